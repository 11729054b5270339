"""The fused steps' CUDA kernels (``csrc/cuda/entry_cuda.cu``, ``csrc/cuda/entry_reduce_cuda.cu``)
under SIMT emulation, against the CPU operators, for both exchanges: header and merge-update
kernels, the reductions writing into the gathered rows or the shifted float64 sums, the split
(hi + lo) group mean, equal rank weights, running-statistic updates (momentum, cumulative,
half-precision buffers, non-finite skips) and the device-side call-order flag. Every output is
poisoned first, so an element no thread writes fails.
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
)
from cuda_emu.build import load_emulator

from syncbn_lightning.ops.activations import ACTIVATIONS
from syncbn_lightning.ops.build import load_extension
from syncbn_lightning.ops.reference.steps import GRAD_HEADER, row_width

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
@pytest.mark.parametrize("equal", [False, True])
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_fused_kernels_match_cpu_operators(
    clean, sizes, channels, spatial, dtype, order, exchange, equal
) -> None:
    clean.set_schedule(order, 3)
    xs = rank_inputs(sizes, channels, spatial, dtype, seed=channels)
    options = {"exchange": exchange, "equal_rank_weights": equal}
    for layout in (xs, channels_last(xs)):
        compare(
            run_fused(clean, layout, **options),
            run_fused(torch.ops.syncbn, layout, **options),
            TOLERANCE[dtype],
        )
    assert clean.take_stats()["launches"] > 0


@pytest.mark.parametrize(("sizes", "channels", "spatial"), FUSED_SHAPES)
def test_reduce_merge_of_gathered_vectors(clean, sizes, channels, spatial) -> None:
    """The reduce merge given every rank's vector (gathered, as in CPU groups) sums them first."""
    xs = rank_inputs(sizes, channels, spatial, torch.float32, seed=channels)
    for layout in (xs, channels_last(xs)):
        compare(
            run_fused(clean, layout, exchange="reduce_gathered"),
            run_fused(torch.ops.syncbn, layout, exchange="reduce_gathered"),
            TOLERANCE[torch.float32],
        )


# Per-channel counts past one block: the reductions split every channel over blocks (NCHW) or
# over the channels-last tiles, and the two-stage fold runs.
BLOCK_SHAPES = [([2, 0, 1], 4, (100, 84)), ([3, 1], 3, (64, 64)), ([1, 2], 33, (16, 16))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("sizes", "channels", "spatial"), BLOCK_SHAPES)
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_fused_kernels_across_block_boundaries(
    clean, sizes, channels, spatial, dtype, exchange
) -> None:
    xs = rank_inputs(sizes, channels, spatial, dtype, seed=len(sizes))
    for layout in (xs, channels_last(xs)):
        compare(
            run_fused(clean, layout, exchange=exchange),
            run_fused(torch.ops.syncbn, layout, exchange=exchange),
            TOLERANCE[dtype],
        )


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_large_offset_keeps_float64_accuracy(clean, exchange) -> None:
    """Activations at 1e4 times their spread: the split mean and the shifted sums keep the
    emulated kernels as close to float64 BatchNorm as the CPU operators (``test_ops``)."""
    xs = [x + 1e4 * 3 for x in rank_inputs([3, 1, 2], 6, (4, 5), torch.float64, seed=9)]
    xs = [x.float() for x in xs]
    options = {"exchange": exchange, "momentum": 1.0}
    got = float64_errors(run_fused(clean, xs, **options), xs)
    want = float64_errors(run_fused(torch.ops.syncbn, xs, **options), xs)
    for key, error in want.items():
        assert got[key] <= max(2 * error, 1e-6), (key, got[key], error)


@pytest.mark.parametrize("act", [a.code for a in ACTIVATIONS if a.code])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_fused_activation_kernels_match_cpu_operators(clean, act, dtype, exchange) -> None:
    """The normalize, reduction and elementwise kernels with each activation fused, both layouts,
    vectorized (C = 8) and not (C = 5), against the CPU operators."""
    options = {
        "act": act,
        "act_param": 0.2 if ACTIVATIONS[act].name == "leaky_relu" else 0.0,
        "exchange": exchange,
    }
    for sizes, channels, spatial in (([2, 0, 3], 5, (3, 7)), ([3, 2], 8, (2, 8))):
        xs = rank_inputs(sizes, channels, spatial, dtype, seed=act)
        for layout in (xs, channels_last(xs)):
            compare(
                run_fused(clean, layout, **options),
                run_fused(torch.ops.syncbn, layout, **options),
                TOLERANCE[dtype],
            )


