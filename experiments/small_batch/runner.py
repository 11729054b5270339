"""Run the small-batch experiment: every variant x seed as a ``train.py`` job, then the analysis.

Each job is a separate ``python train.py <overrides>`` process (the service's own launcher starts
its DDP ranks), so a run here is exactly what a user gets from the same command line. A job's
directory ``<runs>/<variant>/seed<k>/`` keeps the service's outputs (``results.json``, CSV
metrics, checkpoints, logs) and ``experiment.json`` (its overrides, wall time and the batch-
statistics probe). A job whose ``experiment.json`` records the same overrides is reused, so an
interrupted experiment resumes where it stopped; ``--force`` reruns everything (deleting the old
job directories).

The report keeps the published numbers of the variants whose job directories are not under
``--runs-dir`` (``--only-runs``: it does not), so that running one family on another machine
adds it to ``docs/small_batch/results.json`` without erasing the others (see :mod:`.analysis`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf
from torch.nn.modules.batchnorm import _BatchNorm

from syncbn_lightning.app.tasks.centernet import CenterNet
from syncbn_lightning.app.tasks.datamodule import CocoDataModule
from syncbn_lightning.lightning.batches import default_precise_forward
from syncbn_lightning.nn.precise_bn import update_bn_stats
from syncbn_lightning.nn.running_stats import running_stat_layers

from .analysis import write_report
from .variants import PRETRAIN, RECORD_FILE, VARIANTS, Variant

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RUNS = REPO / "experiments" / "small_batch" / "runs"
DEFAULT_DOCS = REPO / "docs" / "small_batch"

PRESETS: dict[str, tuple[str, ...]] = {
    # The experiment: 512 training images, 16 epochs (1024 optimizer steps at global batch 8,
    # 256 at 32), validation every 2 epochs, PreciseBN over 32 steps' worth of images (256 =
    # half the set).
    "full": (
        "data=shapes_hard",
        "trainer.max_epochs=16",
        "trainer.check_val_every_n_epoch=2",
        "bn.precise_bn_batches=32",
    ),
    # A minute-long rehearsal of the whole pipeline on a tiny dataset (the tests use it);
    # its numbers mean nothing.
    "smoke": (
        "data=shapes_hard",
        "data.synthetic.num_train=32",
        "data.synthetic.num_val=8",
        "trainer.max_epochs=2",
        "trainer.check_val_every_n_epoch=1",
        "bn.precise_bn_batches=2",
    ),
}
"""Overrides shared by every job of a preset (before the variant's own)."""

PRETRAIN_PRESETS: dict[str, tuple[str, ...]] = {
    # recipe=backbone_pretrain as it is: 2048 one-object images, 1 process x 64, 20 epochs.
    "full": (),
    "smoke": ("data.synthetic.num_train=64", "data.synthetic.num_val=16", "trainer.max_epochs=1"),
}
"""Overrides of the backbone pretraining job of a preset (``recipe=backbone_pretrain``)."""

SERVICE: tuple[str, ...] = (
    "logger=csv",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "evaluate=true",
    # Every validation's checkpoint is kept, so that last.ckpt is saved at every validation and
    # holds the final weights for the probe: Lightning 2.6 saves last.ckpt only at a validation
    # that also saved a top-k checkpoint, i.e. with the service's save_top_k=1 at the best
    # val/mAP so far, which need not be the last one.
    "callbacks.model_checkpoint.save_top_k=-1",
)
"""Overrides every job gets: CSV metrics for the plots, quiet logs, the closing evaluation, and
``checkpoints/last.ckpt`` at the last validation (the final weights: 16 epochs, validation
every 2)."""


def job_overrides(
    preset: str,
    variant: Variant,
    seed: int,
    extra: Sequence[str] = (),
    runs_dir: Path | None = None,
) -> list[str]:
    """The ``train.py`` overrides of one job (without its output and data paths); a pretrained
    variant starts from ``<runs_dir>/pretrain/seed<k>/checkpoints/last.ckpt``."""
    init: list[str] = []
    if variant.pretrained:
        if runs_dir is None:
            raise ValueError(f"variant {variant.name} is pretrained: give runs_dir")
        init = [f"model.init_backbone={pretrain_checkpoint(runs_dir, seed)}"]
    return [*PRESETS[preset], *SERVICE, *variant.overrides, f"seed={seed}", *init, *extra]


def pretrain_overrides(preset: str, seed: int) -> list[str]:
    """The ``train.py`` overrides of one seed's backbone pretraining job."""
    return [*SERVICE, "recipe=backbone_pretrain", *PRETRAIN_PRESETS[preset], f"seed={seed}"]


def pretrain_checkpoint(runs_dir: Path, seed: int) -> Path:
    """Where the backbone pretraining of ``seed`` leaves the checkpoint the detectors start from."""
    return runs_dir / PRETRAIN / f"seed{seed}" / "checkpoints" / "last.ckpt"


def variant_named(name: str) -> Variant:
    """The variant called ``name``; an unknown name exits with the list of known ones."""
    for v in VARIANTS:
        if v.name == name:
            return v
    names = ", ".join(v.name for v in VARIANTS)
    raise SystemExit(f"error: --variants: unknown variant {name!r}; choose from {names}")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_job(
    run_dir: Path, overrides: list[str], data_dir: Path, timeout_s: float, probe: bool = True
) -> dict[str, Any]:
    """Train one job (``python train.py``) into ``run_dir``; return its ``experiment.json``
    (with the :func:`batch_stat_probe` of a detector unless ``probe`` is false).

    Whatever ``run_dir`` held before (an older run of the job, a partial one) is deleted first.

    Raises:
        RuntimeError: when the job fails or runs past ``timeout_s`` (its whole process group
            is killed); the message has the tail of its log.
    """
    # A rerun starts from an empty directory: Lightning would version new checkpoints and CSV
    # files next to the old ones (last-v1.ckpt, version_1/) and the probe would read the old.
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    command = [
        sys.executable,
        "train.py",
        *overrides,
        f"hydra.run.dir={run_dir}",
        f"paths.data_dir={data_dir}",
    ]
    log_path = run_dir / "stdout.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(
                f"{run_dir}: train.py ran past --timeout-s={timeout_s:g} s and was killed; "
                f"log tail:\n{_tail(log_path)}"
            ) from None
    wall = time.monotonic() - start
    if rc != 0:
        raise RuntimeError(
            f"{run_dir}: `{' '.join(command)}` exited with {rc}; log tail:\n{_tail(log_path)}"
        )
    record = {"overrides": overrides, "wall_s": round(wall, 1)}
    if probe:
        record["probe"] = batch_stat_probe(run_dir)
    (run_dir / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record


def batch_stat_probe(run_dir: Path) -> dict[str, float]:
    """Validate the job's final weights normalizing with each validation batch's own statistics.

    Every BatchNorm layer is switched to training mode with ``momentum=0`` during validation, so
    it normalizes with the mean/variance of the current validation batch (``data.batch_size``
    images: 2 for the 4-process variants, 8 for the reference) and its running statistics stay
    untouched. The mAP drop against the running-statistics evaluation measures how much the
    statistics a layer normalizes with change the detections on this task; for the local-BN
    variant it is also the evaluation consistent with how it was trained.

    Also :func:`running_stat_probe` of the same checkpoint (its keys added).

    Returns:
        ``{"val/mAP": ..., "val/mAP50": ..., "batch": images per normalization, ...}``.
    """
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    root = Path(OmegaConf.select(cfg, "data.root", throw_on_missing=True))
    batch = int(cfg.data.batch_size)
    datamodule = CocoDataModule(
        str(root), image_size=int(cfg.data.synthetic.image_size), batch_size=batch
    )
    model = CenterNet.load_from_checkpoint(
        run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[BatchStatistics()],
    )
    # Before the validation below, whose train-mode layers count batches in num_batches_tracked.
    stats = running_stat_probe(run_dir, root, int(cfg.data.synthetic.image_size))
    (result,) = trainer.validate(model, datamodule=datamodule, verbose=False)
    return {
        "val/mAP": float(result["val/mAP"]),
        "val/mAP50": float(result["val/mAP50"]),
        "batch": batch,
        **stats,
    }


REFERENCE_BATCHES = 32
REFERENCE_BATCH_SIZE = 8
"""The probe's reference population statistics: 32 batches of 8 training images (256)."""


@torch.no_grad()
def running_stat_probe(run_dir: Path, root: Path, image_size: int) -> dict[str, float]:
    """How far the running statistics training left (``last.ckpt``, the EMA) are from
    population statistics of the same final weights, and how many updates they took.

    The reference is recomputed here the same way for every variant (whatever its processes,
    batch or PreciseBN setting): :func:`~syncbn_lightning.nn.precise_bn.update_bn_stats` over
    :data:`REFERENCE_BATCHES` batches of :data:`REFERENCE_BATCH_SIZE` training images in one
    process (layers normalizing with each batch's statistics, as PreciseBN does; a fixed shuffle,
    ``torch.manual_seed(0)``). Per layer, averaged over channels:

    * ``mean``: ``|mu_ema - mu_pop| / sqrt(var_pop + eps)``,
    * ``std``: ``|sqrt(var_ema + eps) / sqrt(var_pop + eps) - 1|``

    (the ``bn/gap_*`` formulas with the population in place of the batch).

    Returns:
        ``stat_err_{mean,std}_{avg,max}`` (average and maximum over layers) and
        ``num_batches_tracked_{min,max}`` over layers (running-statistics updates; torch counts
        one per forward in training mode, ``step_statistics`` one per optimizer step) and the
        optimizer step the checkpoint was saved at (``checkpoint_step``; the job's last one
        with :data:`SERVICE`); ``{}`` for a model without BatchNorm running statistics.
    """
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    state = saved["state_dict"]
    tracked = [int(v) for k, v in state.items() if k.endswith("num_batches_tracked")]
    model = CenterNet.load_from_checkpoint(ckpt, map_location="cpu", weights_only=True)
    layers = running_stat_layers(model)
    if not layers or not tracked:
        return {}
    ema = {
        n: (bn.running_mean.double().clone(), bn.running_var.double().clone()) for n, bn in layers
    }
    datamodule = CocoDataModule(str(root), image_size=image_size, batch_size=REFERENCE_BATCH_SIZE)
    datamodule.setup("fit")
    torch.manual_seed(0)
    update_bn_stats(
        model,
        iter(datamodule.train_dataloader()),
        REFERENCE_BATCHES,
        forward=lambda b: default_precise_forward(model, b),
    )
    errors: dict[str, list[float]] = {"mean": [], "std": []}
    for name, bn in layers:
        mean, var = ema[name]
        pop_std = (bn.running_var.double() + bn.eps).sqrt()
        errors["mean"].append(float(((mean - bn.running_mean.double()).abs() / pop_std).mean()))
        ratio = (var + bn.eps).sqrt() / pop_std
        errors["std"].append(float((ratio - 1.0).abs().mean()))
    out = {
        f"stat_err_{k}_{agg}": fn(v)
        for k, v in errors.items()
        for agg, fn in (("avg", lambda x: sum(x) / len(x)), ("max", max))
    }
    return {
        **out,
        "num_batches_tracked_min": min(tracked),
        "num_batches_tracked_max": max(tracked),
        "checkpoint_step": int(saved["global_step"]),
    }


class BatchStatistics(pl.Callback):
    """During validation every BatchNorm layer normalizes with the batch's own statistics; the
    running statistics are left as they are (``momentum=0``). For :func:`batch_stat_probe`."""

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for m in pl_module.modules():
            if isinstance(m, _BatchNorm):
                m.train()
                m.momentum = 0.0  # running = (1 - 0) * running + 0 * batch: unchanged


def _reusable(run_dir: Path, overrides: list[str]) -> dict[str, Any] | None:
    try:
        record = json.loads((run_dir / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    if record.get("overrides") != overrides or not (run_dir / "results.json").is_file():
        return None
    return record


def machine() -> dict[str, Any]:
    """What the experiment ran on: CPU, cores, memory, Python and library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f"{pages / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        memory = "unknown"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory": memory,
        "gpu": "none (CPU, gloo)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.small_batch",
        description=(
            "Train the small-batch variants (local BN / SyncBN groups of 2 / SyncBN world at "
            "4 processes x 2 and x 8 images, a 1 x 8 plain-BN reference, GroupNorm, and a "
            "pretrained backbone with frozen BN, local BN or SyncBN) on the harder synthetic "
            "shapes, for each seed; evaluate each with EMA, PreciseBN and per-batch statistics; "
            "write the tables, the knee of the norm-batch sweep and the plots."
        ),
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--variants", nargs="+", default=[v.name for v in VARIANTS], help="subset to run"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--runs-dir", type=Path, default=DEFAULT_RUNS, help="job directories")
    parser.add_argument("--docs-dir", type=Path, default=DEFAULT_DOCS, help="table and PNGs")
    parser.add_argument("--data-dir", type=Path, default=REPO / "data", help="datasets")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per job")
    parser.add_argument("--force", action="store_true", help="rerun jobs that already ran")
    parser.add_argument(
        "--analyze-only", action="store_true", help="only rebuild the table and plots"
    )
    parser.add_argument(
        "--override", action="append", default=[], help="extra train.py override, repeatable"
    )
    parser.add_argument(
        "--only-runs",
        action="store_true",
        help="report only the jobs under --runs-dir (default: also keep the numbers the docs "
        "dir's results.json publishes for variants whose jobs are not there)",
    )
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds) or any(s < 0 for s in args.seeds):
        parser.error(f"--seeds must be distinct non-negative ints, got {args.seeds}")
    args.variants = [variant_named(n) for n in dict.fromkeys(args.variants)]
    return args


def _reproduce_command(args: argparse.Namespace) -> str:
    """The command that trains (or reuses) these jobs and writes this report: the invocation
    without ``--force``/``--analyze-only`` and without the defaults."""
    parts = ["python -m experiments.small_batch"]
    if args.seeds != [0, 1, 2]:
        parts.append("--seeds " + " ".join(map(str, args.seeds)))
    if [v.name for v in args.variants] != [v.name for v in VARIANTS]:
        parts.append("--variants " + " ".join(v.name for v in args.variants))
    if args.preset != "full":
        parts.append(f"--preset {args.preset}")
    parts += [f"--override '{o}'" for o in args.override]
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or reuse) every job, then write ``<docs>/results.{md,json}`` and the PNGs."""
    args = _parse(argv)
    runs_dir, docs_dir = args.runs_dir.resolve(), args.docs_dir.resolve()
    command = _reproduce_command(args)
    start = time.monotonic()
    ran = 0
    jobs: list[tuple[str, int, list[str], bool]] = []
    if any(v.pretrained for v in args.variants):
        jobs += [(PRETRAIN, s, pretrain_overrides(args.preset, s), False) for s in args.seeds]
    for variant in args.variants:
        for seed in args.seeds:
            overrides = job_overrides(args.preset, variant, seed, args.override, runs_dir)
            jobs.append((variant.name, seed, overrides, True))
    for name, seed, overrides, probe in jobs:
        run_dir = runs_dir / name / f"seed{seed}"
        if args.analyze_only or (not args.force and _reusable(run_dir, overrides)):
            continue
        print(f"[small_batch] {name} seed {seed}: training ...", flush=True)
        record = run_job(run_dir, overrides, args.data_dir.resolve(), args.timeout_s, probe)
        ran += 1
        print(f"[small_batch] {name} seed {seed}: {record['wall_s']} s", flush=True)
    elapsed = time.monotonic() - start
    # The report covers every variant finished for these seeds, not only the ones run now, so
    # that rerunning one variant keeps the others in the table.
    finished = [
        v
        for v in VARIANTS
        if v in args.variants
        or all((runs_dir / v.name / f"seed{s}" / RECORD_FILE).is_file() for s in args.seeds)
    ]
    summary = write_report(
        runs_dir,
        docs_dir,
        variants=finished,
        seeds=args.seeds,
        meta={
            "command": command,
            "preset": args.preset,
            "preset_overrides": list(PRESETS[args.preset]) + list(args.override),
            "machine": machine(),
            "jobs_run_now": ran,
            "session_wall_s": round(elapsed, 1),
        },
        keep_published=not args.only_runs,
    )
    print(summary)
    return 0
