"""benchmarks/bench_model.py, bench_layer.py and profile_eager.py on a CPU (tiny model smoke
run; argument checks).

The GPU comparison it exists for (ResNet-50, CUDA graphs, torch's SyncBN forced) needs a GPU;
this keeps the script working between the sessions that have one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_model_prints_a_table_for_each_configuration() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_model.py", "--device", "cpu", "--model", "tiny",
         "--batch", "4", "--size", "32", "--steps", "2", "--warmup", "1",
         "--configs", "fp32-nchw,bf16-cl", "--modes", "eager", "--impls", "plain,ours"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| fp32") or
            line.startswith("| bf16")]  # fmt: skip
    assert len(rows) == 4 and all(" - |" in row for row in rows)  # no graph mode on CPU
    assert "device: " in done.stdout and "command: " in done.stdout


@pytest.mark.slow
def test_bench_model_refuses_cuda_only_choices_on_cpu() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_model.py", "--device", "cpu", "--modes", "graph"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "--modes graph needs --device cuda" in done.stderr


@pytest.mark.slow
def test_bench_layer_needs_a_gpu_and_says_so() -> None:
    """benchmarks/bench_layer.py times by CUDA-graph replay: on a CPU it refuses in its parser,
    naming the CPU benchmark to use instead (its GPU figures are in benchmarks/RESULTS.md)."""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_layer.py", "--shapes", "2x8x4x4"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "needs a CUDA GPU (CUDA-graph replay); on CPU use bench_kernels.py" in done.stderr


@pytest.mark.slow
def test_bench_layer_names_a_bad_shape() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_layer.py", "--shapes", "32x256xa"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "--shapes: ['32x256xa'] is not NxCxHxW" in done.stderr


@pytest.mark.slow
def test_profile_eager_writes_its_tables_and_traces_on_cpu(tmp_path: Path) -> None:
    """benchmarks/profile_eager.py (issue 43's GPU profile) on a CPU, tiny model: one row per
    implementation, the category table, the ops beyond plain's, and the files of each side."""
    done = subprocess.run(
        [sys.executable, "benchmarks/profile_eager.py", "--device", "cpu", "--model", "tiny",
         "--batch", "4", "--size", "32", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = (tmp_path / "profile.md").read_text()
    assert "device: " in text and "command: " in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.count("|") > 9}
    assert {"plain", "ours", "ours_reduce"} <= set(rows)
    # 6 BN layers; on the CPU ours adds exactly the C++ path's 2 operators per layer (its steps
    # and collectives inside them), and never syncs.
    assert "syncbn.sync_batch_norm_forward.default +6" in text
    assert "syncbn.sync_batch_norm_backward.default +6" in text
    for impl in ("plain", "ours", "ours_reduce"):
        assert (tmp_path / f"trace_{impl}.json").stat().st_size > 0
        assert "Self CPU" in (tmp_path / f"ops_{impl}.txt").read_text()
        assert (tmp_path / f"syncs_{impl}.txt").read_text() == "no host-device sync\n"


@pytest.mark.slow
def test_profile_eager_refuses_torch_sync_on_cpu(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/profile_eager.py", "--device", "cpu", "--impls", "torch_sync",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "torch_sync needs --device cuda" in done.stderr


@pytest.mark.slow
def test_bench_host_judges_the_cpp_path_against_its_floor_on_cpu() -> None:
    """benchmarks/bench_host.py (the host goal of gpu_check.sh native, there with --device
    cuda) on a CPU: its tables, each path asserted, and one PASS/FAIL line for the C++ path
    over the floor (which of the two is timing, not tested here); the calls inside
    ``step_statistics`` of both modes, over the same layer outside, in both settings."""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_host.py", "--rounds", "1", "--steps", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 1 and " ext: host per layer step / floor " in verdicts[0], verdicts
    assert "| floor |" in done.stdout and "command: " in done.stdout
    for run in ("ext_in_step", "ext_in_step_norm", "nogroup_in_step", "nogroup_in_step_norm"):
        assert done.stdout.count(f"\n{run} / {run.split('_')[0]}: ") == 2, run  # both settings
    for suffix in ("_in_step", "_in_step_norm"):
        assert f"ours_accumulated{suffix} / outside: " in done.stdout, suffix


@pytest.mark.slow
def test_bench_step_statistics_prints_the_cost_by_layers() -> None:
    """benchmarks/bench_step_statistics.py: one row per layer count, the ops it adds the same
    for any count (the merge and the commit cover the layers together)."""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_step_statistics.py", "--rounds", "1", "--steps", "2",
         "--layers", "1,3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    cells = {row[0].strip(): row[1].strip() for row in rows[1:]}
    assert set(cells) == {"1", "3"} and cells["1"] == cells["3"] and int(cells["1"]) > 0, cells


@pytest.mark.slow
def test_bench_before_after_prints_each_side_and_the_paired_ratios() -> None:
    """benchmarks/bench_before_after.py, this checkout on both sides: the four rows, each with
    both sides' medians and one paired ratio with its range."""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_before_after.py", str(ROOT), str(ROOT),
         "--pairs", "2", "--rounds", "1", "--steps", "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [row[0].strip() for row in rows[1:]] == [
        "no group, ext us",
        "one-rank gloo group, ext us",
        "one-rank gloo group, ext / floor",
        "no group, ext / bn",
    ], rows
    for row in rows[1:]:
        assert len(row) == 4 and float(row[1]) > 0 and float(row[2]) > 0, row
        assert row[3].strip().count("(") == 1, row  # the paired median, then its range
