"""The call-order checks: at once where the flag is on the host, queued where reading it would
cost a host sync (and read at later calls or by :func:`check_call_order`), and the raise that
names each rank's layer (the package's docstring says why and how)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..._shared import ORDER_FLAG_SLOTS
from ..collectives import Group, group_ranks, on_failure
from ..flight.file import layer_text
from . import watcher
from .errors import (
    CallOrderError,
    call_order_error,
    raise_if_out_of_order,
    register_layer_name,
)

__all__ = [
    "CallOrderError",
    "call_order_error",
    "check_call_order",
    "layers_with_status",
    "mark_status_used",
    "poll_order_checks",
    "queue_order_check",
    "raise_if_out_of_order",
    "raise_if_published",
    "raise_if_published_for",
    "register_queue",
    "report_queued_failure",
    "note_order_flag",
    "register_layer_name",
    "register_order_status",
]

# Queued flags before a host sync reads them all (bounds memory where the device runs far behind).
_MAX_PENDING = ORDER_FLAG_SLOTS
# Unchecked calls on the device: (flags, index of the order flag, the function that raises the
# error if the flag is 0, its arguments, the group, the flag's host copy or None).
_Entry = tuple[torch.Tensor, int, Callable[..., None], tuple[Any, ...], Group, "_FlagCopy | None"]
_pending: list[_Entry] = []
_poll_lock = threading.Lock()  # one poller at a time (DataParallel's replica threads)
# Queues of flags kept elsewhere (the C++ path's order ring): (drain, clear) functions. ``drain``
# reads every flag (a host sync) and raises the error of the first that reads 0; ``clear`` drops
# them.
_queues: list[tuple[Callable[[], None], Callable[[], None]]] = []
_queue_lock = threading.Lock()  # every change of _pending from eager code (compiled code appends)


class _FlagCopy:
    """A call's order flag copied to pinned host memory behind the call's kernels, with an event
    after the copy: :meth:`ready` asks the event (no host sync), :meth:`ok` then reads the copy.
    On CPU (tests of the device path) the copy is made at once."""

    __slots__ = ("event", "host")

    def __init__(self, host: torch.Tensor, event: Any) -> None:
        self.host, self.event = host, event

    @staticmethod
    def of(flags: torch.Tensor, index: int) -> _FlagCopy | None:
        """The copy of ``flags[index]``; ``None`` on a device without CUDA events, and while a
        CUDA graph is being captured (a pinned allocation or an event query would end the
        capture; a later call copies it), whose flags :func:`check_call_order` reads."""
        flag = flags.narrow(0, index, 1)
        if flag.device.type == "cpu":
            return _FlagCopy(flag.clone(), None)
        if flag.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return None
        host = torch.empty(1, dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _FlagCopy(host, event)

    def ready(self) -> bool:
        """Whether the device has written the copy (never asked while a graph is captured)."""
        if self.event is None:
            return True
        return not torch.cuda.is_current_stream_capturing() and bool(self.event.query())

    def ok(self) -> bool:
        """Whether the flag says the ranks' tags agreed (only once :meth:`ready`)."""
        return bool(self.host[0])


# Compiled calls note their flags on the layer instead (a compiled graph cannot append to a list
# at run time, least of all in a backward): each layer with a status registers a weak reference to
# a method returning (its status or None, its layer tag, its group), read by check_call_order.
_statuses: list[weakref.WeakMethod] = []
# Set by compiled code that passes a status (see mark_status_used): until then there is nothing
# to read, and an eager step on CUDA must not pay a copy of every layer's status.
_status_used = False


# The schema is written out: torch 2.4 cannot infer it from this module's string annotations.
@torch.library.custom_op(
    "syncbn_lightning::note_order_flag",
    mutates_args=("status",),
    schema="(Tensor(a!) status, Tensor order_ok, Tensor call_tag, bool backward) -> ()",
)
def note_order_flag(
    status: torch.Tensor, order_ok: torch.Tensor, call_tag: torch.Tensor, backward: bool
) -> None:
    """Note a compiled call's order flag on its layer: ``status = [failed, call tag, backward]``
    of the first failed call (float32, on the layer's device); ``order_ok``: one value, 0 for a
    mismatch; ``call_tag``: the call's tag; ``backward``: the flag is the backward's. Device ops
    only: no host sync. An operator that mutates ``status``, so that a compiled forward or
    backward keeps it (a Python side effect would be dropped from the graph)."""
    failed = (order_ok.reshape(()) == 0).to(status.dtype)
    first = (failed > 0) & (status[0] == 0)
    noted = torch.stack([failed, call_tag.reshape(()).to(status.dtype), failed * float(backward)])
    status.copy_(torch.where(first, noted, status))


