"""Forward+backward timing of syncbn_lightning's kernels vs torch and a sum/sum-of-squares SyncBN.

Each implementation is timed on the CPU as one training step of a single BatchNorm layer::

    y = layer(x)
    torch.autograd.grad(y, (x, layer.weight, layer.bias), dy)

with ``x.requires_grad=True`` and a fixed random ``dy`` of ``x``'s shape, dtype and layout. The
reported time is the median wall time over ``--repeats`` steps after ``--warmup`` untimed ones; the
implementations are interleaved step by step so that machine noise hits them alike.

Implementations:
    * ``ext``: :class:`syncbn_lightning.SyncBatchNorm` with ``force_sync=True``, ``SYNCBN_IMPL=ext``
      (the compiled C++ primitives); in a process group it calls one all_gather forward and one
      backward (a gloo group sums by all_gather) even with one rank;
    * ``ref``: the same module with ``SYNCBN_IMPL=ref`` (the pure-PyTorch reference primitives);
    * ``torch``: :class:`torch.nn.BatchNorm2d` (no synchronization);
    * ``sumsq``: :class:`SumSqSyncBatchNorm` below, a plain-PyTorch SyncBN in the style of
      detectron2 (mean and mean of squares all-reduced, backward by autograd).

The script runs inside a one-rank gloo process group that it creates and destroys itself;
``--group none`` (alias ``--no-group``) runs without one. bfloat16 inputs keep float32 BatchNorm
parameters (the usual mixed-precision setup).

GPU timings: benchmarks/bench_layer.py (one layer, every implementation by CUDA-graph replay) and
benchmarks/bench_model.py (ResNet-50 step).

Example:
    python benchmarks/bench_kernels.py --out /tmp/bench_kernels.md
    python benchmarks/bench_kernels.py --shapes 8x64x56x56 --impls ext,torch --repeats 50
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from _common import OpCounter, cpu_model, env_var, init_affine, value_text
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn_lightning
from syncbn_lightning.ops import build as ops_build
from syncbn_lightning.ops import dispatch as syncbn_impl

IMPLS = ("ext", "ref", "torch", "sumsq")  # also the table's column order
DEFAULT_SHAPES = ((8, 64, 56, 56), (2, 256, 28, 28), (32, 512, 7, 7), (16, 256, 56, 56))
REPEATS = 20  # --repeats default
WARMUP = 5  # --warmup default
GROUPS = ("gloo", "none")
LAYOUTS = ("NCHW", "channels_last")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# glibc mallopt parameters (malloc.h) and the values --malloc-reuse sets.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MALLOC_REUSE = (
    (_M_MMAP_THRESHOLD, 32 * 2**20),
    (_M_TRIM_THRESHOLD, 2**31 - 1),
    (_M_TOP_PAD, 2**30),
)


class Goal(NamedTuple):
    """A target on one ratio column, checked on every measured row it applies to."""

    title: str
    layouts: tuple[str, ...] | None  # the layouts it applies to; None: all
    column: str  # a Case.ratio column, "top/bottom"
    bound: float
    sense: str  # "<=" or ">="


GOALS = (
    Goal("ext <= 1.0x torch on channels_last", ("channels_last",), "ext/torch", 1.0, "<="),
    Goal("ext <= 0.5x torch on NCHW", ("NCHW",), "ext/torch", 0.5, "<="),
    Goal("sumsq/ext >= 2 everywhere", None, "sumsq/ext", 2.0, ">="),
)
# Ratio columns of the table: ms ratios (ext/torch < 1: ext faster).
RATIO_COLUMNS = ("ext/torch", "sumsq/ext")


class SumSqSyncBatchNorm(_BatchNorm):
    """Synchronized BatchNorm from the group's mean and mean of squares, in plain PyTorch.

    The classic approach (as in detectron2's ``NaiveSyncBatchNorm``, written anew here): per-channel
    ``E[x]`` and ``E[x^2]`` of the local batch in float32, one differentiable all-reduce (sum) of
    both, divided by the group size, then ``var = E[x^2] - E[x]^2``. Backward is autograd through
    the whole computation, including the all-reduce.

    Args:
        num_features: ``C``, the number of channels (dim 1).
        eps: added to the variance before the inverse square root. Default: ``1e-5``.
        momentum: weight of the new batch in the running-stat update. Default: ``0.1``.
        process_group: the ranks to synchronize with; ``None`` is the world. Default: ``None``.

    Note:
        Every rank is assumed to hold the same batch size (the group mean is the plain mean of the
        ranks' means). The output is ``x * scale + shift`` with ``scale = weight * invstd`` and
        ``shift = bias - mean * scale``, both cast to the input's dtype; ``running_var`` is updated
        with the unbiased group variance, as torch does. In eval mode it is plain BatchNorm.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine=True, track_running_stats=True)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected input of shape (N, C, *), got {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        x32 = input.float()
        moments = torch.cat([x32.mean(dims), x32.square().mean(dims)])
        world_size = dist.get_world_size(self.process_group)
        moments = dist_nn.all_reduce(moments, group=self.process_group) * (1.0 / world_size)
        mean, meansqr = moments.split(channels)
        var = meansqr - mean * mean
        invstd = torch.rsqrt(var + self.eps)
        scale = self.weight * invstd
        shift = self.bias - mean * scale
        self._update_running_stats(mean, var, world_size * input.numel() // channels)
        view = (1, channels) + (1,) * (input.dim() - 2)
        return input * scale.to(input.dtype).view(view) + shift.to(input.dtype).view(view)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        """Momentum update of the running stats with the (unbiased) group statistics."""
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        unbiased = var * (count / max(count - 1, 1))
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), self.momentum)
        self.num_batches_tracked.add_(1)


@dataclass
class Case:
    """One row of the table: an input shape, memory layout and dtype."""

    shape: tuple[int, ...]
    layout: str
    dtype_name: str
    ms: dict[str, float] = field(default_factory=dict)
    collectives: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``shape layout dtype``, to name the row in the summary."""
        return f"{_shape_text(self.shape)} {self.layout} {self.dtype_name}"

    def ratio(self, column: str) -> float | None:
        """``top/bottom`` of this row's times (``ext/torch``, ``sumsq/ext``); ``None`` when an
        operand was not measured."""
        top, bottom = column.split("/")
        if top not in self.ms or bottom not in self.ms:
            return None
        return self.ms[top] / self.ms[bottom]


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape)


def _parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"8x64x56x56,2x256x28x28"`` -> ``[(8, 64, 56, 56), (2, 256, 28, 28)]`` (4-D, positive)."""
    shapes = []
    for item in text.split(","):
        try:
            shape = tuple(int(d) for d in item.strip().lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not NxCxHxW, e.g. 8x64x56x56") from None
        if len(shape) != 4 or min(shape) < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r} must have 4 positive sizes NxCxHxW (BatchNorm2d input)"
            )
        shapes.append(shape)
    return shapes


