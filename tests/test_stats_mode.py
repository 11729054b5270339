"""``stats_mode``: mmcv's two ways of combining the ranks' statistics, on real gloo ranks.

``"N"`` (the default) weighs each rank by its number of values: the statistics of the concatenated
batch. ``"default"`` gives every rank with a non-empty batch the same weight. Oracle: one float64
process computing the equal-weight statistics on the concatenated batch, with autograd for the
gradients (each value of rank ``r`` weighs ``1 / (R n_r)``); outputs, input/weight/bias gradients
and running statistics are compared, with uneven batches and an empty rank.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from torch import nn

from syncbn_lightning import SyncBatchNorm, SyncBNCallback, convert_sync_batchnorm

C, EPS, MOMENTUM = 3, 1e-5, 0.1


def _rank_data(rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(size, C, 4, 5, generator=gen, dtype=torch.float64) * (1 + rank) + rank
    return x, torch.randn(x.shape, generator=gen, dtype=torch.float64)


def _layer() -> SyncBatchNorm:
    torch.manual_seed(0)
    bn = SyncBatchNorm(C, eps=EPS, momentum=MOMENTUM).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _worker(rank: int, world: int, sizes: list[int], impl: str) -> dict[str, dict]:
    """Both modes on this rank (one process group, two fresh layers)."""
    results = {}
    for mode in ("default", "N"):
        bn = _layer()
        bn.stats_mode, bn.impl = mode, impl
        x, g = _rank_data(rank, sizes[rank])
        x.requires_grad_(True)
        y = bn(x)
        (y * g).sum().backward()
        results[mode] = {
            "y": y.detach(),
            "dx": x.grad if x.grad is not None else torch.zeros_like(x),
            "dw": bn.weight.grad.clone(),
            "db": bn.bias.grad.clone(),
            "running": (bn.running_mean.clone(), bn.running_var.clone()),
        }
    return results


def _equal_weight_reference(sizes: list[int]) -> dict:
    """One process, float64: every non-empty rank's values weigh 1 / (R n_r)."""
    bn = _layer()
    data = [_rank_data(r, n) for r, n in enumerate(sizes)]
    x = torch.cat([d[0] for d in data]).requires_grad_(True)
    g = torch.cat([d[1] for d in data])
    per_sample = [
        torch.full((n,), 1.0 / (n * sum(1 for s in sizes if s)), dtype=torch.float64)
        for n in sizes
        if n
    ]
    p = torch.cat(per_sample).view(-1, 1, 1, 1) / (x.shape[2] * x.shape[3])
    mean = (p * x).sum(dim=(0, 2, 3))
    var = (p * (x - mean.view(1, C, 1, 1)) ** 2).sum(dim=(0, 2, 3))
    xhat = (x - mean.view(1, C, 1, 1)) / torch.sqrt(var.view(1, C, 1, 1) + EPS)
    y = xhat * bn.weight.view(1, C, 1, 1) + bn.bias.view(1, C, 1, 1)
    (y * g).sum().backward()
    n = x.shape[0] * x.shape[2] * x.shape[3]
    running_mean = MOMENTUM * mean.detach()
    running_var = (1 - MOMENTUM) + MOMENTUM * var.detach() * n / (n - 1)
    return {
        "y": y.detach().split(sizes),
        "dx": x.grad.split(sizes),
        "dw": bn.weight.grad,
        "db": bn.bias.grad,
        "running": (running_mean, running_var),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("impl", ["ref", "ext"])
@pytest.mark.slow
def test_default_mode_weighs_every_nonempty_rank_the_same(impl: str) -> None:
    sizes = [1, 4, 0]
    both = run_distributed(_worker, 3, sizes, impl, timeout=180)
    got = [b["default"] for b in both]
    want = _equal_weight_reference(sizes)
    for rank, out in enumerate(got):
        torch.testing.assert_close(out["y"], want["y"][rank], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(out["dx"], want["dx"][rank], rtol=1e-9, atol=1e-9)
        for stat, ref in zip(out["running"], want["running"], strict=True):
            torch.testing.assert_close(stat, ref, rtol=1e-9, atol=1e-9)
    # Weight/bias gradients are local (DDP sums them): their sum is the full gradient.
    torch.testing.assert_close(sum(o["dw"] for o in got), want["dw"], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(sum(o["db"] for o in got), want["db"], rtol=1e-9, atol=1e-9)
    # With these uneven batches the two modes differ measurably.
    assert (both[1]["N"]["running"][0] - got[1]["running"][0]).abs().max() > 1e-3


@pytest.mark.distributed
@pytest.mark.slow
def test_equal_batches_give_the_same_result_in_both_modes() -> None:
    sizes = [2, 2]
    for rank in run_distributed(_worker, 2, sizes, "ext", timeout=180):
        a, b = rank["default"], rank["N"]
        for key in ("y", "dx", "dw", "db"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-12, atol=1e-12)


def test_stats_mode_reaches_the_layers_through_every_entry_point() -> None:
    net = nn.Sequential(nn.BatchNorm2d(C), nn.BatchNorm1d(C))
    assert [m.stats_mode for m in convert_sync_batchnorm(net, stats_mode="default")] == [
        "default",
        "default",
    ]
    assert SyncBNCallback(stats_mode="default").stats_mode == "default"
    assert SyncBNCallback().stats_mode is None  # keep each layer's own
    for make in (  # the message itself: docs/errors.md (test_bn_stats_mode_unknown)
        lambda: convert_sync_batchnorm(nn.BatchNorm2d(C), stats_mode="mean"),
        lambda: SyncBNCallback(stats_mode="mean"),
    ):
        with pytest.raises(ValueError, match=r"stats_mode must be 'N' .* or 'default'"):
            make()


def test_hydra_bn_node_passes_stats_mode(tmp_path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from syncbn_lightning.app.config.checks import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={tmp_path}", "bn.stats_mode=default"])
    assert instantiate(cfg.bn).stats_mode == "default"
