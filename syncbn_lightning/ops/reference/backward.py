"""Pure-PyTorch twins of the backward's ``syncbn::`` operators (``grad_sums``, ``grad_input``),
shared by both exchanges, and the call-order header their sums carry. The semantics of
``csrc/cpu/entry_cpu.cpp``'s ``grad_sums_cpu``/``grad_input_cpu``; see :mod:`.steps` for
the forward steps and the conventions (the split mean ``mean + mean_lo``, the acc dtype).

The backward's sums travel as ``[header[16], sum_dy[C], sum_dy_xmu[C]]``. The header is the call's
layer and call tags (the merge's ``grad_info[4:6]``) as four 6-bit chunks each, every chunk followed
by its square: summed over ``P`` ranks (all-reduced, or gathered and summed here) a chunk and its
square are ``P c`` and ``P c^2`` together only when every rank sent ``c`` (the chunks' variance
over the ranks is then 0), so every rank detects a mismatch at the same call. The sums of ``P``
squares of at most ``63^2`` stay exact in float32 up to ``P = 4096``.
"""

from __future__ import annotations

import torch

from ..._shared import GRAD_HEADER
from ...distributed.call_order.policy import queues_order_flag
from ..activations import activation_grad, check_activation
from . import (
    CALL_ORDER_MARK,
    affine,
    centered,
    check_residual,
    per_channel,
    reduce_dims,
    scale,
)

__all__ = [
    "GRAD_HEADER",
    "grad_input",
    "grad_sums",
    "grad_sums_residual",
    "header_tags",
    "tag_header",
]

# The merges' info (and grad_info): [count, samples, order_ok, finite, layer_tag, call_tag].
_TAGS = slice(4, 6)
_GRAD_CHUNK = 64.0


def tag_header(tags: torch.Tensor) -> torch.Tensor:
    """The backward's header for the call tagged ``tags`` (``[layer_tag, call_tag]``, integers
    below 2**24 in a float dtype; e.g. ``grad_info[4:6]``): ``[c0, c0^2, ..., c7, c7^2]`` with
    ``c0..c3`` the 6-bit chunks of the layer tag (most significant first), ``c4..c7`` those of the
    call tag, in ``tags``' dtype."""
    powers = tags.new_tensor([_GRAD_CHUNK**k for k in (3, 2, 1, 0)], dtype=torch.float64)
    chunks = torch.remainder(torch.floor(tags.double().unsqueeze(1) / powers), _GRAD_CHUNK)
    chunks = chunks.reshape(-1)
    return torch.stack([chunks, chunks * chunks], dim=1).reshape(-1).to(tags.dtype)


def header_tags(header: torch.Tensor) -> tuple[int, int]:
    """The (layer tag, call tag) of one rank's backward header (the first :data:`GRAD_HEADER`
    values of its sums)."""
    chunks = [int(v) for v in header[0:GRAD_HEADER:2].tolist()]
    layer = ((chunks[0] * 64 + chunks[1]) * 64 + chunks[2]) * 64 + chunks[3]
    call = ((chunks[4] * 64 + chunks[5]) * 64 + chunks[6]) * 64 + chunks[7]
    return layer, call


def _input_grad(
    grad_out: torch.Tensor,
    xmu: torch.Tensor,
    input: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    act: int,
    act_param: float,
) -> torch.Tensor:
    """``dy * act'(z)`` in the acc dtype (``dy`` itself without an activation): the gradient at
    the activation's input, ``z`` recomputed from the centered input ``xmu``."""
    dy = grad_out.to(xmu.dtype)
    if act == 0:
        return dy
    z = affine(xmu, input, scale(input, invstd, weight), bias)
    return dy * activation_grad(z, act, act_param)


