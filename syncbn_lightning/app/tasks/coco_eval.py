"""COCO box mAP with ``pycocotools`` (torchmetrics' detection mAP needs torchvision, which has no
CPU build here).

Detections are COCO result dicts in *original* image pixels:
``{"image_id": int, "category_id": int, "bbox": [x, y, w, h], "score": float}``.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["coco_map", "load_coco"]


def load_coco(annotation_file: str | Path) -> Any:
    """A ``pycocotools.coco.COCO`` index of ``annotation_file``, without pycocotools' prints."""
    from pycocotools.coco import COCO

    path = Path(annotation_file)
    if not path.is_file():
        raise FileNotFoundError(f"COCO annotation file {str(path)!r} does not exist")
    with contextlib.redirect_stdout(io.StringIO()):
        return COCO(str(path))


def coco_map(
    gt: Any, detections: Sequence[dict[str, Any]], image_ids: Iterable[int] | None = None
) -> dict[str, float]:
    """COCO box AP of ``detections`` against the ground truth ``gt``.

    Args:
        gt: a ``COCO`` index (see :func:`load_coco`) or the path of an annotation JSON.
        detections: COCO result dicts (see the module docstring); up to 100 per image count.
        image_ids: evaluate on these images only (e.g. those a limited validation loop saw);
            default: every image of ``gt``. Images without detections still count: their ground
            truth boxes are misses.

    Returns:
        ``{"mAP": AP@[.50:.95], "mAP50": AP@.50}``. Both are 0.0 when there are no detections
        (pycocotools cannot load an empty result list) or no ground truth box to find (COCOeval
        reports -1 there; "nothing found of nothing" is not a score worth plotting).
    """
    from pycocotools.cocoeval import COCOeval

    coco = gt if hasattr(gt, "loadRes") else load_coco(gt)
    ids = sorted(coco.getImgIds() if image_ids is None else set(image_ids))
    dets = [d for d in detections if d["image_id"] in set(ids)]
    if not dets or not ids or not coco.getAnnIds(imgIds=ids, iscrowd=None):
        return {"mAP": 0.0, "mAP50": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):
        result = coco.loadRes([dict(d) for d in dets])  # loadRes mutates the dicts it gets
        evaluator = COCOeval(coco, result, iouType="bbox")
        evaluator.params.imgIds = ids
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats = evaluator.stats
    return {"mAP": max(float(stats[0]), 0.0), "mAP50": max(float(stats[1]), 0.0)}
