"""``step_statistics(normalize="step")``: each training call normalizes with its group's
statistics merged with those of the layer's earlier calls in the optimizer step (one more input
of the exchange's merge), and the step's running statistics are those of ``"micro"``.

* On 2 gloo ranks in float64, K = 4 uneven micro-batches with an empty one on one rank, both
  exchanges, the C++ path (its operator merges the step's earlier statistics too), the Python
  path and the reference twin, under DDP with ``no_sync``: outputs, input gradients and parameter
  gradients equal a float64 autograd oracle that normalizes micro-batch k over every rank's
  micro-batches 1..k (the earlier ones detached), within 1e-10; one running-statistics update
  from every input (1e-12).
* One process: the layer without a group and forced synchronization; a layer called twice in a
  micro-batch (its first call merges into its second); a checkpoint's recompute (the same
  outputs and gradients); bf16 and fp16 inputs against the float64 oracle; fused activations and
  residual tails (as the unfused layers); ``torch.compile(fullgraph=True)`` (as eager).
* The refusals' messages: ``docs/errors.md``, section 6, and ``tests/test_errors_layers.py``.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from _dist import run_distributed
from test_step_statistics import (
    NODES,
    _Block,
    _micro_batches,
    _net,
    _one_update,
    _steps_rank,
    _sync_layers,
    _take_path,
    compiled_twins,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks._common import OpCounter
from syncbn_lightning import (
    SyncBatchNorm,
    SyncBatchNormAct,
    convert_sync_batchnorm,
    step_statistics,
)
from syncbn_lightning._compat import NON_REENTRANT_KEEPS
from syncbn_lightning.nn.residual import FUSED_FROM


class _Oracle(nn.Module):
    """BatchNorm in float64 autograd that normalizes each call over the inputs of its earlier
    calls (detached: constants) and its own, with ``layer``'s affine parameters and eps."""

    def __init__(self, layer: SyncBatchNorm) -> None:
        super().__init__()
        self.weight = nn.Parameter(layer.weight.detach().clone())
        self.bias = nn.Parameter(layer.bias.detach().clone())
        self.eps = layer.eps
        self.earlier: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = torch.cat([*self.earlier, x])
        dims = [0, *range(2, x.dim())]
        mean, var = both.mean(dims, keepdim=True), both.var(dims, correction=0, keepdim=True)
        self.earlier.append(x.detach())
        shape = [1, -1] + [1] * (x.dim() - 2)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight.view(shape) + self.bias.view(
            shape
        )


def _oracle(net: nn.Module, micros: list[list[torch.Tensor]]) -> dict[str, Any]:
    """Every rank's micro-batch k as one batch through ``net`` with its layers replaced by
    :class:`_Oracle`: per rank its outputs and input gradients, and the parameter gradients
    averaged over the ranks (as DDP averages them)."""
    for i, layer in enumerate(_sync_layers(net)):
        parent, name = (net, str(i * 3 + 1))  # the layers of _net: net[1] and net[4]
        setattr(parent, name, _Oracle(layer))
    world = len(micros)
    outputs: list[list[torch.Tensor]] = [[] for _ in range(world)]
    grads: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for k in range(len(micros[0])):
        xs = [micros[r][k].clone().requires_grad_() for r in range(world)]
        y = net(torch.cat(xs))
        y.pow(2).sum().backward()  # each rank's loss, summed: SyncBN's backward is its gradient
        for r, part in enumerate(y.detach().split([x.shape[0] for x in xs])):
            outputs[r].append(part)
            grads[r].append(xs[r].grad)
    params = [p.grad / world for p in net.parameters()]
    return {"outputs": outputs, "grads": grads, "params": params}