def _parse_impls(text: str) -> list[str]:
    """``"ext,torch"`` -> ``["ext", "torch"]``, in the table's column order."""
    wanted = {item.strip() for item in text.split(",") if item.strip()}
    unknown = wanted - set(IMPLS)
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(
            f"unknown {sorted(unknown)}; use a comma-separated subset of {','.join(IMPLS)}"
        )
    return [impl for impl in IMPLS if impl in wanted]


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu only (cuda is refused: GPU timings are benchmarks/bench_layer.py's)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=REPEATS,
        help=f"timed steps per implementation (default: {REPEATS})",
    )
    parser.add_argument(
        "--warmup", type=int, default=WARMUP, help=f"untimed steps first (default: {WARMUP})"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    parser.add_argument(
        "--shapes",
        type=_parse_shapes,
        default=None,
        help="comma-separated NxCxHxW (default: "
        + ",".join(_shape_text(shape) for shape in DEFAULT_SHAPES)
        + ")",
    )
    parser.add_argument(
        "--impls",
        type=_parse_impls,
        default=None,
        help=f"comma-separated subset of {','.join(IMPLS)} (default: all)",
    )
    parser.add_argument(
        "--malloc-reuse",
        action="store_true",
        help="make glibc malloc keep freed memory (mallopt) instead of returning it to the OS, so "
        "steps do not pay page faults for fresh memory; measures the kernels rather than the "
        "allocator",
    )
    parser.add_argument(
        "--group",
        choices=GROUPS,
        default=None,
        help="the one-rank process group to run in (default: gloo). ext/ref/sumsq call "
        "collectives in it, torch never",
    )
    parser.add_argument(
        "--no-group",
        action="store_true",
        help="same as --group none: run without any process group: ext/ref then issue no "
        "collectives (what a layer costs outside torch.distributed); sumsq needs a group and is "
        "left out",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        parser.error(
            "--device cuda: this script times the CPU kernels; on a GPU use "
            "benchmarks/bench_layer.py (every implementation by CUDA-graph replay)"
        )
    if args.no_group and args.group not in (None, "none"):
        parser.error(f"--no-group contradicts --group {args.group}: give one of them")
    if args.no_group:
        args.group = "none"
    elif args.group is None:
        args.group = "gloo"
    args.no_group = args.group == "none"
    if args.shapes is None:
        args.shapes = list(DEFAULT_SHAPES)
    if args.impls is None:
        args.impls = list(IMPLS)
    if args.no_group:
        args.impls = [impl for impl in args.impls if impl != "sumsq"]
    for name, least in (("repeats", 1), ("warmup", 0), ("threads", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            parser.error(f"--{name} must be >= {least}, got {value}")
    if not args.impls:
        parser.error("no implementation left to time (sumsq needs a process group)")
    return args


def _cpu_seconds() -> tuple[float, float, float] | None:
    """``(busy, total, own)`` CPU seconds: the machine's from /proc/stat, then this process's.

    ``None`` where /proc/stat is unavailable. Used to report how much other processes competed for
    the CPUs during the measurements.
    """
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    hertz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / hertz, sum(ticks) / hertz, own.user + own.system


def _contention_line(
    before: tuple[float, float, float] | None, after: tuple[float, float, float] | None
) -> list[str]:
    """A line saying which share of the machine's CPU time other processes used meanwhile."""
    if before is None or after is None or after[1] <= before[1]:
        return []
    other = (after[0] - before[0]) - (after[2] - before[2])
    share = max(other, 0.0) / (after[1] - before[1])
    return [
        f"- Other processes used {100 * share:.0f}% of the machine's CPU time during the "
        f"measurements (0% = quiet machine; the higher, the noisier the timings)."
    ]


def _malloc_reuse() -> None:
    """Keep freed heap memory for reuse (glibc ``mallopt``): no page faults on every step.

    By default glibc serves large blocks (from 128 KiB, adaptively up to 32 MiB) with fresh
    ``mmap`` pages and gives them back on free, so each step re-faults and zeroes every tensor it
    allocates; on small CPUs that can cost more than the BatchNorm arithmetic itself.

    Raises:
        SystemExit: when the C library has no ``mallopt`` or refuses a setting (not glibc).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        raise SystemExit(f"--malloc-reuse needs glibc's mallopt: {exc}") from None
    for param, value in _MALLOC_REUSE:
        if mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            raise SystemExit(f"--malloc-reuse: mallopt({param}, {value}) failed (not glibc?)")


@contextlib.contextmanager
def _single_rank_group(backend: str = "gloo") -> Iterator[None]:
    """A one-rank default process group of ``backend`` over a temporary file store."""
    with tempfile.TemporaryDirectory(prefix="bench_kernels_") as tmp:
        init_file = Path(tmp) / "store"
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _make_layer(impl: str, channels: int, device: torch.device) -> nn.Module:
    """A freshly initialized training-mode layer of ``impl`` with float32 parameters."""
    if impl in ("ext", "ref"):
        layer: nn.Module = syncbn_lightning.SyncBatchNorm(channels, force_sync=True)
    elif impl == "torch":
        layer = nn.BatchNorm2d(channels)
    else:
        layer = SumSqSyncBatchNorm(channels)
    layer = layer.to(device).train()
    init_affine(layer, channels)
    return layer


def _make_inputs(
    shape: tuple[int, ...], layout: str, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random input (requiring grad) and upstream gradient with the given dtype and layout."""
    generator = torch.Generator().manual_seed(0)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(shape, generator=generator).mul_(2.0).add_(0.5)
    dy = torch.randn(shape, generator=generator)
    x = x.to(device=device, dtype=dtype, memory_format=fmt).requires_grad_(True)
    dy = dy.to(device=device, dtype=dtype, memory_format=fmt)
    return x, dy


def _step_fn(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], None]:
    """One forward+backward of ``layer`` as a closure."""
    params = (x, layer.weight, layer.bias)

    def step() -> None:
        y = layer(x)
        torch.autograd.grad(y, params, dy)

    return step


def _count_collectives(step: Callable[[], None], impl: str) -> int:
    """How many collectives one (untimed) ``step`` of ``impl`` issues: the dispatcher's
    collective operators, torch's functional ones (``_c10d_functional.*``, their ``wait_tensor``
    not counted: compiled and graph-captured calls) and the process groups' own (``c10d.*``:
    eager calls, ``torch.distributed``'s functions included)."""
    with OpCounter() as ops:
        _timed(step, impl)
    return sum(
        n
        for name, n in ops.ops.items()
        if name.startswith("c10d.")
        or (name.startswith("_c10d_functional.") and "wait_tensor" not in name)
    )


def _timed(step: Callable[[], None], impl: str) -> float:
    """Wall-clock seconds of one ``step`` under ``SYNCBN_IMPL`` for ``impl``."""
    with env_var(syncbn_impl.IMPL_ENV, impl if impl in ("ext", "ref") else None):
        start = time.perf_counter()
        step()
        return time.perf_counter() - start


def _measure(
    case: Case, impls: Sequence[str], device: torch.device, repeats: int, warmup: int
) -> None:
    """Fill ``case.ms`` with each implementation's median step time (milliseconds)."""
    x, dy = _make_inputs(case.shape, case.layout, DTYPES[case.dtype_name], device)
    steps = {impl: _step_fn(_make_layer(impl, case.shape[1], device), x, dy) for impl in impls}
    case.collectives = {impl: _count_collectives(steps[impl], impl) for impl in impls}
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(warmup):
        for impl in impls:
            _timed(steps[impl], impl)
    for _ in range(repeats):  # interleaved, so drifts in machine load hit all alike
        for impl in impls:
            times[impl].append(_timed(steps[impl], impl))
    case.ms = {impl: 1e3 * statistics.median(values) for impl, values in times.items()}


def _cases(args: argparse.Namespace) -> list[Case]:
    """All (shape, layout, dtype) rows, in table order."""
    return [
        Case(shape, layout, dtype_name)
        for shape in args.shapes
        for layout in LAYOUTS
        for dtype_name in DTYPES
    ]


def _table_head(impls: Sequence[str]) -> list[str]:
    """The markdown table's header: shape, layout, dtype, ms per implementation, two ratios."""
    header = ["shape", "layout", "dtype"]
    header += [f"{impl} ms" for impl in impls]
    header += RATIO_COLUMNS
    return ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]


def _table_row(case: Case, impls: Sequence[str]) -> str:
    """One measured row of the markdown table."""
    cells = [_shape_text(case.shape), case.layout, case.dtype_name]
    cells += [f"{case.ms[impl]:.2f}" for impl in impls]
    cells += [value_text(case.ratio(column)) for column in RATIO_COLUMNS]
    return "| " + " | ".join(cells) + " |"


def _goal_line(goal: Goal, cases: Sequence[Case]) -> str:
    """How many rows meet ``goal`` and which do not."""
    rows = [c for c in cases if goal.layouts is None or c.layout in goal.layouts]
    rated = [(c, c.ratio(goal.column)) for c in rows]
    rated = [(c, r) for c, r in rated if r is not None]
    if not rated:
        return f"- {goal.title}: not measured (needs {goal.column.replace('/', ' and ')})"
    below = goal.sense == ">="
    failed = [(c, r) for c, r in rated if (r < goal.bound if below else r > goal.bound)]
    met = len(rated) - len(failed)
    text = f"- {goal.title}: {met}/{len(rated)} rows meet it"
    if failed:
        text += "; not met: " + "; ".join(f"{c.label} ({goal.column} {r:.3f})" for c, r in failed)
    return text


def _summary(cases: Sequence[Case], group: str) -> list[str]:
    """One line per goal: how many rows meet it, and every row that does not, then the
    collectives each implementation called."""
    lines = ["", "Goals:"]
    lines += [_goal_line(goal, cases) for goal in GOALS]
    counts = {impl: sorted({c.collectives[impl] for c in cases}) for impl in cases[0].collectives}
    lines.append(
        "- torch.distributed collectives per step "
        + ("(no process group): " if group == "none" else f"(one-rank {group} group): ")
        + ", ".join(f"{impl} {'/'.join(map(str, n))}" for impl, n in counts.items())
        + "; an implementation with 0 times no communication at all."
    )
    return lines


def _header(args: argparse.Namespace) -> list[str]:
    """The run's context: device, torch, threads, CPU, repeat counts and what is measured."""
    return [
        f"# bench_kernels: device=cpu, torch {torch.__version__}, "
        f"threads={torch.get_num_threads()}, CPU: {cpu_model()}",
        "",
        f"Median forward+backward time per step (ms) over {args.repeats} repeats after "
        f"{args.warmup} warm-up steps, implementations interleaved step by step.",
        "ext/ref: syncbn_lightning.SyncBatchNorm(force_sync=True) with SYNCBN_IMPL=ext/ref; "
        "torch: nn.BatchNorm2d; sumsq: E[x], E[x^2] + differentiable all_reduce, autograd "
        "backward. "
        + (
            "No process group (no collectives). "
            if args.no_group
            else f"One-rank {args.group} group. "
        )
        + "bf16 inputs use float32 parameters.",
        "Memory: "
        + (
            "--malloc-reuse (glibc keeps freed memory for reuse: far fewer page faults per step)."
            if args.malloc_reuse
            else "default allocator (large tensors get fresh, page-faulting memory every step; "
            "see --malloc-reuse)."
        ),
        "",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark and print (and optionally write) the report."""
    args = _parse_args(argv)
    # The sumsq baseline uses the differentiable torch.distributed.nn.functional.all_reduce on
    # purpose (it is what such SyncBNs use); keep torch's deprecation notice out of the report.
    warnings.filterwarnings(
        "ignore", message=r"torch\.distributed\.nn\.functional\.all_reduce is deprecated"
    )
    if args.malloc_reuse:
        _malloc_reuse()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if "ext" in args.impls:
        ops_build.load_extension()  # build (first run, ~30 s) before anything is timed
    cases = _cases(args)
    report = _header(args) + _table_head(args.impls)
    print("\n".join(report), flush=True)
    before = _cpu_seconds()
    group = contextlib.nullcontext() if args.no_group else _single_rank_group(args.group)
    with group:
        for case in cases:  # rows are printed as they are measured
            _measure(case, args.impls, device, args.repeats, args.warmup)
            report.append(_table_row(case, args.impls))
            print(report[-1], flush=True)
    summary = _summary(cases, args.group) + _contention_line(before, _cpu_seconds())
    print("\n".join(summary), flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(report + summary) + "\n")


if __name__ == "__main__":
    main()
