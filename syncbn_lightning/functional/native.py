"""The C++ path of a synchronized layer call: ``syncbn::sync_batch_norm``, one operator per
direction (``csrc/layer/layer.cpp``).

The built-in exchanges (gather, reduce) run the same steps as :class:`~.function
.SyncBatchNormFunction`, with the same kernels, collectives and flight records, from C++: the
forward is one call from Python, and its backward is an autograd node in C++, so a backward
runs no Python at all. Which layer calls take it is the layer's plan's choice
(:mod:`syncbn_lightning.nn.sync_plan`): eager CPU tensors with the extension's kernels.

Python runs during such a call only when it fails, when it leaves a call-order flag for later
(CUDA), or at a job's first collective, through four operators whose schemas the extension
declares and whose kernels are registered here (:func:`register_python_kernels`):

* ``syncbn::call_order_failed``: the ranks' call-order tags disagree; raises
  :class:`~syncbn_lightning.CallOrderError` naming each rank's layer, as the Python path does
  (gathering the ranks' tags where the payload was summed: an error path every rank of the group
  takes at the same call);
* ``syncbn::collective_failed``: a collective raised; logs what the flight recorder knows, then
  the C++ code rethrows the collective's own error;
* ``syncbn::flight_open``: the first collective of a job makes this process's flight recorder;
* ``syncbn::order_flag_queued``: a call on a device whose flags would cost a host sync to read
  (CUDA) hands its flag to the one queue of both paths
  (:func:`~syncbn_lightning.distributed.call_order.queue_order_check`), after polling the flags
  queued before: a pinned copy behind an event, read at later calls without a host sync, nothing
  queued while a CUDA graph is captured, a mismatch published to the group's other ranks.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .._shared import ROW_HEADER
from ..distributed import flight
from ..distributed.call_order import poll_order_checks, queue_order_check, raise_if_out_of_order
from ..distributed.collectives import all_gather, report_collective_failure
from ..ops.reference import check_group_count
from ..ops.reference_steps import own_tags
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


def _queued_order_failed(*args: Any) -> None:
    """The report of a flag ``syncbn::order_flag_queued`` queued that read 0:
    :func:`_order_failed` from this rank's data."""
    _order_failed(*args, at_once=False)


def _order_flag_queued(
    flags: torch.Tensor,
    index: int,
    kind: int,
    data: torch.Tensor,
    aux: torch.Tensor,
    width: int,
    group: str | None,
    world_size: int,
    layer_tag: int,
    tiny_input: torch.Tensor | None,
) -> None:
    """Poll the flags queued before (raising on a mismatch), then queue ``flags[index]`` with
    what its report needs; with ``tiny_input``, check the group's count on the host (as the
    Python path does: fewer than two values per channel on this rank), except while capturing."""
    poll_order_checks()
    queue_order_check(
        flags,
        index,
        _queued_order_failed,
        kind,
        data,
        aux,
        width,
        group,
        world_size,
        layer_tag,
        group=group,
    )
    if tiny_input is not None and not (
        tiny_input.is_cuda and torch.cuda.is_current_stream_capturing()
    ):
        check_group_count(int(flags[0].item()), tiny_input, world_size)


def _collective_failed(sent: torch.Tensor, op: str, reason: str) -> None:
    report_collective_failure(op, reason)


def _flight_open(like: torch.Tensor) -> None:
    flight.flight_recorder().attach_native()


def register_python_kernels() -> None:
    """Register the kernels of the four hand-off operators (idempotent; the extension must be
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
            ("order_flag_queued", _order_flag_queued),
        ):
            library.impl(name, kernel, "CompositeExplicitAutograd")
        _library.append(library)
        _registered = True


def native_op() -> Any:
    """The C++ path's operator, ``torch.ops.syncbn.sync_batch_norm.default`` (its arguments:
    ``csrc/layer/layer.cpp``); the extension must be loaded."""
    return torch.ops.syncbn.sync_batch_norm.default
