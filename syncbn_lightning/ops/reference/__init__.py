"""Pure-PyTorch reference of the BatchNorm primitives: the kernels' twin (the fused steps, the
``syncbn::`` operators, are :mod:`.steps`).

The same five primitives as the C++/CUDA extension in ``csrc/`` with identical signatures and
semantics (see ``csrc/include/syncbn.h``). They run on any device and dtype, serve as the test
oracle for the kernels, and are the fallback when the extension cannot be built
(``SYNCBN_IMPL=ref``); plain torch code, so ``torch.compile`` traces them too.

Conventions:
    * ``input`` has shape ``(N, C, *)``; statistics are per channel (dim 1).
    * The *acc dtype* is float32 for float16/bfloat16/float32 inputs and float64 for float64 inputs;
      every statistic is computed and returned in it.
    * Outputs of elementwise primitives keep the input's dtype and memory format.
"""

from __future__ import annotations

import torch

from ..._shared import CALL_ORDER_MARK, TAG_LIMIT
from ..activations import activate

__all__ = [
    "CALL_ORDER_MARK",
    "TAG_LIMIT",
    "acc_dtype",
    "check_residual",
    "finish_merge",
    "local_count",
    "merge_infos",
    "split_mean",
    "update_state",
    "affine",
    "backward_elemt",
    "backward_reduce",
    "centered",
    "check_group_count",
    "local_stats",
    "merge_stats",
    "normalize",
    "per_channel",
    "reduce_dims",
    "scale",
    "update_running",
]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for an input dtype: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def reduce_dims(input: torch.Tensor) -> list[int]:
    """The dims a per-channel statistic reduces over: all but dim 1."""
    return [0, *range(2, input.dim())]


