"""The device path of the call-order check, run on gloo ranks with CPU tensors.

On CUDA tensors a call's order flag stays on the device and is read later without a host sync
(``distributed/call_order/``); the rank that finds a mismatch tells the others through the
job's store and aborts SyncBN's group (``distributed/call_order/watcher.py``). Here CPU calls of the
pure-PyTorch kernels queue their flags the same way (``set_queue_order_flags_on_cpu``), so the
logic runs on 2 gloo ranks: found within the calls of the step, every rank raises naming the
layers, nobody waits for a timeout, and the callback reads the flags before the optimizer step.
What only a GPU shows (the pinned copy and event, NCCL's abort ending a pending collective) is
in ``tests/test_cuda.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from torch import nn

from syncbn_lightning import CallOrderError, check_call_order, convert_sync_batchnorm
from syncbn_lightning.distributed.call_order import checks as call_order
from syncbn_lightning.distributed.call_order import watcher as group_abort
from syncbn_lightning.distributed.call_order.policy import set_queue_order_flags_on_cpu
from syncbn_lightning.distributed.job import current_job

_REFERENCE = {"SYNCBN_IMPL": "reference"}  # the C++ CPU kernels always check at once


def _three_layers() -> nn.ModuleDict:
    torch.manual_seed(0)
    return convert_sync_batchnorm(
        nn.ModuleDict({name: nn.BatchNorm1d(4) for name in ("stem", "mid", "tail")})
    )


def _calls(rank: int) -> list[str]:
    """Rank 1 skips `mid`: its `tail` call meets rank 0's `mid` (same channels, same payload)."""
    return ["stem", "mid", "tail"] if rank == 0 else ["stem", "tail"]


def _skip_a_layer(rank: int, world: int) -> tuple[str, int, int, float]:
    """Two forward steps; returns the error and the (step, call) at which it was raised."""
    set_queue_order_flags_on_cpu(True)
    net = _three_layers()
    start = time.monotonic()
    for step in range(2):
        for number, name in enumerate(_calls(rank)):
            try:
                net[name](torch.randn(3, 4))
            except CallOrderError as exc:
                return str(exc), step, number, time.monotonic() - start
    return "", -1, -1, time.monotonic() - start


@pytest.mark.distributed
def test_queued_flags_are_read_within_the_step_on_every_rank() -> None:
    results = run_distributed(_skip_a_layer, 2, timeout=90, pg_timeout_s=60, env=_REFERENCE)
    for rank, (text, _step, _number, seconds) in enumerate(results):
        assert "'mid'" in text and "'tail'" in text, (rank, text)
        assert seconds < 20, (rank, seconds)  # not the 60 s collective timeout
    # Rank 0's mismatch was its 2nd call: found at its 3rd, before that call's collective.
    assert results[0][1:3] == (0, 2)
    # Rank 1's was its last call of the step: found at its next call, the next step's first.
    assert results[1][1:3] == (1, 0)


def _finder_and_waiter(rank: int, world: int) -> tuple[str, float]:
    """Rank 0 finds the mismatch at its 3rd call; rank 1 makes no further SyncBN call (as if
    its device were stuck in a collective) and learns of it from the store (its watcher asks
    every second here, every CHECK_S = 10 s by default)."""
    set_queue_order_flags_on_cpu(True)
    group_abort.CHECK_S = 1.0
    net = _three_layers()
    for name in _calls(rank):
        try:
            net[name](torch.randn(3, 4))
        except CallOrderError as exc:
            assert rank == 0
            return str(exc), 0.0
    start = time.monotonic()
    while not group_abort.signalled() and time.monotonic() - start < 30:
        time.sleep(0.05)
    waited = time.monotonic() - start
    try:
        check_call_order()  # what the callback or the next layer call does
    except CallOrderError as exc:
        return str(exc), waited
    return "", waited


