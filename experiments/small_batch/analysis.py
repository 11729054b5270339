"""Collect the small-batch experiment's jobs into a table, goal checks and PNG plots.

Numbers are COCO mAP and mAP50 in points (x 100). Over seeds each cell is ``mean ± std``
(sample standard deviation, ``n - 1``), with every seed's value in ``results.json``. Three
evaluations of the same final weights per job:

* **EMA**: the running statistics as training left them (the last validation during fit;
  ``results.json["fit"]`` of the job),
* **PreciseBN**: population statistics recomputed over 32 training steps' images
  (``results.json["final"]``, the recipe's closing evaluation),
* **batch stats**: every layer normalizes with the statistics of its validation batch
  (2 images for the 4-process variants, 8 for the reference; the runner's probe).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from syncbn_lightning.app.report import find_metrics_files, read_metrics

from .variants import RECORD_FILE, Variant

if TYPE_CHECKING:
    from matplotlib.axes import Axes

EVALS: tuple[tuple[str, str], ...] = (
    ("ema", "EMA"),
    ("precise", "PreciseBN"),
    ("batch", "batch stats"),
)
"""Evaluation keys and their column names."""

CURVES = (
    "val/mAP",
    "bn/norm_batch_size",
    "bn/global_batch_size",
    "bn/drift_mean_avg",
    "bn/drift_var_avg",
    "bn/gap_mean_avg",
    "bn/gap_std_avg",
)
"""The CSV metrics kept per job for the plots."""


@dataclass
class Job:
    """One finished job's numbers: ``scores[eval][metric]`` in points, wall time, curves."""

    seed: int
    scores: dict[str, dict[str, float]]
    wall_s: float
    steps: int
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def _points(value: float) -> float:
    return 100.0 * float(value)


def load_job(run_dir: Path, seed: int) -> Job:
    """Read ``results.json``, ``experiment.json`` and ``metrics.csv`` of one job directory.

    The closing evaluation is logged at the same step as the last validation during fit; it is
    dropped from the ``val/mAP`` curve, which therefore shows the EMA evaluations only.

    Raises:
        FileNotFoundError: when the job has not finished (no ``results.json`` / record).
    """
    results = json.loads((run_dir / "results.json").read_text())
    record = json.loads((run_dir / RECORD_FILE).read_text())
    scores = {
        "ema": {m: _points(results["fit"][f"val/{m}"]) for m in ("mAP", "mAP50")},
        "precise": {m: _points(results["final"][f"val/{m}"]) for m in ("mAP", "mAP50")},
        "batch": {m: _points(record["probe"][f"val/{m}"]) for m in ("mAP", "mAP50")},
    }
    curves: dict[str, list[tuple[int, float]]] = {}
    files = find_metrics_files(run_dir)
    if files:
        series = read_metrics(files[-1])  # the newest version_<n> of the job
        curves = {k: list(series[k]) for k in CURVES if k in series}
        if curves.get("val/mAP"):
            curves["val/mAP"] = curves["val/mAP"][:-1]
    return Job(seed, scores, float(record["wall_s"]), int(results["global_step"]), curves)


