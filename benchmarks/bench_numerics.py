"""Accuracy at large offsets: both exchanges and ``nn.BatchNorm2d`` against float64 BatchNorm.

Every side normalizes the same float32 input, ``N(offset, 1)`` per channel, and backpropagates
the same output gradient; the truth is ``F.batch_norm`` in float64 on those float32 values, with
autograd. Our layers run in one process with ``force_sync=True`` (the exchange's kernels and
collective path, a group of one rank; ``tests/test_ops.py`` and ``tests/test_exchange.py`` check
uneven and empty ranks). Two running means ``K``:

* ``K = 0``: a fresh layer, the first training step;
* ``K = mean``: the running mean set to the batch's float32-rounded mean first (a trained layer).

The reduce exchange sums ``x - K`` in float64, so ``K = 0`` is its worst case; the gather
exchange's rows do not depend on ``K``.

    python benchmarks/bench_numerics.py [--offsets 1,1e2,1e4,1e6] [--shape 8x16x8x8] [--impl ext]

Prints one Markdown table: offset (``|mean| / std``), ``K``, layer, and the normwise relative
error (``||got - truth|| / ||truth||``) of the output, the input gradient, the weight gradient and
the running variance.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from _common import csv_list
from torch import nn

from syncbn_lightning import SyncBatchNorm

KEYS = ("output", "grad_input", "grad_weight", "running_var")


def _rel(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got.double() - truth).norm() / truth.norm().clamp_min(1e-300))


def _truth(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    x64 = x.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    b64 = torch.zeros_like(w64, requires_grad=True)
    running = [torch.zeros(x.shape[1], dtype=torch.float64), torch.ones(x.shape[1]).double()]
    out = F.batch_norm(x64, *running, w64, b64, training=True, momentum=1.0, eps=1e-5)
    out.backward(dy.double())
    return {"output": out.detach(), "grad_input": x64.grad, "grad_weight": w64.grad,
            "running_var": running[1]}  # fmt: skip


def _layer(kind: str, channels: int, shift: torch.Tensor | None) -> nn.Module:
    if kind == "BatchNorm2d":
        layer: nn.Module = nn.BatchNorm2d(channels, momentum=1.0)
    else:
        layer = SyncBatchNorm(channels, momentum=1.0, exchange=kind, force_sync=True)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 1.5, channels))
        if shift is not None:
            layer.running_mean.copy_(shift)
    return layer


def errors(kind: str, x: torch.Tensor, dy: torch.Tensor, trained: bool) -> dict[str, float]:
    """Normwise relative errors of one training step of ``kind`` against float64."""
    shift = x.double().mean((0, 2, 3)).float() if trained else None
    layer = _layer(kind, x.shape[1], shift)
    mine = x.clone().requires_grad_(True)
    out = layer(mine)
    out.backward(dy)
    truth = _truth(x, dy, layer.weight.detach())
    got = {"output": out.detach(), "grad_input": mine.grad, "grad_weight": layer.weight.grad,
           "running_var": layer.running_var}  # fmt: skip
    # With momentum 1 the running variance is the batch's unbiased one for every layer.
    return {key: _rel(got[key], truth[key]) for key in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offsets", type=csv_list, default=["1", "1e2", "1e4", "1e6"])
    parser.add_argument("--shape", default="8x16x8x8")
    parser.add_argument("--impl", default="ext", choices=["ext", "ref"])
    args = parser.parse_args()
    os.environ["SYNCBN_IMPL"] = args.impl
    shape = tuple(int(v) for v in args.shape.lower().split("x"))
    print(f"input {args.shape} float32, N(offset, 1); torch {torch.__version__}; {args.impl}\n")
    print("| offset | K | layer | " + " | ".join(KEYS) + " |")
    print("|---|---|---|" + "---|" * len(KEYS))
    for offset in map(float, args.offsets):
        gen = torch.Generator().manual_seed(0)
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) + offset).float()
        dy = torch.randn(shape, generator=gen)
        for trained in (False, True):
            for kind in ("gather", "reduce", "BatchNorm2d"):
                row = errors(kind, x, dy, trained)
                cells = " | ".join(f"{row[k]:.1e}" for k in KEYS)
                print(f"| {offset:g} | {'mean' if trained else '0'} | {kind} | {cells} |")


if __name__ == "__main__":
    main()
