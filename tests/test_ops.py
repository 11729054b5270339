"""The ``syncbn::`` operators (CPU kernels) against their pure-PyTorch twins
(``syncbn_lightning.ops.reference.steps``), for both exchanges.

Each case plays W ranks in one process (``tests/_fused_cases.py``): uneven and empty batches,
channels-first and channels-last, every input dtype, running statistics in float32, float16 or
float64, momentum or the cumulative average, count-weighted or equal rank weights. At
``|mean| / std = 1e4`` both exchanges are checked against a float64 oracle.
``torch.library.opcheck`` checks every operator's schema, fake implementation and dispatch
registration.
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

from syncbn_lightning.ops.activations import ACTIVATIONS
from syncbn_lightning.ops.build import load_extension
from syncbn_lightning.ops.dispatch import uses_extension
from syncbn_lightning.ops.reference import steps as reference

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Every fused activation, leaky_relu with a slope of its own.
ACTS = [(a.code, 0.2 if a.name == "leaky_relu" else 0.0) for a in ACTIVATIONS if a.code]


@pytest.fixture(scope="module")
def ops():
    load_extension()
    assert uses_extension("cpu")
    return torch.ops.syncbn


EXCHANGES = [("gather", False), ("reduce", False), ("gather", True), ("reduce", True)]
EXCHANGE_IDS = ["gather", "reduce", "gather-equal", "reduce-equal"]


@pytest.mark.parametrize(("exchange", "equal"), EXCHANGES, ids=EXCHANGE_IDS)
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize(("sizes", "channels", "spatial"), FUSED_SHAPES)
def test_operators_match_reference(ops, sizes, channels, spatial, dtype, exchange, equal) -> None:
    xs = rank_inputs(sizes, channels, spatial, dtype, seed=len(sizes) * 100 + channels)
    options = {"exchange": exchange, "equal_rank_weights": equal}
    for layout in (xs, channels_last(xs)):
        compare(
            run_fused(ops, layout, **options),
            run_fused(reference, layout, **options),
            TOLERANCE[dtype],
        )


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
@pytest.mark.parametrize(("act", "act_param"), ACTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("sizes", "channels", "spatial"), [FUSED_SHAPES[1], FUSED_SHAPES[3]])
def test_fused_activations_match_reference(
    ops, sizes, channels, spatial, dtype, act, act_param, exchange
) -> None:
    xs = rank_inputs(sizes, channels, spatial, dtype, seed=act)
    for layout in (xs, channels_last(xs)):
        fused = {"act": act, "act_param": act_param, "exchange": exchange}
        for affine in (True, False):
            compare(
                run_fused(ops, layout, affine=affine, **fused),
                run_fused(reference, layout, affine=affine, **fused),
                TOLERANCE[dtype],
            )


def test_unknown_activation_is_refused_before_any_update(ops) -> None:
    x = torch.randn(3, 2, 4)
    rows = ops.stats_row(x, 1, torch.zeros(1, dtype=torch.long))
    mean, invstd = torch.zeros(2), torch.ones(2)
    for impl in (ops, reference):
        tracked = torch.zeros((), dtype=torch.long)
        args = (x, rows, None, None, torch.zeros(2), torch.ones(2), tracked, None, 0.1, 1e-5, True)
        with pytest.raises(RuntimeError, match="`act` must be an activation code in"):
            impl.merge_normalize(*args, len(ACTIVATIONS), 0.0)
        sent = impl.reduce_sums(x, None, 1, torch.zeros(1, dtype=torch.long), False)
        with pytest.raises(RuntimeError, match="`act` must be an activation code in"):
            impl.reduce_merge_normalize(
                x,
                sent,
                sent,
                None,
                None,
                torch.zeros(2),
                torch.ones(2),
                tracked,
                None,
                0.1,
                1e-5,
                True,
                False,
                1,
                len(ACTIVATIONS),
                0.0,
            )
        assert int(tracked) == 0
        with pytest.raises(RuntimeError, match="`act_param` must be finite"):
            impl.grad_sums(x, x, mean, invstd, None, None, 2, float("nan"))


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
@pytest.mark.parametrize(
    ("momentum", "running_dtype", "affine"),
    [(None, torch.float32, True), (0.3, torch.float16, False), (1.0, torch.float64, True)],
)
def test_running_statistics_options_match_reference(
    ops, momentum, running_dtype, affine, exchange
) -> None:
    xs = rank_inputs([2, 3], 6, (4,), torch.float32, seed=5)
    options = {
        "momentum": momentum,
        "running_dtype": running_dtype,
        "affine": affine,
        "exchange": exchange,
    }
    got, want = run_fused(ops, xs, **options), run_fused(reference, xs, **options)
    compare(got, want, 2e-3 if running_dtype == torch.float16 else 1e-5)
    assert int(got[0]["num_batches_tracked"]) == 5 and int(got[0]["calls"]) == 3


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_nonfinite_batch_skips_the_update_and_counts_it(ops, exchange) -> None:
    xs = rank_inputs([2, 2], 3, (4,), torch.float32, seed=6)
    xs[1][0, 1, 0] = float("nan")
    for impl in (ops, reference):
        results = run_fused(impl, xs, exchange=exchange)
        for r in results:
            assert float(r["info"][3]) == 0.0  # finite flag
            assert int(r["nonfinite"]) == 1 and int(r["num_batches_tracked"]) == 4
            # left untouched, i.e. still the values the state was made with
            assert (
                torch.isfinite(r["running_mean"]).all() and torch.isfinite(r["running_var"]).all()
            )


def test_call_order_mismatch_raises_in_the_merge(ops) -> None:
    x = torch.randn(2, 3, 4)
    calls = torch.zeros(1, dtype=torch.long)
    rows = torch.cat([ops.stats_row(x, 5, calls), ops.stats_row(x, 6, calls)])
    for impl in (ops, reference):
        with pytest.raises(RuntimeError, match=r"syncbn call order:.*layer tag 5.*layer tag 6"):
            impl.merge_normalize(x, rows, None, None, None, None, None, None, 0.1, 1e-5, True)


@pytest.mark.parametrize("equal", [False, True])
def test_reduce_merge_sums_gathered_vectors_as_the_all_reduce_would(ops, equal) -> None:
    """CPU groups of up to 8 ranks all-gather the reduce vectors (collectives.sum_over_group):
    the merge sums them in rank order and gives what it gives for their all-reduced sum."""
    xs = rank_inputs([2, 0, 3, 1], 5, (3, 4), torch.float32, seed=8)
    want = run_fused(reference, xs, exchange="reduce", equal_rank_weights=equal)
    for impl in (ops, reference):
        got = run_fused(impl, xs, exchange="reduce_gathered", equal_rank_weights=equal)
        compare(got, want, 1e-6)
    x = xs[0]
    sent = ops.reduce_sums(x, None, 1, torch.zeros(1, dtype=torch.long), False)
    for bad in (torch.cat([sent, sent[:3]]), sent[:-1]):
        with pytest.raises(RuntimeError, match=r"`total` may hold R such vectors"):
            ops.reduce_merge_normalize(
                x, bad, sent, None, None, None, None, None, None, 0.1, 1e-5, True, False, 2
            )


def test_reduce_checks_raise_in_the_merge(ops) -> None:
    """The summed tag chunks (a layer or call differs) and running-mean fingerprints (another
    shift) must be world_size times this rank's; a mismatch names the layer or the means."""
    x = torch.randn(2, 3, 4)
    shift, other = torch.zeros(3), torch.full((3,), 0.5)

    def merge(impl, total: torch.Tensor, sent: torch.Tensor) -> None:
        running = (shift.clone(), torch.ones(3), None, None)
        impl.reduce_merge_normalize(x, total, sent, None, None, *running, 0.1, 1e-5, True, False, 2)

    for impl in (ops, reference):
        sent = impl.reduce_sums(x, shift, 5, torch.zeros(1, dtype=torch.long), False)
        for total, pattern in (
            (
                sent + impl.reduce_sums(x, shift, 6, torch.zeros(1, dtype=torch.long), False),
                r"syncbn call order: the ranks' layer or call tags differ \(this rank: layer tag 5 "
                r"call #1\)",
            ),
            (
                sent + impl.reduce_sums(x, other, 5, torch.zeros(1, dtype=torch.long), False),
                "hold different running_mean buffers",
            ),
        ):
            with pytest.raises(RuntimeError, match=pattern):
                merge(impl, total, sent)
    with pytest.raises(RuntimeError) as raised:  # the C++ message is Python's SHIFT_MISMATCH
        merge(ops, total, sent)
    assert str(raised.value).startswith(reference.SHIFT_MISMATCH)


