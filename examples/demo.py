"""Demo: train a small BN convnet with SyncBatchNorm on 2 CPU processes (DDP over gloo).

    python examples/demo.py [--steps 20] [--world-size 2]

Each rank holds a different, uneven number of images per step (2 and 3 by default). The demo prints
per step the loss and the per-layer statistics group count, then checks what synchronization means:
both ranks end with identical running statistics, equal to those of ONE process running plain
``nn.BatchNorm2d`` on the concatenated batches, while per-rank BatchNorm gives different ones.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm
from syncbn_lightning.ops.build import MEASURED_BUILD_S


def make_model(seed: int = 0) -> nn.Module:
    """Conv-BN-ReLU x2, global pooling, linear head: 2 BatchNorm2d layers."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 2),
    )


def make_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic two-class batch: class 1 images carry a bright square."""
    gen = torch.Generator().manual_seed(1000 + step)
    labels = torch.randint(0, 2, (size,), generator=gen)
    images = torch.randn(size, 3, 16, 16, generator=gen) * 0.5
    images[labels == 1, :, 4:12, 4:12] += 1.5
    return images, labels


def _split(step_batch: int, sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _train(model: nn.Module, steps: int, sizes: list[int], rank: int | None) -> list[float]:
    """SGD on the rank's share of each step's batch (all of it when ``rank`` is None)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        images, labels = make_batch(step, sum(sizes))
        if rank is not None:
            part = _split(sum(sizes), sizes, rank)
            images, labels = images[part], labels[part]
        loss = nn.functional.cross_entropy(model(images), labels, reduction="sum") / sum(sizes)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _bn_state(model: nn.Module) -> list[torch.Tensor]:
    return [
        t.detach().clone()
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for t in (m.running_mean, m.running_var)
    ]


def _worker(rank: int, world: int, init_file: str, steps: int, sizes: list[int], out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        model = convert_sync_batchnorm(make_model())
        n_sync = sum(isinstance(m, SyncBatchNorm) for m in model.modules())
        # DDP sums parameter gradients / world; our loss is a per-rank share of the global mean,
        # so scale back by world to get the gradient of the global loss.
        ddp = DistributedDataParallel(model)
        for p in model.parameters():
            p.register_hook(lambda g: g * world)
        started = time.perf_counter()
        losses = _train(ddp, steps, sizes, rank)
        elapsed = time.perf_counter() - started
        # plain lists: tensors would travel as shared memory that dies with this process
        out.put((rank, n_sync, losses, [t.tolist() for t in _bn_state(model)], elapsed))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="SGD steps (default 20)")
    parser.add_argument("--world-size", type=int, default=2, help="processes (default 2)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.world_size < 2:
        parser.error("--steps must be >= 1 and --world-size >= 2")
    sizes = [2 + (r % 2) for r in range(args.world_size)]  # uneven: 2, 3, 2, 3, ...
    print(
        f"syncbn_lightning demo: {args.world_size} CPU processes (gloo), per-rank batches "
        f"{sizes} -> {sum(sizes)} images per BN forward; {args.steps} steps"
    )
    print(
        f"implementation: SYNCBN_IMPL={os.environ.get('SYNCBN_IMPL', 'auto')} (the first run "
        f"compiles the C++ kernels, {MEASURED_BUILD_S} s on an idle 2-core machine, then they "
        f"are cached)"
    )

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, args.world_size, os.path.join(tmp, "s"), args.steps, sizes, out),
            )
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(60)
    if any(p.exitcode != 0 for p in procs):
        print("a worker failed; see the messages above")
        return 1

    results = [
        (r, n, losses, [torch.tensor(t) for t in state], sec)
        for r, n, losses, state, sec in results
    ]
    rank0 = results[0]
    for step in range(0, args.steps, max(1, args.steps // 5)):
        print(f"  step {step:3d}  loss (global batch) {sum(r[2][step] for r in results):.4f}")
    spread = max(
        (a - b).abs().max().item()
        for r in results[1:]
        for a, b in zip(rank0[3], r[3], strict=False)
    )
    single = make_model()
    single_losses = _train(single, args.steps, sizes, None)
    reference = _bn_state(single)
    vs_single = max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(rank0[3], reference, strict=False)
    )
    local = copy.deepcopy(make_model())
    _train(local, args.steps, sizes[:1], None)  # what rank 0 would see with per-rank BN
    vs_local = max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(_bn_state(local), reference, strict=False)
    )
    print(f"synchronized {rank0[1]} BatchNorm layers; {args.steps} steps in {rank0[4]:.2f} s")
    print(f"running stats, max |rank r - rank 0|:                       {spread:.2e}")
    print(f"running stats vs 1 process with nn.BatchNorm2d, rel. error: {vs_single:.2e}")
    print(
        f"final loss, DDP+SyncBN vs single process:                   "
        f"{sum(r[2][-1] for r in results):.6f} vs {single_losses[-1]:.6f}"
    )
    print(f"(per-rank BatchNorm on rank 0's batches alone would be off by {vs_local:.2e})")
    ok = spread == 0.0 and vs_single < 1e-4
    print("OK: the ranks normalized as one batch" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
