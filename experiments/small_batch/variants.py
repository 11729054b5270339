"""What the small-batch experiment compares: its variants, and the file each job's record is in.

Shared by :mod:`.runner` (which trains the jobs) and :mod:`.analysis` (which reads them).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EVALS", "FAMILIES", "PRETRAIN", "RECORD_FILE", "VARIANTS", "Variant"]

RECORD_FILE = "experiment.json"

EVALS: tuple[tuple[str, str], ...] = (
    ("ema", "EMA"),
    ("precise", "PreciseBN"),
    ("batch", "batch stats"),
)
"""Evaluation keys and their column names."""

PRETRAIN = "pretrain"
"""Directory name of the per-seed backbone pretraining jobs (``recipe=backbone_pretrain``)."""


@dataclass(frozen=True)
class Variant:
    """One configuration of the comparison.

    Attributes:
        name: short id (directory name, table key).
        label: what the table and the plots call it.
        overrides: ``train.py`` overrides that select it (on top of the preset's).
        norm_batch: images each normalization layer's statistics come from in training
            (``None``: GroupNorm, per image; ``0``: frozen, none).
        family: which table it belongs to (:data:`FAMILIES`).
        global_batch: images per optimizer step over all processes.
        pretrained: starts from the same seed's backbone pretraining (``model.init_backbone``).
        norm_label: the table's "norm. batch" cell when ``norm_batch`` alone does not say it
            (``normalize="step"``: each micro-batch normalizes over the step's so far).
    """

    name: str
    label: str
    overrides: tuple[str, ...]
    norm_batch: int | None
    family: str = "batchnorm"
    global_batch: int = 8
    pretrained: bool = False
    norm_label: str | None = None

    @property
    def one_process(self) -> bool:
        """Whether the variant trains in one process (the large-batch reference)."""
        return "trainer.devices=1" in self.overrides


FAMILIES: dict[str, str] = {
    "batchnorm": "BatchNorm from scratch, global batch 8",
    "sweep": "SyncBN norm-batch sweep at global batch 32 (4 proc x 8 img)",
    "groupnorm": "GroupNorm from scratch, global batch 8",
    "pretrained": "pretrained backbone, global batch 8",
    "accumulation": "gradient accumulation, 2 proc x 1 img x 4 steps, global batch 8",
}
"""The tables of the report, in order: family -> title."""

_4X2 = ("trainer.devices=4",)
_4X8 = ("trainer.devices=4", "data.batch_size=8")
# 2 processes x 1 image x 4 micro-batches per optimizer step: the global batch (8), learning
# rate and 1024 steps of the global-batch-8 variants, and the same 8 images at every step (the
# union of the 4 micro-batches of both ranks). PreciseBN over 128 batches = 32 steps = 256
# images, as the other global-batch-8 variants (the preset's 32 batches would be 64 images here).
_2X1X4 = (
    "recipe=detection_small_batch",
    "trainer.devices=2",
    "data.batch_size=1",
    "trainer.accumulate_grad_batches=4",
    "bn.precise_bn_batches=128",
)

VARIANTS: tuple[Variant, ...] = (
    Variant("local_bn", "local BN, 4 proc x 2 img", ("recipe=detection_local_bn", *_4X2), 2),
    Variant(
        "group2",
        "SyncBN group_size=2, 4 proc x 2 img",
        ("recipe=detection_group2", *_4X2, "bn.group_size=2"),
        4,
    ),
    Variant("syncbn", "SyncBN world, 4 proc x 2 img", ("recipe=detection_small_batch", *_4X2), 8),
    Variant(
        "large_batch",
        "plain BN, 1 proc x 8 img (reference)",
        ("recipe=detection_large_batch", "trainer.devices=1", "data.batch_size=8"),
        8,
    ),
    # The sweep goes on at a larger global batch: with 2 images per process, 4 processes reach a
    # normalization batch of 8 at most. Same 16 epochs (256 steps), learning rate scaled linearly
    # (x4); local BN at 8 images links the two global batches.
    Variant(
        "local_bn_b8",
        "local BN, 4 proc x 8 img",
        ("recipe=detection_local_bn", *_4X8),
        8,
        "sweep",
        32,
    ),
    Variant(
        "group2_b8",
        "SyncBN group_size=2, 4 proc x 8 img",
        ("recipe=detection_group2", *_4X8, "bn.group_size=2"),
        16,
        "sweep",
        32,
    ),
    Variant(
        "syncbn_b8",
        "SyncBN world, 4 proc x 8 img",
        ("recipe=detection_small_batch", *_4X8),
        32,
        "sweep",
        32,
    ),
    Variant("gn", "GroupNorm, 4 proc x 2 img", ("recipe=detection_gn", *_4X2), None, "groupnorm"),
    Variant(
        "pre_frozen",
        "pretrained, frozen BN, 4 proc x 2 img",
        ("recipe=detection_frozen", *_4X2),
        0,
        "pretrained",
        pretrained=True,
    ),
    Variant(
        "pre_local_bn",
        "pretrained, local BN, 4 proc x 2 img",
        ("recipe=detection_local_bn", *_4X2),
        2,
        "pretrained",
        pretrained=True,
    ),
    Variant(
        "pre_syncbn",
        "pretrained, SyncBN world, 4 proc x 2 img",
        ("recipe=detection_small_batch", *_4X2),
        8,
        "pretrained",
        pretrained=True,
    ),
    Variant(
        "acc_torch",
        "SyncBN, 2 proc x 1 img x 4 accum., torch's 4 updates/step",
        (*_2X1X4, "bn.step_statistics=null"),
        2,
        "accumulation",
    ),
    Variant(
        "acc_micro",
        "SyncBN, 2 proc x 1 img x 4 accum., step_statistics=micro",
        (*_2X1X4, "bn.step_statistics=micro"),
        2,
        "accumulation",
    ),
    Variant(
        "acc_step",
        "SyncBN, 2 proc x 1 img x 4 accum., step_statistics=step",
        (*_2X1X4, "bn.step_statistics=step"),
        2,
        "accumulation",
        norm_label="2, 4, 6, 8 (step so far)",
    ),
    Variant(
        "sync_2x4",
        "SyncBN world, 2 proc x 4 img (no accum.)",
        ("recipe=detection_small_batch", "trainer.devices=2", "data.batch_size=4"),
        8,
        "accumulation",
    ),
)
