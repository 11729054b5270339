"""The activations a synchronized layer fuses into its kernels (layer 1, beside the reference).

A :class:`~syncbn_lightning.SyncBatchNormAct` computes ``act(bn(x))``. In its synchronized
training forward the activation runs inside the normalize kernel, on the acc-dtype value before
the one rounding to the input's dtype, and its backward recomputes the pre-activation ``z`` from
the saved input: ``dy * act'(z)`` stands for ``dy`` in the two backward kernels. That saves the
activation's own pass over the tensor (a read and a write forward, two reads and a write
backward) and the memory of its saved input.

The operators take the activation as a code (:data:`ACTIVATIONS`) and one float parameter;
:func:`fused_activation` maps an ``nn.Module`` to them, or to ``None`` when the module is not one
the kernels reproduce (then the layer applies the module itself, after the normalization).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = [
    "ACTIVATIONS",
    "activate",
    "activation_grad",
    "check_activation",
    "fused_activation",
]

# The activations the fused steps apply after the affine step, by the code the operators take
# (csrc/activation.h); "leaky_relu" takes its negative slope as ``act_param``.
ACTIVATIONS = {
    "identity": 0,
    "relu": 1,
    "leaky_relu": 2,
    "silu": 3,
    "hardswish": 4,
    "gelu": 5,
    "relu6": 6,
}
_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def activate(z: torch.Tensor, act: int, param: float = 0.0) -> torch.Tensor:
    """``act(z)`` for an activation code of :data:`ACTIVATIONS` (``param``: leaky_relu's negative
    slope), computed in ``z``'s dtype: the forward of a fused layer applies it to the acc-dtype
    ``z`` before rounding to the input's dtype."""
    if act == 0:
        return z
    if act == 1:
        return torch.relu(z)
    if act == 2:
        return torch.where(z > 0, z, z * param)
    if act == 3:
        return z * torch.sigmoid(z)
    if act == 4:
        return z * (z + 3).clamp(0, 6) / 6
    if act == 5:
        return 0.5 * z * (1 + torch.erf(z * _SQRT_HALF))
    if act == 6:
        return z.clamp(0, 6)
    raise ValueError(f"act must be an activation code of ACTIVATIONS {ACTIVATIONS}, got {act!r}")


def activation_grad(z: torch.Tensor, act: int, param: float = 0.0) -> torch.Tensor:
    """``d act / dz`` at ``z``; at the kinks the side torch's backward takes (relu and leaky_relu:
    the ``z <= 0`` side at 0; hardswish: the outer pieces at +-3; relu6: 0 at 0 and 6)."""
    one, zero = torch.ones_like(z), torch.zeros_like(z)
    if act == 0:
        return one
    if act == 1:
        return torch.where(z > 0, one, zero)
    if act == 2:
        return torch.where(z > 0, one, torch.full_like(z, param))
    if act == 3:
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if act == 4:
        return torch.where(z <= -3, zero, torch.where(z < 3, z / 3 + 0.5, one))
    if act == 5:
        pdf = torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
        return 0.5 * (1 + torch.erf(z * _SQRT_HALF)) + z * pdf
    if act == 6:
        return torch.where((z > 0) & (z < 6), one, zero)
    raise ValueError(f"act must be an activation code of ACTIVATIONS {ACTIVATIONS}, got {act!r}")


def check_activation(act: int, act_param: float) -> None:
    """The operators' checks of ``act``/``act_param`` (a known code, a finite parameter)."""
    if act not in _CODES:
        raise RuntimeError(
            f"syncbn: `act` must be an activation code in [0, {len(ACTIVATIONS)}) "
            f"(syncbn_lightning.activation.ACTIVATIONS), got {act}"
        )
    if not math.isfinite(act_param):
        raise RuntimeError(
            f"syncbn: `act_param` must be finite (the negative slope of leaky_relu), got "
            f"{act_param}"
        )


_CODES = frozenset(ACTIVATIONS.values())


def fused_activation(module: nn.Module | None) -> tuple[int, float] | None:
    """``(code, param)`` of the activation ``module`` computes, if the kernels can fuse it: exactly
    ``nn.Identity`` (or ``None``), ``nn.ReLU``, ``nn.LeakyReLU``, ``nn.ReLU6``, ``nn.SiLU``,
    ``nn.Hardswish`` or ``nn.GELU(approximate="none")``; else ``None``.

    Exact types only: a subclass may override ``forward``. ``inplace`` makes no difference (the
    fused kernel writes a new output either way).
    """
    if module is None:
        return 0, 0.0
    kind = type(module)
    if kind is nn.LeakyReLU:
        return ACTIVATIONS["leaky_relu"], float(module.negative_slope)
    if kind is nn.GELU:
        return (ACTIVATIONS["gelu"], 0.0) if module.approximate == "none" else None
    code = _PLAIN_CODES.get(kind)
    return None if code is None else (code, 0.0)


_PLAIN_CODES: dict[type, int] = {
    nn.Identity: ACTIVATIONS["identity"],
    nn.ReLU: ACTIVATIONS["relu"],
    nn.ReLU6: ACTIVATIONS["relu6"],
    nn.SiLU: ACTIVATIONS["silu"],
    nn.Hardswish: ACTIVATIONS["hardswish"],
}
