"""Whole-network train step: plain BatchNorm vs our SyncBatchNorm vs torch's SyncBatchNorm.

    python benchmarks/bench_model.py --device cuda                       # ResNet-50 (torchvision)
    python benchmarks/bench_model.py --device cpu --model tiny --batch 4 --size 32 --steps 3
    python benchmarks/bench_model.py --model timm:efficientnet_b0     # BatchNormAct2d + SiLU (timm)

One train step = forward, cross-entropy loss, backward, SGD (momentum) step. The BN layers are:

* ``plain``: the model's own ``nn.BatchNorm2d`` (cuDNN on a GPU): the floor;
* ``ours``: converted by :func:`syncbn_lightning.convert_sync_batchnorm`, every layer with
  ``force_sync=True`` and ``SYNCBN_IMPL=ext``, so a one-rank group pays every kernel and
  collective of a real group (the gather exchange, ``auto``'s choice in one rank);
* ``ours_reduce``: the same with ``exchange="reduce"`` forced (the exchange ``auto`` picks in
  GPU groups of more than 8 ranks);
* ``ours_fused``: ``ours`` converted with ``fuse_residual=True``: every residual block's BN, add
  and ReLU as one fused call (:meth:`syncbn_lightning.SyncBatchNorm.add_act`);
* ``ours_native``, ``ours_native_fused`` (CUDA only): ``ours`` and ``ours_fused`` with
  ``SYNCBN_NATIVE_CUDA=1``: every layer call is one C++ operator per direction
  (``syncbn::sync_batch_norm``) instead of the Python Function (the others run with
  ``SYNCBN_NATIVE_CUDA=0``);
* ``torch_sync`` (CUDA only): ``nn.SyncBatchNorm`` forced through torch's own sync Function
  (``torch.nn.modules._functions.SyncBatchNorm``) the same way.

A ``timm:NAME`` model (timm's BatchNormAct2d layers: batch norm, then the activation module) is
converted by our converter to :class:`syncbn_lightning.SyncBatchNormAct` (activation fused) and,
for ``torch_sync``, by timm's own converter to its SyncBatchNormAct (torch's SyncBatchNorm, then
the activation module), forced the same way.

A one-rank process group (NCCL on CUDA, gloo on CPU) makes the collectives real. Two modes, each
measured the same way for every implementation:

* ``eager``: whole steps timed from the host (host work included for all); with ``--rounds R``
  the implementations' models are built once and measured in R interleaved rounds (each round
  every implementation in turn), and a cell is the median of the R rounds' medians;
* ``graph`` (CUDA only): the whole step captured once in a CUDA graph and replayed (host work
  excluded for all), timed with CUDA events.

Configurations: ``fp32-nchw`` (float32, contiguous) and ``bf16-cl`` (bfloat16 autocast,
channels-last model and input). Prints one markdown table with the device line, the versions
and the command, and the issue's goals: graph step ours <= 1.05x plain, eager ours at least as
fast as torch_sync; with ``ours_native``: eager ours_native <= 1.3x plain and torch_sync's step
>= 2x ours_native's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _common import (
    capture_graph,
    cpu_model,
    csv_list,
    env_var,
    force_torch_sync,
    median_replay_ms,
    one_rank_group,
    ratio_text,
)
from torch import nn

import syncbn_lightning
from syncbn_lightning.ops.impl_names import IMPL_ENV, NATIVE_CUDA_ENV

CONFIGS = ("fp32-nchw", "bf16-cl")
IMPLS = (
    "plain",
    "ours",
    "ours_reduce",
    "ours_fused",
    "ours_native",
    "ours_native_fused",
    "torch_sync",
)
CUDA_ONLY = ("ours_native", "ours_native_fused", "torch_sync")
MODES = ("eager", "graph")


def _tiny_model(classes: int = 10) -> nn.Module:
    """Six conv-BN-ReLU blocks and a linear head: the CPU smoke test's stand-in for ResNet-50."""
    layers: list[nn.Module] = []
    channels = 3
    for width, stride in ((16, 1), (32, 2), (32, 1), (64, 2), (64, 1), (128, 2)):
        layers += [
            nn.Conv2d(channels, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        ]
        channels = width
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers, *head)


def _model(name: str) -> nn.Module:
    if name == "tiny":
        return _tiny_model()
    if name.startswith("timm:"):
        return _timm().create_model(name[5:], num_classes=10)
    try:
        import torchvision
    except ImportError:
        raise SystemExit(
            "--model resnet50 needs torchvision (pip install torchvision); use --model tiny"
        ) from None
    return torchvision.models.resnet50(weights=None)


def _timm() -> Any:
    try:
        import timm
    except ImportError:
        raise SystemExit("--model timm:NAME needs timm (pip install timm)") from None
    return timm


def impl_env(impl: str) -> Any:
    """The environment an implementation's calls run in: ``SYNCBN_NATIVE_CUDA`` 1 for the C++
    path's rows, 0 for the others (a layer reads it when it makes its plan, at its first call)."""
    return env_var(NATIVE_CUDA_ENV, "1" if impl.startswith("ours_native") else "0")