def test_one_value_per_channel_in_the_whole_group_raises(ops) -> None:
    x, empty = torch.randn(1, 3), torch.randn(0, 3)
    calls = torch.zeros(1, dtype=torch.long)
    rows = torch.cat([ops.stats_row(x, 1, calls.clone()), ops.stats_row(empty, 1, calls.clone())])
    for impl in (ops, reference):
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            impl.merge_normalize(x, rows, None, None, None, None, None, None, 0.1, 1e-5, True)
        sums = [impl.reduce_sums(t, None, 1, calls.clone(), False) for t in (x, empty)]
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            impl.reduce_merge_normalize(
                x,
                sums[0] + sums[1],
                sums[0],
                None,
                None,
                None,
                None,
                None,
                None,
                0.1,
                1e-5,
                True,
                False,
                2,
            )


def test_bad_arguments_name_the_argument(ops) -> None:
    x = torch.randn(2, 3, 4)
    with pytest.raises(RuntimeError, match="`calls` must be a one-element int64"):
        ops.stats_row(x, 1, torch.zeros(1))
    row = ops.stats_row(x, 1, torch.zeros(1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="`rows` must be the gathered 1-D buffer"):
        ops.merge_normalize(x, row[:-1], None, None, None, None, None, None, 0.1, 1e-5, True)


@pytest.mark.slow
def test_opcheck_schemas_fakes_and_registrations(ops) -> None:
    for layout in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(3, 4, 5, 2).contiguous(memory_format=layout)
        w, b = torch.rand(4) + 0.5, torch.randn(4)
        calls = torch.zeros(1, dtype=torch.long)
        torch.library.opcheck(ops.stats_row.default, (x, 3, calls))
        rows = torch.cat([ops.stats_row(x, 3, calls.clone()) for _ in range(2)])
        state = (
            torch.zeros(4),
            torch.ones(4),
            torch.zeros((), dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
        )
        torch.library.opcheck(
            ops.merge_normalize.default, (x, rows, w, b, *state, None, 1e-5, True)
        )
        output, mean, lo, invstd, _var, _info, info = ops.merge_normalize(
            x, rows, w, b, None, None, None, None, 0.1, 1e-5, True
        )
        dy = torch.randn_like(output)
        torch.library.opcheck(ops.grad_sums.default, (dy, x, mean, invstd, w))
        torch.library.opcheck(ops.grad_sums.default, (dy, x, mean, invstd, w, b, 0, 0.0, lo, info))
        sums = torch.cat([ops.grad_sums(dy, x, mean, invstd, w, None, 0, 0.0, None, info)[0]] * 2)
        torch.library.opcheck(ops.grad_input.default, (dy, x, mean, invstd, w, sums, info))
        torch.library.opcheck(
            ops.grad_input.default, (dy, x, mean, invstd, w, sums, info, b, 0, 0.0, lo)
        )
        torch.library.opcheck(
            ops.grad_input.default,
            (dy, x, mean, invstd, w, sums.view(2, -1).sum(0), info),
            {"world_size": 2},  # one all-reduced row of two ranks' sums
        )
        sent = ops.reduce_sums(x, state[0], 3, calls.clone(), False)
        torch.library.opcheck(ops.reduce_sums.default, (x, state[0], 3, calls.clone(), True))
        torch.library.opcheck(
            ops.reduce_merge_normalize.default,
            (x, sent * 2, sent, w, b, *state, None, 1e-5, True, False, 2),
        )
        # With a fused activation (silu): the same outputs, the extra arguments traced too.
        torch.library.opcheck(
            ops.merge_normalize.default, (x, rows, w, b, *state, None, 1e-5, True, 3, 0.0)
        )
        torch.library.opcheck(ops.grad_sums.default, (dy, x, mean, invstd, w, b, 3, 0.0))
        torch.library.opcheck(
            ops.grad_input.default, (dy, x, mean, invstd, w, sums, info, b, 3, 0.0)
        )
        # With a fused residual (relu): the residual's layout may differ from the input's.
        r = torch.randn(x.shape)
        torch.library.opcheck(
            ops.merge_normalize.default,
            (x, rows, w, b, *state, None, 1e-5, True, 1, 0.0, False, r),
        )
        torch.library.opcheck(
            ops.reduce_merge_normalize.default,
            (x, sent * 2, sent, w, b, *state, None, 1e-5, True, False, 2, 1, 0.0, r),
        )
        torch.library.opcheck(
            ops.grad_sums_residual.default, (dy, x, mean, invstd, w, b, r, 1, 0.0, lo, info)
        )
        torch.library.opcheck(ops.grad_sums_residual.default, (dy, x, mean, invstd, None, None, r))


def test_the_layer_backwards_fake_gives_no_input_gradient_where_the_kernel_gives_none(ops) -> None:
    """``sync_batch_norm_backward`` with ``input_grad=False`` (a layer whose input needs no
    gradient) returns no input gradient: the fake kernel says so too, for compiled code."""
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    w, b = torch.rand(4, dtype=torch.float64) + 0.5, torch.randn(4, dtype=torch.float64)
    state = [torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)]
    counters = [torch.zeros(1, dtype=torch.long) for _ in range(3)]
    group = {"group": None, "world_size": 1, "layer_tag": 7, "queue_order_flags": False}
    settings = {
        **group,
        **{"reduce": False, "momentum": 0.1, "eps": 1e-5, "unbiased": True},
        **{"equal_rank_weights": False, "act": 0, "act_param": 0.0, "num_features": 4},
        **{"kept": None, "kept_call": -1, "keep": False, "prior": None},  # a plain call
    }
    out = ops.sync_batch_norm_forward.default(x, w, b, *state, *counters, None, **settings)
    for residual in (None, torch.randn_like(x)):
        args = (torch.randn_like(x), x, w, b, residual, out[1], out[4], out[5], out[6])
        kwargs = {**group, "act": 0, "act_param": 0.0, "flight_call": -1, "input_grad": False}
        real = ops.sync_batch_norm_backward.default(*args, **kwargs)
        assert real[0] is None and real[1] is not None
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake = ops.sync_batch_norm_backward.default(
                *(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args),
                **kwargs,
            )
        assert [g is None for g in fake] == [g is None for g in real], residual is None
        torch.library.opcheck(
            ops.sync_batch_norm_backward.default, args, kwargs, test_utils=("test_faketensor",)
        )


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_large_offsets_against_a_float64_oracle(ops, exchange, layout, offset) -> None:
    """|mean| / std = 1e4: outputs, input gradients, the summed parameter gradients and the
    running statistics within 1e-5 of float64 (normwise), on both exchanges, with the running mean
    still 0 (the first step). At 1e6 the gather exchange (float64 local means, split) stays within
    1e-5; the reduce exchange's first step loses 12 of float64's 16 digits to the cancellation
    ``S2/n - (S1/n)^2`` (docs/scaling.md: ~1e-4 measured), bounded here at 1e-3."""
    gen = torch.Generator().manual_seed(9)
    xs = [torch.randn(n, 4, 6, 5, generator=gen, dtype=torch.float64) + offset for n in (3, 0, 2)]
    if layout == "cl":
        xs = channels_last(xs)
    results = run_fused(ops, [x.float() for x in xs], exchange=exchange, momentum=1.0)
    worst = float64_errors(results, xs)
    bound = 1e-3 if (exchange, offset) == ("reduce", 1e6) else 1e-5
    assert max(worst.values()) <= bound, worst
