"""The layer's checks of what it is built with and what it is called on: each failure names the
argument and the fix, before any kernel or collective runs."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "FuseResidual",
    "check_dims",
    "check_fuse_residual",
    "check_input",
    "check_num_features",
    "functorch_error",
    "refuse_scripting",
    "same_operands",
]

#: What ``fuse_residual=`` takes: ``False``, ``True`` or block classes (or their import paths).
FuseResidual = bool | Sequence[type[nn.Module] | str]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def check_num_features(num_features: Any) -> None:
    """Raise a TypeError/ValueError unless ``num_features`` is a positive int."""
    if isinstance(num_features, bool) or not isinstance(num_features, int):
        raise TypeError(
            f"num_features must be an int (the number of channels), got "
            f"{type(num_features).__name__} {num_features!r}"
        )
    if num_features <= 0:
        raise ValueError(f"num_features must be > 0 (the number of channels), got {num_features}")


def check_dims(input: torch.Tensor) -> None:
    """Raise a ValueError unless ``input`` has the shape ``(N, C, *)``."""
    if input.dim() < 2:
        raise ValueError(
            f"SyncBatchNorm expects input of shape (N, C, *) with at least 2 dims, got "
            f"{input.dim()}-D input of shape {tuple(input.shape)}"
        )


def check_input(
    input: Any, num_features: int, reference: torch.Tensor | None, reference_name: str
) -> None:
    """Raise a TypeError/ValueError naming the fix unless ``input`` fits a layer of
    ``num_features`` channels whose first tensor is ``reference`` (its weight, else its running
    mean, named ``reference_name``; ``None``: nothing to match)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"SyncBatchNorm input must be a torch.Tensor, got {type(input).__name__}")
    check_dims(input)
    if not input.is_floating_point():
        raise TypeError(
            f"SyncBatchNorm input must be floating point (float16, bfloat16, float32, "
            f"float64), got {input.dtype}: convert it, e.g. input.float()"
        )
    # While torch.jit.trace records, the comparison of a traced size would only warn that it
    # becomes a constant of the trace (it is one: the layer's channel count).
    if not torch.jit.is_tracing() and input.shape[1] != num_features:
        raise ValueError(
            f"SyncBatchNorm input has {input.shape[1]} channels (dim 1) but the layer was "
            f"built with num_features={num_features}: use "
            f"SyncBatchNorm({input.shape[1]}) or fix the preceding layer "
            f"(input shape {tuple(input.shape)})"
        )
    if reference is None:
        return
    if reference.device != input.device:
        raise ValueError(
            f"SyncBatchNorm input is on {input.device} but the layer's parameters/buffers are "
            f"on {reference.device}: move the model with model.to({str(input.device)!r})"
        )
    if input.dtype != reference.dtype and not (
        input.dtype in _HALF_DTYPES and reference.dtype == torch.float32
    ):
        raise TypeError(
            f"SyncBatchNorm input dtype {input.dtype} does not match the layer's "
            f"{reference_name} dtype {reference.dtype}: cast the model "
            f"(model.to({input.dtype})) or the input; float16/bfloat16 inputs may also use "
            f"float32 parameters"
        )


def same_operands(input: torch.Tensor, residual: Any) -> bool:
    """Whether ``residual`` can be the fused kernels' residual operand for ``input``: a tensor of
    the same shape, dtype and device (anything else is added by torch, broadcasting and
    promoting as the unfused code would)."""
    return (
        isinstance(residual, torch.Tensor)
        and isinstance(input, torch.Tensor)
        and residual.shape == input.shape
        and residual.dtype == input.dtype
        and residual.device == input.device
    )


def functorch_error() -> RuntimeError:
    """The error of a synchronized call inside a ``torch.func`` transform
    (``syncbn_lightning._compat.functorch_active``), which no synchronized call can run in: its
    statistics are a collective over the process group, which a transform can neither batch
    (``vmap``) nor differentiate functionally (``grad``: the layer's autograd nodes, C++ and
    Python, are not functorch-aware)."""
    return RuntimeError(
        "SyncBatchNorm cannot synchronize its batch statistics inside a torch.func transform "
        "(grad, vmap, jacrev, vjp, ...): the exchange is a collective over the process group, "
        "which these transforms can neither batch nor differentiate. Inside the transform, put "
        "the layer in eval mode: it normalizes with its running statistics and communicates "
        "nothing."
    )


def refuse_scripting(layer: Any) -> Any:
    """A synchronized layer's ``__prepare_scriptable__``: raise a TypeError with the ways that work.

    TorchScript cannot compile the layer (its settings object, its process group, the
    synchronized path); in eval mode it computes what plain BatchNorm computes, and the export
    paths that trace a call (``torch.export``, ONNX, ``torch.jit.trace``) take it as it is.
    Scripting a reverted copy gives the same eval-mode module.
    """
    raise TypeError(
        f"torch.jit.script cannot compile {layer._get_name()} (its synchronized forward holds "
        f"a process group and settings TorchScript has no type for): script "
        f"revert_sync_batchnorm(copy.deepcopy(model)).eval() instead, plain BatchNorm layers "
        f"with the same tensors (what these layers compute in eval mode), or export the model "
        f"in eval mode with torch.export.export, torch.onnx.export or torch.jit.trace "
        f"(docs/library.md, Export)"
    )


def check_fuse_residual(value: Any) -> tuple[type[nn.Module], ...] | None:
    """``fuse_residual=`` as the block classes to trace besides the known ones: ``None`` for
    ``False`` (fuse nothing), ``()`` for ``True`` (the known classes only), the classes of a list
    (``nn.Module`` subclasses, or ``"package.module.Class"`` paths, imported here).

    Raises:
        TypeError / ValueError: naming ``fuse_residual``, the entry and what it takes.
    """
    if isinstance(value, bool):
        return () if value else None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"fuse_residual must be True, False or a list of residual block classes (or their "
            f"import paths, 'package.module.Class') to trace, got {value!r}"
        )
    return tuple(_block_class(entry) for entry in value)


def _block_class(entry: Any) -> type[nn.Module]:
    """One entry of a ``fuse_residual`` list as a class."""
    if isinstance(entry, str):
        module_name, _, name = entry.rpartition(".")
        try:
            entry = getattr(importlib.import_module(module_name), name) if module_name else None
        except (ImportError, AttributeError) as exc:
            raise ValueError(
                f"fuse_residual: cannot import the block class {entry!r} ({exc}); give its full "
                f"path, 'package.module.Class'"
            ) from None
        if entry is None:
            raise ValueError(
                "fuse_residual: a block class path needs its module, 'package.module.Class'"
            )
    if not (isinstance(entry, type) and issubclass(entry, nn.Module)):
        raise TypeError(
            f"fuse_residual: each entry must be a torch.nn.Module subclass (a residual block's "
            f"class) or its import path, got {entry!r}"
        )
    return entry
