"""A call-order watcher lives as long as its job needs it (issue 55, item 1; the thread itself:
``distributed/call_order/watcher.py``).

One-rank gloo jobs in this process: a layer built directly on a group starts its group's watcher
(a job whose calls are all compiled queues nothing in Python); reverting one model leaves the
watcher another live model still needs; the callback's teardown ends them; a message published
in an earlier job is never read in a later one; a flag queued while ``check_call_order`` reads the
queue is kept for the next read. The three-jobs test and the revert test are in
``test_order_flags.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _lightning import BNNet, quiet_trainer
from lightning.pytorch.callbacks import Callback
from torch import nn

from syncbn_lightning import (
    SyncBatchNorm,
    SyncBNCallback,
    check_call_order,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from syncbn_lightning.distributed.call_order import checks as call_order
from syncbn_lightning.distributed.call_order import watcher as group_abort
from syncbn_lightning.distributed.job import current_job


def _threads(within_s: float = 2.0, want: int = 0) -> list[Any]:
    """The watcher threads, once their number is ``want`` or ``within_s`` has passed."""
    deadline = time.monotonic() + within_s
    while len(group_abort.watcher_threads()) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return group_abort.watcher_threads()


@pytest.fixture
def one_rank_job(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo job for the test's duration; no watcher before, none left after."""
    assert not _threads(), "a watcher of an earlier test is still running"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
    assert not _threads(), "a watcher outlived its job"


def test_a_layers_first_call_on_a_group_starts_its_watcher(
    one_rank_job: None, queued_flags: None
) -> None:
    """Where calls queue their flags (CUDA's way, here on CPU): the group is registered with the
    job when a layer first plans a call on it, never by the layer's constructor."""
    group = dist.new_group([0])
    layer = SyncBatchNorm(4, process_group=group, force_sync=True)
    assert not _threads(within_s=0.2) and current_job().watcher is None
    layer(torch.randn(3, 4))
    (thread,) = _threads(want=1)
    job = current_job()
    assert thread.name == f"syncbn-abort-watch-{job.id}"
    assert job.watcher.groups == {group.group_name}
    assert layer.process_group is group


def test_a_cpu_job_runs_no_watcher(one_rank_job: None) -> None:
    """On gloo, CPU calls check at once (every rank of the group fails at the same call): no
    flag is left for later, nothing is published, and no watcher thread polls the store."""
    from syncbn_lightning import new_sync_group
    from syncbn_lightning.distributed.groups import sync_world_group

    group = dist.new_group([0])
    layer = SyncBatchNorm(4, process_group=group, force_sync=True)
    layer(torch.randn(3, 4)).sum().backward()
    model = convert_sync_batchnorm(
        nn.Sequential(nn.BatchNorm1d(4)), process_group=new_sync_group(1)
    )
    model(torch.randn(3, 4)).sum().backward()
    sync_world_group()
    check_call_order()
    assert not group_abort.watcher_threads() and current_job().watcher is None


