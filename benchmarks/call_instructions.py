"""Instructions per layer call on several checkouts, counted by valgrind's callgrind: exact where
timings on a busy 2-core machine spread by tens of percent.

Each checkout (a worktree of an older commit, say) runs, from its own tree (``PYTHONPATH``), the
same loop: ``SyncBatchNorm(8, force_sync=True, impl="ext")`` (the C++ path, no process group) on
a 2x8x4x4 float32 input, ``layer(x)`` (``--mode fwd``) or ``layer(x).backward(g)`` (``step``),
after 50 warm-up steps. Two runs per checkout, with 0 and ``--calls`` calls, so that the import
and the warm-up cancel: the figure is their difference over ``--calls``, in thousands of
instructions. ``PYTHONHASHSEED=0``; what is left varies by about 1-2 K between runs (the
allocator, the garbage collector). Needs ``valgrind`` (about a minute a run).

    python benchmarks/call_instructions.py BEFORE_DIR AFTER_DIR [--mode fwd|step] [--calls 4000]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: The loop each run executes, ``calls`` and ``mode`` from its arguments.
LOOP = """
import sys, torch
torch.set_num_threads(1)
from syncbn_lightning import SyncBatchNorm
layer = SyncBatchNorm(8, force_sync=True, impl="ext").train()
x, g = torch.randn(2, 8, 4, 4, requires_grad=True), torch.randn(2, 8, 4, 4)
for _ in range(50):
    layer(x).backward(g)
assert layer._sync_plan.native, "the C++ path did not run"
calls, mode = int(sys.argv[1]), sys.argv[2]
for _ in range(calls):
    out = layer(x)
    if mode == "step":
        out.backward(g)
"""


def instructions(checkout: Path, calls: int, mode: str) -> int:
    """The instructions callgrind counts for one run of :data:`LOOP` in ``checkout``."""
    python = os.path.realpath(sys.executable)  # not a shim script: valgrind runs the binary
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    command += [python, "-c", LOOP, str(calls), mode]
    env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        command, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{checkout}: the run failed:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def per_call(checkout: Path, calls: int, mode: str) -> float:
    """Thousands of instructions per call in ``checkout`` (two runs at once)."""
    with ThreadPoolExecutor(2) as pool:
        empty, full = pool.map(lambda n: instructions(checkout, n, mode), (0, calls))
    return (full - empty) / calls / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="+", type=Path)
    parser.add_argument("--mode", choices=("fwd", "step"), default="step")
    parser.add_argument("--calls", type=int, default=4000)
    args = parser.parse_args()
    print("command: python benchmarks/call_instructions.py " + " ".join(sys.argv[1:]))
    figures = [per_call(path.resolve(), args.calls, args.mode) for path in args.checkouts]
    print(f"| checkout | K instructions per {args.mode} | over the first |")
    print("|---|---:|---:|")
    for path, value in zip(args.checkouts, figures, strict=True):
        print(f"| {path} | {value:.1f} | {value / figures[0]:.3f} |")


if __name__ == "__main__":
    main()
