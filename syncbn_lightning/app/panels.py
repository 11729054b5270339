"""The panels of a run's dashboards as plain data: one spec for the PNG report and for W&B.

:data:`SECTIONS` is the W&B workspace ``syncbn-dashboard`` creates (:mod:`.dashboard`): sections of
panels, every panel a list of metric names (or :mod:`fnmatch` patterns) drawn against
:data:`STEP_METRIC`, runs grouped by the config keys :data:`GROUP_BY` (mean line, min-max band
per group). :data:`PANELS`, the line panels of those sections, are the figures of the PNG report
(:mod:`.report`) and the custom charts logged into each W&B run.

The ``bn/*`` metrics are the ones :class:`~syncbn_lightning.SyncBNCallback` logs (module
``syncbn_lightning.lightning.monitoring``): batch sizes, samples seen, skipped non-finite updates,
and for each per-layer metric of ``syncbn_lightning.nn.running_stats.LAYER_METRICS`` its max and
mean over layers (``bn/<metric>_max``, ``_avg``); with a W&B logger also their per-layer histograms
(``bn/layers/<metric>``) and, at the end, the table of the last values per layer (``bn/layers``).
``tests/test_dashboard.py`` checks this list against what a real run logs, both ways. All ``bn/*``
statistics are dimensionless (units of the running standard deviation).

The per-layer names come from the library (``LAYER_METRICS``, ``summarize``); the four
batch-size/skip names are spelled here as ``monitoring.py`` logs them. Importing this module
imports no Lightning, Hydra, W&B or matplotlib.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from syncbn_lightning.nn.running_stats import LAYER_METRICS, summarize

from .readings import RULES

__all__ = [
    "GROUP_BY",
    "PANELS",
    "SECTIONS",
    "STEP_METRIC",
    "Panel",
    "Section",
    "covering_panels",
    "how_to_read",
    "panel_metrics",
    "spec",
]

#: The x axis of every panel: the optimizer step, as Lightning's ``WandbLogger`` logs it.
STEP_METRIC = "trainer/global_step"
#: Run config keys the dashboard groups runs by (the service logs its config nested:
#: ``bn.group_size`` is ``config["bn"]["group_size"]``).
GROUP_BY: tuple[str, ...] = ("bn.group_size",)

#: Panel kinds: ``line`` (metrics over steps), ``table`` (a W&B table in the run summary).
KINDS = ("line", "table")

# The per-layer metrics of the library, by family; tests/test_dashboard.py checks that every one of
# LAYER_METRICS is in a family (and so has a panel).
_DRIFT = tuple(m for m in LAYER_METRICS if m.startswith("drift"))
_DIVERGENCE = tuple(m for m in LAYER_METRICS if m.startswith("divergence"))
_GAP = tuple(m for m in LAYER_METRICS if m.startswith("gap"))


def _summaries(metrics: Sequence[str]) -> tuple[str, ...]:
    """The names the callback logs for ``metrics`` (``bn/<m>_max``, ``bn/<m>_avg``), from the
    library's own :func:`syncbn_lightning.nn.running_stats.summarize`."""
    return tuple(summarize({"layer": dict.fromkeys(metrics, 0.0)}))


