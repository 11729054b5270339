"""The statistics exchange of large sync groups: ONE all-reduce of O(C) values (layer 3).

The gather exchange (:mod:`.function`) all-gathers one row of ``2C + 4`` values per rank: the bytes
every rank receives grow as ``P * C`` and a ring all-gather takes ``P - 1`` steps. The reduce
exchange sends, per rank, the per-channel sums of the batch shifted by ``K``, the layer's running
mean (the same tensor on every rank of a sync group), accumulated in float64::

    [count, samples, nonempty, tag checks[12], S1[C] = w * sum(x - K), S2[C] = w * sum((x - K)^2)]

and sums them over the group with ONE all-reduce (``w = 1`` for ``stats_mode="N"``, ``1 / n_r``
for ``"default"``), so its size is ``8 * (15 + 2C)`` bytes whatever the group size. With
``D = sum(count)`` (``"N"``) or ``sum(nonempty)`` (``"default"``)::

    mean = K + S1 / D,   var = S2 / D - (S1 / D)^2   (biased; running_var: * n / (n - 1))

Numerics: the shift makes ``S2 / D - (S1 / D)^2`` cancel only by ``((mean - K) / std)^2``; at the
first step (``K = 0``) and ``|mean| / std = 1e4`` that is 1e8, which float64 (16 digits) leaves with
~8 correct digits. The float64 mean is then split into ``m_hi + m_lo`` (two acc-dtype numbers) and
the layer normalizes ``((x - m_hi) - m_lo) * invstd``: ``x - m_hi`` is exact in float32 for ``x``
near the mean, so outputs and gradients keep float32's relative precision on the *deviation*
instead of losing ``log10(|mean| / std)`` digits to the rounding of the mean.

Call order: the layer and call tags (and a fingerprint of ``K``) travel as 12-bit chunks ``c`` with
their squares ``c^2``; every rank checks ``sum(c) == P c`` and ``sum(c^2) == P c^2``, which holds on
one rank iff all ranks sent the same chunk (then the chunks' variance over ranks is 0), so all
ranks detect a mismatch at the same call. Only then (an error path every rank takes) do they
all-gather their tags to raise the gather exchange's :class:`~.call_order.CallOrderError`.

Backward is the gather exchange's: local ``[sum(dy), sum(dy * (x - mean))]``, ONE collective
summing them (:func:`.function._sum_over_group`), the elementwise input gradient.

All steps are plain torch operations (the reference twin's style), so they run on every device and
``torch.compile`` traces them into one graph; the fused ``syncbn::`` kernels are not used on this
path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import reference
from .activation import activate, activation_grad, check_activation
from .call_order import REDUCE_ROWS, SHIFT_MISMATCH, queue_order_check, raise_if_out_of_order
from .reference import CALL_ORDER_MARK, TAG_LIMIT

__all__ = [
    "EXCHANGES",
    "AUTO_REDUCE_ABOVE",
    "check_exchange",
    "resolve_exchange",
    "ReduceSyncBatchNormFunction",
    "reduce_payload_numel",
]

EXCHANGES = ("auto", "gather", "reduce")
#: ``exchange="auto"`` reduces in groups of more than this many ranks and gathers up to it.
AUTO_REDUCE_ABOVE = 8
# Header of the reduced vector: count, samples, nonempty, then 6 tag chunks with their squares.
_CHUNK_BITS = 12
_CHUNKS = 6  # layer tag hi/lo, call tag hi/lo, K fingerprint hi/lo
HEADER = 3 + 2 * _CHUNKS


def check_exchange(exchange: Any, name: str = "exchange") -> str:
    """``exchange`` if it is one of :data:`EXCHANGES`, else a ValueError naming ``name``."""
    if exchange not in EXCHANGES:
        raise ValueError(
            f"{name} must be 'gather' (all-gather every rank's statistics: bytes grow with the "
            f"group size), 'reduce' (one all-reduce of per-channel float64 sums: O(C) bytes for "
            f"any group) or 'auto' (reduce in groups of more than {AUTO_REDUCE_ABOVE} ranks), got "
            f"{exchange!r}"
        )
    return str(exchange)


def resolve_exchange(exchange: str, world_size: int, group: Any) -> str:
    """``"gather"`` or ``"reduce"``: what ``exchange`` means for a sync group of ``world_size``
    ranks; ``group`` is the layer's group name, or a DataParallel replica group (in-process, so
    always ``"gather"``)."""
    if group is not None and not isinstance(group, str):
        return "gather"
    if exchange == "auto":
        return "reduce" if world_size > AUTO_REDUCE_ABOVE else "gather"
    return exchange


def reduce_payload_numel(channels: int) -> int:
    """Number of float64 values one reduce-exchange all-reduce carries for ``channels``."""
    return HEADER + 2 * channels


def _chunks(values: list[torch.Tensor]) -> torch.Tensor:
    """12-bit chunks (hi, lo) of non-negative integer-valued float64 scalars ``< 2**24``, each
    followed by its square: ``[c0, c0^2, c1, c1^2, ...]`` (exact in float64, as are their sums
    over up to 2**29 ranks)."""
    base = float(1 << _CHUNK_BITS)
    parts = []
    for value in values:
        hi = torch.div(value, base, rounding_mode="floor")
        parts += [hi, value - hi * base]
    chunks = torch.stack(parts)
    return torch.stack([chunks, chunks * chunks], dim=1).reshape(-1)


def _fingerprint(shift: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A float64 scalar in ``[0, 2**24)`` that differs when ``shift``'s bits differ (a weighted
    sum of its bytes); 0 without a shift."""
    if shift is None:
        return torch.zeros((), dtype=torch.float64, device=device)
    data = shift.detach().contiguous().view(torch.uint8).to(torch.int64)
    weights = torch.arange(1, data.numel() + 1, device=device, dtype=torch.int64) % 65521 + 1
    return ((data * weights).sum() % TAG_LIMIT).to(torch.float64)


