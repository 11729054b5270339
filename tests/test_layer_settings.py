"""Per-layer settings passed as arguments: ``impl=`` (which kernels) on the layer, the functional
form, the converter, the callback and the LayerSync plugin; ``momentum``/``eps`` of the converter.

``impl`` is checked by which operators a layer's step dispatches (``syncbn::*`` for the C++
extension, plain aten ops for the reference), with ``SYNCBN_IMPL`` set to the other choice, so
the argument, not the environment, must be what decides.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _lightning import BNNet, quiet_trainer
from torch import nn

from benchmarks._common import OpCounter
from syncbn_lightning import (
    SyncBatchNorm,
    SyncBNCallback,
    SyncBNLayerSync,
    convert_sync_batchnorm,
)
from syncbn_lightning.functional import KEEP, SyncOptions, sync_batch_norm
from syncbn_lightning.nn import precise_bn
from syncbn_lightning.nn.convert import configure_sync_layers
from syncbn_lightning.nn.precise_bn import update_bn_stats


def _namespaces(step: Any) -> set[str]:
    with OpCounter() as counter:
        step()
    return counter.namespaces()


def _layer_step(layer: SyncBatchNorm) -> None:
    x = torch.randn(3, layer.num_features, 5, requires_grad=True)
    layer(x).sum().backward()


@pytest.mark.parametrize(
    ("impl", "env", "fused"), [("ext", "ref", True), ("reference", "ext", False)]
)
def test_layer_impl_overrides_the_environment(
    impl: str, env: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", env)
    layer = SyncBatchNorm(4, force_sync=True, impl=impl)
    assert ("syncbn" in _namespaces(lambda: _layer_step(layer))) is fused
    assert layer.impl == ("ext" if fused else "ref")
    assert f"impl={layer.impl!r}" in repr(layer)


@pytest.mark.parametrize(("env", "fused"), [("ext", True), ("ref", False)])
def test_layer_without_impl_follows_the_environment(
    env: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", env)
    layer = SyncBatchNorm(4, force_sync=True)
    assert layer.impl is None and "impl=" not in repr(layer)
    assert ("syncbn" in _namespaces(lambda: _layer_step(layer))) is fused


def test_functional_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", "ext")
    x = torch.randn(4, 3, 2)
    ref = _namespaces(lambda: sync_batch_norm(x, None, None, 1e-5, None, 1, impl="reference"))
    ext = _namespaces(lambda: sync_batch_norm(x, None, None, 1e-5, None, 1, impl="ext"))
    assert "syncbn" not in ref and "syncbn" in ext
    out_ref = sync_batch_norm(x, None, None, 1e-5, None, 1, impl="reference")[0]
    out_ext = sync_batch_norm(x, None, None, 1e-5, None, 1, impl="ext")[0]
    torch.testing.assert_close(out_ref, out_ext, rtol=1e-5, atol=1e-6)


def _bad_impl_calls() -> dict[str, Any]:
    net = nn.Sequential(nn.BatchNorm1d(2))
    return {
        "SyncBatchNorm": lambda impl: SyncBatchNorm(2, impl=impl),
        "convert_sync_batchnorm": lambda impl: convert_sync_batchnorm(net, impl=impl),
        "SyncBNCallback": lambda impl: SyncBNCallback(impl=impl),
        "SyncBNLayerSync": lambda impl: SyncBNLayerSync(impl=impl),
        "sync_batch_norm": lambda impl: sync_batch_norm(
            torch.randn(2, 2), None, None, 1e-5, None, 1, impl=impl
        ),
    }


@pytest.mark.parametrize("where", sorted(_bad_impl_calls()))
@pytest.mark.parametrize(("impl", "error"), [("cuda", ValueError), (1, TypeError)])
def test_invalid_impl_is_refused_naming_the_argument(where: str, impl: Any, error: type) -> None:
    with pytest.raises(error, match=r"impl.*'auto'.*'ext'.*'reference'"):
        _bad_impl_calls()[where](impl)


def test_converter_sets_momentum_eps_and_impl_of_converted_layers() -> None:
    net = nn.Sequential(nn.BatchNorm2d(3, momentum=0.2, eps=1e-3), nn.BatchNorm1d(3))
    kept = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3, momentum=0.2, eps=1e-3)))
    assert (kept[0].momentum, kept[0].eps, kept[0].impl) == (0.2, 1e-3, None)
    convert_sync_batchnorm(net, momentum=0.05, eps=1e-4, impl="reference")
    for layer in net:
        assert isinstance(layer, SyncBatchNorm)
        assert (layer.momentum, layer.eps, layer.impl) == (0.05, 1e-4, "ref")
    cumulative = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), momentum=None)
    assert cumulative[0].momentum is None


def test_converter_leaves_existing_sync_layers_alone() -> None:
    net = nn.Sequential(SyncBatchNorm(3, momentum=0.3), nn.BatchNorm2d(3))
    convert_sync_batchnorm(net, momentum=0.01, impl="ext")
    assert (net[0].momentum, net[0].impl) == (0.3, None)
    assert (net[1].momentum, net[1].impl) == (0.01, "ext")
    overrides = SyncOptions(
        momentum=KEEP,
        eps=1e-2,
        impl="reference",
        force_sync=True,
        stats_mode=KEEP,
        exchange=KEEP,
        unbiased_running_var=KEEP,
    )
    layers = configure_sync_layers(net, None, overrides)
    assert layers == [net[0], net[1]]
    assert all(bn.eps == 1e-2 and bn.impl == "ref" and bn.force_sync for bn in layers)
    assert (net[0].momentum, net[1].momentum) == (0.3, 0.01)  # KEEP


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"momentum": 1.5}, ValueError, "momentum must be in"),
        ({"momentum": "fast"}, TypeError, "momentum must be a float"),
        ({"eps": 0.0}, ValueError, "eps must be a finite float"),
    ],
)
def test_converter_refuses_bad_overrides(kwargs: dict[str, Any], error: type, pattern: str) -> None:
    net = nn.Sequential(nn.BatchNorm2d(3))
    with pytest.raises(error, match=pattern):
        convert_sync_batchnorm(net, **kwargs)
    assert isinstance(net[0], nn.BatchNorm2d)  # nothing converted


def test_keep_is_the_default_and_reads_as_such() -> None:
    assert repr(KEEP) == "KEEP"


@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_callback_gives_its_impl_to_the_layers(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real single-process Trainer in ``monitor`` mode (converted, forced through the sync
    path): the layers carry the callback's impl, and their steps dispatch accordingly."""
    monkeypatch.setenv("SYNCBN_IMPL", "ref" if impl == "ext" else "ext")
    model = BNNet()
    cb = SyncBNCallback(impl=impl, momentum=0.25, single_process="monitor")
    trainer = quiet_trainer(max_steps=2, callbacks=[cb])
    trainer.fit(model)
    layers = [m for m in model.modules() if isinstance(m, SyncBatchNorm)]
    assert layers and all(bn.impl == cb.impl and bn.momentum == 0.25 for bn in layers)
    layers[0].force_sync = True
    step = _namespaces(lambda: _layer_step(layers[0].train()))
    assert ("syncbn" in step) is (impl == "ext")


def test_precise_bn_uses_the_layers_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    """PreciseBN's statistics use each SyncBatchNorm's own choice (a plain BatchNorm: the
    environment's), and stay exact."""
    asked: list[str | None] = []
    real = precise_bn.ops_for

    def recording(x: torch.Tensor, impl: str | None = None) -> Any:
        asked.append(impl)
        return real(x, impl)

    monkeypatch.setattr(precise_bn, "ops_for", recording)
    net = nn.Sequential(SyncBatchNorm(3, impl="reference"), nn.BatchNorm1d(3))
    data = [torch.randn(4, 3, 5) for _ in range(3)]
    update_bn_stats(net, data, num_batches=3)
    assert asked == ["ref", None] * 3
    full = torch.cat(data)
    torch.testing.assert_close(net[0].running_mean, full.mean((0, 2)), rtol=1e-5, atol=1e-6)
