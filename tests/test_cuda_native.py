"""CUDA layers on the C++ path (``SYNCBN_NATIVE_CUDA=1``): ``syncbn::sync_batch_norm`` with the
CUDA step kernels, one orchestration with the CPU's (``csrc/layer/layer.cpp``), on a GPU.

Run by ``benchmarks/gpu_check.sh native`` (with the other GPU test files under
``SYNCBN_NATIVE_CUDA=1``); skipped without a CUDA device. Each test asserts the path it names
(the plan's ``native``, the output's C++ autograd node):

* the C++ path equals the Python Function on the same GPU, bitwise, for both exchanges, fp32,
  fp16, bf16, NCHW and channels_last, a fused residual tail, an empty batch;
* eager train steps issue no host sync (``set_sync_debug_mode("error")``);
* a CUDA graph (captured through the Python path, whose functional collectives capture on NCCL
  needs) of synchronized layers alone replays bitwise what the C++ path computes eagerly
  (outputs, gradients, buffers); a graph of a whole train step (conv, linear, cross-entropy, SGD;
  cuDNN deterministic) replays it within a stated tolerance (cuBLAS and cuDNN may pick other
  algorithms inside a capture);
* a rank that skips a layer is found before the step's last call, without a sync (2 gloo ranks
  sharing the GPU);
* ``torch.compile(fullgraph=True)`` traces a converted model in one graph;
* a user's mistakes, and a wrong call of the CUDA kernels, are Python exceptions (in a process
  of its own: the GPU image's extension once crashed formatting a number).

The one-rank NCCL group is made once per module (each group costs NCCL's setup); a test sets
``SYNCBN_NATIVE_CUDA`` itself, read when a layer makes its plan.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from _convert_models import residual_net
from _dist import run_distributed
from _host_sync import run_without_host_sync
from _numerics import assert_one_graph_and_compiled_matches_eager
from torch import nn

from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm
from syncbn_lightning.ops import build as ops_build

pytestmark = pytest.mark.gpu
_NATIVE = "syncbn::SyncBatchNormBackward"


@pytest.fixture(scope="module")
def one_rank_nccl() -> Iterator[None]:
    """A one-rank NCCL default group for the module's tests, with the extension's kernels."""
    assert ops_build.load_extension().with_cuda
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SYNCBN_IMPL", "ext")
        store = os.path.join(tempfile.mkdtemp(prefix="syncbn_store_"), "store")
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _call(layer: SyncBatchNorm, x: torch.Tensor, r: torch.Tensor | None, dy: torch.Tensor):
    x = x.clone().requires_grad_()
    if r is None:
        y = layer(x)
        leaves = [x, layer.weight, layer.bias]
    else:
        r = r.clone().requires_grad_()
        y = layer.add_act(x, r, nn.ReLU())
        leaves = [x, r, layer.weight, layer.bias]
    node = y.grad_fn.name()
    grads = torch.autograd.grad(y, leaves, dy)
    return node, [y.detach(), *grads, layer.running_mean.clone(), layer.running_var.clone()]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("batch", [5, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_the_cpp_path_equals_the_python_path_on_cuda(
    one_rank_nccl, monkeypatch, exchange, channels_last, dtype, batch, residual
) -> None:
    memory = torch.channels_last if channels_last else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(3)
    shape = (batch, 8, 6, 5)
    x = (torch.randn(shape, device="cuda", generator=g) * 2 + 1).to(dtype)
    r = torch.randn(shape, device="cuda", generator=g).to(dtype) if residual else None
    dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
    x, dy = x.contiguous(memory_format=memory), dy.contiguous(memory_format=memory)
    r = None if r is None else r.contiguous(memory_format=memory)
    results = {}
    for native in ("1", "0"):
        monkeypatch.setenv("SYNCBN_NATIVE_CUDA", native)
        torch.manual_seed(0)
        layer = SyncBatchNorm(8, force_sync=True, exchange=exchange).cuda()
        node, values = _call(layer, x, r, dy)
        assert layer._sync_plan.native is (native == "1")
        assert node.startswith(_NATIVE) is (native == "1"), node
        results[native] = values
    for cpp, python in zip(results["1"], results["0"], strict=True):
        assert torch.equal(cpp, python)


def _converted(fuse: bool, exchange: str = "auto") -> nn.Module:
    net = residual_net()
    named = [type(net[3])] if fuse else False
    model = convert_sync_batchnorm(net, exchange=exchange, fuse_residual=named).cuda().train()
    for layer in model.modules():
        if isinstance(layer, SyncBatchNorm):
            layer.force_sync = True
    return model


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_eager_steps_on_the_cpp_path_never_sync_the_host(
    one_rank_nccl, monkeypatch, exchange, fuse
) -> None:
    monkeypatch.setenv("SYNCBN_NATIVE_CUDA", "1")
    model = _converted(fuse, exchange).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(4, 3, 16, 16, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (4,), device="cuda")

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        nn.functional.cross_entropy(out, y).backward()
        optimizer.step()
        return out

    out = step()
    assert out.grad_fn is not None
    assert all(m._sync_plan.native for m in model.modules() if isinstance(m, SyncBatchNorm))
    run_without_host_sync(step)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _captured(step, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """``step`` captured in a CUDA graph after ``warmup`` eager runs on a side stream (the
    capture runs no step: a replay does)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


