"""Training-step time of a small BN convnet under Lightning DDP on CPU: SyncBN vs local BN.

Each variant trains the same model (5 conv+BN+ReLU blocks, 3->32->64 channels, global average
pooling, a linear head, cross-entropy on random labels of a fixed synthetic dataset generated
in-process) with a real ``lightning.pytorch.Trainer``: ``accelerator="cpu"``, ``devices=--world``,
``strategy="ddp_spawn"`` (gloo), ``--batch`` images of 3x64x64 per rank, SGD, ``--steps``
optimizer steps of which the first ``--warmup`` are not timed.

Variants:
    * ``local``: plain :class:`torch.nn.BatchNorm2d`, no synchronization (the baseline);
    * ``syncbn``: ``callbacks=[syncbn_lightning.SyncBNCallback()]``, which converts the
      BatchNorm layers to :class:`syncbn_lightning.SyncBatchNorm` (kernels as ``SYNCBN_IMPL``
      says; unset means ``auto``, the C++ extension, built here before any worker starts);
    * ``syncbn_ref``: the same callback with ``SYNCBN_IMPL=ref`` (the pure-PyTorch primitives),
      set in this process before spawning so the workers inherit it;
    * ``torch_plain``: :class:`PlainSyncBatchNorm2d` below, the naive plain-PyTorch SyncBN people
      write because :class:`torch.nn.SyncBatchNorm` refuses CPU tensors (per-channel sum, sum of
      squares and count, one differentiable all-reduce, autograd backward).

A step is timed on every rank from ``on_train_batch_start`` to ``on_train_batch_end`` (forward,
backward with DDP's gradient all-reduce, optimizer step, and the hooks of the callbacks listed
before the timer, so SyncBNCallback's own per-step work and its measurement steps, one extra
all_gather every ``log_every_n_steps`` = 50, are included; not the data loading). The step time is
the slowest rank's for that step; the table gives its median and 90th percentile over the timed
steps of all repeats. With ``--repeats`` > 1 the variants run interleaved (``local``, ``syncbn``,
..., ``local``, ``syncbn``, ...), so that drifts in machine load hit them alike. The collectives
column counts the ``torch.distributed`` calls made from Python in one (untimed) warm-up step;
DDP's gradient buckets are all-reduced from C++ and come on top in every variant.

Example:
    python benchmarks/bench_ddp_step.py --world 2 --batch 2
    python benchmarks/bench_ddp_step.py --variants local,syncbn --steps 110 --repeats 3 \\
        --out /tmp/bench_ddp_step.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from _common import count_collectives, cpu_model, env_var
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    from syncbn_lightning.ops import build as ops_build
    from syncbn_lightning.ops import dispatch as syncbn_impl
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from syncbn_lightning.ops import build as ops_build
    from syncbn_lightning.ops import dispatch as syncbn_impl

VARIANTS = ("local", "syncbn", "torch_plain", "syncbn_ref")
CALLBACK_VARIANTS = ("syncbn", "syncbn_ref")
# Python-level collectives counted in one warm-up step (DDP broadcasts buffers with
# _broadcast_coalesced; its gradient buckets are all-reduced from C++ and not seen here).
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "_broadcast_coalesced",
)
GOAL = ("syncbn", 1.3)  # the acceptance: SyncBN step <= 1.3x the local-BN step
DEFAULT_IMAGE_SIZE = 64
NUM_CLASSES = 10
SEED = 0


class PlainSyncBatchNorm2d(nn.BatchNorm2d):
    """Synchronized BatchNorm2d the naive way: all-reduced sums, autograd backward.

    Per channel, the local ``sum(x)``, ``sum(x^2)`` and element count are packed into one tensor,
    summed over the group with the differentiable
    :func:`torch.distributed.nn.functional.all_reduce`, and turned into the group mean and biased
    variance ``E[x^2] - E[x]^2`` (in float32). The backward pass is autograd through all of it,
    the all-reduce included (whose backward is another all-reduce).

    Args:
        num_features: ``C``, the number of channels.
        eps: added to the variance before the inverse square root. Default: ``1e-5``.
        momentum: weight of the new batch in the running-stat update. Default: ``0.1``.

    Note:
        Uneven batches are handled (the counts are summed too). ``running_var`` gets the unbiased
        group variance, as torch does. Eval mode, or training without an initialized process
        group, is plain :class:`torch.nn.BatchNorm2d`.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(input)
        self._check_input_dim(input)
        channels = input.shape[1]
        x32 = input.float()
        count = x32.new_full((1,), input.numel() / channels)
        packed = torch.cat([x32.sum((0, 2, 3)), x32.square().sum((0, 2, 3)), count])
        packed = dist_nn.all_reduce(packed)
        total = packed[-1]
        mean = packed[:channels] / total
        var = (packed[channels : 2 * channels] / total - mean * mean).clamp_min(0.0)
        scale = self.weight * torch.rsqrt(var + self.eps)
        shift = self.bias - mean * scale
        self._update_running_stats(mean.detach(), var.detach(), total.detach())
        view = (1, channels, 1, 1)
        return input * scale.to(input.dtype).view(view) + shift.to(input.dtype).view(view)

    @torch.no_grad()
    def _update_running_stats(
        self, mean: torch.Tensor, var: torch.Tensor, total: torch.Tensor
    ) -> None:
        """Momentum update of the running statistics with the unbiased group variance."""
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        unbiased = var * (total / (total - 1).clamp_min(1.0))
        self.running_mean.lerp_(mean, self.momentum)
        self.running_var.lerp_(unbiased, self.momentum)
        self.num_batches_tracked.add_(1)


