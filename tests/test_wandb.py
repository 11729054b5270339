"""Layer 7: the service's W&B logger (``conf/logger/wandb.yaml``, ``app/loggers.py``).

The node instantiates as it stands (``offline: auto`` included); runs are named after the job's
overrides and grouped by launch; the job's config is logged once; a job resuming a checkpoint
continues the run stored next to it. Real ``wandb`` in offline mode, in this process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from _service import RENDEZVOUS_VARS
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig

from syncbn_lightning.app.loggers import WANDB_RUN_FILE, JobWandbLogger, setup_wandb

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """W&B offline and quiet, no login (``offline: auto`` must decide offline)."""
    for var in (*RENDEZVOUS_VARS, "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def _compose(tmp_path: Path, *overrides: str, hydra: bool = False) -> DictConfig:
    paths = [f"paths.output_dir={tmp_path / 'out'}", f"paths.data_dir={tmp_path / 'data'}"]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=[*paths, *overrides], return_hydra_config=hydra)


@contextlib.contextmanager
def _hydra_job(cfg: DictConfig) -> Iterator[None]:
    """``cfg``'s Hydra node as the running job's (what ``@hydra.main`` sets for each job)."""
    saved = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)
    try:
        yield
    finally:
        HydraConfig.instance().cfg = saved


@pytest.mark.slow
def test_node_instantiates_as_it_stands(tmp_path: Path) -> None:
    cfg = _compose(tmp_path)
    logger = instantiate(cfg.logger.wandb)
    assert isinstance(logger, JobWandbLogger)
    run = logger.experiment
    try:
        assert run.settings.mode in ("offline", "dryrun")
        # Outside a Hydra run (the compose API): the recipe names it, the output dir groups it.
        assert run.name == "detection_small_batch" == run.job_type
        assert run.group == f"detection_small_batch@{tmp_path / 'out'}"
        assert list(run.tags) == list(cfg.recipe.tags)
        assert Path(run.dir).is_relative_to(tmp_path / "out" / "wandb")
    finally:
        run.finish()


@pytest.mark.parametrize(
    ("mode", "group"), [("RUN", "outputs/day/run"), ("MULTIRUN", "multirun/day/sweep")]
)
def test_run_is_named_by_overrides_and_grouped_by_launch(
    tmp_path: Path, mode: str, group: str
) -> None:
    overrides = ["bn.group_size=2", "trainer.devices=4", f"hydra.mode={mode}"]
    dirs = ["hydra.run.dir=outputs/day/run", "hydra.sweep.dir=multirun/day/sweep"]
    cfg = _compose(tmp_path, *overrides, *dirs, hydra=True)
    with _hydra_job(cfg):
        assert cfg.logger.wandb.name == "bn.group_size=2,trainer.devices=4"  # paths.* excluded
        assert cfg.logger.wandb.group == f"detection_small_batch@{group}"


def test_config_is_logged_once(tmp_path: Path) -> None:
    """The job's resolved config, and not Lightning's flat copy of the module's arguments."""
    cfg = _compose(tmp_path, "model=classifier")
    logger = instantiate(cfg.logger.wandb)
    run = logger.experiment
    try:
        setup_wandb(SimpleNamespace(loggers=[logger]), cfg)  # type: ignore[arg-type]
        logger.log_hyperparams({"width": 16, "num_classes": 3})  # what Lightning does at fit
        assert run.config["model"]["width"] == 16 and run.config["bn"]["group_size"] is None
        assert "width" not in run.config and "num_classes" not in run.config
    finally:
        run.finish()


def test_resumed_job_continues_the_stored_run(tmp_path: Path) -> None:
    first = instantiate(_compose(tmp_path / "a").logger.wandb)
    ckpt_dir = tmp_path / "a" / "out" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    run = first.experiment
    first.after_save_checkpoint(ModelCheckpoint(dirpath=ckpt_dir))  # Lightning, after each save
    stored = (run.id, run.name, run.group)
    run.finish()
    assert (ckpt_dir / WANDB_RUN_FILE).is_file()
    (ckpt_dir / "last.ckpt").write_bytes(b"")

    resumed = _compose(tmp_path / "b", f"ckpt_path={ckpt_dir / 'last.ckpt'}")
    run = instantiate(resumed.logger.wandb).experiment
    try:
        assert (run.id, run.name, run.group) == stored
    finally:
        run.finish()
    assert len(list((tmp_path / "b" / "out" / "wandb").glob("offline-run-*"))) == 1


def test_resuming_a_checkpoint_without_a_stored_run_starts_a_new_one(tmp_path: Path) -> None:
    ckpt = tmp_path / "elsewhere" / "model.ckpt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"")
    run = instantiate(_compose(tmp_path, f"ckpt_path={ckpt}").logger.wandb).experiment
    try:
        assert run.name == "detection_small_batch"
    finally:
        run.finish()


def test_disabled_runs_store_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = instantiate(_compose(tmp_path).logger.wandb)
    logger.after_save_checkpoint(ModelCheckpoint(dirpath=tmp_path))
    assert logger.experiment.disabled and not (tmp_path / WANDB_RUN_FILE).exists()
    logger.experiment.finish()
