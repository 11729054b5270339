"""Ending every rank of a sync group when one rank finds a call-order mismatch after the fact.

On CUDA tensors a call's order flag is read later, without a host sync (:mod:`.call_order`). By
the time a rank reads a failed flag, the ranks have parted: one rank ran a layer the others did
not, so some rank's device may wait in a collective that no other rank will join. Raising on the
rank that read the flag is not enough: NCCL would keep the others waiting until the collective
timeout, each naming nothing. So the rank that finds a mismatch *publishes* it:

* it writes the error message under a key of the job's store (``syncbn/abort/<group name>``, and
  the group's name under ``syncbn/abort``, the one key every watcher asks for) and aborts its own
  member of SyncBN's group;
* every rank runs **one watcher per job** (:class:`_Watcher`: one thread, one connection to the
  store of its own, :meth:`torch.distributed.Store.clone`, whose requests time out after
  :data:`REQUEST_TIMEOUT_S`), which watches every group of the job whose calls may queue flags
  (its backends carry device tensors, :func:`.groups.carries_device_tensors`, or CPU calls queue
  them under the tests' switch; a CPU job on gloo runs none: its calls check at once, on every
  rank). A group is registered with the job where SyncBN makes it (:mod:`..groups`) or first
  plans a call on it (a layer's plan, :mod:`syncbn_lightning.functional.layer_call`; compiled
  calls, which plan nothing, when :func:`~.checks.check_call_order` first reads their status):
  no constructor, converter or per-call code feeds it. Every :data:`CHECK_S` seconds the
  watcher asks the store for ``syncbn/abort``: one request, whatever the number of
  groups; between requests it only looks, every :data:`LIVE_S` seconds, whether it was stopped
  and whether its job still runs, which costs the store nothing. When the key appears, it reads
  the keys of its groups; for one of them it logs the message, aborts this rank's member of the
  group (on NCCL its pending collectives fail at once) and keeps the message on the job: the
  rank's next synchronized call or :func:`~syncbn_lightning.check_call_order` raises
  :class:`~.call_order.CallOrderError` with it. The C++ path learns of it through the hooks of
  :func:`on_signal` (it checks before each collective without calling Python).

**The watcher belongs to its job** (:class:`~.job.SyncJob`, which holds it and its messages): it
ends, closing its connection, within :data:`LIVE_S` of its job's ``destroy_process_group``, when
the job ends (at the next use of SyncBN after that, and at interpreter exit, joined before the
interpreter finalizes), and when :func:`stop_watchers` leaves it no group (``SyncBNCallback``'s
teardown; ``revert_sync_batchnorm``, for the groups no other live layer queues flags on).

On gloo an abort does not end a collective already waiting on the host; those end when the
publishing rank's process exits and its connections close (it raised). Only SyncBN's own groups
are aborted, never the default group (``groups`` keeps SyncBN's collectives in groups of their
own).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..._compat import default_store, store_connection
from ..collectives import process_group
from ..job import SyncJob, current_job, on_job_end

__all__ = [
    "CHECK_S",
    "LIVE_S",
    "REQUEST_TIMEOUT_S",
    "abort_group",
    "on_signal",
    "publish_mismatch",
    "published_message",
    "signalled",
    "stop_watchers",
    "watch_epoch",
    "watch_group",
    "watcher_threads",
]

_log = logging.getLogger(__name__)

_KEY = "syncbn/abort/"
# Set with every published mismatch (to the group's name): the one key a watcher asks for.
_ANY_KEY = "syncbn/abort"
#: How often a watcher asks the store whether a mismatch was published (seconds): its job's
#: whole load on the store, one request per rank per period.
CHECK_S = 10.0
#: How often a watcher looks whether it was stopped and whether its job still runs (seconds; no
#: request).
LIVE_S = 0.5
#: The timeout of a watcher's store requests (seconds): shorter than the stop's join, so that a
#: stopped watcher always ends before its stopper goes on (at exit: before the interpreter
#: finalizes).
REQUEST_TIMEOUT_S = 1.5
# How long a stop waits for its watcher to end.
_JOIN_S = 2.0
_THREAD_NAME = "syncbn-abort-watch"

_lock = threading.Lock()
# Whether a job of this process holds a mismatch another rank published (read at every
# synchronized call: a module global and nothing more).
_signalled = False
# Called with whether a mismatch may be signalled, each time that changes (functional/native.py
# tells the C++ path).
_signal_hooks: list[Callable[[bool], None]] = []
#: How many times :func:`stop_watchers` ran: whoever added a group at one value adds it again
#: once this differs (a layer's plan, ``functional/layer_call.py``; read as an attribute, per call).
watch_epoch = 0


class _Watcher:
    """A job's watcher: its thread, its connection, its stop event and the groups it watches
    (a frozenset, replaced whole: the thread reads it without the lock)."""

    def __init__(self, job: SyncJob, connection: Any) -> None:
        self.job, self.connection = job, connection
        self.groups: frozenset[str] = frozenset()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(
            target=_watch, args=(self,), name=f"{_THREAD_NAME}-{self.job.id}", daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (it ends within :data:`LIVE_S`, or its store
        request's :data:`REQUEST_TIMEOUT_S`); one warning if it still runs after the join."""
        self.stop_event.set()
        thread = self.thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(_JOIN_S)
        if thread.is_alive():  # in a store request that outlasts the join
            _log.warning(
                "SyncBN: the call-order watcher of job %s did not end within %.0f s of its stop "
                "(a store request still runs); going on without it",
                self.job.id,
                _JOIN_S,
            )