@note_order_flag.register_fake
def _note_order_flag_fake(
    status: torch.Tensor, order_ok: torch.Tensor, call_tag: torch.Tensor, backward: bool
) -> None:
    return None


def mark_status_used() -> None:
    """Say that compiled code notes flags on layer statuses: :func:`check_call_order` reads them
    at its next call. Called from traced code, whose compiled graph stores the flag at each
    call (a global store is a side effect torch.compile keeps)."""
    global _status_used
    _status_used = True


def register_order_status(entry: Callable[[], tuple[torch.Tensor | None, int, Group]]) -> None:
    """Have :func:`check_call_order` read a layer's status: ``entry``, a bound method of the
    layer (held weakly), returns its status (see :func:`note_order_flag`), tag and group."""
    _statuses.append(weakref.WeakMethod(entry))  # type: ignore[arg-type]


def layers_with_status() -> list[Any]:
    """The live layers whose status :func:`check_call_order` reads (those placed where calls
    queue their order flags), in the order they were placed."""
    methods = (ref() for ref in _statuses)
    return [method.__self__ for method in methods if method is not None]


def check_call_order() -> None:
    """Check every call-order flag queued by CUDA layers and not yet read (one host sync), and
    whether another rank published a mismatch (:mod:`.watcher`).

    Raises:
        CallOrderError: on every rank of a group whose ranks called layers in different orders.
    """
    global _status_used
    raise_if_published()
    if _status_used:
        _status_used = False
        _check_statuses()
    for drain, _clear in _queues:
        drain()
    with _queue_lock:
        queued = _pending[:]
        # Only what was read: compiled code appends without the lock, at the end.
        del _pending[: len(queued)]
    if not queued:
        return
    flags = torch.stack([entry[0][entry[1]] for entry in queued]).cpu()
    for ok, entry in zip(flags.tolist(), queued, strict=True):
        if not ok:
            _fail(entry)


def register_queue(drain: Callable[[], None], clear: Callable[[], None]) -> None:
    """Have :func:`check_call_order` read another queue of flags with ``drain`` (reads every
    flag, raising the error of the first that reads 0), and a found mismatch drop it with
    ``clear`` (once per pair; the C++ path's order ring registers itself)."""
    if (drain, clear) not in _queues:
        _queues.append((drain, clear))


def report_queued_failure(report: Callable[..., None], args: tuple[Any, ...], group: Group) -> None:
    """A flag of another queue (see :func:`register_queue`) read 0: drop every queue, raise
    ``report(*args)``'s error, and first tell the other ranks of ``group``, as for a flag of
    this module's queue."""
    _fail((torch.zeros(1), 0, report, args, group, None))


def _check_statuses() -> None:
    """Read the layers' statuses noted by compiled calls (one copy per device) and raise naming
    every failed layer, after telling the group (the statuses are cleared)."""
    entries = [entry() for entry in _statuses]
    _statuses[:] = [ref for ref, entry in zip(_statuses, entries, strict=True) if entry is not None]
    noted = [entry() for entry in entries if entry is not None]
    by_device: dict[torch.device, list[tuple[torch.Tensor, int, Group]]] = {}
    for status, layer, group in noted:
        if status is not None:
            by_device.setdefault(status.device, []).append((status, layer, group))
            if isinstance(group, str):  # compiled calls plan nothing: their groups, from here on
                watcher.watch_group(group)
    failed: list[tuple[int, int, bool, Group]] = []
    for rows in by_device.values():
        values = torch.stack([status for status, _, _ in rows]).cpu()
        for (status, layer, group), row in zip(rows, values.tolist(), strict=True):
            bad, call, backward = row
            if bad:
                status.zero_()
                failed.append((layer, int(call), bool(backward), group))
    if failed:
        group = failed[0][3]
        _fail((torch.zeros(1), 0, _report_compiled, (failed, group), group, None))


