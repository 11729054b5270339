"""Layer 4: the SyncBatchNorm module.

The central oracle: N gloo ranks with uneven (and empty) batches must compute what ONE process
running ``nn.BatchNorm*`` on the concatenated batch of their sync group computes: outputs, input
gradients, weight/bias gradients summed over the group's ranks, running stats and
num_batches_tracked. Each world size is spawned once and runs every case for both implementations.
"""

from __future__ import annotations

import dataclasses
import math
import os
from functools import cache
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _numerics import rel_err
from torch import nn

from syncbn_lightning import SyncBatchNorm, new_sync_group
from syncbn_lightning.functional import sync_batch_norm

FP32_TOL = 1e-5
# bfloat16 keeps 8 mantissa bits (relative rounding 2^-9), float16 11: the outputs are rounded to
# them, so the bound is a few units of the format's rounding error.
HALF_TOL = {"bfloat16": 2e-2, "float16": 4e-3}


@dataclasses.dataclass(frozen=True)
class Case:
    """One parity scenario; ``batches[r]`` is rank r's batch size."""

    name: str
    batches: tuple[int, ...]
    channels: int = 5
    spatial: tuple[int, ...] = (4, 3)
    channels_last: bool = False
    momentum: float | None = 0.1
    affine: bool = True
    dtype: str = "float32"
    group_size: int | None = None
    force_sync: bool = False
    impl: str = "ext"
    steps: int = 2


def _base_cases() -> list[Case]:
    return [
        # world 1: plain path (exactly nn.BatchNorm) and the forced sync kernels
        Case("w1_4d", (6,)),
        Case("w1_4d_forced", (6,), force_sync=True),
        Case("w1_2d_forced_momentum_none", (7,), spatial=(), force_sync=True, momentum=None),
        # world 2
        Case("w2_4d_uneven", (3, 5)),
        Case("w2_4d_channels_last", (3, 5), channels_last=True, spatial=(5, 6)),
        Case("w2_2d", (4, 1), spatial=()),
        Case("w2_3d_momentum_none", (2, 3), spatial=(7,), momentum=None),
        Case("w2_4d_affine_false", (4, 2), affine=False),
        Case("w2_4d_channels_last_bf16", (3, 5), channels_last=True, dtype="bfloat16"),
        Case("w2_4d_fp16", (2, 4), dtype="float16"),
        # world 3, with an empty rank
        Case("w3_4d_empty_rank", (2, 0, 5)),
        Case("w3_3d_empty_rank", (3, 0, 1), spatial=(9,)),
        Case("w3_5d_channels_last_3d", (1, 2, 2), spatial=(3, 4, 2), channels_last=True),
        # world 4: whole world and groups of 2 ({0,1} and {2,3})
        Case("w4_4d_world", (1, 3, 0, 2)),
        Case("w4_4d_groups_of_2", (1, 3, 0, 2), group_size=2),
        Case("w4_4d_channels_last_groups_of_2", (2, 1, 3, 2), group_size=2, channels_last=True),
        Case(
            "w4_2d_groups_of_2_momentum_none", (1, 3, 3, 2), spatial=(), group_size=2, momentum=None
        ),
    ]


CASES = [
    dataclasses.replace(c, name=f"{c.name}-{impl}", impl=impl)
    for c in _base_cases()
    for impl in ("ext", "ref")
]