@pytest.mark.distributed
def test_the_rank_that_finds_a_mismatch_ends_the_others() -> None:
    (found, _), (told, waited) = run_distributed(
        _finder_and_waiter, 2, timeout=90, pg_timeout_s=60, env=_REFERENCE
    )
    assert "'mid'" in found and "'tail'" in found
    assert waited < 10, waited  # the watcher's next check (1 s here), not a timeout
    assert told.startswith("Another rank of this rank's SyncBatchNorm sync group")
    assert "global rank 0 found" in told and "'mid'" in told and "'tail'" in told


def test_a_flag_is_read_only_once_the_device_wrote_it(queued_flags: None) -> None:
    """Polling reads the queue oldest first and stops at the first flag not yet written."""

    class Pending:
        """A copy whose event has not completed."""

        def ready(self) -> bool:
            return False

        def ok(self) -> bool:
            raise AssertionError("read before it was written")

    reported: list[int] = []

    def report(number: int) -> None:
        reported.append(number)
        raise CallOrderError(f"call {number}")

    good, bad = torch.ones(3), torch.zeros(3)
    call_order._pending.append((good, 2, report, (0,), None, call_order._FlagCopy.of(good, 2)))
    call_order._pending.append((bad, 2, report, (1,), None, Pending()))
    call_order._pending.append((bad, 2, report, (2,), None, call_order._FlagCopy.of(bad, 2)))
    call_order.poll_order_checks()  # the first is read; the second is not written yet
    assert len(call_order._pending) == 2 and reported == []
    entry = call_order._pending[0]
    call_order._pending[0] = (*entry[:5], call_order._FlagCopy.of(bad, 2))
    with pytest.raises(CallOrderError, match="call 1"):
        call_order.poll_order_checks()
    assert call_order._pending == []  # the queue is dropped with the first error


def test_check_call_order_reads_flags_not_yet_written(queued_flags: None) -> None:
    """The callback's read does not wait for events: one host copy of every queued flag."""

    def report() -> None:
        raise CallOrderError("found")

    zero = torch.zeros(1)
    call_order._pending.append((zero, 0, report, (), None, None))
    with pytest.raises(CallOrderError, match="found"):
        check_call_order()


def test_the_callback_reads_the_flags_before_the_optimizer_step(queued_flags: None) -> None:
    from syncbn_lightning import SyncBNCallback

    def report() -> None:
        raise CallOrderError("found before the step")

    callback: Any = SyncBNCallback()
    callback._active = True
    call_order._pending.append((torch.zeros(1), 0, report, (), None, None))
    with pytest.raises(CallOrderError, match="found before the step"):
        callback.on_before_optimizer_step(None, None, None)


class _AuxNet(nn.Module):
    """A stem and two heads; rank 1's loss leaves the auxiliary head out."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
        self.body = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
        self.aux = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.stem(x)
        return self.body(h), self.aux(h)


def _eager_unused_head(rank: int, world: int) -> str:
    """Rank 1's loss leaves the auxiliary head out: its backward has one synchronized layer
    fewer. No callback and no check_call_order: the backward's own calls read the flags."""
    set_queue_order_flags_on_cpu(True)
    torch.manual_seed(0)
    out, aux = convert_sync_batchnorm(_AuxNet())(torch.randn(2, 3, 4, 4))
    loss = out.square().mean() + (aux.square().mean() if rank == 0 else 0.0)
    try:
        loss.backward()
    except CallOrderError as exc:
        return str(exc)
    return ""


@pytest.mark.distributed
def test_a_backward_mismatch_is_found_within_the_backward_on_every_rank() -> None:
    """Each rank raises its own error, or, when the other rank found the mismatch first and
    published it (a busy machine decides which), the published one, which carries the finder's
    text."""
    results = run_distributed(_eager_unused_head, 2, timeout=90, pg_timeout_s=60, env=_REFERENCE)
    published = "Another rank of this rank's SyncBatchNorm sync group found a call-order mismatch"
    for rank, text in enumerate(results):
        own = text.startswith("The backward passes of SyncBatchNorm layers")
        told = text.startswith(published) and "The backward passes of SyncBatchNorm" in text
        assert own or told, (rank, text)
        assert "'aux.1'" in text and "'body.1'" in text, (rank, text)


