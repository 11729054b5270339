"""The service's loggers: W&B (offline unless a login exists) and CSV, built from ``cfg.logger``,
and what rank 0 adds to a W&B run (config, step axes, report charts, final summary).

``logger.wandb`` instantiates as it stands through :func:`wandb_logger`; its run is named after the
job's overrides and grouped by launch (``${syncbn.job_overrides:}``, ``${syncbn.launch_dir:}``),
and a job that resumes a checkpoint continues the W&B run whose id is stored next to it
(:data:`WANDB_RUN_FILE`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import netrc
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

__all__ = [
    "WANDB_RUN_FILE",
    "build_loggers",
    "check_wandb",
    "csv_file",
    "finish_wandb",
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


def _wandb_offline(setting: Any) -> bool:
    """``auto``: offline when ``WANDB_MODE`` says so, or unless ``WANDB_API_KEY`` is set or
    ``~/.netrc`` has a W&B login."""
    if setting != "auto":
        return bool(setting)
    if os.environ.get("WANDB_MODE") in ("offline", "dryrun"):
        return True
    if os.environ.get("WANDB_API_KEY"):
        return False
    with contextlib.suppress(FileNotFoundError, netrc.NetrcParseError, OSError):
        return netrc.netrc().authenticators("api.wandb.ai") is None
    return True


def check_wandb(offline: Any, log_model: Any) -> bool:
    """Check ``offline`` and ``log_model`` of ``logger.wandb``; returns whether the run is offline.

    Raises:
        ValueError: the message starts with the offending argument's name.
    """
    if offline not in ("auto", True, False):
        raise ValueError(f"offline={offline!r}: use auto, true or false")
    if log_model not in (True, False, "all"):
        raise ValueError(f"log_model={log_model!r}: use false, true (at the end) or all")
    is_offline = _wandb_offline(offline)
    if log_model and is_offline:
        cause = (
            "offline=true"
            if offline is True
            else "offline=auto: no W&B login, or WANDB_MODE=offline"
        )
        raise ValueError(
            f"log_model={log_model!r}: checkpoints cannot be uploaded from an offline run "
            f"({cause}); log in (wandb login) and set offline=auto or false, or leave "
            f"log_model=false"
        )
    return is_offline


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
    return JobWandbLogger(offline=is_offline, log_model=log_model, **logger_args)


def _finish_stale_wandb_run() -> None:
    """One W&B run per job: WandbLogger would silently reuse a run left open in this process."""
    import wandb

    if wandb.run is not None:
        log.warning("finishing W&B run %s left open in this process", wandb.run.id)
        wandb.finish()


def build_loggers(cfg: DictConfig) -> list[Any]:
    """Every node of ``cfg.logger``, instantiated as it stands."""
    if "wandb" in cfg.logger:
        _finish_stale_wandb_run()
    return [instantiate(node, _convert_="all") for node in cfg.logger.values()]


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


def csv_file(trainer: pl.Trainer) -> Path | None:
    from lightning.pytorch.loggers import CSVLogger

    for lg in trainer.loggers:
        if isinstance(lg, CSVLogger):
            lg.save()
            return Path(lg.log_dir) / "metrics.csv"
    return None


def finish_wandb(trainer: pl.Trainer, metrics: dict[str, float], csv: Path | None) -> list[str]:
    """Rank 0: custom line charts of the report panels (from the CSV metrics file ``csv``), the
    final metrics in the run summary, ``finish()``. Returns the run directories."""
    from .report import PANELS, panel_series, read_metrics

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
