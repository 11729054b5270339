"""What SyncBN's collectives leave to the threads that finish them (issue 55, item 2; issue 63,
item 3): none of the Python objects plain eager training puts in the thread's state.

A gloo worker thread releases a finished work after the waiting caller has moved on. When that
happens after the interpreter began to finalize, releasing a Python object cannot take the GIL,
CPython ends the thread inside the work's noexcept destructor, and the rank dies with SIGABRT,
"terminate called without an active exception" (core dumps of such ranks:
``benchmarks/RESULTS.md``). A work can hold two such things:

* the ``contextvars.Context`` torch's backward stashes in the thread's state, which the work
  copies: both paths issue their collectives with it set aside (``layer_comm.cpp``,
  ``collectives.py``) and put it back for the rest of the backward;
* a tensor whose Python object its caller dropped while the work still held it (the Python path:
  the C++ path's tensors have none): on gloo, the Python path returns only once the worker has
  let go of its tensors.

Nor does a Python dispatch mode (FlopCounterMode) reach them; saved-tensor hooks do, and are left to
the exit drain. The context tests replace c10d's CPU kernels for the two collectives with probes
(one rank: the gather is a copy) that note whether the issuing thread holds the backward's Python
object. Both paths call the process group's methods, which dispatch to these operators.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from syncbn_lightning import SyncBatchNorm, _compat
from syncbn_lightning.distributed import collectives
from syncbn_lightning.ops.build import load_extension

_CONTEXT = "context"  # the key of torch.autograd.graph._engine_run_backward
# The context tests need a torch whose backward stashes its context (2.13.0 and 2.14.1 of the
# releases checked; 2.4.1 and 2.8.0 stash none, so their works copy no such object).
_STASHES = pytest.mark.skipif(
    not _compat.backward_stashes_context,
    reason=f"torch {torch.__version__}'s backward stashes no Python object in the thread's state",
)


class _Probe:
    """c10d's CPU all_gather / all_reduce for one rank, noting for each call whether the issuing
    thread held torch's backward context."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        # Per call: the issuing thread's Python modes (dispatch + torch-function) and whether it
        # held saved-tensor hooks: state a gloo work copies too.
        self.modes: list[int] = []
        self.hooks: list[bool] = []

    def _note_state(self) -> None:
        self.modes.append(
            torch._C._len_torch_dispatch_stack() + torch._C._len_torch_function_stack()
        )
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        self.hooks.append(top is not None and top(True) is not None)

    @staticmethod
    def _done(result: Any) -> Any:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(result)
        return torch._C._distributed_c10d._create_work_from_future(future).boxed()

    def gather(self, output: torch.Tensor, input: torch.Tensor, *_: Any) -> Any:
        self.calls.append(("all_gather", torch._C._is_key_in_tls(_CONTEXT)))
        self._note_state()
        output.copy_(input.reshape(-1))
        return output, self._done([output])

    def reduce(self, tensors: list[torch.Tensor], *_: Any) -> Any:
        self.calls.append(("all_reduce", torch._C._is_key_in_tls(_CONTEXT)))
        self._note_state()
        return tensors, self._done(tensors)


@pytest.fixture
def probe(tmp_path: Path) -> Iterator[_Probe]:
    """A one-rank gloo job whose CPU collectives are :class:`_Probe`'s."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    found = _Probe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        library = torch.library.Library("c10d", "IMPL")
        library.impl("_allgather_base_", found.gather, "CPU")
        library.impl("allreduce_", found.reduce, "CPU")
    try:
        yield found
    finally:
        library._destroy()
        dist.destroy_process_group()


def _backward(impl: str) -> bool:
    """One train step of conv -> SyncBN (``impl``) on a one-rank group; whether the backward's
    context was in the thread's state after the layer's backward (the conv's backward runs
    after it, under the same context)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), SyncBatchNorm(4, force_sync=True, impl=impl))
    seen_after: list[bool] = []
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    x.register_hook(lambda grad: seen_after.append(torch._C._is_key_in_tls(_CONTEXT)))
    model(x).square().mean().backward()
    return seen_after == [True]


