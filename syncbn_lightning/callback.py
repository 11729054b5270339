"""Lightning integration (layer 6): :class:`SyncBNCallback` and the :class:`SyncBNLayerSync` plugin.

This is the only module of the package that imports Lightning.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from .batchnorm import BatchRecord, SyncBatchNorm, _validate_hyperparameters
from .convert import convert_sync_batchnorm, revert_sync_batchnorm
from .function import check_call_order
from .groups import new_sync_group
from .metrics import (
    average_running_stats,
    ema_drift,
    gather_rows,
    rank_divergence,
    running_stat_layers,
    summarize,
    train_test_gap,
)
from .precise_bn import update_bn_stats

__all__ = ["SyncBNCallback", "SyncBNLayerSync", "resolve_group_size"]

GroupSize = int | Literal["node", "auto"] | None
_GROUP_SIZE_HELP = (
    "None (the whole world), an int that divides the world size, 'node' (the processes of one "
    "machine) or 'auto' (the smallest group reaching target_norm_batch samples)"
)
_NONFINITE_ACTIONS = ("warn", "raise", "ignore")
_PRECISE_AT = ("fit_end", "validation")
_SINGLE_PROCESS = ("leave", "monitor")


def resolve_group_size(
    group_size: GroupSize,
    world_size: int,
    processes_per_node: int,
    per_rank_batch: int | None = None,
    target_norm_batch: int = 32,
) -> int:
    """The number of ranks per sync group that ``group_size`` means in this run.

    Args:
        group_size: ``None`` -> ``world_size``; an int -> itself (must divide ``world_size``);
            ``"node"`` -> ``processes_per_node``; ``"auto"`` -> the smallest divisor ``d`` of
            ``world_size`` with ``d * per_rank_batch >= target_norm_batch``, or ``world_size``
            when no divisor reaches it.
        world_size: number of processes.
        processes_per_node: processes on one machine (Lightning: ``trainer.num_devices``).
        per_rank_batch: samples per BN forward on one rank; required for ``"auto"``.
        target_norm_batch: the normalization batch ``"auto"`` aims for.

    Raises:
        ValueError: when the size does not divide ``world_size`` or ``"auto"`` lacks the batch.
    """
    if group_size is None:
        return world_size
    if group_size == "node":
        size = processes_per_node
    elif group_size == "auto":
        if per_rank_batch is None or per_rank_batch < 1:
            raise ValueError(
                "group_size='auto' needs the per-device batch size, but the train DataLoader does "
                "not expose one (batch_size=None with a custom batch_sampler?): pass an explicit "
                "SyncBNCallback(group_size=...)"
            )
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        return next((d for d in divisors if d * per_rank_batch >= target_norm_batch), world_size)
    else:
        size = group_size
    if size < 1 or world_size % size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"group_size={group_size!r} means {size} ranks per sync group, which does not divide "
            f"the world size {world_size} (num_nodes x devices): use one of {divisors}, None, "
            f"'node' or 'auto'"
        )
    return size


def _validate_group_size(group_size: Any, allow_auto: bool = True) -> None:
    allowed = ("node", "auto") if allow_auto else ("node",)
    if group_size is None or group_size in allowed:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(
            f"group_size must be {_GROUP_SIZE_HELP if allow_auto else 'None, an int or node'}, "
            f"got {type(group_size).__name__} {group_size!r}"
        )
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (1 = per-rank BatchNorm), got {group_size}")


def _validate_overrides(momentum: Any, eps: Any) -> None:
    """Check ``momentum``/``eps`` overrides with the module's own validation (None = keep)."""
    _validate_hyperparameters(1, 1e-5 if eps is None else eps, momentum, None)


