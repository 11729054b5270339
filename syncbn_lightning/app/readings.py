"""What to conclude from each panel of a run: one line computed from the run's numbers.

:func:`reading` turns the metrics one panel draws (``metrics.jsonl``, as :mod:`.report` reads it)
into a sentence such as ``norm batch 4 < 16: statistics noisy; raise the batch per device or the
number of devices``. The PNG report prints it under each figure's title (and stores it in the PNG's
``Description``), the W&B run's charts carry it in their titles and the run summary under
``readings/<panel>``; :data:`RULES` states the thresholds in words for the W&B dashboard's
panel descriptions and ``docs/dashboards.md`` (``tests/test_report.py`` checks the doc quotes
them). The thresholds are module constants.

A batch size or a count is read at the last measurement; a statistic that is noisy from one
measurement to the next (drift, divergence, gap: at 2 samples per normalization the train/test
gap jumps between 0.2 and 1.0) is read as the median of the last half of its measurements, the
state the run ended in, and the drift's trend as that against the median of its first quarter.
The ``bn/*`` statistics are in units of the running standard deviation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from syncbn_lightning.distributed.group_sizes import DEFAULT_TARGET_NORM_BATCH, norm_batch_verdict

__all__ = [
    "DIVERGENCE_AGREE",
    "DRIFT_SETTLED",
    "GAP_LARGE",
    "GAP_SMALL",
    "RULES",
    "reading",
]

Points = Sequence[tuple[int, float]]

#: The running statistics have settled when their drift fell to this fraction of its first
#: measurement.
DRIFT_SETTLED = 0.3
#: Sync groups agree when their running means are less than this far apart.
DIVERGENCE_AGREE = 0.05
#: Train/test gap (batch vs running mean, worst layer): below GAP_SMALL evaluation normalizes as
#: training did; from GAP_LARGE on it does not.
GAP_SMALL = 0.1
GAP_LARGE = 0.3

#: The thresholds of each panel's reading, in words.
RULES: dict[str, str] = {
    "batch_size": f"norm batch below bn.target_norm_batch (default {DEFAULT_TARGET_NORM_BATCH}): "
    f"statistics noisy; from it: enough; from twice it: reliable (the callback's warning says the "
    f"same)",
    "samples_seen": "samples trained on, and per optimizer step",
    "drift": f"bn/drift_mean_avg (median of the last half against the first quarter): settled "
    f"at <= {DRIFT_SETTLED:.0%} of its start; still settling above that; still moving if it "
    "did not fall",
    "divergence": f"bn/divergence_max (median of the last half) 0: one set of running "
    f"statistics; < {DIVERGENCE_AGREE}: groups agree; >= {DIVERGENCE_AGREE}: groups disagree",
    "nonfinite": "0: every update finite; > 0: updates skipped for NaN/inf",
    "gap": f"bn/gap_mean_max (median of the last half) < {GAP_SMALL}: evaluation normalizes as "
    f"training did; {GAP_SMALL}-{GAP_LARGE}: moderate; >= {GAP_LARGE}: evaluation statistics off",
    "map": "the validation metric at the end and at its best",
    "loss": "train/loss at the end as a fraction of its first value",
}


def _finite(points: Points | None) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, v in points or () if math.isfinite(v)]


def _last(metrics: Mapping[str, Points], *names: str) -> tuple[str, float] | None:
    """The first of ``names`` with a finite value, and its last value."""
    for name in names:
        points = _finite(metrics.get(name))
        if points:
            return name, points[-1][1]
    return None


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _ending(metrics: Mapping[str, Points], *names: str) -> tuple[str, float] | None:
    """The first of ``names`` with a finite value, and the median of its last half."""
    for name in names:
        points = _finite(metrics.get(name))
        if points:
            return name, _median([v for _, v in points[len(points) // 2 :]])
    return None


def _batch_size(metrics: Mapping[str, Points]) -> str | None:
    found = _last(metrics, "bn/norm_batch_size")
    if found is None:
        return None
    total = _last(metrics, "bn/global_batch_size")
    # The run's own target (logged by SyncBNCallback), the default for runs from before it was.
    target = _last(metrics, "bn/target_norm_batch")
    return norm_batch_verdict(
        found[1],
        total[1] if total is not None else None,
        round(target[1]) if target is not None else DEFAULT_TARGET_NORM_BATCH,
    ).text


def _samples_seen(metrics: Mapping[str, Points]) -> str | None:
    points = _finite(metrics.get("bn/samples_seen"))
    if not points:
        return None
    step, samples = points[-1]
    if step <= 0:
        return f"{samples:,.0f} samples trained on"
    return f"{samples:,.0f} samples trained on in {step} steps ({samples / step:.0f} per step)"


def _drift(metrics: Mapping[str, Points]) -> str | None:
    for name in ("bn/drift_mean_avg", "bn/drift_mean_max"):
        points = [(s, v) for s, v in _finite(metrics.get(name)) if v >= 0]
        if points:
            break
    else:
        return None
    values = [v for _, v in points]
    start = _median(values[: max(1, len(values) // 4)])
    if len(points) < 2 or start <= 0:
        return f"{len(points)} measurement(s) of {name}: no trend yet"
    ratio = _median(values[len(values) // 2 :]) / start
    if ratio <= DRIFT_SETTLED:
        return f"{name} fell to {ratio:.0%} of its start: running statistics settled"
    if ratio < 1:
        return f"{name} fell to {ratio:.0%} of its start: still settling, train longer"
    return f"{name} did not fall ({ratio:.1f}x its start): running statistics still moving"


def _divergence(metrics: Mapping[str, Points]) -> str | None:
    found = _ending(metrics, "bn/divergence_max", "bn/divergence_avg")
    if found is None:
        return None
    name, value = found
    if value <= 0:
        return f"{name} 0: every rank holds the same running statistics"
    if value < DIVERGENCE_AGREE:
        return f"{name} {value:.3g} < {DIVERGENCE_AGREE}: the sync groups agree"
    return (
        f"{name} {value:.3g} >= {DIVERGENCE_AGREE}: the sync groups disagree; reconcile "
        f"(bn.reconcile) or sync larger groups"
    )


def _nonfinite(metrics: Mapping[str, Points]) -> str | None:
    found = _last(metrics, "bn/nonfinite_skipped")
    if found is None:
        return None
    skipped = round(found[1])
    if skipped == 0:
        return "no running-stat update skipped: batch statistics finite throughout"
    return f"{skipped} running-stat updates skipped for NaN/inf: check the data and learning rate"


def _gap(metrics: Mapping[str, Points]) -> str | None:
    found = _ending(metrics, "bn/gap_mean_max", "bn/gap_mean_avg")
    if found is None:
        return None
    name, value = found
    if value < GAP_SMALL:
        return f"{name} {value:.3g} < {GAP_SMALL}: evaluation normalizes as training did"
    if value < GAP_LARGE:
        return f"{name} {value:.3g}: moderate train/test gap ({GAP_SMALL}-{GAP_LARGE})"
    return (
        f"{name} {value:.3g} >= {GAP_LARGE}: evaluation statistics off; raise the norm batch "
        f"or use PreciseBN (bn.precise_bn_batches)"
    )


def _validation(metrics: Mapping[str, Points]) -> str | None:
    for name in ("val/mAP", "val/acc", "val/mAP50"):
        points = _finite(metrics.get(name))
        if points:
            break
    else:
        return None
    last = points[-1][1]
    best_step, best = max(points, key=lambda p: p[1])
    text = f"{name} {last:.3g} at the end"
    if best > last:
        text += f", best {best:.3g} at step {best_step}"
    return text + f" ({len(points)} validation{'s' if len(points) > 1 else ''})"


def _loss(metrics: Mapping[str, Points]) -> str | None:
    names = ["train/loss", *sorted(n for n in metrics if n.startswith("train/"))]
    for name in names:
        points = _finite(metrics.get(name))
        if len(points) >= 2 and points[0][1] > 0:
            ratio = points[-1][1] / points[0][1]
            return f"{name} {points[0][1]:.3g} -> {points[-1][1]:.3g} ({ratio:.0%} of its start)"
    return None


_READERS: dict[str, Callable[[Mapping[str, Points]], str | None]] = {
    "batch_size": _batch_size,
    "samples_seen": _samples_seen,
    "drift": _drift,
    "divergence": _divergence,
    "nonfinite": _nonfinite,
    "gap": _gap,
    "map": _validation,
    "loss": _loss,
}


def reading(panel: str, metrics: Mapping[str, Points]) -> str | None:
    """The one-line reading of panel ``panel`` (its name: ``"batch_size"``, ``"gap"``, ...) for
    one job's ``metrics`` (name -> ``(step, value)`` points); ``None`` when the panel has no
    reading or its metrics have no finite value.

    Example:
        >>> reading("batch_size", {"bn/norm_batch_size": [(10, 4.0)],
        ...                        "bn/global_batch_size": [(10, 16.0)]})
        'norm batch 4 of 16 (global batch) < 16: statistics noisy; sync more ranks'
    """
    reader = _READERS.get(panel)
    return reader(metrics) if reader is not None else None
