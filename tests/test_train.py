"""Layer 7: the Hydra service (``train.py`` + ``conf/``).

Every config in ``conf/`` is composed and validated; ``train(cfg)`` runs end to end on tiny
generated data with real DDP processes (our launcher, gloo), real Lightning, CSV and offline W&B
loggers; the command line is run as users run it (subprocesses) for config errors, a Hydra
multirun of three group sizes and a two-node simulation on loopback.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _service import RENDEZVOUS_VARS, TINY
from _service import tiny_cfg as _cfg
from hydra.utils import instantiate
from omegaconf import OmegaConf

import syncbn_lightning.app.config.checks as app_config
import syncbn_lightning.app.train as app
from syncbn_lightning.app.launch import free_port
from syncbn_lightning.app.tasks.shapes import generate_shapes

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Earlier tests in this process (Lightning's ddp_spawn) leave rendezvous variables behind."""
    for var in RENDEZVOUS_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


def _metrics_csv(out: Path) -> list[dict[str, str]]:
    """Rows of every CSV metrics file of a job (one per fit: a resume adds a version)."""
    rows: list[dict[str, str]] = []
    for path in sorted((out / "csv").glob("version_*/metrics.csv")):
        with open(path) as f:
            rows += list(csv.DictReader(f))
    assert rows, f"no metrics under {out / 'csv'}"
    return rows


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key)]


def _run_cli(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 300):
    env = {**os.environ, "WANDB_SILENT": "true", **(env or {})}
    env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ----------------------------------------------------------------------------- composition


def _options() -> list[tuple[str, str]]:
    return sorted(
        (p.parent.name, p.stem) for p in CONF.glob("*/*.yaml") if p.parent.name != "hydra"
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["bn=sync"], "SyncBNCallback"),
        (["bn=local"], "SyncBNCallback"),
        (["bn.sync=false"], "NoneType"),
        (["model=centernet"], "CenterNet"),
        (["model=classifier"], "ShapeClassifier"),
        (["data=shapes"], "CocoDataModule"),
        (["data=shapes_hard"], "CocoDataModule"),
    ],
)
def test_target_nodes_instantiate_as_they_stand(
    overrides: list[str], expected: str, tmp_path: Path, data_dir: Path
) -> None:
    """``hydra.utils.instantiate`` of the bn, model and data nodes, nothing removed first."""
    cfg = _cfg(tmp_path, data_dir, *overrides)
    group = overrides[0].split("=")[0].split(".")[0]
    built = instantiate(cfg[group], _convert_="all")
    assert type(built).__name__ == expected
    if group == "bn" and built is not None:
        assert built.impl == "auto" and built.group_size == cfg.bn.group_size
    if group == "model":
        assert built.monitor == cfg.model.monitor
    if group == "data":
        assert built.hparams.global_batch_size == cfg.data.global_batch_size == 4


