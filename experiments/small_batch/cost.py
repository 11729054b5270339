"""Where a small-batch job's time goes: compute against time inside collectives, per variant.

``python -m experiments.small_batch.cost`` runs, for each variant, the experiment's own
``train.py`` job (same recipe, 4 processes x 2 images, ``data=shapes_hard``) for
``--start + --steps`` optimizer steps without validation, with :class:`CollectiveProfile` added
as a callback (``+callbacks.collective_profile=...``). On every rank the callback runs
``torch.profiler`` over ``--steps`` steps and splits the wall time of those steps into the time
inside ``torch.distributed`` collectives on the training thread (the outermost profiler events
of the ``c10d::`` and ``_c10d_functional::`` ops, their ``wait_tensor`` included: waiting for the
slowest rank is part of it) and the rest (forward, backward, optimizer, hooks, the profiler's own
overhead). The table gives the mean over ranks, per step.

It explains the wall times of the experiment's table; it is not part of ``python -m
experiments.small_batch`` (it adds nothing to the results file).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.autograd.profiler_util import FunctionEvent

from .runner import machine, variant_named
from .variants import Variant

__all__ = ["CollectiveProfile", "collective_time_us"]

REPO = Path(__file__).resolve().parents[2]
COLLECTIVE = re.compile(r"^(c10d::|_c10d_functional::|gloo:|record_param_comms)")
"""Profiler event names counted as time inside a collective."""


def collective_time_us(
    events: Sequence[FunctionEvent],
) -> tuple[float, int, dict[str, float]]:
    """CPU time (us) of the outermost collective events of ``events`` on the training thread,
    their count, and the time by event name.

    An event inside another collective event (``c10d::allreduce_`` under ``all_reduce``) is not
    counted twice; events of other threads (gloo's and DDP's background work, which overlaps the
    training thread's) are left out, so the total is time the training thread spent in them.
    """
    main = statistics.mode(e.thread for e in events) if events else None
    total, count, by_name = 0.0, 0, {}
    for e in events:
        if e.thread != main or not COLLECTIVE.search(e.name):
            continue
        parent = e.cpu_parent
        while parent is not None and not COLLECTIVE.search(parent.name):
            parent = parent.cpu_parent
        if parent is None:
            us = e.time_range.elapsed_us()
            total += us
            count += 1
            by_name[e.name] = by_name.get(e.name, 0.0) + us
    return total, count, by_name


class CollectiveProfile(pl.Callback):
    """Profile optimizer steps ``[start, start + steps)`` on every rank; write
    ``<out_dir>/rank<r>.json`` with the wall time, the time in collectives and their count.

    Args:
        out_dir: where each rank writes its file.
        start: the first profiled step (steps before it warm up).
        steps: how many steps are profiled.
    """

    def __init__(self, out_dir: str, start: int = 10, steps: int = 40) -> None:
        self.out_dir, self.start, self.steps = Path(out_dir), start, steps
        self._prof: Any = None
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.start and self._prof is None:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._prof.__enter__()
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._prof is None or trainer.global_step != self.start + self.steps:
            return
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        inside, count, by_name = collective_time_us(self._prof.events())
        self._prof = None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "steps": self.steps,
            "wall_s": wall,
            "collective_s": inside / 1e6,
            "calls": count,
            "by_name_s": {k: v / 1e6 for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])},
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def profile_variant(
    variant: Variant, start: int, steps: int, data_dir: Path, debug: bool = False
) -> dict[str, float]:
    """Run ``variant``'s job for ``start + steps`` steps with :class:`CollectiveProfile`;
    return per-step milliseconds (mean over ranks): ``step``, ``collectives``, ``other`` and
    collective ``calls`` per step."""
    name = variant.name
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile"
        target = "experiments.small_batch.cost.CollectiveProfile"
        command = [
            sys.executable, "train.py", "data=shapes_hard", *variant.overrides,
            "logger=none", "report=false", "evaluate=false", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", "+trainer.limit_val_batches=0",
            f"trainer.max_steps={start + steps + 1}", "bn.precise_bn_batches=0",
            f"+callbacks.collective_profile._target_={target}",
            f"+callbacks.collective_profile.out_dir={out}",
            f"+callbacks.collective_profile.start={start}",
            f"+callbacks.collective_profile.steps={steps}",
            f"hydra.run.dir={Path(tmp) / 'run'}", f"paths.data_dir={data_dir}",
        ]  # fmt: skip
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{name}: train.py failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
        if debug:
            print(json.dumps(records[0]["by_name_s"], indent=1), file=sys.stderr)
    per_step = {
        "step": statistics.fmean(r["wall_s"] for r in records) / steps * 1e3,
        "collectives": statistics.fmean(r["collective_s"] for r in records) / steps * 1e3,
        "calls": statistics.fmean(r["calls"] for r in records) / steps,
    }
    per_step["other"] = per_step["step"] - per_step["collectives"]
    return per_step


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.small_batch.cost")
    parser.add_argument("--variants", nargs="+", default=["local_bn", "group2", "syncbn", "gn"])
    parser.add_argument("--start", type=int, default=10, help="warm-up steps, not profiled")
    parser.add_argument("--steps", type=int, default=40, help="profiled steps")
    parser.add_argument("--data-dir", type=Path, default=REPO / "data")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    parser.add_argument("--debug", action="store_true", help="rank 0's time by event name")
    args = parser.parse_args(argv)
    variants = [variant_named(n) for n in args.variants]  # an unknown name fails before any job
    m = machine()
    lines = [
        f"Command: `python -m experiments.small_batch.cost --start {args.start} --steps "
        f"{args.steps}`. Machine: {m['cpu']}, {m['cores']} cores, {m['memory']}; torch "
        f"{m['torch']}, lightning {m['lightning']}. Per optimizer step, mean over the 4 ranks.",
        "",
        "| variant | step (ms) | in collectives (ms) | rest (ms) | collective calls / step |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for variant in variants:
        r = profile_variant(variant, args.start, args.steps, args.data_dir.resolve(), args.debug)
        row = (
            f"| {variant.name} | {r['step']:.0f} | {r['collectives']:.0f} | {r['other']:.0f} | "
            f"{r['calls']:.0f} |"
        )
        lines.append(row)
        print(row, flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