def signalled() -> bool:
    """Whether another rank published a mismatch of a group this process watches (any job):
    read at each synchronized call, so a module global and nothing more."""
    return _signalled


def _set_signalled(value: bool) -> None:
    global _signalled
    if _signalled != value:
        _signalled = value
        for hook in _signal_hooks:
            try:
                hook(value)
            except Exception as exc:  # the watcher thread must not die of a hook
                _log.debug("syncbn_lightning: a signal hook failed: %s", exc)


def _signal(job: SyncJob, group: str, message: str) -> None:
    """Keep ``message``, published by another rank for ``group``, on ``job`` and say so."""
    job.signalled[group] = message
    _set_signalled(True)


def _job_ended(job: SyncJob, had_signal: bool) -> None:
    if had_signal:  # its messages went with it: never read in a later job
        _set_signalled(False)


on_job_end(_job_ended)


def published_message() -> str | None:
    """The message another rank of the running job published for a group this process watches,
    or ``None`` (an ended job's messages went with it)."""
    if not _signalled:
        return None
    job = current_job(create=False)  # ends a job whose default group was destroyed
    if job is not None and job.signalled:
        return next(iter(job.signalled.values()))
    _set_signalled(False)
    return None


def published_for(group: str) -> str | None:
    """The mismatch another rank published for ``group``, asked of the job's store now (a
    failed collective's error path: the watcher may not have looked yet); ``None`` when none
    was, when this rank published it itself, or without a store."""
    store, job = default_store(), current_job(create=False)
    if store is None or job is None or group in job.published:
        return None
    try:
        if store.check([_KEY + group]):
            return bytes(store.get(_KEY + group)).decode()
    except Exception as exc:  # the store is gone: the job is ending anyway
        _log.debug("syncbn_lightning: could not ask for a published mismatch: %s", exc)
    return None


def on_signal(hook: Callable[[bool], None]) -> None:
    """Call ``hook(signalled())`` now and each time it changes (once per hook)."""
    if hook not in _signal_hooks:
        _signal_hooks.append(hook)
        hook(signalled())


def abort_group(group: str) -> None:
    """Abort this rank's member of SyncBN's process group ``group`` (by name): on NCCL its queued
    and pending collectives fail at once. Never raises: an error path calls it."""
    try:
        process_group(group).abort()
    except Exception as exc:  # a backend without abort, or a group already gone
        _log.debug("syncbn_lightning: could not abort group %s: %s", group, exc)


