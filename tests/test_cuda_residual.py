"""Fused BatchNorm + residual add + activation on a GPU (``pytest -m gpu``).

The operators with a residual (the two-input normalize kernel, the reduction that writes the
residual's gradient as it sums it) against the CPU operators on the same values
(``tests/_fused_cases.py``: uneven and empty ranks, both layouts, every input dtype, planes
spanning many blocks); a fused torchvision ResNet-18 against the unfused conversion on the GPU;
a fused block's forward + backward captured in a CUDA graph and replayed.
``tests/test_cuda_emu_fused.py`` runs the same kernels under CPU emulation.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _fused_cases import FUSED_SHAPES, channels_last, compare, rank_inputs, run_fused, to_cpu
from test_residual import _torchvision
from torch import nn

from syncbn_lightning import convert_sync_batchnorm
from syncbn_lightning.nn.residual import FUSED_FROM
from syncbn_lightning.ops.build import load_extension

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GPU_SHAPES = [FUSED_SHAPES[1], FUSED_SHAPES[3], ([3, 0, 5], 32, (37, 41)), ([2, 2], 64, (8, 8))]


@pytest.fixture(scope="module")
def ops():
    assert load_extension().with_cuda, "the extension was built without its CUDA kernels"
    return torch.ops.syncbn


@pytest.mark.parametrize("act", [0, 1, 3])  # none, relu, silu
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize(("sizes", "channels", "spatial"), GPU_SHAPES)
def test_cuda_residual_kernels_match_cpu_operators(
    ops, sizes, channels, spatial, dtype, exchange, act
) -> None:
    xs = rank_inputs(sizes, channels, spatial, dtype, seed=channels + act)
    options = {"exchange": exchange, "act": act, "residual": True}
    for layout in (xs, channels_last(xs)):
        compare(
            to_cpu(run_fused(ops, [x.cuda() for x in layout], **options)),
            run_fused(ops, layout, **options),
            TOLERANCE[dtype],
        )


def _resnet18s(memory: torch.memory_format) -> dict[str, nn.Module]:
    """ResNet-18 converted unfused and fused (same weights), on the GPU in ``memory``."""
    torch.manual_seed(0)
    model = _torchvision().models.resnet18(weights=None, num_classes=10)
    out = {}
    for fuse in (False, True):
        net = convert_sync_batchnorm(
            copy.deepcopy(model), force_sync=True, impl="ext", fuse_residual=fuse
        )
        assert sum(hasattr(type(m), FUSED_FROM) for m in net.modules()) == (8 if fuse else 0)
        out["fused" if fuse else "unfused"] = net.cuda().to(memory_format=memory).train()
    return out


def _step(model: nn.Module, x: torch.Tensor, bf16: bool) -> list[torch.Tensor]:
    """The output and every parameter gradient of one forward + backward, in float32."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = model(x)
    out.float().square().sum().backward()
    return [out.float(), *(p.grad.float() for p in model.parameters())]


def _errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [
        float((g - w).norm() / max(float(w.norm()), 1e-6)) for g, w in zip(got, want, strict=True)
    ]


def test_cuda_fused_resnet18_matches_the_unfused_conversion_in_float32(ops) -> None:
    nets = _resnet18s(torch.contiguous_format)
    x = torch.randn(8, 3, 64, 64, device="cuda")
    want, got = _step(nets["unfused"], x, False), _step(nets["fused"], x, False)
    assert max(_errors(got, want)) <= 1e-4


def test_cuda_fused_resnet18_in_bfloat16_is_as_close_to_float32_as_unfused(ops) -> None:
    """bf16 autocast, channels-last: the fused tail rounds once (BN, add and ReLU in float32)
    where the unfused one rounds after BN and after the add, so the two bf16 runs differ by bf16
    noise, which a random network's backward amplifies; the fused run must be no further from
    the float32 run than the unfused one (per tensor, relative norm)."""
    x = torch.randn(8, 3, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last)
    reference = _step(_resnet18s(torch.channels_last)["unfused"], x, False)
    nets = _resnet18s(torch.channels_last)
    unfused = _errors(_step(nets["unfused"], x, True), reference)
    fused = _errors(_step(nets["fused"], x, True), reference)
    assert max(unfused) < 0.5, unfused  # bf16, not garbage
    worse = [
        (i, f, u) for i, (f, u) in enumerate(zip(fused, unfused, strict=True)) if f > 1.5 * u + 1e-3
    ]
    assert not worse, worse


def test_cuda_graph_captures_a_fused_block(ops) -> None:
    """A fused BasicBlock's forward + backward in one CUDA graph: replays equal eager steps."""
    torch.manual_seed(0)
    block = _torchvision().models.resnet.BasicBlock(16, 16)
    block = convert_sync_batchnorm(block, force_sync=True, impl="ext", fuse_residual=True).cuda()
    x = torch.randn(4, 16, 12, 12, device="cuda", requires_grad=True)
    dy = torch.randn(4, 16, 12, 12, device="cuda")
    params = [x, *block.parameters()]
    eager = torch.autograd.grad(block(x), params, dy)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            torch.autograd.grad(block(x), params, dy)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.autograd.grad(block(x), params, dy)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
