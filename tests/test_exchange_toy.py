"""A third exchange strategy is one class and one registry line: this file registers a toy that
all-gathers float64 rows and checks it on 3 real gloo ranks (uneven batches, one empty) against a
float64 one-process oracle.

The toy sends ``[count, samples, layer_tag, call_tag, mean[C], mean_lo[C], m2[C]]`` in float64
(the gather exchange's row, in float64 whatever the input dtype, so ``mean_lo`` is 0), merges with
the reference's Chan merge in float64, and runs its backward in float64 through the reference
twins of the fused steps. Everything else
(the layer, its options, the one autograd Function, the collectives, the running statistics,
``SyncBNCallback``'s settings) is the library's, untouched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_distributed
from _numerics import rel_err

from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm
from syncbn_lightning.distributed.call_order.checks import raise_if_out_of_order
from syncbn_lightning.functional import (
    Exchange,
    Inputs,
    LocalGrads,
    Merged,
    Saved,
    SyncCall,
    exchange_names,
    register_exchange,
)
from syncbn_lightning.ops import reference
from syncbn_lightning.ops.reference import steps as reference_steps

pytestmark = pytest.mark.distributed


class Float64Gather(Exchange):
    """Every rank's statistics row in float64, all-gathered; merged and differentiated in
    float64."""

    name = "toy_float64_gather"
    summary = "all-gather float64 rows (a test's toy)"
    gathers = True

    def payload(self, inputs: Inputs, call: SyncCall) -> torch.Tensor:
        return reference_steps.stats_row(inputs.input.double(), call.layer_tag, inputs.state.calls)

    def merge(
        self, inputs: Inputs, sent: torch.Tensor, received: torch.Tensor, call: SyncCall
    ) -> Merged:
        input, weight, bias, state = inputs
        options, channels = call.options, input.shape[1]
        table = received.view(-1, reference_steps.row_width(channels))
        raise_if_out_of_order(table[:, 2:4], call.group)
        hi, lo, m2s = table[:, reference_steps.ROW_HEADER :].split(channels, dim=1)
        means = hi + lo
        mean, invstd, var = reference.merge_stats(
            table[:, 0], means, m2s, options.eps, options.unbiased_running_var
        )
        count, finite = table[:, 0].sum(), torch.isfinite(mean).all() & torch.isfinite(var).all()
        with torch.no_grad():
            if state.num_batches_tracked is not None:
                state.num_batches_tracked.add_(finite.long())
            if state.running_mean is not None:
                reference.update_running(
                    state.running_mean,
                    state.running_var,
                    mean,
                    var,
                    finite & (count > 0),
                    options.momentum,
                    state.num_batches_tracked,
                )
        x64, w64, b64 = (None if t is None else t.double() for t in (input, weight, bias))
        output = reference.normalize(x64, mean, invstd, w64, b64).to(input.dtype)
        # [count, samples, order_ok, finite, layer_tag, call_tag]: the backward sends the tags
        # back with its sums (reference_steps.grad_sums) and checks them (grad_input).
        flags = [table[:, 1].sum(), torch.ones_like(count), finite.double(), *table[0, 2:4]]
        info = torch.stack([count, *flags])
        return Merged(output, mean, var, info, (input, weight, mean, invstd, info))

    def local_grads(self, grad_output: torch.Tensor, saved: Saved, call: SyncCall) -> LocalGrads:
        input, weight, mean, invstd, _info = saved
        w64 = None if weight is None else weight.double()
        sums, grad_weight, grad_bias = reference_steps.grad_sums(
            grad_output.double(), input.double(), mean, invstd, w64, info=_info
        )
        dtype = weight.dtype if weight is not None else input.dtype
        return LocalGrads(sums, grad_weight.to(dtype), grad_bias.to(dtype), saved)

    def grad_input(
        self, grad_output: torch.Tensor, summed: torch.Tensor, local: LocalGrads, call: SyncCall
    ) -> torch.Tensor:
        input, weight, mean, invstd, info = local.carry
        w64 = None if weight is None else weight.double()
        grad, _order_ok = reference_steps.grad_input(
            grad_output.double(), input.double(), mean, invstd, w64, summed, info
        )
        return grad.to(input.dtype)


# The registry line (in a library module it would sit in syncbn_lightning/functional/__init__.py).
register_exchange(Float64Gather())

SIZES = [5, 0, 3]  # per rank: uneven, one empty
OFFSET = 1e3  # |mean| / std: float32 inputs far from zero


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(sum(SIZES), 4, 3, 3, generator=gen, dtype=torch.float64) * 2 + OFFSET
    grad = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    weight = torch.rand(4, generator=gen, dtype=torch.float64) + 0.5
    bias = torch.randn(4, generator=gen, dtype=torch.float64)
    return x.float().double(), grad, weight, bias


def _toy_worker(rank: int, world: int) -> dict[str, Any]:
    x, grad, weight, bias = _data()
    start = sum(SIZES[:rank])
    rows = slice(start, start + SIZES[rank])
    layer = convert_sync_batchnorm(torch.nn.BatchNorm2d(4), exchange="toy_float64_gather")
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    mine = x[rows].float().requires_grad_(True)
    out = layer(mine)
    out.backward(grad[rows].float())
    return {
        "output": out.detach(),
        "grad_input": mine.grad,
        "grad_weight": layer.weight.grad,
        "grad_bias": layer.bias.grad,
        "running_mean": layer.running_mean,
        "running_var": layer.running_var,
        "tracked": int(layer.num_batches_tracked),
        "exchange": type(layer).__name__ + ":" + layer.exchange,
    }


def test_the_toy_is_registered_and_validated_by_name() -> None:
    assert "toy_float64_gather" in exchange_names()
    assert SyncBatchNorm(4, exchange="toy_float64_gather").exchange == "toy_float64_gather"
    with pytest.raises(ValueError, match=r"'toy_float64_gather' \(all-gather float64 rows"):
        SyncBatchNorm(4, exchange="toy")


@pytest.mark.slow
def test_a_registered_toy_exchange_matches_the_float64_oracle_on_three_ranks() -> None:
    world = len(SIZES)
    results = run_distributed(_toy_worker, world, timeout=300)
    x, grad, weight, bias = _data()
    x.requires_grad_(True)
    w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    running_mean, running_var = torch.zeros(4, dtype=torch.float64), torch.ones(4).double()
    expected = F.batch_norm(x, running_mean, running_var, w, b, training=True, momentum=0.1)
    expected.backward(grad)
    start = 0
    for rank, got in enumerate(results):
        rows = slice(start, start + SIZES[rank])
        start += SIZES[rank]
        assert got["exchange"] == "SyncBatchNorm:toy_float64_gather"
        assert got["tracked"] == 1
        if SIZES[rank]:
            assert rel_err(got["output"], expected[rows]) <= 1e-5, rank
            assert rel_err(got["grad_input"], x.grad[rows]) <= 1e-5, rank
        assert rel_err(got["running_mean"], running_mean) <= 1e-6, rank
        assert rel_err(got["running_var"], running_var) <= 1e-6, rank
    # Weight and bias gradients are local; DDP would sum (average) them: the sum is the oracle's.
    for key, oracle in (("grad_weight", w.grad), ("grad_bias", b.grad)):
        total = sum(r[key].double() for r in results)
        assert rel_err(total, oracle) <= 1e-5, key