_CASES = [
    (exchange, path) if (exchange, path) == ("gather", "cpp") else
    pytest.param(exchange, path, marks=pytest.mark.slow)
    for exchange in ("gather", "reduce")
    for path in ("cpp", "python", "reference")
]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(("exchange", "path"), _CASES)
def test_each_micro_batch_is_normalized_over_the_step_so_far_on_two_ranks(
    exchange: str, path: str
) -> None:
    ranks = [
        rank["step"]
        for rank in run_distributed(
            _steps_rank, 2, exchange, path, "step", ("step",), timeout=180.0
        )
    ]
    want = _oracle(_net(exchange, path), [_micro_batches(r) for r in range(2)])
    for r, rank in enumerate(ranks):
        assert rank["nodes"] == {NODES[path]}  # each path keeps its own: the C++ one too
        got = rank["outputs"] + rank["grads"]  # the input's gradients, then the parameters'
        expected = want["outputs"][r] + want["grads"][r] + want["params"]
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    for i, momentum in enumerate((0.1, 0.3)):
        inputs = torch.cat([rank["seen"][i] for rank in ranks])
        want_mean, want_var = _one_update(inputs, momentum)
        for rank in ranks:
            mean, var, tracked = rank["buffers"][i]
            assert tracked == 1
            torch.testing.assert_close(mean, want_mean, rtol=0, atol=1e-12)
            torch.testing.assert_close(var, want_var, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# One process
# ------------------------------------------------------------------------------------------------


def _layer(**options: Any) -> SyncBatchNorm:
    layer = SyncBatchNorm(3, **options).double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
        layer.bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(3))
    return layer


def _xs(dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(n, 3, 4, generator=g, dtype=torch.float64) * 3 - 2) for n in (2, 0, 3, 1)]


def _against_the_oracle(
    layer: SyncBatchNorm, calls_per_micro: int = 1, dtype: torch.dtype = torch.float64
) -> float:
    """The largest difference of the outputs and input gradients of ``layer`` in a step of 4
    micro-batches (each called ``calls_per_micro`` times) from the oracle's; the running
    statistics are checked against one update from every input."""
    xs = [x.to(dtype).requires_grad_() for x in _xs()]
    with step_statistics(layer, normalize="step"):
        outputs = [layer(x) for x in xs for _ in range(calls_per_micro)]
        sum(o.double().pow(2).sum() for o in outputs).backward()
    oracle = _Oracle(layer)
    twins = [x.detach().double().requires_grad_() for x in xs]
    want = [oracle(x) for x in twins for _ in range(calls_per_micro)]
    sum(o.pow(2).sum() for o in want).backward()
    pairs = zip(outputs, want, strict=True)
    worst = max((a.double() - b).abs().max().item() for a, b in pairs if a.numel())
    for x, twin in zip(xs, twins, strict=True):
        if x.numel():
            worst = max(worst, (x.grad.double() - twin.grad).abs().max().item())
    assert int(layer.num_batches_tracked) == 1
    inputs = torch.cat([x.detach().double() for x in xs for _ in range(calls_per_micro)])
    mean, var = _one_update(inputs, layer.momentum)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(layer.running_mean.double(), mean, rtol=0, atol=tolerance)
    torch.testing.assert_close(layer.running_var.double(), var, rtol=0, atol=tolerance)
    return worst


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
@pytest.mark.parametrize("force_sync", [False, True])
@pytest.mark.parametrize("impl", [None, "ref"])
def test_one_process_against_the_oracle(force_sync: bool, exchange: str, impl: str | None) -> None:
    """Also the path each call took: the C++ operator with the extension's kernels, also for
    a layer without a group (whose calls synchronize only to merge with the step's), the Python
    Function with the reference steps."""
    layer = _layer(force_sync=force_sync, exchange=exchange, impl=impl)
    assert _against_the_oracle(layer) < 1e-10
    with step_statistics(layer, normalize="step"):
        node = type(layer(_xs()[0].requires_grad_()).grad_fn).__name__
    assert node == NODES["python" if impl == "ref" else "cpp"]


