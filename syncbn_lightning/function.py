"""The synchronized BatchNorm autograd Function (layer 3).

Forward, per layer call:
    1. local per-channel statistics ``(count, mean, m2)`` with Welford (kernel ``local_stats``);
    2. ONE ``all_gather_single`` (``all_gather_into_tensor``) of every rank's packed row
       ``[count, samples, layer_tag, call_tag, mean[C], m2[C]]`` (``count`` values per channel,
       ``samples`` = ``N``; the two tags say which layer and which of its calls this is, see
       "Call order" below);
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

Call order: collectives pair up by order, so a rank that skips a layer, takes another branch or runs
a layer a different number of times would silently merge statistics of different layers. The tags in
the gathered rows catch it at no extra collective: when the rows disagree, every rank of the group
raises :class:`CallOrderError` naming the layers and ranks (all ranks see the same rows, so they all
raise at the same call, and none is left waiting). On CPU tensors the check runs at once (the rows
are already in host memory). On CUDA tensors it would cost a host sync per layer, so the rows are
queued and checked together by :func:`check_call_order` (the callback calls it once per training
step; the queue is also checked whenever it holds ``_MAX_PENDING`` calls). A mismatch that changes
the payload size (e.g. the skipped layer has another channel count) cannot be told apart by the
payload: the backend then fails the collective, or it waits until the process-group timeout and
raises; either way the run ends with an error, never a silent hang.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ._backend import ops_for
from .groups import _group_from_key, _group_key

__all__ = [
    "SyncBatchNormFunction",
    "sync_batch_norm",
    "CallOrderError",
    "check_call_order",
    "register_layer_name",
]

# Row layout of the forward collective: [count, samples, layer_tag, call_tag, mean[C], m2[C]].
_HEADER = 4
# Tags are carried in the statistics' float dtype: below 2**24 they are exact even in float32.
TAG_LIMIT = 1 << 24
# Queued CUDA call-order checks before one is forced (bounds memory; one host sync per this many).
_MAX_PENDING = 1024


class CallOrderError(RuntimeError):
    """Ranks of one sync group called their SyncBatchNorm layers in different orders."""


_layer_names: dict[int, str] = {}
_pending: list[tuple[torch.Tensor, int]] = []


def register_layer_name(tag: int, name: str) -> None:
    """Remember that layer tag ``tag`` is the layer called ``name`` (for error messages)."""
    _layer_names[tag] = name


def _layer_text(tag: float) -> str:
    return repr(_layer_names.get(int(tag), f"<SyncBatchNorm tag {int(tag)}>"))


def _group_ranks(group_key: int, world_size: int) -> list[int]:
    group = _group_from_key(group_key)
    if group is None or not dist.is_initialized():
        return list(range(world_size))
    return list(dist.get_process_group_ranks(group))


def _raise_if_out_of_order(tags: torch.Tensor, group_key: int) -> None:
    """``tags``: ``[W, 2]`` gathered (layer_tag, call_tag) rows, on the host."""
    if bool((tags == tags[0]).all()):
        return
    ranks = _group_ranks(group_key, tags.shape[0])
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


def check_call_order() -> None:
    """Check the call-order tags queued by CUDA layers since the last check (one host sync).

    Raises:
        CallOrderError: on every rank of a group whose ranks called layers in different orders.
    """
    if not _pending:
        return
    queued = list(_pending)
    _pending.clear()
    host = torch.stack([tags for tags, _ in queued]).cpu()
    for rows, (_, group_key) in zip(host, queued, strict=True):
        _raise_if_out_of_order(rows, group_key)


class SyncBatchNormFunction(torch.autograd.Function):
    """``apply(input, weight, bias, eps, group_key, world_size, unbiased, layer_tag, call_tag)``.

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
        layer_tag: int = 0,
        call_tag: int = 0,
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
                mean_l.new_full((1,), float(layer_tag % TAG_LIMIT)),
                mean_l.new_full((1,), float(call_tag % TAG_LIMIT)),
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
            _check_tags(gathered[:, 2:_HEADER], group_key)
        else:
            gathered = packed.unsqueeze(0)
        counts = gathered[:, 0]
        if local_count < 2:
            _check_group_count(int(counts.sum().item()), input, world_size)
        mean, invstd, var = ops.merge_stats(
            counts,
            gathered[:, _HEADER : channels + _HEADER],
            gathered[:, channels + _HEADER :],
            eps,
            unbiased,
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
            return (None,) * 9
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
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def sync_batch_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    process_group: dist.ProcessGroup | None,
    world_size: int,
    unbiased: bool = True,
    layer_tag: int = 0,
    call_tag: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Functional form of :class:`SyncBatchNormFunction` taking a process group object.

    ``layer_tag`` and ``call_tag`` identify the call for the call-order check (integers; equal on
    all ranks for the same layer and call)."""
    return SyncBatchNormFunction.apply(
        input,
        weight,
        bias,
        eps,
        _group_key(process_group),
        world_size,
        unbiased,
        layer_tag,
        call_tag,
    )


def _check_tags(tags: torch.Tensor, group_key: int) -> None:
    """Check the gathered tags now (CPU) or queue them for :func:`check_call_order` (CUDA)."""
    if tags.device.type == "cpu":
        _raise_if_out_of_order(tags, group_key)
        return
    _pending.append((tags, group_key))
    if len(_pending) >= _MAX_PENDING:
        check_call_order()


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
