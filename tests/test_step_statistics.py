"""``step_statistics``: one running-statistics update per optimizer step under gradient
accumulation (``nn/step_statistics.py``, the policy in ``functional/accumulate.py``).

* On 2 gloo ranks in float64, K = 4 uneven micro-batches with an empty one on one rank, both
  exchanges, the C++ path and the Python path (with the extension's kernels and with the
  reference twin), under DDP with ``no_sync``: outputs and gradients are those without the
  context, bitwise (the reduce exchange's shift, the running mean, is read from the step's
  copies of the running statistics, which move as the buffers would outside), and the running
  statistics are one
  momentum update from the mean and unbiased variance of every input each layer saw in the
  step, on every rank; one ``num_batches_tracked`` per step.
* The layer without a group (plain BatchNorm inside): the same output, one update.
* bf16 and fp16 inputs: the float64 oracle's update to float32's precision; fused activations
  and residual tails: as the unfused layers.
* The rules: ``momentum=None``, ``unbiased_running_var=False``, a non-finite step (skipped and
  counted), a layer not called, eval calls, an exception (nothing committed), a checkpoint's
  recompute (adds nothing), pickles and copies (the merge is left behind).
* The groups kept between steps: the next step takes its layers' group again and starts it
  clean (after a failed step too), two models alike whose steps overlap keep their own, a step
  under ``torch.inference_mode`` leaves nothing the next steps cannot write, and a step that
  fails to start leaves no layer inside it.
* Nested contexts leave the outer one whole; plain BatchNorm layers get one warning. (The
  refusals' messages: ``docs/errors.md``, section 6, and ``tests/test_errors_layers.py``.)
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks._common import OpCounter
from syncbn_lightning import (
    SyncBatchNorm,
    convert_sync_batchnorm,
    step_statistics,
)
from syncbn_lightning.functional import accumulate
from syncbn_lightning.functional.layer_call import plan_of
from syncbn_lightning.nn.residual import FUSED_FROM

# Each rank's micro-batch sizes: uneven, and an empty one on rank 1.
SIZES = ([2, 1, 3, 2], [1, 0, 2, 3])
PATHS = ("cpp", "python", "reference")


def _net(exchange: str, path: str, **options: Any) -> nn.Module:
    """Two synchronized layers (the second's input depends on the first's output), float64."""
    torch.manual_seed(3)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 1),
        nn.BatchNorm2d(4, momentum=0.3),
    )
    net = convert_sync_batchnorm(net).double()
    for layer in _sync_layers(net):
        layer.exchange = exchange
        for name, value in options.items():
            setattr(layer, name, value)
        if path == "reference":
            layer.impl = "ref"
    return net


def _sync_layers(net: nn.Module) -> list[SyncBatchNorm]:
    return [m for m in net.modules() if isinstance(m, SyncBatchNorm)]


def _take_path(net: nn.Module, path: str) -> None:
    """The C++ path (the CPU's default), or the Python Function with the extension's kernels
    (the plan told not to take the operator), or the reference twin (``impl="ref"``)."""
    for layer in _sync_layers(net):
        plan = plan_of(layer, "cpu")
        assert plan.native == (path != "reference"), path
        if path == "python":
            plan.native = False


#: The autograd node of a synchronized call's output, by the path it took: the C++ operator's, or
#: the Python Function's (with the extension's kernels or the reference twin).
NODES = {"cpp": "CppFunction", "python": "SyncBatchNormFunctionBackward"}
NODES["reference"] = NODES["python"]


def _micro_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(17 + rank)
    return [torch.randn(n, 3, 2, 3, generator=g, dtype=torch.float64) * 2 + 1 for n in SIZES[rank]]


def _steps_rank(
    rank: int,
    world: int,
    exchange: str,
    path: str,
    normalize: str = "micro",
    modes: tuple[str, ...] = ("plain", "step"),
) -> dict[str, Any]:
    """One optimizer step of K micro-batches under DDP (``no_sync`` but the last), without
    the context (``"plain"``) and with it (``"step"``, ``step_statistics(model, normalize)``),
    from the same weights: outputs, gradients (the input's, then the parameters'), buffers, and
    the inputs each layer saw, and the autograd nodes of the layers' outputs (which path ran:
    :data:`NODES`)."""
    out: dict[str, Any] = {}
    for mode in modes:
        net = _net(exchange, path)
        model = nn.parallel.DistributedDataParallel(net)
        _take_path(net, path)
        seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}
        nodes: set[str] = set()
        for i, layer in enumerate(_sync_layers(net)):
            layer.register_forward_pre_hook(lambda _m, a, into=seen[i]: into.append(a[0].detach()))
            layer.register_forward_hook(lambda _m, _a, y, s=nodes: s.add(type(y.grad_fn).__name__))
        outputs, grads = [], []
        context = step_statistics(model, normalize) if mode == "step" else _Nothing()
        with context:
            micros = _micro_batches(rank)
            for k, x in enumerate(micros):
                x = x.clone().requires_grad_()
                sync = model.no_sync() if k < len(micros) - 1 else _Nothing()
                with sync:
                    y = model(x)
                    y.pow(2).sum().backward()
                outputs.append(y.detach())
                grads.append(x.grad)
        out[mode] = {
            "outputs": outputs,
            "grads": grads + [p.grad.clone() for p in net.parameters()],
            "buffers": [
                (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
                for bn in _sync_layers(net)
            ],
            "seen": [torch.cat(seen[i]) for i in (0, 1)],
            "nodes": nodes,
        }
    return out


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _one_update(
    inputs: torch.Tensor, momentum: float | None, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running statistics of a fresh layer after one update from all of ``inputs``."""
    dims = [0, *range(2, inputs.dim())]
    mean = inputs.mean(dims)
    var = inputs.var(dims, correction=1 if unbiased else 0)
    factor = 1.0 if momentum is None else momentum
    return factor * mean, (1 - factor) * torch.ones_like(var) + factor * var


