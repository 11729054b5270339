"""Per layer: the gather exchange against the reduce exchange, forward + backward, on the CPU.

Both sides are the same ``SyncBatchNorm`` with ``exchange="gather"`` or ``exchange="reduce"``,
timed the same way in the same run: whole eager steps (``layer(x).backward(g)``, host work
included for both), rounds interleaved (gather, reduce, gather, ...; the first side alternating),
every rank passing a barrier before each round so that ranks start together; the median over
rounds of the mean step time, rank 0's. Settings:

* one process, no process group, ``force_sync=True`` (the layer's own cost, no collective);
* 2, 4 and 8 gloo ranks in one machine (loopback; on a 2-core machine more than 2 ranks are
  oversubscribed, so only the ratio of the two exchanges in the same row means anything).

    python benchmarks/bench_exchange.py [--ranks 1,2,4,8] [--shapes 8x64x16x16,32x32x8x8]
        [--rounds 15] [--steps 5] [--impl ext]

Prints one Markdown table: shape per rank, ranks, gather and reduce microseconds per layer step,
reduce / gather, and the bytes each rank receives in the forward collective.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import cpu_model, csv_list, init_affine

from syncbn_lightning import SyncBatchNorm
from syncbn_lightning.distributed.collectives import GATHER_SUM_MAX_RANKS
from syncbn_lightning.functional.reduce import reduce_payload_numel
from syncbn_lightning.ops.reference.steps import row_width

EXCHANGES = ("gather", "reduce")


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.lower().split("x"))


def _layers(channels: int, force_sync: bool) -> dict[str, SyncBatchNorm]:
    layers = {}
    for exchange in EXCHANGES:
        layer = SyncBatchNorm(channels, exchange=exchange, force_sync=force_sync)
        init_affine(layer, channels)
        layer.set_sync_name("bench")
        layers[exchange] = layer
    return layers


def _time_rounds(
    shape: tuple[int, ...], rounds: int, steps: int, distributed: bool
) -> dict[str, float]:
    """Median over ``rounds`` of the mean microseconds of one fwd+bwd step, per exchange."""
    torch.manual_seed(0)
    layers = _layers(shape[1], force_sync=not distributed)
    x = (torch.randn(shape) * 2 + 3).requires_grad_(True)
    grad = torch.randn(shape)
    times: dict[str, list[float]] = {e: [] for e in EXCHANGES}
    for exchange in EXCHANGES:  # warm-up: builds, first collectives
        for _ in range(3):
            layers[exchange](x).backward(grad)
    for r in range(rounds):
        order = EXCHANGES if r % 2 == 0 else EXCHANGES[::-1]
        for exchange in order:
            layer = layers[exchange]
            if distributed:
                dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                layer(x).backward(grad)
            times[exchange].append((time.perf_counter() - start) / steps * 1e6)
    return {e: statistics.median(t) for e, t in times.items()}


def _payload_bytes(exchange: str, channels: int, ranks: int) -> int:
    """What one rank receives in the forward collective, from the layers' own strategies (the
    reduce exchange's vectors gathered in CPU groups of up to 8 ranks, as ``sum_over_group``)."""
    if exchange == "reduce":
        gathered = ranks if ranks <= GATHER_SUM_MAX_RANKS else 1
        return 8 * gathered * reduce_payload_numel(channels)
    return 4 * ranks * row_width(channels)


def _worker(rank: int, world: int, store: str, args: Any, out: Any) -> None:
    torch.set_num_threads(1)
    os.environ["SYNCBN_IMPL"] = args.impl
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        results = {s: _time_rounds(s, args.rounds, args.steps, True) for s in args.shapes}
        if rank == 0:
            out.put(results)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure(ranks: int, args: Any) -> dict[tuple[int, ...], dict[str, float]]:
    if ranks == 1:
        os.environ["SYNCBN_IMPL"] = args.impl
        torch.set_num_threads(1)
        return {s: _time_rounds(s, args.rounds, args.steps, False) for s in args.shapes}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench_exchange_") as tmp:
        store = str(Path(tmp) / "store")
        procs = [
            ctx.Process(target=_worker, args=(r, ranks, store, args, out)) for r in range(ranks)
        ]
        for p in procs:
            p.start()
        try:
            results = out.get(timeout=args.timeout)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=csv_list, default=["1", "2", "4", "8"])
    parser.add_argument("--shapes", type=csv_list, default=["8x64x16x16", "4x256x8x8"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--impl", default="ext", choices=("ext", "ref"))
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    args.shapes = [_shape(s) for s in args.shapes]
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}; {args.impl}")
    print(f"command: python benchmarks/bench_exchange.py {' '.join(argv or sys.argv[1:])}\n")
    print("| shape per rank | ranks | gather us | reduce us | reduce / gather | bytes in (g / r) |")
    print("|---|---:|---:|---:|---:|---|")
    for ranks in (int(r) for r in args.ranks):
        results = _measure(ranks, args)
        for shape, times in results.items():
            gather, reduce = times["gather"], times["reduce"]
            sizes = "-"
            if ranks > 1:
                sizes = " / ".join(str(_payload_bytes(e, shape[1], ranks)) for e in EXCHANGES)
            label = "x".join(map(str, shape))
            cells = f"{gather:.0f} | {reduce:.0f} | {reduce / gather:.2f} | {sizes}"
            print(f"| {label} | {ranks} | {cells} |")


if __name__ == "__main__":
    main()
