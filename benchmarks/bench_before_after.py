"""The layer call's host time on several checkouts of the project, every side measured alike.

Each checkout (a worktree of an older commit, say) runs, from its own tree (``PYTHONPATH``), its
own ``bench_host.measure``: ``layer(x).backward(g)`` on 2x8x4x4 float32, interleaved round by
round, median of the rounds, for the layers every release of that script has, ``bn``
(``nn.BatchNorm2d``) and ``ext`` (the C++ path, forced to synchronize), without a process group
and in a one-rank gloo group beside the floor (the same collectives called straight). The
sides run one after another in a pair, the first side changing from pair to pair. Printed: each
row's median over the pairs per side, and every later side over the first as paired medians
with the pairs' range.

    python benchmarks/bench_before_after.py BEFORE_DIR AFTER_DIR [MORE_DIRS ...]
        [--pairs 10] [--rounds 9] [--steps 500]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

#: (label, where, layer, divided by): the rows of the table.
ROWS = (
    ("no group, ext us", "alone", "ext", None),
    ("one-rank gloo group, ext us", "group", "ext", None),
    ("one-rank gloo group, ext / floor", "group", "ext", "floor"),
    ("no group, ext / bn", "alone", "ext", "bn"),
)


def measure_here(rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """This checkout's medians (µs per step) of ``bn`` and ``ext``, alone and in the group."""
    sys.path.insert(0, str(Path.cwd() / "benchmarks"))
    import bench_host
    import torch
    from _common import one_rank_group

    torch.set_num_threads(1)
    layers = bench_host._layers
    bench_host._layers = lambda device: {  # the layers every side's script has
        name: entry for name, entry in layers(device).items() if name in ("bn", "ext")
    }
    cpu = torch.device("cpu")
    alone = bench_host.measure(rounds, steps, cpu)
    with one_rank_group(cpu):
        group = bench_host.measure(rounds, steps, cpu, floor=True)
    return {
        "alone": {name: entry["median_us"] for name, entry in alone.items()},
        "group": {name: entry["median_us"] for name, entry in group.items()},
    }


def run_side(checkout: Path, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """:func:`measure_here` in ``checkout``, as a process of its own."""
    command = [sys.executable, str(Path(__file__).resolve()), "--here", str(rounds), str(steps)]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        command, cwd=checkout, env=env, capture_output=True, text=True, check=True, timeout=1800
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def figure(result: dict[str, dict[str, float]], where: str, name: str, over: str | None) -> float:
    """One row's figure of one side's result."""
    value = result[where][name]
    return value / result[where][over] if over else value


def table(sides: list[str], pairs: list[list[dict[str, dict[str, float]]]]) -> list[str]:
    """The medians per side and every later side over the first, paired."""
    header = (
        "| row | "
        + " | ".join(sides)
        + " | "
        + " | ".join(f"{side} / {sides[0]} (pairs)" for side in sides[1:])
    )
    lines = [header + " |", "|---" * (2 * len(sides)) + "|"]
    for label, where, name, over in ROWS:
        values = [[figure(run[i], where, name, over) for run in pairs] for i in range(len(sides))]
        cells = [f"{statistics.median(column):.3g}" for column in values]
        for later in values[1:]:
            ratios = [a / b for a, b in zip(later, values[0], strict=True)]
            cells.append(f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    if sys.argv[1:2] == ["--here"]:
        print(json.dumps(measure_here(int(sys.argv[2]), int(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="+", type=Path, help="the first is 'before'")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    if len(args.checkouts) < 2:
        parser.error("give at least two checkouts: before, after")
    checkouts = [path.resolve() for path in args.checkouts]
    print(f"command: python benchmarks/bench_before_after.py {' '.join(sys.argv[1:])}")
    pairs = []
    for index in range(args.pairs):
        order = list(range(len(checkouts)))
        order = order[index % len(order) :] + order[: index % len(order)]
        run: list[dict[str, dict[str, float]]] = [{}] * len(checkouts)
        for side in order:
            run[side] = run_side(checkouts[side], args.rounds, args.steps)
        pairs.append(run)
    print("\n".join(table([path.name for path in checkouts], pairs)))


if __name__ == "__main__":
    main()
