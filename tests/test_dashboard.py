"""Layer 7: the dashboards as code (``app/panels.py``, ``app/dashboard.py``, ``syncbn-dashboard``).

The panel spec is held to what a real run logs, both ways: a real Lightning Trainer with
SyncBNCallback, a real offline W&B run and the service's metrics history; every ``bn/*`` metric
logged has a panel and every ``bn/*`` metric a panel names is logged. The W&B workspace is built
with ``wandb-workspaces`` and checked in the form W&B stores it (no network); the command line runs
as users run it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _lightning import BNNet, quiet_trainer
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import syncbn_lightning.app.config  # noqa: F401  (the config's resolvers: syncbn.global_batch)
from syncbn_lightning import SyncBNCallback
from syncbn_lightning.app import dashboard
from syncbn_lightning.app.loggers import MetricsHistory, setup_wandb
from syncbn_lightning.app.metrics_csv import read_history
from syncbn_lightning.app.panels import (
    GROUP_BY,
    PANELS,
    SECTIONS,
    STEP_METRIC,
    Panel,
    covering_panels,
    how_to_read,
    spec,
)
from syncbn_lightning.app.readings import RULES
from syncbn_lightning.nn.running_stats import LAYER_METRICS, summarize

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """W&B offline and quiet, no login anywhere (HOME without ~/.netrc)."""
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "NETRC", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))


def _line_panels() -> list[Panel]:
    return [p for s in SECTIONS for p in s.panels if p.kind == "line"]


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """The keys one real run logs: through Lightning (metrics history) and into W&B (summary)."""
    from lightning.pytorch.loggers import WandbLogger

    tmp = tmp_path_factory.mktemp("run")
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_DIR", str(tmp))
        wandb_logger = WandbLogger(save_dir=str(tmp), offline=True, project="syncbn-test")
        history = MetricsHistory(tmp / "out")
        quiet_trainer(
            callbacks=[SyncBNCallback(single_process="monitor", impl="ref")],
            logger=[wandb_logger, history],
            default_root_dir=str(tmp),
            limit_val_batches=0,
            max_steps=3,
            log_every_n_steps=1,
        ).fit(BNNet(batch_size=4))
        run = wandb_logger.experiment
        summary = set(run.summary.keys())
        run.finish()
    finally:
        mp.undo()
    return {"history": set(read_history(history.path)), "wandb": summary}


def test_every_bn_metric_the_callback_logs_has_a_panel(logged: dict[str, set[str]]) -> None:
    bn = {k for keys in logged.values() for k in keys if k.startswith("bn/")}
    # The run really logged what the callback promises (sizes, drift/gap summaries, media).
    assert {"bn/global_batch_size", "bn/norm_batch_size", "bn/gap_std_max"} <= logged["history"]
    assert {"bn/layers", "bn/layers/gap_mean"} <= logged["wandb"]
    uncovered = sorted(k for k in bn if not covering_panels(k))
    assert not uncovered, f"bn/* metrics logged without a panel: {uncovered}"
    # No panel names a bn/* metric the callback does not log (a renamed metric would leave an
    # empty chart behind).
    named = {m for s in SECTIONS for p in s.panels for m in p.metrics if m.startswith("bn/")}
    assert named - bn == set(), "panels of bn/* metrics nobody logs"


def test_panels_follow_the_library_metric_names() -> None:
    """Every per-layer metric of the library: its summaries and histogram shown."""
    names = summarize({"layer": dict.fromkeys(LAYER_METRICS, 0.0)})
    names |= {f"bn/layers/{m}": 0.0 for m in LAYER_METRICS}
    assert {k: covering_panels(k) for k in names if not covering_panels(k)} == {}
    # Lightning-logged panels are the PNG report's; media panels are W&B only.
    assert [p.name for p in PANELS] == [
        "batch_size",
        "samples_seen",
        "drift",
        "divergence",
        "nonfinite",
        "gap",
        "map",
        "loss",
    ]
    assert all(not any(m.startswith("bn/layers") for m in p.metrics) for p in PANELS)


def test_history_and_wandb_hold_the_same_lightning_metrics(logged: dict[str, set[str]]) -> None:
    lightning_keys = {k for k in logged["history"] if k.startswith(("bn/", "train"))}
    assert lightning_keys <= logged["wandb"]


def test_group_by_key_is_where_the_service_logs_it(tmp_path: Path) -> None:
    """``bn.group_size`` is a path into the run config setup_wandb logs (nested)."""
    paths = [f"paths.output_dir={tmp_path / 'out'}", f"paths.data_dir={tmp_path / 'data'}"]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*paths, "bn=group2", "trainer.devices=4"])
    logger = instantiate(cfg.logger.wandb)
    run = logger.experiment
    try:
        setup_wandb(SimpleNamespace(loggers=[logger]), cfg)  # type: ignore[arg-type]
        config = dict(run.config)
    finally:
        run.finish()
    for key in GROUP_BY:
        node = config
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{key}: no {part!r} in {node}"
            node = node[part]
        assert node == 2


def test_workspace_is_built_offline_as_wandb_stores_it() -> None:
    ws = dashboard.build_workspace("my-team", "syncbn_lightning")
    view = ws._to_model().model_dump(by_alias=True, exclude_none=True)
    assert (view["entity"], view["project"], view["displayName"]) == (
        "my-team",
        "syncbn_lightning",
        "SyncBatchNorm",
    )
    section_spec = view["spec"]["section"]
    # The nested config key as W&B stores it (bn: {value: {group_size: ...}}).
    assert section_spec["runSets"][0]["grouping"] == [
        {"section": "config", "name": "bn.value.group_size"}
    ]
    assert section_spec["settings"]["xAxis"] == STEP_METRIC
    sections = section_spec["panelBankConfig"]["sections"]
    assert [s["name"] for s in sections] == [s.name for s in SECTIONS]
    for built, section in zip(sections, SECTIONS, strict=True):
        *charts, notes = built["panels"]
        # Beside the charts, how to read them: descriptions and reading thresholds.
        assert notes["viewType"] == "Markdown Panel"
        assert notes["config"]["value"] == how_to_read(section)
        for panel in section.panels:
            assert panel.title in notes["config"]["value"]
            if panel.name in RULES:
                assert RULES[panel.name] in notes["config"]["value"]
        for panel, wanted in zip(charts, section.panels, strict=True):
            config = panel["config"]
            if wanted.kind == "table":
                assert panel["viewType"] == "Weave"
                assert wanted.metrics[0] in json.dumps(config)
                continue
            assert panel["viewType"] == "Run History Line Plot"
            assert config["chartTitle"] == wanted.title and config["xAxis"] == STEP_METRIC
            assert bool(config.get("yLogScale")) == wanted.log_y
            if wanted.name == "loss":
                assert config["useMetricRegex"] and config["metricRegex"] == "^train/.*$"
            else:
                assert config["metrics"] == list(wanted.metrics)
            if wanted.from_zero:
                assert config["yAxisMin"] == 0


def test_group_by_none_and_other_keys() -> None:
    view = dashboard.build_workspace("e", "p", dashboard.View(group_by=[]))._to_model()
    assert view.model_dump(by_alias=True)["spec"]["section"]["runSets"][0]["grouping"] == []
    by_devices = dashboard.View(group_by=["trainer.devices"])
    view = dashboard.build_workspace("e", "p", by_devices)._to_model()
    grouping = view.model_dump(by_alias=True)["spec"]["section"]["runSets"][0]["grouping"]
    assert grouping == [{"section": "config", "name": "trainer.value.devices"}]


def test_dry_run_prints_the_spec_without_wandb() -> None:
    code = (
        "import sys\n"
        "from syncbn_lightning.app.dashboard import main\n"
        "code = main(['--dry-run', '--entity', 'e', '--project', 'p'])\n"
        "assert code == 0, code\n"
        "loaded = {'wandb', 'wandb_workspaces'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed == {**spec(entity="e", project="p"), "kind": "workspace"}
    assert printed["group_by"] == ["bn.group_size"] and printed["x_axis"] == STEP_METRIC
    panel = printed["sections"][0]["panels"][0]
    assert panel["metrics"] == [
        "bn/global_batch_size",
        "bn/norm_batch_size",
        "bn/target_norm_batch",
    ]


def test_cli_module_dry_run_needs_no_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert dashboard.main(["--dry-run", "--report", "--group-by", "none"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["kind"] == "report" and printed["group_by"] == []
    assert printed["entity"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--project", "p"], "error: --entity is required"),
        (["--entity", "e"], "error: --project is required"),
        (["--entity", "e", "--project", "p"], "error: no W&B API key on this machine"),
        (["--dry-run", "--group-by", "a b"], "error: --group-by 'a b'"),
    ],
)
def test_cli_errors_are_one_line_with_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dashboard.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), err
    if "API key" in message:
        assert "wandb login" in lines[0] and "--dry-run" in lines[0]


def test_console_script_is_declared() -> None:
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["syncbn-dashboard"] == "syncbn_lightning.app.dashboard:main"
    app_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["app"]
    assert any(dep.startswith("wandb-workspaces") for dep in app_extra)


def test_user_doc_describes_every_panel() -> None:
    doc = (ROOT / "docs" / "dashboards.md").read_text()
    for section in SECTIONS:
        assert f"### {section.name}" in doc, section.name
        for panel in section.panels:
            if panel.wandb_only:  # the per-layer media: one row for the family
                assert "`bn/layers/<metric>`" in doc and "`bn/layers`" in doc
                continue
            assert f"| {panel.title} |" in doc, panel.title
            assert all(f"`{m}`" in doc or m == "train/*" for m in panel.metrics), panel.name
    assert "syncbn-dashboard --entity" in doc and "--dry-run" in doc
