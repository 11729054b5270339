"""The suite itself: it collects for everyone, and nothing it writes lands in the checkout.

* Without the optional timm step (timm and torchvision unimportable), every test module collects:
  no module calls ``pytest.skip`` at import (a collection error that stops the whole run, or a
  whole module skipped); tests that need timm skip inside the test, saying why.
* ``SYNCBN_FLIGHT_DIR`` points at a temporary folder for the whole session (``conftest.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# Installed first thing in the subprocess (sitecustomize): ``import timm`` / ``torchvision``
# raise ModuleNotFoundError wherever they are, .third_party included, as if never installed.
_BLOCKER = """
import sys

class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("timm", "torchvision"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, _Absent())
"""


def _without_timm(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    env = {k: v for k, v in os.environ.items() if k != "SYNCBN_REQUIRE_TIMM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(tmp_path), env.get("PYTHONPATH"))))
    return env


@pytest.mark.slow
def test_every_module_collects_without_timm_and_none_skips_at_import(tmp_path: Path) -> None:
    env = _without_timm(tmp_path)
    probe = subprocess.run(
        [sys.executable, "-c", "import timm"], env=env, capture_output=True, text=True, timeout=60
    )
    assert probe.returncode != 0 and "blocked" in probe.stderr, probe.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-rs"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    errors = [line for line in run.stdout.splitlines() if line.startswith(("ERROR", "SKIPPED"))]
    assert run.returncode == 0, f"{summary}\n" + "\n".join(errors) + run.stderr[-2000:]
    assert not errors and "error" not in summary, "\n".join([summary, *errors])
    assert "tests collected" in summary, summary


@pytest.mark.slow
def test_tests_that_need_timm_skip_inside_the_test_saying_why(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            "tests/test_residual.py::"
            "test_blocks_it_cannot_fuse_are_left_as_they_were_with_a_debug_line",
        ],
        cwd=ROOT,
        env=_without_timm(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 skipped" in run.stdout and "timm is not importable" in run.stdout, run.stdout


def test_the_sessions_flight_records_go_to_a_temporary_folder_outside_the_checkout() -> None:
    folder = Path(os.environ["SYNCBN_FLIGHT_DIR"])
    assert folder.is_dir() and folder.name.startswith("syncbn-flight-"), folder
    assert ROOT not in folder.resolve().parents, folder
