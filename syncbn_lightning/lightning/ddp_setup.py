"""What the callback and the LayerSync plugin do to a model and its DDP strategy: convert and
configure the BatchNorm layers, keep DDP from broadcasting one group's running statistics."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..distributed.flight import recorder as flight
from ..distributed.groups import sync_world_group
from ..functional.options import SyncOptions
from ..nn.batchnorm import SyncBatchNorm
from ..nn.convert import configure_sync_layers, convert_with
from ..nn.residual import fuse_residual_blocks
from .arguments import overrides

__all__ = [
    "LayerSettings",
    "build_model_layers",
    "convert_layers",
    "keep_flight_records",
    "keep_group_buffers",
    "overrides",
    "refuse_buffer_broadcast",
    "refuse_other_layer_sync",
    "restore_flight_records",
    "require_ddp_strategy",
]


class LayerSettings:
    """What the callback and the plugin give every layer they convert: ``sync_options``, one
    validated :class:`SyncOptions` (see :func:`overrides`), and the arguments it came from as
    attributes (``None``: each layer keeps its own)."""

    sync_options: SyncOptions
    momentum: float | None
    eps: float | None
    impl: str | None
    stats_mode: str | None
    exchange: str | None

    def _set_layer_settings(
        self,
        momentum: float | None,
        eps: float | None,
        impl: str | None,
        stats_mode: str | None,
        exchange: str | None,
        options: SyncOptions | None = None,
    ) -> None:
        """Set :attr:`sync_options` (``options``, already validated from these arguments, or
        :func:`overrides` of them) and the arguments it came from."""
        if options is None:
            options = overrides(momentum, eps, impl, stats_mode, exchange)
        self.sync_options = options
        self.momentum, self.eps, self.impl = momentum, eps, self.sync_options.impl
        self.stats_mode, self.exchange = stats_mode, exchange


def convert_layers(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    options: SyncOptions,
    fuse_classes: tuple[type, ...] | None = None,
) -> list[SyncBatchNorm]:
    """Convert ``model`` in place; every SyncBatchNorm, also one the model was built with, joins
    ``group`` with ``options`` (see :func:`overrides`). With ``group=None`` in a distributed run,
    the world's SyncBN group (:func:`~syncbn_lightning.distributed.groups.sync_world_group`) is
    made here, where every rank converts, rather than in the first training step. Unless
    ``fuse_classes`` is ``None``, the residual blocks' tails are fused too: the known classes
    and ``fuse_classes`` (:func:`~syncbn_lightning.nn.residual.fuse_residual_blocks`)."""
    convert_with(model, group, options)
    if fuse_classes is not None:
        fuse_residual_blocks(model, fuse_classes)
    layers = configure_sync_layers(model, group, options)
    if group is None and layers and dist.is_available() and dist.is_initialized():
        sync_world_group()
    return layers


def refuse_buffer_broadcast(strategy: Any) -> None:
    """Raise if the user asked DDP to broadcast rank 0's buffers before every forward.

    With sync groups smaller than the world that broadcast would overwrite every other group's
    running statistics with group 0's. Lightning keeps the user's DDP arguments only in the
    strategy's ``_ddp_kwargs`` (no public accessor), so they are read there, and only read.
    """
    kwargs = getattr(strategy, "_ddp_kwargs", None) or {}
    for key in ("forward_sync_buffers", "broadcast_buffers"):
        if kwargs.get(key):
            raise ValueError(
                f"DDPStrategy({key}=True) broadcasts rank 0's BatchNorm running stats before "
                f"every forward, overwriting the other sync groups' statistics: drop {key} or "
                f"use SyncBNCallback(group_size=None) (one group for the whole world)"
            )


def keep_group_buffers(strategy: Any) -> None:
    """Stop DDP from broadcasting rank 0's buffers before every forward (see
    :func:`refuse_buffer_broadcast`); DDP still syncs buffers once at construction, when all
    ranks hold the same (initial or restored) values.

    Once the strategy has wrapped the model (the callback calls this from ``on_fit_start``), this
    sets the wrapper's public ``forward_sync_buffers`` attribute. Before that (the LayerSync
    plugin runs inside ``strategy.setup``, which offers no later hook) the only way is the
    argument the strategy will construct DDP with.
    """
    if not isinstance(strategy, DDPStrategy):
        return
    refuse_buffer_broadcast(strategy)
    if isinstance(strategy.model, DistributedDataParallel):
        strategy.model.forward_sync_buffers = False
        return
    kwargs = strategy._ddp_kwargs
    kwargs.pop("broadcast_buffers", None)
    kwargs["forward_sync_buffers"] = False


def refuse_other_layer_sync(trainer: Any, owner: str, rival: type | None = None) -> None:
    """Raise if the Trainer also converts BatchNorm layers: with ``sync_batchnorm=True``, or (for
    the callback, ``owner``) with our LayerSync plugin, ``rival``."""
    layer_sync = getattr(trainer.strategy, "_layer_sync", None)
    if isinstance(layer_sync, TorchSyncBatchNorm):
        raise ValueError(
            f"{owner} cannot be combined with Trainer(sync_batchnorm=True): that converts the "
            f"model to torch.nn.SyncBatchNorm again (which refuses CPU tensors). Remove "
            f"sync_batchnorm=True; {owner} already synchronizes BatchNorm"
        )
    if rival is not None and isinstance(layer_sync, rival):
        raise ValueError(
            "SyncBNCallback and the SyncBNLayerSync plugin both convert BatchNorm layers: use one "
            "of them (pass group_size/momentum/eps to the one you keep)"
        )


def keep_flight_records(
    trainer: pl.Trainer, folder: str | os.PathLike[str] | None
) -> tuple[str | None] | None:
    """Keep this job's SyncBN flight records in files: in ``folder``, else where a folder is set
    already (``SYNCBN_FLIGHT_DIR``, ``set_flight_dir``), else in ``.syncbn`` of the trainer's
    log folder (read on every rank: ``trainer.log_dir`` broadcasts rank 0's).

    Returns ``(previous,)``, the process's folder before (``None``: none), when it set one, for
    :func:`restore_flight_records` at the end of the fit; ``None`` when it left it alone."""
    if folder is None and flight.flight_dir() is not None:
        return None
    if folder is None:
        base = trainer.log_dir or trainer.default_root_dir
        folder = os.path.join(base, ".syncbn")
    return (flight.set_flight_dir(folder),)


def restore_flight_records(kept: tuple[str | None] | None) -> None:
    """Undo :func:`keep_flight_records` (``kept``: what it returned): later jobs of the process
    keep their records where they did before this fit, not in its trainer's folder."""
    if kept is not None:
        flight.set_flight_dir(kept[0])


def require_ddp_strategy(strategy: Any) -> None:
    """Raise unless ``strategy`` is one of Lightning's DDP strategies (the callback's and the
    plugin's conversion needs whole, unsharded parameters)."""
    if not isinstance(strategy, DDPStrategy):
        raise ValueError(
            f"SyncBNCallback supports the DDP strategies (strategy='ddp', 'ddp_spawn', "
            f"'ddp_fork'), got {type(strategy).__name__}: sharded strategies "
            f"(FSDP, DeepSpeed) keep parameters sharded and are not supported"
        )


def build_model_layers(pl_module: pl.LightningModule) -> None:
    """Run the module's ``configure_model`` when it has one (as Lightning's WeightAveraging
    does): layers built there exist only then, and must exist to be converted."""
    if is_overridden("configure_model", pl_module):
        pl_module.configure_model()
