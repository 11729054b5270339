"""Converting a model's BatchNorm layers to :class:`SyncBatchNorm` and back (layer 5)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _LazyNormBase

from .batchnorm import SyncBatchNorm, _validate_hyperparameters
from .function import check_stats_mode
from .impl import check_impl

__all__ = [
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
) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` with :class:`SyncBatchNorm`.

    ``BatchNorm1d/2d/3d``, their subclasses and ``torch.nn.SyncBatchNorm`` are converted; layers
    that already are :class:`SyncBatchNorm` are left alone (so the call is idempotent), and so is
    everything that is not a ``_BatchNorm``. Each new layer shares the original's Parameter and
    buffer *objects* (an optimizer built before or after the conversion holds the same tensors) and
    keeps its ``training`` flag, ``requires_grad``, hyper-parameters and state_dict keys.

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

    Returns:
        ``module`` with its BatchNorm children replaced in place, or the new layer if ``module``
        itself is a BatchNorm layer.

    Raises:
        ValueError: when a lazy BatchNorm has not been initialized yet (run one forward first),
            or ``momentum``/``eps``/``impl`` is out of range.
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
    converted = _convert_tree(module, settings)
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
    _validate_hyperparameters(
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
) -> list[SyncBatchNorm]:
    """Give every :class:`SyncBatchNorm` of ``module`` (converted or built as one) these settings,
    the converter's arguments of the same names (``stats_mode=None`` keeps each layer's own);
    returns the layers."""
    settings = _settings(process_group, momentum, eps, impl, force_sync)
    if stats_mode is not None:
        settings["stats_mode"] = check_stats_mode(stats_mode)
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


def _convert_tree(module: nn.Module, settings: dict[str, Any]) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        return _to_sync(module, settings)
    for name, child in module.named_children():
        converted = _convert_tree(child, settings)
        if converted is not child:
            module.add_module(name, converted)
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Undo :func:`convert_sync_batchnorm`: every :class:`SyncBatchNorm` becomes its original class.

    A layer made by the converter comes back as exactly the class it was (``BatchNorm2d`` as
    ``BatchNorm2d``, with its input-dim check; a subclass with its extra attributes), sharing the
    current Parameter and buffer objects and keeping ``training`` and the hyper-parameters as they
    are now. A :class:`SyncBatchNorm` constructed directly becomes :class:`BatchNormXd`.

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


def _to_sync(bn: _BatchNorm, settings: dict[str, Any]) -> SyncBatchNorm:
    if isinstance(bn, _LazyNormBase) and bn.has_uninitialized_params():
        raise ValueError(
            f"cannot convert the uninitialized lazy layer {bn!r}: run one forward pass first so "
            f"that num_features is known"
        )
    sync = SyncBatchNorm.__new__(SyncBatchNorm)
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
    cls, original = getattr(sync, _ORIGINAL, (BatchNormXd, None))
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
