"""Forward+backward timing of syncbn_lightning's kernels vs torch and a sum/sum-of-squares SyncBN.

Each implementation is timed as one training step of a single BatchNorm layer::

    y = layer(x)
    torch.autograd.grad(y, (x, layer.weight, layer.bias), dy)

with ``x.requires_grad=True`` and a fixed random ``dy`` of ``x``'s shape, dtype and layout. The
reported time is the median over ``--repeats`` steps after ``--warmup`` untimed ones; the
implementations are interleaved step by step so that machine noise hits them alike.

Implementations:
    * ``ext``: :class:`syncbn_lightning.SyncBatchNorm` with ``force_sync=True``, ``SYNCBN_IMPL=ext``
      (the compiled C++/CUDA primitives); in a process group it calls one all_gather forward and
      one all_reduce (or, on CPU, all_gather) backward even with one rank;
    * ``ref``: the same module with ``SYNCBN_IMPL=ref`` (the pure-PyTorch reference primitives);
    * ``torch_sync`` (CUDA only): :class:`TorchSyncBatchNorm` below, the kernel sequence of
      :class:`torch.nn.SyncBatchNorm`'s training step with its two collectives left out, i.e. what
      torch's SyncBN costs on one rank apart from communication;
    * ``torch``: :class:`torch.nn.BatchNorm2d` (no synchronization; cuDNN where torch picks it);
    * ``sumsq``: :class:`SumSqSyncBatchNorm` below, a plain-PyTorch SyncBN in the style of
      detectron2 (mean and mean of squares all-reduced, backward by autograd).

On CPU (the default) the script runs inside a one-rank gloo process group that it creates and
destroys itself; ``--group none`` (alias ``--no-group``) runs without one. On CUDA it runs without
a process group by default, so that ``ext`` and ``torch_sync`` both issue no collectives and the
comparison is kernels against kernels; ``--group nccl`` (or ``gloo``, which stages CUDA tensors
through host memory) adds ext's one-rank collectives, which torch_sync never issues. bfloat16
inputs keep float32 BatchNorm parameters (the usual mixed-precision setup).

CUDA mode also reports bandwidth:
    * timing: each step is bracketed by CUDA events and queued behind a short GPU spin
      (``torch.cuda._sleep``), so the events measure GPU time without the host's launch overhead,
      except where the step itself makes the host wait for the GPU (that gap is counted);
    * byte model of a minimal fwd+bwd step, ``8 x`` the bytes of ``x``: forward reads ``x`` for the
      statistics, then reads ``x`` and writes ``y`` to normalize (3); backward reads ``dy`` and
      ``x`` for the reduction, then reads ``dy`` and ``x`` and writes ``dx`` (5). Parameters and
      per-channel statistics are negligible and not counted. ``ext GB/s`` = that / ext's time;
    * ``copy GB/s``: ``2 x`` the bytes / the median time of ``dst.copy_(src)`` (a device-to-device
      copy of the same byte count), measured once per tensor size; ``ext/copy`` is their ratio.
      Tensors smaller than the GPU's L2 cache (50 MiB on an H100) run partly from it, in both the
      step and the copy: only the large rows measure memory bandwidth;
    * goals: ``torch_sync/ext`` (ext's speedup over torch's SyncBN kernels) >= 1.0 on NCHW and
      >= 1.3 on channels_last; ``ext/copy`` >= 0.8 for tensors of at least 64 MiB.

Example:
    python benchmarks/bench_kernels.py --out /tmp/bench_kernels.md
    python benchmarks/bench_kernels.py --shapes 8x64x56x56 --impls ext,torch --repeats 50
    python benchmarks/bench_kernels.py --device cuda --out /tmp/bench_kernels_cuda.md
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import functools
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from _common import count_collectives, cpu_model, env_var
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn_lightning
from syncbn_lightning import _backend
from syncbn_lightning import impl as syncbn_impl

IMPLS = ("ext", "ref", "torch_sync", "torch", "sumsq")  # also the table's column order
CPU_IMPLS = ("ext", "ref", "torch", "sumsq")
CUDA_IMPLS = ("ext", "torch_sync", "torch")
CUDA_ONLY_IMPLS = ("torch_sync",)
DEFAULT_SHAPES = ((8, 64, 56, 56), (2, 256, 28, 28), (32, 512, 7, 7), (16, 256, 56, 56))
# ResNet-50's BatchNorm inputs at 32 images of 224x224 per GPU (stem, then one per stage), the
# detection shape of the issue (2 images, 256-channel FPN level of an 800x1344 input) and a large
# square one: every dtype of the last two, and float32 of the first two, is >= 64 MiB.
CUDA_SHAPES = (
    (32, 64, 112, 112),
    (32, 256, 56, 56),
    (32, 512, 28, 28),
    (32, 1024, 14, 14),
    (32, 2048, 7, 7),
    (2, 256, 200, 336),
    (8, 256, 128, 128),
)
# --repeats / --warmup defaults per device.
REPEATS = {"cpu": 20, "cuda": 100}
WARMUP = {"cpu": 5, "cuda": 10}
GROUPS = ("gloo", "nccl", "none")
LAYOUTS = ("NCHW", "channels_last")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)
# glibc mallopt parameters (malloc.h) and the values --malloc-reuse sets.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MALLOC_REUSE = (
    (_M_MMAP_THRESHOLD, 32 * 2**20),
    (_M_TRIM_THRESHOLD, 2**31 - 1),
    (_M_TOP_PAD, 2**30),
)
# CUDA mode: the bytes a minimal fwd+bwd step moves, in units of x's bytes (see the docstring), and
# how long the GPU spins before each timed step so that the host can queue the step meanwhile.
STEP_TRAFFIC = 8
COPY_TRAFFIC = 2
SPIN_MS = 2.0
MIB = 2**20


class Goal(NamedTuple):
    """A target on one ratio column, checked on every measured row it applies to."""

    title: str
    layouts: tuple[str, ...] | None  # the layouts it applies to; None: all
    column: str  # a Case.ratio column, "top/bottom"
    bound: float
    sense: str  # "<=" or ">="
    min_bytes: int = 0  # rows whose x has fewer bytes are left out


GOALS = (
    Goal("ext <= 1.0x torch on channels_last", ("channels_last",), "ext/torch", 1.0, "<="),
    Goal("ext <= 0.5x torch on NCHW", ("NCHW",), "ext/torch", 0.5, "<="),
    Goal("sumsq/ext >= 2 everywhere", None, "sumsq/ext", 2.0, ">="),
)
CUDA_GOALS = (
    Goal("ext >= 1.0x torch's SyncBN kernels on NCHW", ("NCHW",), "torch_sync/ext", 1.0, ">="),
    Goal(
        "ext >= 1.3x torch's SyncBN kernels on channels_last",
        ("channels_last",),
        "torch_sync/ext",
        1.3,
        ">=",
    ),
    Goal("ext >= 80% of copy GB/s at >= 64 MiB", None, "ext/copy", 0.8, ">=", 64 * MIB),
)
# Ratio columns of the table: ms ratios on CPU (ext/torch < 1: ext faster), speedups of ext on CUDA
# (> 1: ext faster) plus ext's bandwidth relative to a device-to-device copy.
RATIO_COLUMNS = {"cpu": ("ext/torch", "sumsq/ext"), "cuda": ("torch_sync/ext", "torch/ext")}


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


def _channels_last_or_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if channels-last (2-D or 3-D), else a contiguous copy, as torch's SyncBN does."""
    if tensor.is_contiguous(memory_format=torch.channels_last) or tensor.is_contiguous(
        memory_format=torch.channels_last_3d
    ):
        return tensor
    return tensor.contiguous()


