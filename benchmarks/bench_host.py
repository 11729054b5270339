"""Host cost of one BatchNorm layer: dispatcher ops and microseconds per forward + backward.

On a tiny tensor the kernels cost next to nothing, so the time is what the host spends around
them: Python, autograd, the dispatcher, the collectives' bookkeeping. Compared, eager, each as a
whole ``layer(x).backward(g)`` step, unprofiled (on a GPU the device is synchronized once per
``--steps`` steps, not per step), interleaved round by round, median of the rounds:

* ``bn``: ``nn.BatchNorm2d`` (no synchronization);
* on the CPU, ``ext``: ``SyncBatchNorm(force_sync=True)`` with the ``syncbn::`` operators (the C++
  path), and ``ref``: the same layer with the pure-PyTorch reference steps;
* on a GPU (``--device cuda``), ``ours``: ``SyncBatchNorm(force_sync=True)`` on the Python path
  (the Python Function with the ``syncbn::`` steps), and ``ours_native``: the C++ path
  (``SYNCBN_NATIVE_CUDA=1``); each run asserts the path it names.

Each of ``ext`` (``ours_native`` on a GPU) and ``nogroup`` (``SyncBatchNorm`` without
``force_sync``: plain BatchNorm's maths) also runs as ``<name>_in_step`` and
``<name>_in_step_norm``: the micro-batches of optimizer steps inside ``step_statistics``, with
``normalize="micro"`` and ``"step"`` (4 calls and the commit, timed per call), against the same
layer outside it; then, without a group, where such a step's time goes (the context's entry,
the calls, its end: timed apart).

Two settings: no process group (the layer's own cost: no collective is issued) and a one-rank
group (gloo on the CPU, NCCL on a GPU: the sync layer really issues two collectives; on the CPU
gloo's own cost is shown on its own line). The flight recorder's share of a collective (the
forward's call number and one record, in memory and into a memory-mapped file) is timed on its
own (CPU). In the group, a floor is timed beside them: ``nn.BatchNorm2d`` plus the two
collectives the synchronized layer issues there, with its payloads, called straight on the
ProcessGroup (on a CPU group of up to 8 ranks the backward's sums are all-gathered, as the layer
does; ``floor_allreduce`` shows the same floor with the all_reduce a GPU or a larger group
issues); the host goal is the synchronized layer over that floor (C++ path: <= 1.1 per layer,
printed as PASS/FAIL). On the CPU a whole ResNet-18 train step follows (plain, ours, and its
floor).
The op counts come from a ``TorchDispatchMode`` around one step, AccumulateGrad's ``add_`` of the
three gradients included (``bn`` pays them too).

    python benchmarks/bench_host.py [--rounds 15] [--steps 1000] [--threads 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _common import OpCounter, one_rank_group
from torch import nn

from syncbn_lightning import SyncBatchNorm, step_statistics
from syncbn_lightning._shared import GRAD_HEADER
from syncbn_lightning.distributed.collectives import sums_gathered
from syncbn_lightning.distributed.flight import recorder as flight
from syncbn_lightning.distributed.flight import recorder as flight_recorder
from syncbn_lightning.ops.reference.steps import row_width

SHAPE = (2, 8, 4, 4)


#: The host goal: the C++ path's layer step over the floor's, in the group.
GOAL = 1.1


def _layers(device: torch.device) -> dict[str, tuple[dict[str, str], nn.Module]]:
    """The layers compared on ``device``: name -> (the environment its calls run under, layer)."""
    if device.type == "cpu":
        impls = {"bn": "auto", "ext": "ext", "ref": "ref"}
        envs = {name: {"SYNCBN_IMPL": impl} for name, impl in impls.items()}
    else:
        envs = {
            "bn": {},
            "ours": {"SYNCBN_IMPL": "ext", "SYNCBN_NATIVE_CUDA": "0"},
            "ours_native": {"SYNCBN_IMPL": "ext", "SYNCBN_NATIVE_CUDA": "1"},
        }
    native = "ext" if device.type == "cpu" else "ours_native"
    # The layer without a group: plain BatchNorm's maths, outside and inside the context.
    envs["nogroup"] = envs[native]
    for suffix in STEP_RUNS:
        envs[f"{native}{suffix}"] = envs[f"nogroup{suffix}"] = envs[native]
    return {name: (env, _layer(name).to(device).train()) for name, env in envs.items()}


#: The suffixes of the runs whose calls are the micro-batches of optimizer steps under
#: ``step_statistics`` (:data:`MICRO_BATCHES` calls and the commit, timed per call), and the
#: ``normalize=`` mode each runs.
IN_STEP = "_in_step"
STEP_RUNS = {IN_STEP: "micro", "_in_step_norm": "step"}
MICRO_BATCHES = 4


def in_step_mode(name: str) -> tuple[str, str | None]:
    """The layer run ``name`` calls, and the ``normalize=`` mode of its steps (``None``: its
    calls are not in one)."""
    for suffix, mode in STEP_RUNS.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix), mode
    return name, None


def _layer(name: str) -> nn.Module:
    """The layer a run of ``name`` calls: torch's, the layer without a group, or the layer
    forced through its synchronized path."""
    if name == "bn":
        return nn.BatchNorm2d(SHAPE[1])
    return SyncBatchNorm(SHAPE[1], force_sync=not name.startswith("nogroup"))


def _check_path(name: str, layer: nn.Module) -> None:
    """Assert that ``layer`` took the path its name says (its plan, made at its first call)."""
    native = {"ext": True, "ref": False, "ours": False, "ours_native": True}.get(
        in_step_mode(name)[0]
    )
    if native is not None:
        plan = layer._sync_plan
        assert plan is not None and plan.native is native, (name, plan and plan.native)


#: The variables a run's environment sets; a run that does not set one runs without it.
_ENV_KEYS = ("SYNCBN_IMPL", "SYNCBN_NATIVE_CUDA")


def _apply_env(env: dict[str, str]) -> None:
    """Run under exactly ``env`` as far as :data:`_ENV_KEYS` go (``{}``: none of them)."""
    for key in _ENV_KEYS:
        if key in env:
            os.environ[key] = env[key]
        else:
            os.environ.pop(key, None)


def _step(name: str, layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One ``layer(x).backward(grad)`` step; for a run in steps (:data:`STEP_RUNS`), one
    optimizer step's :data:`MICRO_BATCHES` of them inside ``step_statistics``."""

    def run() -> None:
        layer(x).backward(grad)

    mode = in_step_mode(name)[1]
    if mode is None:
        return run

    def in_step() -> None:
        with step_statistics(layer, normalize=mode):
            for _ in range(MICRO_BATCHES):
                layer(x).backward(grad)

    return in_step


