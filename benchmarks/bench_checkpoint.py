"""Activation checkpointing on a ResNet-18, 2 gloo ranks on CPU: what a recompute costs.

Every variant trains the same ResNet-18 (torchvision's layout: a 7x7 stem and four stages of two
basic blocks, 64 to 512 channels, 20 BatchNorm layers; defined here, so that the benchmark needs no
torchvision; random init, 10 classes) for ``--steps``
SGD steps on the same batches (``--batch`` images of 3x``--size``x``--size`` per rank, uneven when
``--uneven``), its four stages (``layer1`` to ``layer4``) each under non-reentrant
``torch.utils.checkpoint``:

* ``torch_bn``: torch's BatchNorm2d, unchecked (no synchronization; the reference of the next);
* ``torch_bn_ckpt``: the same, checkpointed (torch updates the running statistics twice);
* ``ours``: ``convert_sync_batchnorm``, unchecked (the reference of the next two);
* ``ours_ckpt``: ours, checkpointed (the recompute takes the forward's statistics);
* ``ours_ckpt_repeat``: ours, checkpointed with ``SYNCBN_RECOMPUTE=repeat`` (the feature off: the
  recompute exchanges and updates again, as torch's layers do).

Printed per variant, from rank 0: the synchronized collectives per step (forward and backward,
from the flight recorder; torch's layers make none), the median step time (forward, backward,
optimizer step; the slower rank's), ``num_batches_tracked`` of ``layer1``'s first layer after
the run, and the largest
relative error of the running statistics (mean and variance, every layer) against the unchecked
run of the same layers. All variants run in the same two processes, one after the other, and
``--repeats`` times over (interleaved; the median is over every timed step of every repeat).

Example:
    python benchmarks/bench_checkpoint.py --steps 20 --uneven
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import cpu_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from syncbn_lightning import convert_sync_batchnorm
from syncbn_lightning.distributed.flight import recorder as flight
from syncbn_lightning.functional.recompute import RECOMPUTE_ENV

VARIANTS = ("torch_bn", "torch_bn_ckpt", "ours", "ours_ckpt", "ours_ckpt_repeat")
REFERENCE = {"torch_bn_ckpt": "torch_bn", "ours_ckpt": "ours", "ours_ckpt_repeat": "ours"}


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, the shortcut (a 1x1 conv-BN where the shape changes), ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` layout (its attribute names too)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)]
        for i, (cin, cout, stride) in enumerate(widths, 1):
            stage = nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1))
            setattr(self, f"layer{i}", stage)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)


class Checkpointed(nn.Module):
    """A ResNet whose four stages run under non-reentrant checkpoint (``enabled``)."""

    def __init__(self, net: nn.Module, enabled: bool) -> None:
        super().__init__()
        self.net, self.enabled = net, enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.net
        x = n.maxpool(n.relu(n.bn1(n.conv1(x))))
        for stage in (n.layer1, n.layer2, n.layer3, n.layer4):
            x = checkpoint(stage, x, use_reentrant=False) if self.enabled else stage(x)
        return n.fc(torch.flatten(n.avgpool(x), 1))


def _records() -> set[tuple[str, int, str]]:
    recorder = flight.current_recorder()
    return {(r.group, r.seq, r.direction) for r in (recorder.records() if recorder else [])}


def _variant(name: str, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Train one variant; its step times, collectives per step and final buffers."""
    torch.manual_seed(0)
    net: nn.Module = ResNet18(num_classes=10)
    if name.startswith("ours"):
        net = convert_sync_batchnorm(net)
    model = Checkpointed(net, enabled="ckpt" in name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    os.environ[RECOMPUTE_ENV] = "repeat" if name.endswith("repeat") else "reuse"
    times, collectives = [], []
    for x, y in batches:
        before = _records()
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
        new = _records() - before
        collectives.append(
            (sum(1 for r in new if r[2] == "forward"), sum(1 for r in new if r[2] == "backward"))
        )
    buffers = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    tracked = int(net.layer1[0].bn1.num_batches_tracked)  # checkpointed in the *_ckpt variants
    return {"times": times, "collectives": collectives, "buffers": buffers, "tracked": tracked}


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        sizes = [args.batch + 1, args.batch] if args.uneven else [args.batch] * world
        g = torch.Generator().manual_seed(1)
        batches = []
        for _ in range(args.steps):
            x = torch.randn(sum(sizes), 3, args.size, args.size, generator=g)
            y = torch.randint(0, 10, (sum(sizes),), generator=g)
            part = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
            batches.append((x[part], y[part]))
        results: dict[str, Any] = {}
        for _ in range(args.repeats):  # interleaved: drifts in machine load hit all alike
            for name in args.variants:
                got = _variant(name, batches)
                if name in results:
                    results[name]["times"] += got["times"]
                else:
                    results[name] = got
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _stat_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(
        float((got[k].double() - want[k].double()).abs().max() / want[k].double().abs().max())
        for k in want
    )


def table(results: dict[str, Any], steps: int) -> str:
    """The markdown table of :func:`main`'s results."""
    lines = [
        "| variant | collectives per step (fwd + bwd) | median step (ms) | "
        f"num_batches_tracked after {steps} steps | running-stat error vs unchecked |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, got in results.items():
        forward_n, backward_n = got["collectives"][-1]
        ref = REFERENCE.get(name)
        error = _stat_error(got["buffers"], results[ref]["buffers"]) if ref in results else None
        lines.append(
            f"| {name} | {forward_n} + {backward_n} | {statistics.median(got['times']) * 1e3:.1f}"
            f" | {got['tracked']} | {'-' if error is None else f'{error:.1e}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2, help="images per rank")
    parser.add_argument("--size", type=int, default=64, help="image side")
    parser.add_argument("--uneven", action="store_true", help="rank 0 gets one image more")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=1, help="runs of every variant, interleaved")
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), args, out), nprocs=2)
        results = torch.load(out, weights_only=False)
    print(
        f"# ResNet-18, 2 gloo ranks, {args.batch}{'+1' if args.uneven else ''} images of "
        f"3x{args.size}x{args.size} per rank, {args.steps} SGD steps x {args.repeats}; "
        f"torch {torch.__version__}, {cpu_model()}, {os.cpu_count()} cores\n"
    )
    print(table(results, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
