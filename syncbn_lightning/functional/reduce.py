"""The reduce exchange: ONE all-reduce of O(C) values, whatever the group size (``auto`` above 8
ranks).

The gather exchange (:mod:`.gather`) all-gathers one row of ``2C + 4`` values per rank: the bytes
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
all-gather their tags to raise :class:`~syncbn_lightning.CallOrderError`.

Backward is the gather exchange's: local ``[sum(dy), sum(dy * (x - mean))]``, ONE collective
summing them (the Function's), the elementwise input gradient.

All steps are plain torch operations (the reference twin's style), so they run on every device and
``torch.compile`` traces them into one graph; the fused ``syncbn::`` kernels are not used on this
path.
"""

from __future__ import annotations

import torch

from ..distributed.call_order import (
    call_order_error,
    layer_text,
    queue_order_check,
    raise_if_out_of_order,
)
from ..distributed.collectives import Group, all_gather, group_ranks
from ..ops.activations import activate, activation_grad, check_activation
from ..ops.reference import (
    CALL_ORDER_MARK,
    TAG_LIMIT,
    acc_dtype,
    check_group_count,
    per_channel,
    reduce_dims,
    update_running,
)
from .exchange import Exchange, Inputs, LayerState, LocalGrads, Merged, Saved, SyncCall

__all__ = ["SHIFT_MISMATCH", "ReduceExchange", "reduce_payload_numel"]

# Header of the reduced vector: count, samples, nonempty, then 6 tag chunks with their squares.
_CHUNK_BITS = 12
_CHUNKS = 6  # layer tag hi/lo, call tag hi/lo, K fingerprint hi/lo
HEADER = 3 + 2 * _CHUNKS
#: The error when the ranks of a group shifted their sums by different running means.
SHIFT_MISMATCH = (
    "syncbn call order: the ranks of one sync group hold different running_mean buffers in a "
    "layer with exchange='reduce', which shifts every rank's sums by its running mean and needs "
    "the same one on every rank (as it is after every synchronized update). Load the same "
    "checkpoint on every rank, keep the buffers in sync, or use exchange='gather'."
)


def reduce_payload_numel(channels: int) -> int:
    """Number of float64 values one reduce-exchange all-reduce carries for ``channels``."""
    return HEADER + 2 * channels


class ReduceExchange(Exchange):
    """See the module docstring."""

    name = "reduce"
    summary = "one all-reduce of per-channel float64 sums: O(C) bytes for any group"
    gathers = False

    def payload(self, inputs: Inputs, call: SyncCall) -> torch.Tensor:
        check_activation(call.act, call.act_param)
        equal = call.options.stats_mode == "default"
        state = inputs.state
        return _local_sums(inputs.input, state.running_mean, call.layer_tag, state.calls, equal)

    def merge(
        self, inputs: Inputs, sent: torch.Tensor, received: torch.Tensor, call: SyncCall
    ) -> Merged:
        input, weight, bias, state = inputs
        options, total, channels = call.options, received, input.shape[1]
        order_ok, shift_ok = _checks(sent, total, call.world_size)
        _check_order(input, sent, order_ok, shift_ok, total, call)
        equal = options.stats_mode == "default"
        mean64, invstd64, var64 = _merge(
            total, state.running_mean, channels, options.eps, options.unbiased_running_var, equal
        )
        acc = acc_dtype(input.dtype)
        m_hi = mean64.to(acc)
        m_lo = (mean64 - m_hi.to(torch.float64)).to(acc)
        invstd, var = invstd64.to(acc), var64.to(acc)
        finite = torch.isfinite(mean64).all() & torch.isfinite(var64).all()
        with torch.no_grad():
            _update_state(state, mean64, var64, finite, total[0] > 0, options.momentum)
        count = total[0]
        if equal:  # each of this rank's values weighs 1 / (R n_r): see gather._per_rank_count
            count = total[2] * float(_own_count(input))
        info = torch.stack([total[0], total[1], order_ok.to(torch.float64), finite.double()])
        grad_info = torch.stack([count, total[1]]).to(acc)
        centered = _centered(input, m_hi, m_lo)
        z = _affine(centered, invstd, weight, bias, input)
        output = activate(z, call.act, call.act_param).to(input.dtype)
        saved = (input, weight, m_hi, m_lo, invstd, grad_info, bias if call.act else None)
        return Merged(output, m_hi, var, info.to(acc), saved)

    def local_grads(self, grad_output: torch.Tensor, saved: Saved, call: SyncCall) -> LocalGrads:
        input, weight, m_hi, m_lo, invstd, info, bias = saved
        centered = _centered(input, m_hi, m_lo)
        dz = grad_output.to(centered.dtype)
        if call.act:
            z = _affine(centered, invstd, weight, bias, input)
            dz = dz * activation_grad(z, call.act, call.act_param)
        dims = reduce_dims(input)
        sum_dy, sum_dy_xmu = dz.sum(dims), (dz * centered).sum(dims)
        param_dtype = weight.dtype if weight is not None else invstd.dtype
        return LocalGrads(
            torch.cat([sum_dy, sum_dy_xmu]),
            (sum_dy_xmu * invstd).to(param_dtype),
            sum_dy.to(param_dtype),
            (input, weight, invstd, info, centered, dz),
        )

    def grad_input(
        self, grad_output: torch.Tensor, summed: torch.Tensor, local: LocalGrads, call: SyncCall
    ) -> torch.Tensor:
        input, weight, invstd, info, centered, dz = local.carry
        channels = input.shape[1]
        total = summed.view(-1, 2 * channels).sum(0)
        n = info[0].clamp_min(1)
        mean_dy = total[:channels] / n
        k = total[channels:] / n * invstd * invstd
        iw = invstd if weight is None else invstd * weight.to(invstd.dtype)
        dx = dz - per_channel(mean_dy, input) - centered * per_channel(k, input)
        return (dx * per_channel(iw, input)).to(input.dtype)


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
        x = x - per_channel(shift.detach().to(torch.float64), input)
    dims = reduce_dims(input)
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
    return (x - per_channel(m_hi, input)) - per_channel(m_lo, input)


