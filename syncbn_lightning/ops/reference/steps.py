"""Pure-PyTorch twins of the ``syncbn::`` operators: the fused steps of a synchronized layer call.

The same signatures and semantics as the operators of ``csrc/ops/ops.cpp`` (the test oracle of their
CPU and CUDA kernels, and the path of ``impl="reference"``):

* the gather exchange: :func:`stats_row` (this rank's row), :func:`merge_normalize` (the merge of
  every rank's row, the running statistics, the output);
* the reduce exchange: :func:`reduce_sums` (this rank's float64 sums),
  :func:`reduce_merge_normalize` (the merge of the summed vector, the running statistics, the
  output);
* the backward of both: :func:`grad_sums`, :func:`grad_input` (in :mod:`.backward`,
  imported here so that this module holds every step under the operators' names).

The group mean travels as two acc-dtype numbers, ``mean + mean_lo`` (the float64 mean split), and
every step normalizes and differentiates with ``(x - mean) - mean_lo``: ``x - mean`` is exact for
``x`` near the mean, so outputs and gradients keep the acc dtype's relative precision on the
deviation even when ``|mean| / std`` is large (1e4 and beyond).
"""

from __future__ import annotations

import torch

from ..._shared import INFO_FIELDS, REDUCE_HEADER, ROW_HEADER, SHIFT_MISMATCH
from ...distributed.call_order.policy import queues_order_flag
from ..activations import check_activation
from . import (
    CALL_ORDER_MARK,
    TAG_LIMIT,
    acc_dtype,
    check_group_count,
    finish_merge,
    finish_output,
    local_count,
    merge_infos,
    per_channel,
    reduce_dims,
    split_mean,
    update_state,
)

__all__ = [
    "GRAD_HEADER",
    "INFO_FIELDS",
    "REDUCE_HEADER",
    "ROW_HEADER",
    "SHIFT_MISMATCH",
    "grad_input",
    "grad_sums",
    "grad_sums_residual",
    "header_tags",
    "merge_normalize",
    "own_tags",
    "reduce_merge_normalize",
    "reduce_sums",
    "renormalize",
    "row_width",
    "stats_row",
    "tag_header",
]

# The layouts (ROW_HEADER, REDUCE_HEADER, INFO_FIELDS) and SHIFT_MISMATCH are the extension's
# too: defined once in syncbn_lightning/_shared.py. The reduce exchange's tag chunks: 12 bits.
_CHUNK_BITS = 12


def row_width(channels: int) -> int:
    """Values in one rank's row: the header, ``mean[C]``, ``mean_lo[C]``, ``m2[C]``."""
    return ROW_HEADER + 3 * channels


# ------------------------------------------------------------------------------------------------
# The gather exchange
# ------------------------------------------------------------------------------------------------


def stats_row(input: torch.Tensor, layer_tag: int, calls: torch.Tensor) -> torch.Tensor:
    """This rank's row for the forward collective, ``[count, samples, layer_tag, call_tag,
    mean[C], mean_lo[C], m2[C]]`` in the acc dtype (the local mean computed in float64 and split,
    see the module docstring); ``calls`` (one int64 element) is the layer's call counter, written
    as the call tag and incremented in place."""
    acc, count = acc_dtype(input.dtype), local_count(input)
    x = input.double()
    if count:
        var, mean64 = torch.var_mean(x, dim=reduce_dims(input), correction=0)
        m2 = var * count
    else:
        mean64 = m2 = x.new_zeros(input.shape[1])
    mean, mean_lo = split_mean(mean64, acc)
    header = torch.stack(
        [
            mean.new_full((), float(count)),
            mean.new_full((), float(input.shape[0])),
            mean.new_full((), float(layer_tag % TAG_LIMIT)),
            (calls.reshape(()) % TAG_LIMIT).to(acc),
        ]
    )
    calls.add_(1)
    return torch.cat([header, mean, mean_lo, m2.to(acc)])