@pytest.mark.parametrize(
    ("overrides", "node", "expected"),
    [
        (["trainer=cpu"], "trainer", {"": "Trainer"}),
        (["callbacks=default"], "callbacks", {"model_checkpoint": "ModelCheckpoint"}),
        (["logger=csv"], "logger", {"csv": "CSVLogger"}),
        (["logger=wandb_csv"], "logger", {"csv": "CSVLogger", "wandb": "WandbLogger"}),
    ],
)
def test_other_nodes_instantiate_as_they_stand(
    overrides: list[str],
    node: str,
    expected: dict[str, str],
    tmp_path: Path,
    data_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer, callbacks and logger nodes: ``hydra.utils.instantiate`` as they stand."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = _cfg(tmp_path, data_dir, *overrides)
    built = instantiate(cfg[node], _convert_="all")
    objects = {"": built} if node == "trainer" else dict(built)
    for key, name in expected.items():  # the class or a subclass of it
        assert name in {c.__name__ for c in type(objects[key]).__mro__}, (key, objects[key])


def test_every_group_option_is_found() -> None:
    groups = {g for g, _ in _options()}
    assert groups == {"bn", "trainer", "model", "data", "logger", "callbacks", "recipe"}


@pytest.mark.parametrize(("group", "option"), _options(), ids=lambda x: str(x))
def test_every_config_composes_and_validates(
    tmp_path: Path, data_dir: Path, group: str, option: str
) -> None:
    extra = []
    if group == "data" and option == "coco":
        root = generate_shapes(data_dir / "coco-like", num_train=4, num_val=2, progress=False)
        extra = [f"data.root={root}", "data.num_classes=3", "data.image_size=64"]
        extra += ["data.train_split=train", "data.val_split=val"]
    cfg = _cfg(tmp_path, data_dir, f"{group}={option}", *extra)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # every interpolation
    if option == "detection_frozen":  # frozen statistics need pretrained ones
        with pytest.raises(app.ConfigError, match=r"^model.norm=frozen_bn .* model.init_backbone="):
            app.validate(cfg)
        with pytest.raises(app.ConfigError, match=r"^model.init_backbone=/nowhere: no such"):
            app.validate(
                _cfg(tmp_path, data_dir, f"{group}={option}", "model.init_backbone=/nowhere")
            )
        (tmp_path / "pre.ckpt").write_bytes(b"")
        cfg = _cfg(
            tmp_path, data_dir, f"{group}={option}", f"model.init_backbone={tmp_path / 'pre.ckpt'}"
        )
    if group == "trainer" and option == "gpu" and not torch.cuda.is_available():
        with pytest.raises(app.ConfigError, match=r"^trainer.accelerator=gpu .* 0 CUDA GPU"):
            app.validate(cfg)
        return
    app.validate(cfg)
    assert cfg.data.global_batch_size == (
        cfg.data.batch_size * cfg.trainer.devices * cfg.trainer.num_nodes
    )


def test_recipes_set_what_they_promise(tmp_path: Path, data_dir: Path) -> None:
    small = _cfg(tmp_path, data_dir)
    assert (small.recipe.name, small.data.batch_size, small.bn.group_size) == (
        "detection_small_batch",
        2,
        None,
    )
    assert small.bn.precise_bn_batches > 0 and small.trainer.devices >= 2
    local = _cfg(tmp_path, data_dir, "recipe=detection_local_bn")
    assert local.bn.group_size == 1 and local.data.batch_size == 2
    group2 = _cfg(tmp_path, data_dir, "recipe=detection_group2")
    assert (group2.trainer.devices, group2.bn.group_size, group2.data.global_batch_size) == (
        4,
        2,
        8,
    )
    large = _cfg(tmp_path, data_dir, "recipe=detection_large_batch")
    assert (
        large.trainer.devices == 1 and large.data.global_batch_size == small.data.global_batch_size
    )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["trainer.devices=4", "bn.group_size=3"], r"^bn.group_size=3: .*does not divide"),
        (["bn.momentum=2"], r"^bn.momentum=2"),
        (["bn.eps=-1"], r"^bn.eps=-1"),
        (["bn.group_size=banana"], r"^bn.group_size='banana'"),
        (["bn.implementation=cuda"], r"^bn.implementation='cuda'"),
        (["trainer.devices=0"], r"^trainer.devices=0"),
        (["trainer.strategy=fsdp"], r"^trainer.strategy='fsdp'"),
        (["data.batch_size=0"], r"data.batch_size"),
        (["data=coco"], r"^data.root is required"),
        (["data=coco", "data.root=/nonexistent/coco"], r"^data.root=/nonexistent/coco: .*missing"),
        (["ckpt_path=/nonexistent.ckpt"], r"^ckpt_path="),
        (["trainer.num_nodes=2"], r"^trainer.num_nodes=2 needs torchrun/SLURM, or MASTER_ADDR"),
        (["model.optim.name=lamb"], r"model.optim.name"),
    ],
)
def test_bad_configs_raise_one_line_naming_the_key(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, overrides, match
) -> None:
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = _cfg(tmp_path, data_dir, *overrides)
    with pytest.raises(app.ConfigError, match=match) as info:
        app.validate(cfg)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()  # nothing written before the config is known good


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.devices=4", "bn.group_size=3"],
        ["bn.momentum=2"],
        ["data=coco", "data.root=/nonexistent/coco"],
    ],
    ids=["group_size", "momentum", "data_root"],
)
@pytest.mark.slow
def test_cli_rejects_bad_configs_fast_with_one_line(tmp_path: Path, overrides: list[str]) -> None:
    start = time.monotonic()
    proc = _run_cli(*overrides, f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert elapsed < 60  # seconds of imports, no training, no waiting on processes
    assert not (tmp_path / "run" / ".syncbn").exists()  # no rank was ever started


# ----------------------------------------------------------------------------- end to end


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_train_end_to_end_then_resume(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, data_dir)
    metrics = app.train(cfg)
    out = tmp_path / "out"
    assert 0.0 <= metrics["val/mAP"] <= metrics["val/mAP50"] <= 1.0
    assert metrics["bn/norm_batch_size"] == 4 and metrics["bn/global_batch_size"] == 4
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert (out / ".syncbn" / "rank1.log").is_file()
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    rows = _metrics_csv(out)
    assert _column(rows, "bn/global_batch_size")[0] == 4
    assert _column(rows, "val/mAP")
    saved = OmegaConf.load(out / ".syncbn" / "config.yaml")  # what rank 1 trained with
    assert saved.data.root == cfg.data.root and saved.bn.group_size is None
    assert "LOCAL_RANK" not in os.environ  # the job's environment did not leak

    first = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    resumed = _cfg(
        tmp_path, data_dir, f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}", "trainer.max_epochs=2"
    )
    app.train(resumed)
    epochs = {int(float(r["epoch"])) for r in _metrics_csv(out) if r.get("train/loss")}
    assert 1 in epochs  # the second epoch ran after the restored first one
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 2 * first["global_step"] > 0  # one restored epoch + one more


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_devices_groups_of_two_report_the_batch_sizes(tmp_path: Path, data_dir: Path) -> None:
    cfg = _cfg(tmp_path, data_dir, "trainer.devices=4", "bn.group_size=2", "logger=csv")
    metrics = app.train(cfg)
    per_device = cfg.data.batch_size
    assert metrics["bn/norm_batch_size"] == 2 * per_device
    assert metrics["bn/global_batch_size"] == 4 * per_device
    rows = _metrics_csv(tmp_path / "out")
    assert set(_column(rows, "bn/norm_batch_size")) == {2 * per_device}
    assert set(_column(rows, "bn/global_batch_size")) == {4 * per_device}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("overrides", "expect"),
    [
        (["model=classifier", "logger=none"], "val/acc"),
        (["recipe=detection_local_bn", "logger=csv"], "val/mAP"),
        (["recipe=detection_large_batch", "logger=csv"], "val/mAP"),
        (["bn=local", "bn.sync=false", "logger=csv"], "val/mAP"),
    ],
    ids=["classifier", "local_bn", "large_batch", "no_callback"],
)
def test_other_configs_train_end_to_end(
    tmp_path: Path, data_dir: Path, overrides: list[str], expect: str
) -> None:
    cfg = _cfg(tmp_path, data_dir, *overrides)
    metrics = app.train(cfg)
    assert 0.0 <= metrics[expect] <= 1.0
    if cfg.bn.sync:
        world = cfg.trainer.devices
        assert metrics["bn/global_batch_size"] == cfg.data.batch_size * world
    else:
        assert not any(k.startswith("bn/") for k in metrics)


