"""Activation checkpointing (``functional/recompute.py``): a recompute reuses its forward's
statistics, exchanges nothing and updates nothing, on 2 gloo ranks with uneven batches (3 + 2),
float64, against the same steps unchecked: every torch checkpoint (reentrant, non-reentrant,
sequential, FSDP's wrapper), both paths (C++, Python), both exchanges, fused activations and a
fused residual tail; a layer shared by two segments; a second backward of a retained graph;
torch's rule everywhere else; nothing kept beyond the graph."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import pytest
import torch
from _checkpoint_nets import MODES, forward, net, rank_inputs, square_loss, steps
from _dist import run_distributed
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from syncbn_lightning import SyncBatchNorm
from syncbn_lightning._compat import NON_REENTRANT_KEEPS
from syncbn_lightning.functional.recompute import Kept, RecomputeOrderError

SIZES = [3, 2]
PATHS = {"cpp": "ext", "python": "ref"}  # SYNCBN_IMPL: the C++ path, the Python path


def _compare(checked: dict[str, Any], plain: dict[str, Any]) -> dict[str, float]:
    """The largest differences between a checkpointed run and the unchecked one."""

    def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))

    buffers = [k for k in plain["buffers"] if "num_batches" not in k]
    return {
        "outputs": worst(checked["outputs"], plain["outputs"]),
        "input_grads": worst(checked["input_grads"], plain["input_grads"]),
        "param_grads": worst(checked["param_grads"], plain["param_grads"]),
        "buffers": worst(
            [checked["buffers"][k] for k in buffers], [plain["buffers"][k] for k in buffers]
        ),
    }


def _matrix_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    inputs = rank_inputs(rank, SIZES, 3)
    for path, impl in PATHS.items():
        os.environ["SYNCBN_IMPL"] = impl
        for exchange in ("gather", "reduce"):
            plain = steps(net(exchange), "plain", inputs, square_loss)
            for mode in MODES[1:]:
                checked = steps(net(exchange), mode, inputs, square_loss)
                tracked = {k: int(v) for k, v in checked["buffers"].items() if "num_batches" in k}
                out[(path, exchange, mode)] = {
                    **_compare(checked, plain),
                    "tracked": tracked,
                    "collectives": checked["collectives"],
                    "plain_collectives": plain["collectives"],
                    "bitwise": all(
                        torch.equal(a, b)
                        for a, b in zip(checked["outputs"], plain["outputs"], strict=True)
                    ),
                }
    return out


@pytest.mark.distributed
def test_a_recompute_repeats_nothing_in_every_checkpoint_path_and_exchange() -> None:
    """3 checkpointed steps equal 3 unchecked ones: outputs bitwise, gradients <= 1e-10,
    running statistics <= 1e-12, num_batches_tracked 3, and per step the same collectives as
    unchecked (one forward and one backward per layer call: 3 + 3). On torch 2.4 a
    non-reentrant checkpoint's forward cannot be found (``_compat.NON_REENTRANT_KEEPS``): its
    recompute exchanges again (a forward collective per recomputed call), and counts nothing
    either."""
    ranks = run_distributed(_matrix_rank, 2, timeout=240.0)
    for rank in ranks:
        assert len(rank) == 2 * 2 * (len(MODES) - 1)
        for case, got in rank.items():
            assert got["bitwise"], case
            assert got["outputs"] <= 1e-12 and got["buffers"] <= 1e-12, (case, got)
            assert got["input_grads"] <= 1e-10 and got["param_grads"] <= 1e-10, (case, got)
            assert set(got["tracked"].values()) == {3}, (case, got["tracked"])
            assert got["plain_collectives"] == [(3, 3)] * 3, (case, got)
            if case[2] in ("reentrant", "wrapper_reentrant") or NON_REENTRANT_KEEPS:
                assert got["collectives"] == [(3, 3)] * 3, (case, got)
            else:  # each recomputed layer exchanges again
                assert all(f > 3 and b == 3 for f, b in got["collectives"]), (case, got)


# ------------------------------------------------------------------------------------------------
# A layer shared by two segments; a retained graph's second backward; torch's rule elsewhere
# ------------------------------------------------------------------------------------------------


def _shared_net() -> nn.Sequential:
    """Three segments for checkpoint_sequential, the first and the third sharing one layer."""
    torch.manual_seed(3)
    shared = SyncBatchNorm(3)
    model = nn.Sequential(
        shared, nn.Conv2d(3, 3, 1), nn.ReLU(), SyncBatchNorm(3), nn.Conv2d(3, 3, 1), shared
    )
    return model.double()


def _shared_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    inputs = rank_inputs(rank, SIZES, 2, seed=9)
    for path, impl in PATHS.items():
        os.environ["SYNCBN_IMPL"] = impl
        plain = steps(_shared_net(), "plain", inputs, square_loss)
        checked_net = _shared_net()
        checked = {"outputs": [], "input_grads": [], "collectives": []}
        for x in inputs:
            x = x.clone().requires_grad_()
            # a list: a Sequential's children() would name the shared layer once
            y = checkpoint_sequential(list(checked_net), 3, x, use_reentrant=False)
            square_loss(y).backward()
            checked["outputs"].append(y.detach())
            checked["input_grads"].append(x.grad)
        checked["param_grads"] = [p.grad.clone() for p in checked_net.parameters()]
        checked["buffers"] = {k: v.clone() for k, v in checked_net.state_dict().items()}
        out[path] = {
            **_compare(checked, plain),
            "tracked": int(checked_net[0].num_batches_tracked),
        }
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_a_layer_shared_by_two_segments_stays_exact() -> None:
    """checkpoint_sequential with 3 segments, one layer in the first and the third: its two
    calls per step recompute from their own statistics (4 updates in 2 steps, as unchecked)."""
    for rank in run_distributed(_shared_rank, 2, timeout=180.0):
        for path, got in rank.items():
            assert got["outputs"] == 0.0 and got["buffers"] <= 1e-12, (path, got)
            assert got["input_grads"] <= 1e-10 and got["param_grads"] <= 1e-10, (path, got)
            assert got["tracked"] == 4, (path, got)


def _retain_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = rank_inputs(rank, SIZES, 1, seed=13)[0]
    for path, impl in PATHS.items():
        os.environ["SYNCBN_IMPL"] = impl
        got = {}
        for mode in ("plain", "reentrant", "non_reentrant"):
            model = net()
            xi = x.clone().requires_grad_()
            y = forward(model, xi, mode)
            loss = square_loss(y)
            loss.backward(retain_graph=True)
            loss.backward()
            got[mode] = [xi.grad, *(p.grad.clone() for p in model.parameters())]
            got[mode + "_tracked"] = int(model[1].num_batches_tracked)
        out[path] = got
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_a_second_backward_of_a_retained_graph_stays_exact() -> None:
    """backward(retain_graph=True), then backward again: each recomputes from the same kept
    statistics (gradients accumulate twice, as unchecked), the layer counts the step once."""
    for rank in run_distributed(_retain_rank, 2, timeout=180.0):
        for path, got in rank.items():
            for mode in ("reentrant", "non_reentrant"):
                worst = max(
                    float((a - b).abs().max()) for a, b in zip(got[mode], got["plain"], strict=True)
                )
                assert worst <= 1e-10, (path, mode, worst)
                assert got[mode + "_tracked"] == 1, (path, mode)


def _torch_rule_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = rank_inputs(rank, SIZES, 1, seed=17)[0]
    for path, impl in PATHS.items():
        os.environ["SYNCBN_IMPL"] = impl
        model = net()
        with torch.no_grad():  # a train-mode forward under no_grad, not a recompute
            model(x)
        once = int(model[1].num_batches_tracked)
        # two checkpointed forwards before one backward: two updates
        y1 = checkpoint(model, x.clone().requires_grad_(), use_reentrant=False)
        y2 = checkpoint(model, x.flip(0).clone().requires_grad_(), use_reentrant=True)
        (square_loss(y1) + square_loss(y2)).backward()
        out[path] = (once, int(model[1].num_batches_tracked))
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_everything_else_keeps_torchs_rule() -> None:
    """A train-mode forward under no_grad counts once; two checkpointed forwards before one
    backward count twice (and their recomputes nothing)."""
    for rank in run_distributed(_torch_rule_rank, 2, timeout=120.0):
        assert rank == {"cpp": (1, 3), "python": (1, 3)}


def _order_rank(rank: int, world: int) -> str:
    model = nn.Sequential(SyncBatchNorm(3), SyncBatchNorm(3)).double()
    flips = iter([False, True])

    def run(x: torch.Tensor) -> torch.Tensor:  # the recompute calls the layers the other way
        first, second = (model[1], model[0]) if next(flips) else (model[0], model[1])
        return second(first(x).relu())

    x = rank_inputs(rank, SIZES, 1)[0].clone().requires_grad_()
    y = checkpoint(run, x, use_reentrant=True)  # (found on every release, 2.4 included)
    try:
        y.sum().backward()
    except RecomputeOrderError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
def test_a_recompute_that_calls_other_layers_raises_on_every_rank() -> None:
    for message in run_distributed(_order_rank, 2, timeout=120.0):
        assert "recompute's synchronized call #1" in message
        assert "same layers on the same shapes in the same order" in message


@pytest.mark.parametrize("impl", ["ext", "reference"])
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_renormalize_is_the_merges_output_bitwise(impl: str, exchange: str) -> None:
    """The recompute's normalize, from the statistics a merge returned, is the merge's output
    bit for bit (float32 channels-last with a fused residual and SiLU; both exchanges)."""
    from syncbn_lightning.ops.build import load_extension
    from syncbn_lightning.ops.reference import steps as reference_steps

    if impl == "ext":
        load_extension()
    steps_ = torch.ops.syncbn if impl == "ext" else reference_steps
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 6, 5, 3, generator=g) * 3 + 2).contiguous(memory_format=torch.channels_last)
    r = torch.randn(4, 6, 5, 3, generator=g).contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(6, generator=g) + 0.5, torch.randn(6, generator=g)
    calls = torch.zeros(1, dtype=torch.long)
    if exchange == "gather":
        rows = torch.cat([steps_.stats_row(x, 1, calls), steps_.stats_row(x[:1], 1, calls * 0)])
        merged = steps_.merge_normalize(
            x, rows, w, b, None, None, None, None, 0.1, 1e-5, True, 3, 0.0, False, r
        )
    else:
        sent = steps_.reduce_sums(x, None, 1, calls, False)
        merged = steps_.reduce_merge_normalize(
            x, sent * 2, sent, w, b, None, None, None, None, 0.1, 1e-5, True, False, 2, 3, 0.0, r
        )
    output, mean, mean_lo, invstd = merged[:4]
    assert torch.equal(steps_.renormalize(x, mean, mean_lo, invstd, w, b, 3, 0.0, r), output)


# ------------------------------------------------------------------------------------------------
# One process: no group; nothing kept beyond the graph
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "sequential"])
def test_a_layer_without_a_group_counts_once_and_recomputes_its_output(mode: str) -> None:
    """No process group: plain BatchNorm's maths, and the recompute updates nothing."""
    plain, checked = net(), net()
    inputs = rank_inputs(0, [4], 3)
    expected = steps(plain, "plain", inputs, square_loss)
    got = steps(checked, mode, inputs, square_loss)
    assert all(torch.equal(a, b) for a, b in zip(got["outputs"], expected["outputs"], strict=True))
    for key, value in expected["buffers"].items():
        assert torch.equal(got["buffers"][key], value), key
    for a, b in zip(got["param_grads"], expected["param_grads"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert int(checked[1].num_batches_tracked) == 3


def _kept_alive() -> int:
    """Kept statistics still alive, given gloo's worker up to 2 s to release the last
    collective's work (a work holds a copy of the thread's saved-tensors hooks, hence the
    checkpoint's frame, until the worker drops it)."""
    deadline = time.monotonic() + 2.0
    while True:
        gc.collect()
        alive = sum(1 for obj in gc.get_objects() if type(obj) is Kept)
        if alive == 0 or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def _growth_rank(rank: int, world: int) -> list[int]:
    model = net()
    x = rank_inputs(rank, SIZES, 1)[0]
    alive = []
    for step in range(100):
        y = checkpoint(model, x.clone().requires_grad_(), use_reentrant=step % 2 == 0)
        if step % 3:  # every third step's backward never runs
            square_loss(y).backward()
        del y
        if step % 10 == 9:
            alive.append(_kept_alive())
    return alive


@pytest.mark.slow
@pytest.mark.distributed
def test_what_a_recompute_takes_is_freed_with_the_graph() -> None:
    """100 steps, a third of them without a backward: nothing kept outlives its graph."""
    for alive in run_distributed(_growth_rank, 2, timeout=180.0):
        assert alive == [0] * 10


def test_kept_statistics_are_per_channel() -> None:
    """What a call keeps is O(C): the merge's statistics, not the input or the gathered rows."""
    captured: list[Kept] = []
    model = nn.Sequential(SyncBatchNorm(3, force_sync=True)).double()
    from syncbn_lightning.functional import recompute

    original = recompute.keep

    def spy(segment: Any, layer: Any, input: torch.Tensor, *stats: Any) -> None:
        original(segment, layer, input, *stats)
        captured.append(segment.__dict__["_syncbn_kept"][-1])

    recompute.keep = spy  # type: ignore[assignment]
    try:
        import syncbn_lightning.functional.layer_call as plan

        plan.keep = spy  # type: ignore[assignment]
        x = torch.randn(6, 3, 8, 8, dtype=torch.float64, requires_grad=True)
        checkpoint(model, x, use_reentrant=True).sum().backward()
    finally:
        recompute.keep = original  # type: ignore[assignment]
        plan.keep = original  # type: ignore[assignment]
    (kept,) = captured
    sizes = [t.numel() for t in kept if isinstance(t, torch.Tensor)]
    assert sum(sizes) <= 4 * 3 + 2 * 8, sizes


def _compiled_rank(rank: int, world: int) -> dict[str, Any]:
    import torch._dynamo

    out: dict[str, Any] = {}
    inputs = rank_inputs(rank, SIZES, 3)
    eager = steps(net(), "plain", inputs, square_loss)
    for setting in ("reuse", "repeat"):
        os.environ["SYNCBN_RECOMPUTE"] = setting
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = net()
        compiled = torch.compile(lambda x, m=model: checkpoint(m, x, use_reentrant=False))
        outputs = []
        for x in inputs:
            x = x.clone().requires_grad_()
            y = compiled(x)
            square_loss(y).backward()
            outputs.append(y.detach())
        got = {
            "outputs": max(
                float((a - b).abs().max()) for a, b in zip(outputs, eager["outputs"], strict=True)
            ),
            "tracked": int(model[1].num_batches_tracked),
            "breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        }
        out[setting] = got
    os.environ.pop("SYNCBN_RECOMPUTE")
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_a_compiled_checkpointed_model_counts_once_without_new_graph_breaks() -> None:
    """torch.compile of a checkpointed model: the layer counts each step once, its outputs are
    eager's, and it breaks the graph exactly where it does with the feature off
    (``SYNCBN_RECOMPUTE=repeat``: torch's behaviour, which counts twice)."""
    for rank in run_distributed(_compiled_rank, 2, timeout=600.0):
        assert rank["reuse"]["tracked"] == 3 and rank["repeat"]["tracked"] == 6, rank
        assert rank["reuse"]["outputs"] <= 1e-12, rank
        assert rank["reuse"]["breaks"] == rank["repeat"]["breaks"], rank


def _fallback_rank(rank: int, world: int) -> dict[str, Any]:
    """Where the forward cannot find its checkpoint (torch 2.4's non-reentrant checkpoint, a
    layout ``_compat.py`` does not recognize: stood in for here), the recompute finds nothing
    kept, exchanges again, and still updates nothing."""
    from syncbn_lightning.functional import recompute

    recompute.checkpoint_forward_segment = lambda: None  # type: ignore[assignment]
    out: dict[str, Any] = {}
    inputs = rank_inputs(rank, SIZES, 2)
    for path, impl in PATHS.items():
        os.environ["SYNCBN_IMPL"] = impl
        plain = steps(net(), "plain", inputs, square_loss)
        model = net()

        checked: dict[str, Any] = {"outputs": [], "input_grads": [], "collectives": []}
        from _checkpoint_nets import collectives_since, flight_records

        for x in inputs:
            before = flight_records()
            x = x.clone().requires_grad_()
            y = checkpoint(model, x, use_reentrant=False)
            square_loss(y).backward()
            checked["collectives"].append(collectives_since(before))
            checked["outputs"].append(y.detach())
            checked["input_grads"].append(x.grad)
        checked["param_grads"] = [p.grad.clone() for p in model.parameters()]
        checked["buffers"] = {k: v.clone() for k, v in model.state_dict().items()}
        out[path] = {
            **_compare(checked, plain),
            "collectives": checked["collectives"],
            "tracked": int(model[1].num_batches_tracked),
        }
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_a_recompute_without_kept_statistics_exchanges_again_and_counts_nothing() -> None:
    for rank in run_distributed(_fallback_rank, 2, timeout=180.0):
        for path, got in rank.items():
            assert got["outputs"] == 0.0 and got["buffers"] <= 1e-12, (path, got)
            assert got["input_grads"] <= 1e-10 and got["param_grads"] <= 1e-10, (path, got)
            assert got["tracked"] == 2, (path, got)
            assert got["collectives"] == [(6, 3)] * 2, (path, got)  # the recompute's 3 again


def test_an_unknown_recompute_setting_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("SYNCBN_RECOMPUTE", "sometimes")
    model, x = net(), rank_inputs(0, [2], 1)[0].requires_grad_()
    with pytest.raises(ValueError, match="SYNCBN_RECOMPUTE='sometimes' is not valid: use reuse"):
        checkpoint(model, x, use_reentrant=False).sum().backward()
