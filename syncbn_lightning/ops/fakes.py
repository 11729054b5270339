"""The ``syncbn::`` operators' fake (meta) kernels, registered when the extension is loaded.

The extension (``csrc/ops.cpp``) registers four operators, one per step of a synchronized layer
call, with CPU and CUDA kernels:

* ``syncbn::stats_row(input, layer_tag, calls!) -> row``
* ``syncbn::merge_normalize(input, rows, weight, bias, running_mean!, running_var!,
  num_batches_tracked!, nonfinite!, momentum, eps, unbiased, act=0, act_param=0.)
  -> (output, mean, invstd, var, info)``
* ``syncbn::grad_sums(grad_out, input, mean, invstd, weight, bias=None, act=0, act_param=0.)
  -> (sums, grad_weight, grad_bias)``
* ``syncbn::grad_input(grad_out, input, mean, invstd, weight, sums, info, bias=None, act=0,
  act_param=0.) -> grad_input``

``act``/``act_param`` are a fused activation (:mod:`.activations`; 0 is none).

Their semantics are those of the same-named functions of :mod:`.reference`. The fake (meta)
implementations below give ``torch.compile`` their output shapes, dtypes and strides without
running a kernel; torch imports this module for them (``set_python_module`` in ``csrc/ops.cpp``),
and :func:`register_fakes` registers them when the extension is loaded (:mod:`.build`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from . import reference

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
    return input.new_empty(reference.ROW_HEADER + 2 * input.shape[1], dtype=_acc(input.dtype))


def _merge_normalize_fake(
    input: torch.Tensor, rows: torch.Tensor, *_settings: Any
) -> tuple[torch.Tensor, ...]:
    """The outputs' shapes depend on ``input`` and ``rows`` only (the other arguments, those of
    :func:`.reference.merge_normalize`, are updated in place or are scalars)."""
    channels = input.shape[1]
    stats = [rows.new_empty(channels) for _ in range(3)]
    return (_dense_like(input), *stats, rows.new_empty(4))


def _grad_sums_fake(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    *_activation: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shapes from ``input``, dtypes from ``mean`` and ``weight`` (the activation arguments,
    ``bias, act, act_param``, change neither)."""
    channels = input.shape[1]
    param_dtype = weight.dtype if weight is not None else mean.dtype
    return (
        mean.new_empty(2 * channels),
        mean.new_empty(channels, dtype=param_dtype),
        mean.new_empty(channels, dtype=param_dtype),
    )


def _grad_input_fake(grad_out: torch.Tensor, input: torch.Tensor, *_rest: Any) -> torch.Tensor:
    """The input gradient has the input's shape and layout (the other arguments: those of
    :func:`.reference.grad_input`)."""
    return _dense_like(input)


_FAKES = {
    "syncbn::stats_row": _stats_row_fake,
    "syncbn::merge_normalize": _merge_normalize_fake,
    "syncbn::grad_sums": _grad_sums_fake,
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
