"""One BatchNorm layer's forward + backward on a GPU, every implementation by CUDA-graph replay.

    python benchmarks/bench_layer.py                    # the issue's rows and more
    python benchmarks/bench_layer.py --profile          # + each implementation's kernels (µs)
    python benchmarks/bench_layer.py --shapes 32x1024x14x14 --dtypes bfloat16 --layouts CL
    python benchmarks/bench_layer.py --act silu          # BatchNorm + SiLU (timm's BatchNormAct2d)

One step = ``y = layer(x); torch.autograd.grad(y, (x, weight, bias), dy)``. Implementations:

* ``ours``: :class:`syncbn_lightning.SyncBatchNorm` with ``force_sync=True`` and
  ``SYNCBN_IMPL=ext``: every kernel and both collectives of a real group (the gather exchange);
* ``ours_reduce``: the same with ``exchange="reduce"`` forced (its all-reduce of shifted float64
  sums; what ``auto`` picks in GPU groups of more than 8 ranks);
* ``torch_sync``: ``nn.SyncBatchNorm`` forced through torch's sync Function
  (:class:`_common.ForcedTorchSyncBatchNorm`): its kernels and both collectives;
* ``plain``: ``nn.BatchNorm2d`` (cuDNN), no synchronization: the floor.

With ``--act NAME`` every implementation computes ``act(bn(x))``: ours is
:class:`syncbn_lightning.SyncBatchNormAct` (the activation fused into its kernels), the others
are followed by the activation module (what timm's ``SyncBatchNormAct`` and ``BatchNormAct2d``
run).

All run in one one-rank NCCL group. Each step is captured once in a CUDA graph; a sample is
``--replays`` back-to-back replays between two CUDA events, divided by ``--replays``; the table
gives the median of ``--samples`` samples, the implementations interleaved sample by sample. No
host work is timed for any of them (torch's host sync on the counts is skipped under capture, as
torch itself does). bfloat16 inputs keep float32 parameters (autocast's setup).

Bandwidth: a minimal fwd+bwd moves 8x the bytes of ``x`` (forward: read x for the statistics,
read x and write y; backward: read dy and x for the sums, read dy and x and write dx).
``ours/copy`` = that rate over a captured device-to-device copy of the same bytes (2x moved).
Below the L2 size (50 MiB on an H100) both run partly from cache: only rows of >= 64 MiB count
for the bandwidth goal.

``--profile`` runs each implementation's step a few times eagerly under ``torch.profiler`` and
lists its GPU kernels with their mean µs per step (the same kernels the graph replays).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from _common import (
    ForcedTorchSyncBatchNorm,
    capture_graph,
    csv_list,
    env_var,
    init_affine,
    one_rank_group,
    ratio_text,
    replay_ms,
    value_text,
)
from torch import nn

import syncbn_lightning
from syncbn_lightning.ops import dispatch as syncbn_impl
from syncbn_lightning.ops.activations import ACTIVATIONS, make_activation

IMPLS = ("ours", "ours_reduce", "torch_sync", "plain")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYOUTS = ("NCHW", "CL")
# (shape, dtype, layout): the issue's five rows, then ResNet-50's other stages and a detection
# FPN level (2 images of 800x1344, stride 4).
DEFAULT_CASES = (
    ((32, 256, 56, 56), "float32", "NCHW"),
    ((32, 256, 56, 56), "bfloat16", "CL"),
    ((32, 64, 112, 112), "bfloat16", "CL"),
    ((32, 1024, 14, 14), "bfloat16", "CL"),
    ((32, 1024, 14, 14), "float32", "NCHW"),
    ((32, 64, 112, 112), "float32", "NCHW"),
    ((32, 512, 28, 28), "bfloat16", "CL"),
    ((32, 2048, 7, 7), "bfloat16", "CL"),
    ((2, 256, 200, 336), "float32", "NCHW"),
    ((2, 256, 200, 336), "bfloat16", "CL"),
)
STEP_TRAFFIC, COPY_TRAFFIC = 8, 2
MIB = 2**20
SPEEDUP_GOAL, COPY_GOAL = 1.2, 0.8


@dataclass
class Case:
    """One row: an input shape, dtype and layout, and what was measured for it."""

    shape: tuple[int, ...]
    dtype: str
    layout: str
    ms: dict[str, float] = field(default_factory=dict)
    copy_ms: float | None = None

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * DTYPES[self.dtype].itemsize

    def label(self) -> str:
        return f"{'x'.join(map(str, self.shape))} {self.dtype} {self.layout}"


def _layer(impl: str, channels: int, device: torch.device, act: str | None) -> nn.Module:
    """The implementation's layer, followed by ``act`` (ours fuses it); its BatchNorm is
    ``layer.bn`` for the parameters."""
    if impl in ("ours", "ours_reduce"):
        # ours: the gather exchange (auto's choice in one rank); ours_reduce: reduce forced.
        options = {"force_sync": True, "exchange": "reduce" if impl == "ours_reduce" else "auto"}
        if act is None:
            bn: nn.Module = syncbn_lightning.SyncBatchNorm(channels, **options)
        else:
            bn = syncbn_lightning.SyncBatchNormAct(channels, act=act, **options)
            assert bn.fused_activation is not None, act
        layer = _WithBN(bn, None)
    else:
        bn = (
            ForcedTorchSyncBatchNorm(channels) if impl == "torch_sync" else nn.BatchNorm2d(channels)
        )
        layer = _WithBN(bn, None if act is None else make_activation(act))
    layer = layer.to(device).train()
    init_affine(layer.bn, channels)
    return layer


class _WithBN(nn.Module):
    """``act(bn(x))`` (``act`` None: ``bn(x)``), the BatchNorm reachable as ``.bn``."""

    def __init__(self, bn: nn.Module, act: nn.Module | None) -> None:
        super().__init__()
        self.bn, self.act = bn, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x)
        return y if self.act is None else self.act(y)


def _inputs(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    fmt = torch.channels_last if case.layout == "CL" else torch.contiguous_format
    dtype = DTYPES[case.dtype]
    x = torch.randn(case.shape, generator=generator, device=device).mul_(2).add_(0.5)
    dy = torch.randn(case.shape, generator=generator, device=device)
    x = x.to(dtype=dtype, memory_format=fmt).requires_grad_(True)
    return x, dy.to(dtype=dtype, memory_format=fmt)


def _step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], None]:
    params = (x, layer.bn.weight, layer.bn.bias)

    def step() -> None:
        torch.autograd.grad(layer(x), params, dy)

    return step


def _measure(case: Case, args: argparse.Namespace, device: torch.device) -> None:
    """Fill ``case.ms`` (median ms per replay of each implementation) and ``case.copy_ms``."""
    x, dy = _inputs(case, device)
    # The layers must outlive their graphs: a replay reads and writes their parameters and buffers.
    layers = {impl: _layer(impl, case.shape[1], device, args.act) for impl in args.impls}
    graphs = {impl: capture_graph(_step(layer, x, dy), device) for impl, layer in layers.items()}
    src = torch.empty(case.nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    graphs["copy"] = capture_graph(lambda: dst.copy_(src), device)
    samples: dict[str, list[float]] = defaultdict(list)
    for graph in graphs.values():
        replay_ms(graph, args.replays)  # warm-up
    for _ in range(args.samples):  # interleaved, so that clock and thermal drift hit all alike
        for name, graph in graphs.items():
            samples[name].append(replay_ms(graph, args.replays))
    medians = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
    case.copy_ms = medians.pop("copy")
    case.ms = medians


def _profile(case: Case, args: argparse.Namespace, device: torch.device, steps: int = 5) -> None:
    """Print each implementation's GPU kernels for ``case``: mean µs per step, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    x, dy = _inputs(case, device)
    print(f"\n### kernels of {case.label()} (eager, mean of {steps} steps)\n")
    print("| impl | kernel | µs/step |")
    print("|---|---|---:|")
    for impl in args.impls:
        step = _step(_layer(impl, case.shape[1], device, args.act), x, dy)
        for _ in range(3):
            step()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
        totals: dict[str, float] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                name = _short_kernel_name(event.name)
                totals[name] = totals.get(name, 0.0) + event.device_time / steps
        for name, us in totals.items():
            print(f"| {impl} | `{name}` | {us:.1f} |")
        print(f"| {impl} | **{len(totals)} kernels, sum** | **{sum(totals.values()):.1f}** |")


