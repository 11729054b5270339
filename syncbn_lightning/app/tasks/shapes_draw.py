"""Drawing one image of the synthetic shapes dataset (:mod:`.shapes`): a smooth noisy background,
optional unannotated clutter, circles/squares/triangles placed without heavy overlap in colours
that stand out, and an optional photometric shift. Deterministic for a given ``random.Random``.
A change to the drawing must bump ``shapes._FORMAT_VERSION`` so that old datasets are rebuilt."""

from __future__ import annotations

import math
import random
from typing import Any

from PIL import Image, ImageDraw

__all__ = ["CATEGORIES"]

CATEGORIES: tuple[dict[str, Any], ...] = (
    {"id": 1, "name": "circle"},
    {"id": 2, "name": "square"},
    {"id": 3, "name": "triangle"},
)
"""The COCO categories of the dataset, ids starting at 1."""

_MAX_IOU = 0.3  # a new shape's nominal box may not overlap an earlier one's with IoU > this
_MAX_COVERED = 0.5  # ... nor cover more than half of the smaller box (containment)
_PLACEMENT_TRIES = 50
_COLOUR_TRIES = 64
_MIN_BACKGROUND_DISTANCE = 140.0  # RGB Euclidean distance of an object colour to the background
_MIN_OBJECT_DISTANCE = 60.0  # ... and to the other objects of the image
_BACKGROUND_JITTER = 24  # per-channel spread of the smooth background around its base colour
_NOISE_ALPHA = 0.1  # weight of uniform noise blended into the background
_BRIGHTNESS_SPAN = 96.0  # photometric=p shifts an image's levels by up to +-p * this


