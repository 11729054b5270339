"""The job as SyncBN sees it: one object per torch.distributed job of this process, the one owner
of what SyncBN keeps for that job.

A job is the life of one torch default process group (``init_process_group`` to
``destroy_process_group``). :func:`current_job` makes its :class:`SyncJob` when SyncBN first needs
it (its first group, a conversion, a synchronized call, the flight recorder) and ends it when the
default group it was made in is no longer torch's: at the next use after ``destroy_process_group``,
within :data:`~.watcher.LIVE_S` where the job runs a watcher (it looks), and at interpreter
exit. A job owns:

* its **id**, shared by every rank through the default group's store (:attr:`SyncJob.id`);
* **SyncBN's groups**: the world's twin (:func:`.groups.sync_world_group`) and the timeout SyncBN
  made its groups with (:func:`.groups.set_sync_timeout` checks a late change against it);
* the **call-order watcher** (:mod:`.call_order.watcher`): at most one thread and one store
  connection for all of the job's groups, and the mismatches published and seen;
* the **flight recorder** (:mod:`.flight`);
* the **exit drain** (:mod:`.exit_drain`): at interpreter exit the running job ends (its watcher
  joined, its recorder closed), then the drain waits for gloo's workers.

The modules that implement these parts store them on the job and ask :func:`current_job` for it;
only :meth:`SyncJob.end` ends them, all together, so no part outlives its job and no state of an
earlier job is read in a later one. This module imports no other module of the package but the
exit drain: the parts are ended through their ``stop()`` and ``close()`` methods.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from .._compat import default_store
from . import exit_drain

__all__ = ["SyncJob", "current_job", "end_current_job", "on_job_end", "store_job_id"]

_log = logging.getLogger(__name__)

# The default store's key under which the ranks of a job agree on its id.
_JOB_KEY = "syncbn_lightning/flight_job"


class _Stoppable(Protocol):
    def stop(self) -> None: ...


class _Closable(Protocol):
    def close(self) -> None: ...


class SyncJob:
    """What SyncBN keeps for one job (see the module docstring). Made by :func:`current_job`.

    Attributes:
        world_twin: SyncBN's twin of the default group, once made.
        groups_timeout: the collective timeout SyncBN's groups of this job were made with, once
            it made one (``(timeout,)``; the timeout itself may be ``None``, torch's default).
        watcher: the job's call-order watcher (:mod:`.call_order.watcher`), once started.
        recorder: the job's flight recorder (:mod:`.flight`), once made.
        published: the groups whose mismatch this rank published.
        signalled: group -> the mismatch another rank published and this rank's watcher read.
    """

    def __init__(self, world: Any) -> None:
        self._world = weakref.ref(world)
        self._id: str | None = None
        self.world_twin: dist.ProcessGroup | None = None
        self.groups_timeout: tuple[timedelta | None] | None = None
        self.watcher: _Stoppable | None = None
        self.recorder: _Closable | None = None
        self.published: set[str] = set()
        self.signalled: dict[str, str] = {}
        self.ended = False

    def is_current(self) -> bool:
        """Whether this job's default group is still torch's (the job runs)."""
        world = self._world()
        return world is not None and dist.is_initialized() and dist.GroupMember.WORLD is world

    @property
    def id(self) -> str:
        """The id every rank of this job shares (:func:`store_job_id`), asked once."""
        if self._id is None:
            self._id = store_job_id()
        return self._id

    def end(self) -> None:
        """End the job's parts: stop its watcher (joined), close its recorder, forget its
        mismatches, then run the :func:`on_job_end` hooks. Once; never raises."""
        if self.ended:
            return
        self.ended = True
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            _quietly(watcher.stop, "stopping its watcher")
        if self.recorder is not None:  # closed, still readable (the job's last records)
            _quietly(self.recorder.close, "closing its recorder")
        had_signal = bool(self.signalled)
        self.signalled.clear()
        for hook in list(_end_hooks):
            _quietly(lambda hook=hook: hook(self, had_signal), "a job-end hook")


def _quietly(step: Callable[[], object], what: str) -> None:
    """Run one step of ending a job: ending runs on error paths and at exit, so it never
    raises."""
    try:
        step()
    except Exception as exc:
        _log.debug("syncbn_lightning: ending a job, %s failed: %s", what, exc)


_current: SyncJob | None = None
_lock = threading.RLock()
_end_hooks: list[Callable[[SyncJob, bool], None]] = []


def current_job(create: bool = True) -> SyncJob | None:
    """The running job: ``None`` outside one (torch.distributed not initialized), or, with
    ``create=False``, before SyncBN made it. A job whose default group was destroyed ends here,
    and the next job is a new object. Per call: a weak reference and an identity check."""
    global _current
    job = _current
    if job is not None and job.is_current():  # a job exists only where torch.distributed does
        return job
    initialized = dist.is_available() and dist.is_initialized()
    if job is None and not (initialized and create):
        return None
    with _lock:
        job = _current
        if job is not None and not job.is_current():
            _current = None
            job.end()
        if initialized and _current is None and create:
            _current = SyncJob(dist.GroupMember.WORLD)
        return _current


def end_current_job() -> None:
    """End the current job now (its parts stop; a later use makes a new one for the same default
    group): interpreter exit, and tests."""
    global _current
    with _lock:
        job, _current = _current, None
    if job is not None:
        job.end()


def on_job_end(hook: Callable[[SyncJob, bool], None]) -> None:
    """Call ``hook(job, had_signal)`` when a job ends (``had_signal``: a mismatch published by
    another rank was still held); once per hook."""
    if hook not in _end_hooks:
        _end_hooks.append(hook)


def store_job_id() -> str:
    """The id every rank of the running job shares: made by the first rank to ask, kept in the
    default group's store (``MASTER_ADDR:MASTER_PORT`` where there is none)."""
    fallback = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    store = default_store()
    if store is None:
        return fallback
    try:
        mine = f"{int(time.time())}-{uuid.uuid4().hex[:8]}"
        return bytes(store.compare_set(_JOB_KEY, "", mine)).decode()
    except Exception:  # a store without compare_set: the launcher's address names the job
        return fallback


def _at_exit() -> None:
    """The job ends before the interpreter finalizes (a watcher still in a store request when
    the interpreter finalizes aborts the process), then gloo's workers are let go."""
    try:
        end_current_job()
    except Exception as exc:  # never let the exit path raise
        _log.debug("syncbn_lightning: ending the job at exit failed: %s", exc)
    exit_drain.drain_at_exit()


atexit.register(_at_exit)
