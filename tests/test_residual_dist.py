"""Fused BatchNorm + residual add + activation on 2 and 3 gloo ranks, against float64 one process.

The oracle runs the unfused model (plain BatchNorm, ``+``, the activation) in float64 on the
concatenation of every rank's batch. Each rank runs the fused one on its own part: one layer
call (:meth:`SyncBatchNorm.add_act`, float32, uneven and empty batches: within 1e-5 relative), or
whole torchvision and timm ResNets, timm's DLA and a user's bottleneck network converted with
``fuse_residual`` (one train step, float64, within 1e-10 relative: the comparison sees the fusion
and the synchronization, not float32's rounding through 20-50 layers). Outputs, input and
residual gradients, parameter gradients (summed over the ranks, as DDP's average times the world
size) and running statistics.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_distributed
from _lightning import BNNet, load_ranks, trainer
from _timm import import_timm
from test_residual import _models
from test_residual_fidelity import _user_bottlenecks, _UserBottleneck
from torch import nn

from syncbn_lightning import SyncBatchNorm, SyncBNCallback, convert_sync_batchnorm
from syncbn_lightning.nn.residual import FUSED_FROM

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(400)]

TOLERANCE = 1e-5
ACTS = {"relu": F.relu, "silu": F.silu, "none": lambda z: z}
MODULES = {"relu": nn.ReLU(inplace=True), "silu": nn.SiLU(), "none": None}


def _block_data(sizes: list[int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    n = sum(sizes)
    return {
        "x": torch.randn(n, 6, 5, 4, generator=g, dtype=torch.float64) * 2 + 1,
        "r": torch.randn(n, 6, 5, 4, generator=g, dtype=torch.float64),
        "dy": torch.randn(n, 6, 5, 4, generator=g, dtype=torch.float64),
        "weight": torch.rand(6, generator=g, dtype=torch.float64) + 0.5,
        "bias": torch.randn(6, generator=g, dtype=torch.float64),
    }


def _block_oracle(sizes: list[int], act: str) -> dict[str, torch.Tensor]:
    d = _block_data(sizes)
    bn = nn.BatchNorm2d(6).double()
    bn.weight.data, bn.bias.data = d["weight"].clone(), d["bias"].clone()
    x, r = d["x"].requires_grad_(), d["r"].requires_grad_()
    y = ACTS[act](bn(x) + r)
    dx, dr, dw, db = torch.autograd.grad(y, (x, r, bn.weight, bn.bias), d["dy"])
    return {
        "y": y.detach(),
        "dx": dx,
        "dr": dr,
        "dw": dw,
        "db": db,
        "running_mean": bn.running_mean,
        "running_var": bn.running_var,
    }


def _block_rank(rank: int, world: int, sizes: list[int], act: str, exchange: str, cl: bool) -> dict:
    d = _block_data(sizes)
    start = sum(sizes[:rank])
    part = slice(start, start + sizes[rank])
    layer = SyncBatchNorm(6, exchange=exchange)
    layer.weight.data, layer.bias.data = d["weight"].float(), d["bias"].float()
    x, r = d["x"][part].float(), d["r"][part].float()
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(), r.requires_grad_()
    y = layer.add_act(x, r, MODULES[act])
    dx, dr, dw, db = torch.autograd.grad(y, (x, r, layer.weight, layer.bias), d["dy"][part].float())
    for g in (dw, db):
        dist.all_reduce(g)
    out = {
        "y": y,
        "dx": dx,
        "dr": dr,
        "dw": dw,
        "db": db,
        "running_mean": layer.running_mean,
        "running_var": layer.running_var,
    }
    return {k: v.detach().double() for k, v in out.items()}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / max(float(want.norm()), 1e-30))


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize(
    ("sizes", "exchange", "cl"),
    [([3, 1], "gather", False), ([2, 0, 3], "gather", True), ([1, 3, 0], "reduce", False)],
    ids=["2-ranks-gather", "3-ranks-empty-gather-cl", "3-ranks-empty-reduce"],
)
def test_fused_layer_on_ranks_matches_float64_unfused(sizes, exchange, cl, act) -> None:
    want = _block_oracle(sizes, act)
    ranks = run_distributed(_block_rank, len(sizes), sizes, act, exchange, cl, timeout=240.0)
    got = {k: torch.cat([r[k] for r in ranks]) for k in ("y", "dx", "dr")}
    got.update({k: ranks[0][k] for k in ("dw", "db", "running_mean", "running_var")})
    errors = {k: _relative(got[k], want[k]) for k in want}
    assert max(errors.values()) <= TOLERANCE, errors
    for rank in ranks[1:]:  # every rank's running statistics from the same group statistics
        assert torch.equal(rank["running_var"], ranks[0]["running_var"])


# Every ResNet-family model the residual tests build (tests/test_residual.py), timm's DLA with its
# blocks named (forward(x, shortcut=None, children=None): the calls with a shortcut run unfused),
# and a user's copy of torchvision's Bottleneck, named.
NETWORKS = (
    "resnet18",
    "resnet50",
    "resnext50_32x4d",
    "timm_resnet18d",
    "timm_resnet26",
    "dla34",
    "user_bottlenecks",
)
NET_TOLERANCE = 1e-10  # float64 end to end: the fusion and the synchronization, not rounding
SIZES = [3, 1]


def _network(name: str) -> tuple[nn.Module, Any]:
    """The model called ``name`` (seeded) and the ``fuse_residual`` it is converted with."""
    if name == "dla34":
        timm = import_timm()
        torch.manual_seed(0)
        dla = timm.models.dla
        return timm.create_model("dla34", num_classes=5), [dla.DlaBasic, dla.DlaRoot]
    if name == "user_bottlenecks":
        torch.manual_seed(0)
        head = (nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
        net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), *_user_bottlenecks(), *head)
        return net, [_UserBottleneck]
    return _models()[name], True


def _net_data(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    side = 64 if name == "dla34" else 48  # DLA's root concatenates stages: a multiple of 32
    images = F.avg_pool2d(
        torch.randn(sum(SIZES), 3, side, side, generator=g, dtype=torch.float64), 3, 1, 1
    )
    return images, torch.randn(sum(SIZES), 5, generator=g, dtype=torch.float64)


def _net_step(
    model: nn.Module, images: torch.Tensor, weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    out = model(images)
    (out * weights).sum().backward()
    result = {"output": out.detach()}
    result.update({f"grad:{n}": p.grad for n, p in model.named_parameters()})
    result.update({f"buffer:{n}": b for n, b in model.named_buffers() if "running" in n})
    return {k: v.detach().double() for k, v in result.items()}


def _net_rank(rank: int, world: int, name: str) -> dict[str, torch.Tensor]:
    model, fuse = _network(name)
    model = convert_sync_batchnorm(model.double().train(), fuse_residual=fuse)
    assert any(hasattr(type(m), FUSED_FROM) for m in model.modules())
    images, weights = _net_data(name)
    part = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    result = _net_step(model, images[part], weights[part])
    for key, value in result.items():
        if key.startswith("grad:"):
            dist.all_reduce(value)
    return result


@pytest.mark.parametrize("name", NETWORKS)
def test_fused_resnet_train_step_on_two_ranks_matches_float64_unfused(name: str) -> None:
    want = _net_step(_network(name)[0].double().train(), *_net_data(name))
    ranks = run_distributed(_net_rank, len(SIZES), name, timeout=300.0)
    got = {"output": torch.cat([r.pop("output") for r in ranks]), **ranks[0]}
    assert sorted(got) == sorted(want)
    # Gradients of conv biases before a BatchNorm are 0 in exact arithmetic: scale by the family.
    largest = max(float(v.norm()) for k, v in want.items() if k.startswith("grad:"))
    errors = {
        k: float((got[k] - want[k]).norm()) / max(float(want[k].norm()), 1e-6 * largest)
        for k in want
    }
    worst = sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] <= NET_TOLERANCE, f"{name}: {worst}"


class _ResidualNet(nn.Module):
    """conv → BN → ReLU, then a block ending in BN → + → ReLU (fx rewrites it), then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = _Tail()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


