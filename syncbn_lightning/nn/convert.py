"""Converting a model's BatchNorm layers to synchronized ones and back.

The converter swaps classes without copying tensors: each new layer shares the original's
Parameter, buffer and child-module objects. Which class replaces which comes from the synchronized
classes themselves: each registers (:func:`register_sync_class`) the BatchNorm forwards it
reproduces and the plain class it reverts to when it was not made by the converter.
:class:`~syncbn_lightning.SyncBatchNorm` replaces torch's BatchNorm and SyncBatchNorm,
:class:`~syncbn_lightning.SyncBatchNormAct` timm's BatchNorm + activation classes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _LazyNormBase

from ..distributed.call_order.checks import layers_with_status
from ..distributed.call_order.watcher import stop_watchers
from ..distributed.groups import check_process_group, made_group_name
from ..functional.options import KEEP, SyncOptions
from .checks import FuseResidual, check_fuse_residual
from .layer_state import name_sync_layers

__all__ = [
    "CUSTOM_FORWARD",
    "KEEP",
    "BatchNormXd",
    "configure_sync_layers",
    "convert_sync_batchnorm",
    "convert_with",
    "name_sync_layers",
    "register_residual_hooks",
    "register_sync_class",
    "revert_sync_batchnorm",
    "sync_layers",
    "torch_forward",
]

# Attributes every _NormBase has and shares with its conversion (momentum and eps travel in the
# synchronized layer's options); everything else of the original module is kept for the revert.
_NORM_STATE = (
    "_parameters",
    "_buffers",
    "_non_persistent_buffers_set",
    "_modules",
    "training",
    "num_features",
    "affine",
    "track_running_stats",
)
_OPTIONS_STATE = ("momentum", "eps")
_ORIGINAL = "_syncbn_original"
#: What the converter does with a ``_BatchNorm`` subclass whose ``forward`` it cannot reproduce:
#: raise (the default), convert it anyway (its forward is plain batch norm, e.g. another
#: library's synchronized BatchNorm), or leave it as it is.
CUSTOM_FORWARD = ("error", "convert", "skip")


class BatchNormXd(_BatchNorm):
    """Plain BatchNorm for inputs of any rank ``(N, C, *)``.

    What :func:`revert_sync_batchnorm` turns a :class:`~syncbn_lightning.SyncBatchNorm` into when
    the layer was not made by :func:`convert_sync_batchnorm` (so its original class is unknown).
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


@dataclass(frozen=True)
class _SyncClass:
    sync: type[_BatchNorm]
    plain: type[_BatchNorm]
    replaces: Callable[[type], bool]


# Registered synchronized classes, the base class (SyncBatchNorm) first.
_SYNC_CLASSES: list[_SyncClass] = []
# fuse_residual's rewrite and its undoing, registered by .residual (which needs the classes
# registered here): "fuse" (model, classes to trace) and "unfuse" (model -> model).
_RESIDUAL_HOOKS: dict[str, Callable[..., Any]] = {
    "fuse": lambda module, classes: module,
    "unfuse": lambda module: module,
}


def register_residual_hooks(
    fuse: Callable[[nn.Module, tuple[type, ...]], Any], unfuse: Callable[[nn.Module], nn.Module]
) -> None:
    """What ``fuse_residual`` runs after the conversion (``fuse``, with the named classes to
    trace), and what :func:`revert_sync_batchnorm` runs first (``unfuse``, returning the model to
    revert)."""
    _RESIDUAL_HOOKS.update(fuse=fuse, unfuse=unfuse)


def register_sync_class(
    sync: type[_BatchNorm], *, plain: type[_BatchNorm], replaces: Callable[[type], bool]
) -> None:
    """Make the converter turn BatchNorm layers into ``sync``: those whose ``forward`` is defined
    by a class ``owner`` with ``replaces(owner)`` true; :func:`revert_sync_batchnorm` turns a
    ``sync`` layer it did not make into ``plain``. The first registered class is the base of all
    synchronized layers; later registrations take precedence."""
    _SYNC_CLASSES.append(_SyncClass(sync, plain, replaces))


