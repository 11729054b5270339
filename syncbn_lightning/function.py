"""The synchronized BatchNorm autograd Function (layer 3).

Forward, per layer call (four dispatcher calls, the ``syncbn::`` operators of :mod:`.ops` or the
same steps of :mod:`.reference`):
    1. ``stats_row``: this rank's row ``[count, samples, layer_tag, call_tag, mean[C], m2[C]]``
       (Welford statistics; ``count`` values per channel, ``samples`` = ``N``; the tags say which
       layer and which of its calls this is, see "Call order" below), written by the kernel into
       the buffer that is gathered;
    2. ONE all-gather of the rows over the group (``torch.distributed``'s functional collectives,
       so that ``torch.compile`` traces it);
    3. ``merge_normalize``: count-weighted Chan merge of the gathered rows, the running-stat update
       (in place, skipped when the merged statistics are not finite) and the normalization, with
       the layer's activation applied in the same kernel when it has one (see :mod:`.activation`).

Backward:
    1. ``grad_sums``: local ``[sum(dy), sum(dy * (x - mean))]`` packed for the collective, plus the
       local weight/bias gradients, which are NOT all-reduced here (DDP averages parameter
       gradients);
    2. ONE collective summing the packed sums over the group (an all-reduce, or on CPU an
       all-gather whose rows the next step sums in rank order, see ``_sum_over_group``), only when
       the input needs a gradient;
    3. ``grad_input``: the elementwise input gradient with the group-wide count.
With a fused activation both backward steps recompute its input from the saved input and use
``dy * act'(z)`` in place of ``dy``; nothing else changes (one collective each way).

"Synchronized" means the group is normalized as one batch: with per-rank counts ``n_r`` the mean is
``sum_r n_r mean_r / sum_r n_r``, so uneven batches are exact, and a rank with an empty batch
(``N = 0``) contributes ``n_r = 0`` but still joins both collectives. Nothing reads device memory
on the host, except on CUDA in eager mode when the local batch has fewer than 2 values per channel
(to raise torch's error when the whole group has just one); the CPU kernels check it for free.

Call order: the gathered rows carry each call's layer and call tags, checked by the merge (see
:mod:`.call_order`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import reference
from .call_order import queue_order_check, raise_if_out_of_order, row_tags
from .groups import group_name_of
from .impl import check_impl
from .ops import uses_extension
from .reference import CALL_ORDER_MARK, TAG_LIMIT

if TYPE_CHECKING:  # data_parallel imports this module (through batchnorm)
    from .data_parallel import ReplicaGroup

__all__ = [
    "STATS_MODES",
    "check_stats_mode",
    "SyncBatchNormFunction",
    "sync_batch_norm",
    "group_name_of",
    "TAG_LIMIT",
]

STATS_MODES = ("N", "default")


def check_stats_mode(stats_mode: Any) -> str:
    """``stats_mode`` if it is one of :data:`STATS_MODES`, else a ValueError naming them."""
    if stats_mode not in STATS_MODES:
        raise ValueError(
            f"stats_mode must be 'N' (ranks weighed by their number of samples: the statistics "
            f"of the concatenated batch) or 'default' (every non-empty rank weighs the same), "
            f"got {stats_mode!r}"
        )
    return str(stats_mode)


# Up to this many ranks, CPU (gloo) groups sum by all_gather + local sum instead of all_reduce.
_GATHER_SUM_MAX_RANKS = 8


class SyncBatchNormFunction(torch.autograd.Function):
    """``apply(input, weight, bias, running_mean, running_var, num_batches_tracked, nonfinite,
    calls, momentum, eps, group_name, world_size, unbiased, layer_tag, impl,
    equal_rank_weights, act, act_param)``.

    ``group_name`` names the process group for torch's functional collectives (``None``: no
    torch.distributed, nothing to communicate), or is the
    :class:`~syncbn_lightning.data_parallel.ReplicaGroup` of a DataParallel replica;
    ``running_*``, ``num_batches_tracked`` and ``nonfinite`` (optional) are updated in place;
    ``calls`` is the layer's int64 call counter;
    ``impl``: ``"auto"``, ``"ext"``, ``"ref"`` or ``None`` (``SYNCBN_IMPL``);
    ``equal_rank_weights``: ``stats_mode="default"`` (see :func:`_equal_rank_rows`);
    ``act``, ``act_param``: the fused activation (:data:`.activation.ACTIVATIONS`; 0 is none).

    Returns ``(output, mean, var, info)``: the normalized input (differentiable), and, not
    differentiable, the group mean, the group variance used for the running-stat update (unbiased
    when ``unbiased``) and ``info = [count, samples, order_ok, finite]``: the group's element count
    per channel and number of samples (the sum of every rank's ``N``; it rides in the same
    collective, so batch-size tracking costs no communication).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        num_batches_tracked: torch.Tensor | None,
        nonfinite: torch.Tensor | None,
        calls: torch.Tensor,
        momentum: float | None,
        eps: float,
        group_name: str | ReplicaGroup | None,
        world_size: int,
        unbiased: bool,
        layer_tag: int,
        impl: str | None = None,
        equal_rank_weights: bool = False,
        act: int = 0,
        act_param: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        fused = uses_extension(input.device.type, impl)
        ops: Any = torch.ops.syncbn if fused else reference
        row = ops.stats_row(input, layer_tag, calls)
        rows = row if group_name is None else _all_gather(row, group_name, world_size)
        ranks = None
        if equal_rank_weights:
            rows, ranks = _equal_rank_rows(rows, input.shape[1])
        try:
            output, mean, invstd, var, info = ops.merge_normalize(
                input,
                rows,
                weight,
                bias,
                running_mean,
                running_var,
                num_batches_tracked,
                nonfinite,
                momentum,
                eps,
                unbiased,
                *((act, act_param) if act else ()),
            )
        except RuntimeError as exc:
            if CALL_ORDER_MARK not in str(exc):
                raise
            raise_if_out_of_order(row_tags(rows, input.shape[1]), group_name)
            raise
        if input.device.type != "cpu":
            queue_order_check(info, rows, input.shape[1], group_name)
            if input.numel() < 2 * input.shape[1] and not torch.compiler.is_compiling():
                reference.check_group_count(int(info[0].item()), input, world_size)
        if ranks is not None:
            info = _per_rank_count(info, ranks, input)
        ctx.save_for_backward(input, weight, mean, invstd, info, bias if act else None)
        ctx.activation = (act, act_param) if act else ()
        ctx.group_name = group_name
        ctx.world_size = world_size
        ctx.fused = fused
        ctx.mark_non_differentiable(mean, var, info)
        return output, mean, var, info

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_output: torch.Tensor | None, *_unused: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            # create_graph=True: the result must refuse a second derivative rather than give a
            # silently wrong one. Only then, as once_differentiable costs host time per call.
            return _backward_once(ctx, grad_output)
        return _backward(ctx, grad_output)


