"""Layer 7: the one-line reading of each report figure (``app/readings.py``, ``app/report.py``).

Two runs' metrics histories, written by the service's own writer (``MetricsHistory``), one with
a small normalization batch (2 ranks x 2 images, groups of one rank) and one with a large one (a
world-wide group of 64): every figure of the PNG report carries the reading its numbers call for,
under the title and in the PNG's ``Description``, which is what is read back here. The expected
sentences are written out from the numbers below and the thresholds of ``docs/dashboards.md``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from syncbn_lightning.app import readings
from syncbn_lightning.app.loggers import MetricsHistory
from syncbn_lightning.app.report import PANELS, render

ROOT = Path(__file__).resolve().parents[1]


def _write_history(job: Path, rows: list[dict[str, float]]) -> None:
    """``rows[i]`` logged at step ``10 * (i + 1)`` through the service's metrics history."""
    history = MetricsHistory(job)
    for i, row in enumerate(rows):
        history.log_metrics(row, step=10 * (i + 1))
    history.finalize("success")


def _run(
    norm: float, total: float, gap: list[float], divergence: list[float], drift: list[float]
) -> list[dict[str, float]]:
    """Eight measurements: batch sizes, samples, drift, divergence, gap, skips, loss, val/acc
    (at measurements 4 and 8)."""
    rows = []
    for i in range(8):
        row = {
            "bn/norm_batch_size": norm,
            "bn/global_batch_size": total,
            "bn/samples_seen": total * 10 * (i + 1),
            "bn/drift_mean_avg": drift[i],
            "bn/drift_mean_max": 2 * drift[i],
            "bn/divergence_max": divergence[i],
            "bn/divergence_avg": divergence[i] / 2,
            "bn/gap_mean_max": gap[i],
            "bn/gap_mean_avg": gap[i] / 3,
            "bn/nonfinite_skipped": 0.0,
            "train/loss": 2.0 - 0.1 * i,
        }
        rows.append(row)
    rows[3]["val/acc"] = 0.45
    rows[7]["val/acc"] = 0.41
    return rows


SMALL = _run(
    norm=2,
    total=4,
    gap=[0.43, 0.31, 1.01, 0.2, 0.42, 0.97, 0.51, 0.38],  # median of the last half: 0.465
    divergence=[0.08, 0.07, 0.09, 0.1, 0.15, 0.1, 0.07, 0.13],  # last half's median: 0.115
    drift=[0.08, 0.06, 0.05, 0.05, 0.04, 0.06, 0.05, 0.07],  # 0.055 / 0.07 = 79 %
)
LARGE = _run(
    norm=64,
    total=64,
    gap=[0.2, 0.1, 0.08, 0.05, 0.04, 0.06, 0.05, 0.03],  # median of the last half: 0.045
    divergence=[0.0] * 8,
    drift=[0.1, 0.1, 0.05, 0.03, 0.02, 0.01, 0.01, 0.01],  # 0.01 / 0.1 = 10 %
)
LARGE[7]["val/acc"] = 0.9  # the best at the end
LARGE[7]["bn/nonfinite_skipped"] = 3.0

EXPECTED = {
    "small": {
        "batch_size": "norm batch 2 of 4 (global batch) < 16: statistics noisy; sync every rank "
        "(group_size=None) and raise the batch per device or the number of devices: the global "
        "batch 4 is below 16",
        "samples_seen": "320 samples trained on in 80 steps (4 per step)",
        "drift": "bn/drift_mean_avg fell to 79% of its start: still settling, train longer",
        "divergence": "bn/divergence_max 0.115 >= 0.05: the sync groups disagree; reconcile "
        "(bn.reconcile) or sync larger groups",
        "nonfinite": "no running-stat update skipped: batch statistics finite throughout",
        "gap": "bn/gap_mean_max 0.465 >= 0.3: evaluation statistics off; raise the norm batch or "
        "use PreciseBN (bn.precise_bn_batches)",
        "map": "val/acc 0.41 at the end, best 0.45 at step 40 (2 validations)",
        "loss": "train/loss 2 -> 1.3 (65% of its start)",
    },
    "large": {
        "batch_size": "norm batch 64 >= 32: statistics reliable",
        "samples_seen": "5,120 samples trained on in 80 steps (64 per step)",
        "drift": "bn/drift_mean_avg fell to 10% of its start: running statistics settled",
        "divergence": "bn/divergence_max 0: every rank holds the same running statistics",
        "nonfinite": "3 running-stat updates skipped for NaN/inf: check the data and learning rate",
        "gap": "bn/gap_mean_max 0.045 < 0.1: evaluation normalizes as training did",
        "map": "val/acc 0.9 at the end (2 validations)",
        "loss": "train/loss 2 -> 1.3 (65% of its start)",
    },
}


