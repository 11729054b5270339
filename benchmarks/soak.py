"""Soak test: thousands of small SyncBN steps under Lightning DDP on CPU, watching for leaks.

A real ``lightning.pytorch.Trainer`` trains a small BN convnet (4 conv+BatchNorm2d+ReLU blocks,
3->16->16->32->32 channels, two stride-2, global average pooling, Linear+BatchNorm1d+ReLU,
Linear; 5 BatchNorm layers) on ``--world`` CPU processes (gloo) with
``SyncBNCallback(group_size=--group-size, log_every_n_steps=--log-every, drift=True)``, for
``--steps`` optimizer steps of ``--batch`` images 3x32x32 per rank, drawn from a fixed synthetic
dataset held in memory. The run uses what a real job uses: a ``CSVLogger`` (into the run
directory) fed by the callback's ``bn/*`` metrics and the module's ``train/loss``, epochs of
``--epoch-steps`` steps (the callback reconciles the groups' running statistics at every epoch end),
a validation of 2 batches after every epoch (reconciliation again), no checkpointing.

Strategy ``ddp`` (default) is Lightning's popen launcher: this process is rank 0 and Lightning
re-runs this script for ranks 1..N-1 (they find ``$SOAK_RUN_DIR`` and ``$LOCAL_RANK`` set and
only train). ``--strategy ddp_spawn`` spawns every rank from this process instead.

Every rank samples, at train start, every ``--sample-every`` steps and at train end: its resident
memory (``VmRSS`` and the peak ``VmHWM`` from ``/proc/self/status``), OS threads, open file
descriptors (``/proc/self/fd``), the process groups torch.distributed knows (live:
``len(distributed_c10d._world.pg_map)``; created so far: ``distributed_c10d.get_pg_count()``),
live Python objects (``gc.get_objects()``), the warnings so far and the bytes written to its
stderr. Warnings are counted with the filter set to ``"always"`` (every ``warnings.warn`` call,
not only the first per location; each distinct message is still printed once) plus every log
record at WARNING or above; each rank's stderr (C++ logs included) goes to
``<run dir>/stderr_rank<r>.log`` (``--show-stderr`` keeps it on the terminal instead). At the
end each rank writes ``rank<r>.json`` and this process prints the report (and writes it to
``--out``).

Checks (exit status 1 if one fails), on every rank, the baseline being the first sample at or
after ``--warmup`` steps (default 10 % of ``--steps``):
    * resident memory growth from the baseline to the end <= ``--max-rss-growth-mib`` MiB or
      <= ``--max-rss-growth-pct`` % of the baseline;
    * live and created process groups, OS threads and open fds: the same at the end as at the
      baseline (process groups: as at train start);
    * warnings (Python warnings + WARNING log records over the whole process) <=
      ``--max-warnings``, no message (numbers masked) more than ``--max-repeats`` times, and at most
      ``--max-stderr-growth`` bytes written to stderr after the baseline.

Example:
    python benchmarks/soak.py --steps 200                      # a quick look
    python benchmarks/soak.py --world 4 --steps 3000 --out /tmp/soak.md
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed.distributed_c10d as c10d
from _common import cpu_model
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    from syncbn_lightning import SyncBNCallback
    from syncbn_lightning.ops import build as ops_build
    from syncbn_lightning.ops import dispatch as syncbn_impl
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from syncbn_lightning import SyncBNCallback
    from syncbn_lightning.ops import build as ops_build
    from syncbn_lightning.ops import dispatch as syncbn_impl

RUN_DIR_ENV = "SOAK_RUN_DIR"
NUM_CLASSES = 10
IMAGE_SIZE = 32
SEED = 0
MIB = 1024.0


# ---------------------------------------------------------------------------- the model


class SoakNet(pl.LightningModule):
    """The soak model: SGD on cross-entropy over fixed synthetic images, 5 BatchNorm layers.

    Args:
        samples: training images in the dataset (one epoch = ``samples / (world * batch)`` steps).
        batch: images per rank and step.
        val_samples: validation images.
    """

    def __init__(self, samples: int, batch: int, val_samples: int) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        plan = ((3, 16, 1), (16, 16, 2), (16, 32, 1), (32, 32, 2))
        layers: list[nn.Module] = []
        for cin, cout, stride in plan:
            layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)]
            layers.append(nn.ReLU())
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        layers += [nn.Linear(32, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU()]
        layers.append(nn.Linear(32, NUM_CLASSES))
        self.model = nn.Sequential(*layers)
        self.samples = samples
        self.batch = batch
        self.val_samples = val_samples

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.log("val/loss", nn.functional.cross_entropy(self(images), labels), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def _loader(self, samples: int, seed: int) -> DataLoader:
        generator = torch.Generator().manual_seed(seed)
        images = torch.randn(samples, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
        labels = torch.randint(0, NUM_CLASSES, (samples,), generator=generator)
        return DataLoader(TensorDataset(images, labels), batch_size=self.batch, drop_last=True)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.samples, SEED)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_samples, SEED + 1)


# ---------------------------------------------------------------------------- per-process probes


def _mask_numbers(text: str) -> str:
    """``text`` with every number replaced by ``#``, so that messages differing only in a step
    number, a size or an address count as one."""
    return re.sub(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?", "#", text)


class _CountingHandler(logging.Handler):
    """Counts log records at WARNING and above per (logger, level, masked message)."""

    def __init__(self, counts: dict[str, list[Any]]) -> None:
        super().__init__(level=logging.WARNING)
        self.counts = counts

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            text = record.getMessage().strip().splitlines()[0] if record.getMessage() else ""
            key = f"log {record.levelname} {record.name}: {_mask_numbers(text)}"
            entry = self.counts.setdefault(key, [0, f"{record.levelname} log {record.name}", text])
            entry[0] += 1


@dataclass
class _Probes:
    """What one process counts: warnings, warning log records, its stderr file."""

    rank: int
    stderr_path: Path | None
    warnings: dict[str, list[Any]] = field(default_factory=dict)  # key -> [count, source, text]
    logs: dict[str, list[Any]] = field(default_factory=dict)
    handler: _CountingHandler | None = None
    saved_stderr_fd: int | None = None

    def warning_total(self) -> int:
        return sum(v[0] for v in self.warnings.values()) + sum(v[0] for v in self.logs.values())

    def stderr_bytes(self) -> int:
        if self.stderr_path is None:
            return -1
        sys.stderr.flush()
        return os.fstat(2).st_size


_PROBES: _Probes | None = None


def _install_probes(run_dir: Path, rank: int, capture_stderr: bool) -> _Probes:
    """Start counting warnings and log records in this process (idempotent); send fd 2 to
    ``run_dir/stderr_rank<rank>.log`` when ``capture_stderr``."""
    global _PROBES
    if _PROBES is not None:
        _attach_log_handler(_PROBES)  # loggers created since then
        return _PROBES
    stderr_path = run_dir / f"stderr_rank{rank}.log" if capture_stderr else None
    probes = _Probes(rank=rank, stderr_path=stderr_path)
    if stderr_path is not None:
        sys.stderr.flush()
        probes.saved_stderr_fd = os.dup(2)
        fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)

    def show(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        text = str(message).strip().splitlines()[0] if str(message).strip() else ""
        where = f"{Path(filename).name}:{lineno}"
        key = f"warn {category.__name__} {where}: {_mask_numbers(text)}"
        entry = probes.warnings.setdefault(key, [0, f"{category.__name__} {where}", text])
        entry[0] += 1
        if entry[0] == 1:  # print each distinct warning once, as the default filter would
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno))

    warnings.simplefilter("always")
    warnings.showwarning = show
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # banners, tips
    probes.handler = _CountingHandler(probes.logs)
    _attach_log_handler(probes)
    _PROBES = probes
    return probes


def _attach_log_handler(probes: _Probes) -> None:
    """Put the counting handler on the root logger and on every logger that does not propagate
    (Lightning's and torch.distributed's), so that each record is counted once."""
    assert probes.handler is not None
    loggers = [logging.getLogger()] + [
        lg
        for lg in logging.root.manager.loggerDict.values()
        if isinstance(lg, logging.Logger) and not lg.propagate
    ]
    for logger in loggers:
        if probes.handler not in logger.handlers:
            logger.addHandler(probes.handler)


def _restore_stderr(probes: _Probes) -> None:
    if probes.saved_stderr_fd is not None:
        sys.stderr.flush()
        os.dup2(probes.saved_stderr_fd, 2)
        os.close(probes.saved_stderr_fd)
        probes.saved_stderr_fd = None


def _proc_status() -> dict[str, int]:
    """``VmRSS``/``VmHWM`` (KiB) and ``Threads`` from ``/proc/self/status``."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM", "Threads"):
                out[name] = int(value.split()[0])
    return out


