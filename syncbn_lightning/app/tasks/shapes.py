"""A synthetic detection dataset in COCO format: coloured circles, squares and triangles.

:func:`generate_shapes` writes, under ``root``::

    train/000000.png ...                  RGB PNGs, image_size x image_size
    val/000000.png ...
    annotations/instances_train.json      COCO "instances" files; images[i].file_name is
    annotations/instances_val.json        relative to the split directory

Each image has a smooth, slightly noisy background and ``min_objects..max_objects`` filled shapes
of distinct colours that contrast clearly with it. Two options make the task harder (both off by
default, which keeps the default dataset byte-identical to earlier versions): ``clutter`` draws up
to that many unannotated distractors under the objects (outline rings and squares, which look like
the categories' edges, line segments and crosses), and ``photometric`` applies a random per-image
contrast and brightness change, so that images differ in their global statistics the way photos
taken under different exposure do (what makes the statistics of a 2-image batch unlike the
population's). Category ids start at 1 as in COCO
(1 circle, 2 square, 3 triangle). A box is the exact pixel extent ``[x, y, w, h]`` of the shape
as drawn (the pixel ``(i, j)`` covers ``[i, i + 1) x [j, j + 1)``), for the whole shape even
where a later shape covers part of it; ``area`` is its number of pixels. A shape is never placed
where its box would overlap an earlier one's with IoU > 0.3 or cover more than half of the
smaller of the two boxes, and shapes are drawn largest first, so every shape stays mostly visible.

The output depends only on the parameters (and the Pillow version, through PNG encoding): the
train and val splits draw from two random streams derived from ``seed``. Generation is
idempotent and safe when several processes (DDP ranks, nodes sharing a file system) call it at
once: each writes into its own temporary sibling of ``root`` and publishes it with one atomic
``os.rename``; the losers delete their copy and use the winner's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import shutil
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .shapes_draw import CATEGORIES, _draw_image

__all__ = ["CATEGORIES", "generate_shapes"]

log = logging.getLogger(__name__)

_FORMAT_VERSION = 1  # bump when the drawing changes, so that old datasets are not reused
_INFO_KEY = "syncbn_shapes"
_SPLITS = ("train", "val")
_HARDER_DEFAULTS: dict[str, Any] = {"clutter": 0, "photometric": 0.0}


def _check_params(
    *,
    num_train: int,
    num_val: int,
    image_size: int,
    min_objects: int,
    max_objects: int,
    min_size: int,
    max_size: int,
    seed: int,
    clutter: int = 0,
    photometric: float = 0.0,
) -> dict[str, Any]:
    """Validate the generation parameters and return them as the dict stored in ``info``.

    ``clutter`` and ``photometric`` enter the dict only when they are not at their defaults (off),
    so that datasets written before these options existed still match their parameters.

    Raises:
        ValueError: naming the first invalid argument and what it must be.
    """
    values = {
        "num_train": num_train,
        "num_val": num_val,
        "image_size": image_size,
        "min_objects": min_objects,
        "max_objects": max_objects,
        "min_size": min_size,
        "max_size": max_size,
        "seed": seed,
    }
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    lower_bounds = {
        "num_train": 1,
        "num_val": 1,
        "image_size": 8,
        "min_objects": 1,
        "max_objects": 1,
        "min_size": 4,
        "max_size": 4,
        "seed": 0,
    }
    for name, low in lower_bounds.items():
        if values[name] < low:
            raise ValueError(f"{name} must be >= {low}, got {values[name]}")
    if min_objects > max_objects:
        raise ValueError(
            f"min_objects ({min_objects}) must be <= max_objects ({max_objects}); "
            "raise max_objects or lower min_objects"
        )
    if min_size > max_size:
        raise ValueError(
            f"min_size ({min_size}) must be <= max_size ({max_size}); "
            "raise max_size or lower min_size"
        )
    if isinstance(clutter, bool) or not isinstance(clutter, int) or clutter < 0:
        raise ValueError(
            f"clutter must be an int >= 0 (most unannotated distractors per image), got {clutter!r}"
        )
    if (
        isinstance(photometric, bool)
        or not isinstance(photometric, (int, float))
        or not 0.0 <= photometric < 1.0
    ):
        raise ValueError(
            f"photometric must be a number in [0, 1) (the per-image contrast and brightness "
            f"spread), got {photometric!r}"
        )
    if max_size >= image_size:
        raise ValueError(
            f"max_size ({max_size}) must be < image_size ({image_size}) so that shapes fit; "
            "lower max_size or raise image_size"
        )
    harder = {"clutter": clutter, "photometric": float(photometric)}
    extra = {k: v for k, v in harder.items() if v != _HARDER_DEFAULTS[k]}
    return {"version": _FORMAT_VERSION, **values, **extra}


# ----------------------------------------------------------------------------- drawing


def _write_split(dest: Path, split: str, params: dict[str, Any], bar: tqdm) -> dict[str, Any]:
    """Draw one split's images into ``dest/split`` and return its COCO dict."""
    rng = random.Random(f"syncbn_shapes/{split}/{params['seed']}")
    split_dir = dest / split
    split_dir.mkdir(parents=True)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    size = params["image_size"]
    for index in range(params[f"num_{split}"]):
        image, objects = _draw_image(rng, params)
        file_name = f"{index:06d}.png"
        image.save(split_dir / file_name, format="PNG")
        image_id = index + 1
        images.append({"id": image_id, "file_name": file_name, "width": size, "height": size})
        for obj in objects:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, **obj})
        bar.update(1)
    return {
        "info": {
            "description": f"syncbn_lightning synthetic shapes, {split} split",
            "version": str(_FORMAT_VERSION),
            _INFO_KEY: params,
        },
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": [dict(c) for c in CATEGORIES],
    }