def merge_normalize(
    input: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    nonfinite: torch.Tensor | None,
    momentum: float | None,
    eps: float,
    unbiased: bool,
    act: int = 0,
    act_param: float = 0.0,
    equal_rank_weights: bool = False,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Merge the gathered rows in float64, update the running statistics, normalize (add
    ``residual`` and apply the activation ``act`` before rounding to the input's dtype:
    ``act(z + residual)``).

    ``equal_rank_weights`` (``stats_mode="default"``): every rank with a non-empty batch weighs
    the same, ``n / R`` (``R`` non-empty ranks), its ``M2`` scaled to that count; the input
    gradient then divides by ``R * n_r`` (``grad_info[0]``), since each of this rank's ``n_r``
    values weighs ``1 / (R n_r)``.

    Returns ``(output, mean, mean_lo, invstd, var, info, grad_info)`` with ``info = [count,
    samples, order_ok, finite, layer_tag, call_tag]``. On CPU tensors a call-order mismatch
    raises (message starting with :data:`CALL_ORDER_MARK`) and a group with a single value per
    channel raises torch's ValueError; on other devices these need a host sync, so only
    ``info[2]`` reports the order.
    """
    check_activation(act, act_param)
    channels = input.shape[1]
    table = rows.view(-1, row_width(channels))
    tags = table[:, 2:ROW_HEADER]
    order_ok = (tags == tags[0]).all()
    counts = table[:, 0].double()
    total = counts.sum()
    if not queues_order_flag(input) and not torch.compiler.is_compiling():
        _check_order_cpu(tags, order_ok, total, input, table.shape[0])
    stats = table[:, ROW_HEADER:].double()
    means = stats[:, :channels] + stats[:, channels : 2 * channels]
    m2s = stats[:, 2 * channels :]
    present = (counts > 0).unsqueeze(1)
    ranks = present.sum()
    weights = counts
    if equal_rank_weights:
        weights = present.squeeze(1).double() * total / ranks.clamp_min(1)
        m2s = m2s * (weights / counts.clamp_min(1)).unsqueeze(1)
    n = total.clamp_min(1)
    mean64 = (weights.unsqueeze(1) * torch.where(present, means, 0)).sum(0) / n
    dev = torch.where(present, means - mean64, 0)
    m2 = torch.where(present, m2s, 0).sum(0) + (weights.unsqueeze(1) * dev * dev).sum(0)
    invstd64 = torch.rsqrt(m2 / n + eps)
    var64 = m2 / (total - 1 if unbiased else total).clamp_min(1)
    finite = torch.isfinite(mean64).all() & torch.isfinite(var64).all()
    update_state(
        (running_mean, running_var, num_batches_tracked, nonfinite),
        mean64,
        var64,
        finite,
        total > 0,
        momentum,
    )
    output, *stats_out = finish_merge(
        input, mean64, invstd64, var64, weight, bias, act, act_param, residual
    )
    grad_count = ranks * local_count(input) if equal_rank_weights else total
    infos = merge_infos(
        total, table[:, 1].sum(), order_ok, finite, grad_count, rows.dtype, table[0, 2:ROW_HEADER]
    )
    return (output, *stats_out, *infos)


def _check_order_cpu(
    tags: torch.Tensor, order_ok: torch.Tensor, total: torch.Tensor, input: torch.Tensor, world: int
) -> None:
    if not bool(order_ok):
        calls = "; ".join(
            f"row {i}: layer tag {int(layer)} call #{int(call) + 1}"
            for i, (layer, call) in enumerate(tags.tolist())
        )
        raise RuntimeError(f"{CALL_ORDER_MARK} tags differ ({calls})")
    check_group_count(int(total.item()), input, world)


# ------------------------------------------------------------------------------------------------
# The reduce exchange
# ------------------------------------------------------------------------------------------------


def _fingerprint(shift: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A float64 integer in ``[0, 2**24)`` that differs when ``shift``'s float64 values differ:
    ``sum_c key_c * (c % 65521 + 1) mod 2**24`` with ``key_c`` from the bits of ``shift[c]``
    (``(lo32 * 31 + hi32) % 65521``); 0 without a shift."""
    if shift is None:
        return torch.zeros((), dtype=torch.float64, device=device)
    bits = shift.detach().double().contiguous().view(torch.int64)
    lo32, hi32 = bits & 0xFFFFFFFF, (bits >> 32) & 0xFFFFFFFF
    keys = (lo32 * 31 + hi32) % 65521
    weights = torch.arange(shift.numel(), device=device, dtype=torch.int64) % 65521 + 1
    return ((keys * weights).sum() % TAG_LIMIT).to(torch.float64)


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


def reduce_sums(
    input: torch.Tensor,
    shift: torch.Tensor | None,
    layer_tag: int,
    calls: torch.Tensor,
    equal_rank_weights: bool,
) -> torch.Tensor:
    """This rank's float64 vector for the all-reduce, ``[count, samples, nonempty, tag chunks[12],
    S1[C], S2[C]]`` with ``S1 = w * sum(x - K)``, ``S2 = w * sum((x - K)^2)`` per channel
    (``K = shift``, the running mean, else 0; ``w = 1``, or ``1 / count`` for
    ``equal_rank_weights``) and the chunks of the layer tag, the call tag and ``K``'s fingerprint.
    ``calls`` is written as the call tag and incremented in place."""
    count = local_count(input)
    x = input.double()
    if shift is not None:
        x = x - per_channel(shift.detach().double(), input)
    dims = reduce_dims(input)
    s1, s2 = x.sum(dims), (x * x).sum(dims)
    if equal_rank_weights and count:
        s1, s2 = s1 / count, s2 / count
    call = (calls.reshape(()) % TAG_LIMIT).to(torch.float64)
    calls.add_(1)
    layer = s1.new_full((), float(layer_tag % TAG_LIMIT))
    head = s1.new_tensor([float(count), float(input.shape[0]), float(count > 0)])
    tags = _chunks([layer, call, _fingerprint(shift, input.device)])
    return torch.cat([head, tags, s1, s2])


def reduce_merge_normalize(
    input: torch.Tensor,
    total: torch.Tensor,
    sent: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    nonfinite: torch.Tensor | None,
    momentum: float | None,
    eps: float,
    unbiased: bool,
    equal_rank_weights: bool,
    world_size: int,
    act: int = 0,
    act_param: float = 0.0,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The group statistics from ``total`` (every rank's :func:`reduce_sums`, summed, or gathered
    and then summed here in rank order; ``sent`` is this rank's) in float64, the running-stat
    update and the output; returns what :func:`merge_normalize` does.

    ``mean = K + S1 / D`` and the biased ``var = S2 / D - (S1 / D)^2`` with ``D`` the group's count
    (or its non-empty ranks with ``equal_rank_weights``); ``running_var`` gets ``var * n / (n -
    1)`` when ``unbiased``. The checks: every rank sent the same tag chunks (``sum(c) == P c`` and
    ``sum(c^2) == P c^2`` hold on one rank iff all sent ``c``) and the same fingerprint of ``K``.
    On CPU tensors a mismatch raises (tags: a message starting with :data:`CALL_ORDER_MARK`;
    running means: :data:`SHIFT_MISMATCH`), as does a group of one value per channel.
    """
    check_activation(act, act_param)
    channels = input.shape[1]
    total = total.view(-1, sent.numel()).sum(0)
    same = (total[3:REDUCE_HEADER] == sent[3:REDUCE_HEADER] * world_size).view(6, 2).all(dim=1)
    order_ok, shift_ok = same[:4].all(), same[4:].all()
    n = total[0]
    if not queues_order_flag(input) and not torch.compiler.is_compiling():
        if not bool(order_ok):
            layer, call = own_tags(sent)
            raise RuntimeError(
                f"{CALL_ORDER_MARK} the ranks' layer or call tags differ (this rank: layer tag "
                f"{int(layer)} call #{int(call) + 1})"
            )
        if not bool(shift_ok):
            raise RuntimeError(SHIFT_MISMATCH)
        check_group_count(int(n.item()), input, world_size)
    divisor = (total[2] if equal_rank_weights else n).clamp_min(1)
    d = total[REDUCE_HEADER : REDUCE_HEADER + channels] / divisor
    biased = (total[REDUCE_HEADER + channels :] / divisor - d * d).clamp_min(0)
    mean64 = d if running_mean is None else d + running_mean.detach().double()
    mean64 = torch.where(n > 0, mean64, torch.zeros_like(mean64))
    var64 = biased * (n / (n - 1).clamp_min(1)) if unbiased else biased
    finite = torch.isfinite(mean64).all() & torch.isfinite(var64).all()
    invstd64 = torch.rsqrt(biased + eps)
    update_state(
        (running_mean, running_var, num_batches_tracked, nonfinite),
        mean64,
        var64,
        finite,
        n > 0,
        momentum,
    )
    output, *stats_out = finish_merge(
        input, mean64, invstd64, var64, weight, bias, act, act_param, residual
    )
    grad_count = total[2] * sent[0] if equal_rank_weights else n
    acc = acc_dtype(input.dtype)
    tags = sent[3:11:4] * float(1 << _CHUNK_BITS) + sent[5:11:4]  # (layer, call), on the device
    infos = merge_infos(n, total[1], order_ok & shift_ok, finite, grad_count, acc, tags)
    return (output, *stats_out, *infos)


def renormalize(
    input: torch.Tensor,
    mean: torch.Tensor,
    mean_lo: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    act: int = 0,
    act_param: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The output of a merge again from the statistics it returned (``mean``, ``mean_lo``,
    ``invstd``): an activation checkpoint's recompute of a layer call. The merges' own
    normalize, so the output is bitwise theirs for the same input; nothing is updated."""
    check_activation(act, act_param)
    return finish_output(input, mean, mean_lo, invstd, weight, bias, act, act_param, residual)


def own_tags(sent: torch.Tensor) -> tuple[float, float]:
    """This rank's (layer tag, call tag), rebuilt from their chunks in ``sent``."""
    base = float(1 << _CHUNK_BITS)
    return float(sent[3] * base + sent[5]), float(sent[7] * base + sent[9])


# The backward of both exchanges, with the call-order header its sums carry.
from .backward import (  # noqa: E402  (after the constants it imports)
    GRAD_HEADER,
    grad_input,
    grad_sums,
    grad_sums_residual,
    header_tags,
    tag_header,
)
