"""Ending every rank of a sync group when one rank finds a call-order mismatch after the fact.

On CUDA tensors a call's order flag is read later, without a host sync (:mod:`.call_order`). By
the time a rank reads a failed flag, the ranks have parted: one rank ran a layer the others did
not, so some rank's device may wait in a collective that no other rank will join. Raising on the
rank that read the flag is not enough: NCCL would keep the others waiting until the collective
timeout, each naming nothing. So the rank that finds a mismatch *publishes* it:

* it writes the error message under a key of the job's store (``syncbn/abort/<group name>``) and
  aborts its own member of SyncBN's group;
* every rank that queues flags on a group runs one watcher thread for it, blocked in a wait for
  that key on its own connection to the store (:meth:`torch.distributed.Store.clone`). When the
  key appears, the watcher logs the message, aborts this rank's member of the group (on NCCL its
  pending collectives fail at once) and remembers the message: the rank's next synchronized call
  or :func:`~syncbn_lightning.check_call_order` raises :class:`~.call_order.CallOrderError` with it.

On gloo an abort does not end a collective already waiting on the host; those end when the
publishing rank's process exits and its connections close (it raised). Only SyncBN's own groups
are aborted, never the default group (``groups`` keeps SyncBN's collectives in groups of their
own).
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .collectives import process_group

__all__ = [
    "abort_group",
    "publish_mismatch",
    "published_message",
    "signalled",
    "watch_group",
]

_log = logging.getLogger(__name__)

_KEY = "syncbn/abort/"
# The watcher's wait: long enough never to time out in a job (a timeout logs two lines in c10d);
# it ends when the key appears or the store goes away with the job.
_WAIT = timedelta(days=7)

# Keys are (id of the job's store, group name): a new job's default group brings a new store,
# and group names repeat from job to job.
# Mismatches published by another rank of a group this process watches: key -> message.
_signalled: dict[tuple[int, str], str] = {}
# Groups watched, and groups whose mismatch this rank published (its watcher stays quiet).
_watched: set[tuple[int, str]] = set()
_published: set[tuple[int, str]] = set()
_lock = threading.Lock()


def _store() -> Any:
    """The job's store (the default group's), or ``None`` without one."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a default group made without a store
        return None


def signalled() -> bool:
    """Whether another rank published a mismatch of a group this process watches (any job):
    read at each synchronized call, so a dict's truth value and nothing more."""
    return bool(_signalled)


def published_message() -> str | None:
    """The message another rank of this job published for a group this process watches, or
    ``None``; drops messages of earlier jobs of this process."""
    store = _store()
    for key in list(_signalled):
        if store is not None and key[0] == id(store):
            return _signalled[key]
        del _signalled[key]
    return None


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
    store = _store()
    if store is not None:
        _published.add((id(store), group))
        try:
            rank = dist.get_rank()
            store.set(_KEY + group, f"global rank {rank} found: {message}")
        except Exception as exc:  # the store is gone: the job is ending anyway
            _log.debug("syncbn_lightning: could not publish the mismatch: %s", exc)
    abort_group(group)


def watch_group(group: str) -> None:
    """Start this process's watcher of ``group`` (once per group and job; see the module
    docstring). Cheap when already started: a set lookup."""
    store = _store()
    if store is None or (id(store), group) in _watched:
        return
    with _lock:
        if (id(store), group) in _watched:
            return
        _watched.add((id(store), group))
    try:
        connection = store.clone()
    except Exception as exc:  # a store that cannot be cloned: the error still ends this rank
        _log.debug("syncbn_lightning: no watcher for group %s: %s", group, exc)
        return
    name = f"syncbn-abort-watch-{group}"
    key = (id(store), group)
    threading.Thread(target=_watch, args=(connection, key), name=name, daemon=True).start()


def _watch(connection: Any, key: tuple[int, str]) -> None:
    """The watcher thread: wait for the group's key; on it, log, remember and abort."""
    group = key[1]
    try:
        connection.wait([_KEY + group], _WAIT)
        message = bytes(connection.get(_KEY + group)).decode()
    except Exception:  # the store went away (the job ended) or the wait timed out
        return
    if key in _published:
        return  # this rank found it, raised, and aborted the group already
    _signalled[key] = message
    _log.error(
        "syncbn_lightning: a SyncBatchNorm call-order mismatch in sync group %s ended it: %s",
        group,
        message,
    )
    abort_group(group)
