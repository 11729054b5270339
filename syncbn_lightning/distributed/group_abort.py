"""Ending every rank of a sync group when one rank finds a call-order mismatch after the fact.

On CUDA tensors a call's order flag is read later, without a host sync (:mod:`.call_order`). By
the time a rank reads a failed flag, the ranks have parted: one rank ran a layer the others did
not, so some rank's device may wait in a collective that no other rank will join. Raising on the
rank that read the flag is not enough: NCCL would keep the others waiting until the collective
timeout, each naming nothing. So the rank that finds a mismatch *publishes* it:

* it writes the error message under a key of the job's store (``syncbn/abort/<group name>``) and
  aborts its own member of SyncBN's group;
* every rank runs one watcher thread per SyncBN group of its job whose calls may queue flags (its
  backends carry device tensors, :func:`.groups.carries_device_tensors`, or CPU calls queue them
  under the tests' switch; a CPU job on gloo runs none: its calls check at once, on every rank),
  started when SyncBN makes the group (:mod:`.groups`), converts a model onto it, makes a layer's
  plan that queues flags on it (the C++ path), or first queues a flag on it (eager or compiled
  code alike: groups are made and converted onto eagerly). On its own connection to the
  store (:meth:`torch.distributed.Store.clone`) it checks for that key every
  :data:`POLL_S` seconds. When the key appears, the watcher logs the message, aborts this rank's
  member of the group (on NCCL its pending collectives fail at once) and remembers the message:
  the rank's next synchronized call or :func:`~syncbn_lightning.check_call_order` raises
  :class:`~.call_order.CallOrderError` with it. The C++ path learns of it through the hooks of
  :func:`on_signal` (it checks before each collective without calling Python).

**A watcher lives as long as its job.** It is keyed by the job's id (the one the default store
holds, :func:`.flight.job_id`) and the group's name, and ends, closing its connection, when its
job's default group is destroyed (``destroy_process_group``: seen within :data:`POLL_S`), when
:func:`stop_watchers` is called (``SyncBNCallback``'s teardown; ``revert_sync_batchnorm``, for
the groups no other live layer queues flags on), when the store goes away, and at interpreter exit
(joined before the interpreter finalizes).

On gloo an abort does not end a collective already waiting on the host; those end when the
publishing rank's process exits and its connections close (it raised). Only SyncBN's own groups
are aborted, never the default group (``groups`` keeps SyncBN's collectives in groups of their
own).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch.distributed as dist

from .._compat import store_connection
from . import flight
from .collectives import process_group

__all__ = [
    "POLL_S",
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
#: How often a watcher checks its group's key and whether its job still runs (seconds).
POLL_S = 0.2
# How long stop_watchers waits for each watcher to end (it ends within POLL_S).
_JOIN_S = 2.0

# Keys are (the job's id, group name): group names repeat from job to job.
# Mismatches published by another rank of a group this process watches: key -> message.
_signalled: dict[tuple[str, str], str] = {}
# Groups whose mismatch this rank published (its watcher stays quiet).
_published: set[tuple[str, str]] = set()
_lock = threading.Lock()
# Called with whether a mismatch may be signalled, each time that changes (functional/native.py
# tells the C++ path).
_signal_hooks: list[Callable[[bool], None]] = []
#: How many times :func:`stop_watchers` ran: whoever started a watcher at one value starts it
#: again once this differs (a C++ layer plan, ``nn/sync_plan.py``; read as an attribute, per call).
watch_epoch = 0


class _Watcher:
    """One group's watcher: its thread, its stop event and the default group of its job."""

    __slots__ = ("key", "stop", "thread", "world")

    def __init__(self, key: tuple[str, str], world: Any) -> None:
        self.key, self.stop, self.world = key, threading.Event(), weakref.ref(world)
        self.thread: threading.Thread | None = None

    def job_running(self) -> bool:
        """Whether the default group this watcher started in is still the process's."""
        world = self.world()
        return world is not None and dist.is_initialized() and dist.GroupMember.WORLD is world


_watchers: dict[tuple[str, str], _Watcher] = {}
# (the default group, as a weak reference, and its job's id): the id asked of the store once.
_job: tuple[Any, str] | None = None


def _store() -> Any:
    """The job's store (the default group's), or ``None`` without one."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a default group made without a store
        return None


def _job_id() -> str | None:
    """The running job's id (``None`` outside a job), asked of the store once per job."""
    global _job
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.GroupMember.WORLD
    if _job is None or _job[0]() is not world:
        _job = (weakref.ref(world), flight.job_id())
    return _job[1]