class _Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)) + x)


class _Probe(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        info = {
            "state": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "traced": hasattr(type(pl_module.net.block), FUSED_FROM),
        }
        torch.save(info, os.path.join(self.out, f"rank{trainer.global_rank}.pt"))


def test_callback_fuse_residual_trains_as_the_unfused_run(tmp_path) -> None:
    """``SyncBNCallback(fuse_residual=True)`` on 2 ddp_spawn ranks: the block is rewritten and 4
    steps end with the parameters and running statistics of the unfused run."""
    runs = {}
    for fuse in (False, True):
        out = tmp_path / str(fuse)
        out.mkdir()
        model = BNNet()
        model.net = _ResidualNet()
        callbacks = [SyncBNCallback(fuse_residual=[_Tail] if fuse else False), _Probe(str(out))]
        trainer(2, callbacks).fit(model)
        runs[fuse] = load_ranks(str(out), 2)
    assert [r["traced"] for r in runs[True]] == [True, True]
    assert [r["traced"] for r in runs[False]] == [False, False]
    unfused, fused = runs[False][0]["state"], runs[True][0]["state"]
    assert list(fused) == list(unfused)
    for key, value in unfused.items():
        torch.testing.assert_close(fused[key], value, rtol=1e-5, atol=1e-6, msg=key)