def _overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[float, float]:
    """IoU and intersection over the smaller box of two square boxes ``(x, y, side)``."""
    iw = min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0])
    ih = min(a[1] + a[2], b[1] + b[2]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0, 0.0
    inter = iw * ih
    return inter / (a[2] ** 2 + b[2] ** 2 - inter), inter / min(a[2], b[2]) ** 2


def _free(box: tuple[int, int, int], placed: list[tuple[int, int, int]]) -> bool:
    """Whether ``box`` may join ``placed``: IoU <= 0.3 and never half inside another box."""
    for other in placed:
        iou, covered = _overlap(box, other)
        if iou > _MAX_IOU or covered > _MAX_COVERED:
            return False
    return True


def _background(rng: random.Random, size: int) -> tuple[Image.Image, list[tuple[int, int, int]]]:
    """A smooth colour field (a bilinearly upsampled 3x3 grid) with a little uniform noise.

    Returns the image and the grid colours (the background stays within a few levels of them).
    """
    base = [rng.randint(0, 255) for _ in range(3)]
    grid = [
        tuple(
            min(255, max(0, c + rng.randint(-_BACKGROUND_JITTER, _BACKGROUND_JITTER))) for c in base
        )
        for _ in range(9)
    ]
    smooth = Image.new("RGB", (3, 3))
    smooth.putdata(grid)
    smooth = smooth.resize((size, size), Image.Resampling.BILINEAR)
    noise = Image.frombytes("RGB", (size, size), rng.randbytes(3 * size * size))
    return Image.blend(smooth, noise, _NOISE_ALPHA), grid


def _object_colour(
    rng: random.Random,
    background: list[tuple[int, int, int]],
    taken: list[tuple[int, int, int]],
) -> tuple[int, int, int]:
    """A random colour far from every background colour and from the image's other objects.

    Rejection sampling; after ``_COLOUR_TRIES`` candidates the one with the best margin is used
    (there always is a colour more than 170 away from a background spread of +-24 per channel).
    """
    best: tuple[float, tuple[int, int, int]] = (-math.inf, (0, 0, 0))
    for _ in range(_COLOUR_TRIES):
        colour = (rng.randint(0, 255), rng.randint(0, 255), rng.randint(0, 255))
        margin = min(math.dist(colour, c) / _MIN_BACKGROUND_DISTANCE for c in background)
        if taken:
            margin = min(margin, min(math.dist(colour, c) / _MIN_OBJECT_DISTANCE for c in taken))
        if margin >= 1.0:
            return colour
        best = max(best, (margin, colour))
    return best[1]


def _shape_mask(category_id: int, image_size: int, x0: int, y0: int, s: int, turn: int):
    """An ``L`` mask (255 inside) of one shape whose nominal box is ``s x s`` at ``(x0, y0)``."""
    mask = Image.new("L", (image_size, image_size), 0)
    draw = ImageDraw.Draw(mask)
    x1, y1 = x0 + s - 1, y0 + s - 1  # PIL boxes are inclusive of their last pixel
    if category_id == 1:
        draw.ellipse((x0, y0, x1, y1), fill=255)
    elif category_id == 2:
        draw.rectangle((x0, y0, x1, y1), fill=255)
    else:
        mid_x, mid_y = (x0 + x1) / 2, (y0 + y1) / 2
        # Isosceles triangle, apex up / right / down / left.
        points = [
            [(mid_x, y0), (x1, y1), (x0, y1)],
            [(x1, mid_y), (x0, y1), (x0, y0)],
            [(mid_x, y1), (x0, y0), (x1, y0)],
            [(x0, mid_y), (x1, y0), (x1, y1)],
        ][turn]
        draw.polygon(points, fill=255)
    return mask


def _draw_clutter(
    rng: random.Random,
    image: Image.Image,
    background: list[tuple[int, int, int]],
    params: dict[str, Any],
) -> None:
    """Draw ``0..params["clutter"]`` unannotated distractors onto ``image``, in place.

    Outline rings and squares share the categories' edges but not their filled interior; line
    segments and crosses add edges of other shapes. Sizes span the objects' size range, colours
    contrast with the background as the objects' do.
    """
    size = params["image_size"]
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(0, params["clutter"])):
        s = rng.randint(params["min_size"], params["max_size"])
        x0, y0 = rng.randint(0, size - s), rng.randint(0, size - s)
        x1, y1 = x0 + s - 1, y0 + s - 1
        colour = _object_colour(rng, background, [])
        width = rng.randint(1, max(1, s // 6))
        kind = rng.randrange(4)
        if kind == 0:
            draw.ellipse((x0, y0, x1, y1), outline=colour, width=width)
        elif kind == 1:
            draw.rectangle((x0, y0, x1, y1), outline=colour, width=width)
        elif kind == 2:
            ends = (x0, y0 + rng.randint(0, s - 1), x1, y0 + rng.randint(0, s - 1))
            draw.line(ends, colour, width)
        else:
            mid_x, mid_y = (x0 + x1) // 2, (y0 + y1) // 2
            draw.line((x0, mid_y, x1, mid_y), colour, width)
            draw.line((mid_x, y0, mid_x, y1), colour, width)


def _photometric(rng: random.Random, image: Image.Image, spread: float) -> Image.Image:
    """Scale the image's contrast about mid-grey by ``U(1 - spread, 1 + spread)`` and shift its
    brightness by ``U(-1, 1) * spread * 96`` levels (the same for the three channels)."""
    contrast = rng.uniform(1.0 - spread, 1.0 + spread)
    shift = rng.uniform(-1.0, 1.0) * spread * _BRIGHTNESS_SPAN
    lut = [min(255, max(0, round((v - 128) * contrast + 128 + shift))) for v in range(256)]
    return image.point(lut * 3)


def _draw_image(
    rng: random.Random, params: dict[str, Any]
) -> tuple[Image.Image, list[dict[str, Any]]]:
    """One image and its annotations (``category_id``, ``bbox``, ``area``; no ids yet)."""
    size = params["image_size"]
    image, background = _background(rng, size)
    if params.get("clutter", 0):
        _draw_clutter(rng, image, background, params)
    wanted = rng.randint(params["min_objects"], params["max_objects"])
    placed: list[tuple[int, int, int]] = []  # nominal square boxes (x0, y0, side)
    for _ in range(wanted):
        for _ in range(_PLACEMENT_TRIES):
            s = rng.randint(params["min_size"], params["max_size"])
            box = (rng.randint(0, size - s), rng.randint(0, size - s), s)
            if _free(box, placed):
                placed.append(box)
                break
        # else: no free place for this object, the image gets one fewer
    objects: list[dict[str, Any]] = []
    colours: list[tuple[int, int, int]] = []
    for x0, y0, s in sorted(placed, key=lambda b: -b[2]):  # large first: small stay visible
        category_id = rng.randint(1, len(CATEGORIES))
        mask = _shape_mask(category_id, size, x0, y0, s, rng.randrange(4))
        left, top, right, bottom = mask.getbbox()  # exclusive right/bottom: the exact extent
        colour = _object_colour(rng, background, colours)
        image.paste(colour, (0, 0), mask)
        colours.append(colour)
        objects.append(
            {
                "category_id": category_id,
                "bbox": [float(left), float(top), float(right - left), float(bottom - top)],
                "area": float(mask.histogram()[255]),
                "iscrowd": 0,
            }
        )
    if params.get("photometric", 0.0):
        image = _photometric(rng, image, params["photometric"])
    return image, objects
