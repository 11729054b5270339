"""One synchronized layer call through the fused steps, for any implementation of them.

``run_fused(ops, xs, exchange=...)`` plays W ranks in one process: every rank's payload
(``stats_row``, or ``reduce_sums`` shifted by its copy of the running mean), the payloads
gathered (concatenated, as the all-gather would) or summed (as the all-reduce would; gathered for
``exchange="reduce_gathered"``, the merge summing them), each rank's
merge (``merge_normalize`` or ``reduce_merge_normalize``) with its own copy of the running
statistics, ``grad_sums``, the sums of all ranks, ``grad_input``. The implementations
(``torch.ops.syncbn``, :mod:`syncbn_lightning.ops.reference.steps`, the CUDA kernels under
emulation) are compared on its results by ``tests/test_ops.py`` and
``tests/test_cuda_emu_fused.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from _numerics import rel_err

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
    exchange: str = "gather",
    equal_rank_weights: bool = False,
    momentum: float | None = 0.1,
    running_dtype: torch.dtype = torch.float32,
    affine: bool = True,
    layer_tag: int = 11,
    calls_start: int = 2,
    act: int = 0,
    act_param: float = 0.0,
    residual: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Every rank's results of one forward + backward through ``ops``' fused steps of
    ``exchange`` (with the activation ``act``, ``act_param`` fused, see
    :mod:`syncbn_lightning.ops.activations`; with ``residual``, a residual of each input's shape
    and layout added before it, and the backward through ``grad_sums_residual``), on the inputs'
    device; the parameters, running statistics, residuals and output gradients are drawn on the
    CPU, so every device sees the same values."""
    channels, device = xs[0].shape[1], xs[0].device
    gen = torch.Generator().manual_seed(3)
    residuals = [
        torch.empty_like(x).copy_(torch.randn(x.shape, generator=gen, dtype=torch.float64) * 2)
        if residual
        else None
        for x in xs
    ]
    weight = (torch.rand(channels, generator=gen) + 0.5).to(device) if affine else None
    bias = torch.randn(channels, generator=gen).to(device) if affine else None
    counters = [torch.full((1,), calls_start, dtype=torch.long, device=device) for _ in xs]
    states = [
        {k: v.to(device) for k, v in running_state(channels, running_dtype).items()} for _ in xs
    ]
    if exchange == "gather":
        sent = [ops.stats_row(x, layer_tag, c) for x, c in zip(xs, counters, strict=True)]
        received = torch.cat(sent)
    else:
        sent = [
            ops.reduce_sums(x, st["running_mean"], layer_tag, c, equal_rank_weights)
            for x, st, c in zip(xs, states, counters, strict=True)
        ]
        # "reduce_gathered": every rank's vector, for the merge to sum (CPU groups of <= 8 ranks)
        received = torch.cat(sent) if exchange == "reduce_gathered" else torch.stack(sent).sum(0)
    merged = []
    for x, own, state, res in zip(xs, sent, states, residuals, strict=True):
        running = (
            state["running_mean"],
            state["running_var"],
            state["num_batches_tracked"],
            state["nonfinite"],
        )
        if exchange == "gather":
            out = ops.merge_normalize(
                x,
                received,
                weight,
                bias,
                *running,
                momentum,
                1e-5,
                True,
                act,
                act_param,
                equal_rank_weights,
                res,
            )
        else:
            out = ops.reduce_merge_normalize(
                x,
                received,
                own,
                weight,
                bias,
                *running,
                momentum,
                1e-5,
                True,
                equal_rank_weights,
                len(xs),
                act,
                act_param,
                res,
            )
        merged.append(out)
    # Drawn on the CPU (the same values on every device), copied in the input's layout.
    grads = [
        torch.empty_like(x).copy_(torch.randn(x.shape, generator=gen, dtype=torch.float64))
        for x in xs
    ]
    if residual:  # g = dy * act'(z + r) is the residual's gradient and grad_input's dy
        sums = [
            ops.grad_sums_residual(dy, x, m[1], m[3], weight, bias, r, act, act_param, m[2], m[6])
            for dy, x, m, r in zip(grads, xs, merged, residuals, strict=True)
        ]
    else:
        sums = [
            ops.grad_sums(dy, x, m[1], m[3], weight, bias, act, act_param, m[2], m[6])
            for dy, x, m in zip(grads, xs, merged, strict=True)
        ]
    gathered = torch.cat([s[0] for s in sums])
    results = []
    for r, x in enumerate(xs):
        output, mean, mean_lo, invstd, var, info, grad_info = merged[r]
        dy, dy_act = (sums[r][3], 0) if residual else (grads[r], act)
        grad_in, order_ok = ops.grad_input(
            dy, x, mean, invstd, weight, gathered, grad_info, bias, dy_act, act_param, mean_lo
        )
        extra = {"residual": residuals[r], "grad_residual": sums[r][3]} if residual else {}
        results.append(
            {
                "grad_output": grads[r],
                "weight": weight,
                "bias": bias,
                "calls": counters[r],
                "sent": sent[r],
                "output": output,
                "mean": mean,
                "mean_lo": mean_lo,
                "invstd": invstd,
                "var": var,
                "info": info,
                "grad_info": grad_info,
                "sums": sums[r][0],
                "grad_weight": sums[r][1],
                "grad_bias": sums[r][2],
                "grad_input": grad_in,
                "order_ok": order_ok,
                **extra,
                **states[r],
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
            if expected is None:
                assert actual is None, where
                continue
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


def float64_errors(
    results: list[dict[str, torch.Tensor]], xs: list[torch.Tensor]
) -> dict[str, float]:
    """The worst normwise relative error (``_numerics.rel_err``) over ranks of each result of a
    :func:`run_fused` with ``momentum=1.0`` against float64 BatchNorm on the concatenated batch
    (the float32 inputs and output gradients the run used, its weight and bias), autograd for the
    gradients: outputs, input gradients, the ranks' summed weight and bias gradients, and the
    running statistics (the batch's, unbiased)."""
    x = torch.cat([r_x.float().double() for r_x in xs]).requires_grad_(True)
    dy = torch.cat([r["grad_output"].double() for r in results])
    weight = results[0]["weight"].double().requires_grad_(True)
    bias = results[0]["bias"].double().requires_grad_(True)
    running = [torch.zeros(x.shape[1], dtype=torch.float64), torch.ones(x.shape[1]).double()]
    out = torch.nn.functional.batch_norm(
        x, *running, weight, bias, training=True, momentum=1.0, eps=1e-5
    )
    out.backward(dy)
    errors: dict[str, float] = {}

    def worst(key: str, value: float) -> None:
        errors[key] = max(errors.get(key, 0.0), value)

    start = 0
    for r, rank_x in zip(results, xs, strict=True):
        rows = slice(start, start + rank_x.shape[0])
        start += rank_x.shape[0]
        if rank_x.shape[0]:
            worst("output", rel_err(r["output"], out[rows]))
            worst("grad_input", rel_err(r["grad_input"], x.grad[rows]))
        worst("running_mean", rel_err(r["running_mean"], running[0]))
        worst("running_var", rel_err(r["running_var"], running[1]))
    for key, oracle in (("grad_weight", weight.grad), ("grad_bias", bias.grad)):
        worst(key, rel_err(sum(r[key].double() for r in results), oracle))
    return errors


def to_cpu(results: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """:func:`run_fused`'s results copied to the CPU, layouts kept (for :func:`compare`)."""
    return [{k: None if v is None else v.cpu() for k, v in r.items()} for r in results]
