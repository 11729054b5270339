"""The synchronized BatchNorm autograd Function (layer 3).

Forward, per layer call:
    1. local per-channel statistics ``(count, mean, m2)`` with Welford (kernel ``local_stats``);
    2. ONE ``all_gather_single`` (``all_gather_into_tensor``) of every rank's packed row
       ``[count, samples, mean[C], m2[C]]`` (``count`` values per channel, ``samples`` = ``N``);
    3. count-weighted Chan merge of the gathered rows (``merge_stats``): mean, invstd, running var;
    4. elementwise normalization (``normalize``).

Backward:
    1. local ``sum(dy)`` and ``sum(dy * (x - mean))`` (``backward_reduce``), plus the local
       weight/bias gradients, which are NOT all-reduced here (DDP averages parameter gradients);
    2. ONE collective summing the packed ``[sum_dy[C], sum_dy_xmu[C]]`` over the group (an
       ``all_reduce``, or on CPU an ``all_gather`` + local sum, see ``_sum_over_group``), only
       when the input needs a gradient;
    3. the elementwise input gradient (``backward_elemt``) with the group-wide count.

"Synchronized" means the group is normalized as one batch: with per-rank counts ``n_r`` the mean is
``sum_r n_r mean_r / sum_r n_r``, so uneven batches are exact, and a rank with an empty batch
(``N = 0``) contributes ``n_r = 0`` but still joins both collectives. The protocol needs no
host-device synchronization; the host reads the gathered counts only when the local batch has fewer
than 2 values per channel, to raise torch's error when the whole group has just one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ._backend import ops_for
from .groups import _group_from_key, _group_key

__all__ = ["SyncBatchNormFunction", "sync_batch_norm"]


class SyncBatchNormFunction(torch.autograd.Function):
    """``apply(input, weight, bias, eps, group_key, world_size, unbiased)``.

    Returns ``(output, mean, var, count, samples)``: the normalized input (differentiable), and,
    not differentiable, the group mean, the group variance for the running-stat update (unbiased
    when ``unbiased``), the group's element count per channel and its number of samples (the sum
    of every rank's ``N``), both 0-d tensors of the statistics' dtype. ``samples`` rides in the
    same collective, so batch-size tracking costs no communication.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        group_key: int,
        world_size: int,
        unbiased: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ops = ops_for(input)
        channels = input.shape[1]
        local_count = input.numel() // channels
        mean_l, m2_l = ops.local_stats(input)
        # Fills, not torch.tensor([...], device=...): a host-to-device copy from pageable memory
        # synchronizes the stream, which would cost every layer a host sync on CUDA.
        packed = torch.cat(
            [
                mean_l.new_full((1,), float(local_count)),
                mean_l.new_full((1,), float(input.shape[0])),
                mean_l,
                m2_l,
            ]
        )
        # With force_sync a one-rank group still takes the collective path, so that benchmarks of
        # it pay what a real group pays; only without torch.distributed is there nothing to call.
        communicate = dist.is_available() and dist.is_initialized()
        if communicate:
            gathered = packed.new_empty(world_size * packed.numel())
            _all_gather_single(gathered, packed, group=_group_from_key(group_key))
            gathered = gathered.view(world_size, -1)
        else:
            gathered = packed.unsqueeze(0)
        counts = gathered[:, 0]
        if local_count < 2:
            _check_group_count(int(counts.sum().item()), input, world_size)
        mean, invstd, var = ops.merge_stats(
            counts, gathered[:, 2 : channels + 2], gathered[:, channels + 2 :], eps, unbiased
        )
        total = counts.sum()
        samples = gathered[:, 1].sum()
        output = ops.normalize(input, mean, invstd, weight, bias)
        ctx.save_for_backward(input, weight, mean, invstd, total)
        ctx.group_key = group_key
        ctx.communicate = communicate
        ctx.world_size = world_size
        ctx.mark_non_differentiable(mean, var, total, samples)
        return output, mean, var, total, samples

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_output: torch.Tensor, *_unused: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        input, weight, mean, invstd, total = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        if not (need_input or need_weight or need_bias):
            return (None,) * 7
        ops = ops_for(input)
        grad_output = _like(grad_output, input)
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = ops.backward_reduce(
            grad_output, input, mean, invstd, weight, need_weight, need_bias
        )
        grad_input = None
        if need_input:
            if ctx.communicate:
                packed = _sum_over_group(
                    torch.cat([sum_dy, sum_dy_xmu]), ctx.group_key, ctx.world_size
                )
                sum_dy, sum_dy_xmu = packed.chunk(2)
            grad_input = ops.backward_elemt(
                grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, total
            )
        return grad_input, grad_weight, grad_bias, None, None, None, None


def sync_batch_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    process_group: dist.ProcessGroup | None,
    world_size: int,
    unbiased: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Functional form of :class:`SyncBatchNormFunction` taking a process group object."""
    return SyncBatchNormFunction.apply(
        input, weight, bias, eps, _group_key(process_group), world_size, unbiased
    )


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """``output`` = every rank's ``input`` concatenated along dim 0 (torch 2.13 renamed
    ``all_gather_into_tensor`` to ``all_gather_single``); looked up per call so that wrappers
    installed on ``torch.distributed`` (profilers, counters) see it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


# Up to this many ranks, CPU (gloo) groups sum by all_gather + local sum instead of all_reduce.
_GATHER_SUM_MAX_RANKS = 8


def _sum_over_group(packed: torch.Tensor, group_key: int, world_size: int) -> torch.Tensor:
    """The sum of ``packed`` over the group's ranks (ONE collective), identical on every rank.

    On CPU with small groups this gathers every rank's row and sums them in rank order: gloo's
    all_gather of a few KB has the lower latency (0.26 vs 0.37 ms median for 2 ranks on the
    2-core CI machine, and a much shorter tail), and the fixed summation order makes the result
    bitwise identical on every rank. Large groups and CUDA tensors (NCCL) use all_reduce.
    """
    group = _group_from_key(group_key)
    if packed.device.type != "cpu" or world_size > _GATHER_SUM_MAX_RANKS:
        dist.all_reduce(packed, group=group)
        return packed
    gathered = packed.new_empty(world_size * packed.numel())
    _all_gather_single(gathered, packed, group=group)
    return gathered.view(world_size, -1).sum(dim=0)


def _check_group_count(total: int, input: torch.Tensor, world_size: int) -> None:
    if total == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {input.size()} "
            f"(1 value per channel in the whole sync group of {world_size} rank(s))"
        )


def _like(grad: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``input``'s strides (the kernels index both tensors the same way)."""
    if grad.stride() == input.stride():
        return grad
    return torch.empty_like(input).copy_(grad)
