"""Pure-PyTorch reference of the BatchNorm primitives and fused steps: the kernels' twin.

The same five primitives and four fused steps as the C++/CUDA extension in ``csrc/`` (the fused
steps are its ``syncbn::`` operators) with identical signatures and semantics (see
``csrc/syncbn.h``). They run on any device and dtype, serve as the test oracle for the kernels, and
are the fallback when the extension cannot be built (``SYNCBN_IMPL=ref``); plain torch code, so
``torch.compile`` traces them too.

Conventions:
    * ``input`` has shape ``(N, C, *)``; statistics are per channel (dim 1).
    * The *acc dtype* is float32 for float16/bfloat16/float32 inputs and float64 for float64 inputs;
      every statistic is computed and returned in it.
    * Outputs of elementwise primitives keep the input's dtype and memory format.
"""

from __future__ import annotations

import torch

from .activations import activate, activation_grad, check_activation

__all__ = [
    "acc_dtype",
    "local_stats",
    "merge_stats",
    "normalize",
    "backward_reduce",
    "backward_elemt",
    "ROW_HEADER",
    "TAG_LIMIT",
    "CALL_ORDER_MARK",
    "check_group_count",
    "stats_row",
    "merge_normalize",
    "grad_sums",
    "grad_input",
    "per_channel",
    "reduce_dims",
    "update_running",
]

# Values in front of the statistics in a gathered row: [count, samples, layer_tag, call_tag].
ROW_HEADER = 4
# Tags travel in the statistics' float dtype: below 2**24 they are exact even in float32.
TAG_LIMIT = 1 << 24
# How a call-order mismatch found while merging starts its message (C++ kernels and this file).
CALL_ORDER_MARK = "syncbn call order:"


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for an input dtype: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def reduce_dims(input: torch.Tensor) -> list[int]:
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
    return _affine(input, mean, _scale(input, invstd, weight), bias).to(input.dtype)


