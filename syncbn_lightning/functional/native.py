"""The C++ path of a synchronized layer call: ``syncbn::sync_batch_norm``, one operator per
direction (``csrc/layer.cpp``).

The built-in exchanges (gather, reduce) run the same steps as :class:`~.function
.SyncBatchNormFunction`, with the same kernels, collectives and flight records, from C++: the
forward is one call from Python, and its backward is an autograd node in C++, so a backward
runs no Python at all. Which layer calls take it is the layer's plan's choice
(:mod:`syncbn_lightning.nn.sync_plan`): eager CPU tensors with the extension's kernels.

Python runs during such a call only when it fails, through three operators whose schemas the
extension declares and whose kernels are registered here (:func:`register_python_kernels`):

* ``syncbn::call_order_failed``: the ranks' call-order tags disagree; raises
  :class:`~syncbn_lightning.CallOrderError` naming each rank's layer, as the Python path does
  (gathering the ranks' tags where the payload was summed: an error path every rank of the group
  takes at the same call);
* ``syncbn::collective_failed``: a collective raised; logs what the flight recorder knows, then
  the C++ code rethrows the collective's own error;
* ``syncbn::flight_open``: the first collective of a job makes this process's flight recorder.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..distributed import flight
from ..distributed.call_order import raise_if_out_of_order
from ..distributed.collectives import all_gather, report_collective_failure
from ..ops.reference_steps import own_tags
from .exchange import SyncCall, raise_backward_order
from .gather import row_tags
from .options import SyncOptions
from .registry import get_exchange

__all__ = ["KINDS", "native_op", "register_python_kernels"]

#: ``csrc/layer.h``'s ``Mismatch``: where a call-order mismatch was found.
KINDS = ("gathered_rows", "reduce_sums", "backward_sums")

_registered = False
_lock = threading.Lock()
_library: list[torch.library.Library] = []  # kept alive: dropping a Library deregisters it


def _call_order_failed(
    kind: int,
    data: torch.Tensor,
    aux: torch.Tensor,
    width: int,
    group: str | None,
    world_size: int,
    layer_tag: int,
) -> None:
    """Raise the CallOrderError of a mismatch the C++ path found (``KINDS[kind]``)."""
    if KINDS[kind] == "gathered_rows":
        channels = (width - 4) // 3
        raise_if_out_of_order(row_tags(data, channels), group)
    elif KINDS[kind] == "reduce_sums":
        own = torch.tensor(own_tags(data), dtype=torch.float64)
        tags = all_gather(own, group, world_size, flight.check_note(layer_tag))
        raise_if_out_of_order(tags.view(-1, 2), group)
    else:
        call = SyncCall(group, world_size, layer_tag, get_exchange("gather"), SyncOptions(), True)
        raise_backward_order(data, width, aux, call, gather=True)


def _collective_failed(sent: torch.Tensor, op: str, reason: str) -> None:
    report_collective_failure(op, reason)


def _flight_open(like: torch.Tensor) -> None:
    flight.flight_recorder().attach_native()


def register_python_kernels() -> None:
    """Register the kernels of the three error-path operators (idempotent; the extension must be
    loaded)."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        library = torch.library.Library("syncbn", "IMPL")
        for name, kernel in (
            ("call_order_failed", _call_order_failed),
            ("collective_failed", _collective_failed),
            ("flight_open", _flight_open),
        ):
            library.impl(name, kernel, "CompositeExplicitAutograd")
        _library.append(library)
        _registered = True


def native_op() -> Any:
    """The C++ path's operator, ``torch.ops.syncbn.sync_batch_norm.default`` (its arguments:
    ``csrc/layer.cpp``); the extension must be loaded."""
    return torch.ops.syncbn.sync_batch_norm.default
