"""Small Lightning models and helpers for the callback tests (importable by spawned ranks)."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from syncbn_lightning import SyncBatchNorm


def make_data(n: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images 3x8x8 with channel offsets (so BN statistics matter) and 4-class labels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g) * 2.0 + torch.tensor([1.0, -2.0, 0.5]).view(1, 3, 1, 1)
    y = torch.randint(0, 4, (n,), generator=g)
    return x, y


def make_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def single_process_reference(steps: int, per_rank: int, world: int) -> nn.Module:
    """Plain BN, one process, batch ``world * per_rank`` made of what the ranks saw at each step
    (``DistributedSampler(shuffle=False)``: rank r holds samples r, r + world, r + 2 world, ...)."""
    x, y = make_data()
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        idx = [(step * per_rank + j) * world + r for r in range(world) for j in range(per_rank)]
        opt.zero_grad()
        F.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
    return net


class BNNet(pl.LightningModule):
    """Conv/BN net on fixed synthetic data.

    Args:
        batch_size: per-rank batch, or a list giving each rank its own batch size.
        n: dataset size. lr: SGD learning rate.
        build_in_configure_model: create the network in ``configure_model`` instead of __init__.
    """

    def __init__(
        self,
        batch_size: int | list[int] = 2,
        n: int = 32,
        lr: float = 0.1,
        build_in_configure_model: bool = False,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.n = n
        self.lr = lr
        self.net: nn.Module | None = None if build_in_configure_model else make_net()

    def configure_model(self) -> None:
        if self.net is None:
            self.net = make_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)  # a metric of the module's own, for the bn/* row tests
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def _loader(self) -> DataLoader:
        data = TensorDataset(*make_data(self.n))
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        batch = self.batch_size[rank] if isinstance(self.batch_size, list) else self.batch_size
        sampler = DistributedSampler(data, world, rank, shuffle=False) if world > 1 else None
        return DataLoader(data, batch_size=batch, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()


class CompiledBNNet(BNNet):
    """BNNet whose network is ``torch.compile(..., fullgraph=True)``-d in ``configure_model``; the
    callback converts the BN layers inside the compiled wrapper before the first forward."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(build_in_configure_model=True, **kwargs)

    def configure_model(self) -> None:
        if self.net is None:
            self.net = torch.compile(make_net(), fullgraph=True)


class CheckpointedBNNet(BNNet):
    """BNNet whose forward runs its network under ``torch.utils.checkpoint`` (non-reentrant),
    as memory-bound detection models do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return checkpoint(self.net, x, use_reentrant=False)


class Probe(Callback):
    """Saves what each rank ends up with to ``<out>/rank<r>.pt`` when training ends."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.optimizer_param_ids: list[int] = []
        self.info: dict[str, Any] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.optimizer_param_ids = [
            id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]
        ]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        layers = [m for m in pl_module.modules() if isinstance(m, SyncBatchNorm)]
        self.info = {
            "state": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "sync_layers": len(layers),
            "group_sizes": [
                dist.get_world_size(m.process_group) if dist.is_initialized() else 1 for m in layers
            ],
            "momentum": [m.momentum for m in layers],
            "optimizer_holds_model_params": sorted(self.optimizer_param_ids)
            == sorted(id(p) for p in pl_module.parameters()),
            "ddp_forward_sync_buffers": getattr(
                trainer.strategy.model, "forward_sync_buffers", None
            ),
            "callback_metrics": {
                cb.__class__.__name__: dict(getattr(cb, "last_metrics", {}))
                for cb in trainer.callbacks
            },
            "trainer_callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        }

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.info["fit_end_bn_classes"] = [
            type(m).__name__ for m in pl_module.modules() if isinstance(m, _BatchNorm)
        ]
        torch.save(self.info, os.path.join(self.out, f"rank{trainer.global_rank}.pt"))


def load_ranks(out: str, world: int) -> list[dict[str, Any]]:
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """A one-process CPU Trainer without logger, checkpoints, progress bar or summary."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{**options, **kwargs})


def trainer(world: int, callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
    """A CPU ``ddp_spawn`` Trainer with our own DistributedSampler (no shuffling)."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": world,
        "strategy": "ddp_spawn",
        "max_steps": 4,
        "use_distributed_sampler": False,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


class NaNBatchNet(BNNet):
    """BNNet whose ``nan_batch``-th training batch holds a NaN on rank 1.

    Every rank runs the forward of that batch (so the SyncBN layers see non-finite group
    statistics) but returns a zero loss that does not depend on it (zero gradients for every
    parameter, so DDP's all-reduce still runs): the weights stay finite and only the BN guard is
    exercised. (Returning ``None`` to skip the step is refused by Lightning under DDP.)
    """

    def __init__(self, nan_batch: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nan_batch = nan_batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx != self.nan_batch:
            return super().training_step(batch, batch_idx)
        x, _ = batch
        if self.global_rank == 1:
            x = x.clone()
            x[0, 0, 0, 0] = float("nan")
        self(x)
        return sum(p.sum() for p in self.parameters()) * 0.0


STAT_KEYS = ("running_mean", "running_var")


def bn_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The running statistics of a state_dict."""
    return {k: v for k, v in state.items() if k.endswith(STAT_KEYS)}


def fit_ranks(
    tmp_path: Any, name: str, world: int, callbacks: list, model: BNNet | None = None, **kw: Any
) -> list[dict[str, Any]]:
    """Fit ``model`` on ``world`` ddp_spawn ranks (:func:`trainer` options ``kw``, plus
    ``ckpt_path``) and return what each rank's :class:`Probe` saved."""
    out = tmp_path / name
    out.mkdir()
    ckpt_path = kw.pop("ckpt_path", None)
    trainer(world, [*callbacks, Probe(str(out))], **kw).fit(model or BNNet(), ckpt_path=ckpt_path)
    return load_ranks(str(out), world)
