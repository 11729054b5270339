"""The Lightning callback: :class:`SyncBNCallback` converts the model's BatchNorm layers when DDP
starts, reconciles the groups' running statistics, runs PreciseBN and keeps its state in
checkpoints; what it measures and logs is its base class,
:class:`~syncbn_lightning.lightning.monitoring.BatchNormMonitor`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from ..distributed.call_order.watcher import stop_watchers
from ..distributed.collectives import gather_rows
from ..distributed.group_sizes import (
    DEFAULT_TARGET_NORM_BATCH,
    GroupSize,
    auto_group_summary,
    resolve_group_size,
)
from ..distributed.groups import new_sync_group
from ..nn.batchnorm import SyncBatchNorm
from ..nn.checks import FuseResidual, check_fuse_residual
from ..nn.convert import revert_sync_batchnorm
from ..nn.precise_bn import update_bn_stats
from ..nn.running_stats import average_running_stats, running_stat_layers
from ..nn.step_statistics import OpenStep, open_step
from .arguments import check_callback_arguments
from .batches import default_precise_forward, loader_batch_size
from .ddp_setup import (
    LayerSettings,
    build_model_layers,
    convert_layers,
    keep_flight_records,
    keep_group_buffers,
    refuse_buffer_broadcast,
    refuse_other_layer_sync,
    require_ddp_strategy,
    restore_flight_records,
)
from .layer_sync import SyncBNLayerSync
from .monitoring import BatchNormMonitor

__all__ = ["SyncBNCallback"]


class SyncBNCallback(LayerSettings, BatchNormMonitor):
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
        stats_mode: if not None, every layer's ``stats_mode`` (``"N"``: ranks weighed by their
            sample count; ``"default"``: every non-empty rank the same, see
            :class:`~syncbn_lightning.SyncBatchNorm`); ``None`` keeps each layer's own (``"N"``
            for converted layers). Default: None.
        exchange: if not None, every layer's statistics exchange: ``"gather"``, ``"reduce"``
            (one all-reduce of O(C) values whatever the group size) or ``"auto"`` (on GPUs, reduce
            in groups of more than 8 ranks); ``None`` keeps each layer's own (``"auto"`` for
            converted layers). See ``docs/scaling.md``. Default: None.
        impl: the layers' kernels: ``"auto"``, ``"ext"``, ``"reference"``, or ``None`` (the
            ``SYNCBN_IMPL`` environment variable, default ``"auto"``); see
            :class:`~syncbn_lightning.SyncBatchNorm`. Default: None.
        fuse_residual: also run each residual block's tail (BatchNorm, shortcut add,
            activation) as one fused call, as ``convert_sync_batchnorm(..., fuse_residual=...)``:
            ``True`` for torchvision's and timm's ResNet blocks, or a list of your block classes
            (or ``"package.module.Class"`` paths) to trace with ``torch.fx`` besides those. Same
            results, classes and state_dict keys. Default: False.
        flight_dir: the folder of the ranks' SyncBN flight records (``syncbn-flight`` reads
            them); ``None``: one set already (``SYNCBN_FLIGHT_DIR``), else the log folder's
            ``.syncbn``. A folder keeps the files of the last 10 jobs
            (``SYNCBN_FLIGHT_KEEP_JOBS``). Default: None.
        step_statistics: with ``Trainer(accumulate_grad_batches=K)``, K > 1: ``"micro"``, the
            micro-batches of each optimizer step run inside
            :func:`~syncbn_lightning.step_statistics` (each normalized with its own group's
            statistics, ONE running-statistics update per optimizer step from all of them);
            ``"step"``: the same, each micro-batch normalized over the step's micro-batches so
            far (``normalize="step"``); ``None``: torch's K updates per step. Default:
            ``"micro"``.
        target_norm_batch: the normalization batch (samples per BN forward in a group) that
            ``"auto"`` aims for, below which the callback warns once, and against which the
            service's report reads ``bn/norm_batch_size`` (below: noisy; from it: enough; from
            twice it: reliable). Default: 16, where BatchNorm's ImageNet accuracy stops falling
            (``docs/choosing-normalization.md``).
        log_every_n_steps: optimizer steps between measurements (the first step is always
            measured). None: the Trainer's ``log_every_n_steps``, so that every row Lightning
            writes holds values measured at its step; a larger value leaves the last measured
            values in the rows between. Default: None.
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
        Logged at each measurement with ``LightningModule.log_dict`` (so Lightning writes them
        to every logger, from global rank 0, in the same rows and at the same ``step`` as the
        module's own ``self.log`` metrics, and they are in ``trainer.callback_metrics`` for
        ``ModelCheckpoint``/``EarlyStopping``): ``bn/global_batch_size`` (samples of the last
        optimizer step summed over all ranks and accumulated micro-batches, uneven batches
        included), ``bn/norm_batch_size`` (samples per BN forward in a sync group, the minimum
        over groups and micro-batches; under gradient accumulation also
        ``bn/norm_batch_size_first`` and ``_last``, the step's first and last micro-batch's),
        ``bn/target_norm_batch`` (the target it is read against), ``bn/samples_seen`` (all
        samples trained on so far) and,
        with ``drift``, ``bn/<metric>_max``/``_avg`` over layers for the metrics of
        :mod:`syncbn_lightning.metrics`; with a ``WandbLogger`` also per-layer histograms and,
        at the end of training, a per-layer table. Sample counts ride in SyncBN's own
        collective; only measurement steps add one all_gather.

        Checkpoints keep the callback's state under the key ``"SyncBNCallback"`` whatever its
        settings, so a run resumed with another ``group_size`` continues ``bn/samples_seen``
        (with a warning that the groups changed); a checkpoint without that state warns once.

        Running statistics with ``group_size`` smaller than the world (and with ``"auto"``, whose
        size is only known at train start): DDP's per-forward buffer broadcast is switched off
        (``forward_sync_buffers=False``; DDP's one-time sync at construction stays), so each group
        keeps its own EMA while training. At the reconciliation points listed under
        ``reconcile`` every rank replaces them with the average over all ranks (equal-sized
        groups, so this is count-weighted), which is the EMA of the global batch mean and the
        mean of the groups' within-group variances. After fit every rank, and every checkpoint,
        holds the same reconciled statistics. Checkpoints keep plain-BatchNorm state_dict keys
        and load into the unconverted model.
    """

    def __init__(
        self,
        group_size: GroupSize = None,
        *,
        momentum: float | None = None,
        eps: float | None = None,
        impl: str | None = None,
        target_norm_batch: int = DEFAULT_TARGET_NORM_BATCH,
        log_every_n_steps: int | None = None,
        drift: bool = True,
        reconcile: bool = True,
        precise_bn_batches: int = 0,
        precise_bn_at: Literal["fit_end", "validation"] = "fit_end",
        precise_bn_forward: Callable[[pl.LightningModule, Any], Any] | None = None,
        revert_on_fit_end: bool = False,
        on_nonfinite: Literal["warn", "raise", "ignore"] = "warn",
        single_process: Literal["leave", "monitor"] = "leave",
        stats_mode: Literal["N", "default"] | None = None,
        exchange: Literal["auto", "gather", "reduce"] | None = None,
        fuse_residual: FuseResidual = False,
        flight_dir: str | os.PathLike[str] | None = None,
        step_statistics: Literal["micro", "step"] | None = "micro",
    ) -> None:
        options = check_callback_arguments(
            group_size,
            momentum=momentum,
            eps=eps,
            impl=impl,
            target_norm_batch=target_norm_batch,
            log_every_n_steps=log_every_n_steps,
            drift=drift,
            reconcile=reconcile,
            precise_bn_batches=precise_bn_batches,
            precise_bn_at=precise_bn_at,
            precise_bn_forward=precise_bn_forward,
            revert_on_fit_end=revert_on_fit_end,
            on_nonfinite=on_nonfinite,
            single_process=single_process,
            stats_mode=stats_mode,
            exchange=exchange,
            fuse_residual=fuse_residual,
            flight_dir=flight_dir,
            step_statistics=step_statistics,
        )
        self._set_layer_settings(momentum, eps, impl, stats_mode, exchange, options)
        self.group_size = group_size
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
        self.fuse_residual, self.flight_dir = fuse_residual, flight_dir
        self.step_statistics = step_statistics
        self._fuse_classes = check_fuse_residual(fuse_residual)  # imports the named paths
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._kept_flight_dir: tuple[str | None] | None = None  # see keep_flight_records
        self._layers: list[SyncBatchNorm] = []
        self._step: OpenStep | None = None  # the optimizer step's micro-batches (accumulation)
        self._active = False
        self.resolved_group_size: int | None = None
        self._world = 1
        self._reset_monitor_state()

    # ------------------------------------------------------------------ conversion

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        refuse_other_layer_sync(trainer, "SyncBNCallback", SyncBNLayerSync)
        self._kept_flight_dir = keep_flight_records(trainer, self.flight_dir)
        world = trainer.world_size
        self._world = world
        if world == 1 and self.single_process == "monitor":
            build_model_layers(pl_module)
            forced = self.sync_options.trusted_replace(force_sync=True)
            self._layers = convert_layers(pl_module, None, forced, self._fuse_classes)
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
        require_ddp_strategy(trainer.strategy)
        build_model_layers(pl_module)  # layers built in configure_model must exist to convert
        size = None
        if self.group_size != "auto":
            size = resolve_group_size(self.group_size, world, trainer.num_devices)
            self.resolved_group_size = size
        group = new_sync_group(size) if size is not None and size < world else None
        self._layers = convert_layers(pl_module, group, self.sync_options, self._fuse_classes)
        if size is None or size < world:
            refuse_buffer_broadcast(trainer.strategy)  # fail before training; switched off later
        self._active = bool(self._layers)
        if not self._layers:
            rank_zero_warn(
                f"SyncBNCallback: {type(pl_module).__name__} has no BatchNorm layer "
                f"(nn.BatchNorm1d/2d/3d, nn.SyncBatchNorm) to synchronize, so the callback does "
                f"nothing. Layers built after setup (outside __init__ and configure_model) are "
                f"not seen; otherwise remove the callback",
                category=UserWarning,
            )
            return
        groups = f"groups of {size}" if size else "auto-sized groups"
        rank_zero_info(f"SyncBNCallback: {len(self._layers)} BatchNorm layers synchronized over "
                       f"{groups} of {world} ranks")  # fmt: skip

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # DDP has wrapped the model by now (and synced the buffers once): from here on, each
        # group keeps its own running statistics.
        if self._active and (self.resolved_group_size or 0) < self._world:
            keep_group_buffers(trainer.strategy)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        if self.group_size == "auto":
            self._resolve_auto_group(trainer)
        if self.drift and not self._snapshot:
            self._snapshot = self._take_snapshot(pl_module)

    def _resolve_auto_group(self, trainer: pl.Trainer) -> None:
        local = loader_batch_size(trainer.train_dataloader)
        # Every rank must build the same groups: agree on the smallest per-rank batch.
        batch = torch.tensor([local if local is not None else -1], dtype=torch.int64)
        batch = gather_rows(batch).min().item()
        if self.step_statistics == "step":  # the step's last call normalizes over K micro-batches
            batch *= trainer.accumulate_grad_batches
        size = resolve_group_size(
            "auto", self._world, trainer.num_devices, int(batch), self.target_norm_batch
        )
        self.resolved_group_size = size
        group = new_sync_group(size) if size < self._world else None
        for bn in self._layers:
            bn.process_group = group
        rank_zero_info(auto_group_summary(size, int(batch), self._world, self.target_norm_batch))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and self.revert_on_fit_end:
            revert_sync_batchnorm(pl_module)
            self._layers = []
            self._active = False

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close_step()
            restore_flight_records(self._kept_flight_dir)
            self._kept_flight_dir = None
            stop_watchers()  # the fit's call-order watchers end with it

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # PreciseBN also runs in a single process, so that a one-process reference run of a recipe
        # is evaluated with statistics computed the same way.
        if self.precise_bn_batches and self.precise_bn_at == "fit_end":
            self._precise_bn(trainer, pl_module)
        if not self._active:
            return
        self._reconcile(pl_module)
        self._log_layer_table(trainer)

    # ------------------------------------------------------------------ running statistics

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

    # ------------------------------------------------------------------ gradient accumulation

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        # The first micro-batch of an optimizer step opens its step_statistics.
        if self._step is None and self._accumulates(trainer, pl_module):
            self._step = open_step(pl_module, self.step_statistics or "micro")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        # After the step's last backward: its one running-statistics update.
        if self._step is not None:
            self._step.commit()
            self._step = None

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close_step()  # nothing of an interrupted step is committed

    def _accumulates(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Whether this run's optimizer steps take several micro-batches, whose running
        statistics the callback updates once per step (``step_statistics``)."""
        return (
            self._active
            and self.step_statistics is not None
            and trainer.accumulate_grad_batches > 1
            and pl_module.automatic_optimization
        )

    def _close_step(self) -> None:
        """End an open optimizer step without its update."""
        if self._step is not None:
            self._step.close()
            self._step = None

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
        forward = self.precise_bn_forward or default_precise_forward
        batches = (trainer.strategy.batch_to_device(b) for b in loader)
        used = update_bn_stats(pl_module, batches, num, forward=lambda b: forward(pl_module, b))
        rank_zero_info(f"SyncBNCallback: PreciseBN recomputed running stats over {used} batches")
