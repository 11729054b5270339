"""Do ranks die at exit right after a backward? torchrun jobs that end as soon as they trained.

    python benchmarks/exit_after_backward.py --jobs 200 --out /tmp/eab
    ../shared/tools/with-load python benchmarks/exit_after_backward.py --jobs 200 --out /tmp/eab \
        --compare ../other-checkout              # alternate with another checkout's library
    python benchmarks/exit_after_backward.py --job ddp --jobs 30 --out /tmp/eab  # torch alone

Each job is ``torchrun --nproc-per-node 2`` of a script that trains 3 steps of conv -> BatchNorm
-> ReLU on gloo and calls ``destroy_process_group()`` right after the last ``optimizer.step()``:

* ``--job syncbn`` (default): the model converted with ``convert_sync_batchnorm`` (the C++ path
  on CPU), no DDP; ``--job syncbn-ref``: the same on the Python path (``SYNCBN_IMPL=ref``);
* ``--job ddp``: plain ``BatchNorm2d`` in DDP, no syncbn_lightning (torch's own behaviour);
* ``--job ddp-syncbn``: the converted model in DDP, the wrapper still held at exit as a Lightning
  trainer holds it (DDP's bucket all-reduces carry the backward's Python object; the exit drain,
  ``distributed/exit_drain.py``, is what stands between them and finalization).

This is where torch 2.13 on gloo can end a rank with SIGABRT, "terminate called without an
active exception": a gloo worker thread releasing a finished collective of the backward after the
interpreter began to finalize (docs/reliability.md). With ``--compare PATH`` the jobs alternate
between this checkout's library and PATH's (``PYTHONPATH``), so both sides see the same machine.
Every rank runs in its own folder under ``--out`` with core dumps allowed (``gdb python core``
then shows the thread that aborted). Prints one markdown table: per side, jobs, jobs with a
SIGABRT, other failures, seconds per job.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]

_JOB = r"""
import os, sys
import torch, torch.distributed as dist
from torch import nn

kind, folder = sys.argv[1], sys.argv[2]
os.chdir(os.path.join(folder, f"rank{os.environ['RANK']}"))  # a core dump per rank
dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
if kind != "ddp":
    from syncbn_lightning import convert_sync_batchnorm
    model = convert_sync_batchnorm(model)
if kind.startswith("ddp"):
    model = nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(2, 3, 16, 16)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
"""


def _allow_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_job(kind: str, folder: Path, library: Path) -> tuple[int, bool]:
    """One torchrun job with ``library`` (a checkout) first on the path: (torchrun's exit code,
    whether a rank printed 'terminate called')."""
    for rank in (0, 1):
        (folder / f"rank{rank}").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(library)}
    if kind == "syncbn-ref":
        env["SYNCBN_IMPL"] = "ref"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(folder.parent / "job.py"),
               "syncbn" if kind == "syncbn-ref" else kind, str(folder)]  # fmt: skip
    with open(folder / "output.txt", "w") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  timeout=240, preexec_fn=_allow_core_dumps).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = -999
    return code, "terminate called" in (folder / "output.txt").read_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs per side")
    parser.add_argument(
        "--job", choices=["syncbn", "syncbn-ref", "ddp", "ddp-syncbn"], default="syncbn"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", type=Path, help="another checkout, alternated with this one")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "job.py").write_text(_JOB)
    sides: dict[str, Path] = {"this checkout": _ROOT}
    if args.compare is not None:
        sides[str(args.compare)] = args.compare.resolve()
    found = {side: {"aborted": 0, "other": 0, "seconds": 0.0} for side in sides}
    for index in range(args.jobs):
        for number, (side, library) in enumerate(sides.items()):
            start = time.monotonic()
            code, aborted = run_job(args.job, args.out / f"job{index:04d}-{number}", library)
            found[side]["seconds"] += time.monotonic() - start
            if aborted:
                found[side]["aborted"] += 1
            elif code != 0:
                found[side]["other"] += 1
    print(f"command: python benchmarks/exit_after_backward.py {' '.join(sys.argv[1:])}")
    print(f"torch {__import__('torch').__version__}, Python {sys.version.split()[0]}\n")
    print("| library | jobs | SIGABRT at exit | other failures | s / job |")
    print("|---|---:|---:|---:|---:|")
    for side, counts in found.items():
        print(
            f"| {side} | {args.jobs} | {counts['aborted']} | {counts['other']} | "
            f"{counts['seconds'] / max(args.jobs, 1):.1f} |"
        )
    return 1 if any(c["aborted"] or c["other"] for c in found.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
