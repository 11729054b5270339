"""Do SyncBN jobs end clean? Many short 2-rank jobs, every rank's exit code and output kept.

    python benchmarks/exit_stress.py --jobs 200 --out /tmp/exits               # one at a time
    python benchmarks/exit_stress.py --jobs 200 --parallel 2 --out /tmp/exits  # jobs side by side
    ../shared/tools/with-load python benchmarks/exit_stress.py --jobs 200 --out /tmp/exits
    python benchmarks/exit_stress.py --jobs 200 --torchrun-beside --out /tmp/exits  # + torchrun

Each job is issue 55's: a launcher process spawns 2 ranks with ``torch.multiprocessing`` (gloo,
rendezvous alternately through a file store and a TCP store hosted by rank 0); each rank converts
a small residual network with ``fuse_residual=True`` (a watcher per rank), runs one train step
on the C++ path, ``barrier()``, ``destroy_process_group()``, then one of the ranks lingers a
little (the store's host leaves first or last). Jobs share one flight-record folder, as jobs of
one machine do. A job passes when both ranks exit 0 and no output mentions ``terminate called``;
every job's stdout and stderr are kept under ``--out`` for the ones that did not. A TCP job whose
rank 0 could not listen on the port the launcher picked (EADDRINUSE: another process took it
between the pick and the bind, a race of this harness's rendezvous, not of SyncBN) counts as
failed, its ranks' codes marked ``port-race``. Prints one markdown table: jobs, failed jobs, ranks
by exit code, the wall time, and the command.

``--torchrun-beside`` also runs 2-rank torchrun jobs of the same step one after another for as long
as the loop runs (other SyncBN jobs on the machine, the flight folder shared); their count and
failures follow the table (torchrun's exit code: non-zero when a rank's was).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_JOB = r"""
import datetime, faulthandler, os, socket, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)) + x)


def worker(rank, init, linger):
    # A rank still alive after 100 s (a job takes seconds) writes every thread's stack to its
    # stderr, then again every 100 s: where it waits, kept with the job's output.
    faulthandler.dump_traceback_later(100, repeat=True)
    torch.set_num_threads(1)
    from syncbn_lightning import convert_sync_batchnorm
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(rank)
        net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), Block())
        net = convert_sync_batchnorm(net, fuse_residual=[Block])
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        net(torch.randn(2, 3, 8, 8)).square().mean().backward()
        optimizer.step()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == (0 if linger > 0 else 1):
        time.sleep(abs(linger))


if __name__ == "__main__":
    kind, folder, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
    if kind == "torchrun":  # a rank of a torchrun job: the launcher is torchrun's
        worker(int(os.environ["RANK"]), "env://", linger)
        sys.exit(0)
    if kind == "tcp":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    else:
        init = f"file://{folder}/store"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, init, linger)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    print("exitcodes", " ".join(str(p.exitcode) for p in procs))
"""

_VARIANTS = [("file", 0.0), ("tcp", 0.3), ("file", -0.3), ("tcp", -0.3), ("tcp", 0.0)]


def run_job(index: int, out: Path, flight: Path) -> tuple[int, list[str], bool, float]:
    """Job ``index``: (index, the ranks' exit codes, whether an output says 'terminate called',
    seconds)."""
    kind, linger = _VARIANTS[index % len(_VARIANTS)]
    folder = out / f"job{index:04d}"
    folder.mkdir(parents=True, exist_ok=True)
    script = out / "job.py"
    start = time.monotonic()
    env = {**os.environ, "SYNCBN_FLIGHT_DIR": str(flight)}
    with open(folder / "stdout.txt", "w") as stdout, open(folder / "stderr.txt", "w") as stderr:
        try:
            subprocess.run(
                [sys.executable, str(script), kind, str(folder), str(linger)],
                stdout=stdout, stderr=stderr, timeout=240, env=env, cwd=folder,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pass
    text = (folder / "stdout.txt").read_text()
    codes = next(
        (line.split()[1:] for line in text.splitlines() if line.startswith("exitcodes")),
        ["timeout", "timeout"],
    )
    errors = (folder / "stderr.txt").read_text()
    terminated = "terminate called" in errors
    if "EADDRINUSE" in errors:  # the harness's free port was taken before rank 0 listened on it
        codes = [f"port-race:{code}" for code in codes]
    return index, codes, terminated, time.monotonic() - start


def run_torchrun_jobs(out: Path, flight: Path, stop: threading.Event) -> list[int]:
    """2-rank torchrun jobs of the same step, one after another until ``stop``: their exit codes
    (torchrun's is non-zero when any rank's is)."""
    codes: list[int] = []
    folder = out / "torchrun"
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SYNCBN_FLIGHT_DIR": str(flight)}
    while not stop.is_set():
        index = len(codes)
        linger = _VARIANTS[index % len(_VARIANTS)][1]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", str(out / "job.py"), "torchrun", str(folder),
                   str(linger)]  # fmt: skip
        with open(folder / f"job{index:04d}.txt", "w") as log:
            try:
                code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      cwd=folder, timeout=240).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                code = -999
        codes.append(code)
    return codes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=1, help="jobs running side by side")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--torchrun-beside", action="store_true", help="torchrun SyncBN jobs alongside the loop"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "job.py").write_text(_JOB)
    flight = args.out / "flight"
    start = time.monotonic()
    stop = threading.Event()
    beside = ThreadPoolExecutor(max_workers=1)
    torchrun = (
        beside.submit(run_torchrun_jobs, args.out, flight, stop) if args.torchrun_beside else None
    )
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = list(pool.map(lambda i: run_job(i, args.out, flight), range(args.jobs)))
    wall = time.monotonic() - start
    stop.set()
    torchrun_codes = torchrun.result() if torchrun is not None else []
    beside.shutdown()
    codes = collections.Counter(code for _, ranks, _, _ in results for code in ranks)
    failed = [i for i, ranks, term, _ in results if term or ranks != ["0", "0"]]
    print(f"command: python benchmarks/exit_stress.py {' '.join(sys.argv[1:])}")
    print(f"torch {__import__('torch').__version__}, Python {sys.version.split()[0]}\n")
    print("| jobs | parallel | failed jobs | ranks by exit code | wall s | s / job |")
    print("|---:|---:|---:|---|---:|---:|")
    by_code = ", ".join(f"{code}: {n}" for code, n in sorted(codes.items()))
    print(
        f"| {args.jobs} | {args.parallel} | {len(failed)} | {by_code} | {wall:.0f} | "
        f"{wall / max(args.jobs, 1) * args.parallel:.1f} |"
    )
    if torchrun is not None:
        bad = sum(code != 0 for code in torchrun_codes)
        print(f"\ntorchrun jobs beside the loop: {len(torchrun_codes)}, failed: {bad}")
        failed += [f"torchrun {i}" for i, code in enumerate(torchrun_codes) if code != 0]
    if failed:
        print(f"\nfailed jobs (outputs under {args.out}): {failed[:20]}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
