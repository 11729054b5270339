"""One settings object: ``SyncOptions`` is validated once, when it is made; the layer, the
converter, the callback and the plugin hand it on without checking it again; a layer's
``momentum``, ``eps``, ``impl``... read it and assigning one makes new, validated options."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from syncbn_lightning import SyncBatchNorm, SyncBNCallback, SyncBNLayerSync, convert_sync_batchnorm
from syncbn_lightning.functional import KEEP, SyncOptions
from syncbn_lightning.functional import options as options_module


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[SyncOptions]:
    """Every SyncOptions the validator sees from here on."""
    seen: list[SyncOptions] = []
    real = options_module._validate

    def counting(options: SyncOptions) -> None:
        seen.append(options)
        real(options)

    monkeypatch.setattr(options_module, "_validate", counting)
    return seen


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=0.3), nn.ReLU(), nn.BatchNorm2d(4)
    )


def test_convert_forward_backward_validate_the_options_once(validations: list) -> None:
    model = convert_sync_batchnorm(_net(), eps=1e-3, impl="reference", force_sync=True)
    x = torch.randn(5, 3, 6, 6, requires_grad=True)
    model(x).square().sum().backward()
    model(x).sum().backward()
    assert len(validations) == 1
    assert [m.momentum for m in (model[1], model[3])] == [0.3, 0.1]  # KEEP: each layer's own
    assert {m.eps for m in (model[1], model[3])} == {1e-3}
    assert model[1].running_mean.abs().sum() > 0


def test_the_callback_and_the_plugin_validate_their_settings_once(validations: list) -> None:
    callback = SyncBNCallback(momentum=0.05, stats_mode="default")
    plugin = SyncBNLayerSync(eps=1e-4, exchange="gather")
    assert len(validations) == 2
    model = plugin.apply(_net())  # no process group: converts, nothing to synchronize
    assert len(validations) == 2
    assert model[1].eps == 1e-4 and model[1].exchange == "gather" and model[1].momentum == 0.3
    assert callback.sync_options.stats_mode == "default" and callback.sync_options.eps is KEEP


def test_a_layer_validates_what_it_is_built_with_once(validations: list) -> None:
    layer = SyncBatchNorm(4, momentum=None, eps=1e-4, stats_mode="default", force_sync=True)
    layer(torch.randn(3, 4, 2)).sum().backward()
    assert len(validations) == 1
    assert (layer.momentum, layer.eps, layer.stats_mode) == (None, 1e-4, "default")


def test_the_layer_attributes_are_views_of_its_options() -> None:
    layer = SyncBatchNorm(4)
    before = layer.sync_options
    layer.momentum = 0.2
    layer.impl = "reference"
    assert layer.sync_options is not before and before.momentum == 0.1
    assert (layer.sync_options.momentum, layer.impl) == (0.2, "ref")
    layer.eps = layer.eps  # the same value: nothing new is made
    assert layer.sync_options.impl == "ref"
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\]"):
        layer.momentum = 2.0
    with pytest.raises(ValueError, match="stats_mode must be 'N'"):
        layer.stats_mode = "mean"
    assert layer.momentum == 0.2  # a refused value leaves the options as they were
    assert "momentum=0.2" in repr(layer) and "impl='ref'" in repr(layer)


def test_options_are_frozen_and_keep_fields_are_overrides() -> None:
    options = SyncOptions(momentum=0.01, impl="reference")
    with pytest.raises(AttributeError):
        options.momentum = 0.5  # type: ignore[misc]
    overrides = SyncOptions(momentum=KEEP, eps=KEEP, stats_mode="default", force_sync=True)
    merged = overrides.apply_to(options)
    assert (merged.momentum, merged.eps, merged.stats_mode, merged.impl) == (
        0.01,
        1e-5,
        "default",
        None,
    )
    merged.check_complete()
    with pytest.raises(ValueError, match="KEEP"):
        overrides.check_complete()
    assert pickle.loads(pickle.dumps(overrides)).momentum is KEEP
    assert copy.deepcopy(merged) == merged


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"eps": 0}, ValueError, r"eps must be a finite float > 0 \(e.g. 1e-5\), got 0"),
        ({"eps": "1e-5"}, TypeError, "eps must be a float > 0, got str"),
        ({"momentum": -0.1}, ValueError, r"momentum must be in \[0, 1\]"),
        ({"impl": "cuda"}, ValueError, "impl='cuda' is not valid"),
        ({"stats_mode": "mean"}, ValueError, "stats_mode must be 'N'"),
        ({"exchange": "ring"}, ValueError, "exchange must be 'gather'"),
    ],
)
def test_invalid_options_name_the_argument(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        SyncOptions(**kwargs)