def per_channel(v: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """View a ``[C]`` vector so that it broadcasts against ``input`` along dim 1."""
    return v.view(1, -1, *([1] * (input.dim() - 2)))


def local_stats(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel statistics of the local batch.

    Returns:
        ``(mean, m2)``, each ``[C]`` in the acc dtype, with ``m2 = sum((x - mean)^2)`` over the
        channel. A channel without elements (``N == 0``) gets ``mean = 0`` and ``m2 = 0``.
    """
    acc = acc_dtype(input.dtype)
    c = input.shape[1]
    count = input.numel() // c if c else 0
    if count == 0:
        zeros = torch.zeros(c, dtype=acc, device=input.device)
        return zeros, zeros.clone()
    var, mean = torch.var_mean(input.to(acc), dim=reduce_dims(input), correction=0)
    return mean, var * count


def merge_stats(
    counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor, eps: float, unbiased: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count-weighted (Chan) merge of per-rank statistics.

    Args:
        counts: ``[W]`` elements per channel on each rank (0 for an empty rank).
        means: ``[W, C]`` per-rank means.
        m2s: ``[W, C]`` per-rank sums of squared deviations.
        eps: added to the biased variance before the inverse square root.
        unbiased: whether the returned ``var`` divides by ``n - 1`` (torch) or ``n`` (TF/Keras).

    Returns:
        ``(mean, invstd, var)``, each ``[C]`` in the dtype of ``means``, where with
        ``n = sum(counts)``: ``mean = sum(counts * means) / n``,
        ``m2 = sum(m2s) + sum(counts * (means - mean)^2)`` (over ranks with ``counts > 0``),
        ``invstd = 1 / sqrt(m2 / n + eps)`` and ``var = m2 / (n - 1)`` (or ``/ n``). Denominators
        are clamped to at least 1, so an all-empty group gives ``mean = 0``, ``var = 0``.
    """
    c64 = counts.double().unsqueeze(1)
    m64 = means.double()
    n = c64.sum(0)
    mean = (c64 * m64).sum(0) / n.clamp_min(1)
    present = c64 > 0
    dev = torch.where(present, m64 - mean, torch.zeros_like(m64))
    m2 = torch.where(present, m2s.double(), torch.zeros_like(m64)).sum(0) + (c64 * dev * dev).sum(0)
    invstd = torch.rsqrt(m2 / n.clamp_min(1) + eps)
    var = m2 / (n - 1 if unbiased else n).clamp_min(1)
    return mean.to(means.dtype), invstd.to(means.dtype), var.to(means.dtype)


def normalize(
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``y = (x - mean) * invstd * weight + bias`` per channel, in ``input``'s dtype and layout."""
    return affine(centered(input, mean), input, scale(input, invstd, weight), bias).to(input.dtype)


def scale(input: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``invstd * weight`` in the acc dtype of ``input``."""
    return invstd if weight is None else invstd * weight.to(acc_dtype(input.dtype))


def centered(
    input: torch.Tensor, mean: torch.Tensor, mean_lo: torch.Tensor | None = None
) -> torch.Tensor:
    """``(x - mean) - mean_lo`` in the acc dtype: with a mean split into ``mean + mean_lo`` (two
    acc-dtype numbers), ``x - mean`` is exact for ``x`` near the mean, so the deviation keeps the
    acc dtype's relative precision even when ``|mean| >> std``."""
    x = input.to(acc_dtype(input.dtype)) - per_channel(mean, input)
    return x if mean_lo is None else x - per_channel(mean_lo, input)


def affine(
    xmu: torch.Tensor, input: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``z = xmu * scale + bias`` in the acc dtype (not rounded), ``xmu`` from :func:`centered`."""
    z = xmu * per_channel(scale, input)
    return z if bias is None else z + per_channel(bias.to(z.dtype), input)


def backward_reduce(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Local backward sums.

    Returns:
        ``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)``: ``sum_dy = sum(dy)`` and
        ``sum_dy_xmu = sum(dy * (x - mean))`` per channel in the acc dtype; ``grad_weight =
        sum_dy_xmu * invstd`` and ``grad_bias = sum_dy`` in the weight's dtype, or ``None`` when not
        requested.
    """
    acc = acc_dtype(input.dtype)
    dims = reduce_dims(input)
    dy = grad_out.to(acc)
    # No shortcut for an empty batch (a sum over no elements is 0): under torch.compile the sums
    # must depend on dy, or the partitioner may hoist this rank's backward collective into the
    # forward graph, where it would pair with another rank's forward collective.
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * centered(input, mean)).sum(dims)
    param_dtype = weight.dtype if weight is not None else acc
    grad_weight = (sum_dy_xmu * invstd).to(param_dtype) if weight_grad else None
    grad_bias = sum_dy.to(param_dtype) if bias_grad else None
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def backward_elemt(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    sum_dy: torch.Tensor,
    sum_dy_xmu: torch.Tensor,
    count: torch.Tensor,
) -> torch.Tensor:
    """Input gradient from group-wide sums.

    ``dx = (dy - sum_dy / n - (x - mean) * invstd^2 * sum_dy_xmu / n) * invstd * weight`` where
    ``sum_dy``/``sum_dy_xmu`` are summed over the whole sync group and ``n = count`` is the group's
    element count per channel (a one-element tensor, so no host synchronization is needed).
    """
    acc = acc_dtype(input.dtype)
    n = count.to(acc).reshape(()).clamp_min(1)
    mean_dy = sum_dy / n
    k = sum_dy_xmu / n * invstd * invstd
    xmu = centered(input, mean)
    dx = grad_out.to(acc) - per_channel(mean_dy, input) - xmu * per_channel(k, input)
    return (dx * per_channel(scale(input, invstd, weight), input)).to(input.dtype)


def check_group_count(total: int, input: torch.Tensor, world_size: int) -> None:
    """torch's error for a training batch of one value per channel, where the batch is the whole
    sync group's: ``total`` values per channel over ``world_size`` ranks."""
    if total == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {input.size()} "
            f"(1 value per channel in the whole sync group of {world_size} rank(s))"
        )


def update_running(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    keep: torch.Tensor,
    momentum: float | None,
    num_batches_tracked: torch.Tensor | None,
) -> None:
    """``running = lerp(running, batch, factor)`` where ``keep`` (on the device, no host sync)."""
    if momentum is None:
        assert num_batches_tracked is not None, "momentum=None needs num_batches_tracked"
        factor: float | torch.Tensor = num_batches_tracked.to(running_mean.dtype).reciprocal()
    else:
        factor = momentum
    for running, batch in ((running_mean, mean), (running_var, var)):
        updated = torch.lerp(running, batch.to(running.dtype), factor)
        running.copy_(torch.where(keep, updated, running))


# ------------------------------------------------------------------------------------------------
# The merges' shared steps (steps.py)
# ------------------------------------------------------------------------------------------------


def local_count(input: torch.Tensor) -> int:
    """Values per channel in ``input``."""
    return input.numel() // input.shape[1] if input.shape[1] else 0


def split_mean(mean64: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 mean as two acc-dtype numbers ``(hi, lo)`` with ``hi + lo`` = the mean."""
    hi = mean64.to(acc)
    return hi, (mean64 - hi.double()).to(acc)


def update_state(
    state: tuple[torch.Tensor | None, ...],
    mean: torch.Tensor,
    var: torch.Tensor,
    finite: torch.Tensor,
    nonempty: torch.Tensor,
    momentum: float | None,
) -> None:
    """The running-stat update and counters of both merges: ``num_batches_tracked`` advances
    unless the statistics are not finite, ``nonfinite`` counts those, and the running statistics
    move only with finite statistics of a non-empty group."""
    running_mean, running_var, num_batches_tracked, nonfinite = state
    with torch.no_grad():
        if num_batches_tracked is not None:
            num_batches_tracked.add_(finite.to(num_batches_tracked.dtype))
        if nonfinite is not None:
            nonfinite.add_((~finite).to(nonfinite.dtype))
        if running_mean is not None and running_var is not None:
            update_running(
                running_mean,
                running_var,
                mean,
                var,
                finite & nonempty,
                momentum,
                num_batches_tracked,
            )


def finish_merge(
    input: torch.Tensor,
    mean64: torch.Tensor,
    invstd64: torch.Tensor,
    var64: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    act: int,
    act_param: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(output, mean, mean_lo, invstd, var)`` from the float64 group statistics; the output is
    ``act(z + residual)`` (``residual`` optional: ``act(z)``), rounded once."""
    acc = acc_dtype(input.dtype)
    mean, mean_lo = split_mean(mean64, acc)
    invstd = invstd64.to(acc)
    output = finish_output(input, mean, mean_lo, invstd, weight, bias, act, act_param, residual)
    return output, mean, mean_lo, invstd, var64.to(acc)


def finish_output(
    input: torch.Tensor,
    mean: torch.Tensor,
    mean_lo: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    act: int,
    act_param: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(z + residual)`` (``residual`` optional) of the group statistics in the acc dtype
    (``mean + mean_lo``, ``invstd``), rounded once to the input's dtype."""
    z = affine(centered(input, mean, mean_lo), input, scale(input, invstd, weight), bias)
    if residual is not None:
        check_residual(residual, input)
        z = z + residual.to(mean.dtype)
    return activate(z, act, act_param).to(input.dtype)


def check_residual(residual: torch.Tensor, input: torch.Tensor) -> None:
    """The operators' checks of a fused ``residual`` (the input's shape, dtype and device)."""
    for what, got, want in (
        ("shape", tuple(residual.shape), tuple(input.shape)),
        ("dtype", residual.dtype, input.dtype),
        ("device", residual.device, input.device),
    ):
        if got != want:
            raise RuntimeError(
                f"syncbn: `residual` must have the input's {what} {want} (it is added to the "
                f"normalized input), got {got}"
            )


def merge_infos(
    count: torch.Tensor,
    samples: torch.Tensor,
    order_ok: torch.Tensor,
    finite: torch.Tensor,
    grad_count: torch.Tensor,
    acc: torch.dtype,
    tags: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``info = [count, samples, order_ok, finite, layer_tag, call_tag]`` and ``grad_info``, the
    same with the count the input gradient divides by (``tags``: the call's two tags, which the
    backward sends back with its sums)."""
    flags = [samples.double(), order_ok.double(), finite.double(), *tags.double().unbind()]
    info = torch.stack([count.double(), *flags]).to(acc)
    return info, torch.stack([grad_count.double(), *flags]).to(acc)
