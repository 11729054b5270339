"""One finished job's numbers, and the mean ± std over seeds every table uses."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Job", "spread"]


@dataclass
class Job:
    """One finished job's numbers: ``scores[eval][metric]`` in points, wall time, curves, and
    ``extra``: the running-statistics probe's numbers and curve tails (absent for jobs of
    results files written before them)."""

    seed: int
    scores: dict[str, dict[str, float]]
    wall_s: float
    steps: int
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)


def spread(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, sample std)``; the std is 0 for a single value and NaN for none."""
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0