def spread(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, sample std)``; the std is 0 for a single value and NaN for none."""
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def _cell(values: Sequence[float]) -> str:
    mean, std = spread(values)
    return f"{mean:.1f} ± {std:.1f}"


def table(jobs: Mapping[Variant, Sequence[Job]]) -> str:
    """The results table (markdown): per variant, mAP and mAP50 per evaluation, wall time."""
    head = ["variant", "norm. batch", "seeds"]
    for _, name in EVALS:
        head += [f"mAP {name}", f"mAP50 {name}"]
    head += ["wall time / job"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, runs in jobs.items():
        cells = [variant.label, str(variant.norm_batch), str(len(runs))]
        for key, _ in EVALS:
            for metric in ("mAP", "mAP50"):
                cells.append(_cell([j.scores[key][metric] for j in runs]))
        mean_wall, _ = spread([j.wall_s for j in runs])
        cells.append(f"{mean_wall:.0f} s")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def seed_table(jobs: Mapping[Variant, Sequence[Job]]) -> str:
    """Every job's mAP (EMA / PreciseBN / batch stats) and wall time, one row per job."""
    rows = [
        "| variant | seed | mAP EMA | mAP PreciseBN | mAP batch stats | steps | wall time |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, runs in jobs.items():
        for j in runs:
            rows.append(
                f"| {variant.name} | {j.seed} | {j.scores['ema']['mAP']:.2f} | "
                f"{j.scores['precise']['mAP']:.2f} | {j.scores['batch']['mAP']:.2f} | "
                f"{j.steps} | {j.wall_s:.0f} s |"
            )
    return "\n".join(rows)


def _mean(jobs: Mapping[Variant, Sequence[Job]], name: str, key: str) -> float | None:
    for variant, runs in jobs.items():
        if variant.name == name and runs:
            return spread([j.scores[key]["mAP"] for j in runs])[0]
    return None


def goals(jobs: Mapping[Variant, Sequence[Job]]) -> list[dict[str, Any]]:
    """The issue's goals, checked on the seed means of mAP (points).

    * SyncBN (world) >= local BN, for the recipe's evaluation (PreciseBN) and for EMA;
    * SyncBN (world) within 1 point of the 1 x 8 reference, both evaluations;
    * PreciseBN >= EMA, per variant.

    Returns:
        ``[{"goal": text, "value": text, "met": bool}]``; goals whose variants did not run are
        left out.
    """
    out: list[dict[str, Any]] = []
    for key, name in EVALS[:2]:
        sync, local, large = (_mean(jobs, n, key) for n in ("syncbn", "local_bn", "large_batch"))
        if sync is not None and local is not None:
            out.append(
                {
                    "goal": f"SyncBN mAP >= local-BN mAP ({name})",
                    "value": f"{sync:.2f} vs {local:.2f} ({sync - local:+.2f})",
                    "met": sync >= local,
                }
            )
        if sync is not None and large is not None:
            out.append(
                {
                    "goal": f"SyncBN within 1 point of the 1 x 8 reference ({name})",
                    "value": f"{sync:.2f} vs {large:.2f} ({sync - large:+.2f})",
                    "met": abs(sync - large) <= 1.0,
                }
            )
    for variant, runs in jobs.items():
        if not runs:
            continue
        ema = spread([j.scores["ema"]["mAP"] for j in runs])[0]
        precise = spread([j.scores["precise"]["mAP"] for j in runs])[0]
        out.append(
            {
                "goal": f"PreciseBN >= EMA ({variant.name})",
                "value": f"{precise:.2f} vs {ema:.2f} ({precise - ema:+.2f})",
                "met": precise >= ema,
            }
        )
    return out


# ----------------------------------------------------------------------------- plots


def _aligned(runs: Sequence[Job], metric: str) -> tuple[list[int], list[list[float]]]:
    """Steps logged by every seed, and each seed's values at those steps."""
    per_seed = [dict(j.curves.get(metric, [])) for j in runs]
    if not per_seed or not all(per_seed):
        return [], []
    steps = sorted(set.intersection(*(set(p) for p in per_seed)))
    return steps, [[p[s] for p in per_seed] for s in steps]


def _band(ax: Axes, runs: Sequence[Job], metric: str, label: str, color: str, scale: float) -> bool:
    """Seed mean as a line, min..max over seeds as a band. Returns whether anything was drawn."""
    steps, values = _aligned(runs, metric)
    finite = [(s, v) for s, v in zip(steps, values, strict=True) if all(map(math.isfinite, v))]
    if not finite:
        return False
    xs = [s for s, _ in finite]
    marker = "o" if len(xs) < 20 else None  # a few points (short runs) stay visible
    means = [scale * statistics.fmean(v) for _, v in finite]
    ax.plot(xs, means, label=label, color=color, marker=marker, markersize=3)
    if len(runs) > 1:
        low = [scale * min(v) for _, v in finite]
        high = [scale * max(v) for _, v in finite]
        ax.fill_between(xs, low, high, color=color, alpha=0.2, linewidth=0)
    return True


def plot(jobs: Mapping[Variant, Sequence[Job]], out_dir: Path) -> list[Path]:
    """Write the PNGs into ``out_dir``; return their paths.

    * ``map_over_steps.png``: validation mAP (EMA statistics) over optimizer steps,
    * ``final_map.png``: final mAP per variant and evaluation, seed means and each seed,
    * ``norm_batch_size.png``: ``bn/norm_batch_size`` (``bn/global_batch_size`` in the title),
    * ``drift_gap.png``: running-statistics drift and train/test gap (averages over layers).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {v: colors[i % len(colors)] for i, v in enumerate(jobs)}
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for v, runs in jobs.items():
        _band(ax, runs, "val/mAP", v.label, color[v], 100.0)
    ax.set(
        xlabel="optimizer step",
        ylabel="val mAP (points)",
        title="Validation mAP with the EMA statistics (mean; band: min..max over seeds)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "map_over_steps.png")

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    width = 0.8 / len(EVALS)
    for i, (key, name) in enumerate(EVALS):
        for x, (_, runs) in enumerate(jobs.items()):
            values = [j.scores[key]["mAP"] for j in runs]
            if not values:
                continue
            pos = x - 0.4 + width * (i + 0.5)
            ax.bar(pos, statistics.fmean(values), width, color=colors[i], alpha=0.7,
                   label=name if x == 0 else None)  # fmt: skip
            ax.plot([pos] * len(values), values, "k.", markersize=4)
    ax.set_xticks(range(len(jobs)), [v.name for v in jobs])
    ax.set(ylabel="val mAP (points)", title="Final mAP by evaluation statistics (dots: seeds)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "final_map.png")

    fig, ax = plt.subplots(figsize=(9.5, 3.8))
    for i, (v, runs) in enumerate(jobs.items()):
        width = 1.5 + 2.0 * (len(jobs) - 1 - i)  # earlier lines wider: equal values stay visible
        steps, values = _aligned(runs, "bn/norm_batch_size")
        if steps:
            ax.plot(steps, [statistics.fmean(x) for x in values], color=color[v],
                    linewidth=width, alpha=0.8, label=v.label)  # fmt: skip
    globals_ = {x for runs in jobs.values() for j in runs for _, x in j.curves.get(
        "bn/global_batch_size", [])}  # fmt: skip
    shown = ", ".join(f"{g:g}" for g in sorted(globals_)) or "-"
    ax.set(
        xlabel="optimizer step",
        ylabel="samples per BN forward",
        title=f"bn/norm_batch_size (bn/global_batch_size: {shown} in every job)",
    )
    ax.set_yscale("log", base=2)
    ax.set_ylim(1.4, 11.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save(fig, "norm_batch_size.png")

    panels = (
        ("bn/drift_mean_avg", "EMA drift of the running mean"),
        ("bn/drift_var_avg", "EMA drift of the running var"),
        ("bn/gap_mean_avg", "train/test gap: mean"),
        ("bn/gap_std_avg", "train/test gap: std"),
    )
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for ax, (metric, title) in zip(axes.flat, panels, strict=True):
        for v, runs in jobs.items():
            _band(ax, runs, metric, v.name, color[v], 1.0)
        ax.set_yscale("log")
        ax.set(title=f"{title} ({metric}, avg over layers)", xlabel="optimizer step")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    save(fig, "drift_gap.png")
    return written


# ----------------------------------------------------------------------------- report


def collect(
    runs_dir: Path, variants: Sequence[Variant], seeds: Sequence[int]
) -> dict[Variant, list[Job]]:
    """Every finished job of ``variants`` x ``seeds`` under ``runs_dir``.

    Raises:
        FileNotFoundError: naming the first job that has not finished.
    """
    jobs: dict[Variant, list[Job]] = {}
    for v in variants:
        jobs[v] = []
        for seed in seeds:
            run_dir = runs_dir / v.name / f"seed{seed}"
            try:
                jobs[v].append(load_job(run_dir, seed))
            except FileNotFoundError as e:
                raise FileNotFoundError(
                    f"job {run_dir} has not finished ({e.filename} missing); run "
                    "`python -m experiments.small_batch` without --analyze-only to train it"
                ) from None
    return jobs


def write_report(
    runs_dir: Path,
    docs_dir: Path,
    *,
    variants: Sequence[Variant],
    seeds: Sequence[int],
    meta: Mapping[str, Any],
) -> str:
    """Write ``docs_dir/results.md``, ``results.json`` and the PNGs; return the markdown."""
    jobs = collect(runs_dir, variants, seeds)
    docs_dir.mkdir(parents=True, exist_ok=True)
    plot(jobs, docs_dir)
    checked = goals(jobs)
    total = sum(j.wall_s for runs in jobs.values() for j in runs)
    m = meta["machine"]
    lines = [
        "# Small-batch detection experiment: results",
        "",
        f"Command: `{meta['command']}` (preset `{meta['preset']}`). "
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory']}, {m['gpu']}; "
        f"Python {m['python']}, torch {m['torch']}, lightning {m['lightning']}. "
        f"Training time of the {sum(len(r) for r in jobs.values())} jobs: {total / 60:.1f} min.",
        "",
        "mAP in points, mean ± sample std over seeds " + ", ".join(map(str, seeds)) + ".",
        "",
        table(jobs),
        "",
        "## Goals",
        "",
        "| goal | seed means (points) | met |",
        "|---|---|---|",
        *(f"| {g['goal']} | {g['value']} | {'yes' if g['met'] else 'no'} |" for g in checked),
        "",
        "## Every job",
        "",
        seed_table(jobs),
        "",
    ]
    text = "\n".join(lines)
    (docs_dir / "results.md").write_text(text)
    raw = {
        **meta,
        "seeds": list(seeds),
        "training_wall_s": round(total, 1),
        "goals": checked,
        "variants": {
            v.name: {
                "label": v.label,
                "overrides": list(v.overrides),
                "norm_batch": v.norm_batch,
                "jobs": [
                    {"seed": j.seed, "scores": j.scores, "wall_s": j.wall_s, "steps": j.steps}
                    for j in runs
                ],
            }
            for v, runs in jobs.items()
        },
    }
    (docs_dir / "results.json").write_text(json.dumps(raw, indent=1) + "\n")
    return text
