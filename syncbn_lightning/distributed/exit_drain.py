"""Letting gloo's worker threads finish their releases before the interpreter finalizes.

A gloo worker thread (``ProcessGroupGloo::runLoop``) drops its reference to a finished collective
after the caller has moved on. If what it drops last needs the GIL and the interpreter has begun
to finalize, CPython ends the thread inside a noexcept destructor and the process dies with
SIGABRT, "terminate called without an active exception" (docs/reliability.md). Two things in a
work need the GIL: the Python object torch's backward stashes in the thread's state (every
collective issued inside ``backward()`` copies it: DDP's bucket all-reduces too), and a tensor
whose Python object its caller dropped while the work still held it (Lightning's and
torchmetrics' metric syncs, any ``dist.all_reduce`` of a temporary). SyncBN's own collectives
leave neither (:mod:`.collectives`, ``csrc/layer/layer_comm.cpp``); the others of a job may.

So at interpreter exit (the ``atexit`` handler of :mod:`.job`, after the running job ended: the
interpreter still runs) :func:`drain` waits, with the GIL released, until no gloo worker thread is
runnable: a worker that still has to drop a work is runnable (or takes the GIL, which is free while
this sleeps, and drops it at once); an idle one sleeps on its queue. Three quiet looks in a row end
the wait, normally within a few milliseconds; it gives up after :data:`LIMIT_S` with a warning. A
collective still running at exit (an ``async_op`` work never waited for) is not waited for: its
worker sleeps on the network.

The worker threads are found in ``/proc/self/task``: by name (``pt_gloo_runloop``, torch 2.13
on), or, on releases before 2.13 (which do not name them), as the native threads Python does not
know, in a process that made a process group. From 2.13 a process without a named gloo thread
(an NCCL job) waits for nothing. Without ``/proc`` (not Linux) nothing is waited for.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch.distributed as dist

from .._compat import GLOO_THREADS_NAMED, made_process_group

__all__ = ["LIMIT_S", "drain", "drain_at_exit", "gloo_worker_threads", "runnable", "threads"]

_log = logging.getLogger(__name__)

#: The longest :func:`drain` waits at exit (seconds).
LIMIT_S = 2.0
#: How many looks in a row must find no worker runnable.
QUIET_LOOKS = 3
#: The sleep between two looks (seconds; the GIL is released meanwhile).
LOOK_EVERY_S = 0.002
_WORKER_NAME = "pt_gloo_runloop"
_GLOO_NAMES = frozenset({_WORKER_NAME, "gloo_tcp_loop"})
_TASKS = Path("/proc/self/task")

# A thread's (name, state letter) by its native id.
Threads = Mapping[int, tuple[str, str]]


def threads() -> dict[int, tuple[str, str]]:
    """This process's native threads: ``{tid: (name, state)}`` with the state letter of
    ``/proc/<tid>/stat`` (``R`` runnable, ``S`` sleeping, ...); empty without ``/proc``."""
    found: dict[int, tuple[str, str]] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return found
    for tid in tids:
        try:
            stat = (_TASKS / tid / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        # "tid (name) S ...": the name may hold spaces and parentheses; the state follows the last.
        close = stat.rfind(")")
        found[int(tid)] = (stat[stat.find("(") + 1 : close], stat[close + 2 : close + 3])
    return found


def gloo_worker_threads(
    found: Threads, python_threads: set[int], by_elimination: bool
) -> list[int]:
    """The native ids in ``found`` that may be gloo worker threads: those named
    ``pt_gloo_runloop``; where none carries a gloo name and ``by_elimination`` (a torch that does
    not name them, in a process that made a group), every thread not in ``python_threads``
    (Python's own threads)."""
    named = [tid for tid, (name, _state) in found.items() if name == _WORKER_NAME]
    if named or any(name in _GLOO_NAMES for name, _state in found.values()) or not by_elimination:
        return named
    return [tid for tid in found if tid not in python_threads]


def runnable(found: Threads, tids: list[int]) -> list[int]:
    """Those of ``tids`` whose state in ``found`` is runnable (``R``); a thread that ended is
    not."""
    return [tid for tid in tids if tid in found and found[tid][1] == "R"]


def drain(
    limit_s: float = LIMIT_S,
    *,
    look: Callable[[], Threads] = threads,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Wait, with the GIL released, until no gloo worker thread is runnable in
    :data:`QUIET_LOOKS` looks in a row, :data:`LOOK_EVERY_S` apart, for at most ``limit_s``.

    Returns:
        ``True`` once quiet (at once without worker threads), ``False`` when it gave up; then it
        has logged one warning naming the threads still runnable.
    """
    if not dist.is_available():
        return True
    python_threads = {t.native_id for t in threading.enumerate() if t.native_id is not None}
    python_threads.add(threading.get_native_id())
    by_elimination = not GLOO_THREADS_NAMED and made_process_group()
    workers = gloo_worker_threads(look(), python_threads, by_elimination)
    if not workers:
        return True
    deadline = time.monotonic() + limit_s
    quiet = 0
    busy: list[int] = []
    while quiet < QUIET_LOOKS:
        if time.monotonic() > deadline:
            _log.warning(
                "SyncBN: %d gloo worker thread(s) (native ids %s) still ran %.1f s into the "
                "interpreter's exit; going on. If one releases a collective holding a Python "
                "object after this, the process may abort (docs/reliability.md)",
                len(busy),
                busy,
                limit_s,
            )
            return False
        sleep(LOOK_EVERY_S)
        busy = runnable(look(), workers)
        quiet = 0 if busy else quiet + 1
    return True


def drain_at_exit() -> None:
    """:func:`drain`, never raising: the last step of the interpreter's exit handler of
    :mod:`.job`, after the running job ended."""
    try:
        drain()
    except Exception as exc:  # never let the exit path raise
        _log.debug("syncbn_lightning: the exit drain failed: %s", exc)