def _write_dataset(dest: Path, params: dict[str, Any], *, progress: bool) -> None:
    """Write the whole dataset into the (new) directory ``dest``; the val JSON is written last."""
    total = params["num_train"] + params["num_val"]
    (dest / "annotations").mkdir(parents=True)
    with tqdm(total=total, desc="synthetic shapes", unit="img", disable=not progress) as bar:
        for split in _SPLITS:  # "val" last: its annotation file marks a complete dataset
            coco = _write_split(dest, split, params, bar)
            with open(dest / "annotations" / f"instances_{split}.json", "w") as f:
                json.dump(coco, f)


# ----------------------------------------------------------------------------- publishing


def _marker(root: Path) -> Path:
    return root / "annotations" / "instances_val.json"


def _stored_params(annotation_file: Path) -> Any:
    """``info.syncbn_shapes`` of an annotation file, or ``None`` when it has none."""
    try:
        with open(annotation_file) as f:
            coco = json.load(f)
    except (OSError, ValueError):
        return None
    info = coco.get("info") if isinstance(coco, dict) else None
    return info.get(_INFO_KEY) if isinstance(info, dict) else None


def _check_existing(root: Path, params: dict[str, Any]) -> bool:
    """Whether ``root`` holds the dataset of ``params``; ``False`` when it holds no dataset.

    Raises:
        ValueError: when ``root`` holds something else: a dataset with other parameters, a
            damaged one, a file, or a non-empty directory of other content.
    """
    if not root.exists():
        return False
    if not root.is_dir():
        raise ValueError(
            f"root={str(root)!r} exists and is not a directory; choose another root for the "
            "synthetic shapes dataset"
        )
    marker = _marker(root)
    if not marker.exists():
        if any(root.iterdir()):
            raise ValueError(
                f"root={str(root)!r} is not empty and holds no synthetic shapes dataset (no "
                f"{marker}); choose another (new or empty) root or delete {root}"
            )
        return False
    stored = _stored_params(marker)
    if stored != params:
        raise ValueError(
            f"{marker} holds a dataset generated with other parameters ({stored!r}) than the "
            f"requested {params!r}; choose another root or delete {root} to regenerate it"
        )
    for split in _SPLITS:
        files = root / split
        count = sum(1 for p in files.glob("*.png")) if files.is_dir() else 0
        annotation_file = root / "annotations" / f"instances_{split}.json"
        if count != params[f"num_{split}"] or _stored_params(annotation_file) != params:
            raise ValueError(
                f"the synthetic shapes dataset at {root} is incomplete ({files} holds {count} "
                f"of {params[f'num_{split}']} images, or {annotation_file} is missing or "
                f"differs); delete {root} to regenerate it"
            )
    return True


