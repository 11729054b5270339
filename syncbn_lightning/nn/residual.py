"""Residual blocks whose tail (BatchNorm, the shortcut added, the activation) runs as one fused
synchronized layer call: :meth:`SyncBatchNorm.add_act <syncbn_lightning.SyncBatchNorm.add_act>`.

``convert_sync_batchnorm(model, fuse_residual=True)`` calls :func:`fuse_residual_blocks` after
converting the BatchNorm layers. It rewrites, by swapping the block's class for a subclass with
the fused forward (no module, parameter or buffer changes, so ``state_dict`` keys stay):

* torchvision's ``BasicBlock`` and ``Bottleneck`` (ResNet, ResNeXt, Wide ResNet);
* timm's ``BasicBlock`` and ``Bottleneck`` (``resnet*``, ``resnet*d`` and the rest of timm's
  ResNet family), when nothing sits between the last BatchNorm and the add (no
  squeeze-excitation ``se``, no ``drop_path``);
* any other module whose ``torch.fx`` trace ends in BatchNorm → add → activation
  (:mod:`.residual_fx`).

Blocks it cannot rewrite are left exactly as they were, with a DEBUG line of the
``syncbn_lightning`` logger naming the block and the reason. The fused forward computes the same
maths in the same order of synchronized calls on every rank (the shortcut's own BatchNorm, in a
``downsample``, runs before the block's last one, as it must feed it).
:func:`~syncbn_lightning.revert_sync_batchnorm` (or :func:`unfuse_residual_blocks`) restores the
original classes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..ops.activations import fused_activation
from .batchnorm import SyncBatchNorm
from .convert import register_residual_hooks
from .residual_fx import fuse_traced_blocks, unfuse_traced_blocks

__all__ = ["FUSED_FROM", "fuse_residual_blocks", "unfuse_residual_blocks"]

log = logging.getLogger("syncbn_lightning")

#: The attribute of a fused block's class naming the class it was made from.
FUSED_FROM = "_syncbn_fused_from"


@dataclass(frozen=True)
class _Block:
    """How one known block class ends: ``head(block, x)`` is everything before the last
    BatchNorm, which is ``block.<bn>``, followed by ``block.<act>``; ``refuse(block)`` says why a
    block cannot be fused (``None``: it can)."""

    head: Callable[[Any, torch.Tensor], torch.Tensor]
    bn: str
    act: str
    refuse: Callable[[Any], str | None] = lambda _block: None


def _torchvision_basic(b: Any, x: torch.Tensor) -> torch.Tensor:
    return b.conv2(b.relu(b.bn1(b.conv1(x))))


def _torchvision_bottleneck(b: Any, x: torch.Tensor) -> torch.Tensor:
    out = b.relu(b.bn1(b.conv1(x)))
    return b.conv3(b.relu(b.bn2(b.conv2(out))))


def _timm_basic(b: Any, x: torch.Tensor) -> torch.Tensor:
    return b.conv2(b.aa(b.act1(b.drop_block(b.bn1(b.conv1(x))))))


def _timm_bottleneck(b: Any, x: torch.Tensor) -> torch.Tensor:
    out = b.act1(b.bn1(b.conv1(x)))
    return b.conv3(b.aa(b.act2(b.drop_block(b.bn2(b.conv2(out))))))


def _timm_refuse(block: Any) -> str | None:
    if getattr(block, "se", None) is not None:
        return "a squeeze-excitation module (se) sits between its last BatchNorm and the add"
    if getattr(block, "drop_path", None) is not None:
        return "drop_path sits between its last BatchNorm and the add"
    return None


# Known block classes by (module, qualified name): the rule, and the classes seen.
_KNOWN: dict[tuple[str, str], _Block] = {
    ("torchvision.models.resnet", "BasicBlock"): _Block(_torchvision_basic, "bn2", "relu"),
    ("torchvision.models.resnet", "Bottleneck"): _Block(_torchvision_bottleneck, "bn3", "relu"),
    ("timm.models.resnet", "BasicBlock"): _Block(_timm_basic, "bn2", "act2", _timm_refuse),
    ("timm.models.resnet", "Bottleneck"): _Block(_timm_bottleneck, "bn3", "act3", _timm_refuse),
}
_FUSED_CLASSES: dict[type, type] = {}


def _rule_of(cls: type) -> _Block | None:
    return _KNOWN.get((cls.__module__, cls.__qualname__))


# The attribute of a fused block's class holding its _Block (looked up once, at class creation).
_RULE = "_syncbn_residual_rule"


def _fused_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The block's forward with its tail as one :meth:`SyncBatchNorm.add_act` call."""
    rule: _Block = getattr(type(self), _RULE)
    out = rule.head(self, x)
    shortcut = x if self.downsample is None else self.downsample(x)
    return getattr(self, rule.bn).add_act(out, shortcut, getattr(self, rule.act))


