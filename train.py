"""The training service: ``python train.py [group=option ...] [key=value ...]``.

``main`` is a thin ``@hydra.main`` shim; :func:`train` is a plain function of a composed config
(tests call it directly). One job = validate the whole config (before any process starts) ->
generate/check the data -> start the job's other DDP processes -> fit -> evaluate -> dashboards.

Examples::

    python train.py                      # detection, 2 CPU processes, SyncBN, W&B offline
    python train.py trainer.devices=4 bn.group_size=2
    python train.py -m bn.group_size=1,2,4 trainer.devices=4   # three jobs, one W&B run each
    python train.py recipe=detection_local_bn          # a baseline
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import netrc
import os
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from typing_extensions import override

from syncbn_lightning.callback import resolve_group_size
from syncbn_lightning.launch import (
    RANK_CONFIG_ENV,
    RankLauncher,
    child_command,
    launched_externally,
    missing_rendezvous,
    restored_environ,
)

log = logging.getLogger("train")

# Validation detections are gathered and de-duplicated by image id (see CenterNet), so the
# DistributedSampler's repeated samples are harmless here.
warnings.filterwarnings("ignore", message=r"Using `DistributedSampler` with the dataloaders")

# Keys of a config group that describe the run rather than being constructor arguments.
_SERVICE_KEYS = {
    "bn": ("sync", "implementation"),
    "data": ("num_classes", "global_batch_size"),
    "model": ("monitor",),
}


def _global_batch(*factors: Any) -> int:
    """``${syncbn.global_batch:a,b,...}``: the product of per-device batch, devices, nodes and
    accumulation, shown in the config as ``data.global_batch_size``."""
    try:
        return math.prod(int(f) for f in factors)
    except (TypeError, ValueError):
        raise ValueError(
            f"data.global_batch_size needs integer batch_size, devices, num_nodes and "
            f"accumulate_grad_batches, got {factors}"
        ) from None


OmegaConf.register_new_resolver("syncbn.global_batch", _global_batch, replace=True)


class ConfigError(ValueError):
    """A config the job cannot run with; the message is one line naming the key and the fix."""


# ----------------------------------------------------------------------------- validation


def _world(cfg: DictConfig) -> tuple[int, int]:
    devices, nodes = cfg.trainer.devices, cfg.trainer.num_nodes
    for key, value in (("trainer.devices", devices), ("trainer.num_nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r}: must be a positive integer (processes per node)")
    return devices, nodes


def _build(cfg: DictConfig, group: str) -> Any:
    """``instantiate`` one group, without the keys that describe the run (``_SERVICE_KEYS``).

    Raises:
        ValueError / TypeError: the constructor's own error, unwrapped from Hydra's.
    """
    spec = OmegaConf.to_container(cfg[group], resolve=True)
    assert isinstance(spec, dict)
    for key in _SERVICE_KEYS.get(group, ()):
        spec.pop(key, None)
    try:
        # Plain containers, not DictConfig, reach the constructors: hyper-parameters saved in
        # checkpoints must load with torch.load(weights_only=True), which refuses DictConfig.
        return instantiate(spec, _convert_="all")
    except InstantiationException as e:
        if isinstance(e.__cause__, (ValueError, TypeError)):
            raise e.__cause__ from None
        raise


def _check_trainer(cfg: DictConfig, devices: int, nodes: int) -> None:
    strategy = cfg.trainer.strategy
    accelerator = str(cfg.trainer.accelerator)
    if devices * nodes > 1 and strategy != "ddp":
        # ddp_spawn would pickle the loggers and datamodule into fresh processes; the service
        # starts (or is started as) one process per device instead.
        raise ConfigError(
            f"trainer.strategy={strategy!r} with {devices * nodes} processes: the service runs "
            f"DDP with one started process per device, use trainer.strategy=ddp"
        )
    if accelerator in ("gpu", "cuda") and torch.cuda.device_count() < devices:
        raise ConfigError(
            f"trainer.accelerator={accelerator} with trainer.devices={devices}, but this machine "
            f"has {torch.cuda.device_count()} CUDA GPU(s): use trainer=cpu or fewer devices"
        )
    if nodes > 1 and not launched_externally():
        missing = missing_rendezvous(nodes)
        if missing:
            raise ConfigError(
                f"trainer.num_nodes={nodes} needs torchrun/SLURM, or {', '.join(missing)} set on "
                f"every node (NODE_RANK=0 on the node at MASTER_ADDR); see the README"
            )


def _check_bn(cfg: DictConfig, devices: int, nodes: int) -> None:
    if cfg.bn.implementation not in ("auto", "ext", "ref"):
        raise ConfigError(f"bn.implementation={cfg.bn.implementation!r}: use auto, ext or ref")
    if not cfg.bn.sync:
        return
    group_size = cfg.bn.group_size
    try:
        _build(cfg, "bn")  # the callback validates every argument it takes
        if group_size != "auto":
            resolve_group_size(group_size, devices * nodes, devices)
    except (ValueError, TypeError) as e:
        name = next((k for k in cfg.bn if str(e).startswith(str(k))), "group_size")
        raise ConfigError(f"bn.{name}={cfg.bn[name]!r}: {e}") from None


def _check_data(cfg: DictConfig) -> None:
    from syncbn_lightning.tasks.coco import missing_files

    data = cfg.data
    if OmegaConf.is_missing(data, "root"):
        raise ConfigError("data.root is required: pass data.root=/path/to/a/coco-format/folder")
    if data.synthetic is None:
        splits = (data.train_split, data.val_split)
        missing = missing_files(
            data.root, splits=splits, images=data.images, annotations=data.annotations
        )
        if missing:
            raise ConfigError(
                f"data.root={data.root}: {len(missing)} required path(s) missing, e.g. "
                f"{missing[0]}; point data.root at a COCO-format folder, or use data=shapes"
            )
    _build(cfg, "data")


def validate(cfg: DictConfig) -> None:
    """Check the whole config before any process is started or any file is written.

    Raises:
        ConfigError: one line naming the offending key and how to fix it.
    """
    try:
        devices, nodes = _world(cfg)
        _check_trainer(cfg, devices, nodes)
        _check_bn(cfg, devices, nodes)
        _check_data(cfg)
        _build(cfg, "model")
        abort = cfg.launch.abort_after_s
        if abort is not None and (
            isinstance(abort, bool) or not isinstance(abort, (int, float)) or abort <= 0
        ):
            raise ConfigError(
                f"launch.abort_after_s={abort!r}: use a positive number of seconds, or null"
            )
        if cfg.ckpt_path is not None and not Path(cfg.ckpt_path).is_file():
            raise ConfigError(f"ckpt_path={cfg.ckpt_path}: no such checkpoint file")
        offline = cfg.logger.get("wandb", {}).get("offline", "auto")
        if offline not in ("auto", True, False):
            raise ConfigError(f"logger.wandb.offline={offline!r}: use auto, true or false")
    except ConfigError:
        raise
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is required (it is ??? in the config): set it") from None
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


# ----------------------------------------------------------------------------- building


def _wandb_offline(setting: Any) -> bool:
    """``auto``: offline unless ``WANDB_API_KEY`` is set or ``~/.netrc`` has a W&B login."""
    if setting != "auto":
        return bool(setting)
    if os.environ.get("WANDB_API_KEY"):
        return False
    with contextlib.suppress(FileNotFoundError, netrc.NetrcParseError, OSError):
        return netrc.netrc().authenticators("api.wandb.ai") is None
    return True


def _finish_stale_wandb_run() -> None:
    """One W&B run per job: WandbLogger would silently reuse a run left open in this process."""
    import wandb

    if wandb.run is not None:
        log.warning("finishing W&B run %s left open in this process", wandb.run.id)
        wandb.finish()


def _build_loggers(cfg: DictConfig) -> list[Any]:
    loggers = []
    if "wandb" in cfg.logger:
        _finish_stale_wandb_run()
    for name, node in cfg.logger.items():
        spec = OmegaConf.to_container(node, resolve=True)
        assert isinstance(spec, dict)
        if name == "wandb":
            spec["offline"] = _wandb_offline(spec.get("offline", "auto"))
            if os.environ.get("WANDB_MODE") == "disabled":
                spec["mode"] = "disabled"
        loggers.append(instantiate(spec, _convert_="all"))
    return loggers


class _AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, but a local checkpoint is written beside its final path
    (``.<name>.partial``), flushed to disk and renamed over it, so a process killed mid-write
    leaves the previous ``last.ckpt`` whole.

    Lightning writes to a temporary file in ``$TMPDIR`` and moves it into place: atomic only when
    ``$TMPDIR`` is on the checkpoint's filesystem; otherwise the move copies into the final file,
    and a kill during the copy leaves a truncated checkpoint (and a stray file in ``$TMPDIR``).
    Remote paths (fsspec URLs) still go through Lightning's implementation.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        from fsspec.implementations.local import LocalFileSystem

        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(str(path).removeprefix("file://"))
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        try:
            with open(partial, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, target)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise


def _build_trainer(cfg: DictConfig, callbacks: list[Any], loggers: list[Any]) -> pl.Trainer:
    strategy: Any = cfg.trainer.strategy
    checkpoint_io = _AtomicCheckpointIO()
    extra: dict[str, Any] = {}
    if strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        timeout = timedelta(seconds=cfg.launch.timeout_s)
        strategy = DDPStrategy(timeout=timeout, checkpoint_io=checkpoint_io)
    else:
        extra["plugins"] = [checkpoint_io]
    return instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, strategy=strategy, **extra
    )


def _setup_wandb(trainer: pl.Trainer, cfg: DictConfig) -> None:
    """Rank 0: create the run, log the config, put ``bn/*`` and ``val/*`` on the step axis."""
    for lg in _wandb_loggers(trainer):
        run = lg.experiment
        run.config.update(OmegaConf.to_container(cfg, resolve=True), allow_val_change=True)
        run.define_metric("trainer/global_step")
        for pattern in ("bn/*", "val/*", "train/*", "charts/*"):
            run.define_metric(pattern, step_metric="trainer/global_step")
        run.define_metric("val/mAP", summary="max")
        run.define_metric("val/acc", summary="max")


def _wandb_loggers(trainer: pl.Trainer) -> list[Any]:
    from lightning.pytorch.loggers import WandbLogger

    return [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]


def _csv_file(trainer: pl.Trainer) -> Path | None:
    from lightning.pytorch.loggers import CSVLogger

    for lg in trainer.loggers:
        if isinstance(lg, CSVLogger):
            lg.save()
            return Path(lg.log_dir) / "metrics.csv"
    return None


def _finish_wandb(trainer: pl.Trainer, metrics: dict[str, float], csv: Path | None) -> list[str]:
    """Rank 0: custom line charts of the report panels (from the CSV metrics file ``csv``), the
    final metrics in the run summary, ``finish()``. Returns the run directories."""
    from syncbn_lightning.report import PANELS, panel_series, read_metrics

    dirs = []
    for lg in _wandb_loggers(trainer):
        import wandb

        run = lg.experiment
        if csv is not None and csv.is_file():
            series = read_metrics(csv)
            for panel in PANELS:
                lines = panel_series(panel, series)
                if not lines:
                    continue
                run.log(
                    {
                        f"charts/{panel.name}": wandb.plot.line_series(
                            xs=[[s for s, _ in pts] for pts in lines.values()],
                            ys=[[v for _, v in pts] for pts in lines.values()],
                            keys=list(lines),
                            title=panel.title,
                            xname="step",
                        )
                    }
                )
        for key, value in metrics.items():
            run.summary[f"final/{key}"] = value
        dirs.append(str(Path(run.dir).parent))
        run.finish()
    return dirs


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
def _launch(cfg: DictConfig, out: Path) -> Iterator[None]:
    """Start this node's other ranks when nobody else did (see :mod:`syncbn_lightning.launch`)."""
    devices, nodes = _world(cfg)
    # Also for one process: DDP still creates a process group, and the launcher is what keeps its
    # rendezvous store on loopback.
    if cfg.trainer.strategy != "ddp" or launched_externally():
        yield
        return
    config_file = out / ".syncbn" / "config.yaml"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, config_file, resolve=True)
    with RankLauncher(
        child_command(__file__),
        config_file,
        devices=devices,
        num_nodes=nodes,
        log_dir=out / ".syncbn",
        grace_s=cfg.launch.grace_s,
        abort_after_s=cfg.launch.abort_after_s,
    ):
        yield


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
        os.environ["SYNCBN_IMPL"] = str(cfg.bn.implementation)
        datamodule = _build(cfg, "data")
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            datamodule.prepare_data()  # generate data before the other ranks start
        with _launch(cfg, out):
            try:
                metrics = _fit_and_evaluate(cfg, datamodule, out)
            except BaseException:
                _destroy_process_group(barrier=False)
                raise
            _destroy_process_group(barrier=True)
            return metrics


def _fit_and_evaluate(
    cfg: DictConfig, datamodule: pl.LightningDataModule, out: Path
) -> dict[str, float]:
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    model = _build(cfg, "model")
    loggers = _build_loggers(cfg)
    callbacks = [instantiate(c, _convert_="all") for c in cfg.callbacks.values() if c is not None]
    if not loggers:  # Lightning refuses a LearningRateMonitor without a logger (logger=none)
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    if cfg.bn.sync:
        callbacks.append(_build(cfg, "bn"))
    trainer = _build_trainer(cfg, callbacks, loggers)
    if trainer.is_global_zero:
        _setup_wandb(trainer, cfg)
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
    if trainer.is_global_zero:
        csv = _csv_file(trainer)  # flushes the CSV logger once, after the closing evaluation
        runs = _finish_wandb(trainer, metrics, csv)
        _write_results(out / RESULTS_FILE, trainer, fit_metrics, metrics)
        _report(trainer, metrics, out, runs, csv)
    return metrics


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


def _report(
    trainer: pl.Trainer, metrics: dict[str, float], out: Path, runs: list[str], csv: Path | None
) -> None:
    keys = [k for k in ("val/mAP", "val/mAP50", "val/acc") if k in metrics]
    keys += [k for k in ("bn/norm_batch_size", "bn/global_batch_size") if k in metrics]
    log.info("final: %s", "  ".join(f"{k}={metrics[k]:.4g}" for k in keys) or "(no metrics)")
    ckpt = trainer.checkpoint_callback
    if ckpt is not None and getattr(ckpt, "dirpath", None):
        log.info("checkpoints: %s (best: %s)", ckpt.dirpath, ckpt.best_model_path or "-")
    for run in runs:
        log.info("W&B run files: %s  (offline runs: `wandb sync %s` uploads them)", run, run)
    if csv is not None:
        log.info("PNG report: python -m syncbn_lightning.report %s", out)


# ----------------------------------------------------------------------------- entry points


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point: one job per call (a multirun calls it once per job)."""
    try:
        metrics = train(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return metrics.get(cfg.model.monitor)  # the objective for Hydra sweepers


def _run_rank(config_file: str) -> None:
    """A rank started by :class:`~syncbn_lightning.launch.RankLauncher`: train with the job's
    resolved config, no Hydra (the parent's Hydra already composed it)."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank {os.environ.get('LOCAL_RANK')}][%(asctime)s][%(name)s] %(message)s",
    )
    train(OmegaConf.load(config_file))


if __name__ == "__main__":
    if os.environ.get(RANK_CONFIG_ENV):
        _run_rank(os.environ[RANK_CONFIG_ENV])
    else:
        main()