def _with_impl(model: nn.Module, impl: str, name: str) -> nn.Module:
    if impl.startswith("ours"):
        exchange = "reduce" if impl == "ours_reduce" else "auto"
        model = syncbn_lightning.convert_sync_batchnorm(
            model, exchange=exchange, fuse_residual=impl.endswith("_fused")
        )
        for module in model.modules():
            if isinstance(module, syncbn_lightning.SyncBatchNorm):
                module.force_sync = True
    elif impl == "torch_sync":
        # timm's converter keeps BatchNormAct2d's activation; torch's would drop it.
        if name.startswith("timm:"):
            model = _timm().layers.convert_sync_batchnorm(model)
        else:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = force_torch_sync(model)
    return model


def _train_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, config: str
) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    autocast = config == "bf16-cl"

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eager_ms(step: Callable[[], None], device: torch.device, steps: int, warmup: int) -> float:
    """Median of ``steps`` whole steps, each timed from the host between two device syncs."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _graph_ms(step: Callable[[], None], device: torch.device, steps: int, warmup: int) -> float:
    """Median replay time of the whole step captured in one CUDA graph (CUDA events)."""
    graph = capture_graph(step, device, warmup=max(warmup, 3))
    return median_replay_ms(graph, steps, warmup=warmup)


def _build_step(args: argparse.Namespace, config: str, batch: int, impl: str) -> Callable[[], None]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = _with_impl(_model(args.model), impl, args.model).to(device).train()
    x = torch.randn(batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    if config == "bf16-cl":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return _train_step(model, x, y, config)


def _measure(args: argparse.Namespace, config: str, batch: int, impl: str) -> dict[str, float]:
    device = torch.device(args.device)
    out = {}
    with impl_env(impl):
        step = _build_step(args, config, batch, impl)
        for mode in args.modes:
            if mode == "eager":
                out[mode] = _eager_ms(step, device, args.steps, args.warmup)
            elif device.type == "cuda":
                out[mode] = _graph_ms(step, device, args.steps, args.warmup)
    return out


def _measure_interleaved(
    args: argparse.Namespace, config: str, batch: int
) -> dict[str, dict[str, float]]:
    """Eager ms of every implementation as the median of ``args.rounds`` interleaved rounds'
    medians (the models built once), with the rounds' spread; graph mode as :func:`_measure`."""
    device = torch.device(args.device)
    steps = {}
    for impl in args.impls:
        with impl_env(impl):
            steps[impl] = _build_step(args, config, batch, impl)
            for _ in range(args.warmup):
                steps[impl]()
    rounds: dict[str, list[float]] = {impl: [] for impl in args.impls}
    for _ in range(args.rounds):
        for impl in args.impls:
            with impl_env(impl):
                rounds[impl].append(_eager_ms(steps[impl], device, args.steps, 1))
    del steps
    out = {}
    for impl in args.impls:
        medians = rounds[impl]
        out[impl] = {
            "eager": statistics.median(medians),
            "eager_spread": (max(medians) - min(medians)) / statistics.median(medians),
            "eager_rounds": medians,
        }
        if "graph" in args.modes and device.type == "cuda":
            out[impl].update(
                _measure(
                    argparse.Namespace(**{**vars(args), "modes": ["graph"]}), config, batch, impl
                )
            )
    return out


