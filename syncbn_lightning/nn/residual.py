"""Residual blocks whose tail (BatchNorm, the shortcut added, the activation) runs as one fused
synchronized layer call: :meth:`SyncBatchNorm.add_act <syncbn_lightning.SyncBatchNorm.add_act>`.

``convert_sync_batchnorm(model, fuse_residual=...)`` calls :func:`fuse_residual_blocks` after
converting the BatchNorm layers. A fused block keeps its object, modules, parameters, buffers,
hooks and ``state_dict`` keys; only its class becomes a subclass of its own class (``isinstance``
holds) with the fused forward:

* ``fuse_residual=True``: the blocks whose forward this module knows, by hand-written rules:
  torchvision's ``BasicBlock`` and ``Bottleneck`` (ResNet, ResNeXt, Wide ResNet) and timm's
  ``BasicBlock`` and ``Bottleneck`` (``resnet*``, ``resnet*d``, ...) when nothing sits between
  the last BatchNorm and the add (no squeeze-excitation ``se``, no ``drop_path``; checked at every
  call, so setting one later takes the class's own forward).
* ``fuse_residual=[MyBlock, "pkg.mod.Other"]``: those too, and every block of exactly the named
  classes, rewritten through ``torch.fx`` (:mod:`.residual_fx`, which says what a trace can and
  cannot guarantee: the reason a class must be named).

A fused call is taken only where it is the same call as the block's own forward. Every call of a
fused block first checks (a few dict and type checks, no loop over the block's modules) that its
tail BatchNorm is still a plain :class:`~syncbn_lightning.SyncBatchNorm` (not replaced later by
``nn.Identity``, a wrapper or a subclass with a forward of its own), its activation one the
kernels fuse, neither has hooks (forward, forward-pre or backward hooks: pruning masks, feature
extraction, Lightning's ModelSummary), and no global module hooks are set
(:func:`~torch.nn.modules.module.register_module_forward_hook` and the like). Otherwise the
call runs the class's own forward, which calls each module through ``__call__``, so every hook
runs where it would. Parametrizations keep the fused path: the layer reads its weight and bias
through them.

A block that cannot be fused is left exactly as it was, with a log line of the
``syncbn_lightning`` logger naming it and the reason (DEBUG for the known classes, WARNING for a
named class; one WARNING per class for a named class whose forward changes or reads grad mode
or autocast, which fx would drop). The fused forward computes what the unfused one computes,
with the synchronized calls in the same order on every rank (the shortcut's own BatchNorm, in a
``downsample``, runs before the block's last one, as it must feed it). Pickles,
``torch.save``/``torch.load`` and ``copy.deepcopy`` of a fused block record its own class and
fuse it again when loaded.
:func:`~syncbn_lightning.revert_sync_batchnorm` (or :func:`unfuse_residual_blocks`) restores the
original classes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..ops.activations import fused_activation
from .batchnorm import SyncBatchNorm
from .convert import register_residual_hooks
from .residual_fx import (
    Refusal,
    TracedForward,
    fused_tail,
    global_hooks_set,
    plain_batchnorm,
    tail_intact,
    trace_block,
)

__all__ = ["FUSED_FROM", "fuse_residual_blocks", "unfuse_residual_blocks"]

log = logging.getLogger("syncbn_lightning")

#: The attribute of a fused block's class naming the class it was made from.
FUSED_FROM = "_syncbn_fused_from"
# The attributes of a fused block's class: its rule (known classes) or its traced forward.
_RULE = "_syncbn_residual_rule"
_TRACED = "_syncbn_traced_forward"


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


# Known block classes by (module, qualified name).
_KNOWN: dict[tuple[str, str], _Block] = {
    ("torchvision.models.resnet", "BasicBlock"): _Block(_torchvision_basic, "bn2", "relu"),
    ("torchvision.models.resnet", "Bottleneck"): _Block(_torchvision_bottleneck, "bn3", "relu"),
    ("timm.models.resnet", "BasicBlock"): _Block(_timm_basic, "bn2", "act2", _timm_refuse),
    ("timm.models.resnet", "Bottleneck"): _Block(_timm_bottleneck, "bn3", "act3", _timm_refuse),
}
# Fused classes made so far: (original class, None) for a rule, (original, sources) if traced.
_FUSED_CLASSES: dict[tuple[type, Any], type] = {}
_PENDING_CLASSES: dict[type, type] = {}


def _rule_of(cls: type) -> _Block | None:
    return _KNOWN.get((cls.__module__, cls.__qualname__))


def _rule_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """A known block's forward with its tail as one :func:`fused_tail` call (``out +=
    shortcut`` in the original, hence ``inplace``), when that is the same call
    (:func:`tail_intact`, no global module hooks, nothing the rule refuses); else the class's
    own forward."""
    cls = type(self)
    rule: _Block = getattr(cls, _RULE)
    children = self._modules  # Module.__getattr__ costs ~0.7 us per name: the dict directly
    bn, act = children.get(rule.bn), children.get(rule.act)
    if global_hooks_set() or not tail_intact(bn, act) or rule.refuse(self) is not None:
        return getattr(cls, FUSED_FROM).forward(self, x)  # e.g. hooks, drop_path set later
    out = rule.head(self, x)
    shortcut = x if self.downsample is None else self.downsample(x)
    return fused_tail(bn, out, shortcut, act, True)


def _traced_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A named block's forward: the traced, rewritten one for calls with the one input it was
    traced for (in the block's current mode) while its fused tails are intact
    (:meth:`TracedForward.intact`, no global module hooks), the class's own for any other
    call."""
    cls = type(self)
    if len(args) == 1 and not kwargs and not global_hooks_set():
        traced: TracedForward = getattr(cls, _TRACED)
        if traced.intact(self):
            return traced.modes[self.training](self, args[0])
    return getattr(cls, FUSED_FROM).forward(self, *args, **kwargs)


