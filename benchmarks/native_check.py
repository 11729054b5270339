"""The GPU check of the C++ path on CUDA tensors: may CUDA layers take it by default?

    OUT=/tmp/gpu bash benchmarks/gpu_check.sh native        # = python benchmarks/native_check.py

One call of the device tool, build included, in at most :data:`DEADLINE_S` seconds (the sum of
the steps' timeouts). It decides by correctness first, then by speed against what users have
today (the Python path), and reports the rest as figures. Each step writes its result as one
line of ``$OUT/steps.jsonl`` when it ends, and the verdict is computed from those lines alone: a
call cut short still decides on what completed, and the verdict names what did not run.

========== ============================================================== ======== =========
step       what                                                           role     timeout s
========== ============================================================== ======== =========
build      the extension with its CUDA kernels (``SYNCBN_REQUIRE_CUDA_     decides  70
           BUILD=1``: a build without them fails at once, naming why)     (first)
diag       the toolchain's libstdc++ (``image_diag.py``)                  reported 15
tests_     ``tests/test_cuda_native.py`` on the C++ path: bitwise the     decides  110
native     Python path, 0 host syncs per step (``set_sync_debug_mode
           ("error")``), graph replay equal to eager, a skipped layer
           found before the step's last call, C++ errors are Python's
tests_     the layer tests of ``test_cuda.py`` and ``test_cuda_residual   decides  90
layers     .py`` on the C++ path (the kernel tests, which take no path,
           and the step_statistics sync test left out)
model_bf16 ResNet-50 eager, bf16 channels-last b32: the median of 5       decides  55
           paired rounds of ours_native / ours must be <= 1.0
model_fp32 the same, fp32 b64                                             decides  55
host       ``bench_host.py --device cuda``: host per layer over the floor reported 25
profile    ``profile_eager.py``: where the host time goes, per layer      reported the rest
========== ============================================================== ======== =========

Every test file of the two test steps must show that its layers ran on the C++ path: the
tests report each plan a layer makes (``tests/_path_report.py``, ``$OUT/paths.tsv``), and a file
without a C++-path plan on CUDA fails the check. Beside their goals, never gates: ours_native /
plain (<= 1.3), torch SyncBatchNorm / ours_native (>= 2), the host figure over the floor
(<= 1.1, a goal calibrated on gloo), and ours (the Python path) against its last recorded
figures (:data:`RECORDED_OURS_MS`), so that a slower Python path cannot make the C++ path look
good. The verdict does not cover NCCL across several GPUs (the machine has one GPU: a one-rank
NCCL group, and 2 gloo ranks sharing it).

Files under ``$OUT`` (the device tool returns at most 8): ``env.txt``, ``steps.jsonl``,
``log.txt`` (every step's output), ``paths.tsv``, ``verdict.txt``, ``profile.tgz`` and, on a pass,
``native_pass.json``, which ``python tools/record_native_pass.py`` adds to
``syncbn_lightning/ops/native_passes.py``: CUDA layers then take the C++ path by default on
exactly these sources.

A dry run without a GPU (``tests/test_native_check.py``): ``--canned DIR`` runs
``DIR/<step>.sh`` instead of a step's command where that file exists (with ``OUT``, ``STEP_JSON``
and ``SYNCBN_PATH_REPORT`` in its environment), under the same timeouts; ``--timeout
STEP=SECONDS`` shortens one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: The whole call's budget, build included: the sum of the steps' timeouts below.
DEADLINE_S = 420
#: The eager step of ours (the Python path), ms, as last recorded (benchmarks/RESULTS.md,
#: 2026-11-26, H200): shown beside today's so that a slower Python path is seen.
RECORDED_OURS_MS = {"bf16-cl": 67.2, "fp32-nchw": 54.0}
#: Paired rounds the speed figure needs, and its goal: the C++ path no slower than the Python.
MIN_ROUNDS, SPEED_GOAL = 5, 1.0

_PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu and not slow"]
_KERNEL_TESTS = "not kernels_match and not merge_of_an_all_empty and not stats_are_accurate"
#: The layer tests the verdict runs: not the kernel tests (they take no path), nor the steps
#: inside step_statistics (a sync check of its own, run by ``gpu_check.sh tests``: it is not one
#: of what decides, and its NCCL setup and 16 micro-batch steps would eat the step's margin).
_LAYER_TESTS = f"{_KERNEL_TESTS} and not accumulated_steps"
_IMPLS = "plain,ours,ours_native,torch_sync"
_MODEL = [
    sys.executable, "benchmarks/bench_model.py", "--modes", "eager", "--rounds", str(MIN_ROUNDS),
    "--steps", "10", "--warmup", "3", "--impls", _IMPLS,
]  # fmt: skip
_HOST_ROUNDS = ("--rounds", "5", "--steps", "200")
_BUILD = """
import json, os, time
from syncbn_lightning.ops import build
started = time.perf_counter()
ext = build.load_extension()
record = {"with_cuda": ext.with_cuda, "static_libstdcxx": ext.static_libstdcxx,
          "sources_digest": ext.sources_digest, "seconds": time.perf_counter() - started,
          "directory": str(build.build_dir())}