def publish_mismatch(group: str, message: str) -> None:
    """Tell every rank watching ``group`` that this rank found a call-order mismatch
    (``message``, the error it raises), then abort this rank's member of the group. Never
    raises: the caller raises the error itself."""
    store, job = default_store(), current_job()  # the job's store: the default group's
    if store is not None and job is not None:
        job.published.add(group)
        try:
            rank = dist.get_rank()
            store.set(_KEY + group, f"global rank {rank} found: {message}")
            store.set(_ANY_KEY, group)  # after the group's key: a watcher that sees it reads it
        except Exception as exc:  # the store is gone: the job is ending anyway
            _log.debug("syncbn_lightning: could not publish the mismatch: %s", exc)
    abort_group(group)


def watch_group(group: str) -> None:
    """Have the running job's watcher watch ``group`` (started with the job's first group; see
    the module docstring). Cheap when it watches it already: a set lookup."""
    job = current_job()
    if job is None:
        return
    watcher = job.watcher
    if isinstance(watcher, _Watcher) and group in watcher.groups:
        return
    with _lock:
        if not isinstance(job.watcher, _Watcher):
            job.watcher = _new_watcher(job)
        watcher = job.watcher
        watcher.groups = watcher.groups | {group}


def _new_watcher(job: SyncJob) -> _Watcher:
    """The job's watcher, its thread started; without a store connection (a store that cannot
    be cloned, none at all) one that runs no thread: the error still ends this rank, and the
    job asks once."""
    try:
        connection = store_connection(default_store(), timedelta(seconds=REQUEST_TIMEOUT_S))
    except Exception as exc:
        _log.debug("syncbn_lightning: no call-order watcher for job %s: %s", job.id, exc)
        return _Watcher(job, None)
    watcher = _Watcher(job, connection)
    watcher.start()
    return watcher


def stop_watchers(keep: Collection[str] = ()) -> None:
    """Stop watching every group but those named in ``keep``; a watcher left with no group ends
    and closes its connection (it ends by itself when its job's default group is destroyed):
    the callback's teardown stops it, ``revert_sync_batchnorm`` leaves the groups other live
    layers need. A later SyncBN group, conversion or queued flag starts a watcher again."""
    global watch_epoch
    job = current_job(create=False)  # a destroyed job ends here, its watcher with it
    with _lock:
        watch_epoch += 1
        watcher = job.watcher if job is not None else None
        if not isinstance(watcher, _Watcher):
            return
        watcher.groups = watcher.groups & frozenset(keep)
        if watcher.groups:
            return
        job.watcher = None  # type: ignore[union-attr]
    watcher.stop()


def watcher_threads() -> list[threading.Thread]:
    """The watcher threads of this process still running."""
    return [t for t in threading.enumerate() if t.name.startswith(_THREAD_NAME)]


def _published_group(connection: Any, groups: frozenset[str]) -> tuple[str, str] | None:
    """``(group, message)`` of a mismatch published for one of ``groups``, else ``None``: one
    request while nothing was published for any group of the job."""
    if not connection.check([_ANY_KEY]):
        return None
    for group in groups:
        if connection.check([_KEY + group]):
            return group, bytes(connection.get(_KEY + group)).decode()
    return None


def _watch(watcher: _Watcher) -> None:
    """The watcher thread: ask for a published mismatch every :data:`CHECK_S` (at once first),
    look whether to go on every :data:`LIVE_S`; on a mismatch of a watched group, keep it on the
    job, log and abort. Its connection is closed as it ends."""
    job, connection = watcher.job, watcher.connection
    found = None
    next_check = time.monotonic()
    try:
        while job.is_current() and not watcher.stop_event.is_set():
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + CHECK_S
                try:
                    found = _published_group(connection, watcher.groups)
                except Exception as exc:  # a request timed out, or the store is going away
                    _log.debug("syncbn_lightning: a call-order watcher's request failed: %s", exc)
                if found is not None:
                    break
            watcher.stop_event.wait(LIVE_S)
    finally:
        watcher.connection = connection = None  # the clone's socket (or file handle) closes
    if found is None or found[0] in job.published:
        return  # nothing published, or this rank found it, raised, and aborted the group
    group, message = found
    _signal(job, group, message)
    _log.error(
        "syncbn_lightning: a SyncBatchNorm call-order mismatch in sync group %s ended it: %s",
        group,
        message,
    )
    abort_group(group)
