"""The service's loggers: W&B (offline unless a login exists) and CSV, built from ``cfg.logger``,
and what rank 0 adds to a W&B run (config, step axes, report charts, final summary)."""

from __future__ import annotations

import contextlib
import logging
import netrc
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

__all__ = ["build_loggers", "csv_file", "finish_wandb", "setup_wandb"]

log = logging.getLogger(__name__)


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


def build_loggers(cfg: DictConfig) -> list[Any]:
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
    from lightning.pytorch.loggers import WandbLogger

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