@_STASHES
@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_the_backward_collective_holds_no_python_object(
    probe: _Probe, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if impl == "ext":  # the C++ path's own guard: the Python path's set-aside is off
        monkeypatch.setattr(collectives, "take_backward_context", lambda: None)
    assert _backward(impl), "the backward's context must be back after the layer's backward"
    # The forward's exchange, then the backward's: neither holds the backward's Python object.
    assert probe.calls == [("all_gather", False), ("all_gather", False)]


@_STASHES
def test_an_all_reduce_holds_no_python_object(
    probe: _Probe, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Groups above GATHER_SUM_MAX_RANKS sum the backward with all_reduce; with the bound at 0
    # (the test switch), a one-rank group does too.
    load_extension()
    with collectives.gather_sums_up_to(0):
        assert _backward("reference")
    assert probe.calls == [("all_gather", False), ("all_reduce", False)]


@_STASHES
def test_the_python_path_without_its_set_aside_is_seen(
    probe: _Probe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference layer's collectives are the Python path's: with its set-aside off, the
    backward's gather holds the context (so the ``ext`` case above, passing with it off, ran the
    C++ path's guard)."""
    monkeypatch.setattr(collectives, "take_backward_context", lambda: None)
    assert _backward("reference")
    assert probe.calls == [("all_gather", False), ("all_gather", True)]


@_STASHES
def test_the_probe_sees_the_context_a_plain_call_holds(probe: _Probe) -> None:
    """The checks above can fail: a collective issued inside a backward without setting the
    context aside (as ``torch.distributed``'s own calls do) is seen holding it."""

    class Gathered(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(grad).reshape(-1)
            collectives.all_gather_single(out, grad.reshape(-1).contiguous(), None)
            return out.view_as(grad)

    Gathered.apply(torch.ones(3, requires_grad=True)).sum().backward()
    assert probe.calls == [("all_gather", True)]


def _train_step(impl: str) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), SyncBatchNorm(4, force_sync=True, impl=impl))
    model(torch.randn(2, 3, 8, 8, requires_grad=True)).square().mean().backward()


@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_a_step_under_flop_counter_mode_hands_the_worker_no_python_object(
    probe: _Probe, impl: str
) -> None:
    """FlopCounterMode, a Python dispatch mode, is active for the whole step; at each collective
    no Python mode is on the issuing thread's stack (torch runs a mode's handler with the mode
    popped) and no backward context either: the works copy nothing that needs the GIL."""

    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        _train_step(impl)
    assert counter.get_total_flops() > 0
    assert probe.calls == [("all_gather", False), ("all_gather", False)]
    assert probe.modes == [0, 0] and probe.hooks == [False, False]


@pytest.mark.skipif(
    not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"),
    reason=f"torch {torch.__version__} cannot show the saved-tensor hooks' stack",
)
@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_saved_tensor_hooks_are_copied_and_left_to_the_exit_drain(probe: _Probe, impl: str) -> None:
    """What is not set aside (docs/reliability.md): saved-tensor hooks (a non-reentrant
    checkpoint's, a user's offloading hooks) are Python callables in the thread's state while
    the forward and backward run, and the works of both collectives copy them. At exit the exit
    drain (``distributed/exit_drain.py``) is what lets the workers drop them in time."""
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        _train_step(impl)
    assert probe.hooks == [True, True] and probe.modes == [0, 0]


def test_the_python_path_returns_once_gloo_let_go_of_its_tensors(tmp_path: Path) -> None:
    """Right after each call, the gathered / summed tensor and the input are held only by their
    Python objects: the worker no longer holds them. (Without the wait, 4 of 400 such calls on an
    idle VM returned while the worker still held a tensor.)"""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        group = dist.new_group([0]).group_name
        row = torch.ones(4)
        held = 0
        for _ in range(500):
            gathered = collectives.all_gather(row, group, 1)
            held += gathered._use_count() > 1 or row._use_count() > 1
            summed = collectives.all_reduce(row, group)
            held += summed._use_count() > 1 or row._use_count() > 1
        assert held == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("config", "device", "waits"),
    [
        ("gloo", "cpu", True),
        ("nccl", "cuda", False),
        ("cpu:gloo,cuda:nccl", "cpu", True),  # a group whose name() reads "nccl"
        ("cpu:gloo,cuda:nccl", "cuda", False),
    ],
)
def test_the_wait_follows_the_backend_of_the_tensors_device(config, device, waits) -> None:
    assert collectives._on_gloo(config, device) is waits


def test_a_wait_that_gives_up_says_so(monkeypatch, caplog) -> None:
    """A worker that holds the tensors past the wait's limit gets one warning, not silence."""
    monkeypatch.setattr(collectives, "_RELEASE_WAIT_S", 0.05)
    monkeypatch.setattr(collectives, "use_count", lambda tensor: 5)
    with caplog.at_level("WARNING", logger=collectives.log.name):
        collectives._until_released([torch.zeros(1)], [1])
    assert "still held a collective's tensors 0.1 s after it finished (5 holders, 1 expected)" in (
        caplog.text
    )
