"""Layer 4 across ranks when something goes wrong: ranks that call their layers in different orders
(every rank raises the same named error, or the collective fails: never a hang) and a batch with
NaN/inf on one rank (running statistics left unchanged and the skip counted). Real gloo ranks.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from _dist import run_distributed
from torch import nn

from syncbn_lightning import CallOrderError, SyncBatchNorm, convert_sync_batchnorm
from syncbn_lightning.distributed.flight.recorder import read_flight_dir, read_layer_names
from syncbn_lightning.distributed.flight.report import describe_flight


def _order_worker(rank: int, world: int, plan: dict[int, list[str]], channels: int) -> str:
    """Run the layers named in ``plan[rank]``, in that order; return the error text or "ok"."""
    torch.manual_seed(0)
    net = convert_sync_batchnorm(
        nn.ModuleDict({"stem": nn.BatchNorm2d(4), "head": nn.BatchNorm2d(channels)})
    )
    try:
        for name in plan[rank]:
            layer = net[name]
            layer(torch.randn(2, layer.num_features, 3, 3))
    except CallOrderError as exc:
        return str(exc)
    return "ok"


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("plan", "rank_0_ran", "rank_1_ran"),
    [
        # rank 1 skips a layer: its first call meets rank 0's first call of another layer
        ({0: ["stem", "head"], 1: ["head"]}, "'stem' (call #1)", "'head' (call #1)"),
        # the same layers in another order
        ({0: ["stem", "head"], 1: ["head", "stem"]}, "'stem' (call #1)", "'head' (call #1)"),
        # a different number of calls of one layer
        (
            {0: ["stem", "stem", "head"], 1: ["stem", "head", "head"]},
            "'stem' (call #2)",
            "'head' (call #1)",
        ),
    ],
    ids=["skipped-layer", "other-order", "extra-call"],
)
@pytest.mark.slow
def test_ranks_calling_layers_out_of_order_all_raise_the_named_error(
    plan: dict[int, list[str]], rank_0_ran: str, rank_1_ran: str
) -> None:
    started = time.monotonic()
    messages = run_distributed(_order_worker, 2, plan, 4, timeout=60, pg_timeout_s=30)
    assert time.monotonic() - started < 30
    for message in messages:  # both ranks, the same error
        assert message.startswith("SyncBatchNorm layers were called in a different order")
        assert f"rank 0 ran {rank_0_ran}; rank 1 ran {rank_1_ran}" in message
        assert "global ranks [0, 1]" in message


@pytest.mark.distributed
@pytest.mark.slow
def test_skipped_layer_of_another_size_ends_in_an_error_not_a_hang() -> None:
    """The payload sizes differ, so the tags cannot be compared: gloo fails the collective."""
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank \d of 2 failed|died without reporting"):
        run_distributed(
            _order_worker, 2, {0: ["stem", "head"], 1: ["head"]}, 8, timeout=60, pg_timeout_s=20
        )
    assert time.monotonic() - started < 50


def _nonfinite_worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(1)
    bn = SyncBatchNorm(3)
    x = torch.randn(4, 3, 5) + 2
    bn(x)  # one finite batch
    before = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    bad = torch.randn(4, 3, 5)
    if rank == 1:
        bad[0, 1, 2] = float("inf")
        bad[3, 0, 0] = float("nan")
    y = bn(bad)
    after = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    bn(torch.randn(4, 3, 5))  # a finite batch afterwards updates again
    return {
        "unchanged": torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]),
        "tracked": (before[2], after[2], int(bn.num_batches_tracked)),
        "skips": int(bn.nonfinite_skips()),
        "output_nan": bool(torch.isnan(y).any()),
        "updated_later": not torch.equal(after[0], bn.running_mean),
        "finite": bool(torch.isfinite(torch.cat([bn.running_mean, bn.running_var])).all()),
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_nan_batch_on_one_rank_leaves_running_stats_unchanged_and_counted() -> None:
    for result in run_distributed(_nonfinite_worker, 2):
        assert result["unchanged"] and result["skips"] == 1
        assert result["tracked"] == (1, 1, 2)  # the skipped update is not counted
        assert result["output_nan"]  # the output propagates NaN like torch's BN
        assert result["updated_later"] and result["finite"]


class _AuxNet(nn.Module):
    """A trunk of two synchronized layers and an auxiliary head with one (``aux``, ``channels``
    wide) that the loss uses on some ranks only."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8))
        self.body = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))
        self.aux = nn.Sequential(nn.Conv2d(8, channels, 1), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.stem(x)
        return self.body(h), self.aux(h)


def _unused_branch_worker(rank: int, world: int, channels: int, report: str) -> str:
    """One step where rank 1's loss leaves the auxiliary head out; returns the error text. The
    flight recorder's report (logged when a collective fails) is appended to ``report``."""
    import logging

    handler = logging.FileHandler(report)
    logging.getLogger("syncbn_lightning.distributed.flight.report").addHandler(handler)
    torch.manual_seed(0)
    net = convert_sync_batchnorm(_AuxNet(channels))
    out, aux = net(torch.randn(2, 3, 4, 4))
    loss = out.square().mean() + (aux.square().mean() if rank == 0 else 0.0)
    try:
        loss.backward()
    except CallOrderError as exc:
        return str(exc)
    finally:
        handler.flush()
    return "ok"


@pytest.mark.distributed
@pytest.mark.slow
def test_a_layer_unused_in_one_ranks_loss_raises_on_every_rank_naming_it(tmp_path) -> None:
    """Equal channel counts: the backward's sums carry the call's tags, so the mismatch is caught
    at the first backward collective, on both ranks, within seconds, with the fix."""
    started = time.monotonic()
    messages = run_distributed(
        _unused_branch_worker, 2, 8, str(tmp_path / "flight.log"), timeout=60, pg_timeout_s=30
    )
    assert time.monotonic() - started < 30
    for message in messages:
        assert message.startswith("The backward passes of SyncBatchNorm layers ran in a different")
        assert "rank 0 ran the backward of 'aux.1' (call #1)" in message
        assert "rank 1 ran the backward of 'body.1' (call #1)" in message
        assert "the output of 'aux.1' was not used in the loss on rank 1" in message
        assert "0 * out.sum()" in message and "eval mode on every rank" in message


@pytest.mark.distributed
@pytest.mark.slow
def test_an_unused_layer_of_another_size_ends_the_ranks_within_seconds_named_by_the_recorder(
    tmp_path,
) -> None:
    """Other channel counts: the payload sizes differ and gloo refuses the collective (it aborts
    a rank whose receive size does not match; the other's collective fails at once). The ranks'
    file-backed flight records survive the abort and name the first collective that differs."""
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank \d of 2 failed|died without reporting"):
        run_distributed(
            _unused_branch_worker,
            2,
            16,
            str(tmp_path / "flight.log"),
            timeout=60,
            pg_timeout_s=30,
            env={"SYNCBN_FLIGHT_DIR": str(tmp_path)},
        )
    assert time.monotonic() - started < 30
    text = describe_flight(read_flight_dir(tmp_path), names=read_layer_names(tmp_path))
    assert "at collective 4 they differ" in text, text
    assert "rank 0: backward all_gather of 'aux.1' (call #1, 192 B)" in text, text
    assert "rank 1: backward all_gather of 'body.1' (call #1, 128 B)" in text, text
