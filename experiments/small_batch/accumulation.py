"""The gradient-accumulation family: its metrics, named before the runs, and their reading rule.

The family (:data:`.variants.FAMILIES` ``"accumulation"``) trains the global-batch-8 recipe as
2 processes x 1 image x 4 micro-batches per optimizer step, with the running statistics of
BatchNorm updated as torch does it (one update per micro-batch, ``bn.step_statistics=null``),
once per optimizer step (``micro``), or once per step with every micro-batch normalized over the
step's micro-batches so far (``step``), against 2 processes x 4 images without accumulation.

Metrics (:data:`METRICS`; ``docs/small-batch.md`` lists them with their reading):

* primary: ``val/mAP`` evaluated with the running statistics training left (EMA);
* secondary: the running statistics' error against population statistics (the job's PreciseBN
  mAP minus its EMA mAP, and :func:`.runner.running_stat_probe`'s per-layer relative error of the
  EMA statistics), and the train/test gap (``bn/gap_mean_avg``, ``bn/gap_std_avg`` of
  :class:`~syncbn_lightning.SyncBNCallback`, averaged over the last 100 optimizer steps).

The rule (:func:`finding`): a paired difference (per seed, the same seed of two variants; the
seeds share initialization and data order) counts as a finding only when the three per-seed
differences have the same sign and their mean exceeds twice the larger of the two variants' seed
standard deviations (and, for mAP, 1 point). Anything else reads "no finding".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .jobs import Job, spread
from .variants import Variant

__all__ = [
    "BASELINES",
    "FAMILY",
    "METRICS",
    "TAIL_STEPS",
    "Metric",
    "accumulation_section",
    "finding",
    "paired",
]

FAMILY = "accumulation"

TAIL_STEPS = 100
"""The ``bn/*`` curves are read as their mean over the last 100 optimizer steps of a job."""

BASELINES = ("acc_torch", "sync_2x4")
"""The variants every other one of the family is compared with, seed by seed."""


@dataclass(frozen=True)
class Metric:
    """One number per job: its key (``results.json``), column name, value, decimals, and the
    smallest mean difference that can count as a finding (besides the spread rule)."""

    key: str
    name: str
    value: Callable[[Job], float]
    digits: int
    floor: float = 0.0
    primary: bool = False


def _extra(key: str) -> Callable[[Job], float]:
    return lambda j: float(j.extra.get(key, math.nan))


METRICS: tuple[Metric, ...] = (
    Metric("map_ema", "mAP EMA", lambda j: j.scores["ema"]["mAP"], 1, 1.0, primary=True),
    Metric("map_precise", "mAP PreciseBN", lambda j: j.scores["precise"]["mAP"], 1, 1.0),
    Metric(
        "precise_minus_ema",
        "PreciseBN - EMA (mAP)",
        lambda j: j.scores["precise"]["mAP"] - j.scores["ema"]["mAP"],
        2,
        1.0,
    ),
    Metric("stat_err_mean", "stat. error, mean", _extra("stat_err_mean_avg"), 3),
    Metric("stat_err_std", "stat. error, std", _extra("stat_err_std_avg"), 3),
    Metric("gap_mean", "gap mean (last 100)", _extra("gap_mean_last100"), 3),
    Metric("gap_std", "gap std (last 100)", _extra("gap_std_last100"), 3),
)
"""The family's metrics, in the tables' order; the first is the primary one."""


def _fmt(value: float, digits: int, sign: bool = False) -> str:
    if not math.isfinite(value):
        return "n/a"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _cell(values: Sequence[float], digits: int, sign: bool = False) -> str:
    if not values or not all(map(math.isfinite, values)):
        return "n/a"
    mean, std = spread(values)
    return f"{_fmt(mean, digits, sign)} ± {std:.{digits}f}"


def finding(a: Sequence[float], b: Sequence[float], floor: float = 0.0) -> bool:
    """Whether ``a`` differs from ``b`` (the same seeds, in the same order) by the rule: every
    per-seed difference of one sign, and the mean difference larger than ``floor`` and than twice
    the larger seed standard deviation of the two."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    if len(diffs) < 2 or not all(map(math.isfinite, diffs)):
        return False
    if not (all(d > 0 for d in diffs) or all(d < 0 for d in diffs)):
        return False
    mean = sum(diffs) / len(diffs)
    spread_ab = max(spread(a)[1], spread(b)[1])
    return abs(mean) > max(floor, 2.0 * spread_ab)


def paired(
    jobs: Mapping[Variant, Sequence[Job]], name: str, base: str, metric: Metric
) -> dict[str, Any] | None:
    """``name`` minus ``base`` on ``metric``, seed by seed (the seeds both ran): the per-seed
    differences, their mean and sample std, and whether it is a finding; ``None`` when either
    variant did not run or a job lacks the metric."""
    runs = {v.name: {j.seed: j for j in r} for v, r in jobs.items()}
    if name not in runs or base not in runs:
        return None
    seeds = sorted(set(runs[name]) & set(runs[base]))
    if not seeds:
        return None
    a = [metric.value(runs[name][s]) for s in seeds]
    b = [metric.value(runs[base][s]) for s in seeds]
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    if not all(map(math.isfinite, diffs)):
        return None  # a job without the metric (probed before it existed)
    mean, std = spread(diffs)
    return {
        "seeds": seeds,
        "diffs": diffs,
        "mean": mean,
        "std": std,
        "finding": finding(a, b, metric.floor),
    }


def accumulation_section(
    jobs: Mapping[Variant, Sequence[Job]],
) -> tuple[list[str], dict[str, Any]]:
    """The report's lines on the accumulation family (the metrics per variant, mean ± std, and
    the paired differences against :data:`BASELINES`), and their ``results.json`` entry;
    ``([], {})`` when none of the family ran."""
    members = {v: r for v, r in jobs.items() if v.family == FAMILY and r}
    if not members:
        return [], {}
    head = ["variant", *(m.name for m in METRICS), "num_batches_tracked", "steps"]
    lines = [
        "## Gradient accumulation: the pre-registered metrics",
        "",
        "Mean ± sample std over seeds. Primary: mAP EMA. Secondary: PreciseBN - EMA and the "
        "probe's error of the EMA statistics against population statistics (per layer, "
        "averaged over channels and layers: |mean difference| / population std, and "
        "|std ratio - 1|), and the train/test gap `bn/gap_mean_avg`, `bn/gap_std_avg` "
        f"(mean over the last {TAIL_STEPS} optimizer steps).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    entry: dict[str, Any] = {"metrics": [m.key for m in METRICS], "variants": {}, "paired": {}}
    for v, runs in members.items():
        cells = [v.label]
        stats: dict[str, Any] = {}
        for m in METRICS:
            values = [m.value(j) for j in runs]
            cells.append(_cell(values, m.digits))
            if all(map(math.isfinite, values)):
                mean, std = spread(values)
                stats[m.key] = {"mean": mean, "std": std, "values": values}
        tracked = sorted(
            {int(j.extra[k]) for j in runs for k in ("num_batches_tracked_min",
                                                     "num_batches_tracked_max") if k in j.extra}
        )  # fmt: skip
        cells.append(", ".join(map(str, tracked)) or "n/a")
        cells.append(", ".join(map(str, sorted({j.steps for j in runs}))))
        stats["num_batches_tracked"] = tracked
        stats["steps"] = sorted({j.steps for j in runs})
        entry["variants"][v.name] = stats
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Paired differences (variant minus baseline, seed by seed): mean ± std of the per-seed "
        "differences, then each seed's. **finding**: the rule holds (every seed's difference "
        "of one sign, the mean beyond twice the larger seed std of the two variants and, for "
        "mAP, beyond 1 point); otherwise the difference is inside the seed spread: no finding.",
        "",
    ]
    head = ["variant - baseline", *(m.name for m in METRICS)]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    names = [v.name for v in members]
    done: set[frozenset[str]] = set()
    for base in BASELINES:
        for name in names:
            pair = frozenset((name, base))
            if name == base or base not in names or pair in done:
                continue  # one row per pair: sync_2x4 - acc_torch, not its negative as well
            done.add(pair)
            row = [f"{name} - {base}"]
            for m in METRICS:
                p = paired(members, name, base, m)
                if p is None:
                    row.append("n/a")
                    continue
                entry["paired"].setdefault(f"{name} - {base}", {})[m.key] = p
                each = ", ".join(_fmt(d, m.digits, sign=True) for d in p["diffs"])
                cell = f"{_fmt(p['mean'], m.digits, sign=True)} ± {p['std']:.{m.digits}f} ({each})"
                row.append(cell + (" **finding**" if p["finding"] else ""))
            lines.append("| " + " | ".join(row) + " |")
    return [*lines, ""], entry


def tail_mean(curve: Sequence[tuple[int, float]], last_step: int) -> float:
    """Mean of a curve's finite values over the last :data:`TAIL_STEPS` optimizer steps."""
    values = [v for s, v in curve if s > last_step - TAIL_STEPS and math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan
