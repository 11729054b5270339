"""The small-batch experiment's PNG plots (written by :func:`.analysis.write_report`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .jobs import spread
from .variants import EVALS

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from .jobs import Job
    from .variants import Variant


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
    * ``drift_gap.png``: running-statistics drift and train/test gap (averages over layers),
    * ``norm_choice.png``: mAP and wall time per job against the normalization batch (the
      sweep), GroupNorm and the pretrained variants beside it.
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
    ax.set_ylim(1.4, 45)
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
    save(norm_choice_figure(plt, jobs), "norm_choice.png")
    return written


def norm_choice_figure(plt: Any, jobs: Mapping[Variant, Sequence[Job]]) -> Any:
    """Left: seed-mean mAP (EMA, error bar: std) against the normalization batch, one line per
    global batch of the multi-process BatchNorm variants, other variants as horizontal lines.
    Right: wall time per job, the same way."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    lines: dict[tuple[str, int], list[tuple[int, float, float, float]]] = {}
    flat: list[tuple[str, float, float, float]] = []
    for v, runs in jobs.items():
        if not runs:
            continue
        mean, std = spread([j.scores["ema"]["mAP"] for j in runs])
        wall = statistics.fmean(j.wall_s for j in runs)
        if v.norm_batch and not v.one_process:
            key = ("pretrained" if v.pretrained else "from scratch", v.global_batch)
            lines.setdefault(key, []).append((v.norm_batch, mean, std, wall))
        else:
            flat.append((v.label, mean, std, wall))
    for (kind, batch), points in sorted(lines.items()):
        points.sort()
        xs = [p[0] for p in points]
        label = f"BN/SyncBN {kind}, global batch {batch}"
        left.errorbar(xs, [p[1] for p in points], [p[2] for p in points], marker="o",
                      capsize=3, label=label)  # fmt: skip
        right.plot(xs, [p[3] for p in points], marker="o", label=label)
    styles = ["--", ":", "-.", (0, (5, 1)), (0, (1, 3))]
    for i, (label, mean, _, wall) in enumerate(flat):
        left.axhline(mean, linestyle=styles[i % len(styles)], color="gray", label=label)
        right.axhline(wall, linestyle=styles[i % len(styles)], color="gray", label=label)
    for ax, ylabel in ((left, "val mAP, EMA (points)"), (right, "wall time per job (s)")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="images per normalization (norm. batch)", ylabel=ylabel)
        ax.grid(alpha=0.3)
    left.set_title("Accuracy against the normalization batch (bars: seed std)", fontsize=9)
    right.set_title("Cost: wall time per job, 2-core CPU, gloo", fontsize=9)
    left.legend(fontsize=6)
    return fig


def accumulation_figure(jobs: Mapping[Variant, Sequence[Job]], path: Path) -> Path:
    """The gradient-accumulation family's figure (``accumulation.png``): validation mAP (EMA)
    over steps; final mAP EMA and the probe's running-statistics error per variant, each seed a
    dot and the seeds joined across variants (paired); the train/test gap of the mean and of the
    std over steps (averages over layers; seed mean, band min..max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {v: colors[i % len(colors)] for i, v in enumerate(jobs)}
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    (curve, final, error), (gap_mean, gap_std, drift) = axes

    def paired(ax: Axes, value: Any, ylabel: str, title: str) -> None:
        names = [v.name for v in jobs]
        seeds = sorted({j.seed for runs in jobs.values() for j in runs})
        for k, seed in enumerate(seeds):
            ys = []
            for runs in jobs.values():
                match = [value(j) for j in runs if j.seed == seed]
                ys.append(match[0] if match else math.nan)
            ax.plot(range(len(names)), ys, "-", color="gray", alpha=0.5, linewidth=0.8,
                    marker="o", markersize=4, label="one seed" if k == 0 else None)  # fmt: skip
        for x, (v, runs) in enumerate(jobs.items()):
            values = [value(j) for j in runs]
            if values and all(map(math.isfinite, values)):
                mean, std = spread(values)
                ax.errorbar([x], [mean], [std], color=color[v], marker="s", markersize=8,
                            capsize=4, linewidth=2)  # fmt: skip
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set(ylabel=ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)

    for v, runs in jobs.items():
        _band(curve, runs, "val/mAP", v.name, color[v], 100.0)
    curve.set(xlabel="optimizer step", ylabel="val mAP (points)")
    curve.set_title("val mAP with the running (EMA) statistics", fontsize=9)
    curve.grid(alpha=0.3)
    curve.legend(fontsize=7)
    paired(final, lambda j: j.scores["ema"]["mAP"], "val mAP, EMA (points)",
           "final mAP EMA (primary): seeds joined, square: mean ± std")  # fmt: skip
    paired(error, lambda j: j.extra.get("stat_err_std_avg", math.nan), "|std ratio - 1|",
           "EMA statistics vs population: std error (avg over layers)")  # fmt: skip
    panels = (
        (gap_mean, "bn/gap_mean_avg", "train/test gap: mean"),
        (gap_std, "bn/gap_std_avg", "train/test gap: std"),
        (drift, "bn/drift_var_avg", "EMA drift of the running var"),
    )
    for ax, metric, title in panels:
        for v, runs in jobs.items():
            _band(ax, runs, metric, v.name, color[v], 1.0)
        ax.set_yscale("log")
        ax.set(xlabel="optimizer step")
        ax.set_title(f"{title} ({metric})", fontsize=9)
        ax.grid(alpha=0.3)
    gap_mean.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