class _TorchSyncBatchNormFunction(torch.autograd.Function):
    """torch's SyncBatchNorm autograd Function on one rank with the collectives left out.

    ``apply(input, weight, bias, running_mean, running_var, eps, momentum)``: the body of
    ``torch.nn.modules._functions.SyncBatchNorm`` (torch 2.13) line for line, except that its two
    collectives are not called: the one-rank ``all_gather`` of ``[mean, invstd, count]`` is replaced
    by that tensor itself (as a ``(1, 2C + 1)`` row) and the one-rank ``all_reduce`` of
    ``[sum_dy, sum_dy_xmu]`` by nothing (a one-rank sum is the identity). Every tensor operation
    torch runs stays, including the packing ``cat``s, the empty-rank mask (a boolean index, which
    makes the host wait for the GPU) and the running-stat update inside
    ``batch_norm_gather_stats_with_counts``. CUDA only (those ``torch.batch_norm_*`` ops have no
    CPU kernels); empty inputs are not supported (the benchmark has none).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
    ) -> torch.Tensor:
        input = _channels_last_or_contiguous(input)
        if weight is not None:
            weight = weight.contiguous()
        size = input.numel() // input.size(1)
        if size == 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {size}"
            )
        assert input.numel() > 0, "the benchmark's torch_sync does not handle empty inputs"
        num_channels = input.shape[1]
        mean, invstd = torch.batch_norm_stats(input, eps)
        count = torch.full((1,), size, dtype=mean.dtype, device=mean.device)
        combined = torch.cat([mean, invstd, count], dim=0)
        # torch: all_gather of `combined` into a (world_size, 2C + 1) tensor; one rank: itself.
        combined = combined.view(1, -1)
        mean_all, invstd_all, count_all = torch.split(combined, num_channels, dim=1)
        # torch drops empty ranks' rows (a device-to-host sync) unless a CUDA graph is capturing.
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            mask = count_all.squeeze(-1) >= 1
            count_all = count_all[mask]
            mean_all = mean_all[mask]
            invstd_all = invstd_all[mask]
        counts = count_all.view(-1)
        if running_mean is not None and counts.dtype != running_mean.dtype:
            counts = counts.to(running_mean.dtype)
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            input, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts
        )
        ctx.save_for_backward(input, weight, mean, invstd, count_all.to(torch.int32))
        return torch.batch_norm_elemt(input, weight, bias, mean, invstd, eps)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        grad_output = _channels_last_or_contiguous(grad_output)
        saved_input, weight, mean, invstd, count_tensor = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
            grad_output, saved_input, mean, invstd, weight, need_input, need_weight, need_bias
        )
        grad_input = None
        if need_input:
            num_channels = sum_dy.shape[0]
            combined = torch.cat([sum_dy, sum_dy_xmu], dim=0)
            # torch: all_reduce(combined, SUM) over the group; one rank: the identity.
            sum_dy, sum_dy_xmu = torch.split(combined, num_channels)
            if weight is not None and weight.dtype != mean.dtype:
                weight = weight.to(mean.dtype)
            grad_input = torch.batch_norm_backward_elemt(
                grad_output, saved_input, mean, invstd, weight, sum_dy, sum_dy_xmu, count_tensor
            )
        if weight is None or not need_weight:
            grad_weight = None
        if weight is None or not need_bias:
            grad_bias = None
        return grad_input, grad_weight, grad_bias, None, None, None, None


class TorchSyncBatchNorm(_BatchNorm):
    """:class:`torch.nn.SyncBatchNorm`'s training step on one rank, without its collectives (CUDA).

    ``nn.SyncBatchNorm`` itself falls back to plain BatchNorm when its group has one rank, so it
    cannot be timed on one GPU; this module runs what it runs in a group instead: the module's
    bookkeeping (``num_batches_tracked``, the momentum factor) and
    :class:`_TorchSyncBatchNormFunction`, torch's kernel sequence ``batch_norm_stats`` ->
    ``batch_norm_gather_stats_with_counts`` -> ``batch_norm_elemt``, backward
    ``batch_norm_backward_reduce`` -> ``batch_norm_backward_elemt``.

    Args:
        num_features: ``C``, the number of channels (dim 1).
        eps: added to the variance before the inverse square root. Default: ``1e-5``.
        momentum: weight of the new batch in the running-stat update; ``None`` for the cumulative
            average. Default: ``0.1``.

    Note:
        Training mode on CUDA tensors only; in eval mode it is plain BatchNorm.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1) -> None:
        super().__init__(num_features, eps, momentum, affine=True, track_running_stats=True)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected input of shape (N, C, *), got {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # as torch: the cumulative average reads the count on the host
            factor = 1.0 / self.num_batches_tracked.item()
        else:
            factor = self.momentum
        return _TorchSyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps, factor
        )


