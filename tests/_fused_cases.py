"""One synchronized layer call through the four fused steps, for any implementation of them.

``run_fused(ops, xs, ...)`` plays W ranks in one process: every rank's ``stats_row``, the
gathered rows (concatenated, as the all-gather would), each rank's ``merge_normalize`` with its
own copy of the running statistics, ``grad_sums``, the sums of all ranks, ``grad_input``. The
implementations (``torch.ops.syncbn``, :mod:`syncbn_lightning.ops.reference`, the CUDA kernels under
emulation) are compared on its results by ``tests/test_ops.py`` and
``tests/test_cuda_emu_fused.py``.
"""

from __future__ import annotations

from typing import Any

import torch

# (per-rank batch sizes, channels, spatial shape): uneven ranks, an empty rank, C = 1, C = 4099.
FUSED_SHAPES = [
    ([3], 4, (5, 5)),
    ([2, 0, 3], 5, (3, 7)),
    ([1, 4], 1, (6,)),
    ([2, 2], 4099, ()),
    ([5, 1, 2, 1], 3, (2, 2, 3)),
]


def rank_inputs(
    sizes: list[int], channels: int, spatial: tuple[int, ...], dtype: torch.dtype, seed: int
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, channels, *spatial, generator=gen, dtype=torch.float64) * 3 + 2).to(dtype)
        for n in sizes
    ]


def running_state(channels: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "running_mean": torch.randn(channels, generator=gen).to(dtype),
        "running_var": (torch.rand(channels, generator=gen) + 0.5).to(dtype),
        "num_batches_tracked": torch.tensor(4, dtype=torch.long),
        "nonfinite": torch.zeros(1, dtype=torch.long),
    }


def run_fused(
    ops: Any,
    xs: list[torch.Tensor],
    *,
    momentum: float | None = 0.1,
    running_dtype: torch.dtype = torch.float32,
    affine: bool = True,
    layer_tag: int = 11,
    calls_start: int = 2,
    act: int = 0,
    act_param: float = 0.0,
) -> list[dict[str, torch.Tensor]]:
    """Every rank's results of one forward + backward through ``ops``' fused steps (with the
    activation ``act``, ``act_param`` fused, see :mod:`syncbn_lightning.ops.activations`)."""
    fused = (act, act_param) if act else ()  # none: the calls the plain layer makes
    channels = xs[0].shape[1]
    gen = torch.Generator().manual_seed(3)
    weight = (torch.rand(channels, generator=gen) + 0.5) if affine else None
    bias = torch.randn(channels, generator=gen) if affine else None
    counters = [torch.full((1,), calls_start, dtype=torch.long) for _ in xs]
    rows = torch.cat([ops.stats_row(x, layer_tag, c) for x, c in zip(xs, counters, strict=True)])
    merged = []
    for x in xs:
        state = running_state(channels, running_dtype)
        out = ops.merge_normalize(
            x,
            rows,
            weight,
            bias,
            state["running_mean"],
            state["running_var"],
            state["num_batches_tracked"],
            state["nonfinite"],
            momentum,
            1e-5,
            True,
            *fused,
        )
        merged.append((out, state))
    results = []
    sums = []
    grads = []
    for x, ((_output, mean, invstd, _var, _info), _) in zip(xs, merged, strict=True):
        dy = torch.empty_like(x).copy_(torch.randn(x.shape, generator=gen, dtype=torch.float64))
        grads.append(dy)
        sums.append(ops.grad_sums(dy, x, mean, invstd, weight, *((bias, *fused) if act else ())))
    gathered = torch.cat([s[0] for s in sums])
    for r, x in enumerate(xs):
        (output, mean, invstd, var, info), state = merged[r]
        extra = (bias, *fused) if act else ()
        grad_in = ops.grad_input(grads[r], x, mean, invstd, weight, gathered, info, *extra)
        results.append(
            {
                "calls": counters[r],
                "rows": rows,
                "output": output,
                "mean": mean,
                "invstd": invstd,
                "var": var,
                "info": info,
                "sums": sums[r][0],
                "grad_weight": sums[r][1],
                "grad_bias": sums[r][2],
                "grad_input": grad_in,
                **state,
            }
        )
    return results


def compare(
    got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], rtol: float
) -> None:
    """Every result of every rank close (exact for integers and layouts)."""
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        for key, expected in w.items():
            actual = g[key]
            where = f"rank {rank} {key}"
            assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
            if actual.numel() > 1 and actual.dim() > 1:
                assert actual.stride() == expected.stride(), where
            if not expected.is_floating_point():
                assert torch.equal(actual, expected), (where, actual, expected)
                continue
            atol = rtol * max(1.0, float(expected.double().abs().max())) if expected.numel() else 0
            torch.testing.assert_close(
                actual.double(), expected.double(), rtol=rtol, atol=atol, msg=where
            )


def channels_last(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same inputs in channels-last layout (4-D and 5-D; others unchanged)."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}
    return [x.contiguous(memory_format=fmt[x.dim()]) if x.dim() in fmt else x for x in xs]