def signalled() -> bool:
    """Whether another rank published a mismatch of a group this process watches (any job):
    read at each synchronized call, so a dict's truth value and nothing more."""
    return bool(_signalled)


def published_message() -> str | None:
    """The message another rank of this job published for a group this process watches, or
    ``None``; drops messages of earlier jobs of this process."""
    job = _job_id() if _signalled else None
    for key in list(_signalled):
        if key[0] == job:
            return _signalled[key]
        del _signalled[key]
        if not _signalled:
            _notify(False)
    return None


def on_signal(hook: Callable[[bool], None]) -> None:
    """Call ``hook(signalled())`` now and each time it changes (once per hook)."""
    if hook not in _signal_hooks:
        _signal_hooks.append(hook)
        hook(signalled())


def _notify(signalled_now: bool) -> None:
    for hook in _signal_hooks:
        try:
            hook(signalled_now)
        except Exception as exc:  # the watcher thread must not die of a hook
            _log.debug("syncbn_lightning: a signal hook failed: %s", exc)


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
    store, job = _store(), _job_id()
    if store is not None and job is not None:
        _published.add((job, group))
        try:
            rank = dist.get_rank()
            store.set(_KEY + group, f"global rank {rank} found: {message}")
        except Exception as exc:  # the store is gone: the job is ending anyway
            _log.debug("syncbn_lightning: could not publish the mismatch: %s", exc)
    abort_group(group)


def watch_group(group: str) -> None:
    """Start this process's watcher of ``group`` (once per group and job; see the module
    docstring). Cheap when already started: a dict lookup."""
    job = _job_id()
    if job is None or (job, group) in _watchers:
        return
    with _lock:
        if (job, group) in _watchers:
            return
        watcher = _Watcher((job, group), dist.GroupMember.WORLD)
        _watchers[watcher.key] = watcher  # also when no watcher runs: asked once per job
        try:
            connection = store_connection(_store())
        except Exception as exc:  # a store that cannot be cloned: the error still ends this rank
            _log.debug("syncbn_lightning: no watcher for group %s: %s", group, exc)
            return
        name = f"syncbn-abort-watch-{group}"
        watcher.thread = threading.Thread(
            target=_watch, args=(connection, watcher), name=name, daemon=True
        )
        watcher.thread.start()


def stop_watchers(keep: Collection[str] = ()) -> None:
    """End every watcher of this process but those of the groups named in ``keep``, and close
    their connections (they end by themselves when their job's default group is destroyed): the
    callback's teardown and interpreter exit stop them all, ``revert_sync_batchnorm`` those no
    other live layer needs. A later SyncBN group, conversion or queued flag starts them again."""
    global watch_epoch
    with _lock:
        watchers = [w for w in _watchers.values() if w.key[1] not in keep]
        for watcher in watchers:
            del _watchers[watcher.key]
        watch_epoch += 1
    for watcher in watchers:
        watcher.stop.set()
    for watcher in watchers:
        if watcher.thread is not None and watcher.thread is not threading.current_thread():
            watcher.thread.join(_JOIN_S)
            if watcher.thread.is_alive():  # in a store request that outlasts the join
                _log.warning(
                    "SyncBN: the call-order watcher of group %s did not end within %.0f s of "
                    "its stop (a store request still runs); going on without it",
                    watcher.key[1],
                    _JOIN_S,
                )


def watcher_threads() -> list[threading.Thread]:
    """The watcher threads of this process still running."""
    return [t for t in threading.enumerate() if t.name.startswith("syncbn-abort-watch-")]


def _watch(connection: Any, watcher: _Watcher) -> None:
    """The watcher thread: check the group's key until it appears, the job ends or it is
    stopped; on the key, log, remember and abort. Its connection is closed as it ends."""
    _job, group = watcher.key
    message = None
    try:
        while not watcher.stop.wait(POLL_S) and watcher.job_running():
            if connection.check([_KEY + group]):
                message = bytes(connection.get(_KEY + group)).decode()
                break
    except Exception:  # the store went away with the job
        pass
    finally:
        del connection  # the clone's socket (or file handle) closes here
        with _lock:
            if _watchers.get(watcher.key) is watcher and message is None:
                del _watchers[watcher.key]  # ended with its job: a new job starts anew
    if message is None or watcher.key in _published:
        return  # nothing published, or this rank found it, raised, and aborted the group
    _signalled[watcher.key] = message
    _notify(True)
    _log.error(
        "syncbn_lightning: a SyncBatchNorm call-order mismatch in sync group %s ended it: %s",
        group,
        message,
    )
    abort_group(group)


atexit.register(stop_watchers)