def _compiled_unused_head(rank: int, world: int, errors: str) -> str:
    """A step whose backward has one synchronized layer fewer on rank 1, each block compiled on
    its own (one whole compiled model would run every head's backward: AOTAutograd gives an
    unused output a zero gradient). The error propagates, as in a job; its text is also written
    to ``errors``/rank<R>.txt (the harness reports only the lowest failing rank's)."""
    set_queue_order_flags_on_cpu(True)
    torch.manual_seed(0)
    net = convert_sync_batchnorm(_AuxNet())
    for name, block in list(net.named_children()):
        setattr(net, name, torch.compile(block, fullgraph=True))
    out, aux = net(torch.randn(2, 3, 4, 4))
    loss = out.square().mean() + (aux.square().mean() if rank == 0 else 0.0)
    try:
        loss.backward()
        check_call_order()  # what the callback does before the optimizer step
    except CallOrderError as exc:
        (Path(errors) / f"rank{rank}.txt").write_text(str(exc))
        raise
    return "ok"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.usefixtures("inline_modules")
def test_a_compiled_backward_keeps_its_order_flag(tmp_path: Path) -> None:
    """The compiled backward notes its flag on the layer's status (a mutating operator, which the
    compiled graph keeps); ``check_call_order`` reads it on rank 1, whose backward ran one
    synchronized layer fewer, and raises naming the layer; rank 0, left in a collective rank 1
    never joins, fails when rank 1's process ends, long before the group timeout."""
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank \d of 2 failed"):
        run_distributed(
            _compiled_unused_head, 2, str(tmp_path), timeout=400, pg_timeout_s=300, env=_REFERENCE
        )
    assert time.monotonic() - started < 200  # compiling included; not the 300 s timeout
    text = (tmp_path / "rank1.txt").read_text()
    assert text.startswith("The backward passes of SyncBatchNorm layers"), text
    # Rank 1's backward of body.1 met rank 0's of aux.1, its stem.1's rank 0's body.1.
    assert "compiled code found a mismatch at the backward of 'stem.1' (call #1)" in text, text
    assert "the backward of 'body.1' (call #1)" in text, text


# ------------------------------------------------------------------------------------------------
# A watcher's life is its job's (issue 55, item 1), and the queue's lock
# ------------------------------------------------------------------------------------------------


def _watchers_gone(within_s: float = 2.0) -> list[Any]:
    """The SyncBN watcher threads still alive after waiting up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while group_abort.watcher_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return group_abort.watcher_threads()


def test_three_jobs_in_one_process_leave_no_syncbn_thread(tmp_path: Path, queued_flags) -> None:
    """Three one-rank jobs one after another (init, convert with the reference kernels, 3 steps
    with queued flags, check_call_order, destroy_process_group): each job's watcher runs while
    it runs, keyed by the job's id, and is gone after its destroy_process_group."""
    import torch.distributed as dist

    from syncbn_lightning.distributed.flight import recorder as flight

    assert not _watchers_gone(), "a watcher of an earlier test is still running"
    jobs = []
    for n in range(3):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s{n}", rank=0, world_size=1)
        try:
            net = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(4)), force_sync=True)
            net[0].impl = "reference"
            for _ in range(3):
                net(torch.randn(3, 4)).sum().backward()
            check_call_order()
            job = flight.job_id()
            (running,) = group_abort.watcher_threads()
            assert running.name == f"syncbn-abort-watch-{job}" and current_job().id == job
            jobs.append(job)
        finally:
            dist.destroy_process_group()
        assert not _watchers_gone(), f"job {n}: a watcher outlived destroy_process_group"
    assert len(set(jobs)) == 3


