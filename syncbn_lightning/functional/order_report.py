"""A call-order mismatch of a built-in exchange, reported one way on both paths.

A built-in strategy says where a mismatch is found (:class:`~.exchange.OrderCheck`: the kind,
the data and one rank's share of it) and computes nothing else about it; the call checks or
queues the flag (:mod:`.function`, and the C++ path's hand-off operators in :mod:`.native`), and
on a flag that
reads 0 this module names every rank's layer: from the gathered rows, or, where the ranks' tags
were summed, from tags gathered now (an error path every rank of the group takes at the same
call), or, for a queued flag read later, from this rank's tags alone (the other ranks are
elsewhere by then).
"""

from __future__ import annotations

from typing import Any

import torch

from .._shared import GRAD_HEADER, REDUCE_HEADER, ROW_HEADER, SHIFT_MISMATCH
from ..distributed.call_order.checks import call_order_error, raise_if_out_of_order
from ..distributed.collectives import all_gather, group_ranks
from ..distributed.flight import recorder as flight
from ..distributed.flight.file import layer_text
from ..ops.reference.steps import header_tags, own_tags, row_width
from .exchange import OrderCheck

__all__ = ["KINDS", "OrderCheck", "report", "report_queued", "row_tags"]

#: ``csrc/layer/layer.h``'s ``Mismatch``: where a call-order mismatch was found.
KINDS = ("gathered_rows", "reduce_sums", "backward_sums")


def row_tags(rows: torch.Tensor, channels: int) -> torch.Tensor:
    """``[W, 2]``: every gathered row's (layer_tag, call_tag)."""
    return rows.view(-1, row_width(channels))[:, 2:ROW_HEADER]


def report(
    kind: int,
    data: torch.Tensor,
    aux: torch.Tensor | None,
    width: int,
    group: Any,
    world_size: int,
    layer_tag: int,
    at_once: bool = True,
) -> None:
    """Raise the CallOrderError of a mismatch found in ``data`` (see
    :class:`~.exchange.OrderCheck`).
    ``at_once``: every rank of the group found it at this call, and may gather the ranks' tags;
    else a queued flag read later, named from what this rank holds.

    Raises:
        CallOrderError: naming each rank's layer (or this rank's, from a queued flag).
        RuntimeError: the reduce exchange's running means differ (its own fix, no layer to name).
    """
    if KINDS[kind] == "gathered_rows":
        raise_if_out_of_order(row_tags(data, (width - ROW_HEADER) // 3).cpu(), group)
    elif KINDS[kind] == "reduce_sums" and at_once:
        own = torch.tensor(own_tags(data), dtype=torch.float64)
        tags = all_gather(own, group, world_size, flight.check_note(layer_tag))
        raise_if_out_of_order(tags.view(-1, 2), group)
    elif KINDS[kind] == "reduce_sums":
        _report_summed_tags(data, aux, world_size, group)
    else:
        _report_backward(data, width, aux, group, world_size, layer_tag, at_once)


def report_queued(*args: Any) -> None:
    """The report of a queued flag that read 0: :func:`report` from this rank's data (the
    arguments: :func:`report`'s, without ``at_once``)."""
    report(*args, at_once=False)


def _report_summed_tags(sent: torch.Tensor, total: Any, world: int, group: Any) -> None:
    """A queued check of the reduce exchange failed: this rank's tags (the other ranks' were
    summed, not gathered), or the running means."""
    sent, total = sent.cpu(), total.cpu().view(-1, sent.numel()).sum(0)
    same = (total[3:REDUCE_HEADER] == sent[3:REDUCE_HEADER] * world).view(6, 2).all(dim=1)
    if bool(same[:4].all()):
        raise RuntimeError(SHIFT_MISMATCH)
    layer, call = own_tags(sent)
    ranks = group_ranks(group, 1) if isinstance(group, str) else []
    raise call_order_error(
        f"this rank ran {layer_text(layer)} (call #{int(call) + 1}) while another rank ran a "
        f"different layer or call (exchange='reduce' sums the tags, so it cannot name the other "
        f"ranks' layers; exchange='gather' does)",
        ranks,
    )


def _report_backward(
    summed: torch.Tensor,
    width: int,
    grad_info: Any,
    group: Any,
    world_size: int,
    layer_tag: int,
    gather: bool,
) -> None:
    """The backward's tags disagree: raise the CallOrderError naming each rank's layer, read
    from the gathered sums, or, for all-reduced sums, gathered now when ``gather``; from a queued
    check (no collective there), this rank's. This rank's tags are its forward's
    (``grad_info[4:6]``, the values its sums' header encodes: the sums may have been summed in
    place); ``width``: one rank's sums."""
    rows = summed.detach().cpu().view(-1, width)
    if rows.shape[0] > 1:
        tags = torch.tensor([header_tags(row[:GRAD_HEADER]) for row in rows], dtype=torch.float64)
        raise_if_out_of_order(tags, group, backward=True)
        return
    own = grad_info.detach()[4:6].to("cpu", torch.float64)
    if gather:
        note = flight.check_note(layer_tag)
        tags = all_gather(own.to(summed.device), group, world_size, note).cpu()
        raise_if_out_of_order(tags.view(-1, 2), group, backward=True)
        return
    layer, number = (int(v) for v in own.tolist())
    raise call_order_error(
        f"this rank ran the backward of {layer_text(layer)} (call #{number + 1}) while another "
        f"rank ran a different layer's or call's (its summed sums cannot name the others)",
        group_ranks(group, 1) if isinstance(group, str) else [],
        backward=True,
    )
