"""The call-order check: ranks of a sync group must call their SyncBatchNorm layers in the same
order (layer 3, beside the Function).

Call order: collectives pair up by order, so a rank that skips a layer, takes another branch or runs
a layer a different number of times would silently merge statistics of different layers. The tags in
the gathered rows catch it at no extra collective: when the rows disagree, every rank of the group
raises :class:`CallOrderError` naming the layers and ranks (all ranks see the same rows, so they all
raise at the same call, and none is left waiting). On CPU tensors the merge kernel checks at once
(the rows are in host memory); compiled code raises the kernel's RuntimeError with the same facts,
since a compiled graph cannot re-raise a Python exception type. On CUDA tensors a check would cost a
host sync per layer, so the merge writes an order flag on the device and the rows are queued and
checked together by :func:`check_call_order` (the callback calls it once per training step; the
queue is also checked whenever it holds ``_MAX_PENDING`` calls). A mismatch that changes the
payload size (e.g. the skipped layer has another channel count) cannot be told apart by the
payload: the backend then fails the collective, or it waits until the process-group timeout and
raises; either way the run ends with an error, never a silent hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .reference import ROW_HEADER

__all__ = [
    "REDUCE_ROWS",
    "SHIFT_MISMATCH",
    "CallOrderError",
    "check_call_order",
    "queue_order_check",
    "raise_if_out_of_order",
    "register_layer_name",
    "row_tags",
]

#: ``channels`` of a queued check from the reduce exchange (:mod:`.exchange`): its "rows" are this
#: rank's ``[order_ok, shift_ok, layer_tag, call_tag]``, since no rank sees the others' tags.
REDUCE_ROWS = -1
#: The error when the ranks of a group shifted their sums by different running means.
SHIFT_MISMATCH = (
    "syncbn call order: the ranks of one sync group hold different running_mean buffers in a "
    "layer with exchange='reduce', which shifts every rank's sums by its running mean and needs "
    "the same one on every rank (as it is after every synchronized update). Load the same "
    "checkpoint on every rank, keep the buffers in sync, or use exchange='gather'."
)
# Queued CUDA call-order checks before one is forced (bounds memory; one host sync per this many).
_MAX_PENDING = 1024


class CallOrderError(RuntimeError):
    """Ranks of one sync group called their SyncBatchNorm layers in different orders."""


_layer_names: dict[int, str] = {}
# (info, gathered rows, channels, group name) of CUDA calls not checked yet.
_pending: list[tuple[torch.Tensor, torch.Tensor, int, str | None]] = []


def register_layer_name(tag: int, name: str) -> None:
    """Remember that layer tag ``tag`` is the layer called ``name`` (for error messages)."""
    _layer_names[tag] = name


def _layer_text(tag: float) -> str:
    return repr(_layer_names.get(int(tag), f"<SyncBatchNorm tag {int(tag)}>"))


def _group_ranks(group_name: str | None, world_size: int) -> list[int]:
    if not isinstance(group_name, str) or not dist.is_initialized():
        return list(range(world_size))  # no process group (DataParallel replicas: their indices)
    from torch.distributed.distributed_c10d import _resolve_process_group

    return list(dist.get_process_group_ranks(_resolve_process_group(group_name)))


def raise_if_out_of_order(tags: torch.Tensor, group_name: str | None) -> None:
    """``tags``: ``[W, 2]`` gathered (layer_tag, call_tag) rows, on the host."""
    if bool((tags == tags[0]).all()):
        return
    ranks = _group_ranks(group_name, tags.shape[0])
    calls = [
        f"rank {ranks[i]} ran {_layer_text(layer)} (call #{int(call) + 1})"
        for i, (layer, call) in enumerate(tags.tolist())
    ]
    raise CallOrderError(
        f"SyncBatchNorm layers were called in a different order on the ranks of one sync group "
        f"(global ranks {ranks}): {'; '.join(calls)}. Every rank must run every SyncBatchNorm "
        f"layer of the group in the same order and the same number of times per training "
        f"forward (a rank skipped a layer, took another branch, or ran a different number of BN "
        f"calls); otherwise statistics of different layers would be merged. Make the forward "
        f"identical on all ranks, or put layers that only some ranks run in eval mode."
    )


def row_tags(rows: torch.Tensor, channels: int) -> torch.Tensor:
    return rows.view(-1, ROW_HEADER + 2 * channels)[:, 2:ROW_HEADER]


def check_call_order() -> None:
    """Check the call-order tags queued by CUDA layers since the last check (one host sync).

    Raises:
        CallOrderError: on every rank of a group whose ranks called layers in different orders.
    """
    if not _pending:
        return
    queued = list(_pending)
    _pending.clear()
    flags = torch.stack([info[2] for info, _, _, _ in queued]).cpu()
    for ok, (_, rows, channels, group_name) in zip(flags.tolist(), queued, strict=True):
        if ok:
            continue
        if channels == REDUCE_ROWS:
            _raise_reduce_mismatch(rows.cpu(), group_name)
        raise_if_out_of_order(row_tags(rows, channels).cpu(), group_name)


def _raise_reduce_mismatch(status: torch.Tensor, group_name: str | None) -> None:
    """A failed check of the reduce exchange: ``status = [order_ok, shift_ok, layer, call]`` of
    this rank (the other ranks' tags were summed, not gathered)."""
    order_ok, _, layer, call = status.tolist()
    if order_ok:
        raise RuntimeError(SHIFT_MISMATCH)
    ranks = _group_ranks(group_name, 1) if isinstance(group_name, str) else []
    raise CallOrderError(
        f"SyncBatchNorm layers were called in a different order on the ranks of one sync group "
        f"(global ranks {ranks}): this rank ran {_layer_text(layer)} (call #{int(call) + 1}) "
        f"while another rank ran a different layer or call (exchange='reduce' sums the tags, so "
        f"it cannot name the other ranks' layers; exchange='gather' does). Every rank must run "
        f"every SyncBatchNorm layer of the group in the same order and the same number of times "
        f"per training forward; make the forward identical on all ranks, or put layers that "
        f"only some ranks run in eval mode."
    )


def queue_order_check(
    info: torch.Tensor, rows: torch.Tensor, channels: int, group_name: str | None
) -> None:
    """Queue a device-side order flag (``info[2]``) for :func:`check_call_order`, with the rows
    whose tags name the layers if it is 0 (read only then: no work per call beyond the append)."""
    _pending.append((info, rows, channels, group_name))
    if len(_pending) >= _MAX_PENDING and not torch.compiler.is_compiling():
        check_call_order()