def _affine(
    centered: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    input: torch.Tensor,
) -> torch.Tensor:
    scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
    z = centered * per_channel(scale, input)
    return z if bias is None else z + per_channel(bias.to(z.dtype), input)


def _own_count(input: torch.Tensor) -> int:
    """Values per channel in this rank's ``input``."""
    return input.numel() // input.shape[1] if input.shape[1] else 0


def _check_order(
    input: torch.Tensor,
    own: torch.Tensor,
    order_ok: torch.Tensor,
    shift_ok: torch.Tensor,
    total: torch.Tensor,
    call: SyncCall,
) -> None:
    """Raise (CPU), assert in the graph (compiled CPU) or queue (other devices, checked by
    :func:`~syncbn_lightning.check_call_order`) the call-order and shift checks; on CPU a group
    with one value per channel raises torch's error."""
    ok = order_ok & shift_ok
    if input.device.type != "cpu":
        status = torch.stack([order_ok, shift_ok, ok]).to(torch.float64)
        tags = torch.stack([status[0], status[1], _tag(own, 0), _tag(own, 1)])
        queue_order_check(status, 2, _report_mismatch, tags, call.group)
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
        # An extra collective on the error path only: every rank detects the mismatch at the same
        # call, so every rank joins it.
        tags = all_gather(mine, call.group, call.world_size)
        raise_if_out_of_order(tags.view(-1, 2), call.group)
    if not bool(shift_ok):
        raise RuntimeError(SHIFT_MISMATCH)
    check_group_count(int(total[0].item()), input, call.world_size)


def _report_mismatch(status: torch.Tensor, group: Group) -> None:
    """A queued check failed: ``status = [order_ok, shift_ok, layer, call]`` of this rank (the
    other ranks' tags were summed, not gathered)."""
    order_ok, _, layer, call = status.cpu().tolist()
    if order_ok:
        raise RuntimeError(SHIFT_MISMATCH)
    ranks = group_ranks(group, 1) if isinstance(group, str) else []
    raise call_order_error(
        f"this rank ran {layer_text(layer)} (call #{int(call) + 1}) while another rank ran a "
        f"different layer or call (exchange='reduce' sums the tags, so it cannot name the other "
        f"ranks' layers; exchange='gather' does)",
        ranks,
    )


def _tag(own: torch.Tensor, which: int) -> torch.Tensor:
    """Layer (``which=0``) or call tag (1) rebuilt from its chunks in ``own``."""
    hi, lo = own[3 + 4 * which], own[5 + 4 * which]
    return hi * float(1 << _CHUNK_BITS) + lo


def _update_state(
    state: LayerState,
    mean: torch.Tensor,
    var: torch.Tensor,
    finite: torch.Tensor,
    nonempty: torch.Tensor,
    momentum: float | None,
) -> None:
    """The running-stat update and the counters (see the gather merge's: the same rules)."""
    if state.num_batches_tracked is not None:
        state.num_batches_tracked.add_(finite.to(state.num_batches_tracked.dtype))
    if state.nonfinite is not None:
        state.nonfinite.add_((~finite).to(state.nonfinite.dtype))
    if state.running_mean is not None and state.running_var is not None:
        update_running(
            state.running_mean,
            state.running_var,
            mean,
            var,
            finite & nonempty,
            momentum,
            state.num_batches_tracked,
        )