# ----------------------------------------------------------------------------- command line


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_multirun_of_three_group_sizes(tmp_path: Path, data_dir: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = _run_cli(
        "-m",
        "bn.group_size=1,2,4",
        "trainer.devices=4",
        *TINY,
        f"paths.data_dir={data_dir}",
        f"hydra.sweep.dir={sweep}",
        timeout=560,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [j.name for j in jobs] == ["0", "1", "2"]
    for job, size in zip(jobs, (1, 2, 4), strict=True):
        assert OmegaConf.load(job / ".hydra" / "config.yaml").bn.group_size == size
        assert OmegaConf.load(job / ".syncbn" / "config.yaml").bn.group_size == size
        assert len(list((job / "wandb").glob("offline-run-*"))) == 1
        assert set(_column(_metrics_csv(job), "bn/norm_batch_size")) == {2 * size}
    # Exactly three jobs ran: no child restarted the sweep (Lightning's launcher would).
    assert not any(sweep.glob("*/*/.hydra")) and not (ROOT / "multirun").exists()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_of_two_processes_on_loopback(tmp_path: Path, data_dir: Path) -> None:
    generate_shapes(data_dir / "shapes-16-64px-seed0", num_train=16, num_val=8, progress=False)
    port = str(free_port())
    procs = []
    for node in (0, 1):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node)}
        args = [
            "trainer.num_nodes=2",
            "trainer.devices=2",
            "bn.group_size=node",
            "logger=csv",
            *TINY,
            f"paths.data_dir={data_dir}",
            f"hydra.run.dir={tmp_path / f'node{node}'}",
        ]
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "train.py"), *args],
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=280)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    rows = _metrics_csv(tmp_path / "node0")  # global rank 0 logs
    assert set(_column(rows, "bn/norm_batch_size")) == {4}  # 2 ranks x 2 images per node
    assert set(_column(rows, "bn/global_batch_size")) == {8}  # 4 ranks x 2 images
    assert (tmp_path / "node1" / ".syncbn" / "rank3.log").is_file()


def test_global_batch_resolver_rejects_non_integers(tmp_path: Path, data_dir: Path) -> None:
    cfg = _cfg(tmp_path, data_dir, "trainer.devices=auto")
    with pytest.raises(app.ConfigError, match=r"^trainer.devices='auto'"):
        app.validate(cfg)
    assert json.dumps(app_config.global_batch(2, 4, 1, 1)) == "8"