def _reduce_fused(self: Any, protocol: int) -> tuple[Any, ...]:
    """Pickle (and deep-copy) a fused block as its original class, fused again when loaded:
    the fused class itself is made at run time and cannot be found by name."""
    return (_restore_fused, (getattr(type(self), FUSED_FROM),), self.__getstate__())


def _restore_fused(original: type) -> Any:
    """An empty block of a placeholder subclass of ``original`` whose ``__setstate__`` (called
    next by pickle and deepcopy) restores the state, then fuses the block again."""
    pending = _PENDING_CLASSES.get(original)
    if pending is None:
        namespace = {"__setstate__": _finish_restore, "__module__": __name__}
        pending = type(original.__name__, (original,), namespace)
        _PENDING_CLASSES[original] = pending
    return object.__new__(pending)


def _finish_restore(self: Any, state: Any) -> None:
    original = type(self).__bases__[0]
    self.__class__ = original
    self.__setstate__(state)
    refusal = _fuse_one(self, _rule_of(original) is None)
    if refusal is not None:
        log.warning(
            "fuse_residual: a loaded %s block runs unfused: %s",
            original.__qualname__,
            refusal.reason,
        )


def _fused_class(cls: type, traced: TracedForward | None) -> type:
    """The subclass of ``cls`` with the fused forward (one per class and traced source)."""
    key = (cls, None if traced is None else traced.sources)
    fused = _FUSED_CLASSES.get(key)
    if fused is None:
        namespace: dict[str, Any] = {
            FUSED_FROM: cls,
            "__reduce_ex__": _reduce_fused,
            "__module__": cls.__module__,
        }
        if traced is None:
            namespace.update(forward=_rule_forward, **{_RULE: _rule_of(cls)})
        else:
            namespace.update(forward=_traced_forward, **{_TRACED: traced})
        fused = type(cls.__name__, (cls,), namespace)
        fused.__qualname__ = cls.__qualname__
        _FUSED_CLASSES[key] = fused
    return fused


