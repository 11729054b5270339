"""Layer 7: the service's W&B logger (``conf/logger/wandb.yaml``, ``app/loggers.py``).

The node instantiates as it stands (``offline: auto`` included); runs are named after the job's
overrides and grouped by launch; the job's config is logged once; a job resuming a checkpoint
continues the run stored next to it; ``offline=false`` without W&B credentials stops the job
before anything starts, in one line; the run's charts come from the metrics history, with or
without a CSV logger. Real ``wandb`` in offline mode, in this process (``train.py`` as a
subprocess for the command line).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from _service import RENDEZVOUS_VARS, wandb_transaction_log
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig

import syncbn_lightning.app.config  # noqa: F401  (the config's resolvers: syncbn.global_batch)
from syncbn_lightning.app.loggers import (
    HISTORY_FILE,
    WANDB_RUN_FILE,
    JobWandbLogger,
    MetricsHistory,
    build_loggers,
    check_wandb,
    finish_wandb,
    metrics_history,
    setup_wandb,
)
from syncbn_lightning.app.wandb_auth import has_wandb_credentials

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """W&B offline and quiet, no login (``offline: auto`` must decide offline)."""
    for var in (*RENDEZVOUS_VARS, "WANDB_API_KEY", "WANDB_BASE_URL", "NETRC"):
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


# ----------------------------------------------------------------------------- online without a key

_FAKE_KEY = "0123456789abcdef" * 2 + "01234567"  # 40 characters, the shape of a W&B API key


def test_online_without_a_key_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(ValueError, match=r"^offline=false: .*`wandb login`.*offline=auto") as e:
        check_wandb(False, False)
    assert "\n" not in str(e.value)
    assert check_wandb("auto", False) is True  # auto: offline without credentials
    monkeypatch.setenv("WANDB_MODE", "offline")  # wandb.init goes offline: no key needed
    assert check_wandb(False, False) is False
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert check_wandb(False, False) is False


@pytest.mark.parametrize("source", ["env", "netrc"])
def test_a_key_or_a_login_allows_online(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: str
) -> None:
    monkeypatch.delenv("WANDB_MODE")
    if source == "env":
        monkeypatch.setenv("WANDB_API_KEY", _FAKE_KEY)
    else:  # what `wandb login` writes
        home = tmp_path / "home"
        home.mkdir(exist_ok=True)
        netrc = f"machine api.wandb.ai\n  login user\n  password {_FAKE_KEY}\n"
        (home / ".netrc").write_text(netrc)
        (home / ".netrc").chmod(0o600)
    assert has_wandb_credentials()
    assert check_wandb(False, False) is False
    assert check_wandb("auto", False) is False  # auto: online with credentials


def test_online_without_a_key_stops_before_any_rank_starts(tmp_path: Path) -> None:
    """``python train.py`` as users run it: one line on stderr, exit code 2, nothing started."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    env.update(HOME=str(tmp_path / "home"), WANDB_SILENT="true")
    for var in RENDEZVOUS_VARS:
        env.pop(var, None)
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "logger=wandb",
            "logger.wandb.offline=false",
            "trainer.devices=2",
            f"paths.output_dir={out}",
            f"paths.data_dir={tmp_path / 'data'}",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: logger.wandb.offline=false: ")
    assert "`wandb login`" in lines[0] and "WANDB_API_KEY" in lines[0]
    # Validation runs before the data is generated, the ranks are launched or W&B starts.
    assert not (tmp_path / "data").exists()
    assert not (out / ".syncbn").exists() and not (out / "wandb").exists()


# ----------------------------------------------------------------------------- charts from history


def test_wandb_alone_gets_the_charts_from_the_metrics_history(tmp_path: Path) -> None:
    """``logger=wandb`` without CSV: the run's charts come from ``metrics.jsonl``."""
    cfg = _compose(tmp_path, "logger=wandb")
    loggers = build_loggers(cfg)
    assert [type(lg) for lg in loggers] == [JobWandbLogger, MetricsHistory]
    wandb_logger, history = loggers
    for step in range(4):
        history.log_metrics({"train/loss": 1.0 / (step + 1), "epoch": 0.0}, step=step)
        history.log_metrics({"bn/norm_batch_size": 8.0, "bn/global_batch_size": 16.0}, step=step)
    trainer = SimpleNamespace(loggers=loggers)
    path = metrics_history(trainer)  # type: ignore[arg-type]
    assert path == tmp_path / "out" / HISTORY_FILE
    run_dir = Path(wandb_logger.experiment.dir).parent
    (dirs,) = finish_wandb(trainer, {"val/mAP": 0.25}, path)  # type: ignore[arg-type]
    assert Path(dirs) == run_dir
    blob = wandb_transaction_log(run_dir)  # what finish() logged, all of it on disk
    assert b"charts/batch_size" in blob and b"charts/loss" in blob
    assert b"charts/gap" not in blob  # a panel without data is not logged
    assert b"final/val/mAP" in blob