def _device_line(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"{name} | torch {torch.__version__} | CUDA {torch.version.cuda}"
    return f"{cpu_model()} ({torch.get_num_threads()} threads) | torch {torch.__version__}"


def _ms(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


Results = dict[tuple[str, int, str], dict[str, float]]  # (config, batch, impl) -> mode -> ms


def _report(args: argparse.Namespace, results: Results) -> None:
    device = torch.device(args.device)
    print(f"device: {_device_line(device)}")
    print(f"command: python benchmarks/bench_model.py {' '.join(sys.argv[1:])}")
    rounds = (
        f", eager: median of {args.rounds} interleaved rounds (spread: (max - min) / median)"
        if args.rounds > 1
        else ""
    )
    print(
        f"model: {args.model}, {args.size}x{args.size} input, median of {args.steps} steps"
        f"{rounds}\n"
    )
    print("| config | batch | BN | eager ms | graph ms | eager / plain | graph / plain | spread |")
    print("|---|---|---|---|---|---|---|---|")
    goals = []
    for (config, batch, impl), times in results.items():
        plain = results.get((config, batch, "plain"), {})
        print(
            f"| {config} | {batch} | {impl} | {_ms(times.get('eager'))} | "
            f"{_ms(times.get('graph'))} | {ratio_text(times.get('eager'), plain.get('eager'))} | "
            f"{ratio_text(times.get('graph'), plain.get('graph'))} | "
            f"{_spread(times.get('eager_spread'))} |"
        )
        if impl == "ours_native" and "eager" in plain:
            ratio = times["eager"] / plain["eager"]
            verdict = "PASS" if ratio <= 1.3 else "FAIL"
            goals.append(
                f"{verdict} {config} b{batch}: eager ours_native/plain {ratio:.2f} (<= 1.3)"
            )
        torch_eager = results.get((config, batch, "torch_sync"), {}).get("eager")
        if impl == "ours_native" and torch_eager is not None:
            ratio = torch_eager / times["eager"]
            verdict = "PASS" if ratio >= 2.0 else "FAIL"
            goals.append(
                f"{verdict} {config} b{batch}: eager torch_sync/ours_native {ratio:.2f} (>= 2.0)"
            )
        if impl == "ours" and "graph" in times and "graph" in plain:
            ratio = times["graph"] / plain["graph"]
            verdict = "PASS" if ratio <= 1.05 else "FAIL"
            goals.append(f"{verdict} {config} b{batch}: graph ours/plain {ratio:.2f} (<= 1.05)")
        if impl == "ours_fused" and "graph" in times and "graph" in plain:
            ratio = times["graph"] / plain["graph"]
            verdict = "PASS" if ratio <= 0.95 else "FAIL"
            goals.append(
                f"{verdict} {config} b{batch}: graph ours_fused/plain {ratio:.2f} (<= 0.95)"
            )
        torch_sync = results.get((config, batch, "torch_sync"), {})
        if impl == "ours" and "eager" in torch_sync:
            ratio = torch_sync["eager"] / times["eager"]
            verdict = "PASS" if ratio >= 1.0 else "FAIL"
            goals.append(f"{verdict} {config} b{batch}: eager torch_sync/ours {ratio:.2f} (>= 1.0)")
    if goals:
        print("\n" + "\n".join(goals))
    paired = paired_ratios(results, "ours_native", "ours")
    for (config, batch), ratios in paired.items():
        print(
            f"\npaired rounds, eager ours_native/ours {config} b{batch}: median "
            f"{statistics.median(ratios):.3f} of {len(ratios)} rounds "
            f"({', '.join(f'{r:.3f}' for r in ratios)})"
        )


def paired_ratios(results: Results, name: str, base: str) -> dict[tuple[str, int], list[float]]:
    """Per (config, batch): ``name``'s eager step over ``base``'s, round by round (the two
    measured back to back in each interleaved round); only where both have rounds."""
    out = {}
    for (config, batch, impl), times in results.items():
        other = results.get((config, batch, base), {})
        if impl == name and "eager_rounds" in times and "eager_rounds" in other:
            pairs = zip(times["eager_rounds"], other["eager_rounds"], strict=True)
            out[(config, batch)] = [a / b for a, b in pairs]
    return out


def write_json(path: str, results: Results) -> None:
    """The results as JSON (a list of rows: config, batch, impl and the mode's figures), with
    the device line: what ``benchmarks/native_check.py`` reads."""
    rows = [
        {"config": config, "batch": batch, "impl": impl, **times}
        for (config, batch, impl), times in results.items()
    ]
    device = _device_line(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    with open(path, "w") as out:
        json.dump({"device": device, "rows": rows}, out, indent=1)


def _spread(value: float | None) -> str:
    return f"{value:.0%}" if value is not None else "-"


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--model", default="resnet50", help="resnet50 (torchvision), tiny, or timm:NAME"
    )
    parser.add_argument("--batch", type=csv_list, default=["32", "128"])
    parser.add_argument("--size", type=int, default=224, help="input height and width")
    parser.add_argument("--configs", type=csv_list, default=list(CONFIGS))
    parser.add_argument("--impls", type=csv_list, help=f"default: all of {IMPLS} the device has")
    parser.add_argument("--modes", type=csv_list, help=f"default: all of {MODES} the device has")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--rounds", type=int, default=1, help="eager: interleaved rounds (models built once)"
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    cuda = not args.device.startswith("cpu")
    args.impls = args.impls or [i for i in IMPLS if cuda or i not in CUDA_ONLY]
    args.modes = args.modes or [m for m in MODES if cuda or m != "graph"]
    for name, allowed in (("configs", CONFIGS), ("impls", IMPLS), ("modes", MODES)):
        bad = [v for v in getattr(args, name) if v not in allowed]
        if bad:
            parser.error(f"--{name}: {bad} not in {list(allowed)}")
    if not cuda:
        for name, cuda_only in (("impls", CUDA_ONLY), ("modes", ("graph",))):
            for value in cuda_only:
                if value in getattr(args, name):
                    parser.error(f"--{name} {value} needs --device cuda")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.model not in ("resnet50", "tiny") and not args.model.startswith("timm:"):
        parser.error(f"--model: {args.model!r} is not resnet50, tiny or timm:NAME")
    args.batch = [int(b) for b in args.batch]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    device = torch.device(args.device)
    results: Results = {}
    with one_rank_group(device), env_var(IMPL_ENV, "ext"):
        for config in args.configs:
            for batch in args.batch:
                if args.rounds > 1 and "eager" in args.modes:
                    for impl, times in _measure_interleaved(args, config, batch).items():
                        results[(config, batch, impl)] = times
                    continue
                for impl in args.impls:
                    results[(config, batch, impl)] = _measure(args, config, batch, impl)
    _report(args, results)
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
