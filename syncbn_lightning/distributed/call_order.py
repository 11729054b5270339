"""The call-order check: ranks of a sync group must call their SyncBatchNorm layers in the same
order.

Collectives pair up by order, so a rank that skips a layer, takes another branch or runs a layer a
different number of times would silently merge statistics of different layers. Every exchange
strategy sends each call's layer and call tags with its statistics, at no extra collective, and
checks them when the statistics arrive: when they disagree, every rank of the group raises
:class:`CallOrderError` naming the layers and ranks (all ranks see the same payload, so they all
raise at the same call, and none is left waiting). On CPU tensors the check runs at once (the
payload is in host memory); compiled code raises the kernel's RuntimeError with the same facts,
since a compiled graph cannot re-raise a Python exception type. On CUDA tensors a check would
cost a host sync per layer, so the strategy leaves a flag on the device and queues it with
:func:`queue_order_check`; :func:`check_call_order` reads the queued flags together (the callback
calls it once per training step; the queue is also checked whenever it holds ``_MAX_PENDING``
calls). A mismatch that changes the payload size (e.g. the skipped layer has another channel
count) cannot be told apart by the payload: the backend then fails the collective, or it waits
until the process-group timeout and raises; either way the run ends with an error, never a silent
hang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .collectives import Group, group_ranks

__all__ = [
    "CallOrderError",
    "call_order_error",
    "check_call_order",
    "layer_text",
    "queue_order_check",
    "raise_if_out_of_order",
    "register_layer_name",
]

# Queued CUDA call-order checks before one is forced (bounds memory; one host sync per this many).
_MAX_PENDING = 1024
_FIX = (
    "Every rank must run every SyncBatchNorm layer of the group in the same order and the same "
    "number of times per training forward (a rank skipped a layer, took another branch, or ran a "
    "different number of BN calls); otherwise statistics of different layers would be merged. "
    "Make the forward identical on all ranks, or put layers that only some ranks run in eval mode."
)


class CallOrderError(RuntimeError):
    """Ranks of one sync group called their SyncBatchNorm layers in different orders."""


_layer_names: dict[int, str] = {}
# Unchecked CUDA calls: (flags on the device, index of the order flag, the function that raises
# the error if the flag is 0, its arguments).
_pending: list[tuple[torch.Tensor, int, Callable[..., None], tuple[Any, ...]]] = []


def register_layer_name(tag: int, name: str) -> None:
    """Remember that layer tag ``tag`` is the layer called ``name`` (for error messages)."""
    _layer_names[tag] = name


def layer_text(tag: float) -> str:
    """The name of the layer whose tag is ``tag``, quoted, for messages."""
    return repr(_layer_names.get(int(tag), f"<SyncBatchNorm tag {int(tag)}>"))


def call_order_error(what: str, ranks: list[int]) -> CallOrderError:
    """The error for a mismatch among ``ranks`` (global ranks of the group); ``what`` says which
    rank ran which layer."""
    return CallOrderError(
        f"SyncBatchNorm layers were called in a different order on the ranks of one sync group "
        f"(global ranks {ranks}): {what}. {_FIX}"
    )


def raise_if_out_of_order(tags: torch.Tensor, group: Group) -> None:
    """Raise :class:`CallOrderError` unless every row of ``tags`` (``[W, 2]`` gathered
    ``(layer_tag, call_tag)`` on the host, one row per rank of ``group``) is the same."""
    if bool((tags == tags[0]).all()):
        return
    ranks = group_ranks(group, tags.shape[0])
    calls = [
        f"rank {rank} ran {layer_text(layer)} (call #{int(call) + 1})"
        for rank, (layer, call) in zip(ranks, tags.tolist(), strict=True)
    ]
    raise call_order_error("; ".join(calls), ranks)


def check_call_order() -> None:
    """Check the call-order flags queued by CUDA layers since the last check (one host sync).

    Raises:
        CallOrderError: on every rank of a group whose ranks called layers in different orders.
    """
    if not _pending:
        return
    queued = list(_pending)
    _pending.clear()
    flags = torch.stack([flags[index] for flags, index, _, _ in queued]).cpu()
    for ok, (_, _, report, args) in zip(flags.tolist(), queued, strict=True):
        if not ok:
            report(*args)


def queue_order_check(
    flags: torch.Tensor, index: int, report: Callable[..., None], *args: Any
) -> None:
    """Queue the device-side order flag ``flags[index]`` (nonzero: in order) for
    :func:`check_call_order`, with ``report(*args)``, which raises the error if it is 0 (called,
    and ``flags`` indexed, only then: no work per call beyond the append; ``report`` a module-level
    function, so that compiled code can queue it too)."""
    _pending.append((flags, index, report, args))
    if len(_pending) >= _MAX_PENDING and not torch.compiler.is_compiling():
        check_call_order()
