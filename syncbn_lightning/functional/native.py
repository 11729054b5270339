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

from ..distributed.call_order.checks import (
    raise_if_published,
    raise_if_published_for,
    register_queue,
    report_queued_failure,
    watcher,
)
from ..distributed.collectives import report_collective_failure
from ..distributed.flight import recorder as flight
from .order_report import KINDS, report, report_queued

__all__ = ["KINDS", "native_op", "register_python_kernels"]


_registered = False
_lock = threading.Lock()
_library: list[torch.library.Library] = []  # kept alive: dropping a Library deregisters it


def _call_order_failed(*args: Any) -> None:
    """``syncbn::call_order_failed``: the report of a mismatch every rank found at this call
    (the arguments: the operator's, :func:`~.order_report.report`'s)."""
    report(*args, at_once=True)


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
    error after telling the group's other ranks (the arguments: :func:`~.order_report.report`'s,
    without ``at_once``)."""
    args = (kind, data, aux, width, group, world_size, layer_tag)
    report_queued_failure(report_queued, args, group)


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