def _local_sums(
    input: torch.Tensor,
    shift: torch.Tensor | None,
    layer_tag: int,
    calls: torch.Tensor,
    equal_rank_weights: bool,
) -> torch.Tensor:
    """This rank's vector for the all-reduce (see the module docstring), float64; ``calls`` is
    incremented in place."""
    channels = input.shape[1]
    count = input.numel() // channels if channels else 0
    x = input.to(torch.float64)
    if shift is not None:
        x = x - reference._per_channel(shift.detach().to(torch.float64), input)
    dims = reference._reduce_dims(input)
    s1, s2 = x.sum(dims), (x * x).sum(dims)
    if equal_rank_weights:  # every non-empty rank: its mean and mean square, weight 1
        scale = 1.0 / count if count else 0.0
        s1, s2 = s1 * scale, s2 * scale
    call = (calls.reshape(()) % TAG_LIMIT).to(torch.float64)
    calls.add_(1)
    layer = s1.new_full((), float(layer_tag % TAG_LIMIT))
    head = torch.tensor(
        [float(count), float(input.shape[0]), float(count > 0)],
        dtype=torch.float64,
        device=input.device,
    )
    tags = _chunks([layer, call, _fingerprint(shift, input.device)])
    return torch.cat([head, tags, s1, s2])


def _all_reduce(vector: torch.Tensor, group_name: str | None) -> torch.Tensor:
    """``vector`` summed over the group: ONE all-reduce (functional, so torch.compile traces it;
    the process group's own call for CUDA tensors on gloo groups, see
    :func:`.function._gloo_group_of_cuda_tensor`)."""
    from .function import _gloo_group_of_cuda_tensor

    if group_name is None:
        return vector
    group = _gloo_group_of_cuda_tensor(vector, group_name)
    if group is not None:
        summed = vector.clone()
        dist.all_reduce(summed, group=group)
        return summed
    collectives = torch.ops._c10d_functional
    return collectives.wait_tensor(collectives.all_reduce(vector, "sum", group_name))


def _checks(own: torch.Tensor, total: torch.Tensor, world: int) -> tuple[torch.Tensor, ...]:
    """``(order_ok, shift_ok)``: 0-d bools, whether every rank sent the same layer and call tags,
    and the same running-mean fingerprint (see the module docstring)."""
    same = (total[3:HEADER] == own[3:HEADER] * world).view(_CHUNKS, 2).all(dim=1)
    return same[:4].all(), same[4:].all()