def _time(fn: Callable[[], None], steps: int, device: torch.device) -> float:
    """Microseconds per ``fn()`` over ``steps`` calls, the device synchronized once at the end."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - start) / steps * 1e6


def measure(
    rounds: int, steps: int, device: torch.device, floor: bool = False
) -> dict[str, dict[str, Any]]:
    """Per layer: median microseconds per step and the op counts of one step; with ``floor``,
    the floor's step (:func:`floor_step`) too, interleaved with the others."""
    x = torch.randn(*SHAPE, device=device, requires_grad=True)
    grad = torch.ones_like(x)
    results: dict[str, dict[str, Any]] = {}
    runs = {}
    layers = _layers(device)
    steps_of = {name: (env, _step(name, layer, x, grad)) for name, (env, layer) in layers.items()}
    if floor:
        gathers = backward_gathers(device)
        steps_of["floor"] = ({}, floor_step(x, grad, gathers))
        if gathers:  # the floor with the all_reduce a CUDA or larger group would issue
            steps_of["floor_allreduce"] = ({}, floor_step(x, grad, False))
    for name, (env, run) in steps_of.items():
        _apply_env(env)
        for _ in range(50):
            run()
        if name in layers:
            _check_path(name, layers[name][1])
        with OpCounter() as counter:
            run()
        runs[name] = (env, run)
        results[name] = {"ops": counter.ops, "us": []}
    for _ in range(rounds):
        for name, (env, run) in runs.items():
            _apply_env(env)
            calls = MICRO_BATCHES if in_step_mode(name)[1] else 1
            results[name]["us"].append(_time(run, steps // calls, device) / calls)
            results[name]["calls"] = calls
    for entry in results.values():
        entry["median_us"] = statistics.median(entry["us"])
    _apply_env({})  # what runs next (the network) runs with the defaults
    return results


def layer_collectives(
    channels: int, device: torch.device, gathered_backward: bool
) -> Callable[[], None]:
    """The two collectives a synchronized layer of ``channels`` issues per step, called straight
    on the ProcessGroup (options made once), with the layer's payloads: the forward's all_gather
    of its row (``row_width(C)`` floats), then the backward's sums (``GRAD_HEADER + 2C`` floats),
    all-gathered where ``gathered_backward`` (what the layer does on CPU groups of up to
    ``GATHER_SUM_MAX_RANKS`` ranks, ``collectives.sum_over_group``) else all-reduced (CUDA, larger
    groups). The layer's own step waits between them; this runs them back to back, which waits
    the same."""
    from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions

    from syncbn_lightning.distributed.groups import sync_world_group

    group = sync_world_group()
    row = torch.randn(row_width(channels), device=device)
    gathered = torch.empty(group.size() * row.numel(), device=device)
    sums = torch.randn(GRAD_HEADER + 2 * channels, device=device)
    gathered_sums = torch.empty(group.size() * sums.numel(), device=device)
    gather_options, sum_options = AllgatherOptions(), AllreduceOptions()

    def backward() -> None:
        if gathered_backward:
            group._allgather_base(gathered_sums, sums, gather_options).wait()
        else:
            group.allreduce([sums], sum_options).wait()

    def run() -> None:
        group._allgather_base(gathered, row, gather_options).wait()
        backward()

    return run


def backward_gathers(device: torch.device) -> bool:
    """Whether a synchronized layer in the current group all-gathers its backward's sums
    (``collectives.sums_gathered``, the layer's own rule; see :func:`layer_collectives`)."""
    return sums_gathered(device.type, dist.get_world_size())


def floor_step(x: torch.Tensor, grad: torch.Tensor, gathered_backward: bool) -> Callable[[], None]:
    """What no synchronized layer can go under: ``nn.BatchNorm2d`` forward + backward and the two
    collectives a synchronized layer issues (:func:`layer_collectives`)."""
    layer = nn.BatchNorm2d(SHAPE[1]).to(x.device)
    collectives = layer_collectives(SHAPE[1], x.device, gathered_backward)

    def run() -> None:
        layer(x).backward(grad)
        collectives()

    return run


def network_steps() -> dict[str, Callable[[], None]]:
    """A whole network where the host's work shows: a torchvision ResNet-18 train step (forward,
    loss, backward, SGD) at 2 images of 32x32, in the one-rank gloo group:

    * ``plain``: its ``nn.BatchNorm2d`` layers;
    * ``ours``: converted, every layer forced through its synchronized path (two collectives);
    * ``floor``: the plain step plus, per BatchNorm layer, the two collectives a synchronized
      layer issues, straight on the ProcessGroup (:func:`layer_collectives`).
    """
    from bench_residual import _torchvision

    from syncbn_lightning import convert_sync_batchnorm

    x, target = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])

    def step_of(model: nn.Module, after: Callable[[], None] = lambda: None) -> Callable[[], None]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def run() -> None:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), target).backward()
            optimizer.step()
            after()

        return run

    def accumulated(model: nn.Module, mode: str | None) -> Callable[[], None]:
        """:data:`MICRO_BATCHES` micro-batches and one optimizer step (inside
        ``step_statistics(normalize=mode)`` unless ``mode`` is ``None``), timed per micro-batch
        by the table."""
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def micro_batches() -> None:
            for _ in range(MICRO_BATCHES):
                nn.functional.cross_entropy(model(x), target).backward()

        def run() -> None:
            optimizer.zero_grad(set_to_none=True)
            if mode is not None:
                with step_statistics(model, normalize=mode):
                    micro_batches()
            else:
                micro_batches()
            optimizer.step()

        return run

    def model() -> nn.Module:
        torch.manual_seed(0)
        return _torchvision().models.resnet18(weights=None, num_classes=5)

    plain = model()
    gathers = backward_gathers(torch.device("cpu"))
    per_layer = [
        layer_collectives(layer.num_features, torch.device("cpu"), gathers)
        for layer in plain.modules()
        if isinstance(layer, nn.BatchNorm2d)
    ]

    def collectives() -> None:
        for run in per_layer:
            run()

    return {
        "plain": step_of(plain),
        "ours": step_of(convert_sync_batchnorm(model(), force_sync=True)),
        "floor": step_of(model(), collectives),
        "ours_accumulated": accumulated(convert_sync_batchnorm(model(), force_sync=True), None),
        **{
            f"ours_accumulated{suffix}": accumulated(
                convert_sync_batchnorm(model(), force_sync=True), mode
            )
            for suffix, mode in STEP_RUNS.items()
        },
    }


