"""The Lightning datamodule of the COCO-format detection data (:mod:`.coco`), optionally
generating the synthetic shapes dataset (:mod:`.shapes`) first."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, DistributedSampler

from .base import global_batch_size as measured_global_batch
from .coco import CocoDetection, detection_collate, missing_files
from .shapes import _check_params, generate_shapes

__all__ = ["CocoDataModule"]


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
        num_classes: the number of categories the annotations must list (what the model is
            built for); checked at :meth:`setup`. ``None`` (default): not checked.
        global_batch_size: the samples per optimizer step the run expects,
            ``batch_size x world size x accumulate_grad_batches``; checked at :meth:`setup`
            against the Trainer. ``None`` (default): not checked.

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
        num_classes: int | None = None,
        global_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("image_size", image_size, 16),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
            ("num_classes", num_classes, 1),
            ("global_batch_size", global_batch_size, 1),
        ):
            if value is None and name in ("num_classes", "global_batch_size"):
                continue
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
        self.expected_classes = num_classes
        self.expected_global_batch = global_batch_size
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
            ValueError: when the train and val annotation files list different categories, or
                ``num_classes``/``global_batch_size`` do not match the data/the Trainer.
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
        self._check_expectations()

    def _check_expectations(self) -> None:
        """``num_classes`` against the annotations, ``global_batch_size`` against the Trainer."""
        if self.expected_classes is not None and self.expected_classes != self.num_classes:
            raise ValueError(
                f"data.num_classes={self.expected_classes} but the annotations of "
                f"data.root={str(self.root)!r} list {self.num_classes} categories: set "
                f"data.num_classes={self.num_classes}"
            )
        trainer = self.trainer
        if self.expected_global_batch is None or trainer is None:
            return
        actual = measured_global_batch(trainer, self.batch_size)
        if actual != self.expected_global_batch:
            raise ValueError(
                f"data.global_batch_size={self.expected_global_batch} but this run steps with "
                f"{actual} samples (data.batch_size={self.batch_size} x {trainer.world_size} "
                f"processes x accumulate_grad_batches={trainer.accumulate_grad_batches}); it is "
                f"derived: change data.batch_size, the devices or the accumulation instead"
            )

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