class _SyncLayers(nn.Module):
    """Synchronized layers alone (every op elementwise or SyncBN's): a fused residual tail after
    a layer and a ReLU, so nothing in a step may pick another algorithm inside a capture."""

    def __init__(self) -> None:
        super().__init__()
        self.a = SyncBatchNorm(8, force_sync=True)
        self.b = SyncBatchNorm(8, force_sync=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b.add_act(torch.relu(self.a(x)), x, nn.ReLU())


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
def test_a_graph_of_synchronized_layers_replays_eager_bitwise(
    one_rank_nccl, monkeypatch, channels_last
) -> None:
    """One copy stepped eagerly on the C++ path, one by replaying its captured step (the Python
    path): outputs, the input's and parameters' gradients and every buffer bitwise equal."""
    monkeypatch.setenv("SYNCBN_NATIVE_CUDA", "1")
    memory = torch.channels_last if channels_last else torch.contiguous_format
    eager = _SyncLayers().cuda()
    graphed = copy.deepcopy(eager)
    g = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(4, 8, 6, 5, device="cuda", generator=g) * 2 + 1).contiguous(
        memory_format=memory
    )
    dy = torch.randn(4, 8, 6, 5, device="cuda", generator=g).contiguous(memory_format=memory)
    static_x = x.clone().requires_grad_()

    def run(model: nn.Module, inp: torch.Tensor) -> list[torch.Tensor]:
        out = model(inp)
        grads = torch.autograd.grad(out, [inp, *model.parameters()], dy)
        return [out.detach(), *grads]

    outputs: list[torch.Tensor] = []
    graph = _captured(lambda: outputs.__setitem__(slice(None), run(graphed, static_x)))
    for _ in range(3):  # the warm-up's 3 steps first, then two steps compared after each
        expected = run(eager, x.clone().requires_grad_())
    for _ in range(2):
        expected = run(eager, x.clone().requires_grad_())
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs, expected, strict=True):
            assert torch.equal(got, want)
    assert all(m._sync_plan.native for m in (eager.a, eager.b))
    for a, b in zip(eager.state_dict().values(), graphed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


#: The whole step's tolerance: conv and linear may take other cuBLAS/cuDNN algorithms inside a
#: capture (another workspace), which changes float32 results in the last bits.
STEP_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_a_graph_of_a_train_step_replays_what_eager_computes(one_rank_nccl, monkeypatch, fuse):
    """Two copies of one model: one stepped eagerly on the C++ path, one by replaying a captured
    step (after the same warm-up steps): losses, parameters and buffers equal within
    :data:`STEP_TOLERANCE`, cuDNN deterministic."""
    monkeypatch.setenv("SYNCBN_NATIVE_CUDA", "1")
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    eager = _converted(fuse)
    graphed = copy.deepcopy(eager)
    x = torch.randn(4, 3, 16, 16, device="cuda")
    y = torch.randint(0, 10, (4,), device="cuda")

    def make_step(model: nn.Module):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=False)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            return loss

        return step

    eager_step, graph_step = make_step(eager), make_step(graphed)
    losses: list[torch.Tensor] = []
    graph = _captured(lambda: losses.append(graph_step()))
    static_loss = losses[-1]
    for _ in range(3):  # the warm-up's steps, eagerly
        eager_step()
    for _ in range(2):
        loss = eager_step()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_loss, loss, **STEP_TOLERANCE)
    assert all(m._sync_plan.native for m in eager.modules() if isinstance(m, SyncBatchNorm))
    for a, b in zip(eager.state_dict().values(), graphed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, **STEP_TOLERANCE)


def test_compiled_converted_model_is_one_graph(one_rank_nccl, monkeypatch) -> None:
    monkeypatch.setenv("SYNCBN_NATIVE_CUDA", "1")
    assert_one_graph_and_compiled_matches_eager(_converted(False), torch.randn(4, 3, 8, 8).cuda())


def _skipped_layer_worker(rank: int, world: int) -> tuple[str, int, int, bool]:
    """Two forward steps where rank 1 skips `mid`, the flags read only at later calls (no
    check_call_order here): returns the error, the (step, call) it was raised at, and whether
    the C++ path ran. Not found before the steps end: ("", -1, -1, ...)."""
    from syncbn_lightning import CallOrderError

    torch.manual_seed(0)
    names = ["stem", "mid", "tail"] if rank == 0 else ["stem", "tail"]
    net = convert_sync_batchnorm(
        nn.ModuleDict({name: nn.BatchNorm1d(4) for name in ("stem", "mid", "tail")})
    ).cuda()
    where = (-1, -1)
    try:
        for step in range(2):
            for number, name in enumerate(names):
                where = (step, number)
                net[name](torch.randn(3, 4, device="cuda"))
                torch.cuda.current_stream().synchronize()  # the device has written the flag
    except CallOrderError as exc:
        return str(exc), *where, net["stem"]._sync_plan.native
    return "", -1, -1, net["stem"]._sync_plan.native


