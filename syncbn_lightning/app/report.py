"""PNG report of a training run (or a Hydra multirun sweep) from its metrics history.

Every job of ``syncbn-train`` writes ``<output_dir>/metrics.jsonl`` (every metric Lightning logged,
with its step), whatever loggers are configured: ``logger=wandb`` alone, ``csv`` or ``none``. This
module reads every such file below a run directory and draws one figure per panel, step on the x
axis. Directories without any ``metrics.jsonl`` (older runs) are read from Lightning's
``CSVLogger`` ``metrics.csv`` files instead (:mod:`.metrics_csv`).

Usage::

    syncbn-report RUN_DIR [--out DIR]        # or: python -m syncbn_lightning.app.report ...

or from Python ``render(run_dir, out_dir=None)``. ``RUN_DIR`` is a job's output directory or a
Hydra multirun sweep directory (``multirun/<date>/<time>/`` holding ``0/``, ``1/``, ...). With
several jobs every line's label starts with the job's label: the overrides that set the jobs of a
Hydra sweep apart (``bn.group_size=2: val/mAP``, read from each job's ``.hydra/overrides.yaml``),
else its directory (``0: val/mAP``). The jobs of a sweep overlay in one figure: one colour per job,
one line style per metric. Figures go to ``DIR`` (default ``RUN_DIR/report/``); a panel with no
data writes no file. Under its title each figure states what to conclude, one line per job
computed from its numbers (:mod:`.readings`), also stored as the PNG's ``Description``. Every
``syncbn-train`` job writes its report at the end (``report: true``).

PNGs (the line panels of :data:`~.panels.SECTIONS`, also the W&B dashboard's; see
``docs/dashboards.md``):
    * ``batch_size.png``: ``bn/global_batch_size`` (samples normalized together per optimizer step,
      summed over ranks) and ``bn/norm_batch_size`` (the smallest group any BatchNorm normalized
      over): the effective batch sizes that SyncBatchNorm produced.
    * ``samples_seen.png``: ``bn/samples_seen``, samples trained on so far.
    * ``drift.png`` (log y): ``bn/drift_mean_*``, ``bn/drift_var_*``: how far the running
      statistics moved since the previous measurement, worst layer (``_max``) and mean (``_avg``).
    * ``divergence.png`` (log y): ``bn/divergence_*``, how far the ranks' running means are apart
      (exactly 0 when every rank syncs with every other).
    * ``nonfinite.png``: ``bn/nonfinite_skipped``, running-stat updates skipped for NaN/inf.
    * ``gap.png`` (log y): ``bn/gap_mean_*`` and ``bn/gap_std_*``, the train/test inconsistency
      between the last synchronized batch statistics and the running statistics.
    * ``map.png``: validation quality, ``val/mAP``, ``val/mAP50`` and ``val/acc``.
    * ``loss.png``: every ``train/*`` metric (the training losses).

All ``bn/*`` statistics are dimensionless (units of the running standard deviation, see
:mod:`syncbn_lightning.nn.running_stats`). On log panels points that are not positive (a divergence
of exactly 0) are kept: the axis becomes ``symlog`` with its linear range below the smallest
positive value, so zeros sit at the bottom instead of vanishing. Non-finite values (``inf``,
``nan``) are not drawn.

:data:`PANELS` and :func:`panel_series` are public so that other front ends (the W&B run charts)
draw the same panels. Importing this module is cheap: it imports neither Lightning nor Hydra, and
matplotlib only when a figure is drawn.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .metrics_csv import Series, find_metrics_files, read_history, read_metrics, read_run
from .panels import PANELS, Panel, panel_metrics
from .readings import reading

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "PANELS",
    "Panel",
    "Series",
    "find_metrics_files",
    "main",
    "panel_lines",
    "panel_readings",
    "panel_series",
    "read_history",
    "read_metrics",
    "read_run",
    "render",
]

log = logging.getLogger(__name__)

_MARKER_MAX_POINTS = 40  # draw point markers on sparse lines (e.g. one val/mAP per epoch)
_LINE_STYLES = ("-", "--", ":", "-.")


def panel_series(panel: Panel, metrics: Mapping[str, Sequence[tuple[int, float]]]) -> Series:
    """The metrics of ``metrics`` that ``panel`` draws, with its patterns resolved.

    Each entry of ``panel.metrics`` is looked up as an exact name first, then as an
    :func:`fnmatch.fnmatchcase` pattern (whose matches are taken in sorted order). Metrics without
    points are left out; a metric matched twice appears once.

    Args:
        panel: The panel, e.g. one of :data:`PANELS`.
        metrics: Metric name -> ``(step, value)`` points, e.g. from :func:`read_metrics` or a W&B
            run history.

    Returns:
        Metric name -> points (copied lists), in the panel's order; empty when the panel has no
        data.

    Example:
        >>> loss = next(p for p in PANELS if p.name == "loss")
        >>> panel_series(loss, {"val/mAP": [(0, 0.5)], "train/loss": [(0, 1.0)]})
        {'train/loss': [(0, 1.0)]}
    """
    return {
        name: [(int(s), float(v)) for s, v in metrics[name]]
        for name in panel_metrics(panel, metrics)
        if len(metrics[name]) > 0
    }


@dataclass(frozen=True)
class _Line:
    job: str
    metric: str
    points: list[tuple[int, float]]

    @property
    def label(self) -> str:
        return f"{self.job}: {self.metric}" if self.job else self.metric


def _lines(
    panel: Panel, runs: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]]
) -> list[_Line]:
    return [
        _Line(job, metric, points)
        for job, metrics in runs.items()
        for metric, points in panel_series(panel, metrics).items()
    ]


def panel_lines(
    panel: Panel, runs: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]]
) -> Series:
    """The lines of ``panel`` over the jobs of ``runs``, keyed by their legend labels.

    Args:
        panel: The panel to draw.
        runs: Job label -> metrics, e.g. from :func:`read_run`. A job labelled ``""`` (a single
            run) gives bare metric names as labels; others give ``"<job>: <metric>"``.

    Returns:
        Legend label -> points, jobs in ``runs`` order and metrics in panel order.

    Example:
        >>> mAP = next(p for p in PANELS if p.name == "map")
        >>> panel_lines(mAP, {"0": {"val/mAP": [(9, 0.3)]}, "1": {"val/mAP": [(9, 0.4)]}})
        {'0: val/mAP': [(9, 0.3)], '1: val/mAP': [(9, 0.4)]}
    """
    return {line.label: line.points for line in _lines(panel, runs)}


def panel_readings(
    panel: Panel, runs: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]]
) -> list[str]:
    """The reading of ``panel`` for each job of ``runs`` (:func:`.readings.reading`), prefixed
    with the job's label when there are several; jobs without one are left out.

    Example:
        >>> gap = next(p for p in PANELS if p.name == "gap")
        >>> panel_readings(gap, {"": {"bn/gap_mean_max": [(5, 0.8), (9, 0.04)]}})
        ['bn/gap_mean_max 0.04 < 0.1: evaluation normalizes as training did']
    """
    found = []
    for job, metrics in runs.items():
        text = reading(panel.name, metrics)
        if text is not None:
            found.append(f"{job}: {text}" if job else text)
    return found


def _y_scale(values: Sequence[float]) -> tuple[str, dict[str, Any]]:
    """``(scale, kwargs)`` for ``Axes.set_yscale`` on a log panel with these (finite) values.

    ``log`` when every value is positive; ``symlog`` with its linear range below the smallest
    positive magnitude when some are not (zeros stay visible); ``linear`` when none is positive.
    """
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values):
        return "log", {}
    magnitudes = [abs(v) for v in values if v != 0]
    if not positive or not magnitudes:
        return "linear", {}
    return "symlog", {"linthresh": min(magnitudes)}


def _figure(panel: Panel, lines: Sequence[_Line], readings: Sequence[str] = ()) -> Figure:
    """Draw ``lines`` into a new Agg-backed figure (no pyplot, so no global backend state), with
    ``readings`` under the title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    jobs = list(dict.fromkeys(line.job for line in lines))
    metrics = list(dict.fromkeys(line.metric for line in lines))
    cycle = _color_cycle()
    finite_values: list[float] = []
    for i, line in enumerate(lines):
        points = [(s, v) for s, v in line.points if math.isfinite(v)]
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        finite_values.extend(values)
        # One line style per metric, so that equal series (global and norm batch size when the
        # whole world is one group) stay visible on top of each other; in a sweep one colour
        # per job, else one per metric.
        style = _LINE_STYLES[metrics.index(line.metric) % len(_LINE_STYLES)]
        color = cycle[(jobs.index(line.job) if len(jobs) > 1 else i) % len(cycle)]
        ax.plot(
            steps,
            values,
            label=line.label,
            color=color,
            linestyle=style,
            linewidth=2.4 if style == "-" else 1.3,
            marker="o" if len(points) <= _MARKER_MAX_POINTS else None,
            markersize=3,
        )
    if panel.log_y and finite_values:
        scale, kwargs = _y_scale(finite_values)
        ax.set_yscale(scale, **kwargs)
    if panel.from_zero and finite_values and min(finite_values) >= 0:
        ax.set_ylim(bottom=0, top=max(finite_values) * 1.1 or 1.0)
    if readings:
        fig.suptitle(panel.title)
        ax.set_title("\n".join(readings), fontsize="medium", style="italic")
    else:
        ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small", ncol=1 if len(ax.lines) <= 8 else 2)
    return fig


