"""COCO-format object detection data: the letterboxing dataset (its datamodule is
:class:`~syncbn_lightning.app.tasks.datamodule.CocoDataModule`).

Batch format (from :func:`detection_collate`)::

    images:  float32 tensor [B, 3, S, S], S = image_size, normalized as (x / 255 - 0.5) / 0.25
             (padding pixels are 0 before normalization, i.e. -2.0 after)
    targets: list of B dicts
        "boxes":     float32 [n, 4], x1 y1 x2 y2 in input pixels of the letterboxed image
        "labels":    int64 [n], contiguous labels 0..K-1 (label l is COCO category
                     ``category_ids[l]``; category ids are sorted, so the map is monotonic)
        "image_id":  int, the COCO image id
        "scale":     float, input pixels per original pixel
        "orig_size": (h, w) ints, the original image size

Coordinate conventions. Each image is letterboxed: resized by ``scale = S / max(h, w)`` to
``round(h * scale) x round(w * scale)`` (bilinear) and padded with zeros at the bottom and right
to ``S x S``, so input pixel coordinates are original ones times ``scale`` with no offset. A
model's boxes in input pixels map back to the original image by dividing by ``scale``; a COCO
``bbox`` (for ground truth and for results given to ``pycocotools``) is ``[x, y, w, h]`` in
original pixels, so a prediction ``x1 y1 x2 y2`` becomes
``[x1 / scale, y1 / scale, (x2 - x1) / scale, (y2 - y1) / scale]`` with category
``category_ids[label]``.

The annotation files are read with :mod:`json`; pycocotools is not needed here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from .coco_files import missing_files

__all__ = [
    "PIXEL_MEAN",
    "PIXEL_STD",
    "CocoDetection",
    "detection_collate",
    "missing_files",
]

PIXEL_MEAN = 0.5
"""Images are normalized as ``(x / 255 - PIXEL_MEAN) / PIXEL_STD`` (every channel)."""
PIXEL_STD = 0.25


class CocoDetection(Dataset):
    """Images and boxes of one COCO "instances" annotation file, letterboxed to a square.

    Category ids are mapped, in sorted order, to contiguous labels ``0..K-1``. Crowd
    annotations (``iscrowd=1``) and boxes narrower or lower than 1 pixel (after clipping to the
    image) are skipped; images without boxes are kept (with empty targets).

    Args:
        images_dir: directory that the images' ``file_name`` are relative to.
        annotation_file: the COCO JSON file (``images``, ``annotations``, ``categories``).
        image_size: side ``S`` of the square network input in pixels (>= 1).
        hflip: flip each sample horizontally with probability 0.5 (torch's RNG, so that
            ``torch.manual_seed`` / DataLoader worker seeding make it reproducible).
            Default False.

    Attributes:
        category_ids: ``category_ids[label]`` is the COCO category id of a label.
        num_classes: ``len(category_ids)``.
        image_ids: the COCO image ids, sorted; sample ``i`` is image ``image_ids[i]``.
        annotation_file: the annotation file, as a ``Path``.

    Raises:
        FileNotFoundError: when ``images_dir`` or ``annotation_file`` does not exist.
        ValueError: for ``image_size < 1``, an annotation file that is not COCO detection JSON,
            or an annotation whose category or image is not listed.

    Example:
        >>> import tempfile
        >>> from syncbn_lightning.app.tasks.shapes import generate_shapes
        >>> root = generate_shapes(tempfile.mkdtemp() + "/d", num_train=1, num_val=1,
        ...                        progress=False)
        >>> ds = CocoDetection(root / "val", root / "annotations/instances_val.json", 32)
        >>> image, target = ds[0]
        >>> image.shape, target["boxes"].shape[1], ds.num_classes, target["scale"]
        (torch.Size([3, 32, 32]), 4, 3, 0.5)

    Note:
        ``target["boxes"]`` are ``x1 y1 x2 y2`` in input pixels: the COCO box ``[x, y, w, h]``
        times ``scale``. With a flip, ``x`` maps to ``round(w * scale) - x`` (the flip is of the
        resized image, before padding), so padding stays at the bottom and right.
    """

    def __init__(
        self,
        images_dir: str | Path,
        annotation_file: str | Path,
        image_size: int,
        *,
        hflip: bool = False,
    ) -> None:
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
            raise ValueError(f"image_size must be an int >= 1, got {image_size!r}")
        self.images_dir = Path(images_dir)
        self.annotation_file = Path(annotation_file)
        if not self.images_dir.is_dir():
            raise FileNotFoundError(
                f"images_dir={str(self.images_dir)!r} is not a directory; pass the directory "
                "that the images' file_name entries are relative to"
            )
        if not self.annotation_file.is_file():
            raise FileNotFoundError(
                f"annotation_file={str(self.annotation_file)!r} does not exist; pass a COCO "
                "instances JSON file"
            )
        self.image_size = image_size
        self.hflip = hflip
        with open(self.annotation_file) as f:
            coco = json.load(f)
        if not isinstance(coco, dict) or not {"images", "categories"} <= coco.keys():
            raise ValueError(
                f"annotation_file={str(self.annotation_file)!r} is not COCO detection JSON "
                "(needs 'images', 'annotations' and 'categories')"
            )
        self.category_ids: list[int] = sorted(int(c["id"]) for c in coco["categories"])
        self.num_classes = len(self.category_ids)
        label_of = {cat: label for label, cat in enumerate(self.category_ids)}
        self._files: dict[int, str] = {int(im["id"]): im["file_name"] for im in coco["images"]}
        self.image_ids: list[int] = sorted(self._files)
        self._boxes: dict[int, list[tuple[list[float], int]]] = {i: [] for i in self.image_ids}
        for ann in coco.get("annotations", []):
            if ann.get("iscrowd", 0):
                continue
            x, y, w, h = (float(v) for v in ann["bbox"])
            if w < 1 or h < 1:
                continue
            if ann["category_id"] not in label_of or ann["image_id"] not in self._boxes:
                raise ValueError(
                    f"annotation {ann.get('id')} of {self.annotation_file} refers to category "
                    f"{ann['category_id']} / image {ann['image_id']}, which the file does not "
                    "list; fix the annotation file"
                )
            self._boxes[ann["image_id"]].append(
                ([x, y, x + w, y + h], label_of[ann["category_id"]])
            )

    def __len__(self) -> int:
        return len(self.image_ids)

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Any]]:
        image_id = self.image_ids[index]
        with Image.open(self.images_dir / self._files[image_id]) as raw:
            image = raw.convert("RGB")
        w, h = image.size
        size = self.image_size
        scale = size / max(h, w)
        new_w = min(size, max(1, round(w * scale)))
        new_h = min(size, max(1, round(h * scale)))
        image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)

        boxes = torch.tensor(
            [box for box, _ in self._boxes[image_id]], dtype=torch.float32
        ).reshape(-1, 4)
        labels = torch.tensor([label for _, label in self._boxes[image_id]], dtype=torch.int64)
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)  # clip to the image, then drop slivers
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h)
        keep = (boxes[:, 2] - boxes[:, 0] >= 1) & (boxes[:, 3] - boxes[:, 1] >= 1)
        boxes, labels = boxes[keep] * scale, labels[keep]

        if self.hflip and torch.rand(()).item() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            boxes = torch.stack(
                [new_w - boxes[:, 2], boxes[:, 1], new_w - boxes[:, 0], boxes[:, 3]], dim=1
            )

        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        canvas = torch.zeros(3, size, size, dtype=torch.uint8)
        canvas[:, :new_h, :new_w] = pixels.view(new_h, new_w, 3).permute(2, 0, 1)
        tensor = (canvas.float() / 255.0 - PIXEL_MEAN) / PIXEL_STD
        target = {
            "boxes": boxes,
            "labels": labels,
            "image_id": image_id,
            "scale": scale,
            "orig_size": (h, w),
        }
        return tensor, target


def detection_collate(
    batch: Sequence[tuple[Tensor, dict[str, Any]]],
) -> tuple[Tensor, list[dict[str, Any]]]:
    """Stack the images of ``(image, target)`` samples into ``[B, 3, S, S]``; keep the targets.

    Args:
        batch: samples of :class:`CocoDetection`.

    Returns:
        ``(images, targets)``: the stacked images and the list of the ``B`` target dicts.
    """
    images = torch.stack([image for image, _ in batch])
    return images, [target for _, target in batch]
