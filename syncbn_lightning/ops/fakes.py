"""The ``syncbn::`` operators' fake (meta) kernels, registered when the extension is loaded.

The extension (``csrc/ops/ops.cpp``) registers eight operators, one per step of a synchronized layer
call, with CPU and CUDA kernels:

* the gather exchange: ``syncbn::stats_row(input, layer_tag, calls!) -> row`` and
  ``syncbn::merge_normalize(input, rows, weight, bias, running_mean!, running_var!,
  num_batches_tracked!, nonfinite!, momentum, eps, unbiased, act=0, act_param=0.,
  equal_rank_weights=False, residual=None) -> (output, mean, mean_lo, invstd, var, info,
  grad_info)``;
* the reduce exchange: ``syncbn::reduce_sums(input, shift, layer_tag, calls!,
  equal_rank_weights) -> sums`` and ``syncbn::reduce_merge_normalize(input, total, sent, weight,
  bias, running_mean!, running_var!, num_batches_tracked!, nonfinite!, momentum, eps, unbiased,
  equal_rank_weights, world_size, act=0, act_param=0., residual=None)`` with the same outputs;
* a checkpoint's recompute: ``syncbn::renormalize(input, mean, mean_lo, invstd, weight, bias,
  act=0, act_param=0., residual=None) -> output`` (the merges' output again, from their
  statistics);
* the backward of both: ``syncbn::grad_sums(grad_out, input, mean, invstd, weight, bias=None,
  act=0, act_param=0., mean_lo=None, info=None) -> (sums, grad_weight, grad_bias)``, with a
  fused residual ``syncbn::grad_sums_residual(grad_out, input, mean, invstd, weight, bias,
  residual, act=0, act_param=0., mean_lo=None, info=None) -> (sums, grad_weight, grad_bias,
  grad_residual)``, and
  ``syncbn::grad_input(grad_out, input, mean, invstd, weight, sums, info, bias=None, act=0,
  act_param=0., mean_lo=None, world_size=1) -> (grad_input, order_ok)``.

``act``/``act_param`` are a fused activation (:mod:`.activations`; 0 is none); ``residual`` is
added before it (``act(z + residual)``, a residual block's tail).

The C++ path of a layer call (``csrc/layer/layer.cpp``) adds three: ``syncbn::sync_batch_norm`` (the
whole call, with its autograd node in C++: a checkpointed forward and its recompute too) and its
two steps below autograd, ``syncbn::sync_batch_norm_forward`` and
``syncbn::sync_batch_norm_backward``; fakes below too, so that fake tensors and dispatch modes can
run them.

Their semantics are those of the same-named functions of :mod:`.reference.steps`. The fake (meta)
implementations below give ``torch.compile`` their output shapes, dtypes and strides without
running a kernel; torch imports this module for them (``set_python_module`` in
``csrc/ops/ops.cpp``), and :func:`register_fakes` registers them when the extension is loaded
(:mod:`.build`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .._shared import INFO_FIELDS, KEPT_PER_CHANNEL
from . import reference
from .reference import steps as reference_steps

__all__ = ["register_fakes"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return reference.acc_dtype(dtype)


def _dense_like(input: torch.Tensor) -> torch.Tensor:
    """What the kernels allocate for an elementwise output: the input's layout when it is dense
    channels-first or channels-last, else contiguous."""
    if input.is_contiguous() or input.movedim(1, -1).is_contiguous():
        return torch.empty_like(input)
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _stats_row_fake(input: torch.Tensor, layer_tag: int, calls: torch.Tensor) -> torch.Tensor:
    return input.new_empty(reference_steps.row_width(input.shape[1]), dtype=_acc(input.dtype))


def _merged(input: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(output, mean, mean_lo, invstd, var, info, grad_info)`` of both merges: shapes from
    ``input``, statistics in the input's acc dtype on ``like``'s device."""
    acc, channels = _acc(input.dtype), input.shape[1]
    stats = [like.new_empty(channels, dtype=acc) for _ in range(4)]
    infos = (like.new_empty(reference_steps.INFO_FIELDS, dtype=acc) for _ in range(2))
    return (_dense_like(input), *stats, *infos)


def _merge_normalize_fake(
    input: torch.Tensor, rows: torch.Tensor, *_settings: Any
) -> tuple[torch.Tensor, ...]:
    """The outputs' shapes depend on ``input`` only (the other arguments, those of
    :func:`.reference.steps.merge_normalize`, are updated in place or are scalars)."""
    return _merged(input, rows)


def _reduce_sums_fake(input: torch.Tensor, *_settings: Any) -> torch.Tensor:
    return input.new_empty(reference_steps.REDUCE_HEADER + 2 * input.shape[1], dtype=torch.float64)


