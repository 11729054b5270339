"""torch.compile of converted models: one graph, no breaks, same numbers as eager.

The layer is four ``syncbn::`` operators and torch's functional collectives inside one
autograd.Function, so dynamo traces a whole model (forward and backward, collectives included)
into one graph. Compiled and eager copies of the same model are trained side by side on real gloo
ranks with uneven batches (one rank empty) and compared step by step. The dispatcher-op count of
one layer's forward + backward is guarded here too.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections import Counter
from typing import Any

import pytest
import torch
from _dist import run_distributed
from _lightning import CompiledBNNet, Probe, load_ranks, single_process_reference, trainer
from _numerics import rel_err
from torch import nn

from benchmarks._common import OpCounter
from syncbn_lightning import SyncBatchNorm, SyncBNCallback, convert_sync_batchnorm, new_sync_group
from syncbn_lightning.distributed.flight import recorder as flight

# inductor compiles on gloo processes: outside the fast check.
# (inline_modules: torch 2.4 compiles a module holding SyncBN whole only with it)
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.usefixtures("inline_modules")]

# Both exchanges, both stats modes, eager CPU (the C++ path): 2 syncbn ops, 3 AccumulateGrad.
MAX_OPS_PER_LAYER = 5


class _Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the identity, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


def resnet_style(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        _Block(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


class _Scale(nn.Module):
    """A learnable per-channel scale (elementwise, so that an empty batch compiles: inductor's
    convolution_backward disagrees with its own meta strides for N = 0, a torch issue unrelated to
    these layers that a plain conv net without any BN hits as well)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, channels).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def bn_stack(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), _Scale(3), nn.BatchNorm2d(3))


MODELS = {"resnet_style": resnet_style, "bn_stack": bn_stack}


def _explain(model: nn.Module, x: torch.Tensor) -> tuple[int, int, list[str]]:
    torch._dynamo.reset()
    result = torch._dynamo.explain(model)(x)
    return (
        result.graph_count,
        result.graph_break_count,
        [str(r.reason) for r in result.break_reasons],
    )


def _train_side_by_side(
    model: nn.Module, x: torch.Tensor, steps: int, backend: str
) -> list[dict[str, float]]:
    """Trains ``model`` and a compiled copy with SGD on the same data; per step, the largest
    relative difference of outputs, input grads, parameter grads and running stats."""
    eager = model
    compiled_inner = copy.deepcopy(model)
    compiled = torch.compile(compiled_inner, backend=backend, fullgraph=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_inner)]
    diffs = []
    for step in range(steps):
        seen = []
        for net, opt in zip((eager, compiled), optimizers, strict=True):
            xi = (x + step).requires_grad_(True)
            opt.zero_grad()
            out = net(xi)
            out.square().sum().backward()
            seen.append((out.detach(), xi.grad))
            opt.step()
        step_diff = {"output": rel_err(seen[0][0], seen[1][0]), "input_grad": 0.0}
        if x.shape[0] > 0:
            step_diff["input_grad"] = rel_err(seen[0][1], seen[1][1])
        # Against at least 1 % of the step's largest gradient: the last BatchNorm's bias
        # gradient, 2 * sum(output), is zero in exact arithmetic on a rank that holds its group's
        # whole batch, and there both sides hold rounding noise of the (growing) outputs' scale.
        floor = 1e-2 * max(float(p.grad.abs().max()) for p in compiled_inner.parameters())
        for (name, a), b in zip(eager.named_parameters(), compiled_inner.parameters(), strict=True):
            scale = max(float(b.grad.abs().max()), floor, 1e-30)
            step_diff[f"grad:{name}"] = float((a.grad - b.grad).abs().max()) / scale
        for (name, a), b in zip(eager.named_buffers(), compiled_inner.buffers(), strict=True):
            if a.is_floating_point():
                step_diff[f"buffer:{name}"] = rel_err(a, b)
            else:
                step_diff[f"buffer:{name}"] = float((a != b).sum())
        diffs.append(step_diff)
    # Eval: running statistics, no communication.
    eager.eval()
    compiled_inner.eval()
    with torch.no_grad():
        diffs.append({"eval_output": rel_err(eager(x + 1), compiled(x + 1))})
    return diffs


BACKENDS = {"ext": "inductor", "ref": "aot_eager"}


