"""The service's loggers: W&B (offline unless a login exists) and CSV, built from ``cfg.logger``,
the metrics history every job writes whatever loggers are configured (:class:`MetricsHistory`),
and what rank 0 adds to a W&B run (config, step axes, report charts, final summary).

``logger.wandb`` instantiates as it stands through :func:`wandb_logger`; its run is named after the
job's overrides and grouped by launch (``${syncbn.job_overrides:}``, ``${syncbn.launch_dir:}``),
and a job that resumes a checkpoint continues the W&B run whose id is stored next to it
(:data:`WANDB_RUN_FILE`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from .metrics_csv import HISTORY_FILE, read_history
from .wandb_auth import check_wandb

__all__ = [
    "HISTORY_FILE",
    "WANDB_RUN_FILE",
    "MetricsHistory",
    "build_loggers",
    "check_wandb",
    "finish_wandb",
    "metrics_history",
    "setup_wandb",
    "wandb_logger",
]

log = logging.getLogger(__name__)

#: Written next to the job's checkpoints: the W&B run (id, name, group) a resume continues.
WANDB_RUN_FILE = "wandb-run.json"


# ----------------------------------------------------------------------------- config values


def job_overrides(default: str) -> str:
    """``${syncbn.job_overrides:DEFAULT}``: this job's command-line overrides as Hydra names its
    directory (``hydra.job.override_dirname``, e.g. ``bn.group_size=2,trainer.devices=4``), or
    ``DEFAULT`` without any, or outside a Hydra run (a config from the compose API)."""
    if not HydraConfig.initialized():
        return default
    return str(HydraConfig.get().job.override_dirname) or default


def launch_dir(default: str) -> str:
    """``${syncbn.launch_dir:DEFAULT}``: the directory of this launch as Hydra was given it, the
    sweep's for every job of a multirun (``multirun/<date>/<time>``), the job's own for a single
    run; ``DEFAULT`` outside a Hydra run."""
    if not HydraConfig.initialized():
        return default
    hydra = HydraConfig.get()
    return str(hydra.sweep.dir if hydra.mode == RunMode.MULTIRUN else hydra.run.dir)


OmegaConf.register_new_resolver("syncbn.job_overrides", job_overrides, replace=True)
OmegaConf.register_new_resolver("syncbn.launch_dir", launch_dir, replace=True)


# ----------------------------------------------------------------------------- W&B logger


def _stored_run(ckpt_path: str | None) -> dict[str, str]:
    """The W&B run (id, name, group) stored next to ``ckpt_path``; empty when there is none."""
    if ckpt_path is None:
        return {}
    file = Path(ckpt_path).parent / WANDB_RUN_FILE
    try:
        stored = json.loads(file.read_text())
    except (OSError, ValueError):
        log.info("no W&B run stored next to %s: the resumed job starts a new run", ckpt_path)
        return {}
    return {k: stored[k] for k in ("id", "name", "group") if stored.get(k)}


def _store_run(dirpath: str | None, run: Any) -> None:
    """Write the run's id, name and group into the checkpoint directory ``dirpath``."""
    if dirpath is None or getattr(run, "disabled", False):
        return
    path = Path(dirpath) / WANDB_RUN_FILE
    stored = {"id": run.id, "name": run.name, "group": run.group, "project": run.project}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(stored, indent=1) + "\n")
    os.replace(tmp, path)


class JobWandbLogger(WandbLogger):
    """A ``WandbLogger`` for one job of the service.

    The run's config is the job's whole resolved config, logged once by :func:`setup_wandb`, so
    the hyper-parameters Lightning logs at fit start (the model's and datamodule's arguments, a
    flat copy of ``model.*`` and ``data.*``) are not added a second time. Next to every
    checkpoint it stores the run (:data:`WANDB_RUN_FILE`), which a job resuming that checkpoint
    continues (:func:`wandb_logger`'s ``ckpt_path``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # WandbLogger passes anonymous=None, which W&B >= 0.22 answers with a warning that the
        # setting has no effect: leave it out (nothing else changes).
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)

    @override
    def log_hyperparams(self, params: Any) -> None:
        """Nothing: :func:`setup_wandb` logged the job's config (which holds these)."""

    @override
    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        """Rank 0, after each checkpoint: queue it for upload (``log_model``), store the run."""
        super().after_save_checkpoint(checkpoint_callback)
        _store_run(checkpoint_callback.dirpath, self.experiment)


def wandb_logger(
    offline: bool | str = "auto",
    log_model: bool | str = False,
    ckpt_path: str | None = None,
    **logger_args: Any,
) -> JobWandbLogger:
    """``logger.wandb``'s ``_target_``: a Lightning ``WandbLogger`` for one job.

    Args:
        offline: ``"auto"`` (offline unless ``WANDB_API_KEY`` or a ``wandb login`` exists, or
            when ``WANDB_MODE=offline``), true or false.
        log_model: upload checkpoints as artifacts: false, true (at the end) or ``"all"``
            (every save); needs an online run.
        ckpt_path: the checkpoint the job resumes: the run stored next to it
            (:data:`WANDB_RUN_FILE`) continues, with its id, name and group.
        logger_args: ``WandbLogger``/``wandb.init`` arguments (``project``, ``name``, ``group``,
            ``job_type``, ``tags``, ``save_dir``, ...).

    Raises:
        ValueError: a bad ``offline`` or ``log_model`` (see :func:`check_wandb`).
    """
    is_offline = check_wandb(offline, log_model)
    if os.environ.get("WANDB_MODE") == "disabled":
        # WandbLogger(offline=True) would set WANDB_MODE=dryrun over the user's choice.
        logger_args["mode"] = "disabled"
    logger_args.update(_stored_run(ckpt_path))
    # No run summary (~30 lines) nor header chatter on the console: the job's last lines say
    # where the run is and how to upload it (docs/service.md; .console).
    logger_args.setdefault("settings", {"quiet": True})
    return JobWandbLogger(offline=is_offline, log_model=log_model, **logger_args)


