"""Detection data: the synthetic shapes generator, CocoDetection and CocoDataModule.

Everything runs on real files written to ``tmp_path`` (PNGs with Pillow, COCO JSON); the
generator's output is also loaded with pycocotools as an independent check of the format.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from pycocotools.coco import COCO

from syncbn_lightning.app.tasks.coco import (
    PIXEL_MEAN,
    PIXEL_STD,
    CocoDetection,
    detection_collate,
    missing_files,
)
from syncbn_lightning.app.tasks.datamodule import CocoDataModule
from syncbn_lightning.app.tasks.shapes import (
    _check_params,
    _publish,
    _write_dataset,
    generate_shapes,
)

SMALL = {"num_train": 8, "num_val": 4, "progress": False}
PAD = (0.0 - PIXEL_MEAN) / PIXEL_STD  # a zero (padding) pixel after normalization


def _files(root: Path) -> dict[str, int]:
    """Relative path -> mtime_ns of every file under ``root``."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def _write_coco(path: Path, images: list[dict], annotations: list[dict], category_ids) -> Path:
    path.write_text(
        json.dumps(
            {
                "images": images,
                "annotations": annotations,
                "categories": [{"id": c, "name": f"c{c}"} for c in category_ids],
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("shapes") / "data", **SMALL)


# ----------------------------------------------------------------------------- generator


def test_generator_writes_valid_coco(shapes_root: Path) -> None:
    root = shapes_root
    assert sorted(p.name for p in root.iterdir()) == ["annotations", "train", "val"]
    for split, count in (("train", 8), ("val", 4)):
        ann_file = root / "annotations" / f"instances_{split}.json"
        coco_json = json.loads(ann_file.read_text())
        params = coco_json["info"]["syncbn_shapes"]
        assert params["num_train"] == 8 and params["num_val"] == 4 and params["seed"] == 0
        assert coco_json["categories"] == [
            {"id": 1, "name": "circle"},
            {"id": 2, "name": "square"},
            {"id": 3, "name": "triangle"},
        ]
        assert [im["id"] for im in coco_json["images"]] == list(range(1, count + 1))
        assert sorted(p.name for p in (root / split).iterdir()) == [
            f"{i:06d}.png" for i in range(count)
        ]

        coco = COCO(str(ann_file))  # pycocotools accepts it
        assert sorted(coco.getImgIds()) == list(range(1, count + 1))
        assert sorted(coco.getCatIds()) == [1, 2, 3]
        ann_ids = coco.getAnnIds()
        assert len(set(ann_ids)) == len(ann_ids) > 0
        for image_id in coco.getImgIds():
            info = coco.loadImgs(image_id)[0]
            with Image.open(root / split / info["file_name"]) as im:
                assert im.mode == "RGB" and im.size == (info["width"], info["height"]) == (64, 64)
            anns = coco.loadAnns(coco.getAnnIds(imgIds=image_id))
            assert 1 <= len(anns) <= 3
            for ann in anns:
                x, y, w, h = ann["bbox"]
                assert all(isinstance(v, float) for v in ann["bbox"])
                assert x >= 0 and y >= 0 and w >= 1 and h >= 1
                assert x + w <= 64 and y + h <= 64
                assert 10 - 1 <= max(w, h) <= 28  # shape sizes within [min_size, max_size]
                assert 0 < ann["area"] <= w * h
                assert ann["iscrowd"] == 0 and ann["category_id"] in (1, 2, 3)


def test_boxes_are_the_exact_extent_of_the_shapes(shapes_root: Path) -> None:
    """Inside each box there are object pixels on all four edges (far from the background)."""
    coco = json.loads((shapes_root / "annotations" / "instances_val.json").read_text())
    for info in coco["images"]:
        with Image.open(shapes_root / "val" / info["file_name"]) as im:
            pixels = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
        pixels = pixels.view(64, 64, 3).float()
        anns = [a for a in coco["annotations"] if a["image_id"] == info["id"]]
        for ann in anns[-1:]:  # the last shape drawn is never covered by another
            x, y, w, h = (int(v) for v in ann["bbox"])
            # The background is smooth, so the box's border ring outside is background-like and
            # differs from the shape's colour, found at the box centre.
            colour = pixels[y + h // 2, x + w // 2]
            inside = (pixels[y : y + h, x : x + w] - colour).norm(dim=-1) < 1
            assert inside[0].any() and inside[-1].any()
            assert inside[:, 0].any() and inside[:, -1].any()
            full = (pixels - colour).norm(dim=-1) < 1
            outside = full.clone()
            outside[y : y + h, x : x + w] = False
            assert not outside.any()


def test_generator_is_deterministic(tmp_path: Path) -> None:
    a = generate_shapes(tmp_path / "a", **SMALL)
    b = generate_shapes(tmp_path / "b", **SMALL)
    c = generate_shapes(tmp_path / "c", **{**SMALL, "seed": 1})
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "val" / "000000.png").read_bytes() != (c / "val" / "000000.png").read_bytes()
    # Train and val draw from different streams.
    assert (a / "train" / "000000.png").read_bytes() != (a / "val" / "000000.png").read_bytes()


def test_second_call_is_a_fast_no_op(shapes_root: Path) -> None:
    before = _files(shapes_root)
    start = time.perf_counter()
    assert generate_shapes(str(shapes_root), **SMALL) == shapes_root
    assert time.perf_counter() - start < 0.5
    assert _files(shapes_root) == before


def test_other_parameters_raise(shapes_root: Path) -> None:
    before = _files(shapes_root)
    with pytest.raises(ValueError, match=r"instances_val\.json.*other parameters.*delete"):
        generate_shapes(shapes_root, **{**SMALL, "seed": 5})
    assert _files(shapes_root) == before


def test_foreign_root_raises(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"not empty.*choose another"):
        generate_shapes(tmp_path / "mine", **SMALL)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        generate_shapes(tmp_path / "file", **SMALL)
    (tmp_path / "empty").mkdir()  # an empty directory is filled
    assert (generate_shapes(tmp_path / "empty", **SMALL) / "val" / "000003.png").is_file()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_train": 0}, "num_train"),
        ({"num_val": -1}, "num_val"),
        ({"min_objects": 0}, "min_objects"),
        ({"min_objects": 3, "max_objects": 2}, "min_objects"),
        ({"min_size": 20, "max_size": 12}, "min_size"),
        ({"max_size": 64}, "max_size"),
        ({"image_size": 32.0}, "image_size"),
        ({"seed": -1}, "seed"),
    ],
)
def test_generator_rejects_bad_arguments(tmp_path: Path, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        generate_shapes(tmp_path / "d", **{**SMALL, **kwargs})
    assert not any(tmp_path.iterdir())


def _generate_after(start, root: str) -> None:
    start.wait(timeout=30)
    generate_shapes(root, **SMALL)


def test_concurrent_generation_shares_one_dataset(tmp_path: Path) -> None:
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    start = ctx.Event()
    root = tmp_path / "data"
    procs = [ctx.Process(target=_generate_after, args=(start, str(root))) for _ in range(2)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # no leftover tmp dirs
    reference = generate_shapes(tmp_path / "reference", **SMALL)
    for path in reference.rglob("*.json"):
        assert (root / path.relative_to(reference)).read_bytes() == path.read_bytes()


def test_losing_the_rename_race_adopts_the_winner(shapes_root: Path, tmp_path: Path) -> None:
    """What the process that renames second does, on real directories."""
    params = _check_params(
        num_train=8, num_val=4, image_size=64, min_objects=1, max_objects=3, min_size=10,
        max_size=28, seed=0,
    )  # fmt: skip
    before = _files(shapes_root)
    loser = tmp_path / "data.tmp-1-abcd"
    _write_dataset(loser, params, progress=False)
    assert _publish(loser, shapes_root, params) is False
    assert not loser.exists() and _files(shapes_root) == before

    other = {**params, "seed": 9}
    _write_dataset(loser, other, progress=False)
    with pytest.raises(ValueError, match="other parameters"):
        _publish(loser, shapes_root, other)
    assert not loser.exists() and _files(shapes_root) == before


# ----------------------------------------------------------------------------- dataset


def test_letterbox_of_a_non_square_image(tmp_path: Path) -> None:
    # An 80 x 40 (w x h) black image with a white rectangle at x 20..59, y 10..29.
    image = Image.new("RGB", (80, 40), (0, 0, 0))
    image.paste((255, 255, 255), (20, 10, 60, 30))
    (tmp_path / "img").mkdir()
    image.save(tmp_path / "img" / "a.png")
    ann = _write_coco(
        tmp_path / "ann.json",
        [{"id": 7, "file_name": "a.png", "width": 80, "height": 40}],
        [{"id": 1, "image_id": 7, "category_id": 2, "bbox": [20, 10, 40, 20], "iscrowd": 0}],
        [2],
    )
    ds = CocoDetection(tmp_path / "img", ann, 64)
    x, target = ds[0]
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32
    assert target["scale"] == pytest.approx(0.8)
    assert target["orig_size"] == (40, 80) and target["image_id"] == 7
    torch.testing.assert_close(target["boxes"], torch.tensor([[16.0, 8.0, 48.0, 24.0]]))
    assert target["labels"].tolist() == [0] and target["labels"].dtype == torch.int64
    assert target["boxes"].dtype == torch.float32
    # Resized to 64 x 32: rows 32.. are padding, zero in raw pixel space.
    assert (x[:, 32:, :] == PAD).all()
    raw = x * PIXEL_STD + PIXEL_MEAN
    assert raw[:, 12:20, 20:44].min() > 0.99  # inside the box: white
    assert raw[:, :32, :12].max() < 0.01  # left of the box: black
    # Mapping back to the original image: divide by scale.
    torch.testing.assert_close(
        target["boxes"] / target["scale"], torch.tensor([[20.0, 10, 60, 30]])
    )


def test_crowd_and_degenerate_boxes_are_skipped_and_labels_are_contiguous(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    for name in ("a.png", "b.png"):
        Image.new("RGB", (32, 32), (90, 90, 90)).save(tmp_path / "img" / name)
    ann = _write_coco(
        tmp_path / "ann.json",
        [
            {"id": 5, "file_name": "b.png", "width": 32, "height": 32},
            {"id": 2, "file_name": "a.png", "width": 32, "height": 32},
        ],
        [
            {"id": 1, "image_id": 2, "category_id": 7, "bbox": [1, 1, 10, 10], "iscrowd": 0},
            {"id": 2, "image_id": 2, "category_id": 3, "bbox": [5, 5, 8, 4], "iscrowd": 0},
            {"id": 3, "image_id": 2, "category_id": 3, "bbox": [0, 0, 20, 20], "iscrowd": 1},
            {"id": 4, "image_id": 2, "category_id": 7, "bbox": [3, 3, 0.5, 9], "iscrowd": 0},
            {"id": 5, "image_id": 5, "category_id": 3, "bbox": [2, 2, 4, 0], "iscrowd": 0},
        ],
        [7, 3],
    )
    ds = CocoDetection(tmp_path / "img", ann, 32)
    assert ds.category_ids == [3, 7] and ds.num_classes == 2
    assert ds.image_ids == [2, 5] and len(ds) == 2
    _, target = ds[0]
    assert target["image_id"] == 2
    assert target["labels"].tolist() == [1, 0]
    torch.testing.assert_close(target["boxes"], torch.tensor([[1.0, 1, 11, 11], [5, 5, 13, 9]]))
    _, empty = ds[1]
    assert empty["boxes"].shape == (0, 4) and empty["labels"].shape == (0,)


def test_hflip_mirrors_image_and_boxes(shapes_root: Path) -> None:
    ann = shapes_root / "annotations" / "instances_train.json"
    plain = CocoDetection(shapes_root / "train", ann, 48)
    flipping = CocoDetection(shapes_root / "train", ann, 48, hflip=True)
    flips = 0
    for seed in range(12):
        torch.manual_seed(seed)
        for i in range(len(plain)):
            x, t = plain[i]
            y, u = flipping[i]
            boxes = u["boxes"]
            assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
            assert boxes.min() >= 0 and boxes.max() <= 48
            if torch.equal(x, y):
                torch.testing.assert_close(boxes, t["boxes"])
                continue
            flips += 1
            torch.testing.assert_close(y, x.flip(-1))  # square images: no padding
            expected = torch.stack(
                [48 - t["boxes"][:, 2], t["boxes"][:, 1], 48 - t["boxes"][:, 0], t["boxes"][:, 3]],
                dim=1,
            )
            torch.testing.assert_close(boxes, expected)
    assert 0.3 < flips / (12 * len(plain)) < 0.7
    torch.manual_seed(0)
    first = [flipping[i][1]["boxes"] for i in range(4)]
    torch.manual_seed(0)
    again = [flipping[i][1]["boxes"] for i in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_hflip_of_a_padded_image_keeps_padding_right(tmp_path: Path) -> None:
    image = Image.new("RGB", (40, 20), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 10, 20))  # white band at the left edge
    (tmp_path / "img").mkdir()
    image.save(tmp_path / "img" / "a.png")
    ann = _write_coco(
        tmp_path / "ann.json",
        [{"id": 1, "file_name": "a.png", "width": 40, "height": 20}],
        [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 10, 20], "iscrowd": 0}],
        [1],
    )
    ds = CocoDetection(tmp_path / "img", ann, 32, hflip=True)
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        x, t = ds[0]
        assert (x[:, 16:, :] == PAD).all()  # 32 x 16 resized image, padding below
        box = t["boxes"][0].tolist()
        seen.add(tuple(box))
        raw = x * PIXEL_STD + PIXEL_MEAN
        x1, y1, x2, y2 = (round(v) for v in box)
        assert raw[:, y1:y2, x1 + 1 : x2 - 1].min() > 0.99  # the white band is inside the box
    assert seen == {(0.0, 0.0, 8.0, 16.0), (24.0, 0.0, 32.0, 16.0)}


def test_dataset_rejects_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="images_dir"):
        CocoDetection(tmp_path / "nope", tmp_path / "ann.json", 32)
    with pytest.raises(FileNotFoundError, match="annotation_file"):
        CocoDetection(tmp_path, tmp_path / "ann.json", 32)


