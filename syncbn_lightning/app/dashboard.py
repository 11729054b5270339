"""W&B dashboards as code: ``syncbn-dashboard`` turns :mod:`.panels` into a saved W&B workspace
(or report) with ``wandb-workspaces``.

Usage::

    syncbn-dashboard --entity E --project P            # a workspace view of project P
    syncbn-dashboard --entity E --project P --report   # a report instead (a shareable page)
    syncbn-dashboard --dry-run                         # print the spec as JSON, nothing else

Each section of :data:`~.panels.SECTIONS` becomes a workspace section (a report panel grid): one
line plot per line panel, x axis ``trainer/global_step``, runs grouped by the run config keys
``--group-by`` (default ``bn.group_size``: one line per group size, the mean of its runs with a
min-max band), and a table panel for the per-layer table. ``--dry-run`` needs neither the network
nor a W&B login; saving needs W&B credentials (``wandb login``), checked first. See
``docs/dashboards.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .panels import GROUP_BY, SECTIONS, STEP_METRIC, Panel, Section, how_to_read, spec
from .wandb_auth import LOGIN_HINT, has_wandb_credentials

__all__ = ["View", "build_report", "build_workspace", "main"]

_INSTALL_HINT = "pip install 'syncbn_lightning[app]' (or pip install wandb-workspaces)"


def _glob_regex(pattern: str) -> str:
    """An :mod:`fnmatch` pattern as an anchored regular expression W&B understands."""
    body = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return f"^{body}$"


def _is_pattern(metric: str) -> bool:
    return any(c in metric for c in "*?[")


def _panel(panel: Panel) -> Any:
    """One ``wandb_workspaces`` panel for ``panel``."""
    import wandb_workspaces.reports.v2 as wr

    if panel.kind == "table":
        return wr.WeavePanelSummaryTable(table_name=panel.metrics[0])
    options: dict[str, Any] = {
        "title": panel.title,
        "x": STEP_METRIC,
        "title_x": "step",
        "groupby_aggfunc": "mean",
        "groupby_rangefunc": "minmax",
    }
    if any(_is_pattern(m) for m in panel.metrics):
        # A pattern names metrics not known in advance (the task's train/* losses).
        options["metric_regex"] = "|".join(_glob_regex(m) for m in panel.metrics)
    else:
        options["y"] = list(panel.metrics)
    if panel.ylabel:
        options["title_y"] = panel.ylabel
    if panel.log_y:
        options["log_y"] = True
    if panel.from_zero:
        options["range_y"] = (0, None)
    return wr.LinePlot(**options)


def _notes(section: Section) -> Any:
    """A text panel beside the section's charts: what each shows and the thresholds of its
    reading (the line every PNG figure and W&B run chart states, docs/dashboards.md)."""
    import wandb_workspaces.reports.v2 as wr

    return wr.MarkdownPanel(markdown=how_to_read(section))


@dataclass(frozen=True)
class View:
    """What a dashboard shows.

    Attributes:
        name: The workspace view's (or report's) name.
        group_by: Run config keys (dotted) to group the runs by; empty: no grouping.
        sections: The sections to show. Defaults to :data:`~.panels.SECTIONS`.
    """

    name: str = "SyncBatchNorm"
    group_by: Sequence[str] = GROUP_BY
    sections: Sequence[Section] = SECTIONS


def build_workspace(entity: str, project: str, view: View = View()) -> Any:
    """The dashboard as a ``wandb_workspaces.workspaces.Workspace`` (not saved; no network).

    Args:
        entity: W&B user or team that owns ``project``.
        project: W&B project of the runs.
        view: Its name, run grouping and sections.

    Returns:
        The workspace; ``.save()`` creates it in W&B.

    Raises:
        ImportError: ``wandb-workspaces`` is not installed.
    """
    import wandb_workspaces.workspaces as ws

    name, group_by, sections = view.name, view.group_by, view.sections
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=[
            ws.Section(
                name=section.name,
                panels=[*(_panel(p) for p in section.panels), _notes(section)],
                is_open=True,
                panel_settings=ws.SectionPanelSettings(x_axis=STEP_METRIC),
            )
            for section in sections
        ],
        settings=ws.WorkspaceSettings(x_axis=STEP_METRIC),
        runset_settings=ws.RunsetSettings(groupby=[ws.Config(key) for key in group_by]),
    )


def build_report(entity: str, project: str, view: View = View()) -> Any:
    """The dashboard as a ``wandb_workspaces.reports.v2.Report``: one heading and panel grid per
    section, each over the project's runs grouped by ``view.group_by`` (arguments as
    :func:`build_workspace`). Building its run sets looks the project up: it needs a W&B login
    and the network."""
    import wandb_workspaces.reports.v2 as wr

    blocks: list[Any] = []
    groupby = [f"config.{key}" for key in view.group_by]
    for section in view.sections:
        runset = wr.Runset(entity=entity, project=project, groupby=groupby)
        panels = [_panel(p) for p in section.panels]
        blocks += [wr.H2(text=section.name), wr.PanelGrid(runsets=[runset], panels=panels)]
        blocks.append(wr.MarkdownBlock(text=how_to_read(section)))
    return wr.Report(
        entity=entity,
        project=project,
        title=view.name,
        description="SyncBatchNorm batch sizes, running-statistics health, train/test gap, "
        "loss and mAP (syncbn-dashboard)",
        blocks=blocks,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="syncbn-dashboard",
        description="Create the SyncBatchNorm dashboard (a W&B workspace or report) of a "
        "project's syncbn-train runs.",
    )
    parser.add_argument("--entity", help="W&B user or team that owns the project")
    parser.add_argument("--project", help="W&B project of the runs (conf: logger.wandb.project)")
    parser.add_argument("--name", default="SyncBatchNorm", help="workspace or report name")
    parser.add_argument(
        "--group-by",
        action="append",
        metavar="KEY",
        help=f"run config key to group runs by, repeatable (default: {', '.join(GROUP_BY)}); "
        "--group-by none: no grouping",
    )
    parser.add_argument("--report", action="store_true", help="create a report, not a workspace")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the spec as JSON; no network, no login"
    )
    return parser


def _group_by(values: list[str] | None) -> list[str]:
    if values is None:
        return list(GROUP_BY)
    if values == ["none"]:
        return []
    for key in values:
        if not key or not re.fullmatch(r"[\w.\-/]+", key):
            raise ValueError(
                f"--group-by {key!r}: give a run config key as dotted path, e.g. bn.group_size"
            )
    return values


def _fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Command line ``syncbn-dashboard`` (or ``python -m syncbn_lightning.app.dashboard``).

    Args:
        argv: Arguments without the program name. Defaults to ``sys.argv[1:]``.

    Returns:
        0 after printing the spec (``--dry-run``) or the saved dashboard's URL; 2 after one
        ``error: ...`` line on stderr for a missing argument, missing credentials or a missing
        ``wandb-workspaces``; 1 when the W&B server refused the dashboard.
    """
    args = _parser().parse_args(argv)
    try:
        group_by = _group_by(args.group_by)
    except ValueError as e:
        return _fail(str(e))
    if args.dry_run:
        data = spec(entity=args.entity, project=args.project, name=args.name, group_by=group_by)
        data["kind"] = "report" if args.report else "workspace"
        print(json.dumps(data, indent=1))
        return 0
    for option in ("entity", "project"):
        if not getattr(args, option):
            return _fail(
                f"--{option} is required to create the dashboard (the W&B "
                f"{'user or team' if option == 'entity' else 'project of the runs'}); "
                f"--dry-run prints the spec without it"
            )
    if not has_wandb_credentials():
        return _fail(
            f"no W&B API key on this machine to create the dashboard; {LOGIN_HINT}, or print "
            f"the spec offline with --dry-run"
        )
    build = build_report if args.report else build_workspace
    try:
        dashboard = build(args.entity, args.project, View(args.name, group_by))
    except ImportError:
        return _fail(f"syncbn-dashboard needs wandb-workspaces: {_INSTALL_HINT}")
    try:
        dashboard.save()
    except Exception as e:  # the server's answer (unknown entity, no access, network)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _fail(
            f"W&B did not save the dashboard for --entity {args.entity} --project "
            f"{args.project}: {first}",
            code=1,
        )
    print(dashboard.url)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
