"""Reading a run's metrics as per-metric ``(step, value)`` points; what :mod:`.report` draws.

Two sources below a job (or sweep) directory:

* ``metrics.jsonl`` (:data:`HISTORY_FILE`), the service's metrics history: every job writes it
  in its output directory, whatever loggers are configured (``logger=wandb``, ``csv``,
  ``none``; :class:`~syncbn_lightning.app.loggers.MetricsHistory`). One JSON object per line,
  ``{"step": 12, "epoch": 0, "<metric>": <value>, ...}``, one line per time Lightning logged;
  values that are not finite are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``.
* ``metrics.csv`` of Lightning's ``CSVLogger``, for runs older than the history file (and for
  any CSVLogger output): read only where no ``metrics.jsonl`` is found.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TypeAlias

__all__ = [
    "HISTORY_FILE",
    "METRICS_FILE",
    "Series",
    "find_history_files",
    "find_metrics_files",
    "read_history",
    "read_metrics",
    "read_run",
]

log = logging.getLogger(__name__)

Series: TypeAlias = dict[str, list[tuple[int, float]]]
"""Metric name (or line label) -> ``(step, value)`` points sorted by step."""

#: Lightning's ``CSVLogger`` file (``<save_dir>/<name>/version_<n>/metrics.csv``).
METRICS_FILE = "metrics.csv"
#: The service's metrics history, ``<output_dir>/metrics.jsonl`` of every job.
HISTORY_FILE = "metrics.jsonl"
_INDEX_COLUMNS = frozenset({"step", "epoch"})
_CSV_HINT = (
    f"pass the output directory of a syncbn-train job (it writes {HISTORY_FILE} with any "
    f"logger), or of a sweep, or a directory with a CSVLogger {METRICS_FILE} below it"
)


def read_metrics(csv_path: str | Path) -> Series:
    """Read a Lightning ``CSVLogger`` ``metrics.csv`` into per-metric ``(step, value)`` points.

    Empty cells (a metric not logged at that row) are skipped, as are the ``step`` and ``epoch``
    columns themselves. Cells that are not numbers are skipped with one warning per column.

    Args:
        csv_path: Path of a ``metrics.csv``.

    Returns:
        Metric name -> points sorted by step (stable: points logged at the same step keep their
        file order). Metrics with no value at all are left out; an empty file gives ``{}``.

    Raises:
        FileNotFoundError: ``csv_path`` does not exist.
        ValueError: The file has a header but no ``step`` column, so it is not a ``CSVLogger``
            metrics file.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "metrics.csv"
        >>> _ = p.write_text("epoch,step,train/loss,val/mAP\\n0,1,0.9,\\n0,0,1.0,0.5\\n")
        >>> read_metrics(p)
        {'train/loss': [(0, 1.0), (1, 0.9)], 'val/mAP': [(0, 0.5)]}
    """
    path = Path(csv_path)
    series: Series = {}
    bad_columns: set[str] = set()
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            log.warning("%s is empty; no metrics read from it", path)
            return {}
        if "step" not in reader.fieldnames:
            raise ValueError(
                f"{path} has no 'step' column (columns: {reader.fieldnames}); csv_path must be a "
                "metrics.csv written by Lightning's CSVLogger"
            )
        columns = [c for c in reader.fieldnames if c not in _INDEX_COLUMNS]
        for row in reader:
            step = _parse_step(row.get("step"))
            if step is None:
                log.debug("%s line %d: no usable step, row skipped", path, reader.line_num)
                continue
            for column in columns:
                cell = row.get(column)
                if cell is None or not cell.strip():
                    continue
                try:
                    value = float(cell)
                except ValueError:
                    if column not in bad_columns:
                        bad_columns.add(column)
                        log.warning(
                            "%s: column %r holds non-numeric values (e.g. %r); they are skipped",
                            path,
                            column,
                            cell,
                        )
                    continue
                series.setdefault(column, []).append((step, value))
    for points in series.values():
        points.sort(key=lambda p: p[0])
    return series


def read_history(path: str | Path) -> Series:
    """Read a metrics history file (:data:`HISTORY_FILE`) into per-metric ``(step, value)`` points.

    Args:
        path: Path of a ``metrics.jsonl``.

    Returns:
        Metric name -> points sorted by step (stable, as :func:`read_metrics`); ``step`` and
        ``epoch`` are not metrics. Values that are neither numbers nor ``"nan"``/``"inf"``/
        ``"-inf"`` are skipped with one warning per metric, as are lines without a usable
        ``step``; a line cut short (a job killed while writing) is skipped with a warning.

    Raises:
        FileNotFoundError: ``path`` does not exist.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
        >>> _ = p.write_text('{"step": 1, "train/loss": 0.9}\\n{"step": 0, "train/loss": 1.0}\\n')
        >>> read_history(p)
        {'train/loss': [(0, 1.0), (1, 0.9)]}
    """
    path = Path(path)
    series: Series = {}
    bad: set[str] = set()
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                log.warning("%s line %d is not JSON (cut short?); skipped", path, number)
                continue
            step = _parse_step(str(row.get("step"))) if isinstance(row, dict) else None
            if step is None:
                log.debug("%s line %d: no usable step, skipped", path, number)
                continue
            for name, cell in row.items():
                if name in _INDEX_COLUMNS:
                    continue
                value = _history_value(cell)
                if value is None:
                    if name not in bad:
                        bad.add(name)
                        log.warning(
                            "%s: %r holds non-numeric values (e.g. %r); they are skipped",
                            path,
                            name,
                            cell,
                        )
                    continue
                series.setdefault(name, []).append((step, value))
    for points in series.values():
        points.sort(key=lambda p: p[0])
    return series


def _history_value(cell: object) -> float | None:
    """A history value as float: numbers, and the strings written for non-finite values."""
    if isinstance(cell, bool):
        return None
    if isinstance(cell, (int, float)):
        return float(cell)
    if isinstance(cell, str) and cell in ("nan", "inf", "-inf"):
        return float(cell)
    return None


def _parse_step(cell: str | None) -> int | None:
    """``int`` of a ``step`` cell (Lightning writes ``"12"``, tolerate ``"12.0"``), else None."""
    if cell is None or not cell.strip():
        return None
    try:
        value = float(cell)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) else None


def _natural_key(path: Path) -> tuple[tuple[int, int, str], ...]:
    """Sort key putting job ``2/`` before job ``10/``."""
    key = []
    for part in path.parts:
        for chunk in re.split(r"(\d+)", part):
            key.append((0, int(chunk), "") if chunk.isdigit() else (1, 0, chunk))
    return tuple(key)


def find_history_files(run_dir: str | Path) -> list[Path]:
    """Every :data:`HISTORY_FILE` below ``run_dir`` (at any depth), in natural order.

    Args:
        run_dir: A job's output directory or a multirun sweep directory.

    Returns:
        The files' paths; empty when there are none or ``run_dir`` is not a directory.
    """
    return _find(run_dir, HISTORY_FILE)


def find_metrics_files(run_dir: str | Path) -> list[Path]:
    """Every ``metrics.csv`` below ``run_dir`` (at any depth), in natural order.

    Natural order compares digit runs as numbers, so the jobs of a sweep come as ``0, 1, 2, 10``.

    Args:
        run_dir: A job's output directory or a multirun sweep directory.

    Returns:
        The files' paths (``run_dir`` joined with their relative paths); empty when there are none
        or ``run_dir`` is not a directory.
    """
    return _find(run_dir, METRICS_FILE)


def _find(run_dir: str | Path, name: str) -> list[Path]:
    root = Path(run_dir)
    if not root.is_dir():
        return []
    files = [p for p in root.rglob(name) if p.is_file()]
    return sorted(files, key=lambda p: _natural_key(p.relative_to(root)))


def _job_labels(root: Path, files: Sequence[Path]) -> list[str]:
    """Label of each file's job: ``""`` for a single file, else the first directory below root.

    When first directories repeat (one job with several ``version_<n>`` directories) the whole
    relative directory is used so that labels stay unique.
    """
    if len(files) == 1:
        return [""]
    rel_dirs = [f.parent.relative_to(root) for f in files]
    firsts = [d.parts[0] if d.parts else "." for d in rel_dirs]
    if len(set(firsts)) == len(firsts):
        return _sweep_labels(root, firsts) or firsts
    return [d.as_posix() for d in rel_dirs]


def _sweep_labels(root: Path, job_dirs: Sequence[str]) -> list[str] | None:
    """The overrides that set the jobs of a Hydra sweep apart (``"bn.group_size=2"``), from each
    job's ``.hydra/overrides.yaml``; None unless every job has one and the labels are unique."""
    import yaml

    jobs = []
    for job in job_dirs:
        try:
            overrides = yaml.safe_load((root / job / ".hydra" / "overrides.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return None
        jobs.append([str(o) for o in overrides or []])
    common = set.intersection(*(set(j) for j in jobs))
    labels = [",".join(o for o in j if o not in common) for j in jobs]
    return labels if all(labels) and len(set(labels)) == len(labels) else None


def read_run(run_dir: str | Path) -> dict[str, Series]:
    """Read the metrics of every job below ``run_dir``, keyed by job label.

    Every :data:`HISTORY_FILE` below ``run_dir`` is read (:func:`read_history`); only when there
    is none, every CSVLogger ``metrics.csv`` (:func:`read_metrics`).

    Args:
        run_dir: A job's output directory or a multirun sweep directory.

    Returns:
        Job label -> that job's metrics. The label is ``""`` when there is a single file; for a
        Hydra sweep the overrides that differ between its jobs (``"bn.group_size=2"``); else the
        job's directory relative to ``run_dir`` (its first component, e.g. ``"0"``; the whole
        relative directory when first components repeat).

    Raises:
        FileNotFoundError: ``run_dir`` does not exist, is not a directory, or holds neither
            ``metrics.jsonl`` nor ``metrics.csv``.
        ValueError: A ``metrics.csv`` is malformed (see :func:`read_metrics`).
    """
    root = Path(run_dir)
    if not root.exists():
        raise FileNotFoundError(f"RUN_DIR {str(root)!r} does not exist; {_CSV_HINT}")
    if not root.is_dir():
        raise FileNotFoundError(
            f"RUN_DIR {str(root)!r} is not a directory; pass the job's (or the sweep's) output "
            f"directory that holds {HISTORY_FILE} (or metrics.csv) files below it"
        )
    files, read = find_history_files(root), read_history
    if not files:
        files, read = find_metrics_files(root), read_metrics
    if not files:
        raise FileNotFoundError(
            f"RUN_DIR {str(root)!r} holds no {HISTORY_FILE} or {METRICS_FILE} (searched "
            f"{root / '**'}); {_CSV_HINT}"
        )
    labels = _job_labels(root, files)
    runs: dict[str, Series] = {}
    for label, path in zip(labels, files, strict=True):
        log.debug("reading %s as job %r", path, label)
        runs[label] = read(path)
    return runs