def _process_groups() -> tuple[int, int]:
    """(live process groups, process groups created so far) in this process; -1 if unknown."""
    world = getattr(c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    live = len(pg_map) if pg_map is not None else -1
    count = getattr(c10d, "get_pg_count", None)
    created = count() if callable(count) and c10d.is_initialized() else -1
    return live, created


def _sample(step: int, start: float, probes: _Probes) -> dict[str, Any]:
    status = _proc_status()
    live, created = _process_groups()
    return {
        "step": step,
        "t": time.perf_counter() - start,
        "rss_kib": status.get("VmRSS", -1),
        "hwm_kib": status.get("VmHWM", -1),
        "threads": status.get("Threads", -1),
        "fds": len(os.listdir("/proc/self/fd")) - 1,  # minus the one listdir itself holds
        "pgs": live,
        "pgs_created": created,
        "py_objects": len(gc.get_objects()),
        "warnings": probes.warning_total(),
        "stderr_bytes": probes.stderr_bytes(),
    }


class SoakProbe(pl.Callback):
    """Samples this rank's resources every ``every`` steps; writes ``rank<r>.json`` at teardown.

    Args:
        run_dir: where the JSON files (and captured stderr) go.
        every: steps between samples (plus one at train start and one at train end).
        steps: the run's ``max_steps`` (for rank 0's progress lines).
        capture_stderr: send this rank's stderr to ``run_dir/stderr_rank<r>.log``.
    """

    def __init__(self, run_dir: Path, every: int, steps: int, capture_stderr: bool) -> None:
        self.run_dir = run_dir
        self.every = every
        self.steps = steps
        self.capture_stderr = capture_stderr
        self.samples: list[dict[str, Any]] = []
        self._start = 0.0
        self._progress = max(steps // 10, 1)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # No-op under `ddp` (installed at process start); the ranks of ddp_spawn start here.
        _install_probes(self.run_dir, trainer.global_rank, self.capture_stderr)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        probes = _install_probes(self.run_dir, trainer.global_rank, self.capture_stderr)
        self._start = time.perf_counter()
        self.samples.append(_sample(trainer.global_step, self._start, probes))

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if step % self.every == 0 and step != self.samples[-1]["step"]:
            assert _PROBES is not None
            self.samples.append(_sample(step, self._start, _PROBES))
        if trainer.is_global_zero and step % self._progress == 0:
            elapsed = time.perf_counter() - self._start
            rss = _proc_status().get("VmRSS", 0) / MIB
            print(
                f"  step {step}/{self.steps}: {elapsed:.0f} s, {step / elapsed:.1f} steps/s, "
                f"rank 0 RSS {rss:.1f} MiB",
                flush=True,
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert _PROBES is not None
        final = _sample(trainer.global_step, self._start, _PROBES)
        if final["step"] == self.samples[-1]["step"]:
            self.samples[-1] = final
        else:
            self.samples.append(final)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or _PROBES is None:
            return
        result = {
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "samples": self.samples,
            "warnings": list(_PROBES.warnings.values()) + list(_PROBES.logs.values()),
            "stderr": str(_PROBES.stderr_path) if _PROBES.stderr_path else None,
            "stderr_bytes": _PROBES.stderr_bytes(),
        }
        (self.run_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------- one run


def _group_size(text: str) -> int | None:
    if text in ("world", "none", "None"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an int or 'world', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _build_trainer(args: argparse.Namespace, run_dir: Path) -> tuple[pl.Trainer, SoakNet]:
    callback = SyncBNCallback(
        group_size=args.group_size, log_every_n_steps=args.log_every, drift=True
    )
    probe = SoakProbe(run_dir, args.sample_every, args.steps, not args.show_stderr)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.world,
        strategy=args.strategy,
        max_steps=args.steps,
        max_epochs=-1,
        callbacks=[callback, probe],
        logger=CSVLogger(run_dir, name="csv"),
        log_every_n_steps=args.log_every,
        check_val_every_n_epoch=1,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=run_dir,
    )
    samples = args.world * args.batch * args.epoch_steps
    model = SoakNet(samples, args.batch, val_samples=args.world * args.batch * 2)
    return trainer, model


def _run_child(args: argparse.Namespace, run_dir: Path) -> None:
    """A rank that Lightning's ``ddp`` launcher started by re-running this script: just train."""
    rank = int(os.environ.get("NODE_RANK", "0")) * args.world + int(os.environ["LOCAL_RANK"])
    _install_probes(run_dir, rank, not args.show_stderr)
    trainer, model = _build_trainer(args, run_dir)
    trainer.fit(model)


def _wait_children(trainer: pl.Trainer, timeout_s: float) -> list[int | None]:
    """Exit codes of the processes Lightning's ``ddp`` launcher started (None: still running)."""
    procs = getattr(getattr(trainer.strategy, "launcher", None), "procs", []) or []
    procs = [proc for proc in procs if isinstance(proc, subprocess.Popen)]  # ddp_spawn: joined
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except Exception:
            codes.append(None)
    return codes


@dataclass
class RunResult:
    """What the ranks reported, plus the parent's view of the run."""

    ranks: list[dict[str, Any]]
    fit_seconds: float
    csv_rows: int
    csv_bn_rows: int


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no stderr file)"


def _count_csv_rows(run_dir: Path) -> tuple[int, int]:
    """(rows, rows with bn/global_batch_size) of the CSVLogger's metrics.csv files."""
    rows = bn_rows = 0
    for path in run_dir.glob("csv/version_*/metrics.csv"):
        text = path.read_text().splitlines()
        if not text:
            continue
        header = text[0].split(",")
        column = header.index("bn/global_batch_size") if "bn/global_batch_size" in header else -1
        for line in text[1:]:
            rows += 1
            cells = line.split(",")
            if column >= 0 and column < len(cells) and cells[column]:
                bn_rows += 1
    return rows, bn_rows


def _run(args: argparse.Namespace, run_dir: Path) -> RunResult:
    """Train on ``--world`` ranks and collect every rank's ``rank<r>.json``."""
    os.environ[RUN_DIR_ENV] = str(run_dir)  # the ranks that `ddp` re-launches inherit it
    probes = None
    if args.strategy == "ddp":
        probes = _install_probes(run_dir, 0, not args.show_stderr)
    start = time.perf_counter()
    try:
        trainer, model = _build_trainer(args, run_dir)
        trainer.fit(model)
        codes = _wait_children(trainer, timeout_s=120.0)
    except BaseException:
        if probes is not None:
            _restore_stderr(probes)
        _print_stderr_tails(run_dir, args.world)
        raise
    fit_seconds = time.perf_counter() - start
    if probes is not None:
        _restore_stderr(probes)
    failed = [(r + 1, code) for r, code in enumerate(codes) if code != 0]
    missing = [r for r in range(args.world) if not (run_dir / f"rank{r}.json").exists()]
    if failed or missing:
        _print_stderr_tails(run_dir, args.world)
        raise SystemExit(f"soak: ranks failed (rank, exit code) {failed}, no report from {missing}")
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(args.world)]
    rows, bn_rows = _count_csv_rows(run_dir)
    return RunResult(ranks, fit_seconds, rows, bn_rows)


def _print_stderr_tails(run_dir: Path, world: int) -> None:
    for rank in range(world):
        path = run_dir / f"stderr_rank{rank}.log"
        if path.exists():
            print(f"---- end of rank {rank}'s stderr ({path}):\n{_tail(path)}", file=sys.stderr)


# ---------------------------------------------------------------------------- the report


@dataclass
class RankFigures:
    """One rank's soak figures, from its samples."""

    rank: int
    start: dict[str, Any]
    base: dict[str, Any]
    end: dict[str, Any]
    slope_mib_per_1000: float
    warnings: list[list[Any]]

    @property
    def growth_mib(self) -> float:
        return (self.end["rss_kib"] - self.base["rss_kib"]) / MIB

    @property
    def growth_pct(self) -> float:
        return 100.0 * (self.end["rss_kib"] - self.base["rss_kib"]) / max(self.base["rss_kib"], 1)

    @property
    def per_1000(self) -> float:
        steps = self.end["step"] - self.base["step"]
        return 1000.0 * self.growth_mib / steps if steps > 0 else float("nan")

    @property
    def warning_total(self) -> int:
        return sum(w[0] for w in self.warnings)

    @property
    def max_repeats(self) -> int:
        return max((w[0] for w in self.warnings), default=0)

    @property
    def stderr_growth(self) -> int:
        if self.end["stderr_bytes"] < 0:
            return -1
        return self.end["stderr_bytes"] - self.base["stderr_bytes"]


def _slope(samples: Sequence[dict[str, Any]]) -> float:
    """Least-squares RSS slope in MiB per 1000 steps over ``samples``."""
    if len(samples) < 2:
        return float("nan")
    xs = [s["step"] for s in samples]
    ys = [s["rss_kib"] / MIB for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return float("nan")
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def _figures(rank: dict[str, Any], warmup: int) -> RankFigures:
    samples = rank["samples"]
    after = [s for s in samples if s["step"] >= warmup] or samples[-1:]
    return RankFigures(
        rank=rank["rank"],
        start=samples[0],
        base=after[0],
        end=samples[-1],
        slope_mib_per_1000=_slope(after),
        warnings=rank["warnings"],
    )


def _arrow(a: Any, b: Any) -> str:
    return f"{a} -> {b}" if a != b else f"{a} (const)"


def _rank_table(figures: Sequence[RankFigures]) -> list[str]:
    base_step, end_step = figures[0].base["step"], figures[0].end["step"]
    lines = [
        f"| rank | RSS MiB @{base_step} | RSS MiB @{end_step} | growth MiB | growth % "
        f"| MiB / 1000 steps (endpoints; fit) | peak RSS MiB | process groups live; created "
        f"| threads | fds | Python objects | warnings | stderr B after warm-up |",
        "|---:|---:|---:|---:|---:|---|---:|---|---|---|---|---:|---:|",
    ]
    for f in figures:
        stderr = "-" if f.stderr_growth < 0 else str(f.stderr_growth)
        cells = [
            str(f.rank),
            f"{f.base['rss_kib'] / MIB:.1f}",
            f"{f.end['rss_kib'] / MIB:.1f}",
            f"{f.growth_mib:+.1f}",
            f"{f.growth_pct:+.2f}",
            f"{f.per_1000:+.2f}; {f.slope_mib_per_1000:+.2f}",
            f"{f.end['hwm_kib'] / MIB:.1f}",
            f"{_arrow(f.start['pgs'], f.end['pgs'])}; "
            f"{_arrow(f.start['pgs_created'], f.end['pgs_created'])}",
            _arrow(f.base["threads"], f.end["threads"]),
            _arrow(f.base["fds"], f.end["fds"]),
            f"{f.base['py_objects']} -> {f.end['py_objects']} "
            f"({f.end['py_objects'] - f.base['py_objects']:+d})",
            str(f.warning_total),
            stderr,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _timeline(ranks: Sequence[dict[str, Any]], points: int = 10) -> list[str]:
    """RSS (MiB) of every rank at about 0, 10, ..., 100 % of the run."""
    samples0 = ranks[0]["samples"]
    last = samples0[-1]["step"]
    wanted = sorted({round(last * i / points) for i in range(points + 1)})
    steps: list[int] = []
    for target in wanted:
        nearest = min(samples0, key=lambda s: abs(s["step"] - target))["step"]
        if nearest not in steps:
            steps.append(nearest)
    lines = [
        "| rank | " + " | ".join(f"@{s}" for s in steps) + " |",
        "|---:|" + "---:|" * len(steps),
    ]
    for rank in ranks:
        by_step = {s["step"]: s["rss_kib"] / MIB for s in rank["samples"]}
        cells = [f"{by_step[s]:.1f}" if s in by_step else "-" for s in steps]
        lines.append(f"| {rank['rank']} | " + " | ".join(cells) + " |")
    return lines


def _warning_table(figures: Sequence[RankFigures], top: int) -> list[str]:
    """The most frequent warning messages (numbers masked), with their count on every rank."""
    merged: dict[tuple[str, str], list[int]] = {}
    for f in figures:
        for count, source, text in f.warnings:
            key = (source, _mask_numbers(text))
            merged.setdefault(key, [0] * len(figures))[f.rank] += count
    if not merged:
        return ["No warnings and no WARNING log records on any rank."]
    ordered = sorted(merged.items(), key=lambda item: (-sum(item[1]), item[0]))
    ranks = " | ".join(f"r{f.rank}" for f in figures)
    lines = [
        f"Warnings: {len(merged)} distinct message(s); the {min(top, len(merged))} most frequent "
        f"(count per rank; numbers masked as #):",
        "",
        f"| {ranks} | source | message |",
        "|" + "---:|" * len(figures) + "---|---|",
    ]
    for (source, text), counts in ordered[:top]:
        short = text if len(text) <= 110 else text[:107] + "..."
        cells = " | ".join(str(c) for c in counts)
        lines.append(f"| {cells} | {source} | {short.replace('|', '/')} |")
    return lines


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _checks(figures: Sequence[RankFigures], args: argparse.Namespace) -> list[Check]:
    worst = max(figures, key=lambda f: f.growth_mib)
    rss_ok = all(
        f.growth_mib <= args.max_rss_growth_mib or f.growth_pct <= args.max_rss_growth_pct
        for f in figures
    )
    pg_ok = all(
        f.start["pgs"] == f.end["pgs"] and f.start["pgs_created"] == f.end["pgs_created"]
        for f in figures
    )
    threads_ok = all(f.base["threads"] == f.end["threads"] for f in figures)
    fds_ok = all(f.base["fds"] == f.end["fds"] for f in figures)
    total = max(f.warning_total for f in figures)
    repeats = max(f.max_repeats for f in figures)
    stderr = max(f.stderr_growth for f in figures)
    warn_ok = total <= args.max_warnings and repeats <= args.max_repeats
    warn_ok = warn_ok and stderr <= args.max_stderr_growth
    stderr_text = "not captured" if stderr < 0 else f"max {stderr} B"
    return [
        Check(
            f"RSS growth after warm-up <= {args.max_rss_growth_mib:g} MiB or "
            f"<= {args.max_rss_growth_pct:g} % on every rank",
            rss_ok,
            f"worst rank {worst.rank}: {worst.growth_mib:+.1f} MiB, {worst.growth_pct:+.2f} %",
        ),
        Check(
            "process groups (live and created) constant from train start to end",
            pg_ok,
            ", ".join(f"r{f.rank} {f.end['pgs']}/{f.end['pgs_created']}" for f in figures),
        ),
        Check(
            "OS threads constant after warm-up",
            threads_ok,
            ", ".join(f"r{f.rank} {_arrow(f.base['threads'], f.end['threads'])}" for f in figures),
        ),
        Check(
            "open fds constant after warm-up",
            fds_ok,
            ", ".join(f"r{f.rank} {_arrow(f.base['fds'], f.end['fds'])}" for f in figures),
        ),
        Check(
            f"warnings <= {args.max_warnings} per rank, none repeated > {args.max_repeats} "
            f"times, stderr after warm-up <= {args.max_stderr_growth} B",
            warn_ok,
            f"max {total} per rank, max {repeats} repeats of one message, stderr {stderr_text}",
        ),
    ]


def _report(args: argparse.Namespace, result: RunResult) -> tuple[list[str], bool]:
    figures = [_figures(rank, args.warmup) for rank in result.ranks]
    rank0 = result.ranks[0]["samples"]
    loop_s = rank0[-1]["t"] - rank0[0]["t"]
    steps = rank0[-1]["step"] - rank0[0]["step"]
    base = figures[0].base
    steady = (rank0[-1]["step"] - base["step"]) / max(rank0[-1]["t"] - base["t"], 1e-9)
    group = "world" if args.group_size is None else args.group_size
    header = [
        f"# soak: {args.world} CPU ranks x {args.steps} steps, SyncBNCallback(group_size="
        f"{group!r}, log_every_n_steps={args.log_every}, drift=True)",
        "",
        f"Machine: {cpu_model()}, cpu_count={os.cpu_count()}; torch {torch.__version__}, "
        f"lightning {pl.__version__}, Python {sys.version.split()[0]}; "
        f"SYNCBN_IMPL={os.environ.get(syncbn_impl.IMPL_ENV, 'auto (unset)')}, "
        f"torch threads per rank={result.ranks[0]['torch_threads']}.",
        "",
        f"Run: strategy={args.strategy} (gloo), batch {args.batch} x 3x{IMAGE_SIZE}x{IMAGE_SIZE} "
        f"per rank, 5 BatchNorm layers (4x 2d, 1x 1d), epochs of {args.epoch_steps} steps, "
        f"validation (2 batches) after each, CSVLogger; samples every {args.sample_every} steps; "
        f"baseline = first sample at or after step {args.warmup}.",
        "",
        f"Time: fit {result.fit_seconds:.1f} s wall (launch to exit of all ranks); training loop "
        f"{loop_s:.1f} s for {steps} steps = {steps / max(loop_s, 1e-9):.1f} steps/s "
        f"({steady:.1f} steps/s after warm-up). CSV metrics rows: {result.csv_rows} "
        f"({result.csv_bn_rows} with bn/global_batch_size).",
        "",
    ]
    checks = _checks(figures, args)
    ok = all(c.ok for c in checks)
    lines = [
        *header,
        *_rank_table(figures),
        "",
        "Resident memory (MiB) over the run:",
        "",
        *_timeline(result.ranks),
        "",
        *_warning_table(figures, args.top_warnings),
        "",
        *(f"- {'PASS' if c.ok else 'FAIL'}: {c.name} ({c.detail})" for c in checks),
        "",
        f"Verdict: {'PASS' if ok else 'FAIL'} "
        f"({sum(c.ok for c in checks)}/{len(checks)} checks passed)",
    ]
    return lines, ok


# ---------------------------------------------------------------------------- main


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--world", type=int, default=4, help="CPU ranks (default: %(default)s)")
    add("--steps", type=int, default=3000, help="optimizer steps (default: %(default)s)")
    add("--batch", type=int, default=2, help="images per rank and step (default: %(default)s)")
    add(
        "--group-size",
        type=_group_size,
        default=2,
        help="SyncBNCallback group_size: an int or 'world' (default: %(default)s)",
    )
    add(
        "--log-every",
        type=int,
        default=10,
        help="SyncBNCallback and Trainer log_every_n_steps (default: %(default)s)",
    )
    add("--epoch-steps", type=int, default=200, help="steps per epoch (default: %(default)s)")
    add("--sample-every", type=int, default=25, help="steps between samples (default: 25)")
    add("--warmup", type=int, default=None, help="baseline step (default: 10%% of --steps)")
    add("--strategy", choices=("ddp", "ddp_spawn"), default="ddp", help="(default: ddp)")
    add("--show-stderr", action="store_true", help="leave the ranks' stderr on the terminal")
    add("--run-dir", type=Path, default=None, help="keep logs here (default: a temp dir)")
    add("--out", type=Path, default=None, help="also write the report (markdown) here")
    add("--top-warnings", type=int, default=5, help="warning messages listed (default: 5)")
    add("--max-rss-growth-mib", type=float, default=20.0, help="check (default: 20)")
    add("--max-rss-growth-pct", type=float, default=5.0, help="check (default: 5)")
    add("--max-warnings", type=int, default=20, help="check, per rank (default: 20)")
    add("--max-repeats", type=int, default=5, help="check, one message per rank (default: 5)")
    add("--max-stderr-growth", type=int, default=4096, help="check, bytes (default: 4096)")
    args = parser.parse_args(argv)
    for name in ("world", "steps", "batch", "log_every", "epoch_steps", "sample_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.world < 2:
        parser.error("--world must be >= 2: a single process has nothing to synchronize")
    if args.group_size is not None and args.world % args.group_size:
        parser.error(f"--group-size {args.group_size} must divide --world {args.world}")
    if args.warmup is None:
        args.warmup = max(args.steps // 10, 1)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    return args


def _prepare_extension() -> None:
    """Build the C++ extension here, once, before any rank starts (they load the cached build)."""
    if syncbn_impl.get_impl() == "ref":
        return
    try:
        ops_build.load_extension()
    except Exception as exc:  # auto falls back to ref in the ranks, with its own warning
        if syncbn_impl.get_impl() == "ext":
            raise
        print(f"note: C++ extension unavailable, the ranks will use the reference path: {exc}")


@contextlib.contextmanager
def _run_dir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="soak_"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak and print the report; 0 if every check passed, 1 otherwise."""
    args = _parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # banners, tips
    child_dir = os.environ.get(RUN_DIR_ENV)
    if child_dir and "LOCAL_RANK" in os.environ and args.strategy == "ddp":
        _run_child(args, Path(child_dir))
        return 0
    _prepare_extension()
    with _run_dir(args.run_dir) as run_dir:
        where = "the terminal" if args.show_stderr else f"{run_dir}/stderr_rank<r>.log"
        print(
            f"soak: {args.world} ranks x {args.steps} steps ({args.strategy}); "
            f"the ranks' stderr goes to {where}",
            flush=True,
        )
        result = _run(args, run_dir)
        lines, ok = _report(args, result)
    print("\n".join(lines), flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
