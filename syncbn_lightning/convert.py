"""Converting a model's BatchNorm layers to :class:`SyncBatchNorm` and back (layer 5)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _LazyNormBase

from .batchnorm import SyncBatchNorm
from .batchnorm_act import BatchNormActXd, SyncBatchNormAct
from .exchange import check_exchange
from .function import check_stats_mode
from .impl import check_impl
from .validation import validate_hyperparameters

__all__ = [
    "CUSTOM_FORWARD",
    "KEEP",
    "convert_sync_batchnorm",
    "configure_sync_layers",
    "revert_sync_batchnorm",
    "name_sync_layers",
    "BatchNormXd",
]

# Attributes every _NormBase has; everything else of the original module is kept for the revert.
_NORM_STATE = (
    "_parameters",
    "_buffers",
    "_non_persistent_buffers_set",
    "_modules",
    "training",
    "num_features",
    "eps",
    "momentum",
    "affine",
    "track_running_stats",
)
_ORIGINAL = "_syncbn_original"
#: What the converter does with a ``_BatchNorm`` subclass whose ``forward`` it cannot reproduce:
#: raise (the default), convert it anyway (its forward is plain batch norm, e.g. another
#: library's synchronized BatchNorm), or leave it as it is.
CUSTOM_FORWARD = ("error", "convert", "skip")
# The forwards a SyncBatchNorm reproduces: torch's BatchNorm (every BatchNorm*d, lazy ones
# included) and torch's SyncBatchNorm.
_PLAIN_FORWARDS = (_BatchNorm.forward, nn.SyncBatchNorm.forward)
# timm's BatchNorm + drop + activation classes (module, name): SyncBatchNormAct reproduces them.
_TIMM_NORM_ACT = {
    ("timm.layers.norm_act", "BatchNormAct2d"),
    ("timm.layers.norm_act", "SyncBatchNormAct"),
}


class _Keep:
    """The default of the converter's ``momentum``: each layer keeps its own (``None`` is a
    momentum: the cumulative average)."""

    def __repr__(self) -> str:
        return "KEEP"


#: ``convert_sync_batchnorm(..., momentum=KEEP)`` (the default): every layer keeps its momentum.
KEEP: Any = _Keep()


class BatchNormXd(_BatchNorm):
    """Plain BatchNorm for inputs of any rank ``(N, C, *)``.

    What :func:`revert_sync_batchnorm` turns a :class:`SyncBatchNorm` into when the layer was not
    made by :func:`convert_sync_batchnorm` (so its original class is unknown).
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


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
    settings = _settings(process_group, momentum, eps, impl, force_sync)
    settings["unbiased_running_var"] = bool(unbiased_running_var)
    settings["stats_mode"] = check_stats_mode(stats_mode)
    settings["exchange"] = check_exchange(exchange)
    if custom_forward not in CUSTOM_FORWARD:
        raise ValueError(
            f"custom_forward must be one of {CUSTOM_FORWARD} (what to do with a BatchNorm "
            f"subclass that has its own forward), got {custom_forward!r}"
        )
    converted = _convert_tree(module, settings, custom_forward, "")
    name_sync_layers(converted)
    return converted


def _settings(
    process_group: dist.ProcessGroup | None,
    momentum: Any,
    eps: Any,
    impl: Any,
    force_sync: bool,
) -> dict[str, Any]:
    """The attributes a converted layer gets, checked (momentum/eps left out when kept)."""
    validate_hyperparameters(
        1, 1e-5 if eps is None else eps, None if momentum is KEEP else momentum, process_group
    )
    settings: dict[str, Any] = {
        "process_group": process_group,
        "force_sync": bool(force_sync),
        "impl": check_impl(impl),
    }
    if momentum is not KEEP:
        settings["momentum"] = None if momentum is None else float(momentum)
    if eps is not None:
        settings["eps"] = float(eps)
    return settings


def configure_sync_layers(
    module: nn.Module,
    process_group: dist.ProcessGroup | None,
    *,
    momentum: Any = KEEP,
    eps: float | None = None,
    impl: str | None = None,
    force_sync: bool = False,
    stats_mode: str | None = None,
    exchange: str | None = None,
) -> list[SyncBatchNorm]:
    """Give every :class:`SyncBatchNorm` of ``module`` (converted or built as one) these settings,
    the converter's arguments of the same names (``stats_mode=None``, ``exchange=None`` keep each
    layer's own); returns the layers."""
    settings = _settings(process_group, momentum, eps, impl, force_sync)
    if stats_mode is not None:
        settings["stats_mode"] = check_stats_mode(stats_mode)
    if exchange is not None:
        settings["exchange"] = check_exchange(exchange)
    layers = [m for m in module.modules() if isinstance(m, SyncBatchNorm)]
    for layer in layers:
        for name, value in settings.items():
            setattr(layer, name, value)
    return layers