def _oracle_cls(dim: int) -> type[nn.Module]:
    return {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[dim]


def _as_layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    if not channels_last:
        return t.contiguous()
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return t.contiguous(memory_format=fmt)


def _run_case(rank: int, world: int, case: Case, groups: dict[int | None, Any]) -> dict[str, Any]:
    os.environ["SYNCBN_IMPL"] = case.impl
    group_size = case.group_size or world
    pg = groups[case.group_size]
    first = rank // group_size * group_size
    members = range(first, first + group_size)
    dtype = getattr(torch, case.dtype)

    torch.manual_seed(7)
    layer = SyncBatchNorm(
        case.channels,
        momentum=case.momentum,
        affine=case.affine,
        process_group=pg,
        force_sync=case.force_sync,
    )
    oracle = _oracle_cls(2 + len(case.spatial))(
        case.channels, momentum=case.momentum, affine=case.affine
    )
    if case.affine:
        with torch.no_grad():
            w, b = torch.rand(case.channels) + 0.5, torch.randn(case.channels)
            for m in (layer, oracle):
                m.weight.copy_(w)
                m.bias.copy_(b)

    errors: dict[str, float] = {}

    def record(key: str, value: float) -> None:
        errors[key] = max(errors.get(key, 0.0), value)

    offsets = [0]
    for n in case.batches:
        offsets.append(offsets[-1] + n)
    for step in range(case.steps):
        gen = torch.Generator().manual_seed(100 + step)
        shape = (offsets[-1], case.channels, *case.spatial)
        full = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
        dy_full = torch.randn(shape, generator=gen).to(dtype)
        mine = slice(offsets[rank], offsets[rank + 1])
        group = slice(offsets[members[0]], offsets[members[-1] + 1])

        x = _as_layout(full[mine], case.channels_last).requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        y.backward(_as_layout(dy_full[mine], case.channels_last))

        # The oracle sees the same (possibly half-precision-rounded) values, in float32.
        xo = full[group].float().requires_grad_(True)
        oracle.zero_grad(set_to_none=True)
        yo = oracle(xo)
        yo.backward(dy_full[group].float())
        local = slice(offsets[rank] - offsets[members[0]], offsets[rank + 1] - offsets[members[0]])

        assert y.dtype == dtype and y.shape == x.shape
        assert y.stride() == x.stride(), "output must keep the input's memory format"
        record("output", rel_err(y, yo[local]))
        record("grad_input", rel_err(x.grad, xo.grad[local]))
        if case.affine:
            for name in ("weight", "bias"):
                grad = getattr(layer, name).grad.clone()
                dist.all_reduce(grad, group=pg)
                record(f"grad_{name}", rel_err(grad, getattr(oracle, name).grad))
    record("running_mean", rel_err(layer.running_mean, oracle.running_mean))
    record("running_var", rel_err(layer.running_var, oracle.running_var))
    errors["num_batches_tracked"] = float(
        layer.num_batches_tracked.item() != oracle.num_batches_tracked.item()
    )
    return errors


def _parity_worker(rank: int, world: int, cases: list[Case]) -> dict[str, dict[str, float]]:
    groups: dict[int | None, Any] = {None: None}
    for size in sorted({c.group_size for c in cases if c.group_size is not None}):
        groups[size] = new_sync_group(size)
    return {case.name: _run_case(rank, world, case, groups) for case in cases}


@cache
def _parity_results(world: int) -> dict[str, list[dict[str, float]]]:
    cases = [c for c in CASES if len(c.batches) == world]
    per_rank = run_distributed(_parity_worker, world, cases, timeout=300)
    return {c.name: [r[c.name] for r in per_rank] for c in cases}


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.slow
def test_parity_with_batchnorm_on_concatenated_batch(case: Case) -> None:
    tol = HALF_TOL.get(case.dtype, FP32_TOL)
    per_rank = _parity_results(len(case.batches))[case.name]
    for rank, errors in enumerate(per_rank):
        assert errors["num_batches_tracked"] == 0, f"rank {rank}: num_batches_tracked differs"
        bad = {k: v for k, v in errors.items() if k != "num_batches_tracked" and v > tol}
        assert not bad, f"rank {rank} (batch {case.batches[rank]}): errors above {tol}: {bad}"


# ------------------------------------------------------------------------------------------------
# Seed 002's example, numerics, eval mode, and per-rank degenerate batches (2 or 3 real ranks)
# ------------------------------------------------------------------------------------------------


def _seed_example_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for unbiased in (True, False):
        bn = SyncBatchNorm(3, momentum=0.1, unbiased_running_var=unbiased)
        # One sample per rank: one value per channel locally, two in the group, which is fine.
        x = torch.full((1, 3), float(rank + 1))
        out[unbiased] = (bn(x).tolist(), bn.running_mean.tolist(), bn.running_var.tolist())
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_seed_example_ones_and_twos() -> None:
    """Two ranks holding ones and twos: mean 1.5, biased var 0.25 -> outputs -1 and +1."""
    results = run_distributed(_seed_example_worker, 2)
    for rank, sign in ((0, -1.0), (1, 1.0)):
        for unbiased, expected_var in ((True, 0.9 + 0.1 * 0.5), (False, 0.925)):
            y, running_mean, running_var = results[rank][unbiased]
            # |y| = 0.5 / sqrt(0.25 + eps): 1 up to eps
            assert y[0] == pytest.approx([sign * 0.5 / math.sqrt(0.25 + 1e-5)] * 3, abs=1e-6)
            assert running_mean == pytest.approx([0.15] * 3, abs=1e-7)
            # torch updates running_var with the unbiased variance (0.5 for n=2), TF/Keras with
            # the biased one (0.25), giving seed 002's 0.925
            assert running_var == pytest.approx([expected_var] * 3, abs=1e-6)


def _large_mean_worker(rank: int, world: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    sizes = [1, 6, 13]
    full = (
        torch.randn(sum(sizes), 4, 8, 8, generator=gen, dtype=torch.float64) * 0.1 + 1e4
    ).float()
    start = sum(sizes[:rank])
    x = full[start : start + sizes[rank]]
    results = {}
    for impl in ("ext", "ref"):
        os.environ["SYNCBN_IMPL"] = impl
        _, mean, var, _, _ = sync_batch_norm(x, None, None, 1e-5, None, world, unbiased=False)
        results[impl] = (mean.double(), var.double())
    # the detectron2-style computation, for contrast: E[x^2] - E[x]^2 in float32
    sums = torch.stack([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3))])
    dist.all_reduce(sums)
    n = full[:, 0].numel()
    results["sumsq"] = sums[1] / n - (sums[0] / n) ** 2
    results["truth"] = full.double().var((0, 2, 3), correction=0)
    results["truth_mean"] = full.double().mean((0, 2, 3))
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_variance_of_large_mean_data_split_unevenly_over_3_ranks() -> None:
    """Mean 1e4, std 0.1 in float32 over 3 uneven ranks: variance within 1e-4 of float64."""
    results = run_distributed(_large_mean_worker, 3)
    for rank, r in enumerate(results):
        truth = r["truth"]
        for impl in ("ext", "ref"):
            mean, var = r[impl]
            var_err = ((var - truth).abs() / truth).max().item()
            assert var_err <= 1e-4, f"rank {rank} {impl}: variance relative error {var_err:.2e}"
            assert ((mean - r["truth_mean"]).abs() / r["truth_mean"]).max() < 1e-7
        # The data really is hard: sum/sum-of-squares loses the variance entirely.
        naive_err = ((r["sumsq"].double() - truth).abs() / truth).max().item()
        assert naive_err > 0.5, f"test data too easy: naive error only {naive_err:.2e}"