# ----------------------------------------------------------------------------- metrics history


class MetricsHistory(Logger):
    """Every metric Lightning logs, appended to ``<save_dir>/metrics.jsonl`` by global rank 0.

    The service adds it to every job whatever ``cfg.logger`` holds, so that the PNG report
    (``syncbn-report``) and the W&B run's charts read the same history with any logger. Each
    time Lightning logs (``log_every_n_steps``, validation ends) one JSON line is appended and
    flushed: ``{"step": 12, "epoch": 0, "train/loss": 0.71, "bn/norm_batch_size": 16.0, ...}``,
    non-finite values as the strings ``"nan"``, ``"inf"``, ``"-inf"``. A job that resumes in the
    same directory appends to the file. Read it with :func:`.metrics_csv.read_history`.

    Args:
        save_dir: The job's output directory; created when the first line is written.

    Example:
        >>> import tempfile
        >>> history = MetricsHistory(tempfile.mkdtemp())
        >>> history.log_metrics({"train/loss": 0.5, "epoch": 0.0}, step=3)
        >>> history.path.read_text()
        '{"step": 3, "epoch": 0, "train/loss": 0.5}\\n'
    """

    def __init__(self, save_dir: str | Path) -> None:
        super().__init__()
        self._save_dir = Path(save_dir)

    @property
    @override
    def name(self) -> str:
        return "history"

    @property
    @override
    def version(self) -> str:
        return ""

    @property
    @override
    def save_dir(self) -> str:
        return str(self._save_dir)

    @property
    def path(self) -> Path:
        """The history file, ``<save_dir>/metrics.jsonl``."""
        return self._save_dir / HISTORY_FILE

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing: the job's config is in ``.hydra/`` (and in the W&B run)."""

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Append one line with ``step`` and ``metrics`` (``epoch`` first when present)."""
        row: dict[str, Any] = {"step": int(step) if step is not None else None}
        if "epoch" in metrics:
            row["epoch"] = int(float(metrics["epoch"]))
        for key, value in metrics.items():
            if key != "epoch":
                row[key] = _json_number(value)
        self._save_dir.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def _json_number(value: Any) -> float | str:
    number = float(value)
    return number if math.isfinite(number) else str(number)


def metrics_history(trainer: pl.Trainer) -> Path | None:
    """Flush the trainer's loggers (a ``CSVLogger`` buffers its rows) and return its
    :class:`MetricsHistory` file; None without one (or before any line)."""
    for lg in trainer.loggers:
        lg.save()
    for lg in trainer.loggers:
        if isinstance(lg, MetricsHistory) and lg.path.is_file():
            return lg.path
    return None


# ----------------------------------------------------------------------------- building, W&B


def _finish_stale_wandb_run() -> None:
    """One W&B run per job: WandbLogger would silently reuse a run left open in this process."""
    import wandb

    if wandb.run is not None:
        log.warning("finishing W&B run %s left open in this process", wandb.run.id)
        wandb.finish()


def build_loggers(cfg: DictConfig) -> list[Any]:
    """Every node of ``cfg.logger``, instantiated as it stands, then the job's
    :class:`MetricsHistory` (``<paths.output_dir>/metrics.jsonl``), last so that Lightning's
    ``trainer.logger`` stays the configured one."""
    if "wandb" in cfg.logger:
        _finish_stale_wandb_run()
    loggers = [instantiate(node, _convert_="all") for node in cfg.logger.values()]
    return [*loggers, MetricsHistory(cfg.paths.output_dir)]


def setup_wandb(trainer: pl.Trainer, cfg: DictConfig) -> None:
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
    return [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]


def finish_wandb(trainer: pl.Trainer, metrics: dict[str, float], history: Path | None) -> list[str]:
    """Rank 0: custom line charts of the report panels (``charts/<panel>``, from the job's
    metrics history file ``history``, see :func:`metrics_history`), the final metrics in the run
    summary, ``finish()``. Returns the run directories."""
    from .readings import reading
    from .report import PANELS, panel_series

    dirs = []
    for lg in _wandb_loggers(trainer):
        import wandb

        run = lg.experiment
        if history is not None and history.is_file():
            series = read_history(history)
            for panel in PANELS:
                lines = panel_series(panel, series)
                if not lines:
                    continue
                text = reading(panel.name, series)
                if text is not None:
                    run.summary[f"readings/{panel.name}"] = text
                run.log(
                    {
                        f"charts/{panel.name}": wandb.plot.line_series(
                            xs=[[s for s, _ in pts] for pts in lines.values()],
                            ys=[[v for _, v in pts] for pts in lines.values()],
                            keys=list(lines),
                            title=f"{panel.title}: {text}" if text else panel.title,
                            xname="step",
                        )
                    }
                )
        for key, value in metrics.items():
            run.summary[f"final/{key}"] = value
        dirs.append(str(Path(run.dir).parent))
        run.finish()
    return dirs