def torch_forward(owner: type) -> bool:
    """Whether ``owner.forward`` is torch's BatchNorm forward (every ``BatchNorm*d``, lazy ones
    included) or torch's SyncBatchNorm forward."""
    return owner.forward in (_BatchNorm.forward, nn.SyncBatchNorm.forward)


def _sync_base() -> type[_BatchNorm]:
    if not _SYNC_CLASSES:
        raise RuntimeError("no synchronized BatchNorm class is registered: import syncbn_lightning")
    return _SYNC_CLASSES[0].sync


def sync_layers(module: nn.Module) -> list[Any]:
    """Every synchronized BatchNorm layer of ``module`` (``module`` itself included)."""
    base = _sync_base()
    return [m for m in module.modules() if isinstance(m, base)]


def convert_sync_batchnorm(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    *,
    momentum: float | None = KEEP,
    eps: float | None = None,
    impl: str | None = None,
    force_sync: bool = False,
    unbiased_running_var: bool = True,
    stats_mode: str = "N",
    exchange: str = "auto",
    custom_forward: str = "error",
    fuse_residual: FuseResidual = False,
) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` with :class:`SyncBatchNorm`.

    ``BatchNorm1d/2d/3d``, their subclasses that keep torch's ``forward`` and
    ``torch.nn.SyncBatchNorm`` are converted; timm's ``BatchNormAct2d`` and ``SyncBatchNormAct``
    (batch norm, then their ``drop`` and ``act`` modules) become :class:`SyncBatchNormAct`, which
    keeps both. Layers that already are :class:`SyncBatchNorm` are left alone (so the call is
    idempotent), and so is everything that is not a ``_BatchNorm``. Each new layer shares the
    original's Parameter, buffer and child-module *objects* (an optimizer built before or after
    the conversion holds the same tensors) and keeps its ``training`` flag, ``requires_grad``,
    hyper-parameters and state_dict keys.

    Args:
        module: the model, or a single BatchNorm layer.
        process_group: the sync group of every converted layer (``None``: the whole world).
        momentum: the converted layers' momentum (a float in [0, 1], or ``None`` for the
            cumulative average); by default (``KEEP``) each keeps its own.
        eps: the converted layers' epsilon; ``None`` keeps each layer's own.
        impl: the converted layers' kernels, see :class:`SyncBatchNorm` (``None``: the
            ``SYNCBN_IMPL`` environment variable at each call).
        force_sync: passed to every :class:`SyncBatchNorm`.
        unbiased_running_var: passed to every :class:`SyncBatchNorm`.
        stats_mode: passed to every :class:`SyncBatchNorm`: ``"N"`` (ranks weighed by their
            number of samples) or ``"default"`` (every non-empty rank weighs the same).
        exchange: passed to every :class:`SyncBatchNorm`: ``"gather"``, ``"reduce"`` (one
            all-reduce of O(C) values per layer, for large groups) or ``"auto"`` (reduce above 8
            ranks). Default: ``"auto"``.
        custom_forward: what to do with any other ``_BatchNorm`` subclass, one with a
            ``forward`` of its own that a SyncBatchNorm would not reproduce: ``"error"`` (raise,
            naming the layer and its class), ``"convert"`` (convert it anyway: its forward is
            plain batch norm, e.g. another library's synchronized BatchNorm) or ``"skip"`` (leave
            it unsynchronized). Default: ``"error"``.
        fuse_residual: also run the tail of residual blocks (BatchNorm → add → activation) as
            one fused call (:meth:`SyncBatchNorm.add_act`). ``True``: the blocks whose forward
            the library knows (torchvision's ``BasicBlock``/``Bottleneck``, timm's ResNet
            blocks); a list of block classes (or ``"package.module.Class"`` paths): those too,
            and every block of exactly these classes, traced with ``torch.fx``
            (``syncbn_lightning.nn.residual``; the rule in docs/library.md). A fused block
            keeps its class (as a subclass), hooks, state_dict keys and pickles; one that
            cannot be fused stays as it was, with a log line saying why. Default: ``False``.

    Returns:
        ``module`` with its BatchNorm children replaced in place, or the new layer if ``module``
        itself is a BatchNorm layer.

    Raises:
        ValueError: when a lazy BatchNorm has not been initialized yet (run one forward first),
            ``momentum``/``eps``/``impl``/``custom_forward`` is out of range, or (with
            ``custom_forward="error"``) a layer has a forward of its own.
        TypeError: when ``process_group`` is not a ProcessGroup or None, or an argument has the
            wrong type.

    Example:
        >>> import torch.nn as nn
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> net = convert_sync_batchnorm(net)
        >>> type(net[1]).__name__
        'SyncBatchNorm'
    """
    _require_module(module)
    options = SyncOptions(
        momentum=momentum,
        eps=KEEP if eps is None else eps,
        impl=impl,
        stats_mode=stats_mode,
        exchange=exchange,
        force_sync=force_sync,
        unbiased_running_var=unbiased_running_var,
    )
    classes = check_fuse_residual(fuse_residual)
    converted = convert_with(module, process_group, options, custom_forward)
    if classes is not None:
        _RESIDUAL_HOOKS["fuse"](converted, classes)
    return converted


def convert_with(
    module: nn.Module,
    process_group: dist.ProcessGroup | None,
    options: SyncOptions,
    custom_forward: str = "error",
) -> nn.Module:
    """:func:`convert_sync_batchnorm` with its settings as one (validated)
    :class:`~syncbn_lightning.functional.SyncOptions`: a converted layer gets ``options`` applied
    to its own momentum and eps (``KEEP`` keeps them)."""
    check_process_group(process_group)
    if custom_forward not in CUSTOM_FORWARD:
        raise ValueError(
            f"custom_forward must be one of {CUSTOM_FORWARD} (what to do with a BatchNorm "
            f"subclass that has its own forward), got {custom_forward!r}"
        )
    converted = _convert_tree(module, (process_group, options), custom_forward, "")
    name_sync_layers(converted)
    return converted


def configure_sync_layers(
    module: nn.Module, process_group: dist.ProcessGroup | None, options: SyncOptions
) -> list[Any]:
    """Give every synchronized layer of ``module`` (converted or built as one) ``process_group``
    and ``options`` (applied to its own: ``KEEP`` fields keep the layer's); returns the layers."""
    check_process_group(process_group)
    layers = sync_layers(module)
    for layer in layers:
        layer.sync_options = options.apply_to(layer.sync_options)
        layer.process_group = process_group
    return layers


def _require_module(module: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"module must be a torch.nn.Module (the model or one BatchNorm layer), got "
            f"{type(module).__name__}"
        )


def _convert_tree(
    module: nn.Module, settings: tuple[Any, SyncOptions], custom_forward: str, name: str
) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, _sync_base()):
        cls = _sync_class(type(module), custom_forward, name or type(module).__name__)
        return module if cls is None else _to_sync(module, settings, cls)
    for child_name, child in module.named_children():
        converted = _convert_tree(
            child, settings, custom_forward, f"{name}.{child_name}" if name else child_name
        )
        if converted is not child:
            module.add_module(child_name, converted)
    return module


def _sync_class(cls: type[_BatchNorm], custom_forward: str, name: str) -> type[_BatchNorm] | None:
    """The class a layer of class ``cls`` converts to (``None``: leave it), by whose ``forward``
    it runs: one a registered class reproduces, or its own (``custom_forward`` decides)."""
    owner = next(klass for klass in cls.__mro__ if "forward" in vars(klass))
    for entry in reversed(_SYNC_CLASSES):
        if entry.replaces(owner):
            return entry.sync
    if custom_forward == "convert":
        return _sync_base()
    if custom_forward == "skip":
        return None
    raise ValueError(
        f"cannot convert {name!r}: {cls.__module__}.{cls.__qualname__} is a BatchNorm with a "
        f"forward of its own ({owner.__qualname__}.forward), which SyncBatchNorm would replace "
        f"with plain batch norm. If that forward is plain batch normalization (e.g. another "
        f"library's synchronized BatchNorm), convert with convert_sync_batchnorm(model, "
        f"custom_forward='convert'); to leave such layers unsynchronized, custom_forward='skip' "
        f"(SyncBNCallback configures layers converted before it runs)."
    )


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Undo :func:`convert_sync_batchnorm`: every :class:`SyncBatchNorm` becomes its original class.

    Residual blocks fused by ``fuse_residual`` get their original classes back first. A layer
    made by the converter comes back as exactly the class it was (``BatchNorm2d`` as
    ``BatchNorm2d``, with its input-dim check; a subclass with its extra attributes), sharing the
    current Parameter and buffer objects and keeping ``training`` and the hyper-parameters as they
    are now. A :class:`SyncBatchNorm` constructed directly becomes :class:`BatchNormXd` (a
    :class:`SyncBatchNormAct`: :class:`BatchNormActXd`, with its ``act`` and ``drop``). The
    job's call-order watcher stops watching the groups of the reverted layers, except those another
    live layer that queues order flags still uses, and ends when it has none left (a later
    conversion starts it again).

    Args:
        module: the model, or a single layer.

    Returns:
        ``module`` with its SyncBatchNorm children replaced in place, or the reverted layer if
        ``module`` itself is a SyncBatchNorm.

    Example:
        >>> import torch.nn as nn
        >>> net = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(8)))
        >>> type(revert_sync_batchnorm(net)[0]).__name__
        'BatchNorm2d'
    """
    _require_module(module)
    leaving = {id(layer) for layer in sync_layers(module)}
    reverted = _revert_tree(_RESIDUAL_HOOKS["unfuse"](module))
    stop_watchers(keep=_groups_still_watched(leaving))
    return reverted


def _groups_still_watched(leaving: set[int]) -> set[str]:
    """The groups of the live layers that queue order flags, other than those with an id in
    ``leaving``: another model (an EMA, a compiled twin) may still train on them."""
    names = (
        made_group_name(layer.process_group)
        for layer in layers_with_status()
        if id(layer) not in leaving
    )
    return {name for name in names if name is not None}


def _revert_tree(module: nn.Module) -> nn.Module:
    if isinstance(module, _sync_base()):
        return _from_sync(module)
    for name, child in module.named_children():
        reverted = _revert_tree(child)
        if reverted is not child:
            module.add_module(name, reverted)
    return module


def _to_sync(
    bn: _BatchNorm, settings: tuple[Any, SyncOptions], cls: type[_BatchNorm]
) -> _BatchNorm:
    if isinstance(bn, _LazyNormBase) and bn.has_uninitialized_params():
        raise ValueError(
            f"cannot convert the uninitialized lazy layer {bn!r}: run one forward pass first so "
            f"that num_features is known"
        )
    process_group, options = settings
    sync = cls.__new__(cls)
    nn.Module.__init__(sync)
    # Share the very same Parameter and buffer objects (and their order, hence the state_dict).
    for attr in _NORM_STATE:
        object.__setattr__(sync, attr, _copy_container(getattr(bn, attr)))
    own = SyncOptions.of_layer(bn.momentum, bn.eps)
    object.__setattr__(sync, "sync_options", options.apply_to(own))
    sync.process_group = process_group
    if hasattr(bn, "qconfig"):
        sync.qconfig = bn.qconfig
    original = {k: v for k, v in vars(bn).items() if k not in _NORM_STATE + _OPTIONS_STATE}
    object.__setattr__(sync, _ORIGINAL, (type(bn), original))
    sync._match_torch_class()  # type: ignore[attr-defined]  # the tensors may be on a GPU
    return sync


def _from_sync(sync: _BatchNorm) -> nn.Module:
    plain = next(e.plain for e in reversed(_SYNC_CLASSES) if isinstance(sync, e.sync))
    cls, original = getattr(sync, _ORIGINAL, (plain, None))
    bn = cls.__new__(cls)
    if original is None:
        nn.Module.__init__(bn)
    else:
        bn.__dict__.update(original)
    for attr in _NORM_STATE + _OPTIONS_STATE:
        object.__setattr__(bn, attr, _copy_container(getattr(sync, attr)))
    if isinstance(bn, nn.SyncBatchNorm):
        bn.process_group = sync.process_group
    return bn


def _copy_container(value: Any) -> Any:
    """A new dict/set with the same entries (tensors shared), or the value itself for scalars."""
    return type(value)(value) if isinstance(value, (dict, set)) else value
