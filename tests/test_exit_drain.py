"""The exit drain (``distributed/exit_drain.py``): at interpreter exit it waits until no gloo worker
thread is runnable, so a worker that still has to drop a finished collective holding a Python
object does so while the interpreter runs (docs/reliability.md, "A clean exit under torchrun").

The real case starves a gloo worker: pinned with its caller to one CPU beside a busy process, at
the idle scheduling class, it wakes its caller and is preempted before it drops the work.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from syncbn_lightning import _compat
from syncbn_lightning.distributed import exit_drain

_WORKER = "pt_gloo_runloop"


def test_gloo_workers_are_found_by_name() -> None:
    found = {1: ("python", "S"), 2: (_WORKER, "S"), 3: ("gloo_tcp_loop", "S"), 4: (_WORKER, "R")}
    assert exit_drain.gloo_worker_threads(found, {1}, by_elimination=True) == [2, 4]
    assert exit_drain.runnable(found, [2, 4, 9]) == [4]  # 9 ended: not runnable


def test_without_names_every_native_thread_python_does_not_know_counts() -> None:
    """torch before 2.13 names no gloo thread: there, after a group was made, every thread Python
    does not know counts (intra-op threads too: they sleep once idle); otherwise none does (an
    NCCL job on a torch that names gloo's threads waits for nothing)."""
    found = {1: ("python", "S"), 2: ("python", "R"), 3: ("python", "S")}
    assert exit_drain.gloo_worker_threads(found, {1}, by_elimination=True) == [2, 3]
    assert exit_drain.gloo_worker_threads(found, {1}, by_elimination=False) == []


def _looks(*states: str) -> Iterator[dict[int, tuple[str, str]]]:
    """A ``look`` that sees one gloo worker in each of ``states`` in turn, then asleep."""
    for state in states:
        yield {7: (_WORKER, state)}
    while True:
        yield {7: (_WORKER, "S")}


def test_the_drain_waits_for_quiet_looks_in_a_row() -> None:
    looks = _looks("R", "R", "S", "R", "S", "S", "S", "R")
    seen: list[float] = []
    assert exit_drain.drain(5.0, look=lambda: next(looks), sleep=seen.append)
    # The first look only finds the workers; then R S R, and S S S ends it: 6 sleeps.
    assert seen == [exit_drain.LOOK_EVERY_S] * 6


def test_a_drain_that_gives_up_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=exit_drain.__name__):
        assert not exit_drain.drain(0.05, look=lambda: {7: (_WORKER, "R")})
    assert len(caplog.records) == 1
    assert "still ran" in caplog.text and "[7]" in caplog.text


def test_no_worker_no_wait() -> None:
    slept: list[float] = []
    assert exit_drain.drain(5.0, look=lambda: {1: ("python", "R")}, sleep=slept.append)
    assert slept == []


def _starve(tids: list[int], cpu: int) -> None:
    """Pin ``tids`` and the calling thread to ``cpu``, ``tids`` at the idle scheduling class: a
    woken caller preempts a worker at once, which then runs only in the gaps a busy process on
    the same CPU leaves."""
    for tid in tids:
        os.sched_setaffinity(tid, {cpu})
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    os.sched_setaffinity(0, {cpu})


def _restore(tids: list[int], cpus: set[int]) -> None:
    os.sched_setaffinity(0, cpus)
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.sched_setaffinity(tid, cpus)
        except OSError:  # the thread ended
            pass


@pytest.mark.distributed
@pytest.mark.skipif(
    not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"),
    reason="needs Linux scheduling classes and /proc",
)
@pytest.mark.skipif(_compat.use_count(torch.ones(1)) is None, reason="torch cannot count holders")
def test_the_drain_lets_a_starved_worker_let_go_of_its_work(tmp_path: Path) -> None:
    """Right after an all-reduce returns, the starved worker still holds the work (the tensor's
    holders say so); :func:`drain` returns only once it let go. With the drain a no-op the
    second assertion fails."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    cpus = os.sched_getaffinity(0)
    hog = None
    workers: list[int] = []
    try:
        dist.all_reduce(torch.ones(1))  # the group's worker threads exist from here
        python_threads = {t.native_id for t in threading.enumerate()}
        workers = exit_drain.gloo_worker_threads(exit_drain.threads(), python_threads, True)
        assert workers
        cpu = min(cpus)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(hog.pid, {cpu})
        _starve(workers, cpu)
        held = 0
        for _round in range(10):
            tensor = torch.ones(4)
            alone = _compat.use_count(tensor)
            dist.all_reduce(tensor)
            if _compat.use_count(tensor) == alone:
                continue  # it let go in the instant before its caller woke: nothing to drain
            held += 1
            assert exit_drain.drain(10.0)
            assert _compat.use_count(tensor) == alone, "the drain returned before the worker let go"
        if not held:  # the scheduler woke the caller elsewhere each time: nothing was shown
            pytest.skip("the gloo worker could not be starved here (10 rounds)")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        _restore(workers, cpus)
        dist.destroy_process_group()