def _merge(
    total: torch.Tensor,
    shift: torch.Tensor | None,
    channels: int,
    eps: float,
    unbiased: bool,
    equal_rank_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, invstd, var)`` in float64 from the summed vector: ``mean = K + S1 / D``, biased
    ``S2 / D - (S1 / D)^2`` for ``invstd``, ``var`` unbiased (``* n / (n - 1)``) when
    ``unbiased``. An all-empty group gives ``mean = 0``, ``var = 0`` (as the gather merge)."""
    n = total[0]
    divisor = (total[2] if equal_rank_weights else n).clamp_min(1)
    d = total[HEADER : HEADER + channels] / divisor
    biased = (total[HEADER + channels :] / divisor - d * d).clamp_min(0)
    mean = d if shift is None else d + shift.detach().to(torch.float64)
    mean = torch.where(n > 0, mean, torch.zeros_like(mean))
    invstd = torch.rsqrt(biased + eps)
    var = biased * (n / (n - 1).clamp_min(1)) if unbiased else biased
    return mean, invstd, var


def _centered(input: torch.Tensor, m_hi: torch.Tensor, m_lo: torch.Tensor) -> torch.Tensor:
    """``(x - m_hi) - m_lo`` in the acc dtype: ``x`` minus the float64 mean without losing the
    digits a rounded mean would (see the module docstring)."""
    x = input.to(m_hi.dtype)
    return (x - reference._per_channel(m_hi, input)) - reference._per_channel(m_lo, input)


def _affine(
    centered: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    input: torch.Tensor,
) -> torch.Tensor:
    scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
    z = centered * reference._per_channel(scale, input)
    return z if bias is None else z + reference._per_channel(bias.to(z.dtype), input)


class ReduceSyncBatchNormFunction(torch.autograd.Function):
    """The reduce exchange: ``apply`` takes the arguments of
    :class:`~syncbn_lightning.function.SyncBatchNormFunction` (``impl`` is ignored: this path is
    plain torch operations) and returns the same ``(output, mean, var, info)``."""

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
        group_name: str | None,
        world_size: int,
        unbiased: bool,
        layer_tag: int,
        impl: str | None = None,
        equal_rank_weights: bool = False,
        act: int = 0,
        act_param: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        check_activation(act, act_param)
        channels = input.shape[1]
        own = _local_sums(input, running_mean, layer_tag, calls, equal_rank_weights)
        total = _all_reduce(own, group_name)
        order_ok, shift_ok = _checks(own, total, world_size)
        _check_order(input, own, order_ok, shift_ok, total, group_name, world_size)
        mean64, invstd64, var64 = _merge(
            total, running_mean, channels, eps, unbiased, equal_rank_weights
        )
        acc = reference.acc_dtype(input.dtype)
        m_hi = mean64.to(acc)
        m_lo = (mean64 - m_hi.to(torch.float64)).to(acc)
        invstd, var = invstd64.to(acc), var64.to(acc)
        finite = torch.isfinite(mean64).all() & torch.isfinite(var64).all()
        with torch.no_grad():
            if num_batches_tracked is not None:
                num_batches_tracked.add_(finite.to(num_batches_tracked.dtype))
            if nonfinite is not None:
                nonfinite.add_((~finite).to(nonfinite.dtype))
            if running_mean is not None and running_var is not None:
                reference._update_running(
                    running_mean,
                    running_var,
                    mean64,
                    var64,
                    finite & (total[0] > 0),
                    momentum,
                    num_batches_tracked,
                )
        count = total[0]
        if equal_rank_weights:  # each of this rank's values weighs 1 / (R n_r): see function.py
            count = total[2] * float(_own_count(input))
        info = torch.stack([total[0], total[1], order_ok.to(torch.float64), finite.double()])
        grad_info = torch.stack([count, total[1]]).to(acc)
        centered = _centered(input, m_hi, m_lo)
        z = _affine(centered, invstd, weight, bias, input)
        output = activate(z, act, act_param).to(input.dtype)
        ctx.save_for_backward(input, weight, m_hi, m_lo, invstd, grad_info, bias if act else None)
        ctx.activation = (act, act_param)
        ctx.group_name = group_name
        ctx.world_size = world_size
        info = info.to(acc)
        ctx.mark_non_differentiable(m_hi, var, info)
        return output, m_hi, var, info

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_output: torch.Tensor | None, *_unused: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: refuse a second derivative
            return _backward_once(ctx, grad_output)
        return _backward(ctx, grad_output)


def _own_count(input: torch.Tensor) -> int:
    """Values per channel in this rank's ``input``."""
    return input.numel() // input.shape[1] if input.shape[1] else 0