def network_table(rounds: int, steps: int) -> list[str]:
    """Median ms per step of :func:`network_steps`, interleaved round by round."""
    runs = network_steps()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        for _ in range(5):
            run()
    for _ in range(rounds):
        for name, run in runs.items():
            calls = MICRO_BATCHES if name.startswith("ours_accumulated") else 1
            times[name].append(_time(run, steps // calls, torch.device("cpu")) / 1000 / calls)
    medians = {name: statistics.median(t) for name, t in times.items()}
    lines = ["| ResNet-18 step | ms / step | x plain | x floor |", "|---|---:|---:|---:|"]
    for name, ms in medians.items():
        lines.append(
            f"| {name} | {ms:.2f} | {ms / medians['plain']:.2f} | {ms / medians['floor']:.2f} |"
        )
    lines.append(
        f"\n(ours_accumulated: {MICRO_BATCHES} micro-batches and one optimizer step, ms per "
        f"micro-batch; {IN_STEP[1:]}: inside step_statistics, normalize='micro'; "
        f"{list(STEP_RUNS)[1][1:]}: normalize='step')"
    )
    outside = medians["ours_accumulated"]
    for suffix in STEP_RUNS:
        inside = medians[f"ours_accumulated{suffix}"]
        lines.append(f"ours_accumulated{suffix} / outside: {inside / outside:.2f} (goal <= 1.1)")
    return lines


def gloo_cost(rounds: int, steps: int) -> float:
    """Median microseconds of one functional all_gather + all_reduce pair (+ waits) on the group."""
    c10d = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name
    row = torch.randn(20)

    def pair() -> None:
        c10d.wait_tensor(c10d.all_gather_into_tensor(row, 1, name))
        c10d.wait_tensor(c10d.all_reduce(row, "sum", name))

    return statistics.median(_time(pair, steps, torch.device("cpu")) for _ in range(rounds))


def flight_cost(rounds: int, steps: int) -> dict[str, float]:
    """Median microseconds of what the flight recorder adds to one collective: the call number
    of the forward and one record, through ``flight.record`` (the compile check and the lookup
    included), into a ring in memory and into a memory-mapped file."""
    row = torch.randn(20)
    costs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for where, path in (("memory", None), ("file", f"{tmp}/flight_rank0.bin")):
            flight_recorder._recorder = flight.FlightRecorder(path=path)

            def one() -> None:
                call = flight.next_call(7)
                flight.record("0", "all_gather", row, (flight.FORWARD, 7, call))

            costs[where] = statistics.median(
                _time(one, steps, torch.device("cpu")) for _ in range(rounds)
            )
            flight.reset_flight_recorder()
    return costs


def _table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The runs' table: dispatcher ops and microseconds per layer step (a run in steps: per
    micro-batch, its share of the step's commit included), and their ratio to ``bn``."""
    floor = results["bn"]["median_us"]
    lines = ["| layer | dispatcher ops | us / step | x bn |", "|---|---:|---:|---:|"]
    for name, entry in results.items():
        ops = sum(entry["ops"].values()) / entry.get("calls", 1)
        lines.append(
            f"| {name} | {ops:g} | {entry['median_us']:.1f} | {entry['median_us'] / floor:.2f} |"
        )
    return lines


def in_step_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Each run in steps over the same layer's run outside (goal: <= 1.1, and <= 1.2 for the
    layer without a group, whose plain batch norm returns no statistics to merge)."""
    lines = []
    for name in results:
        outside, mode = in_step_mode(name)
        if mode is not None:
            goal = 1.2 if outside == "nogroup" else 1.1
            ratio = results[name]["median_us"] / results[outside]["median_us"]
            lines.append(f"{name} / {outside}: {ratio:.2f} (goal <= {goal})")
    return lines


def _step_parts(
    layer: nn.Module, mode: str, x: torch.Tensor, grad: torch.Tensor, count: int
) -> tuple[float, float, float]:
    """Microseconds of ``count`` optimizer steps of ``layer`` inside ``step_statistics(layer,
    normalize=mode)``, each part timed on its own: the context's entry per step, the
    :data:`MICRO_BATCHES` calls per call, and its end (the merge and the commit) per step (the
    device synchronized around each part)."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    entry = calls = end = 0.0
    for _ in range(count):
        sync()
        start = time.perf_counter()
        context = step_statistics(layer, normalize=mode)
        context.__enter__()
        sync()
        entered = time.perf_counter()
        for _ in range(MICRO_BATCHES):
            layer(x).backward(grad)
        sync()
        called = time.perf_counter()
        context.__exit__(None, None, None)
        sync()
        entry, calls = entry + entered - start, calls + called - entered
        end += time.perf_counter() - called
    return entry / count * 1e6, calls / count / MICRO_BATCHES * 1e6, end / count * 1e6


def step_split(rounds: int, steps: int, device: torch.device) -> list[str]:
    """Where an optimizer step's time goes, for each run in steps (:func:`_step_parts`), beside
    the same layer's call outside the context, interleaved round by round (median of the
    rounds). Explains the in-step ratios: a single small layer pays the step's fixed share
    alone, which a network's layers share (one group commits them all)."""
    layers = _layers(device)
    x = torch.randn(*SHAPE, device=device, requires_grad=True)
    grad = torch.ones_like(x)
    count = max(1, steps // MICRO_BATCHES)
    names = [name for name in layers if in_step_mode(name)[1] is not None]
    parts: dict[str, list[list[float]]] = {name: [[], [], [], []] for name in names}
    for _ in range(rounds):
        for name in names:
            outside, mode = in_step_mode(name)
            env, layer = layers[name]
            _apply_env(env)
            inside = _step_parts(layer, str(mode), x, grad, count)
            run = _step(outside, layers[outside][1], x, grad)
            alone = _time(run, count * MICRO_BATCHES, device)
            for part, value in zip(parts[name], (*inside, alone), strict=True):
                part.append(value)
    _apply_env({})
    lines = [
        "| run | entry us / step | us / call inside | end us / step | us / call outside | "
        "calls inside / outside |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        entry, inside, end, outside = (statistics.median(part) for part in parts[name])
        lines.append(
            f"| {name} | {entry:.1f} | {inside:.1f} | {end:.1f} | {outside:.1f} | "
            f"{inside / outside:.2f} |"
        )
    return lines


def goal_line(results: dict[str, dict[str, Any]], name: str, gate: bool = True) -> str:
    """PASS or FAIL of ``name``'s step over the floor's against :data:`GOAL`; with ``gate``
    false, the figure beside the goal (on a GPU: the goal was calibrated on gloo, whose
    collective dominates the floor; NCCL's does not)."""
    ratio = results[name]["median_us"] / results["floor"]["median_us"]
    if not gate:
        return f"figure {name}: host per layer step / floor {ratio:.2f} (goal <= {GOAL}, on gloo)"
    verdict = "PASS" if ratio <= GOAL else "FAIL"
    return f"{verdict} {name}: host per layer step / floor {ratio:.2f} (<= {GOAL})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", help="also write the one-rank group's figures to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    where = f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}" if cuda else "CPU"
    print(f"torch {torch.__version__}, {args.threads} thread(s), input {SHAPE}, float32, {where}")
    print(f"command: python benchmarks/bench_host.py {' '.join(sys.argv[1:])}")
    print("\nNo process group (no collective is issued):\n")
    alone = measure(args.rounds, args.steps, device)
    print("\n".join(_table(alone)))
    print("\n" + "\n".join(in_step_lines(alone)))
    print(f"\nWhere a step of {MICRO_BATCHES} calls goes (no process group):\n")
    print("\n".join(step_split(args.rounds, args.steps, device)))
    if not cuda:
        costs = flight_cost(args.rounds, args.steps)
        print(
            f"\nflight recorder, per collective (call number + one record): "
            f"{costs['memory']:.2f} us in memory, {costs['file']:.2f} us into its file"
        )
    native = "ours_native" if cuda else "ext"
    with one_rank_group(device):
        backend = "NCCL" if cuda else "gloo"
        print(f"\nOne-rank {backend} group (one all-gather forward, one collective backward):\n")
        results = measure(args.rounds, args.steps, device, floor=True)
        print("\n".join(_table(results)))
        print("\n" + "\n".join(in_step_lines(results)))
        for name in results:
            if name not in ("bn", "floor", "floor_allreduce") and not name.endswith(IN_STEP):
                ratio = results[name]["median_us"] / results["floor"]["median_us"]
                print(f"\n{name} / floor: {ratio:.2f}")
        print("\n" + goal_line(results, native, gate=not cuda))
        if args.json:
            figures = {name: entry["median_us"] for name, entry in results.items()}
            floor = figures["floor"]
            ratios = {name: us / floor for name, us in figures.items()}
            with open(args.json, "w") as out:
                json.dump({"median_us": figures, "over_floor": ratios}, out, indent=1)
        if not cuda:
            print(f"\ngloo alone, all_gather + all_reduce with waits: {gloo_cost(5, 500):.1f} us")
            print("\nA whole network in the same group (ResNet-18, 2 images of 32x32, SGD):\n")
            print("\n".join(network_table(max(3, args.rounds // 3), 20)))
        print(f"\nops of one {native} step:", dict(results[native]["ops"]))


if __name__ == "__main__":
    main()
