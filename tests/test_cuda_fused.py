"""The fused steps' CUDA kernels on a GPU (``pytest -m gpu``), for both exchanges.

The same W-ranks-in-one-process cases as ``tests/test_ops.py`` (``tests/_fused_cases.py``), run
with CUDA tensors through ``torch.ops.syncbn`` and compared with the CPU operators on the same
values: uneven and empty ranks, channels-first and channels-last, every input dtype, count-weighted
and equal rank weights, the reduce merge given all-reduced or gathered vectors, and a shape whose
channels span many blocks. At ``|mean| / std = 1e4`` both exchanges are checked against a float64
oracle. ``tests/test_cuda_emu_fused.py`` runs the same kernels under CPU emulation.
"""

from __future__ import annotations

import pytest
import torch
from _fused_cases import (
    FUSED_SHAPES,
    channels_last,
    compare,
    float64_errors,
    rank_inputs,
    run_fused,
    to_cpu,
)

from syncbn_lightning.ops.build import load_extension

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# The CPU cases, and one whose planes span many blocks of the GPU reductions.
GPU_SHAPES = [*FUSED_SHAPES, ([3, 0, 5], 32, (37, 41))]
EXCHANGES = ["gather", "reduce", "reduce_gathered"]


@pytest.fixture(scope="module")
def ops():
    assert load_extension().with_cuda, "the extension was built without its CUDA kernels"
    return torch.ops.syncbn


def _cuda(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.cuda() for x in xs]  # strides kept: channels-last stays channels-last


@pytest.mark.parametrize("equal", [False, True])
@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize(("sizes", "channels", "spatial"), GPU_SHAPES)
def test_cuda_fused_kernels_match_cpu_operators(
    ops, sizes, channels, spatial, dtype, exchange, equal
) -> None:
    xs = rank_inputs(sizes, channels, spatial, dtype, seed=len(sizes) * 100 + channels)
    options = {"exchange": exchange, "equal_rank_weights": equal}
    for layout in (xs, channels_last(xs)):
        compare(
            to_cpu(run_fused(ops, _cuda(layout), **options)),
            run_fused(ops, layout, **options),
            TOLERANCE[dtype],
        )


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_cuda_large_offsets_against_a_float64_oracle(ops, exchange: str, layout: str) -> None:
    """|mean| / std = 1e4, first step (running mean 0): every result within 1e-5 of float64."""
    gen = torch.Generator().manual_seed(9)
    xs = [torch.randn(n, 4, 30, 33, generator=gen, dtype=torch.float64) + 1e4 for n in (3, 0, 2)]
    if layout == "cl":
        xs = channels_last(xs)
    results = run_fused(ops, _cuda([x.float() for x in xs]), exchange=exchange, momentum=1.0)
    worst = float64_errors(to_cpu(results), xs)
    assert max(worst.values()) <= 1e-5, worst
