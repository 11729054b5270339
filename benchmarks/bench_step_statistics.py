"""What ``step_statistics`` adds to an optimizer step, by the number of layers it covers.

A step is 4 forward calls of a model of ``L`` ``SyncBatchNorm(8)`` layers (forced through the
synchronized call, the C++ path, no process group; input 2x8x4x4, float32, ``no_grad``: the
backward is the same inside and outside), run inside ``step_statistics`` and outside it. The
difference is the context's own cost: the step's copies at entry, the merge of the calls'
statistics and the one update at the commit. Printed per ``L``: the dispatcher ops it adds (a
``TorchDispatchMode`` around one step; on a GPU each is about one kernel launch) and the host
microseconds (inside and outside alternated round by round, median of the rounds).

    python benchmarks/bench_step_statistics.py [--rounds 7] [--steps 200] [--layers 1,2,8,20,53]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable

import torch
from _common import OpCounter, csv_list
from torch import nn

from syncbn_lightning import convert_sync_batchnorm, step_statistics

MICRO_BATCHES = 4
SHAPE = (2, 8, 4, 4)


def _model(layers: int) -> nn.Module:
    """``layers`` synchronized layers of ``SHAPE[1]`` channels, one after the other."""
    bns = [nn.BatchNorm2d(SHAPE[1]) for _ in range(layers)]
    return convert_sync_batchnorm(nn.Sequential(*bns), force_sync=True)


def _step(model: nn.Module, inside: bool) -> Callable[[], None]:
    """One optimizer step's forward calls, inside ``step_statistics`` or not."""
    x = torch.randn(SHAPE)

    def run() -> None:
        with step_statistics(model) if inside else contextlib.nullcontext():
            for _ in range(MICRO_BATCHES):
                model(x)

    return run


def _ops(step: Callable[[], None]) -> int:
    """Dispatcher ops of one ``step``."""
    with OpCounter() as counter:
        step()
    return sum(counter.ops.values())


def measure(layers: int, rounds: int, steps: int) -> tuple[int, float, float]:
    """``(ops added, µs added, µs outside)`` per step for a model of ``layers`` layers."""
    model = _model(layers)
    inside, outside = _step(model, True), _step(model, False)
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.no_grad():
        inside(), outside()  # the first calls plan the layers and make their counters
        added_ops = _ops(inside) - _ops(outside)
        for _ in range(rounds):
            for key, step in ((True, inside), (False, outside)):
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                times[key].append((time.perf_counter() - start) / steps * 1e6)
    out = statistics.median(times[False])
    return added_ops, statistics.median(times[True]) - out, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=csv_list, default=["1", "2", "8", "20", "53"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), input {SHAPE}, float32, CPU")
    print(f"command: python benchmarks/bench_step_statistics.py {' '.join(sys.argv[1:])}\n")
    print(f"A step: {MICRO_BATCHES} forward calls of L layers; what step_statistics adds to it:\n")
    print("| layers | ops added / step | us added / step | us added / layer | us / step outside |")
    print("|---:|---:|---:|---:|---:|")
    for layers in (int(text) for text in args.layers):
        ops, added, out = measure(layers, args.rounds, args.steps)
        print(f"| {layers} | {ops} | {added:.0f} | {added / layers:.0f} | {out:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