# The C++ path on the gather exchange in the fast check; the other five (4-5 s each) are slow.
_CASES = [
    (exchange, path) if (exchange, path) == ("gather", "cpp") else
    pytest.param(exchange, path, marks=pytest.mark.slow)
    for exchange in ("gather", "reduce")
    for path in PATHS
]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(("exchange", "path"), _CASES)
def test_one_update_per_step_on_two_ranks_and_the_same_outputs(exchange: str, path: str) -> None:
    ranks = run_distributed(_steps_rank, 2, exchange, path, timeout=180.0)
    for rank in ranks:
        plain, step = rank["plain"], rank["step"]
        for name in ("outputs", "grads"):
            for a, b in zip(plain[name], step[name], strict=True):
                assert torch.equal(a, b), name
        for _mean, _var, tracked in plain["buffers"]:
            assert tracked == 4  # torch's way: one update per micro-batch
        assert plain["nodes"] == step["nodes"] == {NODES[path]}  # the step keeps the path
    for i, momentum in enumerate((0.1, 0.3)):
        # every input the layer saw in the step, on every rank (the same on both: the step's
        # statistics are the group's)
        inputs = torch.cat([rank["step"]["seen"][i] for rank in ranks])
        want_mean, want_var = _one_update(inputs, momentum)
        for rank in ranks:
            mean, var, tracked = rank["step"]["buffers"][i]
            assert tracked == 1
            torch.testing.assert_close(mean, want_mean, rtol=0, atol=1e-12)
            torch.testing.assert_close(var, want_var, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# One process: a layer without a group, and forced synchronization (a group of one)
# ------------------------------------------------------------------------------------------------


def _layer(path: str, **options: Any) -> SyncBatchNorm:
    layer = SyncBatchNorm(3, **options).double()
    if path == "reference":
        layer.impl = "ref"
    return layer


def _xs(sizes: tuple[int, ...] = (2, 0, 3, 1)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(n, 3, 4, generator=g, dtype=torch.float64) * 3 - 2 for n in sizes]


@pytest.mark.parametrize("path", ["cpp", "reference"])
@pytest.mark.parametrize("force_sync", [False, True])
def test_one_process_one_update_and_the_same_outputs(force_sync: bool, path: str) -> None:
    xs = _xs()
    outside, inside = _layer(path, force_sync=force_sync), _layer(path, force_sync=force_sync)
    with step_statistics(inside):
        got = [inside(x) for x in xs]
    want = [outside(x) for x in xs]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert int(outside.num_batches_tracked) == 4 and int(inside.num_batches_tracked) == 1
    mean, var = _one_update(torch.cat(xs), 0.1)
    torch.testing.assert_close(inside.running_mean, mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(inside.running_var, var, rtol=0, atol=1e-12)


@pytest.mark.parametrize("force_sync", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_against_the_float64_oracle(dtype: torch.dtype, force_sync: bool) -> None:
    """bf16 / fp16 inputs, float32 parameters and buffers: the statistics accumulate in float32
    or wider, so the step's update is the float64 oracle's of the same (rounded) inputs to
    float32's precision, and the outputs are those without the context."""
    xs = [x.to(dtype) for x in _xs()]
    outside, inside = (SyncBatchNorm(3, force_sync=force_sync) for _ in range(2))
    with step_statistics(inside):
        got = [inside(x) for x in xs]
    for a, x in zip(got, xs, strict=True):
        assert a.dtype == dtype and torch.equal(a, outside(x))
    mean, var = _one_update(torch.cat(xs).double(), 0.1)
    torch.testing.assert_close(inside.running_mean.double(), mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(inside.running_var.double(), var, rtol=1e-6, atol=1e-7)


class _Block(nn.Module):
    """A residual block whose tail (BatchNorm, the shortcut added, ReLU) the converter fuses."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)
        self.conv2, self.bn2 = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_fused_activations_and_residual_tails_merge_as_plain_layers(exchange: str) -> None:
    """SyncBatchNormAct and a fused residual tail go through the same call: the same outputs as
    without the context, and the same one update as the unfused layers inside it."""
    from syncbn_lightning import SyncBatchNormAct

    def nets() -> dict[str, nn.Module]:
        torch.manual_seed(4)
        block = _Block()
        options: dict[str, Any] = {"force_sync": True, "exchange": exchange}
        fused = convert_sync_batchnorm(copy.deepcopy(block), fuse_residual=[_Block], **options)
        assert hasattr(type(fused), FUSED_FROM)  # rewritten: its tail is one fused call
        return {
            "fused": fused,
            "unfused": convert_sync_batchnorm(copy.deepcopy(block), **options),
            "act": nn.Sequential(SyncBatchNormAct(3, **options)),
        }

    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(n, 3, 2, 2, generator=g, dtype=torch.float64) for n in (2, 3, 1)]
    outside, inside = nets(), nets()
    for name in outside:
        outside[name].double(), inside[name].double()
        with step_statistics(inside[name]):
            got = [inside[name](x) for x in xs]
        for a, x in zip(got, xs, strict=True):
            assert torch.equal(a, outside[name](x)), name
        for layer in _sync_layers(inside[name]):
            assert int(layer.num_batches_tracked) == 1, name
    for a, b in zip(_sync_layers(inside["fused"]), _sync_layers(inside["unfused"]), strict=True):
        torch.testing.assert_close(a.running_mean, b.running_mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(a.running_var, b.running_var, rtol=0, atol=1e-12)


def test_the_reduce_exchange_still_shifts_by_the_running_mean() -> None:
    """Its sums are shifted by the running mean: without it (a missing buffer for "no update"),
    data far from zero would lose every digit of the variance to cancellation."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 3, 4, generator=g, dtype=torch.float64) * 1e-2 + 1e6 for n in (3, 2)]
    outside, inside = (_layer("cpp", force_sync=True, exchange="reduce") for _ in range(2))
    for layer in (outside, inside):
        layer.running_mean.fill_(1e6)
    with step_statistics(inside):
        got = [inside(x) for x in xs]
    for a, x in zip(got, xs, strict=True):
        torch.testing.assert_close(a, outside(x), rtol=0, atol=1e-6)
        assert a.std().item() == pytest.approx(1.0, rel=0.2)


@pytest.mark.parametrize("force_sync", [False, True])
def test_momentum_none_and_the_biased_variance(force_sync: bool) -> None:
    xs = _xs()
    layer = _layer("cpp", momentum=None, unbiased_running_var=False, force_sync=force_sync)
    for _ in range(2):  # the cumulative average over steps: 1, then 1/2
        with step_statistics(layer):
            for x in xs:
                layer(x)
    assert int(layer.num_batches_tracked) == 2
    mean, var = _one_update(torch.cat(xs), None, unbiased=False)  # two equal steps
    torch.testing.assert_close(layer.running_mean, mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.running_var, var, rtol=0, atol=1e-12)


def test_a_non_finite_step_updates_nothing_and_is_counted() -> None:
    layer = _layer("cpp", force_sync=True)
    xs = _xs()
    xs[2] = xs[2].clone()
    xs[2][0, 1, 0] = float("nan")
    with step_statistics(layer):
        for x in xs:
            layer(x)
    assert torch.equal(layer.running_mean, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(layer.running_var, torch.ones(3, dtype=torch.float64))
    assert int(layer.num_batches_tracked) == 0 and int(layer.nonfinite_skips()) == 1


def test_an_all_empty_step_and_an_uncalled_layer_leave_the_statistics_alone() -> None:
    called, uncalled = _layer("cpp", force_sync=True), _layer("cpp")
    with step_statistics(nn.ModuleList([called, uncalled])):
        called(torch.zeros(0, 3, 4, dtype=torch.float64))
    for layer in (called, uncalled):
        assert torch.equal(layer.running_mean, torch.zeros(3, dtype=torch.float64))
        assert torch.equal(layer.running_var, torch.ones(3, dtype=torch.float64))
    # an empty group counts as torch's kernels count it (finite: tracked), uncalled not at all
    assert int(called.num_batches_tracked) == 1 and int(uncalled.num_batches_tracked) == 0


def test_eval_calls_and_an_exception_change_nothing() -> None:
    layer = _layer("cpp", force_sync=True)
    layer(_xs()[0])  # some running statistics to keep
    before = [t.clone() for t in layer.buffers()]
    with pytest.raises(KeyError):
        with step_statistics(layer):
            for x in _xs():
                layer(x)
            raise KeyError("a failing micro-batch")
    assert all(torch.equal(a, b) for a, b in zip(before, layer.buffers(), strict=True))
    assert layer._step_stats is None
    layer.eval()
    with step_statistics(layer):
        y = layer(_xs()[0])
    assert all(torch.equal(a, b) for a, b in zip(before, layer.buffers(), strict=True))
    torch.testing.assert_close(
        y, (_xs()[0] - before[0][:, None]) / (before[1][:, None] + layer.eps).sqrt()
    )


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpoint_recompute_adds_nothing(use_reentrant: bool) -> None:
    xs = _xs((3, 2))
    layers = [_layer("cpp", force_sync=True) for _ in range(2)]
    for layer, checkpointed in zip(layers, (False, True), strict=True):
        with step_statistics(layer):
            for x in xs:
                x = x.clone().requires_grad_()
                if checkpointed:
                    y = checkpoint(layer, x, use_reentrant=use_reentrant)
                else:
                    y = layer(x)
                y.pow(2).sum().backward()
    assert torch.equal(layers[0].running_mean, layers[1].running_mean)
    assert torch.equal(layers[0].running_var, layers[1].running_var)
    assert int(layers[1].num_batches_tracked) == 1


def test_precise_bn_inside_a_step_adds_nothing_to_it() -> None:
    """update_bn_stats in an open step (the callback's PreciseBN before a validation that falls
    inside an accumulation): its pass writes the population statistics and leaves the step's
    merge alone, which then updates once from the step's own calls."""
    from syncbn_lightning import update_bn_stats

    xs, others = _xs(), [x * 5 + 7 for x in _xs((4, 4))]
    layer, twin = _layer("cpp", force_sync=True), _layer("cpp", force_sync=True)
    with step_statistics(layer):
        layer(xs[0])
        update_bn_stats(layer, others, num_batches=2)
        assert layer._step_stats is not None
        layer(xs[1])
    update_bn_stats(twin, others, num_batches=2)
    with step_statistics(twin):
        twin(xs[0]), twin(xs[1])
    assert int(layer.num_batches_tracked) == int(twin.num_batches_tracked) == 1
    torch.testing.assert_close(layer.running_mean, twin.running_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.running_var, twin.running_var, rtol=0, atol=1e-12)


def test_pickles_and_copies_leave_the_merge_behind() -> None:
    layer = _layer("cpp", force_sync=True)
    with step_statistics(layer):
        layer(_xs()[0])
        assert layer._step_stats is not None and layer._step_stats.called
        for twin in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
            assert twin._step_stats is None
            twin(_xs()[0])
            assert int(twin.num_batches_tracked) == 1  # outside the step: updated at once
    assert int(layer.num_batches_tracked) == 1


def _step_ops(layers: int) -> tuple[int, int, int]:
    """Dispatcher ops of a step of 4 forward calls of ``layers`` layers (half forced through the
    synchronized call, half plain batch norm: both rules): the calls outside
    ``step_statistics``, the same calls inside it, and the step's own (its entry, and its exit:
    the merge of every pending call and the commit; 4 calls stay pending until the exit)."""
    net = nn.Sequential(*[_layer("cpp", force_sync=i % 2 == 0) for i in range(layers)])
    xs = _xs((2, 1, 3, 2))
    with torch.no_grad():
        with step_statistics(net):  # the first step makes the layers' counters
            for x in xs:
                net(x)
        outside, inside, own = OpCounter(), OpCounter(), OpCounter()
        with outside:
            for x in xs:
                net(x)
        step = step_statistics(net)
        with own:
            step.__enter__()
        with inside:
            for x in xs:
                net(x)
        with own:
            step.__exit__(None, None, None)
    return tuple(sum(c.ops.values()) for c in (outside, inside, own))  # type: ignore[return-value]


def test_the_step_costs_a_fixed_number_of_ops_however_many_layers() -> None:
    # The merge and the commit cover the layers that commit alike together: the step's own ops
    # are as many for 2 layers as for 8, and the calls inside run no more ops than outside.
    (outside_2, inside_2, own_2), (outside_8, inside_8, own_8) = _step_ops(2), _step_ops(8)
    assert own_2 == own_8 > 0, (own_2, own_8)
    assert inside_2 <= outside_2 and inside_8 <= outside_8, (
        inside_2,
        outside_2,
        inside_8,
        outside_8,
    )


@pytest.mark.parametrize("normalize", ["micro", "step"])
def test_the_next_step_takes_the_same_group_again_and_starts_clean(normalize: str) -> None:
    # A step that fails half way leaves its group with pending calls (micro) or written rows
    # (step); the next step of the same layers takes that group again (its entry: 3 ops at
    # most, no new memory) and must start it as new: its update is a fresh twin's.
    layers = [_layer("cpp", force_sync=True), _layer("cpp")]
    net, twin = nn.Sequential(*layers), copy.deepcopy(nn.Sequential(*layers))
    xs = _xs((2, 1, 3, 2))
    with pytest.raises(KeyError):
        with step_statistics(net, normalize=normalize):
            net(xs[0] * 4 + 1), net(xs[1] * 4 + 1)
            first = layers[0]._step_stats.group
            raise KeyError("a failing micro-batch")
    counter = OpCounter()
    step = step_statistics(net, normalize=normalize)
    with counter:
        step.__enter__()
    assert layers[0]._step_stats.group is first
    assert sum(counter.ops.values()) <= 3, counter.ops
    for x in xs:
        net(x)
    step.__exit__(None, None, None)
    with step_statistics(twin, normalize=normalize):
        for x in xs:
            twin(x)
    for got, want in zip(net.buffers(), twin.buffers(), strict=True):
        assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("normalize", ["micro", "step"])
def test_two_models_alike_in_steps_at_once_keep_their_own_merges(normalize: str) -> None:
    # Two models of one kind (a GAN's generator and its copy, say) whose steps overlap: each
    # takes a group of its own, and each updates as it would alone.
    nets = [nn.Sequential(_layer("cpp", force_sync=True), _layer("cpp")) for _ in range(4)]
    xs = _xs((2, 1, 3, 2))
    for net in (nets[0], nets[2]):  # a step before: its group waits, idle, for the next
        with step_statistics(net, normalize=normalize):
            net(xs[2] - 5)
    with step_statistics(nets[0], normalize=normalize):
        with step_statistics(nets[1], normalize=normalize):
            for x in xs:
                nets[0](x), nets[1](x * 3 - 1)
    for net, scale, shift in ((nets[2], 1, 0), (nets[3], 3, -1)):
        with step_statistics(net, normalize=normalize):
            for x in xs:
                net(x * scale + shift)
    for together, alone in ((nets[0], nets[2]), (nets[1], nets[3])):
        for got, want in zip(together.buffers(), alone.buffers(), strict=True):
            assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("normalize", ["micro", "step"])
def test_a_step_under_inference_mode_leaves_the_next_steps_whole(normalize: str) -> None:
    # Tensors made under torch.inference_mode cannot be written outside it: neither the group
    # that step used nor the layer's counters made there may reach the next step.
    layer, twin = _layer("cpp", force_sync=True), _layer("cpp", force_sync=True)
    xs = _xs((2, 3))
    for net, inference in ((layer, True), (twin, False)):
        with torch.inference_mode(inference), step_statistics(net, normalize=normalize):
            net(xs[0])
        with step_statistics(net, normalize=normalize):
            net(xs[1])
    assert int(layer.num_batches_tracked) == 2
    for got, want in zip(layer.buffers(), twin.buffers(), strict=True):
        assert torch.equal(got, want), (got, want)


def test_a_step_that_fails_to_start_leaves_no_layer_inside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two kinds of layers (two groups); the second fails to start: the first group's layers
    # must leave the step, or every later step would refuse them as nested.
    net = nn.Sequential(_layer("cpp", force_sync=True), _layer("cpp", force_sync=True).float())
    original = accumulate.StepGroup.start

    def fails_for_float32(group: Any, buffers: Any) -> None:
        if buffers[0][0].dtype == torch.float32:
            raise MemoryError("no memory for the second group")
        original(group, buffers)

    with monkeypatch.context() as patch:
        patch.setattr(accumulate.StepGroup, "start", fails_for_float32)
        with pytest.raises(MemoryError), step_statistics(net):
            pass
    assert all(layer._step_stats is None for layer in net)
    with step_statistics(net):
        net[0](_xs()[0]), net[1](_xs()[0].float())
    assert [int(layer.num_batches_tracked) for layer in net] == [1, 1]


def test_a_call_or_a_layer_on_another_device_than_the_step_is_refused_by_name() -> None:
    layer = _layer("cpp", force_sync=True)
    with step_statistics(layer):
        group = layer._step_stats.group
        moved = torch.zeros(3, device="meta", dtype=torch.float64)
        info = torch.tensor([2.0], device="meta")
        with pytest.raises(RuntimeError, match=r"ran on meta.*move the model before"):
            group.merge([[("unbiased", info, moved, moved)]])
    # moved inside the step: the commit refuses it rather than update the tensors it left
    with pytest.raises(RuntimeError, match=r"running statistics are on meta.*or after it ends"):
        with step_statistics(layer):
            layer(_xs()[0])
            layer.to("meta")


def compiled_twins(
    force_sync: bool,
) -> tuple[nn.Module, nn.Module, Callable[..., Any], list[torch.Tensor]]:
    """Two equal converted models of two layers (float64), the second also compiled
    (fullgraph; dynamo's caches and counters cleared), and 4 micro-batches."""
    from torch._dynamo.utils import counters

    def model() -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4))
        net = convert_sync_batchnorm(net).double()
        for layer in _sync_layers(net):
            layer.force_sync = force_sync
        return net

    torch._dynamo.reset()
    counters.clear()
    eager, net = model(), model()
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(4)]
    return eager, net, torch.compile(net, fullgraph=True), xs


@pytest.mark.slow
@pytest.mark.usefixtures("inline_modules")
@pytest.mark.parametrize("force_sync", [False, True])
def test_a_compiled_model_counts_and_merges_as_eager_in_one_graph(force_sync: bool) -> None:
    """fullgraph compile, outside then inside the context then outside again: the values and
    counts of the eager model, no graph break, at most 2 recompiles."""
    from torch._dynamo.utils import counters

    eager, net, compiled, xs = compiled_twins(force_sync)
    for run in (eager, compiled):
        run(xs[0]).sum().backward()
        for _ in range(2):
            with step_statistics(run):
                for x in xs:
                    run(x).sum().backward()
        run(xs[1])
    for a, b in zip(_sync_layers(eager), _sync_layers(net), strict=True):
        assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 4
        torch.testing.assert_close(a.running_mean, b.running_mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(a.running_var, b.running_var, rtol=0, atol=1e-12)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] <= 3  # outside, inside, (at most) outside again


# ------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------


def test_nested_contexts_are_refused_and_the_outer_one_still_commits() -> None:
    layer = _layer("cpp", force_sync=True)
    with step_statistics(layer):
        layer(_xs()[0])
        with pytest.raises(RuntimeError, match="do not nest"):
            with step_statistics(nn.Sequential(layer)):
                pass
        assert layer._step_stats is not None
    assert int(layer.num_batches_tracked) == 1


def test_plain_batchnorm_layers_get_one_warning_naming_the_first() -> None:
    model = nn.Sequential(SyncBatchNorm(3), nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    with pytest.warns(UserWarning, match=r"2 BatchNorm layer\(s\).*'1'.*convert_sync_batchnorm"):
        with step_statistics(model):
            model(torch.randn(4, 3))
    assert int(model[0].num_batches_tracked) == 1 and int(model[1].num_batches_tracked) == 1


def test_the_package_root_exports_it() -> None:
    import syncbn_lightning

    assert syncbn_lightning.step_statistics is step_statistics
    assert "step_statistics" in syncbn_lightning.__all__
    assert dist.is_available()
