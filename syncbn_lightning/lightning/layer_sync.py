"""The :class:`SyncBNLayerSync` plugin: Lightning's ``LayerSync`` interface over our converter."""

from __future__ import annotations

import os
from typing import Literal

import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch import nn
from typing_extensions import override

from ..distributed.groups import new_sync_group, resolve_group_size, validate_group_size
from ..nn.convert import revert_sync_batchnorm
from .ddp_setup import LayerSettings, convert_layers, keep_group_buffers

__all__ = ["SyncBNLayerSync"]


class SyncBNLayerSync(LayerSettings, LayerSync):
    """A Lightning ``LayerSync`` plugin that converts BatchNorm layers to :class:`SyncBatchNorm`.

    For users who prefer ``Trainer(strategy="ddp", plugins=[SyncBNLayerSync()])`` to the callback.
    Lightning applies it in ``strategy.setup`` (after ``configure_model`` and checkpoint restore,
    before DDP wraps the model) and reverts it when fit ends. It only converts; batch-size and
    drift monitoring, reconciliation and PreciseBN are :class:`SyncBNCallback`'s.

    Args:
        group_size: ``None`` (whole world), an int dividing the world size, or ``"node"`` (the
            processes of one machine: ``trainer.num_devices``, else ``$LOCAL_WORLD_SIZE``).
        momentum: if not None, replaces every layer's momentum. Default: None.
        eps: if not None, replaces every layer's eps. Default: None.
        impl: the layers' kernels (see :class:`SyncBNCallback`). Default: None.
        stats_mode: the layers' ``stats_mode`` (see :class:`SyncBNCallback`). Default: None.
        exchange: the layers' ``exchange`` (see :class:`SyncBNCallback`). Default: None.

    Note:
        With ``group_size`` smaller than the world the plugin switches DDP's per-forward buffer
        broadcast off, as the callback does, but does not reconcile the groups' running
        statistics: checkpoints hold global rank 0's group's statistics.

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[SyncBNLayerSync()])
    """

    def __init__(
        self,
        group_size: int | Literal["node"] | None = None,
        *,
        momentum: float | None = None,
        eps: float | None = None,
        impl: str | None = None,
        stats_mode: Literal["N", "default"] | None = None,
        exchange: Literal["auto", "gather", "reduce"] | None = None,
    ) -> None:
        validate_group_size(group_size, allow_auto=False)
        self._set_layer_settings(momentum, eps, impl, stats_mode, exchange)
        self.group_size = group_size

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        """Convert ``model``'s BatchNorm layers in place, in a Trainer or not, distributed or not
        (without torch.distributed the layers normalize their local batch, as BatchNorm)."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        trainer = getattr(model, "_trainer", None)  # set when Lightning's strategy applies it
        size = world
        if self.group_size is not None and world > 1:
            per_node = self._processes_per_node(trainer) if self.group_size == "node" else 0
            size = resolve_group_size(self.group_size, world, per_node)
        group = new_sync_group(size) if size < world else None
        convert_layers(model, group, self.sync_options)
        if size < world and trainer is not None:
            keep_group_buffers(trainer.strategy)
        return model

    @staticmethod
    def _processes_per_node(trainer: object | None) -> int:
        if trainer is not None:
            return int(trainer.num_devices)  # type: ignore[attr-defined]
        return _env_local_world_size()

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)


def _env_local_world_size() -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        raise ValueError(
            "SyncBNLayerSync(group_size='node') needs the number of processes per machine: "
            "apply it in a Lightning Trainer, launch with torchrun (which sets LOCAL_WORLD_SIZE) "
            "or set LOCAL_WORLD_SIZE; or give group_size as an int"
        )
    return int(value)
