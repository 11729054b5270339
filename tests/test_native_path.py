"""The C++ path of a synchronized layer call (``csrc/layer/layer.cpp``,
``functional/layer_call.py``).

* Which calls take it (eager CPU tensors, the extension's kernels, a built-in exchange) and which
  keep the Python Function (the reference twin, a custom exchange, code being compiled).
* Its backward runs no Python function of the package (``sys.setprofile`` around
  ``backward()``; the same probe sees the Python path's frames, so it can fail), and its forward
  runs only the few Python functions that pick the path.
* One dispatcher call per direction (its collective inside it; deterministic budgets).
* Bitwise equal to the Python path on 2 gloo ranks with uneven and empty batches, both exchanges,
  with a fused residual; the flight records of both paths share one sequence per group.
* Every setting reaches the C++ layer (one argument list in ``layer_node.h``): each changed
  setting changes what it governs, on both paths alike.
* Its plan follows the layer: new options, a new group, ``SYNCBN_IMPL``; pickles and deep copies
  leave it behind; ``create_graph`` refuses a second derivative; the operators pass ``opcheck``.
"""

from __future__ import annotations

import copy
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_distributed
from _package_calls import PLAN_CALLS, package_calls
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import syncbn_lightning
from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm
from syncbn_lightning.distributed.flight import recorder as flight
from syncbn_lightning.functional.layer_call import forward_function

