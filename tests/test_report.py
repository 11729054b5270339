"""The PNG report: the service's metrics history (``metrics.jsonl``, written by the real
:class:`MetricsHistory` logger, also under a real Trainer and a real ``train(cfg)`` job with
``logger=wandb`` alone) and metrics.csv files of Lightning's real CSVLogger, read and drawn."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _lightning import BNNet, quiet_trainer
from _service import wandb_transaction_log
from lightning.pytorch.loggers import CSVLogger
from PIL import Image

from syncbn_lightning import SyncBNCallback
from syncbn_lightning.app import report
from syncbn_lightning.app.loggers import MetricsHistory
from syncbn_lightning.app.report import (
    PANELS,
    Panel,
    find_metrics_files,
    main,
    panel_lines,
    panel_series,
    read_history,
    read_metrics,
    read_run,
    render,
)

REPO = Path(__file__).resolve().parents[1]
PANEL = {p.name: p for p in PANELS}
WITH_DATA = ["batch_size", "drift", "divergence", "map", "loss"]  # the panels _log_job feeds


def _log_job(job_dir: Path, offset: float = 0.0, version: int | None = None) -> Path:
    """One training job's metrics through CSVLogger: sparse bn/*, val/* and train/* columns.

    Steps 0..9: ``train/loss`` (and ``train/loss_cls``) every step, ``bn/*`` every other step
    (``bn/divergence_max`` is exactly 0, as with a world-wide sync group) and ``val/mAP`` at the
    end of each of two epochs. No ``bn/gap_*`` metric, so the ``gap`` panel has no data.
    """
    logger = CSVLogger(save_dir=job_dir, name="csv", version=version)
    for step in range(10):
        metrics = {"train/loss": 2.0 - 0.1 * step + offset, "train/loss_cls": 1.0 + offset}
        if step % 2 == 0:
            metrics |= {
                "bn/global_batch_size": 64.0,
                "bn/norm_batch_size": 32.0,
                "bn/drift_mean_max": 0.5 / (step + 1),
                "bn/divergence_max": 0.0,
            }
        logger.log_metrics(metrics, step=step)
        if step in (4, 9):
            logger.log_metrics({"val/mAP": 0.1 * step + offset, "epoch": step // 5}, step=step)
    logger.save()
    logger.finalize("success")
    return Path(logger.log_dir) / "metrics.csv"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A single job's output directory with one metrics.csv below it."""
    root = tmp_path_factory.mktemp("job")
    _log_job(root)
    return root


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hydra multirun sweep directory with jobs 0/ and 1/."""
    root = tmp_path_factory.mktemp("sweep")
    (root / "multirun.yaml").write_text("hydra: {}\n")
    for i in range(2):
        _log_job(root / str(i), offset=float(i))
    return root


def _assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert img.width > 100 and img.height > 100
        img.verify()


def test_read_metrics_sparse_columns(job: Path) -> None:
    (path,) = find_metrics_files(job)
    series = read_metrics(path)
    assert "step" not in series and "epoch" not in series
    assert set(series) == {
        "train/loss",
        "train/loss_cls",
        "bn/global_batch_size",
        "bn/norm_batch_size",
        "bn/drift_mean_max",
        "bn/divergence_max",
        "val/mAP",
    }
    assert [s for s, _ in series["train/loss"]] == list(range(10))
    for (s, v), expected in zip(series["train/loss"], range(10), strict=True):
        assert s == expected and v == pytest.approx(2.0 - 0.1 * expected)
    assert series["bn/global_batch_size"] == [(s, 64.0) for s in range(0, 10, 2)]
    assert series["bn/divergence_max"] == [(s, 0.0) for s in range(0, 10, 2)]
    assert [s for s, _ in series["val/mAP"]] == [4, 9]
    assert [v for _, v in series["val/mAP"]] == pytest.approx([0.4, 0.9])


def test_read_metrics_sorts_and_skips_bad_cells(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,lr,step,note\n0,0.3,5,x\n,,2,\n0,0.1,1,y\n0,0.2,,\n0,nan,7,\n")
    series = read_metrics(path)
    assert set(series) == {"lr"}  # 'note' never parses; the row without a step is skipped
    assert series["lr"][:2] == [(1, 0.1), (5, 0.3)]
    assert series["lr"][2][0] == 7 and math.isnan(series["lr"][2][1])
    assert "'note'" in caplog.text

    (tmp_path / "empty.csv").write_text("")
    assert read_metrics(tmp_path / "empty.csv") == {}

    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="no 'step' column"):
        read_metrics(tmp_path / "other.csv")


def test_find_metrics_files_natural_order(tmp_path: Path) -> None:
    for job in ("10", "2", "0"):
        d = tmp_path / job / "csv" / "version_0"
        d.mkdir(parents=True)
        (d / "metrics.csv").write_text("step\n")
    (tmp_path / "2" / "hparams.yaml").write_text("{}\n")
    found = find_metrics_files(tmp_path)
    assert [p.relative_to(tmp_path).parts[0] for p in found] == ["0", "2", "10"]
    assert find_metrics_files(tmp_path / "missing") == []


def test_panel_definitions_and_globs() -> None:
    assert [p.name for p in PANELS] == [
        "batch_size",
        "samples_seen",
        "drift",
        "divergence",
        "nonfinite",
        "gap",
        "map",
        "loss",
    ]
    assert PANEL["drift"].log_y and PANEL["gap"].log_y and not PANEL["map"].log_y
    assert PANEL["divergence"].log_y and PANEL["batch_size"].from_zero
    metrics = {
        "train/loss_cls": [(0, 2.0)],
        "train/loss": [(0, 1.0)],
        "trainer/x": [(0, 9.0)],
        "val/acc": [(0, 0.7)],
        "val/mAP": [(0, 0.5)],
        "val/mAP50": [],
    }
    loss = panel_series(PANEL["loss"], metrics)
    assert list(loss) == ["train/loss", "train/loss_cls"]
    assert list(panel_series(PANEL["map"], metrics)) == ["val/mAP", "val/acc"]  # panel order
    assert panel_series(PANEL["gap"], metrics) == {}
    with pytest.raises(TypeError, match="metrics must be a tuple"):
        Panel("lr", "Learning rate", "lr")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="file name"):
        Panel("a/b", "t", ("lr",))
    with pytest.raises(ValueError, match="kind='bar'"):
        Panel("lr", "t", ("lr",), kind="bar")
    with pytest.raises(ValueError, match="one W&B table"):
        Panel("t", "t", ("a", "b"), kind="table")


def test_render_writes_pngs_only_for_panels_with_data(job: Path) -> None:
    paths = render(job)
    assert [p.name for p in paths] == [f"{n}.png" for n in WITH_DATA]
    assert all(p.parent == job / "report" for p in paths)
    for p in paths:
        _assert_png(p)
    assert not (job / "report" / "gap.png").exists()


def test_log_panel_keeps_zeros_with_symlog() -> None:
    assert report._y_scale([0.1, 1.0]) == ("log", {})
    assert report._y_scale([0.0, 1e-3, 0.5]) == ("symlog", {"linthresh": 1e-3})
    assert report._y_scale([0.0, 0.0]) == ("linear", {})
    runs = {"": {"bn/divergence_avg": [(0, 0.5)], "bn/divergence_max": [(0, 0.0)]}}
    fig = report._figure(PANEL["divergence"], report._lines(PANEL["divergence"], runs))
    (ax,) = fig.axes
    assert ax.get_yscale() == "symlog"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "bn/divergence_max",
        "bn/divergence_avg",
    ]


def test_sweep_labels_lines_per_job(sweep: Path, tmp_path: Path) -> None:
    runs = read_run(sweep)
    assert list(runs) == ["0", "1"]
    lines = panel_lines(PANEL["map"], runs)
    assert list(lines) == ["0: val/mAP", "1: val/mAP"]
    assert [v for _, v in lines["1: val/mAP"]] == pytest.approx([1.4, 1.9])

    fig = report._figure(PANEL["loss"], report._lines(PANEL["loss"], runs))
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["0: train/loss", "0: train/loss_cls", "1: train/loss", "1: train/loss_cls"]
    colors = [line.get_color() for line in fig.axes[0].lines]
    assert colors[0] == colors[1] != colors[2] == colors[3]  # one colour per job

    paths = render(sweep, tmp_path / "out")
    assert [p.name for p in paths] == [f"{n}.png" for n in WITH_DATA]
    for p in paths:
        _assert_png(p)


def test_sweep_jobs_are_labelled_by_the_overrides_that_differ(tmp_path: Path) -> None:
    for i, size in enumerate((1, 2)):
        _log_job(tmp_path / str(i), offset=float(i))
        (tmp_path / str(i) / ".hydra").mkdir()
        (tmp_path / str(i) / ".hydra" / "overrides.yaml").write_text(
            f"- trainer.devices=2\n- bn.group_size={size}\n"
        )
    runs = read_run(tmp_path)
    assert list(runs) == ["bn.group_size=1", "bn.group_size=2"]
    lines = panel_lines(PANEL["map"], runs)
    assert list(lines) == ["bn.group_size=1: val/mAP", "bn.group_size=2: val/mAP"]


def test_sizes_start_at_zero_and_equal_lines_stay_distinct(tmp_path: Path) -> None:
    runs = {"": {"bn/global_batch_size": [(1, 4.0), (2, 4.0)], "bn/norm_batch_size": [(1, 4.0)]}}
    fig = report._figure(PANEL["batch_size"], report._lines(PANEL["batch_size"], runs))
    (ax,) = fig.axes
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] > 4.0
    assert [line.get_linestyle() for line in ax.lines] == ["-", "--"]
    assert "running stds" in report._figure(PANEL["drift"], []).axes[0].get_ylabel()


def test_job_labels_stay_unique_for_versions(tmp_path: Path) -> None:
    _log_job(tmp_path / "0", version=0)
    _log_job(tmp_path / "0", version=1)
    assert list(read_run(tmp_path)) == ["0/csv/version_0", "0/csv/version_1"]


def test_missing_or_empty_run_dir_names_run_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"RUN_DIR .* does not exist"):
        render(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"holds no metrics\.jsonl or metrics\.csv"):
        render(tmp_path)


def test_cli_prints_written_paths(job: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "figs"
    assert main([str(job), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / f"{n}.png") for n in WITH_DATA]
    for p in printed:
        _assert_png(Path(p))


@pytest.mark.slow
def test_cli_entry_point_missing_dir(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_run"
    proc = subprocess.run(
        [sys.executable, "-m", "syncbn_lightning.app.report", str(missing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: RUN_DIR")
    assert str(missing) in lines[0]


@pytest.mark.slow
def test_import_is_cheap() -> None:
    code = (
        "import sys, syncbn_lightning.app.report\n"
        "heavy = {'matplotlib', 'lightning', 'pytorch_lightning', 'hydra'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------- metrics history


def test_history_of_a_real_trainer_equals_its_csv_and_is_drawn(tmp_path: Path) -> None:
    """The history holds what Lightning logged, at the same steps as the CSVLogger's rows."""
    csv_logger = CSVLogger(str(tmp_path / "csv_only"), name="csv")
    history = MetricsHistory(tmp_path / "job")
    cb = SyncBNCallback(single_process="monitor", impl="ref")
    quiet_trainer(
        callbacks=[cb],
        logger=[csv_logger, history],
        default_root_dir=str(tmp_path),
        max_epochs=2,
        limit_val_batches=2,
        log_every_n_steps=2,
    ).fit(BNNet(batch_size=4, n=16))
    csv_series = read_metrics(find_metrics_files(tmp_path / "csv_only")[0])
    series = read_history(history.path)
    assert series == csv_series
    assert [s for s, _ in series["bn/global_batch_size"]] == [1, 3, 5, 7]
    assert series["bn/samples_seen"][-1] == (7, 32.0)
    assert "val_loss" in series and "epoch" not in series
    lines = history.path.read_text().splitlines()
    assert all(json.loads(line)["step"] >= 0 for line in lines)

    paths = render(tmp_path / "job")  # only the history below it
    names = ["batch_size", "samples_seen", "drift", "divergence", "nonfinite", "gap"]
    assert [p.name for p in paths] == [f"{n}.png" for n in names]
    for path in paths:
        _assert_png(path)


def test_history_is_read_before_csv_and_keeps_non_finite_values(tmp_path: Path) -> None:
    history = MetricsHistory(tmp_path)
    history.log_metrics({"bn/drift_mean_max": float("nan"), "epoch": 0.0}, step=2)
    history.log_metrics({"bn/drift_mean_max": float("inf"), "train/loss": 1.5}, step=1)
    history.log_metrics({"bn/drift_mean_max": 0.25}, step=3)
    with history.path.open("a") as f:
        f.write('{"step": 4, "note": "text"}\n{"step": 5, "bn/drift_mea')  # a job killed mid-line
    _log_job(tmp_path)  # a CSVLogger metrics.csv beside it
    series = read_history(history.path)
    drift = series["bn/drift_mean_max"]
    assert [s for s, _ in drift] == [1, 2, 3]
    assert drift[0][1] == math.inf and math.isnan(drift[1][1]) and drift[2][1] == 0.25
    assert "note" not in series and series["train/loss"] == [(1, 1.5)]
    runs = read_run(tmp_path)  # metrics.jsonl wins over metrics.csv beside it
    assert list(runs) == [""] and set(runs[""]) == {"bn/drift_mean_max", "train/loss"}
    assert [p.name for p in render(tmp_path)] == ["drift.png", "loss.png"]


@pytest.mark.slow
def test_wandb_only_job_writes_the_history_the_report_draws(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train(cfg)`` with ``logger=wandb`` alone (no CSV): the report and the W&B charts."""
    from hydra import compose, initialize_config_dir

    import syncbn_lightning.app.train as app

    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")
    for var in ("WANDB_API_KEY", *rendezvous):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    overrides = [
        f"paths.output_dir={out}",
        f"paths.data_dir={tmp_path / 'data'}",
        "logger=wandb",
        "data.synthetic.num_train=16",
        "data.synthetic.num_val=8",
        "data.synthetic.progress=false",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "bn.implementation=ref",
        "launch.timeout_s=60",
    ]
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    metrics = app.train(cfg)
    assert not list(out.rglob("metrics.csv"))
    series = read_history(out / "metrics.jsonl")
    assert series["bn/norm_batch_size"][-1][1] == metrics["bn/norm_batch_size"]
    assert "val/mAP" in series and "train/loss" in series
    steps = [s for s, _ in series["train/loss"]]
    assert cfg.trainer.devices == 2 and steps == sorted(set(steps))  # one writer: global rank 0
    # The job wrote its report (report: true), each figure with its reading.
    figures = sorted((out / "report").glob("*.png"))
    assert {"batch_size", "drift", "gap", "map", "loss"} <= {p.stem for p in figures}
    for figure in figures:
        with Image.open(figure) as image:
            assert image.text.get("Description"), figure.name
    norm = round(metrics["bn/norm_batch_size"])
    with Image.open(out / "report" / "batch_size.png") as image:
        assert image.text["Description"].startswith(f"norm batch {norm} ")
    written = [p.stem for p in render(out)]
    assert {"batch_size", "drift", "gap", "map", "loss"} <= set(written)
    (run_dir,) = out.glob("wandb/offline-run-*")
    assert b"charts/batch_size" in wandb_transaction_log(run_dir)