print(json.dumps(record))
json.dump(record, open(os.environ["STEP_JSON"], "w"))
"""


@dataclass(frozen=True)
class Step:
    """One step: its command, its timeout, whether it decides, and its test files (those that
    must show C++-path plans)."""

    name: str
    argv: list[str]
    timeout: int
    decides: bool
    env: dict[str, str] = field(default_factory=dict)
    test_files: tuple[str, ...] = ()


def steps() -> list[Step]:
    """The steps, in the order they run (``profile`` last: it takes what remains)."""
    native = {"SYNCBN_NATIVE_CUDA": "1", "SYNCBN_IMPL": "ext"}
    layers = ("tests/test_cuda.py", "tests/test_cuda_residual.py")
    return [
        Step("build", [sys.executable, "-c", _BUILD], 70, True, {"SYNCBN_REQUIRE_CUDA_BUILD": "1"}),
        Step("diag", [sys.executable, "benchmarks/image_diag.py", "--budget", "12"], 15, False),
        Step(
            "tests_native",
            [*_PYTEST, "tests/test_cuda_native.py"],
            110,
            True,
            native,
            ("tests/test_cuda_native.py",),
        ),
        Step("tests_layers", [*_PYTEST, "-k", _LAYER_TESTS, *layers], 90, True, native, layers),
        Step("model_bf16", [*_MODEL, "--configs", "bf16-cl", "--batch", "32"], 55, True),
        Step("model_fp32", [*_MODEL, "--configs", "fp32-nchw", "--batch", "64"], 55, True),
        Step(
            "host",
            [sys.executable, "benchmarks/bench_host.py", *("--device", "cuda"), *_HOST_ROUNDS],
            25,
            False,
        ),
        Step(
            "profile",
            [sys.executable, "benchmarks/profile_eager.py", *("--impls", _IMPLS)],
            0,  # what remains of the deadline
            False,
        ),
    ]


# ------------------------------------------------------------------------------------------------
# Running the steps
# ------------------------------------------------------------------------------------------------


def _command(step: Step, canned: Path | None, json_path: Path, work: Path) -> list[str]:
    if canned is not None and (canned / f"{step.name}.sh").is_file():
        return ["bash", str(canned / f"{step.name}.sh")]
    if step.name in ("diag", "host") or step.name.startswith("model"):
        return [*step.argv, "--json", str(json_path)]
    if step.name == "profile":
        return [*step.argv, "--out", str(work / "profile")]
    return step.argv


def run_step(
    step: Step, out: Path, timeout: float, canned: Path | None, work: Path
) -> dict[str, Any]:
    """Run ``step`` within ``timeout`` seconds; append its output to ``log.txt`` and its result
    to ``steps.jsonl`` (``rc``, ``seconds``, ``timed_out`` and the JSON the step wrote, if any);
    returns the result."""
    json_path = work / f"{step.name}.json"
    env = {
        **os.environ,
        **step.env,
        "OUT": str(out),
        "STEP_JSON": str(json_path),
        "SYNCBN_PATH_REPORT": str(out / "paths.tsv"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    started = time.monotonic()
    timed_out = False
    try:
        done = subprocess.run(
            _command(step, canned, json_path, work),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        rc, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        timed_out, rc = True, 124
        text = _text(exc.stdout) + _text(exc.stderr)
    result: dict[str, Any] = {
        "step": step.name,
        "rc": rc,
        "seconds": round(time.monotonic() - started, 1),
        "timeout": round(timeout),
        "timed_out": timed_out,
        "decides": step.decides,
    }
    if json_path.is_file():
        try:
            result["data"] = json.loads(json_path.read_text())
        except json.JSONDecodeError as exc:
            result["data_error"] = str(exc)
    if step.name == "profile" and (work / "profile").is_dir():
        with tarfile.open(out / "profile.tgz", "w:gz") as archive:
            archive.add(work / "profile", arcname="profile")
    with open(out / "log.txt", "a") as log:
        log.write(f"==== {step.name}: exit {rc}, {result['seconds']} s of {timeout:.0f}\n{text}\n")
    with open(out / "steps.jsonl", "a") as lines:
        lines.write(json.dumps(result) + "\n")
    tail = "\n".join(text.strip().splitlines()[-6:])
    print(f"== {step.name}: exit {rc} in {result['seconds']} s{' (timed out)' * timed_out}\n{tail}")
    return result


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


# ------------------------------------------------------------------------------------------------
# The verdict, from the files alone
# ------------------------------------------------------------------------------------------------


def read_paths(path: Path) -> dict[str, dict[str, list[int]]]:
    """``paths.tsv`` (``tests/_path_report.py``): per test file, per device type, ``[Python-path
    plans, C++-path plans]``."""
    counts: dict[str, dict[str, list[int]]] = {}
    if not path.is_file():
        return counts
    for line in path.read_text().splitlines():
        test, device, native = line.split("\t")
        counts.setdefault(test, {}).setdefault(device, [0, 0])[int(native)] += 1
    return counts


def _status(result: dict[str, Any] | None) -> str:
    if result is None:
        return "did not run"
    if result["timed_out"]:
        return f"timed out after {result['timeout']} s"
    if result["rc"] != 0:
        crashed = " (crashed: a signal)" if result["rc"] < 0 or result["rc"] > 128 else ""
        return f"failed, exit {result['rc']}{crashed}"
    return "ok"


def _rows(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["impl"]: row for row in result.get("data", {}).get("rows", [])}


def speed_lines(result: dict[str, Any] | None, config: str) -> tuple[bool, list[str]]:
    """Whether the model step ``result`` meets the speed goal (the median of its paired rounds
    ours_native / ours), with its lines: the figure that decides, then the others."""
    rows = _rows(result) if result is not None and _status(result) == "ok" else {}
    native, ours = rows.get("ours_native", {}), rows.get("ours", {})
    rounds = list(zip(native.get("eager_rounds", []), ours.get("eager_rounds", []), strict=False))
    if len(rounds) < MIN_ROUNDS:
        return False, [f"  speed {config}: {len(rounds)} paired rounds, {MIN_ROUNDS} needed"]
    ratios = [a / b for a, b in rounds]
    median = statistics.median(ratios)
    ok = median <= SPEED_GOAL
    lines = [
        f"  {'PASS' if ok else 'FAIL'} speed {config}: eager ours_native / ours, median of "
        f"{len(ratios)} paired rounds {median:.3f} (<= {SPEED_GOAL}; rounds "
        f"{', '.join(f'{r:.3f}' for r in ratios)})"
    ]
    plain, torch_sync = rows.get("plain", {}).get("eager"), rows.get("torch_sync", {}).get("eager")
    if plain:
        lines.append(f"  figure: ours_native / plain {native['eager'] / plain:.2f} (goal <= 1.3)")
    if torch_sync:
        lines.append(
            f"  figure: torch SyncBatchNorm / ours_native {torch_sync / native['eager']:.2f} "
            "(goal >= 2)"
        )
    lines.append(
        f"  figure: ours (Python path) {ours['eager']:.1f} ms, recorded "
        f"{RECORDED_OURS_MS[config]} ms; ours_native {native['eager']:.1f} ms"
    )
    return ok, lines


def verdict(out: Path) -> tuple[bool, list[str]]:
    """The verdict from ``out``'s files: passed, and its lines (see the module docstring)."""
    results: dict[str, dict[str, Any]] = {}
    if (out / "steps.jsonl").is_file():
        for line in (out / "steps.jsonl").read_text().splitlines():
            entry = json.loads(line)
            results[entry["step"]] = entry
    passed, lines = True, ["Correctness (decides):"]
    for step in steps():
        if not step.decides or step.name.startswith("model"):
            continue
        status = _status(results.get(step.name))
        build = results.get("build", {}).get("data", {})
        if step.name == "build" and status == "ok" and not build.get("with_cuda"):
            status = "built without CUDA kernels"
        passed &= status == "ok"
        lines.append(f"  {step.name}: {status}")
    paths = read_paths(out / "paths.tsv")
    for step in steps():
        for test_file in step.test_files:
            python, cpp = paths.get(test_file, {}).get("cuda", [0, 0])
            ok = cpp > 0 and results.get(step.name) is not None
            passed &= ok
            lines.append(
                f"  {'ok' if ok else 'FAIL'} path {test_file}: {cpp} C++-path plans on CUDA, "
                f"{python} Python-path ones"
            )
    lines.append("Speed against the Python path (decides):")
    for name, config in (("model_bf16", "bf16-cl"), ("model_fp32", "fp32-nchw")):
        status = _status(results.get(name))
        ok, speed = speed_lines(results.get(name), config)
        passed &= ok
        lines += [f"  {name}: {status}", *speed]
    lines.append("Reported (never decides):")
    for name in ("diag", "host", "profile"):
        lines.append(f"  {name}: {_status(results.get(name))}")
    host = results.get("host", {}).get("data", {}).get("over_floor", {})
    if "ours_native" in host:
        lines.append(f"  figure: ours_native host / floor {host['ours_native']:.2f} (goal <= 1.1)")
    lines.append("Not covered: NCCL across several GPUs (one GPU here).")
    head = (
        "native: PASSED: CUDA layers may take the C++ path by default (record it: "
        "python tools/record_native_pass.py OUT/native_pass.json)"
        if passed
        else "native: NOT passed: CUDA layers keep the Python path by default"
    )
    return passed, [head, *lines]


