"""Pure-PyTorch reference of the BatchNorm primitives (layer 1).

The same five primitives as the C++/CUDA extension in ``csrc/`` with identical signatures and
semantics (see ``csrc/syncbn.h``). They run on any device and dtype, serve as the test oracle for
the kernels, and are the fallback when the extension cannot be built (``SYNCBN_IMPL=ref``).

Conventions:
    * ``input`` has shape ``(N, C, *)``; statistics are per channel (dim 1).
    * The *acc dtype* is float32 for float16/bfloat16/float32 inputs and float64 for float64 inputs;
      every statistic is computed and returned in it.
    * Outputs of elementwise primitives keep the input's dtype and memory format.
"""

from __future__ import annotations

import torch

__all__ = [
    "acc_dtype",
    "local_stats",
    "merge_stats",
    "normalize",
    "backward_reduce",
    "backward_elemt",
]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for an input dtype: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce_dims(input: torch.Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


def _per_channel(v: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
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
    var, mean = torch.var_mean(input.to(acc), dim=_reduce_dims(input), correction=0)
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
    acc = acc_dtype(input.dtype)
    scale = invstd if weight is None else invstd * weight.to(acc)
    y = (input.to(acc) - _per_channel(mean, input)) * _per_channel(scale, input)
    if bias is not None:
        y = y + _per_channel(bias.to(acc), input)
    return y.to(input.dtype)


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
    dims = _reduce_dims(input)
    dy = grad_out.to(acc)
    if input.numel() == 0:
        sum_dy = torch.zeros_like(mean)
        sum_dy_xmu = torch.zeros_like(mean)
    else:
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * (input.to(acc) - _per_channel(mean, input))).sum(dims)
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
    iw = invstd if weight is None else invstd * weight.to(acc)
    xmu = input.to(acc) - _per_channel(mean, input)
    dx = grad_out.to(acc) - _per_channel(mean_dy, input) - xmu * _per_channel(k, input)
    return (dx * _per_channel(iw, input)).to(input.dtype)