def _step_results(exchange: str, path: str) -> list[torch.Tensor]:
    """A step of 4 micro-batches through a forced layer on ``path`` (the C++ operator, or the
    Python Function with the same kernels): its outputs, input and parameter gradients, running
    statistics and count."""
    layer = _layer(force_sync=True, exchange=exchange)
    _take_path(layer, path)
    xs = [x.requires_grad_() for x in _xs()]
    with step_statistics(layer, normalize="step"):
        outputs = [layer(x) for x in xs]
        sum(o.pow(2).sum() for o in outputs).backward()
    assert {type(o.grad_fn).__name__ for o in outputs} == {NODES[path]}
    grads = [x.grad for x in xs] + [layer.weight.grad, layer.bias.grad]
    buffers = [layer.running_mean, layer.running_var, layer.num_batches_tracked]
    return [o.detach() for o in outputs] + grads + buffers


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_the_cpp_path_merges_the_step_as_the_python_path_does_bitwise(exchange: str) -> None:
    cpp, python = _step_results(exchange, "cpp"), _step_results(exchange, "python")
    for a, b in zip(cpp, python, strict=True):
        assert torch.equal(a, b)


def _one_rank_group_step(rank: int, world: int, force_sync: bool) -> tuple[float, int]:
    """:func:`_against_the_oracle` with a group of this rank alone (the world's, in a world of
    one), and the collectives gloo ran during it."""
    from torch.profiler import profile

    from syncbn_lightning import new_sync_group

    group = new_sync_group(1) if world > 1 else None
    layer = _layer(force_sync=force_sync, process_group=group)
    with profile() as prof:
        worst = _against_the_oracle(layer)
    return worst, sum(event.name.startswith("gloo:") for event in prof.events())


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("force_sync", [False, True])
def test_a_one_rank_group_exchanges_nothing_unless_forced(force_sync: bool, world: int) -> None:
    """A layer whose group is one rank (a world of one, or groups of one in a world of two)
    merges its calls with the step's earlier ones without a collective: one rank has nothing to
    exchange. ``force_sync`` still runs its group's."""
    for worst, collectives in run_distributed(_one_rank_group_step, world, force_sync):
        assert worst < 1e-10
        assert collectives == (8 if force_sync else 0)  # 4 calls, a forward and a backward each


def _commit_ops(layers: int) -> int:
    """Dispatcher ops of the end of a ``normalize="step"`` step (the commit) after 3 forward
    calls of ``layers`` layers, the last one not called (its row of zeros is taken too)."""
    net = nn.Sequential(*[_layer(force_sync=i % 2 == 0) for i in range(layers)])
    with torch.no_grad():
        for counter in (None, OpCounter()):  # the first step makes the layers' counters
            context = step_statistics(net, normalize="step")
            context.__enter__()
            for x in _xs()[:3]:
                net[:-1](x)
            with counter or contextlib.nullcontext():
                context.__exit__(None, None, None)
    assert int(net[0].num_batches_tracked) == 2 and int(net[-1].num_batches_tracked) == 0
    return sum(counter.ops.values())


def test_the_commit_takes_every_layers_row_in_a_fixed_number_of_ops() -> None:
    ops = [_commit_ops(n) for n in (2, 8)]
    assert ops[0] == ops[1] > 0, ops


@pytest.mark.parametrize("force_sync", [False, True])
def test_a_layer_called_twice_merges_its_first_call_into_its_second(force_sync: bool) -> None:
    assert _against_the_oracle(_layer(force_sync=force_sync), calls_per_micro=2) < 1e-10


@pytest.mark.parametrize(("dtype", "bound"), [(torch.bfloat16, 0.05), (torch.float16, 0.005)])
def test_half_inputs_against_the_float64_oracle(dtype: torch.dtype, bound: float) -> None:
    layer = _layer(force_sync=True)
    layer.float()
    # outputs of about 3 rounded to 8 (bf16) or 11 (fp16) bits, the statistics in float32
    assert _against_the_oracle(layer, dtype=dtype) < bound


