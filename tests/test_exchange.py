"""The reduce exchange on real gloo ranks (8 and 16): parity with a float64 oracle and bytes on
the wire.

Every configuration trains a float32 layer for two steps (the first with running mean 0, the
second shifted by the updated one) on uneven batches with empty ranks; a float64 one-process
oracle computes the group statistics with autograd on the concatenated batch (count-weighted for
``stats_mode="N"``, every non-empty rank the same for ``"default"``). Outputs, input gradients,
the ranks' summed weight/bias gradients and the running statistics must agree within 1e-5
(normwise, see ``_numerics.rel_err``), also at ``|mean| / std = 1e4`` for both exchanges. A
TorchDispatchMode records every collective's payload: the reduce exchange's forward on 16 ranks
is one all-reduce of ``8 * (2C + 15)`` bytes (in CPU groups of up to 8 ranks, an all-gather of
those vectors, as the backward's sums), while the gather exchange's, ``P`` rows of
``4 * (3C + 4)`` bytes, grows as ``P``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _dist import run_distributed
from _numerics import rel_err
from torch.utils._python_dispatch import TorchDispatchMode

from syncbn_lightning import SyncBatchNorm, SyncBatchNormAct
from syncbn_lightning.distributed.collectives import GATHER_SUM_MAX_RANKS
from syncbn_lightning.functional.reduce import reduce_payload_numel
from syncbn_lightning.ops.reference.backward import GRAD_HEADER
from syncbn_lightning.ops.reference.steps import row_width

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # processes: outside the fast check
# The layers run the reference twins of the fused steps (the same collectives and payloads as the
# extension's kernels, which tests/test_ops.py compares with them): these tests are about the
# exchange, and 16 processes should not wait on a first build of the extension.
ENV = {"SYNCBN_IMPL": "ref"}

C, EPS, MOMENTUM, STEPS, TOL = 4, 1e-5, 0.1, 2, 1e-5
# (exchange, stats_mode, activation, |mean| / std of the data, track_running_stats)
CONFIGS = [
    ("gather", "N", None, 1.0, True),
    ("reduce", "N", None, 1.0, True),
    ("gather", "default", None, 1.0, True),
    ("reduce", "default", None, 1.0, True),
    ("reduce", "N", "silu", 1.0, True),
    ("reduce", "N", None, 1e4, True),
    ("reduce", "default", None, 1e4, True),
    ("reduce", "N", None, 1e4, False),
    ("gather", "N", None, 1e4, True),
    ("gather", "default", None, 1e4, True),
]


# The eager calls' process-group operators under the functional collectives' names.
_EAGER_COLLECTIVES = {"_allgather_base_": "all_gather_into_tensor", "allreduce_": "all_reduce"}


class CollectiveBytes(TorchDispatchMode):
    """Records ``(collective, bytes of its result)`` for every collective of a layer call: the
    functional ones (compiled code; waits excluded) and the process group's own operators
    (``c10d.*``, what eager calls run): what one rank receives from the call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        namespace, name = str(func).split(".")[:2]
        if namespace == "_c10d_functional" and name != "wait_tensor":
            self.calls.append((name, out.numel() * out.element_size()))
        elif namespace == "c10d" and name in _EAGER_COLLECTIVES:
            result = out[0][0] if isinstance(out[0], (list, tuple)) else out[0]
            self.calls.append((_EAGER_COLLECTIVES[name], result.numel() * result.element_size()))
        return out


