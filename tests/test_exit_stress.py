"""Every rank of a SyncBN job exits 0: the stress loop of issue 55, item 2 (``benchmarks/
exit_stress.py``), kept short. Each job spawns 2 gloo ranks that convert a residual network with
``fuse_residual``, train one step on the C++ path, ``barrier()``, ``destroy_process_group()``;
the five jobs take every variant of the loop (file or TCP store, either rank leaving first) and
share one flight folder. The loop's 200-job runs, idle, under load and beside torchrun jobs, are
in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_five_jobs_of_the_stress_loop_end_with_every_rank_at_0(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/exit_stress.py", "--jobs", "5", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    row = "| 5 | 1 | 0 | 0: 10 |"  # jobs, side by side, failed jobs, ranks by exit code
    assert done.returncode == 0 and row in done.stdout, done.stdout + done.stderr[-3000:]
    flight = list((tmp_path / "flight").rglob("flight_*.bin"))
    assert len(flight) == 10  # 5 jobs x 2 ranks: the default keeps the last 10 jobs
