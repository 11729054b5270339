"""What :class:`~syncbn_lightning.SyncBNCallback` measures and logs while training: global and
per-normalization batch sizes, samples seen, skipped non-finite updates and the running-statistics
metrics of :mod:`syncbn_lightning.nn.running_stats` (drift, divergence across ranks, train/test
gap).

:class:`BatchNormMonitor` is the callback's base class: the Lightning hooks of the measurement and
its state, which checkpoints keep (``state_dict``/``load_state_dict``). It reads the callback's
settings (``drift``, ``log_every_n_steps``, ``target_norm_batch``, ``on_nonfinite``) and run
state (``_layers``, ``_active``, ``_world``, ``resolved_group_size``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from ..distributed.call_order.checks import check_call_order
from ..distributed.collectives import gather_rows
from ..distributed.group_sizes import norm_batch_verdict
from ..nn.batchnorm import SyncBatchNorm
from ..nn.layer_state import BatchRecord
from ..nn.running_stats import (
    ema_drift,
    rank_divergence,
    running_stat_layers,
    summarize,
    train_test_gap,
)

__all__ = ["BatchNormMonitor"]

#: The sizes at the front of a measurement's gathered row: the step's samples, its
#: normalization batch, the samples since the last measurement, and the normalization batch of
#: the step's first and last micro-batch.
_SIZES = 5


class BatchNormMonitor(Callback):
    """Batch-size tracking and running-statistics monitoring (see the module docstring)."""

    _layers: list[SyncBatchNorm]
    _active: bool
    _world: int
    resolved_group_size: int | None
    drift: bool
    log_every_n_steps: int | None
    target_norm_batch: int
    on_nonfinite: str
    step_statistics: str | None

    def _reset_monitor_state(self) -> None:
        self._step_start = 0
        self._pending_local = 0
        self._pending_norm: torch.Tensor | None = None
        # The normalization batch of the optimizer step's first and last micro-batch.
        self._first_norm: torch.Tensor | None = None
        self._last_norm: torch.Tensor | None = None
        self._since_log_local = 0
        self._samples_seen = 0
        self._warned = False
        self._snapshot: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_metrics: dict[str, float] = {}
        self._last_layer_metrics: dict[str, dict[str, float]] = {}
        self._reported_skips: torch.Tensor | None = None

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
                bn.sync_options = bn.sync_options.trusted_replace(force_sync=force)

    def _measured(self, trainer: pl.Trainer, step: int) -> bool:
        """Whether the optimizer step ``step`` is a measurement step: the first, and every
        ``log_every_n_steps``-th (the Trainer's by default, so that each row Lightning writes
        holds values measured at its own step)."""
        interval = self.log_every_n_steps or trainer.log_every_n_steps
        return step == 1 or step % interval == 0

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._active:
            # Flags of the last layers' backward calls may still be queued (CUDA): read them now,
            # so that a step whose statistics mixed layers is never applied (one host sync).
            check_call_order()

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
        check_call_order()  # flags queued since the optimizer step (none, or an accumulation's)
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
            if self._pending_norm is None:
                self._first_norm = norm
            self._last_norm = norm
            self._pending_norm = (
                norm if self._pending_norm is None else torch.minimum(self._pending_norm, norm)
            )
        step = trainer.global_step
        if step == self._step_start:
            return  # gradient accumulation: the optimizer step is not complete yet
        step_local, self._pending_local = self._pending_local, 0
        # normalize="step": the step's last call normalized over all its micro-batches
        stepwise = self.step_statistics == "step" and trainer.accumulate_grad_batches > 1
        step_norm = self._last_norm if stepwise else self._pending_norm
        norms = (step_norm, self._first_norm, self._last_norm)
        self._pending_norm = self._first_norm = self._last_norm = None
        self._since_log_local += step_local
        if self._measured(trainer, step):
            self._measure(trainer, pl_module, step, step_local, norms, records)

    def _measure(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        step_local: int,
        norms: tuple[torch.Tensor | None, ...],
        records: list[BatchRecord | None],
    ) -> None:
        """One all_gather of the sizes (and running stats), then log from global rank 0.
        ``norms``: the step's normalization batch (the smallest of its micro-batches'), and
        its first and last micro-batch's (``None``: no layer normalized a batch)."""
        layers = running_stat_layers(pl_module) if self.drift else []
        step_norm, first_norm, last_norm = (
            float(n) if n is not None else float("inf") for n in norms
        )
        sizes = [float(step_local), step_norm, float(self._since_log_local), first_norm, last_norm]
        parts = [torch.tensor(sizes)]
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
        skips = self._check_nonfinite(rows[:, _SIZES : _SIZES + n_layers], step)
        metrics = {
            "bn/global_batch_size": float(rows[:, 0].sum()),
            "bn/norm_batch_size": float(rows[:, 1].min()),
            "bn/samples_seen": float(self._samples_seen),
            "bn/nonfinite_skipped": skips,
            # The target the warning and the report read the normalization batch against.
            "bn/target_norm_batch": float(self.target_norm_batch),
        }
        norm_keys = ["bn/global_batch_size", "bn/norm_batch_size", "bn/samples_seen"]
        if trainer.accumulate_grad_batches > 1:
            # What the step's first and last micro-batch normalized over (the smallest group's).
            metrics["bn/norm_batch_size_first"] = float(rows[:, 3].min())
            metrics["bn/norm_batch_size_last"] = float(rows[:, 4].min())
            norm_keys += ["bn/norm_batch_size_first", "bn/norm_batch_size_last"]
        if layers:
            by_layer = {id(bn): r for bn, r in zip(self._layers, records, strict=True)}
            self._last_layer_metrics = self._layer_metrics(
                layers, rows[:, _SIZES + n_layers :], by_layer
            )
            metrics.update(summarize(self._last_layer_metrics))
            self._snapshot = self._take_snapshot(pl_module)
        if metrics["bn/norm_batch_size"] == float("inf"):
            self._warn_no_batch_statistics()
            for key in norm_keys:
                del metrics[key]  # no layer normalized a batch: there is no size to report
        else:
            self._warn_small_batch(metrics["bn/norm_batch_size"], metrics["bn/global_batch_size"])
        self.last_metrics = metrics
        # Through Lightning, like the module's own self.log: the loggers write the values in the
        # same rows (step, epoch) as train/*, from rank 0, and they reach callback_metrics on
        # every rank (ModelCheckpoint/EarlyStopping can monitor them). Every rank holds the same
        # gathered values, so no sync_dist.
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        if trainer.is_global_zero:
            self._log_wandb_histograms(trainer)

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
            rank_zero_warn(message, category=RuntimeWarning)
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

    def _warn_no_batch_statistics(self) -> None:
        if self._warned:
            return
        self._warned = True
        rank_zero_warn(
            f"SyncBNCallback: none of the {len(self._layers)} converted BatchNorm layers "
            f"normalized with batch statistics in this measurement interval on any rank: they "
            f"are in eval mode (frozen BatchNorm, e.g. kept in eval by the model's train()), "
            f"which uses the running statistics and synchronizes nothing. bn/global_batch_size, "
            f"bn/norm_batch_size and bn/samples_seen are not logged while that lasts; if the "
            f"layers are meant to stay frozen, the callback is not needed",
            category=UserWarning,
        )

    def _warn_small_batch(self, norm_batch: float, global_batch: float) -> None:
        """Warn once when the normalization batch is below ``target_norm_batch``: the verdict and
        the fix the service's report gives the same numbers (:func:`norm_batch_verdict`)."""
        if self._warned or norm_batch >= self.target_norm_batch:
            return
        self._warned = True
        verdict = norm_batch_verdict(norm_batch, global_batch, self.target_norm_batch)
        group = self.resolved_group_size or self._world
        rank_zero_warn(
            f"SyncBNCallback: {verdict.text} (bn/norm_batch_size over a group of {group} "
            f"rank(s), below target_norm_batch={self.target_norm_batch}). Lower "
            f"target_norm_batch to silence this warning",
            category=UserWarning,
        )

    def _log_wandb_histograms(self, trainer: pl.Trainer) -> None:
        if not self._last_layer_metrics:
            return
        # The step Lightning writes this batch's rows at (its own LearningRateMonitor reads the
        # same counter): the histograms line up with bn/* and train/* in W&B.
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger, wandb in _wandb_loggers(trainer):
            data: dict[str, Any] = {"trainer/global_step": step}
            for metric in sorted({k for v in self._last_layer_metrics.values() for k in v}):
                values = [v[metric] for v in self._last_layer_metrics.values() if metric in v]
                data[f"bn/layers/{metric}"] = wandb.Histogram(values)
            logger.experiment.log(data)

    def _log_layer_table(self, trainer: pl.Trainer) -> None:
        """Rank 0, at the end of training: the last per-layer metrics as a W&B table."""
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

    def _take_snapshot(self, pl_module: pl.LightningModule) -> dict[str, Any]:
        return {
            name: (bn.running_mean.detach().double().cpu(), bn.running_var.detach().double().cpu())
            for name, bn in running_stat_layers(pl_module)
        }

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

    # ------------------------------------------------------------------ resumable state

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        states = checkpoint.setdefault("callbacks", {})
        if self.state_key in states:
            return
        # Earlier versions keyed the state by the settings ("SyncBNCallback{'group_size': 2}"),
        # so a resume with another group size lost it: take the one such entry.
        legacy = [k for k in states if isinstance(k, str) and k.startswith(self.state_key + "{")]
        if len(legacy) == 1:
            states[self.state_key] = states[legacy[0]]
            return
        rank_zero_warn(
            f"SyncBNCallback: the checkpoint holds no {self.state_key} state (it was written "
            f"without this callback{' or with several' if legacy else ''}): bn/samples_seen "
            f"restarts from 0 and the first drift measurement has no reference"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "group_size": self.resolved_group_size,
            "world_size": self._world,
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
        saved = (state_dict.get("group_size"), state_dict.get("world_size"))
        now = (self.resolved_group_size, self._world)
        if saved[0] is not None and now[0] is not None and saved != now:
            rank_zero_warn(
                f"SyncBNCallback: resuming a run that normalized over groups of {saved[0]} of "
                f"{saved[1]} ranks with groups of {now[0]} of {now[1]}: bn/samples_seen "
                f"continues, and the next drift measurement compares running statistics from "
                f"the two settings"
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
