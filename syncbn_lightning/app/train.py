"""One job of the training service: validate, generate/check the data, start the job's other DDP
processes, fit, evaluate, write results and dashboards.

:func:`train` is a plain function of a composed config (tests call it directly); :func:`main` is
the ``@hydra.main`` entry of ``syncbn-train`` and ``python train.py``; :func:`entry` also serves the
ranks the launcher starts (``python -m syncbn_lightning.app.train`` with the job's resolved config).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf

from .checkpoint import AtomicCheckpointIO
from .config.checks import CONF_DIR, ConfigError, exit_on_config_error, world
from .config.jobs import build, validate
from .console import quiet_third_party
from .kernels import KernelBuild, prepare_kernels
from .launch import (
    FLIGHT_DIR_ENV,
    RANK_CONFIG_ENV,
    RankLauncher,
    child_command,
    launched_externally,
    restored_environ,
)
from .loggers import build_loggers, finish_wandb, metrics_history, setup_wandb

__all__ = ["RESULTS_FILE", "ConfigError", "entry", "main", "prepare_kernels", "train", "validate"]

log = logging.getLogger("train")

# Validation detections are gathered and de-duplicated by image id (see CenterNet), so the
# DistributedSampler's repeated samples are harmless here.
warnings.filterwarnings("ignore", message=r"Using `DistributedSampler` with the dataloaders")


def _build_trainer(cfg: DictConfig, callbacks: list[Any], loggers: list[Any]) -> pl.Trainer:
    strategy: Any = cfg.trainer.strategy
    checkpoint_io = AtomicCheckpointIO()
    extra: dict[str, Any] = {}
    if strategy == "ddp":
        from .strategy import TimedDDPStrategy

        strategy = TimedDDPStrategy(
            collective_timeout=timedelta(seconds=cfg.launch.default_timeout_s),
            sync_timeout=timedelta(seconds=cfg.launch.timeout_s),
            timeout=timedelta(seconds=cfg.launch.start_timeout_s),
            checkpoint_io=checkpoint_io,
        )
    else:
        extra["plugins"] = [checkpoint_io]
    return instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, strategy=strategy, **extra
    )


def _destroy_process_group(barrier: bool) -> None:
    """Leave torch.distributed clean for the next job of a multirun (or test) in this process.

    After success a barrier first: a peer still finishing its last collective must not see us
    vanish. After a failure no barrier: the peers may be blocked in another collective, and a
    barrier would wait for the whole process-group timeout.
    """
    if dist.is_available() and dist.is_initialized():
        if barrier:
            with contextlib.suppress(RuntimeError):
                dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def _launch(cfg: DictConfig, out: Path) -> Iterator[RankLauncher | None]:
    """Start this node's other ranks when nobody else did (see :mod:`.launch`); the launcher, or
    ``None`` when nothing was started here."""
    devices, nodes = world(cfg)
    # Also for one process: DDP still creates a process group, and the launcher is what keeps its
    # rendezvous store on loopback.
    if cfg.trainer.strategy != "ddp" or launched_externally():
        yield None
        return
    config_file = out / ".syncbn" / "config.yaml"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, config_file, resolve=True)
    with RankLauncher(
        child_command(),
        config_file,
        devices=devices,
        num_nodes=nodes,
        log_dir=out / ".syncbn",
        grace_s=cfg.launch.grace_s,
        abort_after_s=cfg.launch.abort_after_s,
    ) as launcher:
        yield launcher


def train(cfg: DictConfig) -> dict[str, float]:
    """Train and evaluate one job of the service.

    Args:
        cfg: a config composed from ``conf/`` (``hydra.compose`` or ``@hydra.main``); with
            ``paths.output_dir`` set when composed outside a Hydra run.

    Returns:
        The final metrics (``val/*`` of the closing evaluation, ``bn/*`` of the last measurement,
        ``train/*``), identical on every rank.

    Raises:
        ConfigError: before anything starts, for a config that cannot run.
        RuntimeError: when another rank of the job failed (its log's tail is in the message).
    """
    validate(cfg)
    out = Path(cfg.paths.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with restored_environ():
        # The SyncBN flight records in the run's folder however the job was launched (the
        # service's launcher sets the same; torchrun and srun do not).
        os.environ.setdefault(FLIGHT_DIR_ENV, str(out / ".syncbn"))
        datamodule = build(cfg, "data")
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            datamodule.prepare_data()  # generate data before the other ranks start
        # The node's other ranks start once a core is free of the first build (they import while
        # it ends, then load it) and train once it is done, which training waits for too. A
        # build that failed already starts no rank; one still running when this process leaves
        # on an error is waited for, never left half-written (KernelBuild.settle).
        kernels = KernelBuild(cfg)
        try:
            kernels.wait_for_a_free_core()
            kernels.raise_if_failed()
            with _launch(cfg, out) as launcher:
                # A rank that died meanwhile ends the wait: the launcher names it on the way out.
                kernels.result(stop=None if launcher is None else launcher.has_failed)
                return _train_launched(cfg, datamodule, out)
        finally:
            kernels.settle()


def _train_launched(
    cfg: DictConfig, datamodule: pl.LightningDataModule, out: Path
) -> dict[str, float]:
    """Fit, evaluate and (rank 0) write the outputs, inside the launcher's block; the final
    metrics."""
    try:
        trainer, fit_metrics, metrics = _fit_and_evaluate(cfg, datamodule)
    except BaseException as exc:
        _report_flight(exc)
        _destroy_process_group(barrier=False)
        raise
    # Every collective is done: no rank waits (on the process-group timeout) while rank 0 writes
    # the results, the W&B run and the report below.
    _destroy_process_group(barrier=True)
    if trainer.is_global_zero:
        _write_outputs(cfg, trainer, fit_metrics, metrics, out)
    return metrics


def _report_flight(exc: BaseException) -> None:
    """Log what the SyncBN flight recorder says about the collectives before ``exc`` (where the
    ranks' sequences parted, or each rank's last call); nothing for a Ctrl-C or a config error."""
    if isinstance(exc, (KeyboardInterrupt, ConfigError)):
        return
    from syncbn_lightning.distributed.flight import recorder as flight

    with contextlib.suppress(Exception):  # the report must never hide the failure itself
        flight.report_failure(f"{type(exc).__name__}: {str(exc).strip()[:200]}")


def _fit_and_evaluate(
    cfg: DictConfig, datamodule: pl.LightningDataModule
) -> tuple[pl.Trainer, dict[str, float], dict[str, float]]:
    """Fit and (with ``evaluate``) validate once more; returns the trainer, the metrics as fit
    left them and the final ones (the same on every rank)."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    model = build(cfg, "model")
    loggers = build_loggers(cfg)
    callbacks = [instantiate(c, _convert_="all") for c in cfg.callbacks.values() if c is not None]
    if not loggers:  # Lightning refuses a LearningRateMonitor without a logger (logger=none)
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    bn_callback = build(cfg, "bn")  # None with bn.sync=false
    if bn_callback is not None:
        callbacks.append(bn_callback)
    trainer = _build_trainer(cfg, callbacks, loggers)
    if trainer.is_global_zero:
        setup_wandb(trainer, cfg)
        out = Path(cfg.paths.output_dir).resolve()
        log.info("outputs: %s (config, logs, metrics, checkpoints, W&B files)", out)
    # weights_only=True explicitly: Lightning passes None on to torch.load, whose default
    # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 turns into a full unpickling (code execution).
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
    metrics = _scalars(trainer.callback_metrics)
    fit_metrics = dict(metrics)
    if cfg.evaluate:
        for result in trainer.validate(model, datamodule=datamodule, verbose=False):
            metrics.update(_scalars(result))
    for cb in callbacks:
        metrics.update(_scalars(getattr(cb, "last_metrics", None) or {}))
    return trainer, fit_metrics, metrics


def _write_outputs(
    cfg: DictConfig,
    trainer: pl.Trainer,
    fit_metrics: dict[str, float],
    metrics: dict[str, float],
    out: Path,
) -> None:
    """Rank 0, after the other ranks are released: metrics history, the W&B run's summary,
    ``results.json``, the PNG report and the closing log lines."""
    csv = metrics_history(trainer)  # <output_dir>/metrics.jsonl, whatever the loggers
    runs = finish_wandb(trainer, metrics, csv)
    _write_results(out / RESULTS_FILE, trainer, fit_metrics, metrics)
    figures = _png_report(out) if cfg.get("report", True) and csv is not None else []
    _report(trainer, metrics, out, runs, csv, figures)


RESULTS_FILE = "results.json"


def _write_results(
    path: Path, trainer: pl.Trainer, fit_metrics: dict[str, float], metrics: dict[str, float]
) -> None:
    """``<output_dir>/results.json``: the job's numbers for scripts that compare jobs.

    ``fit``: the metrics as fit left them; ``val/*`` there come from the last validation during
    fit, which ran with the running statistics training kept (the EMA; PreciseBN at ``fit_end``
    runs after it). ``final``: what :func:`train` returns (``val/*`` of the closing evaluation,
    after PreciseBN when it is on). ``global_step``: optimizer steps trained.
    """
    results = {"global_step": trainer.global_step, "fit": fit_metrics, "final": metrics}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _scalars(values: Any) -> dict[str, float]:
    return {
        k: float(v) for k, v in dict(values).items() if isinstance(v, (int, float, torch.Tensor))
    }


def _png_report(out: Path) -> list[tuple[Path, list[str]]]:
    """Rank 0, at the end of the job (``report: true``): the PNG report into ``<out>/report/``
    (:func:`~syncbn_lightning.app.report.render`), each figure with its reading. Returns the
    figures and their readings; a failure is logged, not raised (the training is done)."""
    from .report import PANELS, panel_readings, read_run, render

    try:
        paths = render(out)
        runs = read_run(out)
    except (OSError, ValueError) as e:
        log.warning("report: not written (%s)", e)
        return []
    panels = {p.name: p for p in PANELS}
    return [(path, panel_readings(panels[path.stem], runs)) for path in paths]


def _report(
    trainer: pl.Trainer,
    metrics: dict[str, float],
    out: Path,
    runs: list[str],
    csv: Path | None,
    figures: list[tuple[Path, list[str]]],
) -> None:
    keys = [k for k in ("val/mAP", "val/mAP50", "val/acc") if k in metrics]
    keys += [k for k in ("bn/norm_batch_size", "bn/global_batch_size") if k in metrics]
    log.info("final: %s", "  ".join(f"{k}={metrics[k]:.4g}" for k in keys) or "(no metrics)")
    ckpt = trainer.checkpoint_callback
    if ckpt is not None and getattr(ckpt, "dirpath", None):
        log.info("checkpoints: %s (best: %s)", ckpt.dirpath, ckpt.best_model_path or "-")
    for run in runs:
        log.info("W&B run files: %s  (offline runs: `wandb sync %s` uploads them)", run, run)
    for path, readings in figures:
        log.info("%s: %s", path.stem, "; ".join(readings) or "-")
    if figures:
        log.info(
            "PNG report: %s (%d figures, each with the reading above)", out / "report", len(figures)
        )
    elif csv is not None:
        log.info("PNG report: syncbn-report %s", out)


# ----------------------------------------------------------------------------- entry points


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point: one job per call (a multirun calls it once per job)."""
    quiet_third_party()
    with exit_on_config_error():
        metrics = train(cfg)
    return metrics.get(cfg.model.monitor)  # the objective for Hydra sweepers


def _run_rank(config_file: str) -> None:
    """A rank started by :class:`~syncbn_lightning.app.launch.RankLauncher`: train with the job's
    resolved config, no Hydra (the parent's Hydra already composed it)."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank {os.environ.get('LOCAL_RANK')}][%(asctime)s][%(name)s] %(message)s",
    )
    quiet_third_party()
    train(OmegaConf.load(config_file))


def entry() -> None:
    """A job (Hydra), or one of its ranks when started by the launcher. ``syncbn-train`` and
    ``python train.py`` check the command line's config before they get here
    (:func:`.cli.entry`)."""
    if os.environ.get(RANK_CONFIG_ENV):
        _run_rank(os.environ[RANK_CONFIG_ENV])
    else:
        main()


if __name__ == "__main__":
    entry()
