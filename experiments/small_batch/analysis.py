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

The gradient-accumulation family adds its own section (:mod:`.accumulation`) and figure.

A report covers the variants finished under the runs directory and, unless told otherwise, keeps
the published numbers of every other variant the docs directory's ``results.json`` already holds
for the same seeds (their job directories need not be on this machine): each variant's entry
records the command and machine it came from (``source``). The PNGs drawn from every variant's
curves are rewritten only when no kept variant lacks its curves.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from syncbn_lightning.app.report import find_metrics_files, read_metrics

from .accumulation import FAMILY as ACCUMULATION
from .accumulation import accumulation_section, tail_mean
from .choice import (
    KNEE_SIGMAS,
    KNEE_TOLERANCE,
    choice_rows,
    choice_table,
    knee,
    norm_batch_text,
    sweep_points,
)
from .jobs import Job, spread
from .plots import accumulation_figure, plot
from .variants import EVALS, FAMILIES, PRETRAIN, RECORD_FILE, VARIANTS, Variant

CURVES = (
    "val/mAP",
    "bn/norm_batch_size",
    "bn/global_batch_size",
    "bn/drift_mean_avg",
    "bn/drift_var_avg",
    "bn/gap_mean_avg",
    "bn/gap_std_avg",
    "lr-AdamW/pg1",
)
"""The CSV metrics kept per job for the plots."""

PROBE_EXTRA = (
    "stat_err_mean_avg",
    "stat_err_mean_max",
    "stat_err_std_avg",
    "stat_err_std_max",
    "num_batches_tracked_min",
    "num_batches_tracked_max",
    "checkpoint_step",
)
"""The running-statistics probe's numbers a job keeps in ``Job.extra`` (when its record has
them: jobs probed before it existed do not)."""

TAILS = {
    "gap_mean_last100": "bn/gap_mean_avg",
    "gap_std_last100": "bn/gap_std_avg",
    "drift_mean_last100": "bn/drift_mean_avg",
    "drift_var_last100": "bn/drift_var_avg",
}
"""``Job.extra`` keys: a ``bn/*`` curve's mean over the job's last 100 optimizer steps."""


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
    steps = int(results["global_step"])
    extra = {k: float(record["probe"][k]) for k in PROBE_EXTRA if k in record["probe"]}
    for key, metric in TAILS.items():
        if curves.get(metric):
            extra[key] = tail_mean(curves[metric], steps)
    if curves.get("lr-AdamW/pg1"):  # LearningRateMonitor's, of the first parameter group
        extra["lr_peak"] = max(v for _, v in curves["lr-AdamW/pg1"])
    return Job(seed, scores, float(record["wall_s"]), steps, curves, extra)


def _cell(values: Sequence[float]) -> str:
    mean, std = spread(values)
    return f"{mean:.1f} ± {std:.1f}"


def _has_batch_stats(variant: Variant) -> bool:
    """Whether the variant's layers have running statistics that PreciseBN and the batch-stats
    probe change (not GroupNorm, not frozen BatchNorm: those two evaluations equal the first)."""
    return bool(variant.norm_batch)