def write_verdict(out: Path) -> bool:
    """Write ``verdict.txt`` (and ``native_pass.json`` on a pass); print it; return passed."""
    passed, lines = verdict(out)
    (out / "verdict.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if passed:
        (out / "native_pass.json").write_text(json.dumps(pass_record(out), indent=1) + "\n")
    return passed


def pass_record(out: Path) -> dict[str, Any]:
    """What a pass records: the digests of the sources it ran on (the extension's, from the
    build step; the library's Python files), the device, torch and the date."""
    from syncbn_lightning.ops.dispatch import python_path_digest

    build = {}
    for line in (out / "steps.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry["step"] == "build":
            build = entry.get("data", {})
    env = (out / "env.txt").read_text().strip().splitlines() if (out / "env.txt").is_file() else []
    return {
        "extension": build.get("sources_digest", ""),
        "python": python_path_digest(),
        "device": env[0] if env else "",
        "torch": env[1] if len(env) > 1 else "",
        "date": datetime.date.today().isoformat(),
    }


# ------------------------------------------------------------------------------------------------
# The call
# ------------------------------------------------------------------------------------------------


def _environment(out: Path) -> None:
    """``env.txt``: the GPU (``nvidia-smi -L``) and the torch/CUDA versions."""
    try:
        gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        device = gpu.stdout.strip().splitlines()[0] if gpu.stdout.strip() else gpu.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        device = f"nvidia-smi: {exc}"
    import torch

    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    (out / "env.txt").write_text(f"{device}\n{versions}\n")
    print(f"{device}\n{versions}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    parser.add_argument("--canned", type=Path, help="dry run: DIR/<step>.sh replaces a step")
    parser.add_argument("--timeout", action="append", default=[], help="STEP=SECONDS")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S)
    args = parser.parse_args(argv)
    timeouts = dict(item.split("=", 1) for item in args.timeout)
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in ("steps.jsonl", "log.txt", "paths.tsv", "verdict.txt", "native_pass.json"):
        (args.out / stale).unlink(missing_ok=True)
    deadline = time.monotonic() + args.deadline
    _environment(args.out)
    with tempfile.TemporaryDirectory(prefix="native_check_") as work:
        for step in steps():
            left = deadline - time.monotonic()
            timeout = min(float(timeouts.get(step.name, step.timeout or left)), left)
            if timeout < 5:
                print(f"== {step.name}: not run ({left:.0f} s of the deadline left)")
                continue
            result = run_step(step, args.out, timeout, args.canned, Path(work))
            if step.name == "build" and (result["rc"] != 0 or result["timed_out"]):
                print("== build failed: nothing else runs")
                break
    return 0 if write_verdict(args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
