"""timm models converted with :func:`convert_sync_batchnorm`, on 2 gloo ranks, against float64.

timm builds BatchNorm + activation as one module (``timm.layers.BatchNormAct2d``): the converter
must keep the activation (and the drop) as :class:`SyncBatchNormAct`. For each model the oracle is
the unconverted timm model in float64 in one process on the whole batch; each of 2 ranks runs the
converted model in float32 on half of it (the reference kernels, whose arithmetic the C++ and
CUDA kernels share). The outputs, the gradients summed over the ranks and the running statistics
after one training step must match within 1e-4 relative (norm of the difference over the norm of
the oracle, per tensor; see _relative_errors for tensors that are zero in exact arithmetic).
Inputs are smooth (a random image blurred), no dropout; untrained timm weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_distributed
from _timm import import_timm
from torch import nn

from syncbn_lightning import SyncBatchNormAct, convert_sync_batchnorm, revert_sync_batchnorm

MODELS = ("efficientnet_b0", "regnetx_002", "mobilenetv3_small_050", "cspresnet50")
CLASSES, BATCH, SIZE, WORLD = 10, 4, 64, 2
TOLERANCE = 1e-4
FLOOR = 0.05  # see _relative_errors

# Whole timm networks on gloo processes: outside the fast check.
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = import_timm().create_model(
        name, pretrained=False, num_classes=CLASSES, drop_rate=0.0, drop_path_rate=0.0
    )
    return model.train()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """(images, head weights) in float64: the loss is (model(images) * weights).sum()."""
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(BATCH, 3, SIZE, SIZE, generator=g, dtype=torch.float64)
    images = F.avg_pool2d(noise, 5, stride=1, padding=2, count_include_pad=False) * 2
    return images, torch.randn(BATCH, CLASSES, generator=g, dtype=torch.float64)


def _step(model: nn.Module, images: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward/backward: the output, every parameter's gradient and every BN buffer."""
    out = model(images)
    (out * weights).sum().backward()
    result = {"output": out.detach()}
    result.update({f"grad:{n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    result.update({f"buffer:{n}": b for n, b in model.named_buffers() if "running" in n})
    return {k: v.detach().double() for k, v in result.items()}


def _oracle(name: str) -> dict[str, torch.Tensor]:
    images, weights = _data()
    return _step(_model(name).double(), images, weights)


def _rank(rank: int, world: int, name: str) -> dict[str, torch.Tensor]:
    """The rank's _step, gradients summed over the ranks."""
    model = convert_sync_batchnorm(_model(name), impl="reference")
    images, weights = _data()
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    result = _step(model, images[part].float(), weights[part].float())
    for key, value in result.items():
        if key.startswith("grad:"):
            dist.all_reduce(value)
    return result


def _family(key: str) -> str:
    """output, or kind + parameter name (grad:weight, grad:bias, buffer:running_var, ...)."""
    return key.split(":")[0] + ":" + key.rsplit(".", 1)[-1] if ":" in key else key


def _relative_errors(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, float]:
    """|got - want| / max(|want|, FLOOR * the largest |want| of its family), per tensor (norms).

    The floor is for tensors that are zero in exact arithmetic, where the float64 oracle holds
    1e-14 and float32 holds rounding noise: e.g. the bias gradient of a BatchNorm whose output
    feeds the next one only through a linear layer (the next normalization removes any shift).
    """
    largest: dict[str, float] = {}
    for key, value in want.items():
        largest[_family(key)] = max(largest.get(_family(key), 0.0), float(value.norm()))
    return {
        key: float((got[key] - want[key]).norm())
        / max(float(want[key].norm()), FLOOR * largest[_family(key)], 1e-30)
        for key in want
    }


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", MODELS)
def test_converted_timm_model_on_two_ranks_matches_float64_one_process(name: str) -> None:
    want = _oracle(name)
    ranks = run_distributed(_rank, WORLD, name, timeout=240.0)
    got = {"output": torch.cat([r.pop("output") for r in ranks])}
    got.update(ranks[0])
    assert sorted(got) == sorted(want)
    errors = _relative_errors(got, want)
    worst = sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    assert worst[0][1] <= TOLERANCE, f"{name}: largest relative errors {worst}"
    for key in want:  # each rank updated its running statistics from the same group statistics
        if key.startswith("buffer:"):
            torch.testing.assert_close(ranks[1][key], ranks[0][key], rtol=0, atol=0)


def _norm_act_layers(model: nn.Module, cls: type) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if type(m) is cls}


@pytest.mark.parametrize("name", MODELS[:3])
def test_conversion_keeps_act_and_drop_and_revert_gives_timm_class_back(name: str) -> None:
    timm = import_timm()
    original = _model(name)
    before = _norm_act_layers(original, timm.layers.BatchNormAct2d)
    acts = {n: type(m.act) for n, m in before.items()}
    assert before, f"{name} has no BatchNormAct2d"
    images = _data()[0][:2].float()
    with torch.no_grad():
        want = original.eval()(images)
    converted = convert_sync_batchnorm(original)
    after = _norm_act_layers(converted, SyncBatchNormAct)
    assert sorted(after) == sorted(before)
    assert {n: type(m.act) for n, m in after.items()} == acts
    fused = [n for n, m in after.items() if m.fused_activation is not None]
    assert fused, "no activation of the model was fused into the kernels"
    with torch.no_grad():
        torch.testing.assert_close(converted.eval()(images), want, rtol=1e-5, atol=1e-5)
    reverted = revert_sync_batchnorm(converted)
    assert sorted(_norm_act_layers(reverted, timm.layers.BatchNormAct2d)) == sorted(before)
    assert not _norm_act_layers(reverted, SyncBatchNormAct)
    with torch.no_grad():
        torch.testing.assert_close(reverted(images), want, rtol=0, atol=0)


def test_timm_model_state_dict_loads_across_conversion() -> None:
    original = _model("mobilenetv3_small_050")
    state = {k: v.clone() for k, v in original.state_dict().items()}
    converted = convert_sync_batchnorm(_model("mobilenetv3_small_050"))
    assert converted.load_state_dict(state, strict=True)
    assert sorted(converted.state_dict()) == sorted(state)
