"""Where one eager train step's host time goes, per BN layer: plain vs ours vs torch SyncBN.

    python benchmarks/profile_eager.py --out /tmp/prof                     # ResNet-50 bf16-cl b32
    python benchmarks/profile_eager.py --device cpu --model tiny --batch 4 --size 32 --out /tmp/p

For each implementation (``bench_model.py``'s: plain BatchNorm, ours with the gather and the
reduce exchange, torch's SyncBatchNorm forced through its sync Function; one-rank group, every
kernel and collective of a real group), after a warm-up:

1. **Syncs** (CUDA only): one step under ``torch.cuda.set_sync_debug_mode("warn")``; every
   host-device synchronization is recorded with the Python frames that caused it
   (``syncs_<impl>.txt``), counted per step.
2. **Profile**: ``--steps`` eager steps under ``torch.profiler`` (CPU and CUDA activity); the
   Chrome trace (``trace_<impl>.json``) and the operator table (``ops_<impl>.txt``) are written,
   and every event's *self* host time is put in one category: sync (stream/device/event syncs,
   blocking copies, ``aten::_local_scalar_dense``), launch (kernel launches), copy (async
   memcpy), collective (c10d, NCCL, gloo), allocator (``cudaMalloc``/``cudaFree``), syncbn ops,
   aten ops, autograd (the engine's nodes), other.
3. **Dispatcher ops** per step (``TorchDispatchMode``), the step's host wall time (median of the
   profiled steps, each between two device syncs) and kernels per step.

Prints one markdown table per implementation (µs per step and per BN layer; ``over plain``:
this implementation's time minus plain BatchNorm's, per layer) and a summary, with the device
line and the command. Host time of the backward thread is included (the autograd engine runs
CUDA backwards on its own thread), so a category's sum may exceed the step's wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from _common import OpCounter, csv_list, env_var, one_rank_group
from bench_model import CUDA_ONLY, IMPLS, _device_line, _model, _train_step, _with_impl, impl_env
from torch import nn

from syncbn_lightning.ops.impl_names import IMPL_ENV

CATEGORIES = (
    "sync",
    "launch",
    "copy",
    "collective",
    "allocator",
    "syncbn",
    "aten",
    "autograd",
    "other",
)
_SYNC_NAMES = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "aten::_local_scalar_dense",
    "cudaStreamWaitEvent_blocking",
)
_COLLECTIVE_MARKS = ("nccl", "c10d", "record_param_comms", "gloo", "ProcessGroup")


def category(name: str) -> str:
    """The host-cost category of a profiler event ``name`` (see the module docstring)."""
    if name in _SYNC_NAMES:
        return "sync"
    if name.startswith(("cudaLaunch", "cuLaunch")):
        return "launch"
    if name.startswith("cudaMemcpy") or name.startswith("cudaMemset"):
        return "copy"
    if any(mark in name for mark in _COLLECTIVE_MARKS):
        return "collective"
    if name.startswith(("cudaMalloc", "cudaFree", "cudaHostAlloc", "[memory]")):
        return "allocator"
    if name.startswith("syncbn::"):
        return "syncbn"
    if name.startswith("aten::"):
        return "aten"
    if "Backward" in name or name.startswith(("autograd::", "torch::autograd")):
        return "autograd"
    return "other"


def bn_layers(model: nn.Module) -> int:
    """Number of batch-norm layers (ours, torch's, plain) in ``model``."""
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def record_syncs(step: Callable[[], None], device: torch.device) -> list[str]:
    """One ``step`` under the sync debug mode ``warn``: each sync's message and Python stack."""
    if device.type != "cuda":
        return []
    found: list[str] = []

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        stack = "".join(traceback.format_stack(limit=12)[:-1])
        found.append(f"{message}\n{stack}")

    _sync(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    _sync(device)
    return found


def profile_steps(
    step: Callable[[], None], device: torch.device, steps: int, trace: Path
) -> tuple[Any, list[float]]:
    """``steps`` steps under ``torch.profiler``; the profile (its Chrome trace written to
    ``trace``) and each step's host wall time in ms (between two device syncs)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    times = []
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
    prof.export_chrome_trace(str(trace))
    return prof, times


def host_us_by_category(prof: Any) -> tuple[dict[str, float], int]:
    """Self host time (µs, all steps) per category, and the number of device kernels."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    kernels = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            continue
        totals[category(event.name)] += event.self_cpu_time_total
    return totals, kernels


def measure(args: argparse.Namespace, impl: str, out: Path) -> dict[str, Any]:
    """Everything of the module docstring for one implementation."""
    with impl_env(impl):
        return _measure(args, impl, out)


def _measure(args: argparse.Namespace, impl: str, out: Path) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = _with_impl(_model(args.model), impl, args.model).to(device).train()
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    if args.config == "bf16-cl":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    step = _train_step(model, x, y, args.config)
    for _ in range(args.warmup):
        step()
    syncs = record_syncs(step, device)
    (out / f"syncs_{impl}.txt").write_text("\n".join(syncs) or "no host-device sync\n")
    with OpCounter() as counter:
        step()
    _sync(device)
    prof, times = profile_steps(step, device, args.steps, out / f"trace_{impl}.json")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
    (out / f"ops_{impl}.txt").write_text(table)
    totals, kernels = host_us_by_category(prof)
    return {
        "layers": bn_layers(model),
        "syncs": len(syncs),
        "ops": sum(counter.ops.values()),
        "ops_by_name": counter.ops,
        "wall_ms": statistics.median(times),
        "us": {k: v / args.steps for k, v in totals.items()},
        "kernels": kernels / args.steps,
    }


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    """The markdown tables of the module docstring."""
    device = torch.device(args.device)
    plain = results.get("plain")
    lines = [
        f"device: {_device_line(device)}",
        f"command: python benchmarks/profile_eager.py {' '.join(sys.argv[1:])}",
        f"model: {args.model} {args.config} b{args.batch} {args.size}px, "
        f"{args.steps} profiled steps after {args.warmup} warm-up\n",
        "| BN | layers | step ms | syncs/step | dispatcher ops/step | kernels/step | "
        "over plain: step µs/layer | ops/layer | kernels/layer |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for impl, r in results.items():
        n = max(r["layers"], 1)
        over = (
            ((r["wall_ms"] - plain["wall_ms"]) * 1e3 / n, (r["ops"] - plain["ops"]) / n,
             (r["kernels"] - plain["kernels"]) / n)
            if plain and impl != "plain" else None
        )  # fmt: skip
        cells = "| - | - | - |" if over is None else "| {:.0f} | {:.1f} | {:.1f} |".format(*over)
        lines.append(
            f"| {impl} | {r['layers']} | {r['wall_ms']:.1f} | {r['syncs']} | {r['ops']} | "
            f"{r['kernels']:.0f} {cells}"
        )
    lines += [
        "\nSelf host time per step by category, µs (per BN layer over plain in brackets):\n",
        "| BN | " + " | ".join(CATEGORIES) + " |",
        "|---|" + "---:|" * len(CATEGORIES),
    ]
    for impl, r in results.items():
        n = max(r["layers"], 1)
        cells = []
        for cat in CATEGORIES:
            value = r["us"][cat]
            extra = f" ({(value - plain['us'][cat]) / n:+.0f})" if plain and impl != "plain" else ""
            cells.append(f"{value:.0f}{extra}")
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    if plain:
        lines.append("\nDispatcher ops per step beyond plain's (name: count):\n")
        for impl, r in results.items():
            if impl == "plain":
                continue
            extra = Counter(r["ops_by_name"])
            extra.subtract(plain["ops_by_name"])
            top = ", ".join(f"{k} {v:+d}" for k, v in extra.most_common(12) if v)
            lines.append(f"- {impl}: {top}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="resnet50", help="resnet50, tiny or timm:NAME")
    parser.add_argument("--config", default="bf16-cl", choices=("fp32-nchw", "bf16-cl"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--impls", type=csv_list, help=f"default: all of {IMPLS} the device has")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True, help="folder for traces and tables")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.impls = args.impls or [i for i in IMPLS if cuda or i not in CUDA_ONLY]
    unknown = [i for i in args.impls if i not in IMPLS]
    if unknown:
        parser.error(f"--impls: {unknown} not in {list(IMPLS)}")
    for impl in args.impls:
        if impl in CUDA_ONLY and not cuda:
            parser.error(f"--impls {impl} needs --device cuda")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    device = torch.device(args.device)
    with one_rank_group(device), env_var(IMPL_ENV, "ext"):
        for impl in args.impls:
            results[impl] = measure(args, impl, args.out)
    text = report(args, results)
    (args.out / "profile.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