def _eval_worker(rank: int, world: int) -> list[float]:
    bn = SyncBatchNorm(4)
    bn.train()
    bn(torch.randn(3, 4, 2, 2) + rank)  # one synchronized training step
    bn.eval()
    if rank == 0:
        # Only rank 0 evaluates. If eval communicated, rank 1 would be in the all_reduce below
        # while rank 0 sits in an all_gather: a mismatch that errors or times out.
        for _ in range(3):
            bn(torch.randn(2, 4, 2, 2))
    check = torch.tensor([float(rank + 1)])
    dist.all_reduce(check)
    return [check.item(), *bn.running_mean.tolist()]


@pytest.mark.distributed
@pytest.mark.slow
def test_eval_mode_communicates_nothing_and_running_stats_agree() -> None:
    results = run_distributed(_eval_worker, 2, pg_timeout_s=20)
    assert results[0][0] == results[1][0] == 3.0
    assert results[0][1:] == pytest.approx(results[1][1:], abs=0)


def _one_value_worker(rank: int, world: int) -> str:
    bn = SyncBatchNorm(3)
    x = torch.randn(1, 3) if rank == 0 else torch.randn(0, 3)
    try:
        bn(x)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
@pytest.mark.slow
def test_one_value_per_channel_in_the_whole_group_raises_on_every_rank() -> None:
    messages = run_distributed(_one_value_worker, 2)
    for message in messages:
        assert message.startswith("Expected more than 1 value per channel when training")


def _all_empty_worker(rank: int, world: int) -> list[float]:
    bn = SyncBatchNorm(2)
    y = bn(torch.randn(0, 2, 3))
    return [
        y.numel(),
        bn.num_batches_tracked.item(),
        *bn.running_mean.tolist(),
        *bn.running_var.tolist(),
    ]


@pytest.mark.distributed
@pytest.mark.slow
def test_all_empty_group_behaves_like_torch_on_an_empty_batch() -> None:
    # torch: counts the batch, leaves the running stats untouched
    torch_bn = nn.BatchNorm1d(2)
    torch_bn(torch.randn(0, 2, 3))
    expected = [0, 1, *torch_bn.running_mean.tolist(), *torch_bn.running_var.tolist()]
    assert run_distributed(_all_empty_worker, 2) == [expected, expected]
