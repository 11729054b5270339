"""Layer 1: the pure-PyTorch reference primitives against torch's own BatchNorm and float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _numerics import rel_err

from syncbn_lightning.ops import reference as R


def _stats_against_float64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dims = [0, *range(2, x.dim())]
    x64 = x.double()
    return x64.mean(dims), x64.var(dims, correction=0) * (x.numel() // x.shape[1])


@pytest.mark.parametrize("shape", [(7, 3), (4, 3, 9), (2, 3, 5, 4), (2, 3, 2, 3, 4)])
def test_forward_pipeline_equals_f_batch_norm(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape) * 4 + 2
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    mean, m2 = R.local_stats(x)
    count = torch.tensor([float(x.numel() // 3)])
    mean, invstd, var = R.merge_stats(count, mean[None], m2[None], 1e-5, True)
    y = R.normalize(x, mean, invstd, w, b)
    expected = F.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
    assert rel_err(y, expected) < 1e-6
    assert rel_err(var, x.var([0, *range(2, x.dim())], correction=1)) < 1e-6


def test_merge_of_split_batch_equals_whole_batch_and_ignores_empty_ranks() -> None:
    torch.manual_seed(1)
    x = torch.randn(9, 4, 3, dtype=torch.float64) * 3 + 7
    parts = [x[:2], x[2:2], x[2:9]]  # an empty rank in the middle
    stats = [R.local_stats(p) for p in parts]
    counts = torch.tensor([float(p.numel() // 4) for p in parts], dtype=torch.float64)
    mean, _invstd, var = R.merge_stats(
        counts,
        torch.stack([s[0] for s in stats]),
        torch.stack([s[1] for s in stats]),
        0.0 + 1e-12,
        False,
    )
    true_mean, true_m2 = _stats_against_float64(x)
    assert rel_err(mean, true_mean) < 1e-14
    assert rel_err(var, true_m2 / 27) < 1e-13


def test_all_empty_group_gives_finite_stats() -> None:
    zeros = torch.zeros(2, 3)
    mean, invstd, var = R.merge_stats(torch.zeros(2), zeros, zeros, 1e-5, True)
    assert torch.equal(mean, torch.zeros(3)) and torch.equal(var, torch.zeros(3))
    assert torch.isfinite(invstd).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_accumulate_in_float32(dtype: torch.dtype) -> None:
    x = torch.randn(16, 3, 8, 8).to(dtype)
    mean, m2 = R.local_stats(x)
    assert mean.dtype == torch.float32
    true_mean, true_m2 = _stats_against_float64(x)
    assert rel_err(mean, true_mean) < 1e-6 and rel_err(m2, true_m2) < 1e-6
    y = R.normalize(
        x, *R.merge_stats(torch.tensor([1024.0]), mean[None], m2[None], 1e-5, True)[:2], None, None
    )
    assert y.dtype == dtype


def test_backward_pipeline_equals_autograd_of_f_batch_norm() -> None:
    torch.manual_seed(2)
    x = (
        (torch.randn(5, 3, 4, 4, dtype=torch.float64) * 2)
        .contiguous(memory_format=torch.channels_last)
        .requires_grad_(True)
    )
    w = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_(True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    dy = torch.randn_like(x)
    F.batch_norm(x, None, None, w, b, training=True, eps=1e-5).backward(dy)
    mean, m2 = R.local_stats(x.detach())
    n = torch.tensor([80.0], dtype=torch.float64)
    mean, invstd, _ = R.merge_stats(n, mean[None], m2[None], 1e-5, True)
    sum_dy, sum_dy_xmu, gw, gb = R.backward_reduce(
        dy, x.detach(), mean, invstd, w.detach(), True, True
    )
    gx = R.backward_elemt(dy, x.detach(), mean, invstd, w.detach(), sum_dy, sum_dy_xmu, n)
    assert rel_err(gx, x.grad) < 1e-12
    assert rel_err(gw, w.grad) < 1e-12 and rel_err(gb, b.grad) < 1e-12