def _positive_int(name: str, value: Any, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _convert(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    momentum: float | None,
    eps: float | None,
    force_sync: bool = False,
) -> list[SyncBatchNorm]:
    """Convert ``model`` in place, put every SyncBatchNorm in ``group``, apply the overrides."""
    convert_sync_batchnorm(model, process_group=group)
    layers = [m for m in model.modules() if isinstance(m, SyncBatchNorm)]
    for bn in layers:  # also the layers that already were SyncBatchNorm
        bn.process_group = group
        bn.force_sync = force_sync
        if momentum is not None:
            bn.momentum = float(momentum)
        if eps is not None:
            bn.eps = float(eps)
    return layers


def _keep_group_buffers(strategy: Any) -> None:
    """Stop DDP from broadcasting rank 0's buffers before every forward.

    With sync groups smaller than the world, that broadcast would overwrite every other group's
    running statistics with group 0's. DDP still syncs buffers once at construction, when all
    ranks hold the same (initial or restored) values.
    """
    if not isinstance(strategy, DDPStrategy):
        return
    kwargs = strategy._ddp_kwargs
    for key in ("forward_sync_buffers", "broadcast_buffers"):
        if kwargs.get(key):
            raise ValueError(
                f"DDPStrategy({key}=True) broadcasts rank 0's BatchNorm running stats before "
                f"every forward, overwriting the other sync groups' statistics: drop {key} or "
                f"use SyncBNCallback(group_size=None) (one group for the whole world)"
            )
    kwargs.pop("broadcast_buffers", None)
    kwargs["forward_sync_buffers"] = False


def _refuse_other_layer_sync(trainer: pl.Trainer, owner: str) -> None:
    layer_sync = getattr(trainer.strategy, "_layer_sync", None)
    if isinstance(layer_sync, TorchSyncBatchNorm):
        raise ValueError(
            f"{owner} cannot be combined with Trainer(sync_batchnorm=True): that converts the "
            f"model to torch.nn.SyncBatchNorm again (which refuses CPU tensors). Remove "
            f"sync_batchnorm=True; {owner} already synchronizes BatchNorm"
        )
    if isinstance(layer_sync, SyncBNLayerSync) and owner == "SyncBNCallback":
        raise ValueError(
            "SyncBNCallback and the SyncBNLayerSync plugin both convert BatchNorm layers: use one "
            "of them (pass group_size/momentum/eps to the one you keep)"
        )


def _default_precise_forward(module: pl.LightningModule, batch: Any) -> Any:
    """``module(x)`` with ``x = batch[0]`` for tuple/list batches, else the batch itself."""
    if isinstance(batch, (tuple, list)):
        return module(batch[0])
    if isinstance(batch, torch.Tensor):
        return module(batch)
    raise TypeError(
        f"PreciseBN cannot guess how to run the model on a {type(batch).__name__} batch: pass "
        f"SyncBNCallback(precise_bn_forward=fn) with fn(module, batch) running the forward"
    )


def _loader_batch_size(loader: Any) -> int | None:
    """Samples per batch of a DataLoader (or of the smallest of a collection of them)."""
    if isinstance(loader, DataLoader):
        size = loader.batch_size
        if size is None:
            size = getattr(loader.batch_sampler, "batch_size", None)
        return size if isinstance(size, int) else None
    if isinstance(loader, dict):
        loader = list(loader.values())
    if isinstance(loader, (list, tuple)) and loader:
        sizes = [_loader_batch_size(item) for item in loader]
        return None if None in sizes else min(s for s in sizes if s is not None)
    return None


class SyncBNCallback(Callback):
    """Synchronized BatchNorm for a Lightning DDP run, with batch-size and running-stat monitoring.

    ``Trainer(strategy="ddp", callbacks=[SyncBNCallback()])`` converts every BatchNorm layer of the
    LightningModule to :class:`~syncbn_lightning.SyncBatchNorm` when the process group is up and
    before DDP wraps the model (``setup(stage="fit")``; layers built in ``configure_model`` are
    included because the callback calls it first). It works with the DDP strategies (``ddp``,
    ``ddp_spawn``, ``ddp_fork``), on CPU with gloo and on GPUs with NCCL. In a single-process run
    it leaves the model alone and says so once.

    Args:
        group_size: ranks that normalize together. ``None`` (default): the whole world. An int:
            consecutive blocks of that many ranks (must divide the world size). ``"node"``: the
            processes of one machine. ``"auto"``: the smallest divisor ``d`` of the world size such
            that ``d * per-device batch >= target_norm_batch`` (the whole world if none reaches
            it), decided at ``on_train_start`` from the train DataLoader's ``batch_size``.
        momentum: if not None, replaces every layer's momentum (``None`` keeps each layer's own;
            to switch layers to the cumulative average, convert them yourself). Default: None.
        eps: if not None, replaces every layer's eps. Default: None.
        target_norm_batch: the normalization batch (samples per BN forward in a group) that
            ``"auto"`` aims for and below which the callback warns once. Default: 32.
        log_every_n_steps: optimizer steps between measurements (the first step is always
            measured). None: the Trainer's ``log_every_n_steps``. Default: None.
        drift: also compute the running-statistics metrics (EMA drift, divergence across ranks,
            train/test gap) at each measurement. Default: True.
        reconcile: with groups smaller than the world, average the running statistics over all
            ranks before each validation, at the end of every training epoch, before every
            checkpoint and at the end of training (see Note). Default: True.
        precise_bn_batches: if > 0, recompute population statistics over that many training
            batches (:func:`~syncbn_lightning.precise_bn.update_bn_stats`). Default: 0 (off).
        precise_bn_at: ``"fit_end"`` (once, when training ends) or ``"validation"`` (before every
            validation during fit). Default: ``"fit_end"``.
        precise_bn_forward: ``fn(module, batch)`` running the model on one training batch for
            PreciseBN. Default: ``module(batch[0])`` for tuple/list batches.
        revert_on_fit_end: turn the layers back into their original classes when fit ends, so the
            trained model exports like a plain model. Default: False.
        on_nonfinite: what to do, at each measurement, about running-stat updates skipped since
            the previous one because a batch's synchronized statistics were NaN/inf (the layers
            skip them on the device; see :class:`~syncbn_lightning.SyncBatchNorm`): ``"warn"``
            (a warning naming the layers and counts), ``"raise"`` (a ``RuntimeError`` on every
            rank) or ``"ignore"``. The count is logged as ``bn/nonfinite_skipped`` either way.
            Default: ``"warn"``.
        single_process: what to do in a single-process run (world size 1). ``"leave"``: keep
            the model's BatchNorm layers, measure nothing (PreciseBN still runs). ``"monitor"``:
            convert them to a group of one rank so that the ``bn/*`` batch sizes, drift and
            train/test gap are logged as in a DDP run; for large-batch reference runs compared
            with DDP runs. Like any group of one rank (``group_size=1``) the layers compute plain
            BatchNorm, and on measurement steps the synchronized kernels (``force_sync``), equal
            up to float rounding, which record the batch statistics. Default: ``"leave"``.

    Raises:
        TypeError / ValueError: at construction for invalid arguments; in ``setup`` when combined
            with ``Trainer(sync_batchnorm=True)``, with a non-DDP multi-process strategy, or when
            ``group_size`` does not divide the world size.

    Example:
        >>> import lightning.pytorch as pl
        >>> cb = SyncBNCallback(group_size=2, target_norm_batch=16)
        >>> trainer = pl.Trainer(accelerator="cpu", devices=1, callbacks=[cb], logger=False)

    Note:
        Logged through every logger of the Trainer (CSV, TensorBoard, W&B) at each measurement,
        from global rank 0: ``bn/global_batch_size`` (samples of the last optimizer step summed
        over all ranks and accumulated micro-batches, uneven batches included),
        ``bn/norm_batch_size`` (samples per BN forward in a sync group, the minimum over groups
        and micro-batches), ``bn/samples_seen`` (all samples trained on so far) and, with
        ``drift``, ``bn/<metric>_max``/``_avg`` over layers for the metrics of
        :mod:`syncbn_lightning.metrics`; with a ``WandbLogger`` also per-layer histograms and,
        at the end of training, a per-layer table. Sample counts ride in SyncBN's own
        collective; only measurement steps add one all_gather.

        Running statistics with ``group_size`` smaller than the world (and with ``"auto"``, whose
        size is only known at train start): DDP's per-forward buffer broadcast is switched off
        (``forward_sync_buffers=False``; DDP's one-time sync at construction stays), so each group
        keeps its own
        EMA while training. At the reconciliation points listed under ``reconcile`` every rank
        replaces them with the average over all ranks (equal-sized groups, so this is
        count-weighted), which is the EMA of the global batch mean and the mean of the groups'
        within-group variances. After fit every rank, and every checkpoint, holds the same
        reconciled statistics. Checkpoints keep plain-BatchNorm state_dict keys and load into
        the unconverted model.
    """

    def __init__(
        self,
        group_size: GroupSize = None,
        *,
        momentum: float | None = None,
        eps: float | None = None,
        target_norm_batch: int = 32,
        log_every_n_steps: int | None = None,
        drift: bool = True,
        reconcile: bool = True,
        precise_bn_batches: int = 0,
        precise_bn_at: Literal["fit_end", "validation"] = "fit_end",
        precise_bn_forward: Callable[[pl.LightningModule, Any], Any] | None = None,
        revert_on_fit_end: bool = False,
        on_nonfinite: Literal["warn", "raise", "ignore"] = "warn",
        single_process: Literal["leave", "monitor"] = "leave",
    ) -> None:
        _validate_group_size(group_size)
        if on_nonfinite not in _NONFINITE_ACTIONS:
            raise ValueError(
                f"on_nonfinite must be one of {_NONFINITE_ACTIONS} (what to do when a batch's "
                f"synchronized statistics are NaN/inf), got {on_nonfinite!r}"
            )
        if single_process not in _SINGLE_PROCESS:
            raise ValueError(
                f"single_process must be one of {_SINGLE_PROCESS} (what to do in a run of one "
                f"process: leave BatchNorm alone, or monitor it), got {single_process!r}"
            )
        _validate_overrides(momentum, eps)
        _positive_int("target_norm_batch", target_norm_batch)
        _positive_int("log_every_n_steps", log_every_n_steps, allow_none=True)
        _positive_int("precise_bn_batches", precise_bn_batches, minimum=0)
        if precise_bn_at not in _PRECISE_AT:
            raise ValueError(f"precise_bn_at must be one of {_PRECISE_AT}, got {precise_bn_at!r}")
        if precise_bn_forward is not None and not callable(precise_bn_forward):
            raise TypeError("precise_bn_forward must be a callable fn(module, batch)")
        self.group_size = group_size
        self.momentum = momentum
        self.eps = eps
        self.target_norm_batch = target_norm_batch
        self.log_every_n_steps = log_every_n_steps
        self.drift = bool(drift)
        self.reconcile = bool(reconcile)
        self.precise_bn_batches = precise_bn_batches
        self.precise_bn_at = precise_bn_at
        self.precise_bn_forward = precise_bn_forward
        self.revert_on_fit_end = bool(revert_on_fit_end)
        self.on_nonfinite = on_nonfinite
        self.single_process = single_process
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._layers: list[SyncBatchNorm] = []
        self._active = False
        self.resolved_group_size: int | None = None
        self._world = 1
        self._step_start = 0
        self._pending_local = 0
        self._pending_norm: torch.Tensor | None = None
        self._since_log_local = 0
        self._samples_seen = 0
        self._warned = False
        self._snapshot: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_metrics: dict[str, float] = {}
        self._last_layer_metrics: dict[str, dict[str, float]] = {}
        self._reported_skips: torch.Tensor | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(group_size=self.group_size)

    # ------------------------------------------------------------------ conversion

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _refuse_other_layer_sync(trainer, "SyncBNCallback")
        world = trainer.world_size
        self._world = world
        if world == 1 and self.single_process == "monitor":
            if is_overridden("configure_model", pl_module):
                pl_module.configure_model()
            self._layers = _convert(pl_module, None, self.momentum, self.eps, force_sync=True)
            self._active = bool(self._layers)
            self.resolved_group_size = 1
            rank_zero_info(
                f"SyncBNCallback: single process, {len(self._layers)} BatchNorm layers normalize "
                f"their local batch and are monitored (single_process='monitor')"
            )
            return
        if world == 1:
            rank_zero_info(
                "SyncBNCallback: single process (world size 1), BatchNorm layers are left as they "
                "are: there is nothing to synchronize"
            )
            return
        if not isinstance(trainer.strategy, DDPStrategy):
            raise ValueError(
                f"SyncBNCallback supports the DDP strategies (strategy='ddp', 'ddp_spawn', "
                f"'ddp_fork'), got {type(trainer.strategy).__name__}: sharded strategies "
                f"(FSDP, DeepSpeed) keep parameters sharded and are not supported"
            )
        if is_overridden("configure_model", pl_module):
            pl_module.configure_model()  # layers built there must exist to be converted
        size = None
        if self.group_size != "auto":
            size = resolve_group_size(self.group_size, world, trainer.num_devices)
            self.resolved_group_size = size
        group = new_sync_group(size) if size is not None and size < world else None
        self._layers = _convert(pl_module, group, self.momentum, self.eps)
        if size is None or size < world:
            _keep_group_buffers(trainer.strategy)
        self._active = bool(self._layers)
        rank_zero_info(
            f"SyncBNCallback: {len(self._layers)} BatchNorm layers synchronized over "
            f"{'groups of ' + str(size) if size else 'auto-sized groups'} of {world} ranks"
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        if self.group_size == "auto":
            self._resolve_auto_group(trainer)
        if self.drift and not self._snapshot:
            self._snapshot = self._take_snapshot(pl_module)

    def _resolve_auto_group(self, trainer: pl.Trainer) -> None:
        local = _loader_batch_size(trainer.train_dataloader)
        # Every rank must build the same groups: agree on the smallest per-rank batch.
        batch = torch.tensor([local if local is not None else -1], dtype=torch.int64)
        batch = gather_rows(batch).min().item()
        size = resolve_group_size(
            "auto", self._world, trainer.num_devices, int(batch), self.target_norm_batch
        )
        self.resolved_group_size = size
        group = new_sync_group(size) if size < self._world else None
        for bn in self._layers:
            bn.process_group = group
        rank_zero_info(
            f"SyncBNCallback: group_size='auto' -> {size} ranks x {batch} samples = "
            f"{size * batch} samples per BN forward (target_norm_batch={self.target_norm_batch})"
        )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and self.revert_on_fit_end:
            revert_sync_batchnorm(pl_module)
            self._layers = []
            self._active = False

    # ------------------------------------------------------------------ batch-size tracking

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_start = trainer.global_step
        if self._active and self.drift and self.resolved_group_size == 1:
            # One-rank groups normalize with plain BatchNorm, which records no batch statistics;
            # on the steps that will be measured they take the synchronized path (a one-rank
            # collective) so that the train/test gap of local BN is measured too.
            force = self._measured(trainer, trainer.global_step + 1)
            for bn in self._layers:
                bn.force_sync = force

    def _measured(self, trainer: pl.Trainer, step: int) -> bool:
        """Whether the optimizer step ``step`` is a measurement step."""
        interval = self.log_every_n_steps or trainer.log_every_n_steps
        return step == 1 or step % interval == 0

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._active:
            return
        check_call_order()  # CUDA layers queue their call-order tags; one host sync per step
        records = [bn.last_batch for bn in self._layers]
        for bn in self._layers:
            bn.last_batch = None  # so that a layer skipped next time is not read again
        probe = next((r for r in records if r is not None), None)
        if probe is not None:
            self._pending_local += probe.local_samples
            norm = (
                probe.samples
                if probe.samples is not None
                else torch.tensor(float(probe.local_samples))
            )
            self._pending_norm = (
                norm if self._pending_norm is None else torch.minimum(self._pending_norm, norm)
            )
        step = trainer.global_step
        if step == self._step_start:
            return  # gradient accumulation: the optimizer step is not complete yet
        step_local, self._pending_local = self._pending_local, 0
        step_norm, self._pending_norm = self._pending_norm, None
        self._since_log_local += step_local
        if self._measured(trainer, step):
            self._measure(trainer, pl_module, step, step_local, step_norm, records)

    def _measure(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        step_local: int,
        step_norm: torch.Tensor | None,
        records: list[BatchRecord | None],
    ) -> None:
        """One all_gather of the sizes (and running stats), then log from global rank 0."""
        layers = running_stat_layers(pl_module) if self.drift else []
        norm = float(step_norm) if step_norm is not None else float("inf")
        parts = [torch.tensor([float(step_local), norm, float(self._since_log_local)])]
        parts += [torch.stack([bn.nonfinite_skips() for bn in self._layers]).cpu()]
        for _, bn in layers:
            parts += [
                bn.running_mean.detach().double().cpu(),
                bn.running_var.detach().double().cpu(),
            ]
        rows = gather_rows(torch.cat([p.double() for p in parts]).to(_comm_device(pl_module)))
        rows = rows.cpu()
        self._since_log_local = 0
        self._samples_seen += int(rows[:, 2].sum())
        n_layers = len(self._layers)
        skips = self._check_nonfinite(rows[:, 3 : 3 + n_layers], step)
        metrics = {
            "bn/global_batch_size": float(rows[:, 0].sum()),
            "bn/norm_batch_size": float(rows[:, 1].min()),
            "bn/samples_seen": float(self._samples_seen),
            "bn/nonfinite_skipped": skips,
        }
        if layers:
            by_layer = {id(bn): r for bn, r in zip(self._layers, records, strict=True)}
            self._last_layer_metrics = self._layer_metrics(
                layers, rows[:, 3 + n_layers :], by_layer
            )
            metrics.update(summarize(self._last_layer_metrics))
            self._snapshot = self._take_snapshot(pl_module)
        self.last_metrics = metrics
        self._warn_small_batch(metrics["bn/norm_batch_size"])
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            self._log_wandb_histograms(trainer, step)

    def _check_nonfinite(self, counts: torch.Tensor, step: int) -> float:
        """Act on updates skipped for NaN/inf statistics since the last measurement.

        ``counts``: ``[world, layers]`` cumulative skips gathered from every rank (all ranks see
        the same, so "raise" raises everywhere at once). Returns the total over layers of the
        worst rank's count (ranks of one group skip together; groups may differ).
        """
        worst = counts.max(dim=0).values
        previous = self._reported_skips
        self._reported_skips = worst
        new = worst - previous if previous is not None else worst
        if self.on_nonfinite != "ignore" and bool((new > 0).any()):
            names = [bn.sync_name or f"layer {i}" for i, bn in enumerate(self._layers)]
            listed = ", ".join(
                f"{names[i]} ({int(new[i])}x)" for i in torch.nonzero(new).flatten().tolist()
            )
            message = (
                f"SyncBNCallback: {int(new.sum())} running-stat update(s) skipped since the last "
                f"measurement (step {step}) because the synchronized batch statistics were NaN or "
                f"inf: {listed}. The running statistics were left as they were; the loss of those "
                f"batches is NaN too. Check the data and the learning rate (or "
                f"on_nonfinite='raise' to stop at once)."
            )
            if self.on_nonfinite == "raise":
                raise RuntimeError(message)
            rank_zero = not dist.is_initialized() or dist.get_rank() == 0
            if rank_zero:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
        return float(worst.sum())

    def _layer_metrics(
        self,
        layers: list[tuple[str, Any]],
        stats: torch.Tensor,
        records: dict[int, BatchRecord | None],
    ) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        rank = dist.get_rank() if dist.is_initialized() else 0
        offset = 0
        for name, bn in layers:
            c = bn.num_features
            means, variances = stats[:, offset : offset + c], stats[:, offset + c : offset + 2 * c]
            offset += 2 * c
            mean, var = means[rank], variances[rank]
            values = {"divergence": rank_divergence(means, variances, bn.eps)}
            if name in self._snapshot:
                prev_mean, prev_var = self._snapshot[name]
                values["drift_mean"], values["drift_var"] = ema_drift(
                    prev_mean, prev_var, mean, var, bn.eps
                )
            record = records.get(id(bn))
            gap = train_test_gap(record, mean, var, bn.eps) if record is not None else None
            if gap is not None:
                values["gap_mean"], values["gap_std"] = gap
            out[name] = values
        return out

    def _warn_small_batch(self, norm_batch: float) -> None:
        if self._warned or norm_batch >= self.target_norm_batch or norm_batch == float("inf"):
            return
        self._warned = True
        group = self.resolved_group_size or self._world
        per_rank = max(1.0, norm_batch / max(group, 1))
        suggestion = next(
            (
                d
                for d in range(group + 1, self._world + 1)
                if self._world % d == 0 and d * per_rank >= self.target_norm_batch
            ),
            None,
        )
        fix = (
            f"use SyncBNCallback(group_size={suggestion}) ({suggestion} ranks x "
            f"{per_rank:g} samples)"
            if suggestion is not None
            else (
                "raise the per-device batch size (the whole world already normalizes together)"
                if group >= self._world
                else f"raise the per-device batch size: even the whole world ({self._world} ranks "
                f"x {per_rank:g} samples, group_size=None) stays below the target"
            )
        )
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        warnings.warn(
            f"SyncBNCallback: BatchNorm normalizes over only {norm_batch:g} samples per forward "
            f"(bn/norm_batch_size, group of {group} rank(s)), below target_norm_batch="
            f"{self.target_norm_batch}; batch statistics this small are noisy. To fix it, {fix}, "
            f"or lower target_norm_batch to silence this warning",
            UserWarning,
            stacklevel=2,
        )

    def _log_wandb_histograms(self, trainer: pl.Trainer, step: int) -> None:
        if not self._last_layer_metrics:
            return
        for logger, wandb in _wandb_loggers(trainer):
            data: dict[str, Any] = {"trainer/global_step": step}
            for metric in sorted({k for v in self._last_layer_metrics.values() for k in v}):
                values = [v[metric] for v in self._last_layer_metrics.values() if metric in v]
                data[f"bn/layers/{metric}"] = wandb.Histogram(values)
            logger.experiment.log(data)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # PreciseBN also runs in a single process, so that a one-process reference run of a recipe
        # is evaluated with statistics computed the same way.
        if self.precise_bn_batches and self.precise_bn_at == "fit_end":
            self._precise_bn(trainer, pl_module)
        if not self._active:
            return
        self._reconcile(pl_module)
        if trainer.is_global_zero and self._last_layer_metrics:
            for logger, wandb in _wandb_loggers(trainer):
                columns = [
                    "layer",
                    *sorted({k for v in self._last_layer_metrics.values() for k in v}),
                ]
                rows = [
                    [name, *(values.get(c, float("nan")) for c in columns[1:])]
                    for name, values in self._last_layer_metrics.items()
                ]
                logger.experiment.log({"bn/layers": wandb.Table(columns=columns, data=rows)})

    # ------------------------------------------------------------------ running statistics

    def _take_snapshot(self, pl_module: pl.LightningModule) -> dict[str, Any]:
        return {
            name: (bn.running_mean.detach().double().cpu(), bn.running_var.detach().double().cpu())
            for name, bn in running_stat_layers(pl_module)
        }

    def _groups_differ(self) -> bool:
        return self._active and (self.resolved_group_size or self._world) < self._world

    def _reconcile(self, pl_module: pl.LightningModule) -> None:
        if self.reconcile and self._groups_differ():
            average_running_stats([bn for _, bn in running_stat_layers(pl_module)])

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return  # trainer.validate() after fit evaluates the model as fit left it
        if self.precise_bn_batches and self.precise_bn_at == "validation":
            self._precise_bn(trainer, pl_module)
        if self._active:
            self._reconcile(pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reconcile(pl_module)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Runs on every rank: Trainer.save_checkpoint is collective, so collectives are safe here.
        if not self._active:
            return
        self._fold_unlogged_samples(pl_module, checkpoint)
        if not (self.reconcile and self._groups_differ()):
            return
        self._reconcile(pl_module)
        state = checkpoint.get("state_dict")
        if isinstance(state, dict):
            for name, bn in running_stat_layers(pl_module):
                for key in ("running_mean", "running_var"):
                    full = f"{name}.{key}" if name else key
                    if full in state:
                        state[full] = getattr(bn, key).detach().clone()

    def _fold_unlogged_samples(
        self, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Add every rank's samples since the last measurement to ``samples_seen`` (one gather),
        so that the checkpoint, which keeps only rank 0's callback state, counts them all."""
        local = torch.tensor([float(self._since_log_local)], dtype=torch.float64)
        self._samples_seen += int(gather_rows(local.to(_comm_device(pl_module))).sum())
        self._since_log_local = 0
        saved = checkpoint.get("callbacks", {}).get(self.state_key)
        if isinstance(saved, dict):
            saved.update(samples_seen=self._samples_seen, since_log_local=0)

    def _precise_bn(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader):
            raise TypeError(
                f"PreciseBN (precise_bn_batches={self.precise_bn_batches}) needs a single train "
                f"DataLoader, got {type(loader).__name__}: set precise_bn_batches=0"
            )
        available = len(loader) if hasattr(loader, "__len__") else self.precise_bn_batches
        wanted = torch.tensor([min(self.precise_bn_batches, available)], dtype=torch.int64)
        num = int(gather_rows(wanted).min())  # every rank must run the same number of forwards
        if num < 1:
            return
        forward = self.precise_bn_forward or _default_precise_forward
        batches = (trainer.strategy.batch_to_device(b) for b in loader)
        used = update_bn_stats(pl_module, batches, num, forward=lambda b: forward(pl_module, b))
        rank_zero_info(f"SyncBNCallback: PreciseBN recomputed running stats over {used} batches")

    # ------------------------------------------------------------------ resumable state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "samples_seen": self._samples_seen,
            "since_log_local": self._since_log_local,
            "warned": self._warned,
            "snapshot": dict(self._snapshot),
            "last_metrics": dict(self.last_metrics),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != 1:
            raise ValueError(
                f"SyncBNCallback state version {state_dict.get('version')!r} is not supported "
                f"(expected 1): the checkpoint was written by a different syncbn_lightning"
            )
        self._samples_seen = int(state_dict["samples_seen"])
        self._since_log_local = int(state_dict["since_log_local"])
        self._warned = bool(state_dict["warned"])
        self._snapshot = dict(state_dict["snapshot"])
        self.last_metrics = dict(state_dict["last_metrics"])


def _comm_device(pl_module: pl.LightningModule) -> torch.device:
    """Where collectives' tensors must live: CUDA for NCCL, CPU for gloo."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return pl_module.device if backend == "nccl" else torch.device("cpu")


def _wandb_loggers(trainer: pl.Trainer) -> list[tuple[Any, Any]]:
    """``(logger, wandb module)`` for every WandbLogger of the trainer (none if not installed)."""
    try:
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:  # pragma: no cover - WandbLogger ships with Lightning
        return []
    found = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
    if not found:
        return []
    import wandb

    return [(lg, wandb) for lg in found]


class SyncBNLayerSync(LayerSync):
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
    ) -> None:
        _validate_group_size(group_size, allow_auto=False)
        _validate_overrides(momentum, eps)
        self.group_size = group_size
        self.momentum = momentum
        self.eps = eps

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return model
        trainer = getattr(model, "_trainer", None)
        world = dist.get_world_size()
        per_node = trainer.num_devices if trainer is not None else _env_local_world_size()
        size = resolve_group_size(self.group_size, world, per_node)
        group = new_sync_group(size) if size < world else None
        _convert(model, group, self.momentum, self.eps)
        if size < world and trainer is not None:
            _keep_group_buffers(trainer.strategy)
        return model

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)


def _env_local_world_size() -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        raise ValueError(
            "group_size='node' needs the number of processes per machine: run under a Lightning "
            "Trainer or set LOCAL_WORLD_SIZE"
        )
    return int(value)