@pytest.mark.parametrize("act", [0, 1, 3])  # none, relu, silu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_fused_residual_kernels_match_cpu_operators(clean, act, dtype, exchange) -> None:
    """BatchNorm + residual add + activation (the two-input normalize kernel, and the reduction
    writing g = dy * act'(z + r) as it sums it): both layouts, vectorized (C = 8) and not
    (C = 5), an empty rank, per-channel counts past one block, against the CPU operators."""
    options = {"act": act, "exchange": exchange, "residual": True}
    cases = (([2, 0, 3], 5, (3, 7)), ([3, 2], 8, (2, 8)), ([2, 1], 4, (100, 84)))
    for sizes, channels, spatial in cases:
        xs = rank_inputs(sizes, channels, spatial, dtype, seed=act + channels)
        for layout in (xs, channels_last(xs)):
            compare(
                run_fused(clean, layout, **options),
                run_fused(torch.ops.syncbn, layout, **options),
                TOLERANCE[dtype],
            )


@pytest.mark.parametrize(
    ("momentum", "running_dtype", "affine"),
    [(None, torch.float32, True), (0.3, torch.float16, False), (1.0, torch.float64, True)],
)
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_running_statistics_options(clean, momentum, running_dtype, affine, exchange) -> None:
    xs = rank_inputs([2, 0, 3], 6, (4,), torch.float32, seed=5)
    options = {
        "momentum": momentum,
        "running_dtype": running_dtype,
        "affine": affine,
        "exchange": exchange,
    }
    compare(
        run_fused(clean, xs, **options),
        run_fused(torch.ops.syncbn, xs, **options),
        2e-3 if running_dtype == torch.float16 else 1e-5,
    )


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_nonfinite_batch_skips_the_update(clean, exchange) -> None:
    xs = rank_inputs([2, 2], 3, (4,), torch.float32, seed=6)
    xs[0][1, 2, 3] = float("inf")
    got = run_fused(clean, xs, exchange=exchange)
    want = run_fused(torch.ops.syncbn, xs, exchange=exchange)
    for g, w in zip(got, want, strict=True):
        assert float(g["info"][3]) == 0.0 and int(g["nonfinite"]) == 1
        assert torch.equal(g["running_mean"], w["running_mean"])
        assert int(g["num_batches_tracked"]) == int(w["num_batches_tracked"]) == 4


def test_call_order_mismatch_is_flagged_on_the_device(clean) -> None:
    x = torch.randn(2, 3, 4)
    calls = torch.zeros(1, dtype=torch.long)
    rows = torch.cat([clean.stats_row(x, 5, calls), clean.stats_row(x, 6, calls)])
    width = row_width(3)
    assert int(calls) == 2 and rows[3].item() == 0 and rows[3 + width].item() == 1
    info = clean.merge_normalize(x, rows, None, None, None, None, None, None, 0.1, 1e-5, True)[5]
    assert info[2].item() == 0.0  # the CPU operator raises instead (it may read the rows)
    same = torch.cat([clean.stats_row(x, 5, calls.clone()) for _ in range(2)])
    info = clean.merge_normalize(x, same, None, None, None, None, None, None, 0.1, 1e-5, True)[5]
    assert info[2].item() == 1.0


def test_reduce_call_order_mismatch_is_flagged_on_the_device(clean) -> None:
    """Two ranks at different layers: the summed fingerprint differs from the rank's own times
    the world size, and the merge flags it in ``info[2]`` instead of reading the sums."""
    x = torch.randn(2, 3, 4)
    shift = torch.zeros(3)
    sent = [
        clean.reduce_sums(x, shift, tag, torch.zeros(1, dtype=torch.long), False) for tag in (5, 6)
    ]
    total = sent[0] + sent[1]
    merge = [None, None, None, None, None, None, 0.1, 1e-5, True, False, 2]
    assert clean.reduce_merge_normalize(x, total, sent[0], *merge)[5][2].item() == 0.0
    same = sent[0] * 2
    assert clean.reduce_merge_normalize(x, same, sent[0], *merge)[5][2].item() == 1.0