@pytest.mark.distributed
def test_a_skipped_layer_is_found_before_the_step_s_last_call() -> None:
    """The flags queued by the C++ path are read at the later calls' hand-offs: each rank raises
    naming the two layers at a call of the steps, never only at their end."""
    env = {"SYNCBN_NATIVE_CUDA": "1", "SYNCBN_IMPL": "ext"}
    results = run_distributed(_skipped_layer_worker, 2, timeout=120, pg_timeout_s=60, env=env)
    for rank, (text, step, number, native) in enumerate(results):
        assert native, rank
        assert "'mid'" in text and "'tail'" in text, (rank, text)
        last = (1, 2 if rank == 0 else 1)
        assert step >= 0 and (step, number) < last, (rank, step, number)


_BAD_INPUTS = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("nccl", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from syncbn_lightning import SyncBatchNorm
layer = SyncBatchNorm(4, force_sync=True).cuda()
layer(torch.randn(2, 4, 3, device="cuda"))
assert layer._sync_plan.native, "not on the C++ path"
cases = [
    (torch.randn(2, 3, 3, device="cuda"), ValueError, "3 channels"),
    (torch.randint(0, 3, (2, 4, 3), device="cuda"), TypeError, "must be floating point"),
    (torch.randn(2, 4, 3), ValueError, "model.to('cpu')"),
    (torch.randn(1, 4, device="cuda"), ValueError, "more than 1 value per channel"),
]
for bad, kind, text in cases:
    try:
        layer(bad)
    except kind as exc:
        assert text in str(exc), str(exc)
    else:
        raise AssertionError(f"no {kind.__name__} for {text}")
try:  # a check of the extension's own kernels, on CUDA tensors
    torch.ops.syncbn.local_stats(torch.zeros(3, device="cuda"))
except RuntimeError as exc:
    assert "got 1-D input of shape [3]" in str(exc), str(exc)
dist.destroy_process_group()
print("ok")
"""


def test_cpp_errors_are_python_errors_on_cuda(tmp_path) -> None:
    """A user's mistakes on the C++ path of CUDA layers (wrong channels, dtype, device, one value
    per channel) and a wrong call of the extension's CUDA kernels raise Python's exceptions with
    their messages. Run in a process of its own: on an image whose extension links libstdc++
    statically, formatting a number through an ostream crashes (the known defect); the crash
    then fails this test alone, naming the signal."""
    env = {**os.environ, "SYNCBN_NATIVE_CUDA": "1", "SYNCBN_IMPL": "ext"}
    done = subprocess.run(
        [sys.executable, "-c", _BAD_INPUTS, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (
        f"exit {done.returncode} (a negative exit is a signal: -11 the crash)\n"
        f"{done.stdout[-2000:]}{done.stderr[-3000:]}"
    )


@pytest.mark.parametrize("native", ["0", "1"], ids=["python_path", "cpp_path"])
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_a_checkpoint_recompute_repeats_nothing_on_the_gpu(
    one_rank_nccl, monkeypatch, native, exchange
):
    """Activation checkpointing on CUDA (``functional/recompute.py``): 3 steps of a float32
    channels-last net, reentrant and non-reentrant, equal the unchecked steps (outputs bitwise,
    the same running statistics, gradients within 1e-5; cuDNN deterministic) and count each step
    once."""
    from _checkpoint_nets import forward, net

    # monkeypatch restores the variable as it was: gpu_check's SYNCBN_NATIVE_CUDA=1 stays for
    # the tests after this one (popping it here once put them on the Python path).
    monkeypatch.setenv("SYNCBN_NATIVE_CUDA", native)
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(4, 3, 6, 6, generator=g) for _ in range(3)]

    def run(mode: str) -> list[torch.Tensor]:
        model = net(exchange, force_sync=True).float().cuda()
        model = model.to(memory_format=torch.channels_last)
        got = []
        for x in inputs:
            x = x.cuda().contiguous(memory_format=torch.channels_last).requires_grad_()
            y = forward(model, x, mode)
            (y * y).sum().backward()
            got += [y.detach(), x.grad]
        assert int(model[1].num_batches_tracked) == 3, mode
        return got + [p.grad for p in model.parameters()] + list(model.buffers())

    with torch.backends.cudnn.flags(enabled=True, deterministic=True, benchmark=False):
        plain = run("plain")
        checked_runs = {mode: run(mode) for mode in ("reentrant", "non_reentrant")}
    for mode, checked in checked_runs.items():
        for i, (a, b) in enumerate(zip(checked, plain, strict=True)):
            if i < 6 and i % 2 == 0:  # the outputs
                assert torch.equal(a, b), (mode, i)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