def _publish(tmp: Path, root: Path, params: dict[str, Any]) -> bool:
    """Move the finished dataset ``tmp`` to ``root`` atomically, or adopt a concurrent winner's.

    ``os.rename`` replaces a missing or empty ``root`` and fails when another process has
    already put a dataset there; ``tmp`` is then deleted and the winner's dataset validated.

    Returns:
        ``True`` when ``tmp`` became ``root``, ``False`` when another process's dataset is used.

    Raises:
        ValueError: when what is at ``root`` is not the dataset of ``params``.
        OSError: when the rename failed for another reason (``root`` is left as it was).
    """
    try:
        os.rename(tmp, root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _check_existing(root, params):
            raise
        log.info("generate_shapes: another process wrote %s first; using it", root)
        return False
    return True


def generate_shapes(
    root: str | Path,
    *,
    num_train: int = 256,
    num_val: int = 64,
    image_size: int = 64,
    min_objects: int = 1,
    max_objects: int = 3,
    min_size: int = 10,
    max_size: int = 28,
    seed: int = 0,
    clutter: int = 0,
    photometric: float = 0.0,
    progress: bool = True,
) -> Path:
    """Write the synthetic shapes detection dataset (COCO format) under ``root``, once.

    If ``root`` already holds the dataset of exactly these parameters (recorded in
    ``info["syncbn_shapes"]`` of ``annotations/instances_val.json``) it returns at once without
    writing anything. Otherwise the dataset is generated into a temporary sibling directory
    ``<root>.tmp-<pid>-<random>`` and renamed into place, so ``root`` never holds a partial
    dataset; concurrent callers with the same parameters all succeed and share one dataset.

    Args:
        root: the dataset directory; must be missing, empty, or this very dataset.
        num_train: number of training images (>= 1). Default 256.
        num_val: number of validation images (>= 1). Default 64.
        image_size: side of the square images in pixels (>= 8). Default 64.
        min_objects: fewest shapes drawn per image (>= 1). Default 1.
        max_objects: most shapes drawn per image (>= ``min_objects``); an image gets fewer
            when no place with IoU <= 0.3 to the shapes already placed is found (the first
            shape always fits, so every image has at least one). Default 3.
        min_size: smallest side of a shape's nominal square box in pixels (>= 4). Default 10.
        max_size: largest side (``min_size <= max_size < image_size``). Default 28.
        seed: seed of the random streams (>= 0); train and val use different streams. Default 0.
        clutter: most unannotated distractors per image (>= 0; each image draws ``0..clutter``):
            outline rings and squares, line segments and crosses, drawn under the objects.
            Default 0 (none).
        photometric: per-image contrast factor ``U(1 - p, 1 + p)`` and brightness shift up to
            ``+-96 p`` levels, applied to the finished image (``0 <= p < 1``). Default 0 (off).
        progress: show a tqdm progress bar over the images. Default True.

    Returns:
        ``Path(root)``.

    Raises:
        ValueError: for an invalid argument (named in the message); when ``root`` holds a
            dataset generated with other parameters, or is a file or a non-empty directory
            that is not a synthetic shapes dataset (choose another root or delete it).

    Example:
        >>> import tempfile, json
        >>> root = generate_shapes(tempfile.mkdtemp() + "/shapes", num_train=2, num_val=1,
        ...                        progress=False)
        >>> coco = json.load(open(root / "annotations" / "instances_val.json"))
        >>> [c["name"] for c in coco["categories"]], coco["images"][0]["file_name"]
        (['circle', 'square', 'triangle'], '000000.png')

    Note:
        The result is a pure function of the parameters: the same seed gives byte-identical
        JSON and (with the same Pillow) byte-identical PNGs. Boxes are ``[x, y, w, h]`` floats in
        pixels, the exact extent of the drawn shape; ``area`` is its pixel count.
    """
    params = _check_params(
        num_train=num_train,
        num_val=num_val,
        image_size=image_size,
        min_objects=min_objects,
        max_objects=max_objects,
        min_size=min_size,
        max_size=max_size,
        seed=seed,
        clutter=clutter,
        photometric=photometric,
    )
    root = Path(root).expanduser()
    if _check_existing(root, params):
        log.debug("generate_shapes: %s already holds the requested dataset", root)
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f"{root.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        _write_dataset(tmp, params, progress=progress)
        if not _publish(tmp, root, params):
            return root
    finally:
        if tmp.exists():
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)
    log.info(
        "generate_shapes: wrote %d train + %d val synthetic shapes images (%dx%d) to %s",
        num_train,
        num_val,
        image_size,
        image_size,
        root,
    )
    return root