PACKAGE = str(Path(syncbn_lightning.__file__).resolve().parent)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _residual_net() -> nn.Module:
    """conv-BN-ReLU, a torchvision-style block whose tail is fused, and a head."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(self.bn(self.conv(x)) + x)

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(), Block(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 2),
    )  # fmt: skip
    return convert_sync_batchnorm(net, force_sync=True, fuse_residual=[Block])


@pytest.mark.parametrize("group", ["none", "one_rank"])
def test_the_backward_runs_no_python_of_the_package(request, group: str) -> None:
    if group == "one_rank":
        request.getfixturevalue("one_rank")
    net = _residual_net()
    x = torch.randn(4, 3, 8, 8, requires_grad=True)
    loss = net(x).square().sum()
    assert package_calls(loss.backward) == []
    assert x.grad is not None and net[1].weight.grad is not None
    # The probe sees the Python path's backward (the reference twin's Function).
    for layer in net.modules():
        if isinstance(layer, SyncBatchNorm):
            layer.impl = "reference"
    loss = net(x).square().sum()
    assert any("function.py:backward" in c for c in package_calls(loss.backward))


def test_a_forward_runs_only_the_python_that_picks_the_path(one_rank) -> None:
    layer = SyncBatchNorm(4, force_sync=True)
    x = torch.randn(3, 4, 5)
    layer(x)  # the plan is made once
    calls = package_calls(lambda: layer(x))
    assert set(calls) <= PLAN_CALLS, calls
    assert len(calls) == len(PLAN_CALLS), calls  # each once


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_one_dispatcher_call_and_one_collective_per_direction(one_rank, exchange: str) -> None:
    layer = SyncBatchNorm(4, force_sync=True, exchange=exchange)
    x = torch.randn(3, 4, 5, requires_grad=True)
    layer(x).sum().backward()
    with _Ops() as forward:
        y = layer(x)
    with _Ops() as backward:
        y.sum().backward()
    # The collectives run inside the operators (below the Python dispatch key): one call each.
    assert forward.ops == {"syncbn.sync_batch_norm_forward.default": 1}
    assert backward.ops.pop("syncbn.sync_batch_norm_backward.default") == 1
    # The loss's own ops, and AccumulateGrad's add_ of the input's, weight's and bias's grads.
    rest = {"aten.sum.default", "aten.ones_like.default", "aten.expand.default", "aten.add_.Tensor"}
    assert set(backward.ops) <= rest, backward.ops


def test_which_calls_take_the_cpp_path(one_rank) -> None:
    x = torch.randn(3, 4, 5)
    native = SyncBatchNorm(4, force_sync=True)
    native(x)
    assert native._sync_plan.native
    reference = SyncBatchNorm(4, force_sync=True, impl="reference")
    reference(x)
    assert not reference._sync_plan.native
    local = SyncBatchNorm(4)  # a group of one rank without force_sync: plain BatchNorm
    local(x)
    assert not local._sync_plan.native
    native.eval()
    with _Ops() as seen:
        native(x)
    assert not [op for op in seen.ops if op.startswith("syncbn")]  # eval: running statistics


BAD_INPUTS = {
    "channels": lambda: torch.randn(2, 5, 3),
    "integer": lambda: torch.ones(2, 4, 3, dtype=torch.int64),
    "dtype": lambda: torch.randn(2, 4, 3, dtype=torch.float64),
    "one_dim": lambda: torch.randn(4),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
@pytest.mark.parametrize("affine", [True, False])
def test_the_cpp_path_refuses_bad_input_as_the_python_checks_do(one_rank, bad, affine) -> None:
    """The same exception type and message (docs/errors.md's rows) from the C++ path's checks
    as from the Python path's (a layer that does not synchronize checks in Python)."""
    native = SyncBatchNorm(4, force_sync=True, affine=affine)
    native(torch.randn(2, 4, 3))
    assert native._sync_plan.native
    errors = []
    for layer in (SyncBatchNorm(4, affine=affine), native):
        with pytest.raises((TypeError, ValueError)) as caught:
            layer(BAD_INPUTS[bad]())
        errors.append((type(caught.value), str(caught.value).splitlines()[0]))
    assert errors[0] == errors[1]


def test_the_plan_follows_the_layer(one_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    layer, plain = SyncBatchNorm(4, force_sync=True), nn.BatchNorm2d(4)
    x = torch.randn(3, 4, 2, 2)
    layer(x), plain(x)
    first = layer._sync_plan
    layer.momentum = plain.momentum = 0.5  # new options: a new plan
    layer(x), plain(x)
    assert layer._sync_plan is not first
    torch.testing.assert_close(layer.running_mean, plain.running_mean)
    torch.testing.assert_close(layer.running_var, plain.running_var)
    monkeypatch.setenv("SYNCBN_IMPL", "ref")  # the environment, read at each call
    layer(x)
    assert not layer._sync_plan.native
    monkeypatch.setenv("SYNCBN_IMPL", "ext")
    layer.process_group = dist.new_group([0])
    layer(x)
    assert layer._sync_plan.native and layer._sync_plan.process_group is layer.process_group


def test_pickles_and_copies_leave_the_plan_behind(one_rank) -> None:
    layer = SyncBatchNorm(4, force_sync=True)
    x = torch.randn(3, 4, 5)
    layer(x)
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert copied._sync_plan is None
        copied(x)
        assert copied._sync_plan.native


def test_create_graph_gives_first_grads_and_refuses_a_second(one_rank) -> None:
    layer = SyncBatchNorm(3, force_sync=True).double()
    x = (torch.randn(4, 3, 5, dtype=torch.float64) * 2).requires_grad_(True)
    y = layer(x)
    assert y.grad_fn.name() == "syncbn::SyncBatchNormBackward"
    gx, gw = torch.autograd.grad(y.pow(3).sum(), (x, layer.weight), create_graph=True)
    plain = F.batch_norm(x, None, None, layer.weight, layer.bias, training=True, eps=1e-5)
    ex, ew = torch.autograd.grad(plain.pow(3).sum(), (x, layer.weight))
    torch.testing.assert_close(gx, ex, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, ew, rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


def test_the_node_saves_through_hooks_and_records_only_when_needed(one_rank) -> None:
    """The layer's node (``layer_node.h``: made as torch's operators make theirs) saves its
    tensors through ``saved_tensors_hooks`` (what activation checkpointing and CPU offload
    rely on), is made only where a gradient is wanted, frees its tensors after a backward, and
    refuses forward-mode AD with the layer's message."""
    layer = SyncBatchNorm(3, force_sync=True).double()
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    residual = torch.randn_like(x, requires_grad=True)
    packed, unpacked = [], []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = layer.add_act(x, residual)
    assert y.grad_fn.name() == "syncbn::SyncBatchNormBackward"
    assert any(t is x for t in packed) and any(t is residual for t in packed), len(packed)
    dy = torch.randn_like(y)
    gx, gr, gw = torch.autograd.grad(y, (x, residual, layer.weight), dy)
    assert len(unpacked) == len(packed)
    plain = F.batch_norm(x, None, None, layer.weight, layer.bias, training=True) + residual
    ex, er, ew = torch.autograd.grad(plain, (x, residual, layer.weight), dy)
    for got, want in ((gx, ex), (gr, er), (gw, ew)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(y, x, dy)
    with torch.no_grad():
        assert layer(x).grad_fn is None
    frozen = SyncBatchNorm(3, force_sync=True, affine=False).double()
    assert frozen(x.detach()).grad_fn is None
    from torch.autograd import forward_ad

    with forward_ad.dual_level(), pytest.raises(RuntimeError, match="no forward-mode derivative"):
        layer(forward_ad.make_dual(x.detach(), torch.ones_like(x)))


def test_inference_mode_runs_the_forward_alone() -> None:
    layer = SyncBatchNorm(3, force_sync=True)
    x = torch.randn(4, 3, 5)
    with torch.inference_mode():
        y = layer(x)
    torch.testing.assert_close(y, F.batch_norm(x, None, None, training=True))


def test_the_operators_pass_opcheck() -> None:
    from syncbn_lightning.ops.build import load_extension

    load_extension()
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    weight, bias = torch.rand(4, dtype=torch.float64) + 0.5, torch.randn(4, dtype=torch.float64)
    state = [torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)]
    counters = [torch.zeros(1, dtype=torch.long) for _ in range(3)]
    group = {"group": None, "world_size": 1, "layer_tag": 7, "queue_order_flags": False}
    settings = {
        **group,
        "reduce": False,
        "momentum": 0.1,
        "eps": 1e-5,
        "unbiased": True,
        "equal_rank_weights": False,
        "num_features": 4,
    }
    # The call's tensors, its activation, then its kind: no kept statistics, none to keep, no
    # earlier statistics of a step.
    args = (x, weight, bias, *state, *counters, None, 0, 0.0, None, -1, False, None)
    keeping = (*args[:-2], True, None)  # a checkpoint's forward: it returns what it keeps
    # Inside step_statistics(normalize="step"): a prior row, which the call overwrites.
    prior = torch.cat([torch.tensor([5.0, 2.0, 0.0, 0.0]), torch.randn(8), torch.rand(4)])
    stepwise = (*args[:-1], prior.double())
    calls = [("sync_batch_norm", args), ("sync_batch_norm_forward", args)]
    for name, call in [*calls, ("sync_batch_norm", keeping), ("sync_batch_norm", stepwise)]:
        torch.library.opcheck(
            getattr(torch.ops.syncbn, name).default,
            call,
            settings,
            test_utils=("test_schema", "test_faketensor"),
        )
    out = torch.ops.syncbn.sync_batch_norm_forward.default(*args, **settings)
    backward = (torch.randn_like(x), x, weight, bias, None, out[1], out[4], out[5], out[6])
    torch.library.opcheck(
        torch.ops.syncbn.sync_batch_norm_backward.default,
        backward,
        {**group, "act": 0, "act_param": 0.0, "flight_call": -1, "input_grad": True},
        test_utils=("test_schema", "test_faketensor"),
    )
    # A checkpoint's recompute: the same operator with what the forward kept (and its flight
    # number), nothing to update (no running statistics, a copy of the counter), and the
    # normalize step it runs.
    kept = torch.ops.syncbn.sync_batch_norm.default(*keeping, **settings)[4]
    recompute = (x, weight, bias, None, None, None, None, counters[0].clone(), None, 0, 0.0)
    torch.library.opcheck(
        torch.ops.syncbn.sync_batch_norm.default,
        (*recompute, kept, -1, False, None),
        settings,
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    torch.library.opcheck(
        torch.ops.syncbn.renormalize.default,
        (x, out[1], out[4], out[5], weight, bias),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


# ------------------------------------------------------------------------------------------------
# Several ranks: bitwise the Python path's results, one flight sequence
# ------------------------------------------------------------------------------------------------


def _paths_rank(rank: int, world: int, sizes: list[int], exchange: str) -> dict[str, Any]:
    """One layer call of each path on this rank's part of the same data (float32, a fused
    residual and ReLU), then every record of the flight recorder."""
    g = torch.Generator().manual_seed(11)
    total = sum(sizes)
    x_all = torch.randn(total, 5, 4, 3, generator=g) * 3 + 1
    r_all, dy_all = (
        torch.randn(total, 5, 4, 3, generator=g),
        torch.randn(total, 5, 4, 3, generator=g),
    )
    part = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out: dict[str, Any] = {}
    for path in ("cpp", "python"):
        layer = SyncBatchNorm(5, exchange=exchange)
        layer.set_sync_name("layer")
        x, r = x_all[part].clone().requires_grad_(), r_all[part].clone().requires_grad_()
        if path == "cpp":
            y = layer.add_act(x, r, nn.ReLU())
            assert layer._sync_plan is not None and layer._sync_plan.native
        else:
            world_size = dist.get_world_size()
            y, _ = forward_function(layer, x, world_size, (1, 0.0), r)
        grads = torch.autograd.grad(y, (x, r, layer.weight, layer.bias), dy_all[part])
        out[path] = [y.detach(), *grads, layer.running_mean.clone(), layer.running_var.clone()]
    recorder = flight.current_recorder()
    out["records"] = [
        (r.group, r.seq, r.direction, r.layer_tag, r.call) for r in recorder.records()
    ]
    return out


# Each variation of the layer's settings, and what it must change against the defaults: a
# setting that reached the C++ layer in another argument's place would change something else, or
# nothing, and differ from the Python path (which reads each by name).
SETTINGS: dict[str, tuple[dict[str, Any], str]] = {
    "unbiased_running_var=False": ({"unbiased_running_var": False}, "running_var"),
    "momentum=0.7": ({"momentum": 0.7}, "running_mean"),
    "momentum=None": ({"momentum": None}, "running_mean"),
    "eps=0.5": ({"eps": 0.5}, "output"),
    "stats_mode='default'": ({"stats_mode": "default"}, "output"),
    "exchange='reduce'": ({"exchange": "reduce"}, "ops"),
}
_RESULTS = ("output", "grad_input", "grad_weight", "running_mean", "running_var")


def _settings_rank(rank: int, world: int, sizes: list[int]) -> dict[str, dict[str, Any]]:
    """One training call and its backward per variation of :data:`SETTINGS` (and the defaults),
    on each path, on this rank's part of the same data: the results of ``_RESULTS`` and the
    collectives the flight recorder saw (op, direction, bytes)."""
    g = torch.Generator().manual_seed(5)
    x_all = torch.randn(sum(sizes), 3, 4, generator=g) * 2 + 1
    dy_all = torch.randn(sum(sizes), 3, 4, generator=g)
    part = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out: dict[str, dict[str, Any]] = {}
    for name, (options, _) in {"defaults": ({}, ""), **SETTINGS}.items():
        for path in ("cpp", "python"):
            layer = SyncBatchNorm(3, **options)
            layer.set_sync_name("layer")
            x = x_all[part].clone().requires_grad_()
            before = flight.current_recorder()
            seen = len(before.records()) if before is not None else 0
            if path == "cpp":
                y = layer(x)
                assert layer._sync_plan is not None and layer._sync_plan.native, name
            else:
                y, _ = forward_function(layer, x, world, None, None)
            grads = torch.autograd.grad(y, (x, layer.weight), dy_all[part])
            recorder = flight.current_recorder()
            assert recorder is not None
            ops = [(r.op, r.direction, r.nbytes) for r in recorder.records()[seen:]]
            values = (y.detach(), *grads, layer.running_mean.clone(), layer.running_var.clone())
            out[f"{name} {path}"] = {**dict(zip(_RESULTS, values, strict=True)), "ops": ops}
    return out


@pytest.mark.distributed
def test_every_setting_reaches_the_cpp_layer_and_does_what_the_python_path_does() -> None:
    """Each changed setting changes what it governs against the defaults, and the C++ path
    computes bitwise what the Python path computes with it (2 uneven ranks)."""
    for result in run_distributed(_settings_rank, 2, [3, 1], timeout=120.0):
        for name in ("defaults", *SETTINGS):
            cpp, python = result[f"{name} cpp"], result[f"{name} python"]
            assert cpp["ops"] == python["ops"], name
            for key in _RESULTS:
                assert torch.equal(cpp[key], python[key]), (name, key)
        defaults = result["defaults cpp"]
        for name, (_, changes) in SETTINGS.items():
            got, want = result[f"{name} cpp"][changes], defaults[changes]
            same = got == want if changes == "ops" else torch.equal(got, want)
            assert not same, (name, changes)


@pytest.mark.distributed
@pytest.mark.parametrize(("sizes", "exchange"), [([3, 1], "gather"), ([2, 0, 3], "reduce")])
def test_the_cpp_path_equals_the_python_path_bitwise(sizes: list[int], exchange: str) -> None:
    ranks = run_distributed(_paths_rank, len(sizes), sizes, exchange, timeout=120.0)
    for rank in ranks:
        for cpp, python in zip(rank["cpp"], rank["python"], strict=True):
            assert torch.equal(cpp, python)
        records = rank["records"]
        by_group: dict[str, list[int]] = {}
        for group, seq, *_ in records:
            by_group.setdefault(group, []).append(seq)
        assert all(seqs == list(range(len(seqs))) for seqs in by_group.values()), records
        calls = [(direction, call) for _g, _s, direction, _tag, call in records]
        assert calls == [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]


def _all_reduced_rank(rank: int, world: int, sizes: list[int], exchange: str) -> dict[str, Any]:
    """:func:`_paths_rank` with the sums all-reduced (the branch CUDA groups take), and the
    collectives each direction issued on the C++ path; then the same calls all-gathered."""
    from syncbn_lightning.distributed.collectives import gather_sums_up_to
    from syncbn_lightning.ops import build

    build.load_extension()
    with gather_sums_up_to(0):
        reduced = _paths_rank(rank, world, sizes, exchange)
    reduced["ops"] = [(r.direction, r.op) for r in flight.current_recorder().records()]
    gathered = _paths_rank(rank, world, sizes, exchange)
    return {"reduced": reduced, "gathered": gathered["cpp"]}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_the_all_reduce_branch_of_cpu_groups_runs_under_the_test_switch(exchange: str) -> None:
    """``gather_sums_up_to(0)``: a CPU group all-reduces its sums as CUDA groups do
    (``layer_comm.cpp``'s other branch): the flight records say so, both paths stay bitwise
    equal, and the results are the gathered ones up to the summation order."""
    for rank in run_distributed(_all_reduced_rank, 2, [3, 1], exchange, timeout=120.0):
        reduced = rank["reduced"]
        forward = "all_reduce" if exchange == "reduce" else "all_gather"
        assert reduced["ops"] == [
            ("forward", forward), ("backward", "all_reduce")
        ] * 2, reduced["ops"]  # fmt: skip
        for cpp, python in zip(reduced["cpp"], reduced["python"], strict=True):
            assert torch.equal(cpp, python)
        for got, want in zip(reduced["cpp"], rank["gathered"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
