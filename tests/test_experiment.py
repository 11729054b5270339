"""The small-batch experiment layer: harder synthetic data, shared data order, the runner/analysis.

The end-to-end test runs the real command (``python -m experiments.small_batch --preset smoke``):
real ``train.py`` jobs with 4 gloo processes and a one-process reference, the real probe and the
real plots; only the dataset and the number of steps are tiny.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
from PIL import Image
from torch.utils.data import DistributedSampler

from experiments.small_batch import accumulation, analysis, choice, runner
from syncbn_lightning.app.tasks.datamodule import CocoDataModule
from syncbn_lightning.app.tasks.shapes import generate_shapes

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- harder data


def _annotations(root: Path) -> dict:
    return json.loads((root / "annotations" / "instances_train.json").read_text())


def test_default_dataset_records_no_new_parameters(tmp_path: Path) -> None:
    # Datasets written before clutter/photometric existed must still match their parameters.
    root = generate_shapes(tmp_path / "d", num_train=2, num_val=1, progress=False)
    stored = _annotations(root)["info"]["syncbn_shapes"]
    assert "clutter" not in stored and "photometric" not in stored
    hard = generate_shapes(
        tmp_path / "h", num_train=2, num_val=1, clutter=3, photometric=0.25, progress=False
    )
    stored = _annotations(hard)["info"]["syncbn_shapes"]
    assert (stored["clutter"], stored["photometric"]) == (3, 0.25)


def test_photometric_is_a_per_image_affine_change_of_the_same_image(tmp_path: Path) -> None:
    # The change is drawn after everything else of an image, so image 0 of both datasets is the
    # same drawing; photometric maps its levels v -> (v - 128) * c + 128 + b (then clips).
    common = {"num_train": 1, "num_val": 1, "progress": False}
    base = generate_shapes(tmp_path / "base", **common)
    photo = generate_shapes(tmp_path / "photo", photometric=0.9, **common)
    a = np.asarray(Image.open(base / "train" / "000000.png"), dtype=float).ravel()
    b = np.asarray(Image.open(photo / "train" / "000000.png"), dtype=float).ravel()
    inside = (b > 0) & (b < 255)  # not clipped
    assert inside.mean() > 0.5
    slope, intercept = np.polyfit(a[inside], b[inside], 1)
    residual = b[inside] - (slope * a[inside] + intercept)
    assert np.abs(residual).max() <= 1.0  # one affine map, up to rounding
    assert abs(slope - 1.0) > 0.01  # and not the identity
    assert _annotations(base)["annotations"] == _annotations(photo)["annotations"]


def test_clutter_puts_unannotated_edges_outside_every_box(tmp_path: Path) -> None:
    def edges_outside_boxes(root: Path) -> float:
        coco = _annotations(root)
        fractions = []
        for image in coco["images"]:
            gray = np.asarray(
                Image.open(root / "train" / image["file_name"]).convert("L"), dtype=float
            )
            free = np.ones_like(gray, dtype=bool)
            for ann in coco["annotations"]:
                if ann["image_id"] == image["id"]:
                    x, y, w, h = (int(v) for v in ann["bbox"])
                    free[max(0, y - 1) : y + h + 1, max(0, x - 1) : x + w + 1] = False
            step = np.abs(np.diff(gray, axis=1)) > 40  # far above the background's noise
            fractions.append(step[free[:, 1:] & free[:, :-1]].mean())
        return float(np.mean(fractions))

    common = {"num_train": 24, "num_val": 1, "progress": False}
    assert edges_outside_boxes(generate_shapes(tmp_path / "plain", **common)) == 0.0
    assert edges_outside_boxes(generate_shapes(tmp_path / "clutter", clutter=4, **common)) > 0.002


# ----------------------------------------------------------------------------- data order


def test_one_process_sees_the_global_batches_of_four(tmp_path: Path, monkeypatch) -> None:
    """A 1 x 8 run trains at every step on the 8 images that 4 DDP ranks x 2 train on."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    dm = CocoDataModule(
        str(tmp_path / "shapes"),
        batch_size=8,
        synthetic={"num_train": 32, "num_val": 2, "progress": False},
    )
    dm.prepare_data()
    dm.setup("fit")
    dm.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    sampler = dm.train_dataloader().sampler
    assert isinstance(sampler, DistributedSampler)
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        single = list(sampler)
        ranks = []
        for rank in range(4):
            ddp = DistributedSampler(dm.train_set, 4, rank, shuffle=True, seed=7)
            ddp.set_epoch(epoch)
            ranks.append(list(ddp))
        for step in range(len(single) // 8):
            together = {i for r in ranks for i in r[2 * step : 2 * step + 2]}
            assert set(single[8 * step : 8 * step + 8]) == together
        orders.append(single)
    assert orders[0] != orders[1]  # reshuffled per epoch


def test_without_a_trainer_the_loader_shuffles_plainly(tmp_path: Path) -> None:
    dm = CocoDataModule(
        str(tmp_path / "shapes"), synthetic={"num_train": 4, "num_val": 2, "progress": False}
    )
    dm.prepare_data()
    dm.setup("fit")
    assert not isinstance(dm.train_dataloader().sampler, DistributedSampler)


# ----------------------------------------------------------------------------- analysis


def _job(seed: int, ema: float, precise: float, batch: float = 0.0) -> analysis.Job:
    scores = {
        "ema": {"mAP": ema, "mAP50": 2 * ema},
        "precise": {"mAP": precise, "mAP50": 2 * precise},
        "batch": {"mAP": batch, "mAP50": 2 * batch},
    }
    return analysis.Job(seed, scores, wall_s=10.0 + seed, steps=100)


def _variants() -> dict[str, runner.Variant]:
    return {v.name: v for v in runner.VARIANTS}


def test_spread_is_the_sample_standard_deviation() -> None:
    assert analysis.spread([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert analysis.spread([5.0]) == (5.0, 0.0)


def test_goals_compare_seed_means() -> None:
    v = _variants()
    jobs = {
        v["local_bn"]: [_job(0, 20.0, 18.0), _job(1, 22.0, 20.0)],
        v["syncbn"]: [_job(0, 30.0, 31.0), _job(1, 32.0, 33.0)],
        v["large_batch"]: [_job(0, 31.5, 31.0), _job(1, 33.5, 32.0)],
    }
    met = {g["goal"]: g["met"] for g in analysis.goals(jobs)}
    assert met == {
        "SyncBN mAP >= local-BN mAP (EMA)": True,
        "SyncBN within 1 point of the 1 x 8 reference (EMA)": False,  # 31 vs 32.5
        "SyncBN mAP >= local-BN mAP (PreciseBN)": True,
        "SyncBN within 1 point of the 1 x 8 reference (PreciseBN)": True,  # 32 vs 31.5
        "PreciseBN >= EMA (local_bn)": False,
        "PreciseBN >= EMA (syncbn)": True,
        "PreciseBN >= EMA (large_batch)": False,
    }


def test_table_has_one_row_per_variant_with_mean_and_std() -> None:
    v = _variants()
    text = analysis.table({v["syncbn"]: [_job(0, 30.0, 31.0), _job(1, 32.0, 33.0)]})
    row = text.splitlines()[2]
    assert row.startswith(f"| {v['syncbn'].label} | 8 | 2 | 31.0 ± 1.4 | 62.0 ± 2.8 | 32.0 ± 1.4")
    assert row.endswith("| 10 s |")  # mean wall time 10.5 s


def _override(v: runner.Variant, key: str, default: str) -> str:
    found = [o.split("=", 1)[1] for o in v.overrides if o.split("=", 1)[0] == key]
    return found[-1] if found else default


def test_accumulation_variants_keep_the_global_batch_of_8() -> None:
    """The family: 2 processes, images x accumulation = 4 per process, so the LR, the steps
    and the images of a step are the other global-batch-8 variants'; PreciseBN over 256 images."""
    family = [v for v in runner.VARIANTS if v.family == accumulation.FAMILY]
    assert [v.name for v in family] == ["acc_torch", "acc_micro", "acc_step", "sync_2x4"]
    assert accumulation.FAMILY in analysis.FAMILIES
    modes = {}
    for v in family:
        devices = int(_override(v, "trainer.devices", "2"))
        batch = int(_override(v, "data.batch_size", "2"))
        accumulate = int(_override(v, "trainer.accumulate_grad_batches", "1"))
        assert devices * batch * accumulate == v.global_batch == 8, v.name
        precise = int(_override(v, "bn.precise_bn_batches", "32"))
        assert precise * devices * batch == 256, v.name  # 32 optimizer steps' images
        assert _override(v, "recipe", "") == "detection_small_batch"
        modes[v.name] = _override(v, "bn.step_statistics", "absent")
    assert modes == {"acc_torch": "null", "acc_micro": "micro", "acc_step": "step",
                     "sync_2x4": "absent"}  # fmt: skip
    # Not a normalization choice: outside the choice table (and the knee's sweep).
    jobs = {v: [_job(0, 30.0, 30.0)] for v in family}
    assert choice.choice_rows(jobs) == [] and choice.sweep_points(jobs) == {}


def test_a_paired_difference_is_a_finding_only_beyond_the_spread() -> None:
    # Same sign on every seed and the mean (+2) beyond twice the larger std (0.5): a finding.
    assert accumulation.finding([32.0, 32.5, 33.0], [30.0, 30.5, 31.0], floor=1.0)
    # The mean beyond 1 point but within twice the std (1.5): no finding.
    assert not accumulation.finding([30.0, 33.0, 33.0], [29.0, 31.0, 32.0], floor=1.0)
    # One seed the other way: no finding, however large the mean.
    assert not accumulation.finding([40.0, 40.0, 29.0], [30.0, 30.0, 30.0])
    # Tight but under the 1-point floor: no finding.
    assert not accumulation.finding([30.5, 30.5, 30.6], [30.0, 30.0, 30.1], floor=1.0)


def _fake_job(run_dir: Path, ema: float, tracked: int) -> None:
    run_dir.mkdir(parents=True)
    val = {"val/mAP": ema / 100, "val/mAP50": 2 * ema / 100}
    (run_dir / "results.json").write_text(
        json.dumps({"global_step": 1024, "fit": val, "final": val})
    )
    probe = {**val, "batch": 1, "stat_err_mean_avg": 0.1, "stat_err_std_avg": 0.05,
             "num_batches_tracked_min": tracked, "num_batches_tracked_max": tracked,
             "checkpoint_step": 1024}  # fmt: skip
    record = {"overrides": [], "wall_s": 12.0, "probe": probe}
    (run_dir / "experiment.json").write_text(json.dumps(record))


def test_report_keeps_the_published_numbers_of_variants_it_did_not_find(tmp_path: Path) -> None:
    """A family run alone into the docs dir adds its variants to results.json and results.md
    without erasing the published ones (whose job directories are elsewhere), and leaves the
    PNGs drawn from every variant's curves as they were."""
    v = _variants()
    docs, runs = tmp_path / "docs", tmp_path / "runs"
    meta = {"command": "old", "preset": "full", "preset_overrides": [],
            "machine": {"cpu": "old cpu", "cores": 2}}  # fmt: skip
    analysis.write_report(tmp_path / "old_runs", docs, variants=[], seeds=[0, 1], meta=meta)
    assert json.loads((docs / "results.json").read_text())["variants"] == {}
    # The published file: syncbn as an earlier report wrote it.
    raw = json.loads((docs / "results.json").read_text())
    raw["variants"]["syncbn"] = {
        "jobs": [
            {"seed": s, "scores": _job(s, 41.0 + s, 41.0).scores, "wall_s": 250.0, "steps": 1024}
            for s in (0, 1)
        ],
    }
    (docs / "results.json").write_text(json.dumps(raw))
    (docs / "final_map.png").write_bytes(b"published")
    for name, tracked in (("acc_torch", 4096), ("acc_micro", 1024)):
        for seed in (0, 1):
            _fake_job(runs / name / f"seed{seed}", 30.0 + seed + (name == "acc_micro"), tracked)
    now = {**meta, "command": "new", "machine": {"cpu": "new cpu", "cores": 2}}
    analysis.write_report(runs, docs, variants=[v["acc_torch"], v["acc_micro"]], seeds=[0, 1],
                          meta=now)  # fmt: skip
    out = json.loads((docs / "results.json").read_text())
    assert list(out["variants"]) == ["syncbn", "acc_torch", "acc_micro"]
    assert out["kept_variants"] == ["syncbn"]
    assert out["variants"]["syncbn"]["jobs"][1]["scores"]["ema"]["mAP"] == 42.0
    assert out["variants"]["syncbn"]["source"]["command"] == "old"
    assert out["variants"]["acc_micro"]["source"]["command"] == "new"
    assert [(s["command"], s["jobs"]) for s in out["training_wall_by_source"]] == [
        ("old", 2),
        ("new", 4),
    ]
    assert (docs / "final_map.png").read_bytes() == b"published"
    acc = out["accumulation"]
    assert acc["variants"]["acc_torch"]["num_batches_tracked"] == [4096]
    pair = acc["paired"]["acc_micro - acc_torch"]["map_ema"]
    assert pair["diffs"] == pytest.approx([1.0, 1.0]) and not pair["finding"]  # std 0.7 x 2
    md = (docs / "results.md").read_text()
    assert "| SyncBN world, 4 proc x 2 img | 8 | 2 | 41.5 ± 0.7 |" in md
    assert "## Gradient accumulation" in md and "| acc_micro - acc_torch | +1.0 ± 0.0" in md
    # --only-runs: the published variants go.
    analysis.write_report(runs, docs, variants=[v["acc_torch"]], seeds=[0, 1], meta=now,
                          keep_published=False)  # fmt: skip
    assert list(json.loads((docs / "results.json").read_text())["variants"]) == ["acc_torch"]


# ----------------------------------------------------------------------------- command


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "experiments.small_batch", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_unknown_variant_is_refused_by_name() -> None:
    proc = _run("--variants", "syncbn", "batchnorm", timeout=120)
    assert proc.returncode != 0
    names = "local_bn, group2, syncbn, large_batch, local_bn_b8, group2_b8, syncbn_b8, gn, "
    assert f"unknown variant 'batchnorm'; choose from {names}pre_frozen" in proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_smoke_experiment_end_to_end_and_resume(tmp_path: Path) -> None:
    dirs = [
        f"--runs-dir={tmp_path / 'runs'}",
        f"--docs-dir={tmp_path / 'docs'}",
        f"--data-dir={tmp_path / 'data'}",
    ]
    args = ["--preset", "smoke", "--seeds", "0", "1", "--variants", "syncbn", "large_batch"]
    proc = _run(*args, *dirs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    docs = tmp_path / "docs"
    raw = json.loads((docs / "results.json").read_text())
    assert raw["jobs_run_now"] == 4 and raw["seeds"] == [0, 1]
    assert raw["machine"]["cores"] >= 1
    for name, steps in (("syncbn", 8), ("large_batch", 8)):  # 32 images / 8 per step x 2 epochs
        jobs = raw["variants"][name]["jobs"]
        assert [j["seed"] for j in jobs] == [0, 1]
        for j in jobs:
            assert j["steps"] == steps and j["wall_s"] > 0
            for key in ("ema", "precise", "batch"):
                assert 0.0 <= j["scores"][key]["mAP"] <= 100.0
    # Each job's own files: the service's results.json and the probe's record.
    record = json.loads((tmp_path / "runs" / "syncbn" / "seed0" / "experiment.json").read_text())
    assert record["probe"]["batch"] == 2 and "seed=0" in record["overrides"]
    large_dir = tmp_path / "runs" / "large_batch" / "seed1"
    large = json.loads((large_dir / "experiment.json").read_text())
    assert large["probe"]["batch"] == 8
    results = json.loads((tmp_path / "runs" / "syncbn" / "seed0" / "results.json").read_text())
    assert results["global_step"] == 8 and "val/mAP" in results["fit"]
    assert results["final"]["bn/norm_batch_size"] == 8.0
    table = (docs / "results.md").read_text()
    assert "| SyncBN world, 4 proc x 2 img | 8 | 2 |" in table and "## Goals" in table
    for png in ("map_over_steps", "final_map", "norm_batch_size", "drift_gap"):
        assert (docs / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The same command again reuses every finished job and rewrites the same table.
    again = _run(*args, *dirs)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((docs / "results.json").read_text())["jobs_run_now"] == 0
    assert (docs / "results.md").read_text().split("## Goals")[1] == table.split("## Goals")[1]
    # --force reruns a job from an empty directory: the probe and the plots read the new run.
    forced = _run("--preset", "smoke", "--seeds", "0", "--variants", "large_batch", "--force",
                  *dirs)  # fmt: skip
    assert forced.returncode == 0, forced.stderr[-3000:]
    job = tmp_path / "runs" / "large_batch" / "seed0"
    assert sorted(p.name for p in (job / "checkpoints").glob("last*")) == ["last.ckpt"]
    assert [p.name for p in (job / "csv").iterdir()] == ["version_0"]
    assert json.loads((docs / "results.json").read_text())["jobs_run_now"] == 1


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_smoke_pretrained_and_group_norm_variants(tmp_path: Path) -> None:
    """A pretrained variant first trains its seed's backbone pretraining job, then starts from
    its checkpoint; GroupNorm and frozen BN report n/a where PreciseBN cannot change them."""
    dirs = [f"--runs-dir={tmp_path / 'runs'}", f"--docs-dir={tmp_path / 'docs'}",
            f"--data-dir={tmp_path / 'data'}"]  # fmt: skip
    proc = _run("--preset", "smoke", "--seeds", "0", "--variants", "gn", "pre_frozen", *dirs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.index("pretrain seed 0: training") < proc.stdout.index("pre_frozen seed 0")
    raw = json.loads((tmp_path / "docs" / "results.json").read_text())
    assert raw["jobs_run_now"] == 3 and [p["seed"] for p in raw["pretrain"]] == [0]
    ckpt = tmp_path / "runs" / "pretrain" / "seed0" / "checkpoints" / "last.ckpt"
    record = json.loads(
        (tmp_path / "runs" / "pre_frozen" / "seed0" / "experiment.json").read_text()
    )
    assert f"model.init_backbone={ckpt}" in record["overrides"]
    assert {r["variant"] for r in raw["choice"]} == {"gn", "pre_frozen"}
    table = (tmp_path / "docs" / "results.md").read_text()
    assert "| GroupNorm, 4 proc x 2 img | per image (GN) | 1 |" in table
    assert "| n/a | n/a | n/a | n/a |" in table and "## What each choice costs" in table
    assert (tmp_path / "docs" / "norm_choice.png").read_bytes()[:4] == b"\x89PNG"


def _points(**segments: dict[int, tuple[float, float]]) -> dict[int, dict[int, tuple]]:
    """``gb8={2: (mean, std)}`` -> ``{8: {2: (mean, std, 3)}}`` (3 seeds each)."""
    return {int(k[2:]): {n: (*ms, 3) for n, ms in v.items()} for k, v in segments.items()}


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        # 2 -> 4 is a finding (+6 points, std 1); 4 -> 8 and the 4 x 8 curve are flat: 4.
        (_points(gb8={2: (35, 1), 4: (41, 1), 8: (41.5, 1)}, gb32={8: (41, 1), 32: (41.5, 1)}), 4),
        # +1.5 points, but within two standard errors (std 3 over 3 seeds): not a finding.
        (_points(gb8={2: (35, 1), 4: (40, 3), 8: (41.5, 3)}), 4),
        # +1.5 points with std 0.5: a finding, so the knee moves to 8.
        (_points(gb8={2: (35, 1), 4: (40, 0.5), 8: (41.5, 0.5)}), 8),
        # Tight but under 1 point: not a finding.
        (_points(gb8={2: (35, 0.1), 4: (40.9, 0.1), 8: (41.0, 0.1)}), 4),
        # The 4 x 8 curve still climbs from 8 to 16: the knee is 16.
        (_points(gb8={2: (35, 1), 4: (41, 1), 8: (41, 1)}, gb32={8: (38, 0.5), 16: (41, 0.5)}), 16),
        # Still improving at the largest: the largest.
        (_points(gb8={2: (30, 0.5), 4: (35, 0.5), 8: (40, 0.5)}), 8),
    ],
)
def test_knee_is_the_smallest_norm_batch_no_larger_one_is_better_than(
    points: dict[int, dict[int, tuple]], expected: int
) -> None:
    assert choice.knee(points) == expected