def table(jobs: Mapping[Variant, Sequence[Job]]) -> str:
    """The results table (markdown): per variant, mAP and mAP50 per evaluation, wall time.
    Evaluations that cannot differ from EMA (GroupNorm, frozen BN) read ``n/a``."""
    head = ["variant", "norm. batch", "seeds"]
    for _, name in EVALS:
        head += [f"mAP {name}", f"mAP50 {name}"]
    head += ["wall time / job"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, runs in jobs.items():
        cells = [variant.label, norm_batch_text(variant), str(len(runs))]
        for key, _ in EVALS:
            for metric in ("mAP", "mAP50"):
                applies = key == "ema" or _has_batch_stats(variant)
                cells.append(_cell([j.scores[key][metric] for j in runs]) if applies else "n/a")
        mean_wall, _ = spread([j.wall_s for j in runs])
        cells.append(f"{mean_wall:.0f} s")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def family_tables(jobs: Mapping[Variant, Sequence[Job]]) -> str:
    """:func:`table` per family of variants (:data:`~.variants.FAMILIES`), each under its title."""
    parts = []
    for family, title in FAMILIES.items():
        members = {v: runs for v, runs in jobs.items() if v.family == family}
        if members:
            parts += [f"### {title}", "", table(members), ""]
    return "\n".join(parts).rstrip()


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
        if not runs or not _has_batch_stats(variant):
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


def pretraining(runs_dir: Path, seeds: Sequence[int]) -> list[dict[str, Any]]:
    """The backbone pretraining jobs of ``seeds`` that finished: final ``val/acc`` (points),
    optimizer steps and wall time."""
    out = []
    for seed in seeds:
        run_dir = runs_dir / PRETRAIN / f"seed{seed}"
        try:
            results = json.loads((run_dir / "results.json").read_text())
            record = json.loads((run_dir / RECORD_FILE).read_text())
        except (OSError, ValueError):
            continue
        acc = _points(results["final"]["val/acc"])
        out.append(
            {
                "seed": seed,
                "val_acc": round(acc, 2),
                "steps": int(results["global_step"]),
                "wall_s": float(record["wall_s"]),
            }
        )
    return out


def knee_section(jobs: Mapping[Variant, Sequence[Job]]) -> tuple[list[str], dict[str, Any]]:
    """The report's lines on the norm-batch sweep and its knee, and their ``results.json``
    entry (``{}`` when the sweep did not run)."""
    points = sweep_points(jobs)
    if not points:
        return [], {}
    found = knee(points)
    lines = ["## The knee of the norm-batch sweep", ""]
    for batch, per in sorted(points.items()):
        means = ", ".join(f"{n} img: {per[n][0]:.2f} ± {per[n][1]:.2f}" for n in sorted(per))
        lines.append(f"* global batch {batch}: mAP (EMA) by norm. batch: {means}")
    lines += [
        "",
        f"Knee: **{found}** images per normalization (rule: the smallest norm. batch from "
        f"which no larger one at the same global batch is better by more than "
        f"{KNEE_TOLERANCE:g} point and {KNEE_SIGMAS:g} standard errors).",
        "",
    ]
    entry = {
        "norm_batch": found,
        "tolerance_points": KNEE_TOLERANCE,
        "sigmas": KNEE_SIGMAS,
        "points": {
            str(b): {
                str(n): [round(m, 4), round(sd, 4), k] for n, (m, sd, k) in sorted(per.items())
            }
            for b, per in sorted(points.items())
        },
    }
    return lines, entry


def _source(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Where a variant's numbers come from: the command, preset overrides and machine."""
    return {
        "command": meta.get("command"),
        "preset_overrides": list(meta.get("preset_overrides", [])),
        "machine": dict(meta.get("machine", {})),
    }


def published(
    results_file: Path, skip: Sequence[Variant], seeds: Sequence[int]
) -> tuple[dict[Variant, list[Job]], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The numbers an earlier report published for the variants not in ``skip``: their jobs
    (without curves; :data:`~.variants.VARIANTS` order), each variant's ``source``, and the
    pretraining entries. A variant is kept only with a job for every seed of ``seeds``, no more
    (another seed list is another report). ``({}, {}, [])`` without a readable file.
    """
    try:
        raw = json.loads(results_file.read_text())
    except (OSError, ValueError):
        return {}, {}, []
    entries = raw.get("variants", {})
    skipped = {v.name for v in skip}
    kept: dict[Variant, list[Job]] = {}
    sources: dict[str, dict[str, Any]] = {}
    for v in VARIANTS:
        entry = entries.get(v.name)
        if v.name in skipped or not entry:
            continue
        if sorted(j["seed"] for j in entry["jobs"]) != sorted(seeds):
            continue
        by_seed = {j["seed"]: j for j in entry["jobs"]}
        kept[v] = [
            Job(
                s,
                by_seed[s]["scores"],
                float(by_seed[s]["wall_s"]),
                int(by_seed[s]["steps"]),
                extra=dict(by_seed[s].get("extra", {})),
            )
            for s in seeds
        ]
        sources[v.name] = entry.get("source") or _source(raw)
    pretrain = [p for p in raw.get("pretrain", []) if p["seed"] in seeds]
    return kept, sources, pretrain


def write_report(
    runs_dir: Path,
    docs_dir: Path,
    *,
    variants: Sequence[Variant],
    seeds: Sequence[int],
    meta: Mapping[str, Any],
    keep_published: bool = True,
) -> str:
    """Write ``docs_dir/results.md``, ``results.json`` and the PNGs; return the markdown.

    ``variants`` are read from ``runs_dir``; with ``keep_published`` the variants that
    ``docs_dir/results.json`` already holds for ``seeds`` and that are not among ``variants``
    stay in the report with their published numbers (:func:`published`). The PNGs drawn from
    every variant's curves are then left as they are (a kept variant has no curves); the
    accumulation family's figure is drawn from its jobs whenever they have curves.
    """
    ran = collect(runs_dir, variants, seeds)
    kept, sources, kept_pretrain = (
        published(docs_dir / "results.json", variants, seeds) if keep_published else ({}, {}, [])
    )
    jobs = {v: ran[v] if v in ran else kept[v] for v in VARIANTS if v in ran or v in kept}
    jobs.update({v: r for v, r in ran.items() if v not in jobs})  # variants not in VARIANTS
    for v in ran:
        sources[v.name] = _source(meta)
    docs_dir.mkdir(parents=True, exist_ok=True)
    generic = {v: r for v, r in jobs.items() if v.family != ACCUMULATION}
    if generic and not any(v in kept for v in generic):
        plot(generic, docs_dir)
    family = {v: r for v, r in ran.items() if v.family == ACCUMULATION and r}
    if family and all(j.curves for r in family.values() for j in r):
        accumulation_figure(family, docs_dir / "accumulation.png")
    checked = goals(jobs)
    pretrained = pretraining(runs_dir, seeds) if any(v.pretrained for v in jobs) else []
    if not pretrained and any(v.pretrained for v in kept):
        pretrained = kept_pretrain
    knee_lines, knee_entry = knee_section(jobs)
    acc_lines, acc_entry = accumulation_section(jobs)
    rows = choice_rows(jobs)
    total = sum(j.wall_s for runs in jobs.values() for j in runs)
    total += sum(p["wall_s"] for p in pretrained)
    count = sum(len(r) for r in jobs.values()) + len(pretrained)
    by_source = _wall_by_source(jobs, sources, pretrained, kept_pretrain, meta)
    m = meta["machine"]
    if len(by_source) > 1:
        timing = f"Training time of the {count} jobs: {total / 60:.1f} min in all: " + "; ".join(
            f"{s['jobs']} by `{s['command']}` on {_machine_text(s['machine'])}: "
            f"{s['training_wall_s'] / 60:.1f} min" + (" (kept from the previous results file)"
                                                     if s["kept"] else "")
            for s in by_source
        ) + "."  # fmt: skip
    else:
        timing = f"Training time of the {count} jobs: {total / 60:.1f} min."
    lines = [
        "# Small-batch detection experiment: results",
        "",
        f"Command: `{meta['command']}` (preset `{meta['preset']}`). "
        f"Machine: {_machine_text(m)}. {timing}",
        "",
        "mAP in points, mean ± sample std over seeds " + ", ".join(map(str, seeds)) + ".",
        "",
        family_tables(jobs),
        "",
        *(
            [
                "Backbone pretraining (`recipe=backbone_pretrain`, one per seed), final val "
                "accuracy: "
                + ", ".join(f"seed {p['seed']}: {p['val_acc']:.1f}%" for p in pretrained)
                + f" ({pretrained[0]['steps']} steps, about "
                f"{sum(p['wall_s'] for p in pretrained) / len(pretrained):.0f} s each).",
                "",
            ]
            if pretrained
            else []
        ),
        *knee_lines,
        *acc_lines,
        "## What each choice costs",
        "",
        choice_table(rows),
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
        "training_wall_by_source": by_source,
        "kept_variants": [v.name for v in jobs if v in kept],
        "goals": checked,
        "knee": knee_entry,
        "accumulation": acc_entry,
        "choice": rows,
        "pretrain": pretrained,
        "variants": {
            v.name: {
                "label": v.label,
                "overrides": list(v.overrides),
                "norm_batch": v.norm_batch,
                "family": v.family,
                "global_batch": v.global_batch,
                "pretrained": v.pretrained,
                "source": sources[v.name],
                "jobs": [
                    {
                        "seed": j.seed,
                        "scores": j.scores,
                        "wall_s": j.wall_s,
                        "steps": j.steps,
                        **({"extra": j.extra} if j.extra else {}),
                    }
                    for j in runs
                ],
            }
            for v, runs in jobs.items()
        },
    }
    (docs_dir / "results.json").write_text(json.dumps(raw, indent=1) + "\n")
    return text


def _machine_text(m: Mapping[str, Any]) -> str:
    return (
        f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('memory')}, {m.get('gpu')}; "
        f"Python {m.get('python')}, torch {m.get('torch')}, lightning {m.get('lightning')}"
    )


def _wall_by_source(
    jobs: Mapping[Variant, Sequence[Job]],
    sources: Mapping[str, Mapping[str, Any]],
    pretrained: Sequence[Mapping[str, Any]],
    kept_pretrain: Sequence[Mapping[str, Any]],
    meta: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """The jobs' count and summed wall time per source (command and machine), in order of
    appearance; the pretraining jobs count with the source of the first pretrained variant."""
    out: dict[str, dict[str, Any]] = {}
    now = json.dumps(_source(meta), sort_keys=True)

    def add(source: Mapping[str, Any], n: int, wall: float) -> None:
        key = json.dumps(source, sort_keys=True)
        entry = out.setdefault(
            key,
            {
                "command": source.get("command"),
                "machine": source.get("machine", {}),
                "kept": key != now,
                "jobs": 0,
                "training_wall_s": 0.0,
            },
        )
        entry["jobs"] += n
        entry["training_wall_s"] = round(entry["training_wall_s"] + wall, 1)

    for v, runs in jobs.items():
        add(sources[v.name], len(runs), sum(j.wall_s for j in runs))
    if pretrained:
        first = next(v for v in jobs if v.pretrained)
        source = sources[first.name] if pretrained is kept_pretrain else _source(meta)
        add(source, len(pretrained), sum(p["wall_s"] for p in pretrained))
    return list(out.values())
