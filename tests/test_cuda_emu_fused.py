"""The fused steps' CUDA kernels (``csrc/entry_cuda.cu``) under SIMT emulation, against the CPU
operators: header and merge-update kernels, the reductions writing into the gathered rows,
running-statistic updates (momentum, cumulative, half-precision buffers, non-finite skips) and the
device-side call-order flag. Every output is poisoned first, so an element no thread writes fails.
"""

from __future__ import annotations

import pytest
import torch
from _fused_cases import FUSED_SHAPES, channels_last, compare, rank_inputs, run_fused
from cuda_emu.build import load_emulator

from syncbn_lightning.ops.activations import ACTIVATIONS
from syncbn_lightning.ops.build import load_extension

# Needs the emulation build (minutes on 2 cores): outside the fast check.
pytestmark = [pytest.mark.cuda_emu, pytest.mark.slow]

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def emu():
    load_extension()
    module = load_emulator()
    yield module
    module.set_schedule("forward", 0)


@pytest.fixture
def clean(emu):
    emu.take_diagnostics()
    emu.take_stats()
    yield emu
    assert emu.take_diagnostics() == []


@pytest.mark.parametrize(
    ("dtype", "order"),
    [(d, "forward") for d in TOLERANCE] + [(torch.float32, "reverse"), (torch.float32, "random")],
)
@pytest.mark.parametrize(("sizes", "channels", "spatial"), FUSED_SHAPES)
def test_fused_kernels_match_cpu_operators(clean, sizes, channels, spatial, dtype, order) -> None:
    clean.set_schedule(order, 3)
    xs = rank_inputs(sizes, channels, spatial, dtype, seed=channels)
    for layout in (xs, channels_last(xs)):
        compare(run_fused(clean, layout), run_fused(torch.ops.syncbn, layout), TOLERANCE[dtype])
    assert clean.take_stats()["launches"] > 0


@pytest.mark.parametrize("act", [a.code for a in ACTIVATIONS if a.code])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_activation_kernels_match_cpu_operators(clean, act, dtype) -> None:
    """The normalize, reduction and elementwise kernels with each activation fused, both layouts,
    vectorized (C = 8) and not (C = 5), against the CPU operators."""
    param = 0.2 if ACTIVATIONS[act].name == "leaky_relu" else 0.0
    for sizes, channels, spatial in (([2, 0, 3], 5, (3, 7)), ([3, 2], 8, (2, 8))):
        xs = rank_inputs(sizes, channels, spatial, dtype, seed=act)
        for layout in (xs, channels_last(xs)):
            compare(
                run_fused(clean, layout, act=act, act_param=param),
                run_fused(torch.ops.syncbn, layout, act=act, act_param=param),
                TOLERANCE[dtype],
            )


@pytest.mark.parametrize(
    ("momentum", "running_dtype", "affine"),
    [(None, torch.float32, True), (0.3, torch.float16, False), (1.0, torch.float64, True)],
)
def test_running_statistics_options(clean, momentum, running_dtype, affine) -> None:
    xs = rank_inputs([2, 0, 3], 6, (4,), torch.float32, seed=5)
    options = {"momentum": momentum, "running_dtype": running_dtype, "affine": affine}
    compare(
        run_fused(clean, xs, **options),
        run_fused(torch.ops.syncbn, xs, **options),
        2e-3 if running_dtype == torch.float16 else 1e-5,
    )


def test_nonfinite_batch_skips_the_update(clean) -> None:
    xs = rank_inputs([2, 2], 3, (4,), torch.float32, seed=6)
    xs[0][1, 2, 3] = float("inf")
    got, want = run_fused(clean, xs), run_fused(torch.ops.syncbn, xs)
    for g, w in zip(got, want, strict=True):
        assert float(g["info"][3]) == 0.0 and int(g["nonfinite"]) == 1
        assert torch.equal(g["running_mean"], w["running_mean"])
        assert int(g["num_batches_tracked"]) == int(w["num_batches_tracked"]) == 4


def test_call_order_mismatch_is_flagged_on_the_device(clean) -> None:
    x = torch.randn(2, 3, 4)
    calls = torch.zeros(1, dtype=torch.long)
    rows = torch.cat([clean.stats_row(x, 5, calls), clean.stats_row(x, 6, calls)])
    assert int(calls) == 2 and rows[3].item() == 0 and rows[3 + 10].item() == 1
    info = clean.merge_normalize(x, rows, None, None, None, None, None, None, 0.1, 1e-5, True)[4]
    assert info[2].item() == 0.0  # the CPU operator raises instead (it may read the rows)
    same = torch.cat([clean.stats_row(x, 5, calls.clone()) for _ in range(2)])
    info = clean.merge_normalize(x, same, None, None, None, None, None, None, 0.1, 1e-5, True)[4]
    assert info[2].item() == 1.0
