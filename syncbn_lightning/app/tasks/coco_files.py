"""Where a COCO-layout dataset's files are and which are missing (no torch: the service checks a
config's ``data.root`` with it before it imports torch; :mod:`.coco` reads the data)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

__all__ = ["missing_files"]


def missing_files(
    root: str | Path,
    *,
    splits: Iterable[str] = ("train", "val"),
    images: str = "{split}",
    annotations: str = "annotations/instances_{split}.json",
) -> list[Path]:
    """The image directories and annotation files of a COCO-layout dataset that do not exist.

    Args:
        root: the dataset directory.
        splits: the split names substituted for ``{split}``. Default ``("train", "val")``.
        images: image directory of a split, relative to ``root``. Default ``"{split}"``.
        annotations: annotation file of a split, relative to ``root``.
            Default ``"annotations/instances_{split}.json"``.

    Returns:
        The missing paths (``root / ...``), in split order, images before annotations; empty
        when the dataset is complete.
    """
    root = Path(root)
    paths = []
    for split in splits:
        paths += [root / images.format(split=split), root / annotations.format(split=split)]
    return [p for p in paths if not p.exists()]
