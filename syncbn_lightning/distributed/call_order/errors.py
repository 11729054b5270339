"""The call-order check's errors: :class:`CallOrderError` and its messages, naming each rank's
layer (:mod:`.call_order` runs the checks; the names come from the flight recorder, which keeps
them beside the tags).
"""

from __future__ import annotations

import torch

from ..collectives import Group, group_ranks
from ..flight import recorder as flight
from ..flight.file import layer_text

__all__ = [
    "CallOrderError",
    "call_order_error",
    "raise_if_out_of_order",
    "register_layer_name",
]

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


def register_layer_name(tag: int, name: str) -> None:
    """Remember that layer tag ``tag`` is the layer called ``name`` (for error messages and the
    flight records, which keep the names beside the tags)."""
    flight.register_layer_name(tag, name)


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