def _checkpointed_step(checkpointed: bool, use_reentrant: bool) -> tuple[Any, ...]:
    """A step of 4 micro-batches through conv, the layer and ReLU, each checkpointed or not:
    the outputs, the input gradients and the running mean after it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv1d(3, 3, 1), _layer(force_sync=True), nn.ReLU()).double()
    xs = [x.requires_grad_() for x in _xs()]
    with step_statistics(net, normalize="step"):
        outputs = []
        for x in xs:
            y = checkpoint(net, x, use_reentrant=use_reentrant) if checkpointed else net(x)
            y.pow(2).sum().backward()
            outputs.append(y.detach())
    return outputs, [x.grad for x in xs], net[1].running_mean.clone()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpoint_recompute_renormalizes_from_its_forward(use_reentrant: bool) -> None:
    """Where the forward cannot be found (torch 2.4's non-reentrant checkpoint:
    ``_compat.NON_REENTRANT_KEEPS``), the recompute refuses rather than normalize twice."""
    if not use_reentrant and not NON_REENTRANT_KEEPS:
        with pytest.raises(RuntimeError, match="found nothing its forward kept"):
            _checkpointed_step(True, use_reentrant)
        return
    plain_out, plain_grads, plain_mean = _checkpointed_step(False, use_reentrant)
    ck_out, ck_grads, ck_mean = _checkpointed_step(True, use_reentrant)
    for a, b in zip(plain_out + plain_grads, ck_out + ck_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(plain_mean, ck_mean, rtol=0, atol=1e-12)


@pytest.mark.slow
@pytest.mark.usefixtures("inline_modules")
@pytest.mark.parametrize("force_sync", [False, True])
def test_a_compiled_model_normalizes_and_counts_as_eager(force_sync: bool) -> None:
    """fullgraph compile, outside then inside the context (twice) then outside again: the
    outputs, gradients and counts of the eager model, no graph break, at most 2 recompiles (the
    layers without a group too: the context makes their counters before their first
    synchronized, compiled, call)."""
    from torch._dynamo.utils import counters

    eager, net, compiled, xs = compiled_twins(force_sync)
    seen = []
    for run in (eager, compiled):
        outputs = [run(xs[0])]
        outputs[0].sum().backward()
        for _ in range(2):
            with step_statistics(run, normalize="step"):
                for x in xs:
                    y = run(x)
                    y.pow(2).sum().backward()
                    outputs.append(y.detach())
        outputs.append(run(xs[1]))
        seen.append((outputs, [p.grad.clone() for p in run.parameters()]))
    for a, b in zip(seen[0][0] + seen[0][1], seen[1][0] + seen[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    for a, b in zip(_sync_layers(eager), _sync_layers(net), strict=True):
        assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 4
        torch.testing.assert_close(a.running_mean, b.running_mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(a.running_var, b.running_var, rtol=0, atol=1e-12)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] <= 3  # outside, inside, (at most) outside again


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_fused_activations_and_residual_tails_normalize_as_the_unfused_layers(
    exchange: str,
) -> None:
    """A fused residual tail and SyncBatchNormAct inside ``"step"``: the outputs and input
    gradients of the unfused layers in the same mode, and the same one update."""
    options: dict[str, Any] = {"force_sync": True, "exchange": exchange}
    torch.manual_seed(4)
    block = _Block()
    fused = convert_sync_batchnorm(copy.deepcopy(block), fuse_residual=[_Block], **options)
    assert hasattr(type(fused), FUSED_FROM)  # rewritten: its tail is one fused call
    torch.manual_seed(5)
    act = SyncBatchNormAct(3, **options)
    pairs = {
        "tail": (fused, convert_sync_batchnorm(copy.deepcopy(block), **options)),
        "act": (act, nn.Sequential(SyncBatchNorm(3, **options), nn.ReLU())),
    }
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(n, 3, 2, 2, generator=g, dtype=torch.float64) for n in (2, 3, 1)]
    for name, pair in pairs.items():
        seen = []
        for net in pair:
            net.double()
            inputs = [x.clone().requires_grad_() for x in xs]
            with step_statistics(net, normalize="step"):
                outputs = [net(x) for x in inputs]
                sum(o.pow(2).sum() for o in outputs).backward()
            seen.append([o.detach() for o in outputs] + [x.grad for x in inputs])
        for a, b in zip(*seen, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
        for a, b in zip(_sync_layers(pair[0]), _sync_layers(pair[1]), strict=True):
            assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 1, name
            torch.testing.assert_close(a.running_mean, b.running_mean, rtol=0, atol=1e-12)
            torch.testing.assert_close(a.running_var, b.running_var, rtol=0, atol=1e-12)
