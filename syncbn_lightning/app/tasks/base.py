"""What every task shares: the linearly scaled learning rate with warmup and cosine decay, and the
global batch size it scales by."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["ScaledLRModule", "global_batch_size"]


def global_batch_size(trainer: pl.Trainer, per_device: int) -> int:
    """Samples per optimizer step over all processes:
    ``per_device x world_size x accumulate_grad_batches``."""
    return per_device * trainer.world_size * trainer.accumulate_grad_batches


def _check_optim(optim: dict[str, Any]) -> dict[str, Any]:
    known = {"name", "base_lr", "base_batch_size", "weight_decay", "momentum", "warmup_steps"}
    unknown = set(optim) - known
    if unknown:
        raise ValueError(f"model.optim has unknown keys {sorted(unknown)}; known: {sorted(known)}")
    out = {
        "name": "adamw",
        "base_lr": 1e-3,
        "base_batch_size": 16,
        "weight_decay": 1e-4,
        "momentum": 0.9,
        "warmup_steps": 50,
        **optim,
    }
    if out["name"] not in ("adamw", "sgd"):
        raise ValueError(f"model.optim.name must be 'adamw' or 'sgd', got {out['name']!r}")
    if not out["base_lr"] > 0 or out["base_batch_size"] < 1 or out["warmup_steps"] < 0:
        raise ValueError(
            "model.optim needs base_lr > 0, base_batch_size >= 1 and warmup_steps >= 0, got "
            f"{out['base_lr']}, {out['base_batch_size']}, {out['warmup_steps']}"
        )
    return out


class ScaledLRModule(pl.LightningModule):
    """A LightningModule whose learning rate follows the linear scaling rule.

    ``lr = base_lr x global_batch / base_batch_size`` (Goyal et al.), where ``global_batch`` is
    measured from the Trainer at ``configure_optimizers`` (per-device batch of the datamodule x
    world size x gradient accumulation), so changing ``trainer.devices`` keeps the recipe right.
    The rate ramps linearly from 0 over ``warmup_steps`` optimizer steps, then follows a cosine to
    0 at the last step. BatchNorm weights and biases get no weight decay.
    """

    #: The metrics the task logs that a checkpoint may keep the best of (higher is better); the
    #: first is the default ``monitor``.
    SCORES: tuple[str, ...] = ()

    def __init__(self, optim: dict[str, Any] | None = None, monitor: str | None = None) -> None:
        super().__init__()
        self.optim = _check_optim(dict(optim or {}))
        #: The metric this run is judged by (checkpoints keep its best, sweeps maximize it).
        self.monitor = self._check_monitor(monitor)

    def _check_monitor(self, monitor: str | None) -> str | None:
        if monitor is None:
            return self.SCORES[0] if self.SCORES else None
        if monitor not in self.SCORES:
            raise ValueError(
                f"model.monitor={monitor!r}: {type(self).__name__} logs "
                f"{', '.join(self.SCORES) or 'no score'} (higher is better); use one of them"
            )
        return monitor

    def _per_device_batch(self) -> int:
        # The optimizer is configured before the train DataLoader exists: read the datamodule.
        size = getattr(getattr(self.trainer, "datamodule", None), "hparams", {}).get("batch_size")
        if not size:
            raise ValueError(
                f"{type(self).__name__} scales its learning rate by the global batch: fit it with "
                "a datamodule that has a `batch_size` hyper-parameter"
            )
        return int(size)

    def configure_optimizers(self) -> dict[str, Any]:
        o = self.optim
        batch = global_batch_size(self.trainer, self._per_device_batch())
        lr = o["base_lr"] * batch / o["base_batch_size"]
        decay, no_decay = [], []
        for module in self.modules():
            is_norm = isinstance(module, torch.nn.modules.batchnorm._NormBase)
            for p in module.parameters(recurse=False):
                (no_decay if is_norm or p.dim() == 1 else decay).append(p)
        groups = [
            {"params": decay, "weight_decay": o["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if o["name"] == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=lr, momentum=o["momentum"])
        else:
            opt = torch.optim.AdamW(groups, lr=lr)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = min(int(o["warmup_steps"]), total - 1)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = (step - warmup) / max(total - warmup, 1)
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
