"""Fused BatchNorm + residual add + activation on the CPU, side by side on 2 gloo ranks.

    python benchmarks/bench_residual.py                      # block and ResNet-18, 2 ranks
    python benchmarks/bench_residual.py --steps 10 --image-size 64

Three ways to run the same model, measured the same way in the same run (interleaved: every
repeat times one step of each, so that drifts of the machine's load hit all alike):

* ``plain``: the model's own ``nn.BatchNorm2d`` (each rank normalizes its own batch): the floor;
* ``ours``: :func:`syncbn_lightning.convert_sync_batchnorm` (synchronized, BN then ``+`` then
  ReLU as separate steps);
* ``fused``: the same with ``fuse_residual=True`` (each block's tail as one
  :meth:`~syncbn_lightning.SyncBatchNorm.add_act` call).

Two workloads: one torchvision ``BasicBlock`` forward + backward (``--block``: N, C, H, W per
rank; NCHW and channels-last), and a torchvision ResNet-18 train step (forward, cross-entropy,
backward with DDP's gradient all-reduce, SGD) at ``--batch`` images of ``--image-size`` pixels
per rank. Each rank runs one thread (2 ranks on the 2-core CI machine); the time of a step is
the slower rank's. Prints a markdown table (median and 90th percentile, ms) with the machine
line and the command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import cpu_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import syncbn_lightning
from syncbn_lightning.ops.build import load_extension

VARIANTS = ("plain", "ours", "fused")


def _torchvision() -> Any:
    """torchvision, or, where only its Python modules can load (CI's CUDA wheel beside the CPU
    torch), the copy the tests use (``tests/_timm.py`` says why and how)."""
    try:
        import torchvision
    except (ImportError, RuntimeError):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from _timm import THIRD_PARTY, import_timm

        import_timm()
        sys.path.append(str(THIRD_PARTY))
        import torchvision
    return torchvision


def _variant(model: nn.Module, variant: str) -> nn.Module:
    if variant == "plain":
        return model
    return syncbn_lightning.convert_sync_batchnorm(model, fuse_residual=variant == "fused")


def _block_steps(args: argparse.Namespace, layout: torch.memory_format) -> dict[str, Callable]:
    tv = _torchvision()
    n, c, h, w = args.block
    steps = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        block = _variant(tv.models.resnet.BasicBlock(c, c), variant).to(memory_format=layout)
        x = torch.randn(n, c, h, w).contiguous(memory_format=layout).requires_grad_()
        dy = torch.randn(n, c, h, w).contiguous(memory_format=layout)
        params = [x, *block.parameters()]

        def step(
            block: nn.Module = block,
            x: torch.Tensor = x,
            dy: torch.Tensor = dy,
            params: list = params,
        ) -> None:
            torch.autograd.grad(block(x), params, dy)

        steps[variant] = step
    return steps


def _resnet_steps(args: argparse.Namespace) -> dict[str, Callable]:
    tv = _torchvision()
    steps = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model = DistributedDataParallel(_variant(tv.models.resnet18(num_classes=10), variant))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(args.batch, 3, args.image_size, args.image_size)
        y = torch.randint(0, 10, (args.batch,))

        def step(
            model: nn.Module = model,
            optimizer: Any = optimizer,
            x: torch.Tensor = x,
            y: torch.Tensor = y,
        ) -> None:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        steps[variant] = step
    return steps


def _timed(steps: dict[str, Callable], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Every variant's step times (ms, the slower rank's), interleaved."""
    times: dict[str, list[float]] = {v: [] for v in steps}
    for index in range(warmup + repeats):
        for variant, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if index >= warmup:
                times[variant].append(float(elapsed) * 1e3)
    return times


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = []
    try:
        for name, layout in (
            ("NCHW", torch.contiguous_format),
            ("channels_last", torch.channels_last),
        ):
            shape = "x".join(map(str, args.block))
            times = _timed(_block_steps(args, layout), args.steps, args.warmup)
            rows.append((f"BasicBlock fwd+bwd {shape} {name}", times))
        times = _timed(_resnet_steps(args), args.steps, args.warmup)
        rows.append((f"ResNet-18 train step b{args.batch} {args.image_size}px", times))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(rows, out)


def _table(rows: list[tuple[str, dict[str, list[float]]]], args: argparse.Namespace) -> str:
    lines = [
        f"machine: {cpu_model()} | torch {torch.__version__} | {args.world} gloo ranks x 1 thread",
        f"command: python benchmarks/bench_residual.py {' '.join(sys.argv[1:])}",
        f"median (p90) of {args.steps} steps, ms, the slower rank's\n",
        "| workload | plain BN | ours | ours fused | fused / ours | fused / plain |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, times in rows:
        med = {v: statistics.median(t) for v, t in times.items()}
        p90 = {v: sorted(t)[int(0.9 * (len(t) - 1))] for v, t in times.items()}
        cells = " | ".join(f"{med[v]:.2f} ({p90[v]:.2f})" for v in VARIANTS)
        lines.append(
            f"| {name} | {cells} | {med['fused'] / med['ours']:.2f} | "
            f"{med['fused'] / med['plain']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--block", type=lambda s: [int(v) for v in s.split("x")], default=[8, 64, 28, 28]
    )
    parser.add_argument("--batch", type=int, default=8, help="ResNet-18 images per rank")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    if len(args.block) != 4:
        parser.error("--block: N x C x H x W, e.g. 8x64x28x28")
    load_extension()  # built once here, not by every rank
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_worker, (args.world, os.path.join(tmp, "store"), args, out), nprocs=args.world)
        print(_table(torch.load(out, weights_only=False), args))


if __name__ == "__main__":
    main()