def _scale(input: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``invstd * weight`` in the acc dtype."""
    return invstd if weight is None else invstd * weight.to(acc_dtype(input.dtype))


def _affine(
    input: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``z = (x - mean) * scale + bias`` in the acc dtype (not rounded)."""
    acc = acc_dtype(input.dtype)
    z = (input.to(acc) - per_channel(mean, input)) * per_channel(scale, input)
    if bias is not None:
        z = z + per_channel(bias.to(acc), input)
    return z


def _activation_input_grad(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    act: int,
    act_param: float,
) -> torch.Tensor:
    """``dy * act'(z)`` in the acc dtype (``grad_out`` itself without an activation): the
    gradient at the activation's input, z recomputed from ``input``."""
    if act == 0:
        return grad_out
    z = _affine(input, mean, _scale(input, invstd, weight), bias)
    return grad_out.to(z.dtype) * activation_grad(z, act, act_param)


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
    sum_dy_xmu = (dy * (input.to(acc) - per_channel(mean, input))).sum(dims)
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
    xmu = input.to(acc) - per_channel(mean, input)
    dx = grad_out.to(acc) - per_channel(mean_dy, input) - xmu * per_channel(k, input)
    return (dx * per_channel(iw, input)).to(input.dtype)


# ------------------------------------------------------------------------------------------------
# Fused steps (the syncbn:: operators of the extension)
# ------------------------------------------------------------------------------------------------


def stats_row(input: torch.Tensor, layer_tag: int, calls: torch.Tensor) -> torch.Tensor:
    """This rank's row for the forward collective, ``[count, samples, layer_tag, call_tag,
    mean[C], m2[C]]`` in the acc dtype; ``calls`` (one int64 element) is the layer's call counter,
    written as the call tag and incremented in place."""
    mean, m2 = local_stats(input)
    count = input.numel() // input.shape[1]
    header = torch.stack(
        [
            mean.new_full((), float(count)),
            mean.new_full((), float(input.shape[0])),
            mean.new_full((), float(layer_tag % TAG_LIMIT)),
            (calls.reshape(()) % TAG_LIMIT).to(mean.dtype),
        ]
    )
    calls.add_(1)
    return torch.cat([header, mean, m2])


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge the gathered rows, update the running statistics, normalize (and apply the
    activation ``act``, see :mod:`.activations`, before rounding to the input's dtype).

    Returns ``(output, mean, invstd, var, info)`` with ``info = [count, samples, order_ok,
    finite]``. On CPU tensors a call-order mismatch raises (message starting with
    :data:`CALL_ORDER_MARK`) and a group with a single value per channel raises torch's
    ValueError; on other devices these need a host sync, so only ``info[2]`` reports the order.
    The running statistics are left alone when the merged statistics are not finite or the group
    is empty; ``num_batches_tracked`` advances unless they are not finite, ``nonfinite`` counts the
    skips.
    """
    check_activation(act, act_param)
    channels = input.shape[1]
    table = rows.view(-1, ROW_HEADER + 2 * channels)
    tags = table[:, 2:ROW_HEADER]
    order_ok = (tags == tags[0]).all()
    counts = table[:, 0]
    total = counts.sum()
    if input.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_cpu_merge(tags, order_ok, total, input, table.shape[0])
    mean, invstd, var = merge_stats(
        counts,
        table[:, ROW_HEADER : ROW_HEADER + channels],
        table[:, ROW_HEADER + channels :],
        eps,
        unbiased,
    )
    finite = torch.isfinite(mean).all() & torch.isfinite(var).all()
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
                finite & (total > 0),
                momentum,
                num_batches_tracked,
            )
    info = torch.stack([total, table[:, 1].sum(), order_ok.to(mean.dtype), finite.to(mean.dtype)])
    z = _affine(input, mean, _scale(input, invstd, weight), bias)
    output = activate(z, act, act_param).to(input.dtype)
    return output, mean, invstd, var, info


def _check_cpu_merge(
    tags: torch.Tensor,
    order_ok: torch.Tensor,
    total: torch.Tensor,
    input: torch.Tensor,
    world: int,
) -> None:
    if not bool(order_ok):
        calls = "; ".join(
            f"row {i}: layer tag {int(layer)} call #{int(call) + 1}"
            for i, (layer, call) in enumerate(tags.tolist())
        )
        raise RuntimeError(f"{CALL_ORDER_MARK} tags differ ({calls})")
    check_group_count(int(total.item()), input, world)


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


def grad_sums(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    act: int = 0,
    act_param: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sums, grad_weight, grad_bias)``: the local ``[sum_dy[C], sum_dy_xmu[C]]`` packed for the
    collective, and the local parameter gradients (weight dtype, acc dtype without weight). With
    an activation, ``dy * act'(z)`` stands for ``dy`` (``z`` recomputed with ``bias``)."""
    check_activation(act, act_param)
    dz = _activation_input_grad(grad_out, input, mean, invstd, weight, bias, act, act_param)
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = backward_reduce(
        dz, input, mean, invstd, weight, True, True
    )
    assert grad_weight is not None and grad_bias is not None
    return torch.cat([sum_dy, sum_dy_xmu]), grad_weight, grad_bias


def grad_input(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    sums: torch.Tensor,
    info: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: int = 0,
    act_param: float = 0.0,
) -> torch.Tensor:
    """The input gradient from ``R`` rows of sums (``[R * 2C]``, summed in row order) and the
    group count ``info[0]`` (``dy * act'(z)`` for ``dy`` with an activation, as in
    :func:`grad_sums`)."""
    check_activation(act, act_param)
    channels = input.shape[1]
    total = sums.view(-1, 2 * channels).sum(0)
    dz = _activation_input_grad(grad_out, input, mean, invstd, weight, bias, act, act_param)
    return backward_elemt(
        dz, input, mean, invstd, weight, total[:channels], total[channels:], info[:1]
    )