def _reduce_merge_normalize_fake(input: torch.Tensor, *_rest: Any) -> tuple[torch.Tensor, ...]:
    """As :func:`_merge_normalize_fake` (arguments: :func:`.reference.steps
    .reduce_merge_normalize`'s)."""
    return _merged(input, input)


def _renormalize_fake(input: torch.Tensor, *_rest: Any) -> torch.Tensor:
    """The merges' output: the input's shape and layout."""
    return _dense_like(input)


def _grad_sums_fake(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    *_activation: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shapes from ``input``, dtypes from ``mean`` and ``weight`` (the activation arguments,
    ``bias, act, act_param``, ``mean_lo`` and ``info`` change neither)."""
    channels = input.shape[1]
    param_dtype = weight.dtype if weight is not None else mean.dtype
    return (
        mean.new_empty(reference_steps.GRAD_HEADER + 2 * channels),
        mean.new_empty(channels, dtype=param_dtype),
        mean.new_empty(channels, dtype=param_dtype),
    )


def _grad_sums_residual_fake(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    *_rest: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_grad_sums_fake`'s three, and the residual's gradient: the input's shape and
    layout."""
    return (*_grad_sums_fake(grad_out, input, mean, invstd, weight), _dense_like(input))


def _grad_input_fake(
    grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, *_rest: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input gradient has the input's shape and layout, the order flag is one value of the
    acc dtype (the other arguments: those of :func:`.reference.steps.grad_input`)."""
    return _dense_like(input), mean.new_empty(1)


def _layer_forward_fake(input: torch.Tensor, *_rest: Any) -> tuple[Any, ...]:
    """``syncbn::sync_batch_norm_forward``: the merge's outputs in the operator's order
    ``(output, mean, var, info, mean_lo, invstd, grad_info)``, and the flight recorder's call
    number (none is recorded under fake tensors: -1)."""
    output, mean, mean_lo, invstd, var, info, grad_info = _merged(input, input)
    return output, mean, var, info, mean_lo, invstd, grad_info, -1


#: ``keep``'s position among ``syncbn::sync_batch_norm``'s arguments after ``input``.
_KEEP_AT = 12


def _layer_fake(input: torch.Tensor, *rest: Any, **named: Any) -> tuple[torch.Tensor | None, ...]:
    """``syncbn::sync_batch_norm``: the forward's first four, and what a checkpointed forward
    keeps (``keep``; ``None`` otherwise): ``KEPT_PER_CHANNEL`` vectors of one value per channel
    and two infos, in the acc dtype; and the flight recorder's call number (-1: none is recorded
    under fake tensors)."""
    output, mean, var, info, *_ = _layer_forward_fake(input, *rest)
    keep = named["keep"] if "keep" in named else rest[_KEEP_AT]
    size = KEPT_PER_CHANNEL * input.shape[1] + 2 * INFO_FIELDS
    return output, mean, var, info, mean.new_empty(size) if keep else None, -1


def _layer_backward_fake(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    *rest: Any,
) -> tuple[torch.Tensor | None, ...]:
    """``syncbn::sync_batch_norm_backward``: the input's and the residual's gradients like the
    input, the parameters' like the weight (``None`` where the real kernel returns none: no
    input gradient with ``input_grad`` false, the schema's last argument)."""
    grads = [None, None] if weight is None else [weight.new_empty(weight.shape) for _ in "wb"]
    grad_input = _dense_like(input) if rest[-1] else None
    return grad_input, *grads, None if residual is None else _dense_like(input)


_FAKES = {
    "syncbn::sync_batch_norm": _layer_fake,
    "syncbn::sync_batch_norm_forward": _layer_forward_fake,
    "syncbn::sync_batch_norm_backward": _layer_backward_fake,
    "syncbn::stats_row": _stats_row_fake,
    "syncbn::merge_normalize": _merge_normalize_fake,
    "syncbn::reduce_sums": _reduce_sums_fake,
    "syncbn::reduce_merge_normalize": _reduce_merge_normalize_fake,
    "syncbn::renormalize": _renormalize_fake,
    "syncbn::grad_sums": _grad_sums_fake,
    "syncbn::grad_sums_residual": _grad_sums_residual_fake,
    "syncbn::grad_input": _grad_input_fake,
}
_registered = False
_fakes_lock = threading.Lock()


def register_fakes() -> None:
    """Register the fake implementations (once per process; the operators must exist)."""
    global _registered
    with _fakes_lock:
        if _registered:
            return
        for name, fake in _FAKES.items():
            torch.library.register_fake(name)(fake)
        _registered = True


if hasattr(torch.ops, "syncbn") and hasattr(torch.ops.syncbn, "stats_row"):
    # Imported by torch on behalf of an already loaded extension (set_python_module).
    register_fakes()