@pytest.mark.parametrize(
    ("config", "carries"),
    [("gloo", False), ("nccl", True), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl", True)],
)
def test_a_group_carries_device_tensors_by_its_backends(
    one_rank_job: None, monkeypatch: pytest.MonkeyPatch, config: str, carries: bool
) -> None:
    from syncbn_lightning.distributed import groups

    group = dist.new_group([0])
    assert not groups.carries_device_tensors(group)  # this job's own: gloo
    monkeypatch.setattr(dist, "get_backend_config", lambda _group: config)
    assert groups.carries_device_tensors(group) is carries
    assert groups.carries_device_tensors(group.group_name) is carries


def test_reverting_one_model_keeps_the_watcher_another_model_needs(
    one_rank_job: None, queued_flags: None
) -> None:
    """Two models on one group whose calls queue their flags (CUDA's way, here on CPU): reverting
    the first (an exported copy, an EMA) leaves the second's watcher; reverting the second ends
    it."""
    group = dist.new_group([0])
    models = [
        convert_sync_batchnorm(
            nn.Sequential(nn.BatchNorm1d(4)), process_group=group, force_sync=True
        )
        for _ in range(2)
    ]
    for model in models:
        model(torch.randn(3, 4))
    first, second = models
    (thread,) = _threads(want=1)
    revert_sync_batchnorm(first)
    assert type(first[0]) is nn.BatchNorm1d
    assert _threads(want=0, within_s=0.5) == [thread] and thread.is_alive()
    second(torch.randn(3, 4)).sum().backward()
    check_call_order()
    revert_sync_batchnorm(second)
    assert not group_abort.watcher_threads()  # joined before revert returns


class _Watching(Callback):
    """Counts the watcher threads at each training batch's end."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen.append(len(group_abort.watcher_threads()))


def test_the_callbacks_teardown_ends_the_fits_watchers(
    tmp_path: Path, queued_flags: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-process DDP fit (the layers converted to be monitored, their calls synchronized):
    their watcher runs during the fit and is gone when ``fit``
    returns, the default group still alive (Lightning keeps it)."""
    assert not _threads(), "a watcher of an earlier test is still running"
    # Lightning writes its rendezvous into os.environ, and a later test's launcher would reuse
    # the port: recorded as unset here, so that the test's end removes them.
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    watching = _Watching()
    trainer = quiet_trainer(
        strategy="ddp",
        max_steps=2,
        callbacks=[SyncBNCallback(single_process="monitor"), watching],
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    try:
        trainer.fit(BNNet())
        assert watching.seen and all(n == 1 for n in watching.seen), watching.seen
        assert dist.is_initialized()
        assert not group_abort.watcher_threads()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_message_of_an_earlier_job_is_not_read_in_a_later_one(tmp_path: Path) -> None:
    """A mismatch another rank published in one job goes with that job: the next job of the
    process (a new default group) neither raises it nor tells the C++ path of it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s1", rank=0, world_size=1)
    try:
        first = current_job()
        group_abort._signal(first, dist.new_group([0]).group_name, "an old mismatch")
        assert group_abort.signalled() and group_abort.published_message() == "an old mismatch"
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s2", rank=0, world_size=1)
    try:
        assert current_job() is not first and first.ended and not first.signalled
        assert not group_abort.signalled() and group_abort.published_message() is None
        check_call_order()  # would raise CallOrderError with the old message
    finally:
        dist.destroy_process_group()


def test_a_watcher_reads_a_mismatch_another_rank_published(
    one_rank_job: None, queued_flags: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store keys another rank writes (publish_mismatch's) reach this rank's watcher within a
    check period: it keeps the message on the job and the next check raises it."""
    monkeypatch.setattr(group_abort, "CHECK_S", 0.05)
    monkeypatch.setattr(group_abort, "LIVE_S", 0.01)
    group = dist.new_group([0])
    SyncBatchNorm(4, process_group=group, force_sync=True)(torch.randn(3, 4))
    job = current_job()
    store = dist.distributed_c10d._get_default_store()
    store.set(group_abort._KEY + group.group_name, "global rank 1 found: a mismatch")
    store.set(group_abort._ANY_KEY, group.group_name)
    try:
        deadline = time.monotonic() + 5
        while not group_abort.signalled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.signalled == {group.group_name: "global rank 1 found: a mismatch"}
        assert not _threads(want=0)  # it ended with its finding
        with pytest.raises(call_order.CallOrderError, match="global rank 1 found: a mismatch"):
            check_call_order()
    finally:
        job.signalled.clear()
        group_abort._set_signalled(False)


def test_one_watcher_watches_every_group_of_a_job(one_rank_job: None, queued_flags: None) -> None:
    """Four groups, one thread: the job's watcher, whose store load does not grow with them."""
    groups = [dist.new_group([0]) for _ in range(4)]
    layers = [SyncBatchNorm(4, process_group=group, force_sync=True) for group in groups]
    for layer in layers:
        layer(torch.randn(3, 4))
    assert len(_threads(want=1)) == 1
    assert current_job().watcher.groups == {group.group_name for group in groups}
    revert_sync_batchnorm(nn.Sequential(*layers[:3]))
    assert current_job().watcher.groups == {groups[3].group_name} and len(_threads()) == 1
    revert_sync_batchnorm(nn.Sequential(layers[3]))
    assert not group_abort.watcher_threads() and current_job().watcher is None


def test_a_watcher_ends_within_a_second_of_destroy_process_group(
    tmp_path: Path, queued_flags: None
) -> None:
    """No hook tells SyncBN of ``destroy_process_group``: the watcher looks every LIVE_S, without
    asking the store."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    SyncBatchNorm(4, process_group=dist.new_group([0]), force_sync=True)(torch.randn(3, 4))
    (thread,) = _threads(want=1)
    dist.destroy_process_group()
    thread.join(1.0)
    assert not thread.is_alive()


class _AppendedWhileCopied(list):
    """A queue to which an entry is appended (as compiled code does, without the lock) right
    after ``check_call_order`` copies it, before it takes what it copied off."""

    late: tuple[Any, ...] = ()

    def _copied(self, copy: list[Any]) -> list[Any]:
        if self.late:
            self.append(self.late)
            self.late = ()
        return copy

    def __iter__(self) -> Iterator[Any]:
        return iter(self._copied(list(super().__iter__())))

    def __getitem__(self, index: Any) -> Any:
        value = super().__getitem__(index)
        return self._copied(list(value)) if isinstance(index, slice) else value


def test_a_flag_queued_while_the_queue_is_read_waits_for_the_next_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def report() -> None:
        raise call_order.CallOrderError("the late flag")

    ok, failed = torch.ones(1), torch.zeros(1)
    queue = _AppendedWhileCopied([(ok, 0, report, (), None, None)])
    queue.late = (failed, 0, report, (), None, None)
    monkeypatch.setattr(call_order, "_pending", queue)
    check_call_order()  # reads the first flag (1); the late one stays queued
    assert len(queue) == 1 and queue[0][0] is failed
    with pytest.raises(call_order.CallOrderError, match="the late flag"):
        check_call_order()


def test_a_watcher_that_outlasts_its_stop_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A watcher still in a store request when the join gives up is not left silently (at exit it
    would come back to a finalizing interpreter)."""
    import threading

    release = threading.Event()
    watcher = group_abort._Watcher(SimpleNamespace(id="stuck-job"), None)
    watcher.thread = threading.Thread(target=release.wait, name="syncbn-abort-watch-stuck")
    watcher.thread.start()
    monkeypatch.setattr(group_abort, "_JOIN_S", 0.05)
    try:
        with caplog.at_level("WARNING", logger=group_abort.__name__):
            watcher.stop()
    finally:
        release.set()
        watcher.thread.join()
    assert watcher.stop_event.is_set()
    assert "stuck-job" in caplog.text and "did not end" in caplog.text


def _left_alone_rank(rank: int, world: int) -> dict[str, str]:
    """Rank 0 publishes a mismatch for two groups (as a rank that read a failed queued flag
    does) and calls nothing more; rank 1 calls a layer on each group, the C++ path on one and
    the Python path on the other, and waits alone in the collective until SyncBN's timeout."""
    from datetime import timedelta

    from syncbn_lightning.distributed.groups import set_sync_timeout
    from syncbn_lightning.functional.layer_call import forward_function

    set_sync_timeout(timedelta(seconds=3))
    groups = {path: dist.new_group([0, 1], timeout=timedelta(seconds=3)) for path in ("cpp", "py")}
    if rank == 0:
        for group in groups.values():
            group_abort.publish_mismatch(group.group_name, "layer 'mid' against 'tail'")
        return {}
    errors = {}
    for path, group in groups.items():
        layer = SyncBatchNorm(4, process_group=group)
        started = time.monotonic()
        try:
            if path == "cpp":
                layer(torch.randn(3, 4))
            else:
                forward_function(layer, torch.randn(3, 4), 2, None, None)
        except call_order.CallOrderError as exc:
            errors[path] = f"{time.monotonic() - started:.1f} s: {exc}"
        else:
            errors[path] = "no error"
    return errors


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_left_alone_in_a_collective_ends_with_the_published_call_order_error() -> None:
    """The rank that did not see the mismatch itself waits in a collective the other rank will
    never join; when it fails (SyncBN's timeout here, 3 s; at once where an abort ends it), the
    error is the CallOrderError the other rank published, on both paths, not the backend's."""
    errors = run_distributed(_left_alone_rank, 2, timeout=90, pg_timeout_s=60)[1]
    for path in ("cpp", "py"):
        seconds, _, text = errors[path].partition(" s: ")
        assert "found a call-order mismatch and ended the group" in text, (path, errors[path])
        assert "global rank 0 found: layer 'mid' against 'tail'" in text, (path, text)
        assert float(seconds) < 20, (path, seconds)
