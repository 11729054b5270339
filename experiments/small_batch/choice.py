"""Which normalization to use: the knee of the norm-batch sweep, and the choice table.

Read by :func:`.analysis.write_report` (``results.json["knee"]``, ``["choice"]``), by
``docs/choosing-normalization.md`` (its numbers) and by ``tests/test_choice_docs.py`` (which
checks that the page, the results file and ``target_norm_batch``'s default agree).

**The knee**: the smallest normalization batch ``n`` such that, among the BN/SyncBN variants
trained from scratch at each global batch, no variant with a normalization batch ``>= n`` is
*better* than the one with the smallest normalization batch ``>= n``, where better means a
seed-mean mAP (EMA) higher by more than :data:`KNEE_TOLERANCE` points *and* by more than
:data:`KNEE_SIGMAS` standard errors of the difference of the two means (the docs' standard: a
difference within about two seed std's is not a finding). Below the knee more images per
normalization still buy accuracy; from it on they only cost communication.

The significance half of the rule was added after the global-batch-8 results and the 4 x 8
local-BN results were in, and before the 4 x 8 SyncBN ones: with 3 seeds of 1-3 points std, a
bare 1-point threshold would have let one low seed move the knee (docs/choosing-normalization.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .jobs import Job, spread
from .variants import FAMILIES, Variant

__all__ = [
    "CHOICE_FAMILIES",
    "KNEE_SIGMAS",
    "KNEE_TOLERANCE",
    "Point",
    "better",
    "choice_rows",
    "choice_table",
    "knee",
    "norm_batch_text",
    "sweep_points",
]

KNEE_TOLERANCE = 1.0
"""Points of mAP a larger normalization batch must add to count as still improving ..."""

KNEE_SIGMAS = 2.0
"""... and standard errors of the difference of the seed means it must add."""

Point = tuple[float, float, int]
"""A variant's seed mean, sample std and number of seeds (mAP EMA, points)."""

SWEEP_FAMILIES = ("batchnorm", "sweep")
"""The families whose BatchNorm variants trained from scratch form the norm-batch sweep."""

CHOICE_FAMILIES = ("batchnorm", "sweep", "groupnorm", "pretrained")
"""The families of the choice table: which normalization to use. The gradient-accumulation
family answers another question (how running statistics are updated over micro-batches) and has
its own section (:mod:`.accumulation`)."""


def _stats(runs: Sequence[Job], key: str = "ema") -> tuple[float, float]:
    return spread([j.scores[key]["mAP"] for j in runs])


def sweep_points(jobs: Mapping[Variant, Sequence[Job]]) -> dict[int, dict[int, Point]]:
    """``{global batch: {normalization batch: (mean, std, seeds)}}`` of the sweep's variants
    (multi-process, from scratch; the one-process reference is not part of it)."""
    points: dict[int, dict[int, Point]] = {}
    for v, runs in jobs.items():
        if v.family in SWEEP_FAMILIES and v.norm_batch and runs and not v.one_process:
            points.setdefault(v.global_batch, {})[v.norm_batch] = (*_stats(runs), len(runs))
    return points


def better(a: Point, b: Point) -> bool:
    """Whether ``a`` is better than ``b`` by the knee's rule: its mean higher by more than
    :data:`KNEE_TOLERANCE` points and by more than :data:`KNEE_SIGMAS` standard errors."""
    (ma, sa, na), (mb, sb, nb) = a, b
    error = math.sqrt(sa * sa / na + sb * sb / nb)
    return ma - mb > max(KNEE_TOLERANCE, KNEE_SIGMAS * error)


def knee(points: Mapping[int, Mapping[int, Point]]) -> int:
    """The knee of the sweep (the module's rule) from :func:`sweep_points`.

    Raises:
        ValueError: when the sweep is empty.
    """
    sizes = sorted({n for per in points.values() for n in per})
    if not sizes:
        raise ValueError("the norm-batch sweep has no finished variant")
    for n in sizes:
        larger = [{m: p for m, p in per.items() if m >= n} for per in points.values()]
        if not any(better(p, at[min(at)]) for at in larger if at for p in at.values()):
            return n
    return sizes[-1]


def norm_batch_text(v: Variant) -> str:
    """The table's "norm. batch" cell of ``v``."""
    if v.norm_label is not None:
        return v.norm_label
    if v.norm_batch is None:
        return "per image (GN)"
    if v.norm_batch == 0:
        return "none (frozen)"
    return str(v.norm_batch)


def choice_rows(jobs: Mapping[Variant, Sequence[Job]]) -> list[dict[str, Any]]:
    """One row per variant of :data:`CHOICE_FAMILIES` with what a user weighs: mAP (EMA)
    mean ± std, wall time per job.

    The cells are the strings the docs print (``"41.8 ± 0.7"``), so a test can find each one in
    the page.
    """
    rows = []
    for v, runs in jobs.items():
        if not runs or v.family not in CHOICE_FAMILIES:
            continue
        mean, std = _stats(runs)
        wall = sum(j.wall_s for j in runs) / len(runs)
        rows.append(
            {
                "variant": v.name,
                "label": v.label,
                "family": v.family,
                "norm_batch": norm_batch_text(v),
                "global_batch": v.global_batch,
                "mAP": f"{mean:.1f} ± {std:.1f}",
                "mAP_mean": round(mean, 2),
                "wall_s": round(wall),
            }
        )
    return rows


def choice_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table of :func:`choice_rows`, grouped by family (the docs' table)."""
    lines = [
        "| setting | variant | norm. batch | global batch | mAP (EMA) | wall time / job |",
        "|---|---|---|---|---|---|",
    ]
    for family, title in FAMILIES.items():
        if family not in CHOICE_FAMILIES:
            continue
        for r in rows:
            if r["family"] == family:
                lines.append(
                    f"| {title} | {r['label']} | {r['norm_batch']} | {r['global_batch']} | "
                    f"{r['mAP']} | {r['wall_s']} s |"
                )
    return "\n".join(lines)
