"""The examples, run as a user runs them: ``python examples/demo.py`` (the README's) and
``python examples/fabric_accumulation.py`` (docs/gradient-accumulation.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_example(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python examples/<name> <args>`` from ``cwd``, as a user runs it; it must succeed."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.distributed
@pytest.mark.slow
def test_demo_runs_and_finds_the_ranks_synchronized(tmp_path: Path) -> None:
    """From another folder, as the README's command does from a clone (2 gloo processes)."""
    proc = _run_example("demo.py", "--steps", "3", cwd=tmp_path)
    assert "OK: the ranks normalized as one batch" in proc.stdout, proc.stdout
    assert "synchronized 2 BatchNorm layers" in proc.stdout, proc.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_fabric_accumulation_recipe_updates_once_per_step(tmp_path: Path) -> None:
    """The Fabric recipe of docs/gradient-accumulation.md (2 gloo processes, Fabric's ``ddp``
    launcher): rank 0's running statistics are those of one process running every rank's
    micro-batches, with one update per optimizer step."""
    proc = _run_example("fabric_accumulation.py", "--steps", "2", cwd=tmp_path)
    assert "num_batches_tracked = 2;" in proc.stdout, proc.stdout
    assert "OK: one running-statistics update per optimizer step" in proc.stdout, proc.stdout