def test_collate_and_missing_files(tmp_path: Path) -> None:
    batch = [
        (torch.zeros(3, 4, 4), {"boxes": torch.zeros(0, 4)}),
        (torch.ones(3, 4, 4), {"boxes": torch.ones(2, 4)}),
    ]
    images, targets = detection_collate(batch)
    assert images.shape == (2, 3, 4, 4) and [len(t["boxes"]) for t in targets] == [0, 2]

    (tmp_path / "train").mkdir()
    (tmp_path / "annotations").mkdir()
    (tmp_path / "annotations" / "instances_val.json").write_text("{}")
    assert missing_files(tmp_path) == [
        tmp_path / "annotations" / "instances_train.json",
        tmp_path / "val",
    ]
    assert missing_files(tmp_path, splits=["train"], annotations="annotations/{split}.json") == [
        tmp_path / "annotations" / "train.json"
    ]


# ----------------------------------------------------------------------------- datamodule


def test_datamodule_batches(tmp_path: Path) -> None:
    dm = CocoDataModule(str(tmp_path / "shapes"), image_size=32, batch_size=3, synthetic=SMALL)
    assert dm.hparams["batch_size"] == 3 and dm.hparams["synthetic"] == SMALL
    dm.prepare_data()
    dm.setup("fit")
    assert dm.num_classes == 3 and dm.category_ids == [1, 2, 3]
    assert dm.val_annotation_file == tmp_path / "shapes" / "annotations" / "instances_val.json"

    train = dm.train_dataloader()
    assert len(train) == 8 // 3  # drop_last
    assert train.persistent_workers is False
    images, targets = next(iter(train))
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.float32
    assert len(targets) == 3
    for t in targets:
        assert set(t) == {"boxes", "labels", "image_id", "scale", "orig_size"}
        assert t["boxes"].dtype == torch.float32 and t["boxes"].shape[1] == 4
        assert t["labels"].dtype == torch.int64 and len(t["labels"]) == len(t["boxes"]) >= 1
        assert t["scale"] == 0.5 and t["orig_size"] == (64, 64)

    val = dm.val_dataloader()
    batches = list(val)
    assert [len(b[1]) for b in batches] == [3, 1]  # no drop_last
    assert [t["image_id"] for b in batches for t in b[1]] == [1, 2, 3, 4]  # in order

    workers = CocoDataModule(str(tmp_path / "shapes"), num_workers=1, synthetic=SMALL)
    workers.setup("validate")
    assert workers.val_dataloader().persistent_workers is True
    assert workers.train_set is None


def test_datamodule_on_existing_files(shapes_root: Path) -> None:
    dm = CocoDataModule(str(shapes_root), hflip=False)
    dm.prepare_data()
    dm.setup()
    assert len(dm.train_dataloader()) == 4


def test_datamodule_missing_data(tmp_path: Path) -> None:
    dm = CocoDataModule(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"data\.root.*nowhere.*instances_train\.json"):
        dm.prepare_data()
    with pytest.raises(FileNotFoundError, match=r"data\.root"):
        dm.setup("fit")
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"batch_size": 0}, "data.batch_size"),
        ({"image_size": 8}, "data.image_size"),
        ({"num_workers": -1}, "data.num_workers"),
        ({"annotations": "ann.json"}, "data.annotations"),
        ({"synthetic": {"num_imgs": 3}}, "data.synthetic"),
        ({"synthetic": {"max_size": 80}}, r"data\.synthetic.*max_size"),
        ({"synthetic": {}, "val_split": "test"}, "data.val_split"),
        ({"synthetic": [1]}, "data.synthetic"),
    ],
)
def test_datamodule_rejects_bad_arguments(tmp_path: Path, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        CocoDataModule(str(tmp_path), **kwargs)