@pytest.mark.parametrize("batch", [2, 0], ids=["batch", "empty"])
def test_backward_call_order_mismatch_is_flagged_on_the_device(clean, batch) -> None:
    """The backward's sums carry the call's tags (header, written by the reduction, or for an empty
    batch by a one-thread kernel) and grad_input checks them in its elementwise kernel: another
    call's sums give ``order_ok`` 0 on the device, gathered or all-reduced, where the CPU operator
    raises; the tags of the merges' ``grad_info`` are the rows' (gather) and the vector's
    (reduce)."""
    x = torch.randn(batch, 3, 4)
    rows = torch.cat(
        [clean.stats_row(torch.randn(2, 3, 4), 9, torch.zeros(1, dtype=torch.long))] * 2
    )
    out = clean.merge_normalize(x, rows, None, None, None, None, None, None, 0.1, 1e-5, True)
    _, mean, mean_lo, invstd, _var, info, grad_info = out
    assert grad_info[4:].tolist() == info[4:].tolist() == [9.0, 0.0]
    sent = clean.reduce_sums(torch.randn(2, 3, 4), None, 9, torch.ones(1, dtype=torch.long), False)
    merged = clean.reduce_merge_normalize(
        x, sent * 2, sent, None, None, None, None, None, None, 0.1, 1e-5, True, False, 2
    )
    assert merged[6][4:].tolist() == [9.0, 1.0]
    dy = torch.randn_like(x)
    other = grad_info.clone()
    other[5] += 1  # the next call of the same layer
    steps = (clean, torch.ops.syncbn)
    sums = {
        (impl, name): impl.grad_sums(dy, x, mean, invstd, None, None, 0, 0.0, mean_lo, tags)[0]
        for impl in steps
        for name, tags in (("own", grad_info), ("other", other))
    }
    for name in ("own", "other"):  # the headers: the same on the device and on the CPU
        device, cpu = sums[(clean, name)], sums[(torch.ops.syncbn, name)]
        assert torch.equal(device[:GRAD_HEADER], cpu[:GRAD_HEADER])
        torch.testing.assert_close(device[GRAD_HEADER:], cpu[GRAD_HEADER:])
    args = (dy, x, mean, invstd, None)
    tail = (grad_info, None, 0, 0.0, mean_lo)
    for name, world, expected in (("own", 2, 1.0), ("other", 2, 0.0)):
        gathered = torch.cat([sums[(clean, "own")], sums[(clean, name)]])
        assert clean.grad_input(*args, gathered, *tail, 1)[1].item() == expected
        reduced = sums[(clean, "own")] + sums[(clean, name)]
        assert clean.grad_input(*args, reduced, *tail, world)[1].item() == expected
        if expected == 0.0:
            with pytest.raises(RuntimeError, match="syncbn call order: backward"):
                torch.ops.syncbn.grad_input(*args, gathered, *tail, 1)
        else:
            assert torch.ops.syncbn.grad_input(*args, gathered, *tail, 1)[1].item() == 1.0


@pytest.mark.parametrize("act", [0, 1, 3])  # none, relu, silu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("residual", [False, True])
def test_renormalize_is_the_merges_output_bitwise(clean, act, dtype, residual) -> None:
    """A checkpoint's recompute (``renormalize``) from the statistics a merge returned gives the
    merge's output bit for bit, both layouts, with a fused activation and residual."""
    g = torch.Generator().manual_seed(act)
    x = torch.randn(3, 5, 4, 6, generator=g).to(dtype) * 2 + 1
    w, b = torch.rand(5, generator=g) + 0.5, torch.randn(5, generator=g)
    if dtype == torch.float64:
        w, b = w.double(), b.double()
    r = torch.randn(3, 5, 4, 6, generator=g).to(dtype) if residual else None
    for layout in (lambda t: t, lambda t: t.contiguous(memory_format=torch.channels_last)):
        xs, rs = layout(x), None if r is None else layout(r)
        calls = torch.zeros(1, dtype=torch.long)
        rows = torch.cat([clean.stats_row(xs, 2, calls), clean.stats_row(xs * 0.5, 2, calls * 0)])
        out, mean, mean_lo, invstd, *_ = clean.merge_normalize(
            xs, rows, w, b, None, None, None, None, 0.1, 1e-5, True, act, 0.0, False, rs
        )
        again = clean.renormalize(xs, mean, mean_lo, invstd, w, b, act, 0.0, rs)
        assert torch.equal(again, out)
        assert again.stride() == out.stride()