def _backward(ctx: Any, grad_output: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The layer's backward: local sums, ONE collective, the input gradient."""
    if grad_output is None:  # grads are not materialized: nothing flows back through output
        return _NO_GRADS
    input, weight, mean, invstd, info, bias = ctx.saved_tensors
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    ops: Any = torch.ops.syncbn if ctx.fused else reference
    # The activation's arguments only when there is one: the plain layer's calls stay as they were.
    act = (bias, *ctx.activation) if ctx.activation else ()
    sums, grad_weight, grad_bias = ops.grad_sums(grad_output, input, mean, invstd, weight, *act)
    grad_input = None
    if need_input:
        if ctx.group_name is not None:
            sums = _sum_over_group(sums, ctx.group_name, ctx.world_size)
        grad_input = ops.grad_input(grad_output, input, mean, invstd, weight, sums, info, *act)
    return (
        grad_input,
        grad_weight if need_weight else None,
        grad_bias if need_bias else None,
        *_NO_GRADS[3:],
    )


_NO_GRADS: tuple[None, ...] = (None,) * 18  # one per argument of forward
_backward_once = once_differentiable(_backward)


def sync_batch_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    process_group: dist.ProcessGroup | None,
    world_size: int,
    unbiased: bool = True,
    layer_tag: int = 0,
    calls: torch.Tensor | None = None,
    impl: str | None = None,
    stats_mode: str = "N",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Functional form of :class:`SyncBatchNormFunction` without running statistics.

    ``layer_tag`` and ``calls`` (an int64 counter on the input's device, incremented per call)
    identify the call for the call-order check; equal on all ranks for the same layer and call.
    ``impl``: ``"auto"``, ``"ext"``, ``"reference"`` or ``None`` (the ``SYNCBN_IMPL`` default);
    ``stats_mode``: ``"N"`` or ``"default"``, see :class:`~syncbn_lightning.SyncBatchNorm`.

    Returns:
        ``(output, mean, var, count, samples)``: ``count`` and ``samples`` are 0-d tensors.
    """
    if calls is None:
        calls = torch.zeros(1, dtype=torch.long, device=input.device)
    output, mean, var, info = SyncBatchNormFunction.apply(
        input,
        weight,
        bias,
        None,
        None,
        None,
        None,
        calls,
        None,
        eps,
        group_name_of(process_group),
        world_size,
        unbiased,
        layer_tag,
        check_impl(impl),
        check_stats_mode(stats_mode) == "default",
    )
    return output, mean, var, info[0], info[1]


def _equal_rank_rows(rows: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered rows reweighted so that every rank with a non-empty batch weighs the same
    (``stats_mode="default"``): each such rank's count becomes the mean count ``n / R`` (``R``
    non-empty ranks) and its ``M2`` that count times its biased variance. The count-weighted
    merge of these rows gives ``mean = sum_r mean_r / R`` and ``var = sum_r (var_r + (mean_r -
    mean)^2) / R`` (mmcv's equal-weight statistics) with the group's true count ``n``, so the
    unbiased running variance and the small-group check are as in ``"N"`` mode. Also returns
    ``R`` (a 0-d tensor). Equal batches leave the rows unchanged."""
    table = rows.view(-1, reference.ROW_HEADER + 2 * channels)
    counts = table[:, :1]
    nonempty = (counts > 0).to(table.dtype)
    ranks = nonempty.sum()
    share = counts.sum() / ranks.clamp_min(1)
    m2 = table[:, reference.ROW_HEADER + channels :] * (share / counts.clamp_min(1))
    head = table[:, 1 : reference.ROW_HEADER + channels]
    return torch.cat([nonempty * share, head, m2], dim=1).view(-1), ranks


def _per_rank_count(info: torch.Tensor, ranks: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``info`` for the backward of ``stats_mode="default"``: the count ``R * n_r``. Each of this
    rank's ``n_r`` values weighs ``1 / (R n_r)`` in the statistics, so the input gradient is the
    count-weighted one with that count in place of the group's."""
    local = input.numel() // max(input.shape[1], 1)
    return torch.cat([(ranks * local).reshape(1).to(info.dtype), info[1:]])


def _sum_over_group(
    sums: torch.Tensor, group_name: str | ReplicaGroup, world_size: int
) -> torch.Tensor:
    """``sums`` of every rank of the group, ONE collective: all-reduced (``[2C]``), or on CPU with
    small groups all-gathered (``[W * 2C]``, summed in rank order by ``grad_input``).

    gloo's all_gather of a few KB has the lower latency (0.26 vs 0.37 ms median for 2 ranks on the
    2-core CI machine, and a much shorter tail), and the fixed summation order makes the result
    bitwise identical on every rank. Large groups and CUDA tensors (NCCL) use all_reduce.
    """
    in_process = not isinstance(group_name, str)  # DataParallel replicas: gathered, then summed
    if in_process or (sums.device.type == "cpu" and world_size <= _GATHER_SUM_MAX_RANKS):
        return _all_gather(sums, group_name, world_size)
    group = _gloo_group_of_cuda_tensor(sums, group_name)
    if group is not None:
        summed = sums.clone()  # grad_sums' parameter gradients may view ``sums``
        dist.all_reduce(summed, group=group)
        return summed
    collectives = torch.ops._c10d_functional
    return collectives.wait_tensor(collectives.all_reduce(sums, "sum", group_name))


def _all_gather(
    tensor: torch.Tensor, group_name: str | ReplicaGroup, world_size: int
) -> torch.Tensor:
    """Every rank's 1-D ``tensor`` concatenated in rank order (``[world_size * numel]``): ONE
    collective, torch's functional form, which torch.compile traces.

    (Calling the process group directly in eager mode saves ~23 us of host time per collective in
    isolation, but nothing measurable in a layer step: that overhead overlaps the collective.)
    """
    if not isinstance(group_name, str):  # the replicas of nn.DataParallel: an in-process exchange
        return group_name.all_gather(tensor)
    group = _gloo_group_of_cuda_tensor(tensor, group_name)
    if group is not None:
        gathered = tensor.new_empty(world_size * tensor.numel())
        dist.all_gather_into_tensor(gathered, tensor, group=group)
        return gathered
    collectives = torch.ops._c10d_functional
    gathered = collectives.all_gather_into_tensor(tensor, world_size, group_name)
    return collectives.wait_tensor(gathered)


def _gloo_group_of_cuda_tensor(tensor: torch.Tensor, group_name: str) -> Any:
    """The process group ``group_name`` if ``tensor`` is a CUDA tensor and the group is gloo's (in
    eager mode), else None.

    torch 2.11's functional collectives kill the process (SIGSEGV) for CUDA tensors on a gloo
    group (e.g. two ranks sharing one GPU, where NCCL refuses), while the process group's own
    collectives work there: such calls take those instead. The lookup costs about 1 us.
    """
    if tensor.device.type != "cuda" or torch.compiler.is_compiling():
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    return group if dist.get_backend(group) == "gloo" else None


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """``output`` = every rank's ``input`` concatenated along dim 0 (torch 2.13 renamed
    ``all_gather_into_tensor`` to ``all_gather_single``); looked up per call so that wrappers
    installed on ``torch.distributed`` (profilers, counters) see it. For eager-only helpers
    (monitoring); the layer itself uses :func:`_all_gather`."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)