def _compile_worker(
    rank: int, world: int, sizes: list[int], group_size: int | None, impls: list[str]
) -> Any:
    """Per implementation: explain of the ResNet-style model, then eager vs compiled training of
    it (empty batches get one sample: see _Scale) and of the BN stack (batches as given)."""
    group = new_sync_group(group_size)
    gen = torch.Generator().manual_seed(100 + rank)
    out: dict[str, Any] = {}
    for impl in impls:
        backend = BACKENDS[impl]
        os.environ["SYNCBN_IMPL"] = impl
        model = convert_sync_batchnorm(resnet_style(), process_group=group)
        out[f"explain:{impl}"] = _explain(copy.deepcopy(model), torch.randn(2, 3, 6, 6))
        for name, build in MODELS.items():
            size = max(sizes[rank], 1) if name == "resnet_style" else sizes[rank]
            x = torch.randn(size, 3, 6, 6, generator=gen) * 2 + 1
            model = convert_sync_batchnorm(build(), process_group=group)
            out[f"steps:{impl}:{name}"] = _train_side_by_side(model, x, 3, backend)
    return out


def _check_compile_results(results: list[Any], impls: list[str]) -> None:
    for rank, result in enumerate(results):
        for impl in impls:
            graphs, breaks, reasons = result[f"explain:{impl}"]
            assert (graphs, breaks) == (1, 0), (rank, impl, reasons)
            for name in MODELS:
                for step, diffs in enumerate(result[f"steps:{impl}:{name}"]):
                    worst = max(diffs, key=diffs.get)
                    assert diffs[worst] <= 1e-5, (rank, impl, name, step, worst, diffs[worst])


@pytest.mark.slow
def test_compiled_matches_eager_on_two_ranks_with_an_empty_batch() -> None:
    impls = ["ext", "ref"]
    results = run_distributed(_compile_worker, 2, [3, 0], None, impls, timeout=600)
    _check_compile_results(results, impls)


@pytest.mark.slow
def test_compiled_matches_eager_with_groups_of_two_in_a_world_of_four() -> None:
    # The extension only: the reference compiles the same way on two ranks (above).
    results = run_distributed(_compile_worker, 4, [2, 0, 3, 1], 2, ["ext"], timeout=900)
    _check_compile_results(results, ["ext"])


def test_explain_one_graph_without_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    for impl in ("ext", "ref"):
        monkeypatch.setenv("SYNCBN_IMPL", impl)
        model = convert_sync_batchnorm(resnet_style(), force_sync=True)
        graphs, breaks, reasons = _explain(model, torch.randn(4, 3, 6, 6))
        assert (graphs, breaks) == (1, 0), (impl, reasons)


@pytest.mark.parametrize("normalize", [None, "step"])
def test_chained_layers_compiled_whole_give_every_gradient_eager_gives(
    normalize: str | None,
) -> None:
    """Two synchronized layers in one compiled graph, the second on the first's output: the
    input's and every parameter's gradient as eager (on torch 2.4 the trace read the second's
    ``needs_input_grad`` as False: the first layer's input got zeros); outside a step and inside
    ``step_statistics(normalize="step")`` over 2 micro-batches."""
    from syncbn_lightning import step_statistics

    torch.manual_seed(0)
    net = nn.Sequential(
        SyncBatchNorm(4, force_sync=True), nn.ReLU(), SyncBatchNorm(4, force_sync=True)
    )
    eager, twin = net.double(), copy.deepcopy(net).double()
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 4, 3, 3, dtype=torch.float64, generator=g) for _ in range(2)]
    weights = torch.randn(2, 4, 3, 3, dtype=torch.float64, generator=g)  # not BN's invariant sum
    grads = []
    for run, model in ((eager, eager), (compiled, twin)):
        context = (
            step_statistics(run, normalize=normalize) if normalize else contextlib.nullcontext()
        )
        inputs = [x.clone().requires_grad_() for x in xs]
        with context:
            for x in inputs:
                (run(x) * weights).sum().backward()
        grads.append([x.grad for x in inputs] + [p.grad for p in model.parameters()])
    assert grads[0][0].abs().max() > 0.1  # (the case has a gradient to lose)
    # Eager took the C++ path, the compiled twin the Python Function (all compiled code does).
    assert all(layer._sync_plan.native for layer in eager if isinstance(layer, SyncBatchNorm))
    for ours, theirs in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def _call_order_worker(rank: int, world: int) -> str:
    layers = nn.ModuleDict({"a": SyncBatchNorm(4), "b": SyncBatchNorm(4)})
    for name, layer in layers.items():
        layer.set_sync_name(name)
    # Rank 1 skips layer "a": the first collective pairs a (rank 0) with b (rank 1).
    run = torch.compile(
        lambda x: layers["b"](layers["a"](x) if rank == 0 else x),
        backend="aot_eager",
        fullgraph=True,
    )
    try:
        run(torch.randn(2, 4, 3))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_compiled_call_order_mismatch_raises_on_every_rank() -> None:
    for message in run_distributed(_call_order_worker, 2, timeout=300):
        assert "syncbn call order" in message and "layer tag" in message, message


