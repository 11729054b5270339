"""What the callback and the LayerSync plugin do to a model and its DDP strategy: convert and
configure the BatchNorm layers, keep DDP from broadcasting one group's running statistics."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .batchnorm import SyncBatchNorm
from .convert import KEEP, configure_sync_layers, convert_sync_batchnorm
from .validation import validate_hyperparameters

__all__ = ["convert_layers", "keep_group_buffers", "refuse_buffer_broadcast", "validate_overrides"]


def validate_overrides(momentum: Any, eps: Any) -> None:
    """Check ``momentum``/``eps`` overrides with the module's own validation (None = keep)."""
    validate_hyperparameters(1, 1e-5 if eps is None else eps, momentum, None)


def convert_layers(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    momentum: float | None,
    eps: float | None,
    impl: str | None,
    force_sync: bool = False,
    stats_mode: str | None = None,
    exchange: str | None = None,
) -> list[SyncBatchNorm]:
    """Convert ``model`` in place; every SyncBatchNorm, also one the model was built with, joins
    ``group`` with the overrides (``None`` keeps a layer's momentum/eps/stats_mode/exchange)."""
    convert_sync_batchnorm(model, process_group=group)
    return configure_sync_layers(
        model,
        group,
        momentum=KEEP if momentum is None else momentum,
        eps=eps,
        impl=impl,
        force_sync=force_sync,
        stats_mode=stats_mode,
        exchange=exchange,
    )


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
