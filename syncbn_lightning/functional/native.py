"""The C++ path of a synchronized layer call: ``syncbn::sync_batch_norm``, one operator per
direction (``csrc/layer/layer.cpp``).

The built-in exchanges (gather, reduce) run the same steps as :class:`~.function
.SyncBatchNormFunction`, with the same kernels, collectives and flight records, from C++: the
forward is one call from Python, and its backward is an autograd node in C++, which runs Python
only through the hand-off operators below. Which layer calls take it is the layer's plan's choice
(:mod:`syncbn_lightning.functional.layer_call`): eager CPU tensors with the extension's kernels.

Python runs during such a call only through six operators whose schemas the extension
declares and whose kernels are registered here (:func:`register_python_kernels`):

* ``syncbn::call_order_failed``: the ranks' call-order tags disagree; raises
  :class:`~syncbn_lightning.CallOrderError` naming each rank's layer, as the Python path does
  (gathering the ranks' tags where the payload was summed: an error path every rank of the group
  takes at the same call);
* ``syncbn::queued_order_failed``: a call-order flag the C++ path queued (a call on a device
  whose flags would cost a host sync to read: CUDA) read 0 when a later call or
  :func:`~syncbn_lightning.check_call_order` read it; raises the error from what this rank holds,
  after telling the group's other ranks (:mod:`~syncbn_lightning.distributed.call_order.watcher`);
* ``syncbn::raise_if_published``: another rank published a mismatch (the watcher said so through
  ``syncbn::order_signal``); raises its error before this rank joins another collective;
* ``syncbn::collective_failed``: a collective raised; logs what the flight recorder knows, then
  ``syncbn::raise_if_published_for`` raises the CallOrderError another rank published for the
  group, if one did (the reason the collective failed), else the C++ code rethrows the
  collective's own error;
* ``syncbn::flight_open``: the first collective of a job makes this process's flight recorder.

The queued flags themselves never reach Python: they wait in the C++ path's order ring
(``csrc/layer/order_ring.h``: a pinned slot and an event per flag, polled before each later
collective without a host sync), which :func:`~syncbn_lightning.check_call_order` drains through
``syncbn::order_ring_drain`` (registered with :func:`~syncbn_lightning.distributed.call_order
.register_queue`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .._shared import ROW_HEADER
from ..distributed import flight
from ..distributed.call_order import (
    raise_if_out_of_order,
    raise_if_published,
    raise_if_published_for,
    register_queue,
    report_queued_failure,
    watcher,
)
from ..distributed.collectives import all_gather, report_collective_failure
from ..ops.reference.steps import own_tags
from .exchange import SyncCall, raise_backward_order
from .gather import _report_order
from .options import SyncOptions
from .reduce import _report_mismatch
from .registry import get_exchange

__all__ = ["KINDS", "native_op", "register_python_kernels"]

#: ``csrc/layer/layer.h``'s ``Mismatch``: where a call-order mismatch was found.
KINDS = ("gathered_rows", "reduce_sums", "backward_sums")

_registered = False
_lock = threading.Lock()
_library: list[torch.library.Library] = []  # kept alive: dropping a Library deregisters it


def _order_failed(
    kind: int,
    data: torch.Tensor,
    aux: torch.Tensor,
    width: int,
    group: str | None,
    world_size: int,
    layer_tag: int,
    at_once: bool,
) -> None:
    """Raise the CallOrderError of a mismatch the C++ path found (``KINDS[kind]``) in ``data``
    (the gathered rows, the reduce exchange's vector sent, the backward's summed sums; ``aux``:
    the summed vector, the merge's grad_info), one rank's share ``width`` values long.
    ``at_once``: found by every rank of the group at this call, which may then gather the ranks'
    tags to name each rank's layer; else a queued flag read later, reported from what this rank
    holds, never through a collective (the other ranks are elsewhere by now)."""
    if KINDS[kind] == "gathered_rows":
        _report_order(data, (width - ROW_HEADER) // 3, group)
    elif KINDS[kind] == "reduce_sums" and at_once:
        own = torch.tensor(own_tags(data), dtype=torch.float64)
        tags = all_gather(own, group, world_size, flight.check_note(layer_tag))
        raise_if_out_of_order(tags.view(-1, 2), group)
    elif KINDS[kind] == "reduce_sums":
        _report_mismatch(data, aux, world_size, group)
    else:
        call = SyncCall(group, world_size, layer_tag, get_exchange("gather"), SyncOptions(), True)
        raise_backward_order(data, width, aux, call, gather=at_once)


def _call_order_failed(*args: Any) -> None:
    """``syncbn::call_order_failed``: :func:`_order_failed` of a mismatch every rank found at
    this call (the arguments: the operator's)."""
    _order_failed(*args, at_once=True)


def _report_queued(*args: Any) -> None:
    """The report of a queued flag that read 0: :func:`_order_failed` from this rank's data."""
    _order_failed(*args, at_once=False)


def _queued_order_failed(
    kind: int,
    data: torch.Tensor,
    aux: torch.Tensor,
    width: int,
    group: str | None,
    world_size: int,
    layer_tag: int,
) -> None:
    """``syncbn::queued_order_failed``: a flag of the C++ path's order ring read 0; raise its
    error after telling the group's other ranks (the arguments: :func:`_order_failed`'s)."""
    args = (kind, data, aux, width, group, world_size, layer_tag)
    report_queued_failure(_report_queued, args, group)


def _order_signal(signalled: bool) -> None:
    """Tell the C++ path whether another rank may have published a mismatch."""
    torch.ops.syncbn.order_signal(signalled)


def _collective_failed(sent: torch.Tensor, op: str, reason: str) -> None:
    report_collective_failure(op, reason)


def _flight_open(like: torch.Tensor) -> None:
    flight.flight_recorder().attach_native()


def register_python_kernels() -> None:
    """Register the kernels of the hand-off operators, the C++ order ring as a queue
    :func:`~syncbn_lightning.check_call_order` drains, and the watcher's signal to the C++ path
    (idempotent; the extension must be loaded)."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        library = torch.library.Library("syncbn", "IMPL")
        for name, kernel in (
            ("call_order_failed", _call_order_failed),
            ("queued_order_failed", _queued_order_failed),
            ("raise_if_published", raise_if_published),
            ("raise_if_published_for", raise_if_published_for),
            ("collective_failed", _collective_failed),
            ("flight_open", _flight_open),
        ):
            library.impl(name, kernel, "CompositeExplicitAutograd")
        _library.append(library)
        register_queue(torch.ops.syncbn.order_ring_drain, torch.ops.syncbn.order_ring_clear)
        watcher.on_signal(_order_signal)
        _registered = True


def native_op() -> Any:
    """The C++ path's operator, ``torch.ops.syncbn.sync_batch_norm.default`` (its arguments:
    ``csrc/layer/layer.cpp``); the extension must be loaded."""
    return torch.ops.syncbn.sync_batch_norm.default