def _backward_order_worker(rank: int, world: int) -> str:
    """Compiled forward and backward; rank 1's loss leaves layer "aux" out, so its backward (and
    collective) runs on rank 0 only: the backward's tags meet another layer's on rank 1."""
    layers = nn.ModuleDict({"body": SyncBatchNorm(4), "aux": SyncBatchNorm(4)})
    for name, layer in layers.items():
        layer.set_sync_name(name)

    def loss(x: torch.Tensor) -> torch.Tensor:
        out, aux = layers["body"](x).square().mean(), layers["aux"](x * 2).square().mean()
        return out + aux if rank == 0 else out  # both forwards run everywhere

    run = torch.compile(loss, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 4, 3, requires_grad=True)
    try:
        run(x).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_compiled_backward_order_mismatch_raises_the_kernels_error_on_every_rank() -> None:
    """In compiled code the backward's check is the kernel's RuntimeError, on every rank, at the
    first backward collective that pairs different layers (equal channel counts)."""
    for message in run_distributed(_backward_order_worker, 2, timeout=300):
        assert "syncbn call order: backward" in message, message


def _op_count_worker(rank: int, world: int) -> dict[str, Counter[str]]:
    counts = {}
    for exchange in ("gather", "reduce"):
        for stats_mode in ("N", "default"):
            for impl in ("ext", "ref"):
                os.environ["SYNCBN_IMPL"] = impl
                layer = SyncBatchNorm(8, force_sync=True, exchange=exchange, stats_mode=stats_mode)
                x = torch.randn(2, 8, 4, 4, requires_grad=True)
                grad = torch.ones_like(x)
                layer(x).backward(grad)  # builds the extension, creates .grad
                recorded = len(flight.current_recorder().records())
                with OpCounter() as counter:
                    layer(x).backward(grad)
                # The C++ path's collectives run inside its operators, below the dispatch mode:
                # counted by what the flight recorder recorded (every collective is recorded).
                counter.ops["recorded collectives"] = (
                    len(flight.current_recorder().records()) - recorded
                )
                counts[f"{exchange}:{stats_mode}:{impl}"] = counter.ops
    return counts


def _collectives(ops: Counter[str]) -> dict[str, int]:
    """The collective operators among ``ops``: the process group's (``c10d.*``, eager calls) and
    the functional ones (``_c10d_functional.*``, their waits left out)."""
    return {
        k: v
        for k, v in ops.items()
        if k.startswith("c10d.") or (k.startswith("_c10d_functional.") and "wait" not in k)
    }


@pytest.mark.parametrize("stats_mode", ["N", "default"])
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_dispatcher_ops_per_layer_forward_and_backward(exchange: str, stats_mode: str) -> None:
    (counts,) = run_distributed(_op_count_worker, 1)
    ext = counts[f"{exchange}:{stats_mode}:ext"]
    # Eager CPU layers take the C++ path: one operator per direction (its steps and collective
    # inside), and AccumulateGrad's add_ of the three gradients.
    assert ext.pop("recorded collectives") == 2, ext
    assert ext == {
        "syncbn.sync_batch_norm_forward.default": 1,
        "syncbn.sync_batch_norm_backward.default": 1,
        "aten.add_.Tensor": 3,
    }, ext
    assert sum(ext.values()) <= MAX_OPS_PER_LAYER, ext
    # The reference is the oracle, not the fast path, but it communicates the same way.
    ref = counts[f"{exchange}:{stats_mode}:ref"]
    assert ref.pop("recorded collectives") == 2, ref
    assert sum(_collectives(ref).values()) == 2, ref


def test_compiled_lightning_module_trains_on_two_ranks(tmp_path) -> None:
    steps = 3
    out = tmp_path / "compiled"
    out.mkdir()
    trainer(2, [SyncBNCallback(log_every_n_steps=1), Probe(str(out))], max_steps=steps).fit(
        CompiledBNNet(batch_size=2)
    )
    ranks = load_ranks(str(out), 2)
    # CompiledBNNet keeps the network under torch.compile's wrapper: `net._orig_mod.<name>`.
    net = single_process_reference(steps, per_rank=2, world=2)
    reference = {f"net._orig_mod.{k}": v for k, v in net.state_dict().items()}
    for rank, got in enumerate(ranks):
        assert got["sync_layers"] == 2
        for key, value in reference.items():
            if key.endswith("num_batches_tracked"):
                assert int(got["state"][key]) == steps
            else:
                assert rel_err(got["state"][key], value) <= 1e-5, (rank, key)
