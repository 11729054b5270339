"""The layer's checks of what it is built with (and of a residual operand the fused kernels can
take): each failure names the argument and the fix. What a call's input must be is checked by
the call (:mod:`syncbn_lightning.functional.layer_call`)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "FuseResidual",
    "check_fuse_residual",
    "check_num_features",
    "refuse_scripting",
    "same_operands",
]

#: What ``fuse_residual=`` takes: ``False``, ``True`` or block classes (or their import paths).
FuseResidual = bool | Sequence[type[nn.Module] | str]


def check_num_features(num_features: Any) -> None:
    """Raise a TypeError/ValueError unless ``num_features`` is a positive int."""
    if isinstance(num_features, bool) or not isinstance(num_features, int):
        raise TypeError(
            f"num_features must be an int (the number of channels), got "
            f"{type(num_features).__name__} {num_features!r}"
        )
    if num_features <= 0:
        raise ValueError(f"num_features must be > 0 (the number of channels), got {num_features}")


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
