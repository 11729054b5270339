"""Soak of the default job: ``python train.py`` run again and again with every core busy, counting
runs, hangs, failures and training steps.

Each run is the service's default job as a user starts it (``python train.py`` plus any
``--overrides``), from the repository root, while ``--load`` CPU-bound processes keep every core
busy (as ``../shared/tools/with-load`` does). A run that has not ended after ``--hang-after``
seconds counts as a hang: its processes' Python stacks are written next to its log (py-spy, when
installed), then the job is killed. A run that ends with a non-zero exit status is a failure. Steps
come from the run's ``results.json`` (``global_step``). The table is printed and, with ``--out``,
written as Markdown.

Example:
    python benchmarks/soak_jobs.py --runs 20 --out /tmp/soak_jobs.md
    python benchmarks/soak_jobs.py --runs 3 -- trainer.max_epochs=2   # shorter jobs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from _common import busy_cores, cpu_model

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    """One job of the soak."""

    index: int
    status: str  # "finished", "failed" or "hung"
    seconds: float
    steps: int | None
    returncode: int | None
    log: Path
    note: str = ""


def _job_processes(root_pid: int) -> list[int]:
    """The job's processes: ``root_pid`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _dump_stacks(pids: Sequence[int], path: Path) -> None:
    """Every process's Python stacks (``py-spy dump``) into ``path``, if py-spy is installed."""
    spy = shutil.which("py-spy")
    with open(path, "w") as out:
        if spy is None:
            out.write("py-spy not installed: no stacks (pip install py-spy)\n")
            return
        for pid in pids:
            out.write(f"=== pid {pid}\n")
            out.flush()
            subprocess.run([spy, "dump", "--pid", str(pid)], stdout=out, stderr=out, check=False)


def _output_dir(log_text: str) -> Path | None:
    """The run's output directory, from the job's ``outputs: <dir>`` line."""
    match = re.search(r"outputs: (\S+) \(config", log_text)
    return Path(match.group(1)) if match else None


def _steps(out_dir: Path | None) -> int | None:
    with contextlib.suppress(OSError, ValueError, TypeError):
        return int(json.loads((out_dir / "results.json").read_text())["global_step"])
    return None


def run_job(index: int, overrides: Sequence[str], hang_after: float, logs: Path) -> Run:
    """One ``python train.py`` under the caller's load; killed (a hang) after ``hang_after``."""
    log = logs / f"run{index:03d}.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        job = subprocess.Popen(
            [sys.executable, "train.py", *overrides],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = job.wait(timeout=hang_after)
        except subprocess.TimeoutExpired:
            _dump_stacks(_job_processes(job.pid), logs / f"run{index:03d}.stacks")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            code = None
    seconds = time.monotonic() - started
    text = log.read_text(errors="replace")
    steps = _steps(_output_dir(text))
    if code is None:
        return Run(index, "hung", seconds, steps, None, log, f"killed after {hang_after:.0f} s")
    status = "finished" if code == 0 else "failed"
    note = "" if code == 0 else (text.strip().splitlines() or [""])[-1][:160]
    return Run(index, status, seconds, steps, code, log, note)


def report(runs: list[Run], load: int, overrides: Sequence[str]) -> str:
    """The Markdown table of the soak and its summary line."""
    lines = [
        f"`python benchmarks/soak_jobs.py --runs {len(runs)} --load {load}"
        + (f" -- {' '.join(overrides)}" if overrides else "")
        + f"`: `{' '.join(['python train.py', *overrides])}` with {load} CPU-bound processes "
        f"beside it, on {os.cpu_count()} cores ({cpu_model()}); a run still going after "
        f"the hang limit counts as hung",
        "",
        "| run | result | steps | s | note |",
        "|---:|---|---:|---:|---|",
    ]
    lines += [
        f"| {r.index} | {r.status} | {r.steps if r.steps is not None else '-'} | "
        f"{r.seconds:.0f} | {r.note} |"
        for r in runs
    ]
    count = {s: sum(r.status == s for r in runs) for s in ("finished", "failed", "hung")}
    steps = sum(r.steps or 0 for r in runs)
    lines += [
        "",
        f"**{len(runs)} runs: {count['finished']} finished, {count['hung']} hung, "
        f"{count['failed']} failed; {steps} training steps in all "
        f"({sum(r.seconds for r in runs) / 60:.1f} min).**",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="jobs to run, one after another")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes")
    parser.add_argument(
        "--hang-after", type=float, default=900.0, help="seconds after which a run is a hang"
    )
    parser.add_argument("--logs", type=Path, default=None, help="where run logs go (temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write the table here (Markdown)")
    parser.add_argument("overrides", nargs="*", help="config overrides for train.py (after --)")
    args = parser.parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="soak_jobs-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    with busy_cores(args.load, args.runs * args.hang_after + 60):
        for i in range(1, args.runs + 1):
            run = run_job(i, args.overrides, args.hang_after, logs)
            print(f"run {i}: {run.status} in {run.seconds:.0f} s, {run.steps} steps", flush=True)
            runs.append(run)
    table = report(runs, args.load, args.overrides)
    print(table)
    print(f"logs: {logs}")
    if args.out:
        args.out.write_text(table + "\n")
    return 0 if all(r.status == "finished" for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
