"""Layer 7: the service's console shows its own lines (``app/console.py``).

Lightning's LitLogger advertisement, torch's pytree deprecation warning (triggered by Lightning
at fit start), W&B's warning about the ``anonymous`` setting and W&B's run summary are kept off
the service's console, by filters the service installs for itself. The library installs none:
a user's own Trainer and warnings are theirs.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from lightning.pytorch.utilities import rank_zero_info

from syncbn_lightning.app.console import LIGHTNING_INFO_LOGGER, quiet_third_party
from syncbn_lightning.app.loggers import wandb_logger

TIP = (
    "💡 Tip: For seamless cloud logging and experiment tracking, try installing "
    "[litlogger](https://pypi.org/project/litlogger/) to enable LitLogger"
)
PYTREE = (
    "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
    "treespec.is_leaf()` instead."
)


@pytest.fixture
def _service_filters():
    """The service's filters for one test, removed after it."""
    logger = logging.getLogger(LIGHTNING_INFO_LOGGER)
    saved_filters, saved_warnings = list(logger.filters), list(warnings.filters)
    quiet_third_party()
    quiet_third_party()  # idempotent
    yield
    logger.filters[:] = saved_filters
    warnings.filters[:] = saved_warnings


@pytest.mark.usefixtures("_service_filters")
def test_the_service_drops_the_tip_and_keeps_lightnings_other_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger=LIGHTNING_INFO_LOGGER):
        rank_zero_info(TIP)
        rank_zero_info("GPU available: False, used: False")
    assert caplog.messages == ["GPU available: False, used: False"]
    assert len(logging.getLogger(LIGHTNING_INFO_LOGGER).filters) == 1


@pytest.mark.usefixtures("_service_filters")
def test_the_service_drops_the_pytree_warning_and_keeps_others() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(PYTREE, FutureWarning, stacklevel=1)
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else is deprecated"]


@pytest.mark.slow
def test_the_library_installs_no_filter() -> None:
    """A fresh interpreter: the library, its callback and the service's modules imported,
    nothing filtered until the service runs a job."""
    code = """
import json, logging, warnings
import syncbn_lightning
from syncbn_lightning import SyncBNCallback
SyncBNCallback()
import syncbn_lightning.app.train
tip = logging.getLogger("lightning.pytorch.utilities.rank_zero").filters
pytree = [f for f in warnings.filters if f[1] is not None and "LeafSpec" in f[1].pattern]
print(json.dumps([len(tip), len(pytree)]))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == [0, 0]


def test_the_service_wandb_run_is_quiet_and_not_anonymous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    import wandb

    wandb.finish()  # no run of an earlier test in this process: the logger would reuse it
    logger = wandb_logger(offline=True, project="console-test", save_dir=str(tmp_path))
    assert "anonymous" not in logger._wandb_init
    run = logger.experiment
    try:
        assert run.settings.quiet
        run.log({"train/loss": 1.0})
    finally:
        run.finish()
    out, err = capfd.readouterr()
    printed = out + err
    assert "anonymous" not in printed
    assert "Run history" not in printed and "Run summary" not in printed
