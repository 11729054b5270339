"""What the callback reads from the Trainer's training data: the per-device batch size (for
``group_size="auto"``) and how to run the model on one batch (for PreciseBN)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

__all__ = ["default_precise_forward", "loader_batch_size"]


def default_precise_forward(module: pl.LightningModule, batch: Any) -> Any:
    """``module(x)`` with ``x = batch[0]`` for tuple/list batches, else the batch itself."""
    if isinstance(batch, (tuple, list)):
        return module(batch[0])
    if isinstance(batch, torch.Tensor):
        return module(batch)
    raise TypeError(
        f"PreciseBN cannot guess how to run the model on a {type(batch).__name__} batch: pass "
        f"SyncBNCallback(precise_bn_forward=fn) with fn(module, batch) running the forward"
    )


def loader_batch_size(loader: Any) -> int | None:
    """Samples per batch of a DataLoader (or of the smallest of a collection of them)."""
    if isinstance(loader, DataLoader):
        size = loader.batch_size
        if size is None:
            size = getattr(loader.batch_sampler, "batch_size", None)
        return size if isinstance(size, int) else None
    if isinstance(loader, dict):
        loader = list(loader.values())
    if isinstance(loader, (list, tuple)) and loader:
        sizes = [loader_batch_size(item) for item in loader]
        return None if None in sizes else min(s for s in sizes if s is not None)
    return None