def test_a_watcher_starts_at_the_first_planned_call_and_ends_at_revert(
    tmp_path: Path, queued_flags
) -> None:
    """Converting starts nothing: the group's watcher starts when a layer first plans a call on
    a group whose calls queue their flags (CUDA's way, here on CPU), and
    revert_sync_batchnorm ends it."""
    import torch.distributed as dist

    from syncbn_lightning import revert_sync_batchnorm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        net = convert_sync_batchnorm(
            nn.Sequential(nn.BatchNorm1d(4)), process_group=group, force_sync=True
        )
        assert not group_abort.watcher_threads()
        net(torch.randn(3, 4))
        assert len(group_abort.watcher_threads()) == 1
        assert current_job().watcher.groups == {group.group_name}
        revert_sync_batchnorm(net)
        assert not group_abort.watcher_threads()  # joined before revert returns
    finally:
        dist.destroy_process_group()


def test_compiled_calls_groups_are_watched_from_the_first_check(tmp_path: Path, queued_flags):
    """A layer whose calls are all compiled plans nothing: its status (where compiled calls note
    their flags) names its group, which check_call_order registers with the job's watcher when
    it first reads the status."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        layer = convert_sync_batchnorm(nn.BatchNorm1d(4), process_group=group)
        assert layer._order is not None and not group_abort.watcher_threads()
        call_order.mark_status_used()  # what a compiled call does
        check_call_order()
        assert group.group_name in current_job().watcher.groups  # (and earlier tests' layers')
    finally:
        dist.destroy_process_group()


def test_the_queue_changes_only_under_its_lock(queued_flags: None) -> None:
    """A poller takes the queue's head while another thread (a DataParallel replica, the
    callback) empties the queue: the poller's take is whole, the other waits for it."""
    import threading

    cleared: list[threading.Thread] = []

    class Racing:
        """A copy whose readiness check lets another thread run check_call_order."""

        def ready(self) -> bool:
            other = threading.Thread(target=check_call_order)
            other.start()
            other.join(0.5)  # with the lock held, it waits for this take
            cleared.append(other)
            return True

        def ok(self) -> bool:
            return True

    def report() -> None:
        raise CallOrderError("never")

    ones = torch.ones(1)
    call_order._pending.append((ones, 0, report, (), None, Racing()))
    call_order._pending.append((ones, 0, report, (), None, call_order._FlagCopy.of(ones, 0)))
    call_order.poll_order_checks()
    (other,) = cleared
    other.join(5)
    assert not other.is_alive() and call_order._pending == []


# A 2-rank job with queued flags (a watcher per rank) on a TCP store hosted by rank 0, which
# lingers after destroy_process_group while rank 1 exits at once (or the other way round).
_EXIT_JOB = """
import datetime, os, socket, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn

def worker(rank, port, delay):
    os.environ["SYNCBN_IMPL"] = "reference"
    torch.set_num_threads(1)
    from syncbn_lightning import check_call_order, convert_sync_batchnorm
    from syncbn_lightning.distributed.call_order.policy import set_queue_order_flags_on_cpu
    set_queue_order_flags_on_cpu(True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        net = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(4)))
        net(torch.randn(3, 4)).sum().backward()
        check_call_order()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == (0 if delay > 0 else 1):
        time.sleep(abs(delay))

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, port, float(sys.argv[1]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    print(" ".join(str(p.exitcode) for p in procs))
"""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_rank_exits_0_when_the_store_goes_first(tmp_path: Path) -> None:
    """The store (rank 0's) closes while a rank's interpreter finalizes. A watcher then
    blocked in the store's wait got the store's error, went for the GIL during finalization,
    and Python 3.11 ended the thread with pthread_exit, whose forced unwind through C++ ended
    the process: SIGABRT, 'terminate called without an active exception' (before the fix: 4
    and 5 of the 6 ranks of these 3 jobs, in two runs). Watchers now poll, end with their job,
    and are joined at exit."""
    script = tmp_path / "job.py"
    script.write_text(_EXIT_JOB)
    codes = {}
    for delay in (0.3, 0.6, -0.3):
        done = subprocess.run(
            [sys.executable, str(script), str(delay)],
            capture_output=True,
            text=True,
            timeout=200,
            cwd=tmp_path,
        )
        codes[delay] = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
    assert all(c == "0 0" for c in codes.values()), (codes, done.stderr[-3000:])
