"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import _functions as torch_functions
from torch.utils._python_dispatch import TorchDispatchMode


@contextlib.contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set (or leave alone, for ``None``) an environment variable, restoring it afterwards."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@contextlib.contextmanager
def busy_cores(count: int | None = None, seconds: float = 1800) -> Iterator[None]:
    """Every core (or ``count``) busy with a CPU-bound process (at most ``seconds`` long) while
    the block runs, as ``../shared/tools/with-load`` does: distributed code must hold on a busy
    machine (also the tests' load, through ``benchmarks._common``)."""
    burner = (
        f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: sum(range(9999))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", burner])
        for _ in range(count or os.cpu_count() or 2)
    ]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else what :mod:`platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def count_collectives(names: Iterable[str], counts: dict[str, int]) -> contextlib.ExitStack:
    """Wrap the ``torch.distributed`` functions ``names`` so that each call adds 1 to
    ``counts[name]``; the returned stack (usable as ``with``) restores them when closed.

    Names this torch does not have are skipped.
    """
    stack = contextlib.ExitStack()
    for name in names:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args: Any, _name: str = name, _fn: Any = original, **kwargs: Any) -> Any:
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        setattr(dist, name, counting)
        stack.callback(setattr, dist, name, original)
    return stack


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...``: ``c.ops`` counts each dispatcher operator overload by its
    name, e.g. ``"syncbn.stats_row.default"`` or ``"aten.add_.Tensor"`` (also used by the tests'
    op-count budgets, through ``benchmarks._common``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def namespaces(self) -> set[str]:
        """The operator namespaces seen (``"aten"``, ``"syncbn"``, ...)."""
        return {name.split(".")[0] for name in self.ops}


class ForcedTorchSyncBatchNorm(nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` that takes torch's sync Function in training even in a one-rank group
    (torch falls back to ``F.batch_norm`` there), with the module's own momentum handling: every
    kernel and collective torch's SyncBN runs in a real group (CUDA only)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        assert self.num_batches_tracked is not None and self.momentum is not None
        self.num_batches_tracked.add_(1)
        return torch_functions.SyncBatchNorm.apply(
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
            self.momentum, self.process_group or dist.group.WORLD, 1,
        )  # fmt: skip


class ForcedTorchSyncBatchNormAct(ForcedTorchSyncBatchNorm):
    """timm's ``SyncBatchNormAct`` (torch's SyncBatchNorm, then its ``drop`` and ``act``) forced
    through torch's sync Function like :class:`ForcedTorchSyncBatchNorm`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(super().forward(input)))


def force_torch_sync(model: nn.Module) -> nn.Module:
    """``model`` with every ``nn.SyncBatchNorm`` forced through torch's sync Function: the plain
    ones become :class:`ForcedTorchSyncBatchNorm`, those with ``act`` and ``drop`` children
    (timm's SyncBatchNormAct) :class:`ForcedTorchSyncBatchNormAct`."""
    for module in model.modules():
        if isinstance(module, nn.SyncBatchNorm):
            with_act = "act" in module._modules and "drop" in module._modules
            module.__class__ = ForcedTorchSyncBatchNormAct if with_act else ForcedTorchSyncBatchNorm
    return model


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A one-rank default process group (NCCL for CUDA devices, else gloo) over a file store."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="syncbn_bench_") as tmp:
        dist.init_process_group(
            backend, init_method=f"file://{Path(tmp) / 'store'}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def capture_graph(step: Callable[[], None], device: torch.device, warmup: int = 3) -> Any:
    """``step`` captured in a ``torch.cuda.CUDAGraph``, after ``warmup`` eager runs on a side
    stream (so that lazily created state, allocator pools and communicators exist first)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def replay_ms(graph: Any, replays: int = 1) -> float:
    """Milliseconds per replay of ``graph``: ``replays`` back-to-back replays between two CUDA
    events, divided by ``replays`` (the host only enqueues; no host work is timed)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def median_replay_ms(graph: Any, samples: int, replays: int = 1, warmup: int = 3) -> float:
    """Median over ``samples`` of :func:`replay_ms`, after ``warmup`` untimed replays."""
    for _ in range(warmup):
        graph.replay()
    return statistics.median(replay_ms(graph, replays) for _ in range(samples))


def csv_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``: a comma-separated command-line option."""
    return [item.strip() for item in text.split(",") if item.strip()]


def ratio_text(a: float | None, b: float | None) -> str:
    """``a / b`` with two decimals for a table cell, ``-`` when either side was not measured."""
    return f"{a / b:.2f}" if a and b else "-"


def value_text(value: float | None) -> str:
    """``value`` with two decimals for a table cell, ``-`` when it was not measured."""
    return "-" if value is None else f"{value:.2f}"


def init_affine(layer: nn.Module, channels: int) -> None:
    """Give ``layer`` the same non-trivial weight and bias as every other implementation of a
    comparison (seeded by ``channels``), so that no side normalizes with identity parameters."""
    with torch.no_grad():
        generator = torch.Generator().manual_seed(channels)
        layer.weight.copy_(torch.rand(channels, generator=generator) + 0.5)
        layer.bias.copy_(torch.randn(channels, generator=generator))
