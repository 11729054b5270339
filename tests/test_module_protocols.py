"""torch's module protocols on a synchronized layer: what users do to ``nn.BatchNorm2d`` works on
ours and computes the same, on the C++ path and the Python path.

* ``torch.nn.utils.prune`` (network slimming prunes channels by their BN scales): the weight
  becomes a plain attribute recomputed by a forward pre-hook, ``weight_orig`` the Parameter;
* ``torch.nn.utils.parametrize``: the weight becomes a property of a new class;
* ``torch.func.functional_call``: the Parameters swapped for other tensors for one call;
* a forward pre-hook that edits the input;
* ``torch.fx``: a converted model traces with our layers as ``call_module`` nodes (fx's default
  tracer keeps ``torch.nn.SyncBatchNorm`` whole too), and torchvision's
  ``create_feature_extractor`` builds an FPN-style backbone from a converted ResNet.

Each is compared on 2 gloo ranks with uneven batches, in float64, against ``nn.BatchNorm2d``
under the same protocol on the concatenated batch: outputs, input gradients, the summed
gradients of the leaf Parameters, running stats. The tests assert which path ran (the C++
path's autograd node is ``syncbn::SyncBatchNormBackward``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx
from _dist import run_distributed
from _timm import import_timm
from torch import nn
from torch.nn.utils import parametrize, prune

from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm

SIZES = [3, 2]  # uneven batches on 2 ranks
C = 6


class _Softplus(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return nn.functional.softplus(w)


def _prune(layer: nn.Module) -> list[torch.Tensor]:
    prune.l1_unstructured(layer, "weight", 0.5)
    return [layer.weight_orig, layer.bias]


def _parametrize(layer: nn.Module) -> list[torch.Tensor]:
    parametrize.register_parametrization(layer, "weight", _Softplus())
    return [layer.parametrizations.weight.original, layer.bias]


def _pre_hook(layer: nn.Module) -> list[torch.Tensor]:
    layer.register_forward_pre_hook(lambda _m, args: (args[0] * 2 + 1,))
    return [layer.weight, layer.bias]


def _functional(layer: nn.Module) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    w = (torch.rand(C, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(C, generator=g, dtype=torch.float64).requires_grad_()
    layer.swapped_affine = {"weight": w, "bias": b}  # what _call passes to functional_call
    return [w, b]


def _call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    swapped = getattr(layer, "swapped_affine", None)
    if swapped is not None:
        return torch.func.functional_call(layer, swapped, (x,))
    return layer(x)


PROTOCOLS: dict[str, Callable[[nn.Module], list[torch.Tensor]]] = {
    "prune": _prune,
    "parametrize": _parametrize,
    "functional_call": _functional,
    "pre_hook": _pre_hook,
}


def _plain() -> nn.BatchNorm2d:
    torch.manual_seed(3)
    bn = nn.BatchNorm2d(C).double()
    with torch.no_grad():
        bn.weight.copy_(torch.randn(C, dtype=torch.float64))  # some small, some negative: prunable
        bn.bias.copy_(torch.randn(C, dtype=torch.float64))
    return bn


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(sum(SIZES), C, 4, 3, generator=g, dtype=torch.float64) * 2 + 1
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def _run(layer: nn.Module, protocol: str, x: torch.Tensor, dy: torch.Tensor) -> dict[str, Any]:
    leaves = PROTOCOLS[protocol](layer)
    x = x.clone().requires_grad_()
    y = _call(layer, x)
    grads = torch.autograd.grad(y, [x, *leaves], dy)
    return {
        "y": y.detach(),
        "grads": grads,
        "running": (layer.running_mean.clone(), layer.running_var.clone()),
        "node": y.grad_fn.name(),
    }


def _protocols_rank(rank: int, world: int, impl: str) -> dict[str, Any]:
    """Every protocol on this rank's part, on a converted layer (C++ path: impl 'ext'; Python
    path: impl 'reference')."""
    x, dy = _data()
    part = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    out = {}
    for protocol in PROTOCOLS:
        layer = convert_sync_batchnorm(nn.Sequential(_plain()), impl=impl)[0]
        assert type(layer) is SyncBatchNorm
        out[protocol] = _run(layer, protocol, x[part], dy[part])
        plan = layer._sync_plan
        out[protocol]["native"] = plan is not None and plan.native
    return out


def _expected(protocol: str) -> dict[str, Any]:
    x, dy = _data()
    return _run(_plain(), protocol, x, dy)


def _assert_matches(ranks: list[dict[str, Any]], protocol: str) -> None:
    expected = _expected(protocol)
    close = {"rtol": 1e-10, "atol": 1e-10}
    y = torch.cat([rank[protocol]["y"] for rank in ranks])
    torch.testing.assert_close(y, expected["y"], **close)
    grad_x = torch.cat([rank[protocol]["grads"][0] for rank in ranks])
    torch.testing.assert_close(grad_x, expected["grads"][0], **close)
    for i, want in enumerate(expected["grads"][1:], start=1):
        summed = sum(rank[protocol]["grads"][i] for rank in ranks)  # what DDP's all-reduce gives
        torch.testing.assert_close(summed, want, **close)
    for rank in ranks:
        for got, want in zip(rank[protocol]["running"], expected["running"], strict=True):
            torch.testing.assert_close(got, want, **close)


@pytest.mark.distributed
@pytest.mark.parametrize(("impl", "native"), [("ext", True), ("reference", False)])
def test_protocols_on_two_ranks_compute_what_batchnorm_computes(impl: str, native: bool) -> None:
    ranks = run_distributed(_protocols_rank, len(SIZES), impl, timeout=180.0)
    for protocol in PROTOCOLS:
        for rank in ranks:
            assert rank[protocol]["native"] is native, protocol
            if native:  # the output's node is the C++ path's
                node = rank[protocol]["node"]
                assert node == "syncbn::SyncBatchNormBackward", node
        _assert_matches(ranks, protocol)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("protocol", ["prune", "parametrize"])
def test_prune_and_parametrize_take_the_cpp_path(one_rank, protocol: str) -> None:
    """The regression: both raised ``KeyError: 'weight'`` on the C++ path (one-rank group,
    ``force_sync``); now they run there and match the Python path."""
    x, dy = _data()
    results = []
    for impl in ("ext", "reference"):
        layer = convert_sync_batchnorm(nn.Sequential(_plain()), impl=impl, force_sync=True)[0]
        results.append(_run(layer, protocol, x, dy))
        assert layer._sync_plan.native is (impl == "ext")
    assert results[0]["node"] == "syncbn::SyncBatchNormBackward", results[0]["node"]
    torch.testing.assert_close(results[0]["y"], results[1]["y"], rtol=1e-10, atol=1e-10)
    for got, want in zip(results[0]["grads"], results[1]["grads"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------------
# torch.func transforms
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_a_synchronizing_call_inside_a_torch_func_transform_names_the_fix(
    one_rank, impl: str, transform: str
) -> None:
    """Wrapped tensors pass the C++ path's type check; inside a transform neither path can run
    (its collective), so both raise the layer's error, not torch's internal one. What the error
    suggests works: the layer in eval mode, under the same transform."""
    layer = convert_sync_batchnorm(nn.Sequential(_plain()), impl=impl, force_sync=True)[0]
    x = torch.randn(2, 3, C, 4, 4, dtype=torch.float64)

    def apply(module: nn.Module) -> Any:
        if transform == "vmap":
            return torch.func.vmap(module)(x)

        def loss(weight: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(module, {"weight": weight}, (x[0],)).sum()

        return torch.func.grad(loss)(module.weight.detach())

    with pytest.raises(RuntimeError, match="cannot synchronize its batch statistics inside a"):
        apply(layer)
    assert torch.equal(layer.num_batches_tracked, torch.tensor(0))
    assert apply(layer.eval()) is not None


# ------------------------------------------------------------------------------------------------
# torch.fx
# ------------------------------------------------------------------------------------------------


def _small_net() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1), nn.BatchNorm2d(C), nn.ReLU(), nn.Conv2d(C, C, 1)
    ).double()


def test_fx_traces_converted_layers_as_call_module_nodes() -> None:
    """As fx records ``torch.nn.SyncBatchNorm``: one ``call_module`` node per layer, which the
    traced module calls (so it computes what the model does); no Proxy reaches the layer's
    input checks."""
    model = convert_sync_batchnorm(_small_net())
    traced = torch.fx.symbolic_trace(model)
    nodes = [(n.op, n.target) for n in traced.graph.nodes if n.op == "call_module"]
    assert ("call_module", "1") in nodes
    assert traced.get_submodule("1") is model[1]
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)
    model.eval()
    torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)


def test_fx_traces_add_act_and_sync_batchnorm_act() -> None:
    from syncbn_lightning import SyncBatchNormAct

    class Tail(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.act = SyncBatchNorm(C).double(), SyncBatchNormAct(C, act="silu").double()
            self.relu = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.bn.add_act(x, x, self.relu))

    block = Tail()
    traced = torch.fx.symbolic_trace(block)
    targets = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert targets == ["bn", "relu", "act"]
    x = torch.randn(3, C, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(traced(x), block(x), rtol=0, atol=0)


def _fx_rank(rank: int, world: int) -> dict[str, Any]:
    x, _ = _data()
    x = x[:, :3]
    part = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    model = convert_sync_batchnorm(_small_net())
    traced = torch.fx.symbolic_trace(model)
    xi = x[part].clone().requires_grad_()
    y = traced(xi)
    grads = torch.autograd.grad(y.square().sum(), [xi, model[1].weight])
    return {"y": y.detach(), "grads": grads, "native": model[1]._sync_plan.native}


@pytest.mark.distributed
def test_an_fx_traced_model_synchronizes_on_two_ranks() -> None:
    ranks = run_distributed(_fx_rank, len(SIZES), timeout=180.0)
    x, _ = _data()
    x = x[:, :3].clone().requires_grad_()
    model = _small_net()
    y = model(x)
    want = torch.autograd.grad(y.square().sum(), [x, model[1].weight])
    assert all(rank["native"] for rank in ranks)
    close = {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks]), y.detach(), **close)
    torch.testing.assert_close(torch.cat([r["grads"][0] for r in ranks]), want[0], **close)
    torch.testing.assert_close(sum(r["grads"][1] for r in ranks), want[1], **close)


def _torchvision() -> Any:
    import_timm()  # puts torchvision where the tests find it (see tests/_timm.py), or skips
    import torchvision.models as models
    from torchvision.models.feature_extraction import create_feature_extractor

    return models, create_feature_extractor


def _extractor_rank(rank: int, world: int) -> dict[str, Any]:
    models, create_feature_extractor = _torchvision()
    torch.manual_seed(0)
    model = convert_sync_batchnorm(models.resnet18(num_classes=4).double())
    extractor = create_feature_extractor(model, {"layer1": "c2", "layer2": "c3"})
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(SIZES), 3, 32, 32, generator=g, dtype=torch.float64)
    part = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    features = extractor(x[part])
    names = {n.target for n in extractor.graph.nodes if n.op == "call_module"}
    return {"features": {k: v.detach() for k, v in features.items()}, "names": names}


@pytest.mark.slow
@pytest.mark.distributed
def test_create_feature_extractor_works_on_a_converted_resnet() -> None:
    """torchvision builds FPN backbones this way: it traces the model with fx and keeps the
    nodes it is asked for. The converted layers are leaves (named as torchvision names
    torch's), and the extracted features are the synchronized ones."""
    models, create_feature_extractor = _torchvision()
    ranks = run_distributed(_extractor_rank, len(SIZES), timeout=240.0)
    torch.manual_seed(0)
    plain = models.resnet18(num_classes=4).double()
    expected_extractor = create_feature_extractor(plain, {"layer1": "c2", "layer2": "c3"})
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(SIZES), 3, 32, 32, generator=g, dtype=torch.float64)
    expected = expected_extractor(x)
    plain_names = {n.target for n in expected_extractor.graph.nodes if n.op == "call_module"}
    for rank in ranks:
        assert rank["names"] == plain_names  # "bn1", "layer1.0.bn1", ...: the same leaves
    for key in ("c2", "c3"):
        got = torch.cat([rank["features"][key] for rank in ranks])
        torch.testing.assert_close(got, expected[key].detach(), rtol=1e-9, atol=1e-9)