def grad_sums(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    act: int = 0,
    act_param: float = 0.0,
    mean_lo: torch.Tensor | None = None,
    info: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sums, grad_weight, grad_bias)``: the local ``[header[16], sum_dy[C], sum_dy_xmu[C]]``
    packed for the collective (``xmu = (x - mean) - mean_lo``; the header is :func:`tag_header`
    of ``info[4:6]``, the merge's tags of this call, zeros without ``info``), and the local
    parameter gradients (weight dtype, acc dtype without weight). With an activation,
    ``dy * act'(z)`` stands for ``dy``."""
    check_activation(act, act_param)
    xmu = centered(input, mean, mean_lo)
    dz = _input_grad(grad_out, xmu, input, invstd, weight, bias, act, act_param)
    dims = reduce_dims(input)
    # No shortcut for an empty batch: under torch.compile the sums must depend on dy (see the
    # reference's backward_reduce).
    sum_dy, sum_dy_xmu = dz.sum(dims), (dz * xmu).sum(dims)
    if info is None:
        header = sum_dy.new_zeros(GRAD_HEADER)
    else:
        header = tag_header(info[_TAGS]).to(sum_dy.dtype)
    param_dtype = weight.dtype if weight is not None else xmu.dtype
    return (
        torch.cat([header, sum_dy, sum_dy_xmu]),
        (sum_dy_xmu * invstd).to(param_dtype),
        sum_dy.to(param_dtype),
    )


def grad_sums_residual(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    act: int = 0,
    act_param: float = 0.0,
    mean_lo: torch.Tensor | None = None,
    info: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`grad_sums` of a layer whose output was ``act(z + residual)``: ``g = dy * act'(z +
    residual)`` (``dy`` without an activation), rounded to the input's dtype as the unfused
    activation's backward rounds it, stands for ``dy``. Returns ``(sums, grad_weight, grad_bias,
    g)``: ``g`` is the residual's gradient, and what :func:`grad_input` takes next with
    ``act=0``."""
    check_activation(act, act_param)
    check_residual(residual, input)
    if act == 0:
        g = grad_out.clone()
    else:
        xmu = centered(input, mean, mean_lo)
        z = affine(xmu, input, scale(input, invstd, weight), bias) + residual.to(xmu.dtype)
        g = (grad_out.to(xmu.dtype) * activation_grad(z, act, act_param)).to(input.dtype)
    return (*grad_sums(g, input, mean, invstd, weight, None, 0, 0.0, mean_lo, info), g)


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
    mean_lo: torch.Tensor | None = None,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_input, order_ok)``: the input gradient from ``R`` rows of :func:`grad_sums`' sums
    (``[R * (16 + 2C)]``, summed in row order) and the count ``info[0]`` (``dy * act'(z)`` for
    ``dy`` with an activation, as in :func:`grad_sums`), and the backward's call-order check.

    The check: the summed header equals ``P`` times this call's own (:func:`tag_header` of
    ``info[4:6]``), with ``P = R`` for gathered rows and ``world_size`` for one all-reduced row.
    That holds iff every rank sent this call's tags (a chunk's sum and the sum of its squares are
    ``P c`` and ``P c^2`` only when all ranks sent ``c``), so every rank finds a mismatch at the
    same call. On CPU tensors a mismatch raises (a message starting with :data:`CALL_ORDER_MARK`);
    elsewhere ``order_ok`` (one value, 1 or 0) reports it without a host sync."""
    check_activation(act, act_param)
    channels = input.shape[1]
    rows = sums.view(-1, GRAD_HEADER + 2 * channels)
    total = rows.sum(0)
    ranks = rows.shape[0] if rows.shape[0] > 1 else world_size
    own = tag_header(info[_TAGS])
    order_ok = (total[:GRAD_HEADER] == own * ranks).all()
    checks_now = not queues_order_flag(input) and not torch.compiler.is_compiling()
    if checks_now and not bool(order_ok):
        layer, call = header_tags(own)
        raise RuntimeError(
            f"{CALL_ORDER_MARK} backward: the ranks' layer or call tags differ (this rank: layer "
            f"tag {layer} call #{call + 1})"
        )
    xmu = centered(input, mean, mean_lo)
    dz = _input_grad(grad_out, xmu, input, invstd, weight, bias, act, act_param)
    n = info[:1].to(xmu.dtype).reshape(()).clamp_min(1)
    sums_of_group = total[GRAD_HEADER:]
    sum_dy, sum_dy_xmu = sums_of_group[:channels], sums_of_group[channels:]
    k = sum_dy_xmu / n * invstd * invstd
    dx = dz - per_channel(sum_dy / n, input) - xmu * per_channel(k, input)
    grad = (dx * per_channel(scale(input, invstd, weight), input)).to(input.dtype)
    return grad, order_ok.to(xmu.dtype).reshape(1)