def _color_cycle() -> list[str]:
    import matplotlib as mpl

    colors = mpl.rcParams["axes.prop_cycle"].by_key().get("color")
    return list(colors) if colors else ["C0"]


def render(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    panels: Sequence[Panel] = PANELS,
) -> list[Path]:
    """Write one PNG per panel that has data for the run (or sweep) in ``run_dir``.

    Args:
        run_dir: A job's output directory or a multirun sweep directory; every
            ``metrics.jsonl`` below it is read, else every ``metrics.csv`` (see :func:`read_run`
            for how jobs are labelled).
        out_dir: Where the figures go, created if needed. Defaults to ``<run_dir>/report/``.
        panels: The panels to draw. Defaults to :data:`PANELS`.

    Returns:
        The written paths ``<out_dir>/<panel.name>.png``, in panel order. Panels without data (or
        with only non-finite values) are skipped and write nothing. Each figure carries its
        reading (:func:`panel_readings`) under the title and in the PNG's ``Description``.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist or holds no metrics file.
        ValueError: A ``metrics.csv`` is malformed.

    Example:
        >>> render("multirun/2024-05-01/12-00-00")  # doctest: +SKIP
        [PosixPath('multirun/2024-05-01/12-00-00/report/batch_size.png'), ...]
    """
    runs = read_run(run_dir)
    out = Path(run_dir) / "report" if out_dir is None else Path(out_dir)
    written: list[Path] = []
    for panel in panels:
        lines = [
            line for line in _lines(panel, runs) if any(math.isfinite(v) for _, v in line.points)
        ]
        if not lines:
            log.debug("panel %r: no data, skipped", panel.name)
            continue
        readings = panel_readings(panel, runs)
        fig = _figure(panel, lines, readings)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{panel.name}.png"
        # The readings also as the PNG's Description text chunk (PIL: Image.open(p).text).
        fig.savefig(path, metadata={"Title": panel.title, "Description": "\n".join(readings)})
        log.debug("wrote %s (%d lines)", path, len(lines))
        written.append(path)
    if not written:
        log.warning(
            "%s: no panel has data (metrics found: %s)",
            run_dir,
            sorted({m for metrics in runs.values() for m in metrics}),
        )
    return written


def main(argv: list[str] | None = None) -> int:
    """Command line: ``syncbn-report RUN_DIR [--out DIR]`` (or ``python -m`` this module).

    Args:
        argv: Arguments without the program name. Defaults to ``sys.argv[1:]``.

    Returns:
        0 after printing each written path; 2 after printing ``error: ...`` to stderr when
        ``RUN_DIR`` has no metrics (or a ``metrics.csv`` is malformed).
    """
    parser = argparse.ArgumentParser(
        prog="syncbn-report",
        description="Draw PNG figures of a run's (or a Hydra sweep's) metrics (metrics.jsonl, "
        "else CSVLogger metrics.csv).",
    )
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a job output directory or a multirun sweep directory (metrics.jsonl below it)",
    )
    parser.add_argument(
        "--out", metavar="DIR", default=None, help="output directory (default: RUN_DIR/report)"
    )
    args = parser.parse_args(argv)
    try:
        paths = render(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    if not paths:
        print(f"warning: no panel has data in {args.run_dir}; nothing written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
