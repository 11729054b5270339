"""The activations a synchronized layer fuses into its kernels: ONE registry, read by all the rest.

A :class:`~syncbn_lightning.SyncBatchNormAct` computes ``act(bn(x))``. In its synchronized
training forward the activation runs inside the normalize kernel, on the acc-dtype value before
the one rounding to the input's dtype, and its backward recomputes the pre-activation ``z`` from
the saved input: ``dy * act'(z)`` stands for ``dy`` in the two backward kernels. That saves the
activation's own pass over the tensor (a read and a write forward, two reads and a write
backward) and the memory of its saved input.

:data:`ACTIVATIONS` is the table: one :class:`Activation` row per kind, with the code the
operators take (``ActKind`` in ``csrc/include/activation.h``, checked by
``tests/test_activations.py``), the module type that computes it, the reference formulas (the
pure-PyTorch twin of the kernels) and what a name given as ``act=`` builds. The layer
(:func:`fused_activation`, :func:`make_activation`), the reference steps (:func:`activate`,
:func:`activation_grad`) and the documentation's table (:func:`markdown_table`) all read it. A
new fused activation is one row here and its case in ``csrc/include/activation.h``.

Derivatives at the kinks take the side torch's backward takes: relu and leaky_relu the ``z <= 0``
side at 0, hardswish the outer pieces at +-3, relu6 0 at 0 and 6.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "activate",
    "activation_grad",
    "by_name",
    "check_activation",
    "fused_activation",
    "make_activation",
    "markdown_table",
    "optional_module",
]

_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
Formula = Callable[[torch.Tensor, float], torch.Tensor]


def _no_param(_module: nn.Module) -> float | None:
    return 0.0


@dataclass(frozen=True)
class Activation:
    """One fusable activation.

    Attributes:
        name: what ``SyncBatchNormAct(act=name)`` accepts.
        code: the kernels' code for it (``ActKind`` in ``csrc/include/activation.h``).
        module: the ``nn.Module`` type that computes it (matched exactly: a subclass may override
            ``forward``); ``make_activation(name)`` builds ``module()``.
        forward: ``forward(z, param)``, the reference of the fused forward, in ``z``'s dtype.
        grad: ``grad(z, param)``, ``d act / dz`` at ``z``.
        formula: the forward in words, for the documentation.
        param: the fused parameter of a ``module`` instance (leaky_relu's negative slope), or
            ``None`` when that instance computes something the kernels do not (``nn.GELU`` with
            ``approximate="tanh"``).
    """

    name: str
    code: int
    module: type[nn.Module]
    forward: Formula
    grad: Formula
    formula: str
    param: Callable[[nn.Module], float | None] = _no_param


def _ones(z: torch.Tensor, _p: float) -> torch.Tensor:
    return torch.ones_like(z)


def _step(z: torch.Tensor, below: float) -> torch.Tensor:
    """1 where ``z > 0``, else ``below``."""
    return torch.where(z > 0, torch.ones_like(z), torch.full_like(z, below))


def _silu_grad(z: torch.Tensor, _p: float) -> torch.Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def _hardswish_grad(z: torch.Tensor, _p: float) -> torch.Tensor:
    one, zero = torch.ones_like(z), torch.zeros_like(z)
    return torch.where(z <= -3, zero, torch.where(z < 3, z / 3 + 0.5, one))


def _gelu(z: torch.Tensor, _p: float) -> torch.Tensor:
    return 0.5 * z * (1 + torch.erf(z * _SQRT_HALF))


def _gelu_grad(z: torch.Tensor, _p: float) -> torch.Tensor:
    pdf = torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    return 0.5 * (1 + torch.erf(z * _SQRT_HALF)) + z * pdf


def _relu6_grad(z: torch.Tensor, _p: float) -> torch.Tensor:
    return ((z > 0) & (z < 6)).to(z.dtype)


#: The registry, by code (``ACTIVATIONS[code].code == code``).
ACTIVATIONS: tuple[Activation, ...] = (
    Activation("identity", 0, nn.Identity, lambda z, p: z, _ones, "z"),
    Activation(
        "relu", 1, nn.ReLU, lambda z, p: torch.relu(z), lambda z, p: _step(z, 0.0), "max(z, 0)"
    ),
    Activation(
        "leaky_relu",
        2,
        nn.LeakyReLU,
        lambda z, p: torch.where(z > 0, z, z * p),
        _step,
        "z if z > 0 else slope * z (slope: the module's negative_slope, 0.01 by name)",
        param=lambda m: float(m.negative_slope),
    ),  # type: ignore[arg-type]
    Activation("silu", 3, nn.SiLU, lambda z, p: z * torch.sigmoid(z), _silu_grad, "z * sigmoid(z)"),
    Activation(
        "hardswish",
        4,
        nn.Hardswish,
        lambda z, p: z * (z + 3).clamp(0, 6) / 6,
        _hardswish_grad,
        "z * clamp(z + 3, 0, 6) / 6",
    ),
    Activation(
        "gelu",
        5,
        nn.GELU,
        _gelu,
        _gelu_grad,
        "z * Phi(z), the exact (erf) form",
        param=lambda m: 0.0 if m.approximate == "none" else None,
    ),
    Activation("relu6", 6, nn.ReLU6, lambda z, p: z.clamp(0, 6), _relu6_grad, "clamp(z, 0, 6)"),
)
_BY_NAME = {a.name: a for a in ACTIVATIONS}
_BY_MODULE = {a.module: a for a in ACTIVATIONS}
assert [a.code for a in ACTIVATIONS] == list(range(len(ACTIVATIONS))), "rows are in code order"


def by_name(name: str) -> Activation:
    """The row named ``name`` (case and surrounding spaces ignored).

    Raises:
        ValueError: naming the known activations.
    """
    row = _BY_NAME.get(name.strip().lower())
    if row is None:
        raise ValueError(
            f"act={name!r} is not a known activation: use an nn.Module or one of {sorted(_BY_NAME)}"
        )
    return row


def _row(act: int) -> Activation:
    if not (isinstance(act, int) and 0 <= act < len(ACTIVATIONS)):
        raise ValueError(
            f"act must be an activation code of ACTIVATIONS (0..{len(ACTIVATIONS) - 1}: "
            f"{', '.join(a.name for a in ACTIVATIONS)}), got {act!r}"
        )
    return ACTIVATIONS[act]


def activate(z: torch.Tensor, act: int, param: float = 0.0) -> torch.Tensor:
    """``act(z)`` for an activation code (``param``: leaky_relu's negative slope), computed in
    ``z``'s dtype: the forward of a fused layer applies it to the acc-dtype ``z`` before rounding to
    the input's dtype."""
    return z if act == 0 else _row(act).forward(z, param)


def activation_grad(z: torch.Tensor, act: int, param: float = 0.0) -> torch.Tensor:
    """``d act / dz`` at ``z`` (at the kinks, the side torch's backward takes)."""
    return _row(act).grad(z, param)


def check_activation(act: int, act_param: float) -> None:
    """The operators' checks of ``act``/``act_param`` (a known code, a finite parameter), with the
    C++ kernels' messages."""
    if not (isinstance(act, int) and 0 <= act < len(ACTIVATIONS)):
        raise RuntimeError(
            f"syncbn: `act` must be an activation code in [0, {len(ACTIVATIONS)}) "
            f"(syncbn_lightning.ops.activations.ACTIVATIONS), got {act}"
        )
    if not math.isfinite(act_param):
        raise RuntimeError(
            f"syncbn: `act_param` must be finite (the negative slope of leaky_relu), got "
            f"{act_param}"
        )


def fused_activation(module: nn.Module | None) -> tuple[int, float] | None:
    """``(code, param)`` of the activation ``module`` computes if the kernels can fuse it (a
    registry row's exact module type, with a parameter the kernels take; ``None`` is the
    identity), else ``None``. ``inplace`` makes no difference: the fused kernel writes a new
    output either way."""
    if module is None:
        return 0, 0.0
    row = _BY_MODULE.get(type(module))
    if row is None:
        return None
    param = row.param(module)
    return None if param is None else (row.code, param)


def make_activation(act: nn.Module | str | None) -> nn.Module:
    """``act`` as a module: itself, the module a registry name stands for (``"leaky_relu"`` with
    torch's default slope, 0.01), or ``nn.Identity()`` for ``None``.

    Raises:
        ValueError / TypeError: naming ``act`` and the accepted values.
    """
    if isinstance(act, str):
        return by_name(act).module()
    return optional_module(act, "act")


def optional_module(value: Any, name: str) -> nn.Module:
    """``value`` itself if it is a module, ``nn.Identity()`` for ``None``.

    Raises:
        TypeError: naming ``name``.
    """
    if value is None:
        return nn.Identity()
    if not isinstance(value, nn.Module):
        raise TypeError(
            f"{name} must be an nn.Module or None (the identity), got {type(value).__name__}"
        )
    return value


def markdown_table() -> str:
    """The registry as the documentation's Markdown table (``docs/timm.md`` shows it)."""
    lines = [
        "| `act=` | module (exact type) | fused forward `act(z)` | kernel code |",
        "|---|---|---|---:|",
    ]
    lines += [
        f'| `"{a.name}"` | `nn.{a.module.__name__}` | {a.formula} | {a.code} |' for a in ACTIVATIONS
    ]
    return "\n".join(lines)
