"""The GPU check of the C++ path (``benchmarks/gpu_check.sh native``, ``native_check.py``) as a
dry run on the CPU: a fake ``nvidia-smi``, and canned steps (``--canned``) where a real one needs
a GPU, under the real timeouts, files and verdict.

* The real build on this CPU machine: no CUDA kernels, so the check fails at once naming why,
  and nothing else runs.
* Canned outputs: a pass (a crashed profile reported, never deciding; the pass record written);
  a test step past its timeout, a failed speed figure, a test file that ran no layer on the C++
  path, a deadline that leaves the profile out: each named by the verdict, which decides on what
  completed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import native_check  # noqa: E402


def _fake_gpu(tmp: Path) -> dict[str, str]:
    """An environment with a fake ``nvidia-smi`` first on PATH."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (fake, for a dry run)"\n')
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _check(tmp: Path, canned: Path | None, *extra: str) -> subprocess.CompletedProcess:
    env = _fake_gpu(tmp)
    env["OUT"] = str(tmp / "out")
    args = [] if canned is None else ["--canned", str(canned)]
    env["NATIVE_CHECK_ARGS"] = " ".join([*args, *extra])
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "native"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _steps(out: Path) -> dict[str, dict]:
    lines = (out / "steps.jsonl").read_text().splitlines()
    return {entry["step"]: entry for entry in map(json.loads, lines)}


@pytest.mark.slow
def test_a_build_without_cuda_kernels_fails_at_once_naming_why(tmp_path: Path) -> None:
    done = _check(tmp_path, None)
    out = tmp_path / "out"
    assert done.returncode == 1, done.stdout + done.stderr
    assert "would have no CUDA kernels" in done.stdout, done.stdout
    assert "build failed: nothing else runs" in done.stdout
    assert list(_steps(out)) == ["build"]
    verdict = (out / "verdict.txt").read_text()
    assert verdict.startswith("native: NOT passed")
    assert "build: failed, exit 1" in verdict and "tests_native: did not run" in verdict
    assert not (out / "native_pass.json").exists()
    assert "NVIDIA H200 (fake" in (out / "env.txt").read_text()


def _model(ratio: float, config: str) -> str:
    ours = [60.0, 62.0, 59.0, 61.0, 60.5]
    rows = [
        {"config": config, "batch": 32, "impl": "plain", "eager": 21.0},
        {"config": config, "batch": 32, "impl": "ours", "eager": 60.5, "eager_rounds": ours},
        {
            "config": config,
            "batch": 32,
            "impl": "ours_native",
            "eager": 60.5 * ratio,
            "eager_rounds": [o * ratio for o in ours],
        },
        {"config": config, "batch": 32, "impl": "torch_sync", "eager": 64.0},
    ]
    return json.dumps({"device": "fake", "rows": rows})


def _canned(tmp: Path, **override: str) -> Path:
    """Canned steps that pass; ``override``: a step's script instead."""
    paths = 'printf "%s\\tcuda\\t%s\\n" '
    scripts = {
        "build": 'echo \'{"with_cuda": true, "static_libstdcxx": false, '
        '"sources_digest": "0123456789abcdef"}\' > "$STEP_JSON"; echo built',
        "diag": "echo 'compiler: c++'",
        "tests_native": f'{paths} tests/test_cuda_native.py 1 >> "$SYNCBN_PATH_REPORT"; '
        "echo '48 passed'",
        "tests_layers": f'{paths} tests/test_cuda.py 1 >> "$SYNCBN_PATH_REPORT"; '
        f'{paths} tests/test_cuda_residual.py 1 >> "$SYNCBN_PATH_REPORT"; echo "30 passed"',
        "model_bf16": f"echo '{_model(0.8, 'bf16-cl')}' > \"$STEP_JSON\"",
        "model_fp32": f"echo '{_model(0.9, 'fp32-nchw')}' > \"$STEP_JSON\"",
        "host": 'echo \'{"over_floor": {"ours_native": 1.4}}\' > "$STEP_JSON"',
        "profile": "echo profiling; kill -SEGV $$",  # a crash
        **override,
    }
    canned = tmp / "canned"
    canned.mkdir()
    for name, body in scripts.items():
        (canned / f"{name}.sh").write_text(body + "\n")
    return canned


@pytest.mark.slow
def test_a_pass_is_decided_by_correctness_and_speed_and_a_crashed_profile_only_reported(
    tmp_path: Path,
) -> None:
    done = _check(tmp_path, _canned(tmp_path))
    out = tmp_path / "out"
    verdict = (out / "verdict.txt").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    assert verdict.startswith("native: PASSED"), verdict
    assert "profile: failed, exit -11 (crashed: a signal)" in verdict
    assert (
        "PASS speed bf16-cl: eager ours_native / ours, median of 5 paired rounds 0.800" in verdict
    )
    assert "figure: ours_native / plain 2.30 (goal <= 1.3)" in verdict  # printed, not a gate
    assert "figure: ours_native host / floor 1.40 (goal <= 1.1)" in verdict
    assert "recorded 67.2 ms" in verdict and "recorded 54.0 ms" in verdict
    assert "Not covered: NCCL across several GPUs" in verdict
    record = json.loads((out / "native_pass.json").read_text())
    assert record["extension"] == "0123456789abcdef" and len(record["python"]) == 16
    assert record["device"].startswith("GPU 0: NVIDIA H200")
    assert sorted(p.name for p in out.iterdir()) == [
        "env.txt", "log.txt", "native_pass.json", "paths.tsv", "steps.jsonl", "verdict.txt"
    ]  # fmt: skip