def _short_kernel_name(name: str, limit: int = 110) -> str:
    """A kernel's name without namespaces and ``void``, cut to ``limit`` characters."""
    for noise in ("void ", "syncbn::", "(anonymous namespace)::", "at::native::", "c10::"):
        name = name.replace(noise, "")
    return name[:limit]


def _report(cases: Sequence[Case], args: argparse.Namespace, device: torch.device) -> list[str]:
    name = torch.cuda.get_device_name(device)
    lines = [
        f"device: {name} | torch {torch.__version__} | CUDA {torch.version.cuda}",
        f"command: python benchmarks/bench_layer.py {' '.join(sys.argv[1:])}",
        f"layer: BatchNorm{f' + {args.act}' if args.act else ''}",
        f"median of {args.samples} samples of {args.replays} graph replays each\n",
    ]
    head = [f"{impl} µs" for impl in args.impls]
    ratios = ["torch_sync/ours", "ours_reduce/ours", "ours/plain", "ours/copy"]
    lines.append("| shape dtype layout | MiB | " + " | ".join(head + ratios) + " |")
    lines.append("|---|---:|" + "---:|" * (len(head) + len(ratios)))
    goals: list[str] = []
    for case in cases:
        ours, reduce, sync, plain = (
            case.ms.get(i) for i in ("ours", "ours_reduce", "torch_sync", "plain")
        )
        copy_ratio = None
        if ours and case.copy_ms:
            copy_ratio = (STEP_TRAFFIC / COPY_TRAFFIC) * case.copy_ms / ours
        cells = [f"{case.ms[i] * 1e3:.1f}" for i in args.impls]
        cells += [ratio_text(sync, ours), ratio_text(reduce, ours), ratio_text(ours, plain)]
        cells.append(value_text(copy_ratio))
        lines.append(f"| {case.label()} | {case.nbytes / MIB:.0f} | " + " | ".join(cells) + " |")
        if ours and sync:
            ok = sync / ours >= SPEEDUP_GOAL
            goals.append(
                f"{'PASS' if ok else 'FAIL'} {case.label()}: torch_sync/ours "
                f"{sync / ours:.2f} (>= {SPEEDUP_GOAL})"
            )
        if copy_ratio is not None and case.nbytes >= 64 * MIB:
            ok = copy_ratio >= COPY_GOAL
            goals.append(
                f"{'PASS' if ok else 'FAIL'} {case.label()}: ours/copy {copy_ratio:.2f} "
                f"(>= {COPY_GOAL} at >= 64 MiB)"
            )
    return [*lines, "", *goals]


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=csv_list, help="NxCxHxW,... (default: the built-in rows)")
    parser.add_argument("--dtypes", type=csv_list, default=["float32", "bfloat16"])
    parser.add_argument("--layouts", type=csv_list, default=list(LAYOUTS))
    parser.add_argument("--impls", type=csv_list, default=list(IMPLS))
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="also list each impl's kernels")
    parser.add_argument(
        "--act",
        choices=[a.name for a in ACTIVATIONS if a.name != "identity"],
        help="BatchNorm + this",
    )
    args = parser.parse_args(argv)
    for name, allowed in (("dtypes", DTYPES), ("layouts", LAYOUTS), ("impls", IMPLS)):
        bad = [v for v in getattr(args, name) if v not in allowed]
        if bad:
            parser.error(f"--{name}: {bad} not in {list(allowed)}")
    if args.shapes:
        try:
            shapes = [tuple(int(n) for n in s.lower().split("x")) for s in args.shapes]
        except ValueError:
            parser.error(f"--shapes: {args.shapes} is not NxCxHxW,... (e.g. 32x256x56x56)")
        args.cases = [(s, d, lay) for s in shapes for d in args.dtypes for lay in args.layouts]
    else:
        args.cases = [c for c in DEFAULT_CASES if c[1] in args.dtypes and c[2] in args.layouts]
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (CUDA-graph replay); on CPU use bench_kernels.py")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    device = torch.device("cuda")
    cases = [Case(shape, dtype, layout) for shape, dtype, layout in args.cases]
    with one_rank_group(device), env_var(syncbn_impl.IMPL_ENV, "ext"):
        for case in cases:
            _measure(case, args, device)
            if args.profile:
                _profile(case, args, device)
    print("\n" + "\n".join(_report(cases, args, device)))


if __name__ == "__main__":
    main()