def _check_order(
    input: torch.Tensor,
    own: torch.Tensor,
    order_ok: torch.Tensor,
    shift_ok: torch.Tensor,
    total: torch.Tensor,
    group_name: str | None,
    world_size: int,
) -> None:
    """Raise (CPU), assert in the graph (compiled CPU) or queue (other devices, checked by
    :func:`~syncbn_lightning.check_call_order`) the call-order and shift checks; on CPU a group
    with one value per channel raises torch's error."""
    ok = order_ok & shift_ok
    if input.device.type != "cpu":
        status = torch.stack([order_ok, shift_ok, ok]).to(torch.float64)
        tags = torch.stack([status[0], status[1], _tag(own, 0), _tag(own, 1)])
        queue_order_check(status, tags, REDUCE_ROWS, group_name)
        return
    if torch.compiler.is_compiling():
        torch._assert_async(
            ok,
            f"{CALL_ORDER_MARK} the ranks' layer tags, call tags or running means differ "
            f"(a layer with exchange='reduce')",
        )
        return
    if not bool(order_ok):
        mine = torch.stack([_tag(own, 0), _tag(own, 1)])
        tags = mine if group_name is None else _gather_tags(mine, group_name)
        raise_if_out_of_order(tags.view(-1, 2), group_name)
    if not bool(shift_ok):
        raise RuntimeError(SHIFT_MISMATCH)
    reference.check_group_count(int(total[0].item()), input, world_size)


def _tag(own: torch.Tensor, which: int) -> torch.Tensor:
    """Layer (``which=0``) or call tag (1) rebuilt from its chunks in ``own``."""
    hi, lo = own[3 + 4 * which], own[5 + 4 * which]
    return hi * float(1 << _CHUNK_BITS) + lo


def _gather_tags(tags: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every rank's ``[layer, call]`` (an extra collective on the error path only: every rank
    detects the mismatch at the same call, so every rank joins it)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    collectives = torch.ops._c10d_functional
    size = dist.get_world_size(_resolve_process_group(group_name))
    return collectives.wait_tensor(collectives.all_gather_into_tensor(tags, size, group_name))


def _backward(ctx: Any, grad_output: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Local sums, ONE collective (the gather exchange's), the input gradient."""
    from .function import _sum_over_group

    if grad_output is None:
        return _NO_GRADS
    input, weight, m_hi, m_lo, invstd, info, bias = ctx.saved_tensors
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    act, act_param = ctx.activation
    centered = _centered(input, m_hi, m_lo)
    dz = grad_output.to(centered.dtype)
    if act:
        dz = dz * activation_grad(_affine(centered, invstd, weight, bias, input), act, act_param)
    dims = reference._reduce_dims(input)
    sum_dy, sum_dy_xmu = dz.sum(dims), (dz * centered).sum(dims)
    param_dtype = weight.dtype if weight is not None else invstd.dtype
    grad_input = None
    if need_input:
        sums = torch.cat([sum_dy, sum_dy_xmu])
        if ctx.group_name is not None:
            sums = _sum_over_group(sums, ctx.group_name, ctx.world_size)
        total = sums.view(-1, 2 * input.shape[1]).sum(0)
        n = info[0].clamp_min(1)
        channels = input.shape[1]
        mean_dy = total[:channels] / n
        k = total[channels:] / n * invstd * invstd
        iw = invstd if weight is None else invstd * weight.to(invstd.dtype)
        dx = (
            dz
            - reference._per_channel(mean_dy, input)
            - centered * reference._per_channel(k, input)
        )
        grad_input = (dx * reference._per_channel(iw, input)).to(input.dtype)
    return (
        grad_input,
        (sum_dy_xmu * invstd).to(param_dtype) if need_weight else None,
        sum_dy.to(param_dtype) if need_bias else None,
        *_NO_GRADS[3:],
    )


_NO_GRADS: tuple[None, ...] = (None,) * 18
_backward_once = once_differentiable(_backward)