def _refusal(block: nn.Module, rule: _Block) -> str | None:
    """Why ``block`` (of a known class) cannot be fused, or ``None``."""
    bn = getattr(block, rule.bn, None)
    if not isinstance(bn, SyncBatchNorm):
        return f"its {rule.bn} is a {type(bn).__name__}, not a SyncBatchNorm (not converted)"
    if not plain_batchnorm(bn):
        return f"its {rule.bn} ({type(bn).__name__}) has a forward of its own"
    act = getattr(block, rule.act, None)
    if not isinstance(act, nn.Module) or fused_activation(act) is None:
        return f"its activation {rule.act} ({type(act).__name__}) is not one the kernels fuse"
    return rule.refuse(block)


def _fuse_one(block: nn.Module, traced: bool) -> Refusal | None:
    """Fuse ``block`` (of a known class, or ``traced`` through fx); returns why not, or
    ``None`` when it was fused."""
    cls = type(block)
    if not traced:
        rule = _rule_of(cls)
        assert rule is not None, cls
        reason = _refusal(block, rule)
        if reason is not None:
            return Refusal(reason)
        block.__class__ = _fused_class(cls, None)
        return None
    if not any(isinstance(child, SyncBatchNorm) for child in block.children()):
        return Refusal("it has no SyncBatchNorm child (not converted)")
    result = trace_block(block)
    if isinstance(result, Refusal):
        return result
    block.__class__ = _fused_class(cls, result)
    return None


def fuse_residual_blocks(model: nn.Module, classes: Sequence[type] = ()) -> list[str]:
    """Fuse the tail (BatchNorm → add → activation) of every residual block of ``model`` that
    is of a known class, or of exactly one of ``classes`` (traced through ``torch.fx``); see the
    module docstring. Returns the fused blocks' names (``""`` for ``model`` itself).

    Run it after the BatchNorm layers are converted (the tail's layer must be a
    :class:`~syncbn_lightning.SyncBatchNorm`). Idempotent.
    """
    named = set(classes)
    fused: list[str] = []
    seen: set[type] = set()
    # Named classes refused for their code (Refusal.whole_class): one line each, after the loop;
    # blocks of such a class fused before the refusal (traced one by one) go back too.
    refused: dict[type, tuple[str, list[str]]] = {}
    fused_here: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, block in list(model.named_modules()):
        cls = type(block)
        if hasattr(cls, FUSED_FROM):
            continue
        known = _rule_of(cls) is not None
        if not known and cls not in named:
            continue
        seen.add(cls)
        where = name or "<model>"
        if cls in refused:
            refused[cls][1].append(where)
            continue
        refusal = _fuse_one(block, traced=not known)
        if refusal is None:
            fused.append(name)
            fused_here.setdefault(cls, []).append((name, block))
        elif refusal.whole_class:
            earlier = fused_here.pop(cls, [])
            for earlier_name, earlier_block in earlier:
                earlier_block.__class__ = cls
                fused.remove(earlier_name)
            refused[cls] = (refusal.reason, [n or "<model>" for n, _ in earlier] + [where])
        else:
            level = logging.DEBUG if known else logging.WARNING
            reason = refusal.reason
            log.log(level, "fuse_residual: left %s (%s) as it was: %s", where, cls.__name__, reason)
    for cls, (reason, names) in refused.items():
        where = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        log.warning(
            "fuse_residual: left every %s block as it was (%s): %s", cls.__name__, where, reason
        )
    present = seen | {getattr(type(m), FUSED_FROM, None) for m in model.modules()}
    for cls in sorted(named - present, key=lambda c: c.__qualname__):
        log.warning(
            "fuse_residual: the model has no module of class %s.%s (named in fuse_residual)",
            cls.__module__,
            cls.__qualname__,
        )
    return fused


def unfuse_residual_blocks(model: nn.Module) -> nn.Module:
    """Give every block :func:`fuse_residual_blocks` fused its original class back; returns
    ``model``."""
    for block in model.modules():
        original = getattr(type(block), FUSED_FROM, None)
        if original is not None:
            block.__class__ = original
    return model


register_residual_hooks(fuse_residual_blocks, unfuse_residual_blocks)