@dataclass
class Case:
    """One row of the table: an input shape, memory layout and dtype."""

    shape: tuple[int, ...]
    layout: str
    dtype_name: str
    ms: dict[str, float] = field(default_factory=dict)
    collectives: dict[str, int] = field(default_factory=dict)
    copy_gbps: float | None = None  # CUDA: device-to-device copy bandwidth at this row's bytes

    @property
    def label(self) -> str:
        """``shape layout dtype``, to name the row in the summary."""
        return f"{_shape_text(self.shape)} {self.layout} {self.dtype_name}"

    @property
    def nbytes(self) -> int:
        """Bytes of the input ``x`` (and of ``y``, ``dy``, ``dx``)."""
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * DTYPES[self.dtype_name].itemsize

    def gbps(self, impl: str) -> float | None:
        """``impl``'s achieved GB/s under the minimal-step byte model; ``None`` if not timed."""
        if impl not in self.ms:
            return None
        return STEP_TRAFFIC * self.nbytes / (self.ms[impl] * 1e-3) / 1e9

    def ratio(self, column: str) -> float | None:
        """``top/bottom`` of this row's times (``ext/torch``, ``torch_sync/ext``, ...), or for
        ``impl/copy`` of its GB/s over the copy's; ``None`` when an operand was not measured."""
        top, bottom = column.split("/")
        if bottom == "copy":
            ours = self.gbps(top)
            return None if ours is None or self.copy_gbps is None else ours / self.copy_gbps
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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed steps per implementation (default: "
        + ", ".join(f"{n} on {device}" for device, n in REPEATS.items())
        + ")",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps first (default: "
        + ", ".join(f"{n} on {device}" for device, n in WARMUP.items())
        + ")",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    parser.add_argument(
        "--shapes",
        type=_parse_shapes,
        default=None,
        help="comma-separated NxCxHxW (default on cpu: "
        + ",".join(_shape_text(shape) for shape in DEFAULT_SHAPES)
        + "; on cuda: "
        + ",".join(_shape_text(shape) for shape in CUDA_SHAPES)
        + ")",
    )
    parser.add_argument(
        "--impls",
        type=_parse_impls,
        default=None,
        help=f"comma-separated subset of {','.join(IMPLS)} (default on cpu: "
        f"{','.join(CPU_IMPLS)}; on cuda: {','.join(CUDA_IMPLS)}); torch_sync needs cuda",
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
        help="the one-rank process group to run in (default: gloo on cpu, none on cuda); nccl "
        "needs cuda; gloo with cuda stages tensors through host memory. ext/ref/sumsq call "
        "collectives in it, torch_sync and torch never",
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
    if args.no_group and args.group not in (None, "none"):
        parser.error(f"--no-group contradicts --group {args.group}: give one of them")
    if args.no_group:
        args.group = "none"
    elif args.group is None:
        args.group = "gloo" if args.device == "cpu" else "none"
    args.no_group = args.group == "none"
    if args.repeats is None:
        args.repeats = REPEATS[args.device]
    if args.warmup is None:
        args.warmup = WARMUP[args.device]
    if args.shapes is None:
        args.shapes = list(DEFAULT_SHAPES if args.device == "cpu" else CUDA_SHAPES)
    if args.impls is None:
        args.impls = list(CPU_IMPLS if args.device == "cpu" else CUDA_IMPLS)
    if args.no_group:
        args.impls = [impl for impl in args.impls if impl != "sumsq"]
    for name, least in (("repeats", 1), ("warmup", 0), ("threads", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            parser.error(f"--{name} must be >= {least}, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available to this torch")
    cuda_only = [impl for impl in args.impls if impl in CUDA_ONLY_IMPLS]
    if cuda_only and args.device != "cuda":
        parser.error(
            f"--impls {','.join(cuda_only)} needs --device cuda: torch.batch_norm_stats, "
            f"batch_norm_elemt and the other SyncBatchNorm kernels it runs exist for CUDA only"
        )
    if args.group == "nccl" and args.device != "cuda":
        parser.error("--group nccl needs --device cuda; use --group gloo or none on cpu")
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
    elif impl == "torch_sync":
        layer = TorchSyncBatchNorm(channels)
    elif impl == "torch":
        layer = nn.BatchNorm2d(channels)
    else:
        layer = SumSqSyncBatchNorm(channels)
    layer = layer.to(device).train()
    with torch.no_grad():  # non-trivial affine parameters, the same for every implementation
        generator = torch.Generator().manual_seed(channels)
        layer.weight.copy_(torch.rand(channels, generator=generator) + 0.5)
        layer.bias.copy_(torch.randn(channels, generator=generator))
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


def _count_collectives(step: Callable[[], None], impl: str, device: torch.device) -> int:
    """How many torch.distributed collectives one (untimed) ``step`` of ``impl`` issues."""
    counts: dict[str, int] = {}
    with count_collectives(COLLECTIVES, counts):
        _timed(step, impl, device)
    return sum(counts.values())


def _timed(step: Callable[[], None], impl: str, device: torch.device) -> float:
    """Seconds of one ``step`` under ``SYNCBN_IMPL`` for ``impl``: wall time on CPU, GPU time
    between CUDA events on CUDA (see :func:`_timed_cuda`)."""
    with env_var(syncbn_impl.IMPL_ENV, impl if impl in ("ext", "ref") else None):
        if device.type == "cuda":
            return _timed_cuda(step, device)
        start = time.perf_counter()
        step()
        return time.perf_counter() - start


def _timed_cuda(step: Callable[[], None], device: torch.device) -> float:
    """GPU seconds of one ``step``: from a CUDA event recorded before it to one recorded after.

    A spin kernel of about :data:`SPIN_MS` runs first, so that the host has queued the whole step
    (and the end event) before the GPU reaches the start event: the interval is then the GPU's
    time for the step's kernels, without the host's launch overhead, except where the step makes
    the host wait for the GPU (a device-to-host read), whose gap up to the next launch counts.
    """
    with torch.cuda.device(device):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_spin_cycles(torch.cuda.current_device()))
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3


@functools.cache
def _spin_cycles(device_index: int) -> int:
    """GPU clock cycles for ``torch.cuda._sleep`` to spin about :data:`SPIN_MS` on the device."""
    with torch.cuda.device(device_index):
        probe = 1_000_000
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(probe)  # first launch: module load, clocks ramping up
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        probe_ms = max(start.elapsed_time(end), 1e-3)
        # Bounded, so that a bogus probe cannot make every step spin for seconds.
        return min(max(int(probe * SPIN_MS / probe_ms), 1), 100 * probe)


def _copy_gbps(nbytes: int, device: torch.device, repeats: int, warmup: int) -> float:
    """Device-to-device copy bandwidth (GB/s, 2 x ``nbytes`` moved) of ``dst.copy_(src)``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def step() -> None:
        dst.copy_(src)

    for _ in range(warmup):
        _timed(step, "copy", device)
    seconds = statistics.median(_timed(step, "copy", device) for _ in range(repeats))
    return COPY_TRAFFIC * nbytes / seconds / 1e9


def _measure(
    case: Case, impls: Sequence[str], device: torch.device, repeats: int, warmup: int
) -> None:
    """Fill ``case.ms`` with each implementation's median step time (milliseconds)."""
    x, dy = _make_inputs(case.shape, case.layout, DTYPES[case.dtype_name], device)
    steps = {impl: _step_fn(_make_layer(impl, case.shape[1], device), x, dy) for impl in impls}
    case.collectives = {impl: _count_collectives(steps[impl], impl, device) for impl in impls}
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(warmup):
        for impl in impls:
            _timed(steps[impl], impl, device)
    for _ in range(repeats):  # interleaved, so drifts in machine load hit all alike
        for impl in impls:
            times[impl].append(_timed(steps[impl], impl, device))
    case.ms = {impl: 1e3 * statistics.median(values) for impl, values in times.items()}


def _cases(args: argparse.Namespace) -> list[Case]:
    """All (shape, layout, dtype) rows, in table order."""
    return [
        Case(shape, layout, dtype_name)
        for shape in args.shapes
        for layout in LAYOUTS
        for dtype_name in DTYPES
    ]


def _format_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _table_head(impls: Sequence[str], device: torch.device) -> list[str]:
    """The markdown table's header: shape, layout, dtype, ms per implementation, two ratios; on
    CUDA also the tensor size and ext's bandwidth against a device-to-device copy."""
    header = ["shape", "layout", "dtype"]
    if device.type == "cuda":
        header.append("MiB")
    header += [f"{impl} ms" for impl in impls]
    header += RATIO_COLUMNS[device.type]
    if device.type == "cuda":
        header += ["ext GB/s", "copy GB/s", "ext/copy"]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]


def _table_row(case: Case, impls: Sequence[str], device: torch.device) -> str:
    """One measured row of the markdown table."""
    cells = [_shape_text(case.shape), case.layout, case.dtype_name]
    if device.type == "cuda":
        cells.append(f"{case.nbytes / MIB:.1f}")
    # Sub-0.1 ms GPU steps need more digits than the CPU table's two.
    precision = 3 if device.type == "cuda" else 2
    cells += [f"{case.ms[impl]:.{precision}f}" for impl in impls]
    cells += [_format_ratio(case.ratio(column)) for column in RATIO_COLUMNS[device.type]]
    if device.type == "cuda":
        ours = case.gbps("ext")
        cells.append("-" if ours is None else f"{ours:.0f}")
        cells.append("-" if case.copy_gbps is None else f"{case.copy_gbps:.0f}")
        cells.append(_format_ratio(case.ratio("ext/copy")))
    return "| " + " | ".join(cells) + " |"


def _goal_line(goal: Goal, cases: Sequence[Case], verdict: bool) -> str:
    """How many rows meet ``goal`` and which do not; with ``verdict``, led by PASS/FAIL and with
    the worst row."""
    rows = [
        c
        for c in cases
        if (goal.layouts is None or c.layout in goal.layouts) and c.nbytes >= goal.min_bytes
    ]
    rated = [(c, c.ratio(goal.column)) for c in rows]
    rated = [(c, r) for c, r in rated if r is not None]
    if not rated:
        if rows or not cases:
            why = f"needs {goal.column.replace('/', ' and ')}"
        else:
            why = f"no row has an input of >= {goal.min_bytes / MIB:.0f} MiB"
        if verdict:
            return f"- NOT MEASURED {goal.title}: {why}"
        return f"- {goal.title}: not measured ({why})"
    below = goal.sense == ">="
    failed = [(c, r) for c, r in rated if (r < goal.bound if below else r > goal.bound)]
    met = len(rated) - len(failed)
    text = f"- {goal.title}: {met}/{len(rated)} rows meet it"
    if verdict:
        worst, ratio = (min if below else max)(rated, key=lambda item: item[1])
        text = f"- {'FAIL' if failed else 'PASS'} {text[2:]}; worst: {worst.label} "
        text += f"({goal.column} {ratio:.3f})"
    if failed:
        text += "; not met: " + "; ".join(f"{c.label} ({goal.column} {r:.3f})" for c, r in failed)
    return text


def _summary(cases: Sequence[Case], group: str, device: torch.device) -> list[str]:
    """One line per goal of ``device``: how many rows meet it, and every row that does not (on
    CUDA: PASS/FAIL and the worst row), then the collectives each implementation called."""
    cuda = device.type == "cuda"
    lines = ["", "Goals:"]
    lines += [_goal_line(goal, cases, verdict=cuda) for goal in (CUDA_GOALS if cuda else GOALS)]
    counts = {impl: sorted({c.collectives[impl] for c in cases}) for impl in cases[0].collectives}
    lines.append(
        "- torch.distributed collectives per step "
        + ("(no process group): " if group == "none" else f"(one-rank {group} group): ")
        + ", ".join(f"{impl} {'/'.join(map(str, n))}" for impl, n in counts.items())
        + "; an implementation with 0 times no communication at all."
    )
    if cuda and max(counts.get("ext", [0])) > 0 and "torch_sync" in counts:
        lines.append(
            "- Note: ext's times include its one-rank collectives and torch_sync's include none; "
            "run with --group none for the kernel-against-kernel comparison."
        )
    return lines


def _header(args: argparse.Namespace, device: torch.device) -> list[str]:
    """The run's context: device, torch, threads, CPU, repeat counts and what is measured."""
    if device.type == "cuda":
        return _cuda_header(args, device)
    return [
        f"# bench_kernels: device={device.type}, torch {torch.__version__}, "
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


def _cuda_header(args: argparse.Namespace, device: torch.device) -> list[str]:
    """:func:`_header` for CUDA: the GPU, torch/CUDA/cuDNN versions, timing and byte model."""
    props = torch.cuda.get_device_properties(device)
    if args.no_group:
        group = "No process group: no implementation calls a collective (kernels against kernels). "
    else:
        group = (
            f"One-rank {args.group} group: ext/ref/sumsq call their collectives in it "
            "(ext: all_gather forward, all_reduce backward), torch_sync and torch none. "
        )
    return [
        f"# bench_kernels: device=cuda ({torch.cuda.get_device_name(device)}, "
        f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB), "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version()}, threads={torch.get_num_threads()}, "
        f"CPU: {cpu_model()}",
        "",
        f"Median forward+backward GPU time per step (ms) over {args.repeats} repeats after "
        f"{args.warmup} warm-up steps, implementations interleaved step by step; each step between "
        f"CUDA events, queued behind a ~{SPIN_MS:g} ms GPU spin so that host launch overhead is "
        "hidden (a host wait inside a step still counts).",
        "ext: syncbn_lightning.SyncBatchNorm(force_sync=True), SYNCBN_IMPL=ext (our CUDA kernels "
        "local_stats, merge_stats, normalize, backward_reduce, backward_elemt); torch_sync: "
        "torch's nn.SyncBatchNorm kernel sequence (batch_norm_stats, "
        "batch_norm_gather_stats_with_counts incl. its empty-rank mask and running-stat update, "
        "batch_norm_elemt; batch_norm_backward_reduce, batch_norm_backward_elemt) with its "
        "collectives left out; torch: nn.BatchNorm2d (cuDNN where torch picks it), no sync. "
        + group
        + "bf16 inputs use float32 parameters.",
        "Ratios torch_sync/ext and torch/ext are ms ratios, i.e. ext's speedup (> 1: ext "
        f"faster). ext GB/s = {STEP_TRAFFIC} x the input's bytes (minimal step: forward reads x "
        "twice and writes y, backward reads dy and x twice and writes dx) / ext's time; copy "
        f"GB/s = {COPY_TRAFFIC} x the input's bytes / median time of a device-to-device "
        "dst.copy_(src) of as many bytes; ext/copy = their ratio. MiB = the input's size.",
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
        ext = _backend.load_extension()  # build (first run, ~30 s) before anything is timed
        if device.type == "cuda" and not ext.with_cuda:
            raise SystemExit(
                "--device cuda: the syncbn_lightning extension was built without its CUDA kernels "
                "(it needs a CUDA torch, a visible GPU and nvcc under CUDA_HOME at build time); "
                f"build dir: {_backend.build_dir()}"
            )
    cases = _cases(args)
    report = _header(args, device) + _table_head(args.impls, device)
    print("\n".join(report), flush=True)
    before = _cpu_seconds()
    copy_gbps: dict[int, float] = {}  # by byte count: measured once per tensor size
    group = contextlib.nullcontext() if args.no_group else _single_rank_group(args.group)
    with group:
        for case in cases:  # rows are printed as they are measured
            _measure(case, args.impls, device, args.repeats, args.warmup)
            if device.type == "cuda":
                if case.nbytes not in copy_gbps:
                    copy_gbps[case.nbytes] = _copy_gbps(
                        case.nbytes, device, args.repeats, args.warmup
                    )
                case.copy_gbps = copy_gbps[case.nbytes]
            report.append(_table_row(case, args.impls, device))
            print(report[-1], flush=True)
    summary = _summary(cases, args.group, device) + _contention_line(before, _cpu_seconds())
    print("\n".join(summary), flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(report + summary) + "\n")


if __name__ == "__main__":
    main()
