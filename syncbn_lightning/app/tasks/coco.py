"""COCO-format object detection data: a letterboxing dataset and its Lightning datamodule.

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

import inspect
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .shapes import _check_params, generate_shapes

__all__ = [
    "PIXEL_MEAN",
    "PIXEL_STD",
    "CocoDetection",
    "detection_collate",
    "missing_files",
    "CocoDataModule",
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


_SHAPES_LAYOUT = {
    "train_split": "train",
    "val_split": "val",
    "images": "{split}",
    "annotations": "annotations/instances_{split}.json",
}


class CocoDataModule(pl.LightningDataModule):
    """Train/val dataloaders over a COCO-format detection dataset, optionally synthetic.

    The dataset lives under ``root``: split ``s`` has its images in ``root / images`` and its
    annotations in ``root / annotations`` with ``{split}`` replaced by ``s``. With ``synthetic``
    set, :meth:`prepare_data` (run by Lightning once per node, on local rank 0) writes the
    synthetic shapes dataset there first with
    :func:`~syncbn_lightning.app.tasks.shapes.generate_shapes` (a no-op when it already exists).
    Batches are ``(images [B, 3, S, S], targets: list[dict])`` as described in the module
    docstring.

    Args:
        root: the dataset directory.
        image_size: side ``S`` of the letterboxed network input (>= 16). Default 64.
        batch_size: samples per batch and process (>= 1). Default 2.
        num_workers: DataLoader worker processes (>= 0; persistent when > 0). Default 0.
        train_split: name of the training split. Default ``"train"``.
        val_split: name of the validation split. Default ``"val"``.
        images: image directory of a split relative to ``root``. Default ``"{split}"``.
        annotations: annotation file of a split relative to ``root``.
            Default ``"annotations/instances_{split}.json"``.
        hflip: random horizontal flips of training samples. Default True.
        synthetic: keyword arguments of ``generate_shapes(root, **synthetic)`` (e.g.
            ``{"num_train": 256, "num_val": 64}``); ``None`` (default) uses existing files.
            Requires the default split names and layout.

    Attributes:
        num_classes, category_ids: after :meth:`setup`, from the validation annotations
            (``category_ids[label]`` is the COCO category id of a label).
        val_annotation_file: after :meth:`setup`, the validation annotation file (for COCO mAP).

    Raises:
        ValueError: for an invalid argument, named as in the ``data`` config group (e.g.
            ``data.batch_size``), checked at construction, before any process is spawned.

    Example:
        >>> import tempfile
        >>> dm = CocoDataModule(tempfile.mkdtemp() + "/shapes", batch_size=2,
        ...                     synthetic={"num_train": 4, "num_val": 2, "progress": False})
        >>> dm.prepare_data(); dm.setup("fit")
        >>> images, targets = next(iter(dm.train_dataloader()))
        >>> images.shape, len(targets), dm.num_classes
        (torch.Size([2, 3, 64, 64]), 2, 3)

    Note:
        Train loaders shuffle and drop the last incomplete batch (every step sees
        ``batch_size`` samples per process, which keeps BatchNorm statistics comparable);
        val loaders keep every sample in order. Under DDP, Lightning adds the distributed
        sampler. In a single-process Trainer the train loader draws the same permutation that
        sampler does (``DistributedSampler`` with one replica, seeded by the global seed and
        the epoch), so one process with batch ``W * B`` trains at every step on exactly the images
        that ``W`` processes with batch ``B`` see together: a large-batch reference run and its
        DDP counterparts share their data order. Flips use torch's RNG, so
        ``seed_everything(..., workers=True)`` makes them reproducible (they are drawn per
        process, so they differ between such runs).
    """

    def __init__(
        self,
        root: str,
        *,
        image_size: int = 64,
        batch_size: int = 2,
        num_workers: int = 0,
        train_split: str = "train",
        val_split: str = "val",
        images: str = "{split}",
        annotations: str = "annotations/instances_{split}.json",
        hflip: bool = True,
        synthetic: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("image_size", image_size, 16),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"data.{name} must be an int >= {low}, got {value!r}")
        for name, value in (("images", images), ("annotations", annotations)):
            if "{split}" not in value:
                raise ValueError(
                    f"data.{name}={value!r} must contain '{{split}}' (replaced by the split "
                    "name), e.g. 'annotations/instances_{split}.json'"
                )
        if synthetic is not None:
            synthetic = self._check_synthetic(
                synthetic,
                train_split=train_split,
                val_split=val_split,
                images=images,
                annotations=annotations,
            )
        self.save_hyperparameters()
        self.root = Path(root)
        self.image_size = image_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_split = train_split
        self.val_split = val_split
        self.images = images
        self.annotations = annotations
        self.hflip = hflip
        self.synthetic = synthetic
        self.train_set: CocoDetection | None = None
        self.val_set: CocoDetection | None = None
        self.num_classes: int | None = None
        self.category_ids: list[int] | None = None
        self.val_annotation_file: Path | None = None

    @staticmethod
    def _check_synthetic(synthetic: Any, **layout: str) -> dict[str, Any]:
        """Validate ``synthetic`` eagerly against ``generate_shapes``; return it as a dict."""
        if not isinstance(synthetic, Mapping):
            raise ValueError(
                f"data.synthetic must be a mapping of generate_shapes arguments or null, got "
                f"{type(synthetic).__name__}"
            )
        synthetic = dict(synthetic)
        accepted = list(inspect.signature(generate_shapes).parameters)[1:]
        unknown = sorted(set(synthetic) - set(accepted))
        if unknown:
            raise ValueError(
                f"data.synthetic has unknown keys {unknown}; accepted: {', '.join(accepted)}"
            )
        params = {k: v for k, v in synthetic.items() if k != "progress"}
        defaults = {
            k: p.default
            for k, p in inspect.signature(generate_shapes).parameters.items()
            if k in accepted and k != "progress"
        }
        try:
            _check_params(**{**defaults, **params})
        except ValueError as e:
            raise ValueError(f"data.synthetic: {e}") from None
        for name, value in layout.items():
            if value != _SHAPES_LAYOUT[name]:
                raise ValueError(
                    f"data.{name}={value!r} but the synthetic dataset has "
                    f"{name}={_SHAPES_LAYOUT[name]!r}; use the default or set data.synthetic=null"
                )
        return synthetic

    def _missing(self, splits: Iterable[str]) -> list[Path]:
        return missing_files(
            self.root, splits=splits, images=self.images, annotations=self.annotations
        )

    def _require(self, splits: Iterable[str]) -> None:
        missing = self._missing(splits)
        if missing:
            raise FileNotFoundError(
                f"data.root={str(self.root)!r} lacks {', '.join(str(p) for p in missing)}; "
                "point data.root at a COCO-format dataset (or fix data.images / "
                "data.annotations), or set data.synthetic to generate the synthetic one"
            )

    def _dataset(self, split: str, hflip: bool) -> CocoDetection:
        return CocoDetection(
            self.root / self.images.format(split=split),
            self.root / self.annotations.format(split=split),
            self.image_size,
            hflip=hflip,
        )

    def prepare_data(self) -> None:
        """Generate the synthetic dataset, or check that the configured files exist.

        Raises:
            FileNotFoundError: without ``synthetic``, naming ``data.root`` and the missing paths.
            ValueError: from ``generate_shapes`` when ``root`` holds something else.
        """
        if self.synthetic is not None:
            generate_shapes(self.root, **self.synthetic)
        else:
            self._require((self.train_split, self.val_split))

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets: train and val for ``fit`` (or ``None``), val only otherwise.

        Raises:
            FileNotFoundError: naming ``data.root`` and the missing paths.
            ValueError: when the train and val annotation files list different categories.
        """
        fit = stage in (None, "fit")
        self._require([self.train_split, self.val_split] if fit else [self.val_split])
        self.val_set = self._dataset(self.val_split, hflip=False)
        if fit:
            self.train_set = self._dataset(self.train_split, hflip=self.hflip)
            if self.train_set.category_ids != self.val_set.category_ids:
                raise ValueError(
                    f"the {self.train_split!r} and {self.val_split!r} annotation files of "
                    f"data.root={str(self.root)!r} list different categories "
                    f"({self.train_set.category_ids} vs {self.val_set.category_ids})"
                )
        self.num_classes = self.val_set.num_classes
        self.category_ids = list(self.val_set.category_ids)
        self.val_annotation_file = self.val_set.annotation_file

    def _loader(self, dataset: CocoDetection | None, train: bool) -> DataLoader:
        if dataset is None:
            stage, name = ("fit", "train") if train else ("validate", "val")
            raise RuntimeError(f"call CocoDataModule.setup({stage!r}) before {name}_dataloader()")
        sampler = self._single_process_sampler(dataset) if train else None
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train and sampler is None,
            sampler=sampler,
            drop_last=train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            collate_fn=detection_collate,
        )

    def _single_process_sampler(self, dataset: CocoDetection) -> DistributedSampler | None:
        """DDP's shuffle order for a single-process Trainer; ``None`` (plain shuffling, which
        Lightning replaces with its ``DistributedSampler``) under DDP or without a Trainer."""
        trainer = self.trainer
        if trainer is None or trainer.world_size != 1:
            return None
        # Lightning seeds its DistributedSampler with the same variable (seed_everything sets it).
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        return DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)

    def train_dataloader(self) -> DataLoader:
        """Shuffled batches of the training split, the last incomplete batch dropped."""
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        """The validation split in order, every sample kept."""
        return self._loader(self.val_set, train=False)