@pytest.mark.slow
def test_a_timeout_a_slow_figure_and_a_file_off_the_path_each_fail_by_name(
    tmp_path: Path,
) -> None:
    """tests_layers runs past its (shortened) timeout after reporting one file only on the
    Python path; the fp32 speed figure is 1.08; the host step runs into the call's deadline,
    which leaves the profile out. The verdict names each, and still decides on what
    completed."""
    slow = 'printf "tests/test_cuda.py\\tcuda\\t0\\n" >> "$SYNCBN_PATH_REPORT"; sleep 30'
    canned = _canned(
        tmp_path,
        tests_layers=slow,
        model_fp32=f"echo '{_model(1.08, 'fp32-nchw')}' > \"$STEP_JSON\"",
        host="sleep 60",
    )
    done = _check(tmp_path, canned, "--timeout", "tests_layers=6", "--deadline", "25")
    out = tmp_path / "out"
    verdict = (out / "verdict.txt").read_text()
    assert done.returncode == 1, done.stdout + done.stderr
    assert verdict.startswith("native: NOT passed")
    assert "tests_layers: timed out after 6 s" in verdict
    assert "FAIL path tests/test_cuda.py: 0 C++-path plans on CUDA, 1 Python-path ones" in verdict
    assert "FAIL path tests/test_cuda_residual.py: 0 C++-path plans" in verdict
    assert "ok path tests/test_cuda_native.py" in verdict
    assert "FAIL speed fp32-nchw: eager ours_native / ours, median of 5 paired rounds 1.080" in (
        verdict
    )
    assert "PASS speed bf16-cl" in verdict
    assert "host: timed out after" in verdict and "profile: did not run" in verdict
    assert _steps(out)["tests_layers"]["timed_out"] is True
    assert not (out / "native_pass.json").exists()


def test_the_budget_fits_the_call() -> None:
    """The steps' timeouts add up to the deadline, at most 7 minutes (the profile takes what
    remains), and the model steps measure enough paired rounds to decide."""
    fixed = [step.timeout for step in native_check.steps() if step.name != "profile"]
    assert sum(fixed) <= native_check.DEADLINE_S <= 7 * 60
    for step in native_check.steps():
        if step.name.startswith("model"):
            rounds = step.argv[step.argv.index("--rounds") + 1]
            assert int(rounds) >= native_check.MIN_ROUNDS


@pytest.mark.parametrize("rounds", [4, 5])
def test_fewer_paired_rounds_than_needed_do_not_decide(rounds: int) -> None:
    data = json.loads(_model(0.5, "bf16-cl"))
    for row in data["rows"]:
        if "eager_rounds" in row:
            row["eager_rounds"] = row["eager_rounds"][:rounds]
    result = {"step": "model_bf16", "rc": 0, "timed_out": False, "timeout": 55, "data": data}
    ok, lines = native_check.speed_lines(result, "bf16-cl")
    assert ok is (rounds >= 5), lines


def test_a_pass_is_recorded_only_for_this_tree(tmp_path: Path) -> None:
    """``tools/record_native_pass.py`` appends a pass of this checkout's digests to the record
    (which then parses and matches), and refuses a pass of other sources."""
    sys.path.insert(0, str(ROOT / "tools"))
    import record_native_pass

    from syncbn_lightning.ops import build
    from syncbn_lightning.ops.dispatch import python_path_digest

    record = tmp_path / "native_passes.py"
    record.write_text(record_native_pass.RECORD.read_text())
    here = {"extension": build.sources_digest(build.csrc_dir()), "python": python_path_digest()}
    with pytest.raises(ValueError, match="other python sources"):
        record_native_pass.record_pass({**here, "python": "0" * 16}, record)
    record_native_pass.record_pass({**here, "device": "GPU 0: NVIDIA H200"}, record)
    namespace: dict = {}
    exec(record.read_text(), namespace)
    assert namespace["PASSES"] == ({**here, "device": "GPU 0: NVIDIA H200"},)
    assert namespace["__doc__"].startswith("The passes of")


def test_the_native_steps_test_files_leave_the_path_switch_alone() -> None:
    """The test files the native steps run under SYNCBN_NATIVE_CUDA=1 never assign, pop or
    delete the variable themselves (monkeypatch restores it): one that did once put every later
    test of the step on the Python path while the step said the C++ path."""
    import re

    writes = re.compile(r"os\.environ(\[[^]]*NATIVE|\.pop\([^)]*NATIVE)|del os\.environ")
    for step in native_check.steps():
        for test_file in step.test_files:
            text = (ROOT / test_file).read_text()
            assert not writes.search(text), (test_file, writes.search(text).group(0))
            assert "SYNCBN_NATIVE_CUDA" not in text or "monkeypatch" in text, test_file
