"""Every rank of a SyncBN job exits 0: the stress loop of issue 55, item 2 (``benchmarks/
exit_stress.py``), kept short. Each job spawns 2 gloo ranks that convert a residual network with
``fuse_residual``, train one step on the C++ path, ``barrier()``, ``destroy_process_group()``;
the five jobs take every variant of the loop (file or TCP store, either rank leaving first) and
share one flight folder. The loop's 200-job runs, idle, under load and beside torchrun jobs, are
in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _stress_loop():
    """``benchmarks/exit_stress.py`` as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("exit_stress", ROOT / "benchmarks/exit_stress.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_five_jobs_of_the_stress_loop_end_with_every_rank_at_0(tmp_path: Path) -> None:
    stress = _stress_loop()
    (tmp_path / "job.py").write_text(stress._JOB)
    for index in range(5):  # every variant of the loop: file or TCP store, either rank first
        _, codes, terminated, _ = stress.run_job(index, tmp_path, tmp_path / "flight")
        assert codes == ["0", "0"] and not terminated, (index, codes, terminated)
    flight = list((tmp_path / "flight").rglob("flight_*.bin"))
    assert len(flight) == 10  # 5 jobs x 2 ranks: the default keeps the last 10 jobs