def _require_module(module: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"module must be a torch.nn.Module (the model or one BatchNorm layer), got "
            f"{type(module).__name__}"
        )


def name_sync_layers(module: nn.Module) -> None:
    """Give every :class:`SyncBatchNorm` in ``module`` its qualified name (``sync_name``).

    The name fixes the layer's call-order tag (the same on every rank of the same model) and
    names it in call-order errors. :func:`convert_sync_batchnorm` calls this; call it yourself
    for a model whose SyncBatchNorm layers you built directly.
    """
    for name, child in module.named_modules():
        if isinstance(child, SyncBatchNorm):
            child.set_sync_name(name or type(module).__name__)


def _convert_tree(
    module: nn.Module, settings: dict[str, Any], custom_forward: str, name: str
) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        cls = _sync_class(type(module), custom_forward, name or type(module).__name__)
        return module if cls is None else _to_sync(module, settings, cls)
    for child_name, child in module.named_children():
        converted = _convert_tree(
            child, settings, custom_forward, f"{name}.{child_name}" if name else child_name
        )
        if converted is not child:
            module.add_module(child_name, converted)
    return module


def _sync_class(
    cls: type[_BatchNorm], custom_forward: str, name: str
) -> type[SyncBatchNorm] | None:
    """The class a layer of class ``cls`` converts to (``None``: leave it), by whose ``forward``
    it runs: torch's (SyncBatchNorm), timm's BatchNorm + drop + act (SyncBatchNormAct), or its
    own (``custom_forward`` decides)."""
    owner = next(klass for klass in cls.__mro__ if "forward" in vars(klass))
    if owner.forward in _PLAIN_FORWARDS:
        return SyncBatchNorm
    if owner is BatchNormActXd or (owner.__module__, owner.__name__) in _TIMM_NORM_ACT:
        return SyncBatchNormAct
    if custom_forward == "convert":
        return SyncBatchNorm
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

    A layer made by the converter comes back as exactly the class it was (``BatchNorm2d`` as
    ``BatchNorm2d``, with its input-dim check; a subclass with its extra attributes), sharing the
    current Parameter and buffer objects and keeping ``training`` and the hyper-parameters as they
    are now. A :class:`SyncBatchNorm` constructed directly becomes :class:`BatchNormXd` (a
    :class:`SyncBatchNormAct`: :class:`BatchNormActXd`, with its ``act`` and ``drop``).

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
    if isinstance(module, SyncBatchNorm):
        return _from_sync(module)
    for name, child in module.named_children():
        reverted = revert_sync_batchnorm(child)
        if reverted is not child:
            module.add_module(name, reverted)
    return module


def _to_sync(bn: _BatchNorm, settings: dict[str, Any], cls: type[SyncBatchNorm]) -> SyncBatchNorm:
    if isinstance(bn, _LazyNormBase) and bn.has_uninitialized_params():
        raise ValueError(
            f"cannot convert the uninitialized lazy layer {bn!r}: run one forward pass first so "
            f"that num_features is known"
        )
    sync = cls.__new__(cls)
    nn.Module.__init__(sync)
    # Share the very same Parameter and buffer objects (and their order, hence the state_dict).
    for attr in _NORM_STATE:
        object.__setattr__(sync, attr, _copy_container(getattr(bn, attr)))
    for name, value in settings.items():
        setattr(sync, name, value)
    if hasattr(bn, "qconfig"):
        sync.qconfig = bn.qconfig
    original = {k: v for k, v in vars(bn).items() if k not in _NORM_STATE}
    object.__setattr__(sync, _ORIGINAL, (type(bn), original))
    sync._match_torch_class()  # the shared tensors may already be on a GPU
    return sync


def _from_sync(sync: SyncBatchNorm) -> nn.Module:
    plain = BatchNormActXd if isinstance(sync, SyncBatchNormAct) else BatchNormXd
    cls, original = getattr(sync, _ORIGINAL, (plain, None))
    bn = cls.__new__(cls)
    if original is None:
        nn.Module.__init__(bn)
    else:
        bn.__dict__.update(original)
    for attr in _NORM_STATE:
        object.__setattr__(bn, attr, _copy_container(getattr(sync, attr)))
    if isinstance(bn, nn.SyncBatchNorm):
        bn.process_group = sync.process_group
    return bn


def _copy_container(value: Any) -> Any:
    """A new dict/set with the same entries (tensors shared), or the value itself for scalars."""
    return type(value)(value) if isinstance(value, (dict, set)) else value