@pytest.mark.parametrize(("run", "rows"), [("small", SMALL), ("large", LARGE)])
def test_every_figure_states_its_reading(tmp_path: Path, run: str, rows: list) -> None:
    _write_history(tmp_path, rows)
    written = render(tmp_path)
    assert {p.stem for p in written} == {p.name for p in PANELS} == set(EXPECTED[run])
    for path in written:
        with Image.open(path) as image:
            assert image.text["Description"] == EXPECTED[run][path.stem], path.stem


def test_the_norm_batch_bands_come_from_the_runs_target() -> None:
    """Below the target noisy, from it enough, from twice it reliable: the default target (16)
    for runs that did not log theirs, else the run's own ``bn/target_norm_batch``."""

    def batch(norm: float, target: float | None = None, total: float | None = None) -> str:
        metrics = {"bn/norm_batch_size": [(1, norm)]}
        if target is not None:
            metrics["bn/target_norm_batch"] = [(1, target)]
        if total is not None:
            metrics["bn/global_batch_size"] = [(1, total)]
        reading = readings.reading("batch_size", metrics)
        assert reading is not None
        return reading

    assert batch(15) == (
        "norm batch 15 < 16: statistics noisy; raise the batch per device or the number of devices"
    )
    assert batch(16) == "norm batch 16 >= 16: statistics enough (32+ reliable)"
    assert batch(32) == "norm batch 32 >= 32: statistics reliable"
    assert batch(4, total=64) == (
        "norm batch 4 of 64 (global batch) < 16: statistics noisy; sync more ranks: "
        "group_size='auto' syncs the smallest group reaching 16"
    )
    assert batch(8, target=8) == "norm batch 8 >= 8: statistics enough (16+ reliable)"
    assert batch(16, target=8) == "norm batch 16 >= 16: statistics reliable"
    assert readings.reading("batch_size", {"bn/norm_batch_size": [(1, float("nan"))]}) is None
    assert readings.reading("layer_table", {}) is None  # W&B-only panels have none


def test_a_sweep_reads_each_job(tmp_path: Path) -> None:
    for job, rows in (("0", SMALL), ("1", LARGE)):
        _write_history(tmp_path / job, rows)
    (path,) = render(tmp_path, panels=[p for p in PANELS if p.name == "batch_size"])
    with Image.open(path) as image:
        assert image.text["Description"].splitlines() == [
            f"0: {EXPECTED['small']['batch_size']}",
            f"1: {EXPECTED['large']['batch_size']}",
        ]


def test_the_dashboard_doc_states_every_threshold() -> None:
    doc = (ROOT / "docs" / "dashboards.md").read_text()
    for name, rule in readings.RULES.items():
        assert f"| `{name}` | {rule} |" in doc, name


def test_the_wandb_charts_carry_the_readings(tmp_path: Path, monkeypatch) -> None:
    """``finish_wandb``: each chart's title ends with its reading, which the run summary also
    keeps under ``readings/<panel>`` (a stand-in run: what W&B receives, not how it stores it)."""
    import wandb

    from syncbn_lightning.app import loggers

    _write_history(tmp_path, SMALL)
    logged: dict[str, object] = {}
    run = SimpleNamespace(
        log=logged.update, summary={}, dir=str(tmp_path / "files"), finish=lambda: None
    )
    monkeypatch.setattr(
        loggers, "_wandb_loggers", lambda trainer: [SimpleNamespace(experiment=run)]
    )
    monkeypatch.setattr(wandb.plot, "line_series", lambda **kw: kw["title"])
    loggers.finish_wandb(SimpleNamespace(), {}, tmp_path / "metrics.jsonl")  # type: ignore[arg-type]
    titles = {p.name: p.title for p in PANELS}
    for panel, text in EXPECTED["small"].items():
        assert run.summary[f"readings/{panel}"] == text
        assert logged[f"charts/{panel}"] == f"{titles[panel]}: {text}"
