"""The call-order check: ranks of a sync group must call their SyncBatchNorm layers, forward and
backward, in the same order.

Collectives pair up by order, so a rank that skips a layer, takes another branch or runs a layer a
different number of times would silently merge statistics of different layers. Every exchange
strategy sends each call's layer and call tags with its statistics, and the backward sends them
back with its sums (a 16-value header, see ``ops.reference_steps.grad_sums``), at no extra
collective; both are checked when the payload arrives: when the ranks' tags disagree, every rank
of the group raises :class:`CallOrderError` naming the layers and ranks (all ranks see the same
payload, so they all raise at the same call, and none is left waiting). A backward mismatch
usually means a layer's output was not used in the loss on some rank (its backward never runs
there); the error says so and how to fix it. On CPU tensors the check runs at once (the payload
is in host memory); compiled code raises the kernel's RuntimeError with the same facts, since a
compiled graph cannot re-raise a Python exception type. On CUDA tensors a check would cost a host
sync per layer, so the strategy leaves a flag on the device and queues it with
:func:`queue_order_check`; :func:`check_call_order` reads the queued flags together (the callback
calls it once per training step; the queue is also checked whenever it holds ``_MAX_PENDING``
calls). A mismatch that changes the payload size (e.g. the skipped layer has another channel
count) cannot be told apart by the payload: gloo then aborts the rank whose receive size does not
match within seconds, NCCL fails the collective at its timeout; the flight recorder
(:mod:`.flight`) names the first collective at which the ranks differed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import flight
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


_BACKWARD_FIX = (
    "A synchronized layer's backward runs only on the ranks whose loss depends on its output, and "
    "each such backward joins a collective of the whole group: an auxiliary head used on some "
    "ranks only, or a branch the data skipped, leaves the other ranks one collective short. Use "
    "every synchronized layer's output in the loss on every rank (e.g. `loss = loss + 0 * "
    "out.sum()` where it is not needed), or put a layer that need not be trained in eval mode on "
    "every rank (eval mode does not synchronize)."
)


class CallOrderError(RuntimeError):
    """Ranks of one sync group called their SyncBatchNorm layers in different orders."""


# Unchecked CUDA calls: (flags on the device, index of the order flag, the function that raises
# the error if the flag is 0, its arguments).
_pending: list[tuple[torch.Tensor, int, Callable[..., None], tuple[Any, ...]]] = []


def register_layer_name(tag: int, name: str) -> None:
    """Remember that layer tag ``tag`` is the layer called ``name`` (for error messages and the
    flight records, which keep the names beside the tags)."""
    flight.register_layer_name(tag, name)


def layer_text(tag: float) -> str:
    """The name of the layer whose tag is ``tag``, quoted, for messages."""
    return flight.layer_text(tag)


def call_order_error(what: str, ranks: list[int], backward: bool = False) -> CallOrderError:
    """The error for a mismatch among ``ranks`` (global ranks of the group); ``what`` says which
    rank ran which layer; ``backward``: found by the backward's exchange. Logs what the flight
    recorder knows first (:func:`.flight.report_failure`)."""
    flight.report_failure("a SyncBatchNorm call-order mismatch")
    if backward:
        return CallOrderError(
            f"The backward passes of SyncBatchNorm layers ran in a different order on the ranks of "
            f"one sync group (global ranks {ranks}): {what}. {_BACKWARD_FIX}"
        )
    return CallOrderError(
        f"SyncBatchNorm layers were called in a different order on the ranks of one sync group "
        f"(global ranks {ranks}): {what}. {_FIX}"
    )


def raise_if_out_of_order(tags: torch.Tensor, group: Group, backward: bool = False) -> None:
    """Raise :class:`CallOrderError` unless every row of ``tags`` (``[W, 2]`` gathered
    ``(layer_tag, call_tag)`` on the host, one row per rank of ``group``) is the same;
    ``backward``: the tags came with the backward's sums."""
    if bool((tags == tags[0]).all()):
        return
    ranks = group_ranks(group, tags.shape[0])
    pairs = zip(ranks, tags.tolist(), strict=True)
    rows = [(rank, int(layer), int(call)) for rank, (layer, call) in pairs]
    ran = "ran the backward of" if backward else "ran"
    what = "; ".join(f"rank {r} {ran} {layer_text(layer)} (call #{c + 1})" for r, layer, c in rows)
    if backward:
        first, other = rows[0], next(row for row in rows if row[1:] != rows[0][1:])
        what += (
            f" (e.g. the output of {layer_text(first[1])} was not used in the loss on rank "
            f"{other[0]})"
        )
    raise call_order_error(what, ranks, backward)


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
