"""What the small-batch experiment compares: its variants, and the file each job's record is in.

Shared by :mod:`.runner` (which trains the jobs) and :mod:`.analysis` (which reads them).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RECORD_FILE", "VARIANTS", "Variant"]

RECORD_FILE = "experiment.json"


@dataclass(frozen=True)
class Variant:
    """One configuration of the comparison.

    Attributes:
        name: short id (directory name, table key).
        label: what the table and the plots call it.
        overrides: ``train.py`` overrides that select it (on top of the preset's).
        norm_batch: images each BatchNorm layer normalizes over in training.
    """

    name: str
    label: str
    overrides: tuple[str, ...]
    norm_batch: int


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "local_bn",
        "local BN, 4 proc x 2 img",
        ("recipe=detection_local_bn", "trainer.devices=4"),
        2,
    ),
    Variant(
        "group2",
        "SyncBN group_size=2, 4 proc x 2 img",
        ("recipe=detection_group2", "trainer.devices=4", "bn.group_size=2"),
        4,
    ),
    Variant(
        "syncbn",
        "SyncBN world, 4 proc x 2 img",
        ("recipe=detection_small_batch", "trainer.devices=4"),
        8,
    ),
    Variant(
        "large_batch",
        "plain BN, 1 proc x 8 img (reference)",
        ("recipe=detection_large_batch", "trainer.devices=1", "data.batch_size=8"),
        8,
    ),
)