def _report_compiled(failed: list[tuple[int, int, bool, Group]], group: Group) -> None:
    """Flags noted by compiled calls: ``(layer tag, call tag, backward, group)`` of each layer
    whose status failed, in the order the layers were placed (a status keeps only this rank's
    layer and call)."""
    backward = any(row[2] for row in failed)
    calls = ", ".join(
        f"{'the backward of ' if back else ''}{layer_text(layer)} (call #{call + 1})"
        for layer, call, back, _ in failed
    )
    raise call_order_error(
        f"on this rank, compiled code found a mismatch at {calls}: another rank ran a different "
        f"layer's or call's there (compiled code notes only this rank's layers; the flight "
        f"records name the others'; with exchange='reduce' the ranks may also hold different "
        f"running_mean buffers)",
        group_ranks(group, 1) if isinstance(group, str) else [],
        backward,
    )


def poll_order_checks() -> None:
    """Read, oldest first, the queued flags the device has already written (an event query
    each: no host sync) and raise on the first mismatch; raise if another rank published one.
    Runs before each synchronized call's collective, forward and backward, so a mismatch is
    found within the calls of the step it happened in, a few layers after the device got
    there."""
    if torch.compiler.is_compiling() or not (_pending or watcher.signalled()):
        return
    raise_if_published()
    if not _poll_lock.acquire(blocking=False):
        return  # another thread (a DataParallel replica) is reading the queue
    try:
        _poll_queue()
    finally:
        _poll_lock.release()


def _poll_queue() -> None:
    """:func:`poll_order_checks`' loop over the queue, oldest first."""
    while True:
        with _queue_lock:  # the head is taken whole: another thread may clear the queue
            if not _pending:
                return
            entry = _pending[0]
            copy = entry[5]
            if copy is None:  # queued by compiled code: copy it now (not while capturing)
                copy = _FlagCopy.of(entry[0], entry[1])
                if copy is None:
                    return
                entry = _pending[0] = (*entry[:5], copy)
            if not copy.ready():
                return
            del _pending[0]
        if not copy.ok():
            _fail(entry)


def queue_order_check(
    flags: torch.Tensor,
    index: int,
    report: Callable[..., None],
    *args: Any,
    group: Group = None,
) -> None:
    """Queue the device-side order flag ``flags[index]`` (nonzero: in order) with
    ``report(*args)``, which raises the error if it is 0 (called, and ``flags`` indexed, only
    then; ``report`` a module-level function, so that compiled code can queue it too). The flag
    is read by :func:`poll_order_checks` once the device has written it, or by
    :func:`check_call_order`. ``group``: the call's group name, whose ranks learn of a mismatch
    this rank finds (:mod:`.watcher`)."""
    if torch.compiler.is_compiling():
        _pending.append((flags, index, report, args, group, None))
        return
    if flags.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # a captured graph's flags hold nothing yet, and each replay rewrites them
    entry = (flags, index, report, args, group, _FlagCopy.of(flags, index))
    with _queue_lock:
        _pending.append(entry)
        full = len(_pending) >= _MAX_PENDING
    if full:
        check_call_order()


def _fail(entry: _Entry) -> None:
    """A queued flag is 0: drop the queue, raise the entry's error, and first tell the other
    ranks of its group (they may be waiting in a collective this rank will never join)."""
    _clear_queues()
    _flags, _index, report, args, group, _copy = entry
    try:
        report(*args)
    except Exception as exc:
        if isinstance(group, str):
            watcher.publish_mismatch(group, str(exc))
        raise


def _clear_queues() -> None:
    """Drop every queued flag, this module's and the other queues' (a mismatch was found: the
    ranks have parted, and the flags queued since mean nothing)."""
    with _queue_lock:
        _pending.clear()
    for _drain, clear in _queues:
        clear()


def raise_if_published_for(group: str | None) -> None:
    """After a collective of ``group`` failed: raise :class:`CallOrderError` with the mismatch
    another rank published for it (asking the job's store at once, not waiting for the
    watcher), the reason the collective failed; nothing if none (the caller re-raises the
    collective's own error)."""
    message = watcher.published_for(group) if group is not None else None
    if message is not None:
        _clear_queues()
        raise CallOrderError(
            f"A SyncBatchNorm collective failed because another rank of its sync group found a "
            f"call-order mismatch and ended the group: {message}"
        )


def raise_if_published() -> None:
    """Raise :class:`CallOrderError` with the mismatch another rank of one of this process's
    sync groups published (:mod:`.watcher`), dropping every queued flag; nothing if none."""
    message = watcher.published_message()
    if message is not None:
        _clear_queues()
        raise CallOrderError(
            f"Another rank of this rank's SyncBatchNorm sync group found a call-order mismatch "
            f"and ended the group: {message}"
        )


on_failure(raise_if_published_for)  # the Python path's collectives (the C++ path asks itself)