def _plain(value: Any) -> Any:
    """``value`` with tensors as numpy arrays: pickled by value, so that a worker may exit before
    the parent reads its result (torch shares tensors through the sender's file descriptors)."""
    if isinstance(value, torch.Tensor):
        return value.detach().numpy().copy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _tensors(value: Any) -> Any:
    """The inverse of :func:`_plain`."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: _tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors(v) for v in value)
    return value


def _data(rank: int, step: int, size: int, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s float32 input (std about 1, mean about ``ratio``) and output gradient."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, C, 3, generator=gen) * (1 + 0.1 * rank) + ratio + 0.5 * rank
    return x, torch.randn(x.shape, generator=gen)


def _layer(exchange: str, stats_mode: str, act: str | None, track: bool) -> SyncBatchNorm:
    torch.manual_seed(0)
    kwargs = dict(exchange=exchange, stats_mode=stats_mode, track_running_stats=track)
    bn = SyncBatchNorm(C, EPS, MOMENTUM, **kwargs)
    if act is not None:
        bn = SyncBatchNormAct(C, EPS, MOMENTUM, act=act, **kwargs)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    bn.set_sync_name("bn")
    return bn


def _parity_worker(rank: int, world: int, sizes: list[list[int]], configs: list) -> list[Any]:
    """Per configuration, per step: this rank's output, input and parameter gradients, running
    statistics, and the collectives of the forward and the backward."""
    results = []
    for exchange, stats_mode, act, ratio, track in configs:
        bn = _layer(exchange, stats_mode, act, track)
        steps = []
        for step in range(STEPS):
            x, g = _data(rank, step, sizes[step][rank], ratio)
            x.requires_grad_(True)
            bn.zero_grad()
            with CollectiveBytes() as forward:
                y = bn(x)
            with CollectiveBytes() as backward:
                (y * g).sum().backward()
            steps.append(
                {
                    "y": y.detach(),
                    "dx": x.grad,
                    "dw": bn.weight.grad.clone(),
                    "db": bn.bias.grad.clone(),
                    "running": (bn.running_mean.clone(), bn.running_var.clone()) if track else None,
                    "forward": forward.calls,
                    "backward": backward.calls,
                }
            )
        results.append(steps)
    return _plain(results)


def _oracle(sizes: list[list[int]], config: tuple) -> list[dict[str, Any]]:
    """One float64 process: the group statistics of every step with autograd (see the module
    docstring), and the running statistics they give."""
    _, stats_mode, act, ratio, track = config
    bn = _layer("gather", "N", None, True).double()
    weight, bias = bn.weight.detach(), bn.bias.detach()
    running_mean = torch.zeros(C, dtype=torch.float64)
    running_var = torch.ones(C, dtype=torch.float64)
    out = []
    for step, step_sizes in enumerate(sizes):
        data = [_data(r, step, n, ratio) for r, n in enumerate(step_sizes)]
        xs = [x.double().requires_grad_(True) for x, _ in data]
        w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
        full = [x for x in xs if x.shape[0] > 0]
        if stats_mode == "N":
            cat = torch.cat(full)
            var, mean = torch.var_mean(cat, dim=(0, 2), correction=0)
        else:
            per_rank = [torch.var_mean(x, dim=(0, 2), correction=0) for x in full]
            mean = torch.stack([m for _, m in per_rank]).mean(0)
            var = torch.stack([v + (m - mean) ** 2 for v, m in per_rank]).mean(0)
        ys = []
        for x in xs:
            y = (x - mean[:, None]) / torch.sqrt(var[:, None] + EPS) * w[:, None] + b[:, None]
            ys.append(F.silu(y) if act == "silu" else y)
        sum(((y * g.double()).sum() for y, (_, g) in zip(ys, data, strict=True))).backward()
        n = sum(step_sizes) * 3
        running_mean = (1 - MOMENTUM) * running_mean + MOMENTUM * mean.detach()
        running_var = (1 - MOMENTUM) * running_var + MOMENTUM * var.detach() * n / (n - 1)
        out.append(
            {
                "y": [y.detach() for y in ys],
                "dx": [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs],
                "dw": w.grad,
                "db": b.grad,
                "running": (running_mean.clone(), running_var.clone()) if track else None,
            }
        )
    return out


def _check_parity(results: list[Any], sizes: list[list[int]], configs: list) -> None:
    results = _tensors(results)
    for index, config in enumerate(configs):
        for step, expected in enumerate(_oracle(sizes, config)):
            got = [ranks[index][step] for ranks in results]
            where = (config, step)
            errors = {
                "y": rel_err(torch.cat([g["y"] for g in got]), torch.cat(expected["y"])),
                "dx": rel_err(torch.cat([g["dx"] for g in got]), torch.cat(expected["dx"])),
                "dw": rel_err(sum(g["dw"] for g in got), expected["dw"]),
                "db": rel_err(sum(g["db"] for g in got), expected["db"]),
            }
            if expected["running"] is not None:
                for rank_result in got:  # every rank holds the same running statistics
                    errors["running_mean"] = max(
                        errors.get("running_mean", 0.0),
                        rel_err(rank_result["running"][0], expected["running"][0]),
                    )
                    errors["running_var"] = max(
                        errors.get("running_var", 0.0),
                        rel_err(rank_result["running"][1], expected["running"][1]),
                    )
            worst = max(errors, key=errors.get)
            assert errors[worst] <= TOL, (where, worst, errors)


def forward_collective(exchange: str, channels: int, world: int) -> tuple[str, int]:
    """``(collective, bytes one rank receives)`` of a forward on CPU: the gather exchange
    all-gathers ``world`` rows of ``4 * (3C + 4)`` bytes; the reduce exchange all-reduces
    ``8 * (2C + 15)`` bytes whatever ``world`` above 8 ranks, and in groups of up to 8 ranks
    all-gathers those vectors (``collectives.sum_over_group``: gloo's all-gather is the faster)."""
    if exchange == "gather":
        return ("all_gather_into_tensor", world * 4 * row_width(channels))
    vector = 8 * reduce_payload_numel(channels)
    if world <= GATHER_SUM_MAX_RANKS:
        return ("all_gather_into_tensor", world * vector)
    return ("all_reduce", vector)


def _check_forward_bytes(results: list[Any], configs: list, world: int) -> None:
    """Every forward: ONE collective, :func:`forward_collective`'s."""
    for index, (exchange, *_rest) in enumerate(configs):
        for ranks in results:
            for step in ranks[index]:
                assert step["forward"] == [forward_collective(exchange, C, world)], step


def _sizes(world: int) -> list[list[int]]:
    """Uneven batches with empty ranks, different per step."""
    first = [(3 * r + 1) % 5 for r in range(world)]  # 1, 4, 2, 0, 3, 1, 4, 2, ...
    return [first, first[1:] + first[:1]]


def test_reduce_matches_gather_and_float64_oracle_on_eight_ranks() -> None:
    sizes = _sizes(8)
    assert 0 in sizes[0] and 0 in sizes[1]
    results = run_distributed(_parity_worker, 8, sizes, CONFIGS, timeout=300, env=ENV)
    _check_parity(results, sizes, CONFIGS)
    _check_forward_bytes(results, CONFIGS, 8)


@pytest.mark.slow
def test_sixteen_ranks_reduce_with_float64_accuracy_and_auto_gathers_on_cpu() -> None:
    configs = [
        ("reduce", "N", None, 1e4, True),
        ("reduce", "default", None, 1.0, True),
        ("auto", "N", None, 1.0, True),
    ]
    sizes = _sizes(16)
    results = run_distributed(
        _parity_worker, 16, sizes, configs, timeout=600, pg_timeout_s=300, env=ENV
    )
    _check_parity(results, sizes, configs)
    # Above 8 ranks the reduce exchange all-reduces its O(C) vector; "auto" gathers CPU tensors
    # (on GPUs it would reduce: test_exchange_api); the backward all-reduces 2C float32 sums
    # behind the call-order header.
    _check_forward_bytes(results, [("reduce",), ("reduce",), ("gather",)], 16)
    for ranks in results:
        for steps in ranks:
            for step in steps:
                expected = [("all_reduce", 4 * (GRAD_HEADER + 2 * C))]
                assert step["backward"] == expected, step["backward"]


def _bytes_worker(rank: int, world: int) -> dict[str, list[tuple[str, int]]]:
    """The collectives of one forward per exchange, for C = 4 and C = 64."""
    out = {}
    for channels in (4, 64):
        for exchange in ("gather", "reduce"):
            bn = SyncBatchNorm(channels, exchange=exchange)
            with CollectiveBytes() as recorder:
                bn(torch.randn(2, channels, 3))
            out[f"{exchange}:{channels}"] = recorder.calls
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_forward_bytes_of_each_exchange_in_cpu_groups(world: int) -> None:
    for calls in run_distributed(_bytes_worker, world, env=ENV):
        for channels in (4, 64):
            for exchange in ("gather", "reduce"):
                want = forward_collective(exchange, channels, world)
                assert calls[f"{exchange}:{channels}"] == [want]
