"""Gradient accumulation with SyncBatchNorm under Lightning Fabric, on 2 CPU processes.

Fabric has no SyncBatchNorm option of its own: convert the model before ``fabric.setup``, then
run the micro-batches of each optimizer step inside ``step_statistics`` (one running-statistics
update per step) and ``fabric.no_backward_sync`` (one gradient all-reduce per step)::

    python examples/fabric_accumulation.py [--steps 3] [--accumulate 4]

It ends by checking the ranks' running statistics against one process that ran every rank's
micro-batches itself, and prints ``OK: one running-statistics update per optimizer step``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

import syncbn_lightning as sbl

WORLD, PER_RANK = 2, 2


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip


def micro_batch(step: int, k: int, accumulate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's samples of micro-batch ``k`` of optimizer step ``step`` (rank r takes rows
    ``r * PER_RANK ...``)."""
    g = torch.Generator().manual_seed(step * accumulate + k)
    x = torch.randn(WORLD * PER_RANK, 3, 6, 6, generator=g) * 2 + 1
    return x, torch.randint(0, 4, (WORLD * PER_RANK,), generator=g)


def train(fabric: Fabric, steps: int, accumulate: int) -> dict[str, torch.Tensor]:
    """The recipe: convert, set up, then each optimizer step's micro-batches inside
    ``step_statistics`` and ``no_backward_sync`` (all but the last)."""
    model = sbl.convert_sync_batchnorm(make_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    rows = slice(fabric.global_rank * PER_RANK, (fabric.global_rank + 1) * PER_RANK)
    for step in range(steps):
        with sbl.step_statistics(model):
            for k in range(accumulate):
                x, y = micro_batch(step, k, accumulate)
                with fabric.no_backward_sync(model, enabled=k < accumulate - 1):
                    fabric.backward(F.cross_entropy(model(x[rows]), y[rows]) / accumulate)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(steps: int, accumulate: int, alone: Any) -> dict[str, torch.Tensor]:
    """One process (its layers in the group ``alone``, this rank by itself), every rank's
    samples per micro-batch, the same step_statistics."""
    model = sbl.convert_sync_batchnorm(make_net(), alone)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        with sbl.step_statistics(model):
            for k in range(accumulate):
                x, y = micro_batch(step, k, accumulate)
                (F.cross_entropy(model(x), y) / accumulate).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=4)
    args = parser.parse_args()
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy="ddp")
    fabric.launch()  # (starts the other process, which runs this script again)
    state = train(fabric, args.steps, args.accumulate)
    alone = sbl.new_sync_group(1)  # (on every rank: making groups is collective)
    if fabric.global_rank == 0:
        check(state, args.steps, args.accumulate, alone)
    fabric.barrier()


def check(state: dict[str, torch.Tensor], steps: int, accumulate: int, alone: Any) -> None:
    """Print how rank 0's running statistics compare with :func:`reference`'s."""
    want = reference(steps, accumulate, alone)
    tracked = int(state["1.num_batches_tracked"])
    worst = max(
        float((state[key] - want[key]).abs().max())
        for key in want
        if key.endswith(("running_mean", "running_var"))
    )
    print(f"rank 0: {steps} optimizer steps of {accumulate} micro-batches each, "
          f"num_batches_tracked = {tracked}; running statistics within {worst:.1e} of one "
          f"process")  # fmt: skip
    if tracked == steps and worst <= 1e-5:
        print("OK: one running-statistics update per optimizer step")


if __name__ == "__main__":
    main()