def _fused_class(cls: type) -> type:
    """The subclass of ``cls`` with the fused forward (one per class, made once)."""
    fused = _FUSED_CLASSES.get(cls)
    if fused is None:
        namespace = {
            "forward": _fused_forward,
            FUSED_FROM: cls,
            _RULE: _rule_of(cls),
            "__module__": cls.__module__,
        }
        fused = type(cls.__name__, (cls,), namespace)
        fused.__qualname__ = cls.__qualname__
        _FUSED_CLASSES[cls] = fused
    return fused


def _refusal(block: nn.Module, rule: _Block) -> str | None:
    """Why ``block`` (of a known class) cannot be fused, or ``None``."""
    bn = getattr(block, rule.bn, None)
    if not isinstance(bn, SyncBatchNorm):
        return f"its {rule.bn} is a {type(bn).__name__}, not a SyncBatchNorm (not converted)"
    if type(bn).add_act is not SyncBatchNorm.add_act or type(bn).forward is not (
        SyncBatchNorm.forward
    ):
        return f"its {rule.bn} ({type(bn).__name__}) has a forward of its own"
    act = getattr(block, rule.act, None)
    if not isinstance(act, nn.Module) or fused_activation(act) is None:
        return f"its activation {rule.act} ({type(act).__name__}) is not one the kernels fuse"
    return rule.refuse(block)


def fuse_residual_blocks(model: nn.Module) -> list[str]:
    """Rewrite every residual block of ``model`` whose tail is BatchNorm → add → activation to
    run it as one fused call (see the module docstring); returns the rewritten blocks' names.

    Run it after the BatchNorm layers are converted (the tail's layer must be a
    :class:`~syncbn_lightning.SyncBatchNorm`). Idempotent.
    """
    fused: list[str] = []
    refused: set[str] = set()  # known classes: fx would find the same
    for name, block in model.named_modules():
        cls = type(block)
        if hasattr(cls, FUSED_FROM):
            continue
        rule = _rule_of(cls)
        if rule is None:
            continue
        reason = _refusal(block, rule)
        if reason is not None:
            log.debug(
                "fuse_residual: left %s (%s) as it was: %s", name or "<model>", cls.__name__, reason
            )
            refused.add(name)
            continue
        block.__class__ = _fused_class(cls)
        fused.append(name)
    return fused + fuse_traced_blocks(model, skip=refused | set(fused))


def unfuse_residual_blocks(model: nn.Module) -> nn.Module:
    """Give every block :func:`fuse_residual_blocks` rewrote its original class back; returns
    ``model`` (or its replacement, when ``model`` itself was a traced block)."""
    for block in model.modules():
        original = getattr(type(block), FUSED_FROM, None)
        if original is not None:
            block.__class__ = original
    return unfuse_traced_blocks(model)


register_residual_hooks(fuse_residual_blocks, unfuse_residual_blocks)
