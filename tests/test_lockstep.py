"""Collectives in lockstep: SyncBN's collectives never share a process group with DDP's.

The regression test of the default job's hang (docs/reliability.md, "Collectives in lockstep"):
DDP launches each gradient bucket's all-reduce asynchronously from an autograd hook, and the
backward of the SyncBN layers below it issues its own collectives while that all-reduce is still
in flight. On one gloo process group, torch 2.13's functional all-gather does not survive that
overlap: a rank crashed (SIGSEGV/SIGABRT, heap corruption) or hung (gloo's ``Timed out waiting
... for send operation``, or DDP's ``finalize_backward`` waiting forever). With SyncBN in a
group of its own it cannot happen. The test reproduces the pattern of the job (2 gloo ranks, DDP,
residual blocks, 2 images per rank, every core busy) with one gradient per DDP bucket, so that an
all-reduce is launched right before nearly every SyncBN backward collective: what hit the
default job once in thousands of steps happens within a few hundred.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from torch import nn

from benchmarks._common import busy_cores
from syncbn_lightning import convert_sync_batchnorm
from syncbn_lightning.distributed.groups import group_name_of, sync_world_group

pytestmark = pytest.mark.distributed


class _Block(nn.Module):
    """A residual block: ``relu(x + bn(conv(relu(bn(conv(x))))))``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
        )
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn(self.body(x)))


def residual_net(width: int = 8, outputs: int = 10) -> nn.Sequential:
    """A small ResNet: stem, three stages of a strided conv and a residual block (10 BatchNorm
    layers), a linear head."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)]
    channels = width
    for _ in range(3):
        layers += [
            nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            _Block(2 * channels),
        ]
        channels *= 2
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, outputs)]
    return nn.Sequential(*layers)


def _ddp_steps(rank: int, world: int, steps: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = convert_sync_batchnorm(residual_net(width=8, outputs=10))
    # Every gradient in a bucket of its own: an all-reduce starts as each one is ready.
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(2, 3, 8, 8, generator=data)
        loss = ddp(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    checksum = torch.cat([p.detach().double().flatten() for p in model.parameters()]).sum()
    return {
        "checksum": float(checksum),
        "sync_group": group_name_of(None),
        "ddp_group": ddp.process_group.group_name,
        "twin_size": dist.get_world_size(sync_world_group()),
    }


@pytest.mark.slow
def test_ddp_residual_training_under_load_keeps_collectives_in_lockstep() -> None:
    started = time.monotonic()
    with busy_cores():
        results = run_distributed(_ddp_steps, 2, 1500, timeout=900, pg_timeout_s=60)
    # Both ranks finished every step with the same parameters (DDP keeps them equal; a collective
    # paired with another's would have crashed, hung until the 60 s timeout or diverged them).
    assert results[0]["checksum"] == results[1]["checksum"]
    for r in results:
        # SyncBN's collectives go through the world's twin, DDP's through the default group.
        assert r["ddp_group"] == "0" and r["sync_group"] != "0" and r["twin_size"] == 2
    assert time.monotonic() - started < 900