def make_convnet(norm: Callable[[int], nn.Module]) -> nn.Sequential:
    """Five conv+norm+ReLU blocks (3->32->32->64->64->64, two stride-2), pooling, linear head."""
    plan = ((3, 32, 1), (32, 32, 2), (32, 64, 1), (64, 64, 2), (64, 64, 1))
    layers: list[nn.Module] = []
    for cin, cout, stride in plan:
        layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), norm(cout), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(plan[-1][1], NUM_CLASSES)]
    return nn.Sequential(*layers)


class ConvNetModule(pl.LightningModule):
    """The benchmark model: SGD on cross-entropy over a fixed synthetic dataset.

    Args:
        variant: ``torch_plain`` builds the model with :class:`PlainSyncBatchNorm2d`, every other
            variant with :class:`torch.nn.BatchNorm2d` (the callback variants convert it).
        samples: images in the dataset (the world's batch times the number of steps).
        batch: images per rank and step.
    """

    def __init__(self, variant: str, samples: int, batch: int, image_size: int) -> None:
        super().__init__()
        torch.manual_seed(SEED)  # the same initial weights in every variant
        norm = PlainSyncBatchNorm2d if variant == "torch_plain" else nn.BatchNorm2d
        self.model = make_convnet(norm)
        self.samples = samples
        self.batch = batch
        self.image_size = image_size

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        images, labels = batch
        return nn.functional.cross_entropy(self.model(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(SEED)
        images = torch.randn(self.samples, 3, self.image_size, self.image_size, generator=generator)
        labels = torch.randint(0, NUM_CLASSES, (self.samples,), generator=generator)
        return DataLoader(TensorDataset(images, labels), batch_size=self.batch, drop_last=True)


class StepTimer(pl.Callback):
    """Times every training step on every rank and writes them to ``<out_dir>/rank<r>.json``.

    Also sets the worker's torch thread count in ``setup`` and counts the Python-level
    ``torch.distributed`` collectives of step ``count_step``.

    Args:
        out_dir: where each rank writes its JSON file (in ``on_train_end``).
        threads: ``torch.set_num_threads`` in every worker.
        count_step: index of the (warm-up) step whose collectives are counted.
    """

    def __init__(self, out_dir: Path, threads: int, count_step: int) -> None:
        self.out_dir = out_dir
        self.threads = threads
        self.count_step = count_step
        self.seconds: list[float] = []
        self.collectives: dict[str, int] = {}
        self._start = 0.0
        self._counting: contextlib.ExitStack | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        torch.set_num_threads(self.threads)
        _quiet_known_warnings()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.count_step:
            self._counting = count_collectives(COLLECTIVES, self.collectives)
        self._start = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        if self._counting is not None:
            self._counting.close()
            self._counting = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        result = {
            "rank": trainer.global_rank,
            "seconds": self.seconds,
            "collectives": self.collectives,
            "threads": torch.get_num_threads(),
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _quiet_known_warnings() -> None:
    """Hide warnings that are expected in this benchmark and say nothing about its results."""
    # torch_plain uses the differentiable all_reduce on purpose: it is what such SyncBNs use.
    warnings.filterwarnings(
        "ignore", message=r"torch\.distributed\.nn\.functional\.all_reduce is deprecated"
    )
    # The synthetic dataset lives in memory; loader workers would only add processes.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # Batch 2 x 2 ranks is the setting: SyncBNCallback's small-batch advice is expected.
    warnings.filterwarnings("ignore", message=r"SyncBNCallback: BatchNorm normalizes over only")
    # Lightning 2.6's own pytree helper on torch >= 2.13, once per rank and run.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")


def _variant_callbacks(variant: str) -> list[pl.Callback]:
    """The extra Trainer callbacks of ``variant`` (imported lazily: Lightning layer)."""
    if variant not in CALLBACK_VARIANTS:
        return []
    from syncbn_lightning import SyncBNCallback

    return [SyncBNCallback()]


@dataclass
class Run:
    """The timed steps of one Trainer.fit of one variant, as the workers reported them."""

    variant: str
    step_seconds: list[float]  # per timed step, the slowest rank's time
    collectives: dict[str, int]
    threads: int


def _run_variant(variant: str, args: argparse.Namespace) -> Run:
    """One ``Trainer.fit`` of ``variant`` with ``--world`` spawned CPU ranks."""
    with tempfile.TemporaryDirectory(prefix=f"bench_ddp_step_{variant}_") as tmp:
        out_dir = Path(tmp)
        count_step = max(args.warmup - 1, 0)
        timer = StepTimer(out_dir, args.threads, count_step)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=args.world,
            strategy="ddp_spawn",
            max_steps=args.steps,
            max_epochs=1,
            callbacks=[*_variant_callbacks(variant), timer],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp,
        )
        module = ConvNetModule(
            variant, args.world * args.batch * args.steps, args.batch, args.image_size
        )
        with env_var(syncbn_impl.IMPL_ENV, "ref" if variant == "syncbn_ref" else None):
            trainer.fit(module)
        results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(args.world)]
    per_rank = [result["seconds"][args.warmup :] for result in results]
    if len({len(seconds) for seconds in per_rank}) != 1 or not per_rank[0]:
        raise RuntimeError(f"{variant}: ranks timed {[len(s) for s in per_rank]} steps")
    return Run(
        variant=variant,
        step_seconds=[max(step) for step in zip(*per_rank, strict=True)],
        collectives=results[0]["collectives"],
        threads=results[0]["threads"],
    )


@dataclass
class Summary:
    """Pooled step times of one variant over all its repeats."""

    variant: str
    step_seconds: list[float] = field(default_factory=list)
    collectives: dict[str, int] = field(default_factory=dict)

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.step_seconds)

    @property
    def p90_ms(self) -> float:
        if len(self.step_seconds) < 2:
            return 1e3 * self.step_seconds[0]
        return 1e3 * statistics.quantiles(self.step_seconds, n=10, method="inclusive")[-1]