@dataclass(frozen=True)
class Panel:
    """One chart: which metrics it overlays and how its y axis looks.

    Args:
        name: File stem of the PNG (``<name>.png``) and the panel's key in the spec.
        title: Chart title.
        metrics: Metric names or :mod:`fnmatch` patterns (``"train/*"``), drawn in this order;
            the metrics a pattern matches are drawn in sorted order.
        ylabel: Label of the y axis (with the unit).
        log_y: Logarithmic y axis (``symlog`` in the PNG when some values are not positive).
        from_zero: Linear y axis starting at 0 (sizes: a constant 4 is drawn on 0..4, not on an
            autoscaled 3.8..4.2).
        kind: ``"line"`` (default) or ``"table"`` (the W&B table logged under the one name in
            ``metrics``; W&B only).
        wandb_only: Its metrics are logged to W&B only (media: histograms, tables), not through
            Lightning, so the metrics history and the PNG report have none of them.
        description: What the panel shows and how to read it (the user docs and the spec).

    Raises:
        TypeError: ``metrics`` is a single string instead of a tuple of strings.
        ValueError: ``name`` is empty or not usable as a file name; ``kind`` is unknown; a table
            panel does not name exactly one table.

    Example:
        >>> lr = Panel("lr", "Learning rate", ("lr",), ylabel="lr", log_y=True)
        >>> lr.matches("lr"), lr.matches("bn/norm_batch_size")
        (True, False)
    """

    name: str
    title: str
    metrics: tuple[str, ...]
    ylabel: str = ""
    log_y: bool = False
    from_zero: bool = False
    kind: str = "line"
    wandb_only: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.metrics, str) or not all(isinstance(m, str) for m in self.metrics):
            raise TypeError(
                f"Panel {self.name!r}: metrics must be a tuple of metric names or patterns, got "
                f"{self.metrics!r}; write metrics=({self.metrics!r},) for a single one"
            )
        object.__setattr__(self, "metrics", tuple(self.metrics))
        if not self.name or any(c in self.name for c in "/\\") or self.name in {".", ".."}:
            raise ValueError(
                f"Panel name {self.name!r} is used as a file name (<name>.png); "
                "use a non-empty name without path separators, e.g. 'batch_size'"
            )
        if self.kind not in KINDS:
            raise ValueError(f"Panel {self.name!r}: kind={self.kind!r}; use one of {KINDS}")
        if self.kind == "table" and not self.wandb_only:
            object.__setattr__(self, "wandb_only", True)
        if self.kind == "table" and len(self.metrics) != 1:
            raise ValueError(
                f"Panel {self.name!r}: a table panel shows one W&B table, got metrics="
                f"{self.metrics!r}; give the table's name alone"
            )

    def matches(self, metric: str) -> bool:
        """Whether ``metric`` is one of this panel's names or matches one of its patterns."""
        return any(m == metric or fnmatch.fnmatchcase(metric, m) for m in self.metrics)


def _layer_histograms() -> tuple[Panel, ...]:
    """One panel per per-layer metric: its histogram over the layers at every measurement."""
    return tuple(
        Panel(
            f"layer_{m}",
            f"Per-layer {m} (histogram over layers)",
            (f"bn/layers/{m}",),
            wandb_only=True,
            description="W&B only: the distribution over BatchNorm layers at every "
            "measurement, to tell one outlying layer from a shift of all of them.",
        )
        for m in (*_DRIFT, *_DIVERGENCE, *_GAP)
    )


@dataclass(frozen=True)
class Section:
    """A titled group of panels (a W&B workspace section).

    Args:
        name: Section title.
        panels: Its panels, in order.
    """

    name: str
    panels: tuple[Panel, ...]


SECTIONS: tuple[Section, ...] = (
    Section(
        "BatchNorm batch size",
        (
            Panel(
                "batch_size",
                "BatchNorm batch size",
                ("bn/global_batch_size", "bn/norm_batch_size", "bn/target_norm_batch"),
                ylabel="samples",
                from_zero=True,
                description="global: samples of the last optimizer step summed over ranks; norm: "
                "samples one BatchNorm forward normalized over (its sync group), the smallest "
                "over groups and micro-batches (equal when every rank syncs with every other); "
                "target: bn.target_norm_batch, below which the statistics are noisy.",
            ),
            Panel(
                "samples_seen",
                "Samples trained on",
                ("bn/samples_seen",),
                ylabel="samples",
                from_zero=True,
                description="all samples trained on so far, every rank; continues across resumes.",
            ),
        ),
    ),
    Section(
        "Running statistics",
        (
            Panel(
                "drift",
                "Running-statistics drift since the previous measurement",
                _summaries(_DRIFT),
                ylabel="running stds (mean); relative (var)",
                log_y=True,
                description="how far the running mean (in running stds) and variance (relative) "
                "moved between two measurements: worst layer (_max) and layer mean (_avg). "
                "Falls as training settles; spikes show a distribution shift or a bad batch.",
            ),
            Panel(
                "divergence",
                "Rank divergence of the running means",
                _summaries(_DIVERGENCE),
                ylabel="running stds",
                log_y=True,
                description="how far the ranks' running means are apart (in running stds): "
                "exactly 0 when every rank syncs with every other; > 0 between sync groups "
                "(bn.group_size), until reconcile averages them.",
            ),
            Panel(
                "nonfinite",
                "Running-stat updates skipped (NaN/inf batch statistics)",
                ("bn/nonfinite_skipped",),
                ylabel="updates (cumulative)",
                from_zero=True,
                description="updates skipped because the synchronized batch statistics were "
                "not finite, summed over layers (worst rank); anything above 0 needs a look.",
            ),
        ),
    ),
    Section(
        "Train/test gap",
        (
            Panel(
                "gap",
                "Train/test gap: batch vs running statistics",
                _summaries(_GAP),
                ylabel="running stds (mean); relative (std)",
                log_y=True,
                description="distance between the last synchronized batch statistics (what "
                "training normalized with) and the running statistics (what evaluation uses): "
                "large values mean small or unrepresentative normalization batches.",
            ),
        ),
    ),
    Section(
        "Loss and mAP",
        (
            Panel(
                "map",
                "Validation",
                ("val/mAP", "val/mAP50", "val/acc"),
                ylabel="score",
                description="validation quality after each validation (COCO mAP for detection, "
                "accuracy for classification).",
            ),
            Panel(
                "loss",
                "Training losses",
                ("train/*",),
                ylabel="loss",
                description="every train/* metric: the training loss and its parts.",
            ),
        ),
    ),
    Section(
        "Per layer",
        (
            *_layer_histograms(),
            Panel(
                "layer_table",
                "Per-layer metrics at the end of training",
                ("bn/layers",),
                kind="table",
                description="W&B only: the last measurement of every layer (one row per "
                "BatchNorm layer), to find the layer behind a _max value.",
            ),
        ),
    ),
)
"""The dashboard: sections of panels, in the order they are shown."""