def _collectives_note(counts: dict[str, int]) -> str:
    """``"5 all_gather_into_tensor, 5 all_reduce, 1 _broadcast_coalesced"`` and DDP's grads."""
    seen = ", ".join(f"{counts[name]} {name}" for name in COLLECTIVES if counts.get(name))
    return (seen + " + " if seen else "") + "DDP grad buckets"


def _table(summaries: Sequence[Summary]) -> list[str]:
    """The markdown table: one row per variant, ratios against ``local`` where it was run."""
    local = next((s for s in summaries if s.variant == "local"), None)
    lines = [
        "| variant | median step ms | p90 ms | ratio vs local | collectives per step |",
        "|---|---:|---:|---:|---|",
    ]
    for summary in summaries:
        ratio = "-" if local is None else f"{summary.median_ms / local.median_ms:.2f}"
        cells = [
            summary.variant,
            f"{summary.median_ms:.1f}",
            f"{summary.p90_ms:.1f}",
            ratio,
            _collectives_note(summary.collectives),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _goal_line(summaries: Sequence[Summary]) -> list[str]:
    """Whether ``syncbn``'s median step is within the goal's factor of ``local``'s."""
    by_name = {s.variant: s for s in summaries}
    variant, bound = GOAL
    title = f"Goal: {variant} median step <= {bound}x local"
    if variant not in by_name or "local" not in by_name:
        return ["", f"{title}: not measured (needs {variant} and local)"]
    ratio = by_name[variant].median_ms / by_name["local"].median_ms
    return ["", f"{title}: {'met' if ratio <= bound else 'NOT met'} ({ratio:.2f}x)"]


def _header(args: argparse.Namespace, threads: int) -> list[str]:
    """The run's context: versions, threads, CPUs, and what exactly was timed."""
    timed = args.steps - args.warmup
    return [
        f"# bench_ddp_step: torch {torch.__version__}, lightning {pl.__version__}, "
        f"threads per rank={threads}, cpu_count={os.cpu_count()}, CPU: {cpu_model()}",
        "",
        f"Lightning Trainer, accelerator=cpu, strategy=ddp_spawn (gloo), {args.world} ranks, "
        f"batch {args.batch} x 3x{args.image_size}x{args.image_size} per rank, "
        f"5 conv+BN+ReLU blocks. "
        f"Step = on_train_batch_start..end (forward, backward, SGD step), slowest rank per step; "
        f"median and p90 over {timed} timed steps x {args.repeats} repeat(s) after "
        f"{args.warmup} warm-up steps each; variants interleaved. "
        f"SYNCBN_IMPL for syncbn: {os.environ.get(syncbn_impl.IMPL_ENV, 'auto (unset)')}.",
        "",
    ]


def _parse_variants(text: str) -> list[str]:
    variants = [v.strip() for v in text.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        raise argparse.ArgumentTypeError(
            f"unknown variant(s) {unknown}; choose a comma-separated subset of {','.join(VARIANTS)}"
        )
    return list(dict.fromkeys(variants))


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="CPU ranks (default: %(default)s)")
    parser.add_argument(
        "--batch", type=int, default=2, help="images per rank and step (default: %(default)s)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=60,
        help="optimizer steps per run, warm-up included (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="first steps of each run left out of the timings (default: %(default)s)",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=DEFAULT_IMAGE_SIZE,
        help="height and width of the square input images (default: %(default)s)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per variant, interleaved across variants (default: %(default)s)",
    )
    parser.add_argument(
        "--variants",
        type=_parse_variants,
        default=list(VARIANTS),
        help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    for name, least in (
        ("world", 1),
        ("batch", 1),
        ("image_size", 8),
        ("warmup", 0),
        ("threads", 1),
        ("repeats", 1),
    ):
        if getattr(args, name) < least:
            parser.error(f"--{name} must be >= {least}, got {getattr(args, name)}")
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if set(args.variants) & set(CALLBACK_VARIANTS):
        try:
            from syncbn_lightning import SyncBNCallback  # noqa: F401
        except ImportError as exc:
            parser.error(
                f"the syncbn variants need syncbn_lightning.SyncBNCallback ({exc}); "
                "leave them out with --variants local,torch_plain"
            )
    return args


def _prepare_extension(variants: Sequence[str]) -> None:
    """Build the C++ extension here, once, so that no worker builds it while being timed."""
    if "syncbn" not in variants or syncbn_impl.get_impl() == "ref":
        return
    try:
        ops_build.load_extension()
    except Exception as exc:  # auto falls back to ref in the workers, with its own warning
        if syncbn_impl.get_impl() == "ext":
            raise
        print(f"note: C++ extension unavailable, syncbn will use the reference path: {exc}")


def main(argv: Sequence[str] | None = None) -> None:
    """Run every variant ``--repeats`` times, interleaved, then print (and write) the report."""
    args = _parse_args(argv)
    _quiet_known_warnings()
    # Trainer's banner lines (accelerators, tips, "max_steps reached") for every run; the workers'
    # "Initializing distributed" lines come from fresh processes and still show.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    _prepare_extension(args.variants)
    summaries = {variant: Summary(variant) for variant in args.variants}
    threads = args.threads
    for _ in range(args.repeats):
        for variant in args.variants:
            run = _run_variant(variant, args)
            summaries[variant].step_seconds += run.step_seconds
            summaries[variant].collectives = run.collectives
            threads = run.threads
    ordered = [summaries[v] for v in args.variants]
    report = _header(args, threads) + _table(ordered) + _goal_line(ordered)
    print("\n".join(report), flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