PANELS: tuple[Panel, ...] = tuple(p for s in SECTIONS for p in s.panels if not p.wandb_only)
"""The figures of the PNG report (and the custom charts of each W&B run): the panels of
:data:`SECTIONS` whose metrics Lightning logs (all but the per-layer histograms and table)."""


def covering_panels(metric: str, sections: Iterable[Section] = SECTIONS) -> list[str]:
    """Names of the panels that show ``metric``.

    Example:
        >>> covering_panels("bn/divergence_max")
        ['divergence']
    """
    return [p.name for s in sections for p in s.panels if p.matches(metric)]


def spec(
    *,
    entity: str | None = None,
    project: str | None = None,
    name: str = "SyncBatchNorm",
    group_by: Sequence[str] = GROUP_BY,
    sections: Sequence[Section] = SECTIONS,
) -> dict[str, Any]:
    """The dashboard as JSON-ready data (what ``syncbn-dashboard --dry-run`` prints).

    Args:
        entity: W&B user or team that owns the project (``None``: not chosen yet).
        project: W&B project of the runs.
        name: Workspace name.
        group_by: Run config keys to group runs by (dotted, as the config is nested).
        sections: The sections to show. Defaults to :data:`SECTIONS`.

    Returns:
        ``{"entity", "project", "name", "x_axis", "group_by", "sections": [{"name", "panels":
        [{"name", "title", "kind", "metrics", "ylabel", "log_y", "from_zero",
        "description", "reading"}]}]}``; ``reading`` states the thresholds of the panel's
        one-line reading (empty for W&B-only panels).
    """
    return {
        "entity": entity,
        "project": project,
        "name": name,
        "x_axis": STEP_METRIC,
        "group_by": list(group_by),
        "sections": [
            {"name": s.name, "panels": [_panel_dict(p) for p in s.panels]} for s in sections
        ],
    }


def _panel_dict(panel: Panel) -> dict[str, Any]:
    data = asdict(panel)
    data["metrics"] = list(panel.metrics)
    data["reading"] = RULES.get(panel.name, "")
    return data


def how_to_read(section: Section) -> str:
    """Markdown for a section's text panel: each panel's description and, for the panels of the
    PNG report, the thresholds of its one-line reading (:data:`.readings.RULES`)."""
    lines = []
    for panel in section.panels:
        line = f"**{panel.title}**: {panel.description}"
        if panel.name in RULES:
            line += f" *Reading:* {RULES[panel.name]}."
        lines.append(f"- {line}")
    return "\n".join(lines)


def panel_metrics(panel: Panel, logged: Mapping[str, Any]) -> list[str]:
    """The names in ``logged`` that ``panel`` shows, in panel order (patterns resolved, sorted)."""
    out: list[str] = []
    for pattern in panel.metrics:
        names = (
            [pattern]
            if pattern in logged
            else sorted(n for n in logged if fnmatch.fnmatchcase(n, pattern))
        )
        out += [n for n in names if n not in out]
    return out
