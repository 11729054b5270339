"""Training tasks: COCO mAP, CenterNet (targets, focal loss, decoding, validation, training), the
shape classifier and the linearly scaled learning rate.

Everything runs on a real synthetic shapes dataset written to a temporary directory, with real
pycocotools and real Lightning Trainers on the CPU. Oracles: perfect detections score exactly 1
and none 0; a partial recall has the AP the COCO definition gives (101 recall thresholds, all
detections correct so precision is 1 up to the recall reached); decoded perfect head outputs give
back the ground-truth boxes.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from _lightning import quiet_trainer
from lightning.pytorch.callbacks import Callback

from syncbn_lightning.app.tasks.base import ScaledLRModule, global_batch_size
from syncbn_lightning.app.tasks.centernet import STRIDE, CenterNet, decode, focal_loss, make_targets
from syncbn_lightning.app.tasks.classifier import ShapeClassifier, largest_object_labels
from syncbn_lightning.app.tasks.coco import CocoDetection, detection_collate
from syncbn_lightning.app.tasks.coco_eval import coco_map, load_coco
from syncbn_lightning.app.tasks.datamodule import CocoDataModule
from syncbn_lightning.app.tasks.shapes import generate_shapes

SHAPES = {"num_train": 8, "num_val": 8, "progress": False}
NUM_CLASSES = 3
EPS = 1e-4  # clamp of a target heatmap before it becomes logits (CenterNet's own clamp)


def _trainer(**kw: Any) -> pl.Trainer:
    return quiet_trainer(**kw)


def _gaussian_logits(heatmap: torch.Tensor) -> torch.Tensor:
    """Logits whose sigmoid is the target heatmap (clamped away from 0 and 1)."""
    return torch.logit(heatmap.clamp(EPS, 1 - EPS))


def _centre_logits(heatmap: torch.Tensor) -> torch.Tensor:
    """The focal loss's ideal: probability ~1 at object centres (target 1), ~0 elsewhere."""
    return _gaussian_logits(heatmap.eq(1).float())


def _off_centre_noise(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The size and offset targets, with arbitrary values away from object centres (where a
    prediction is free: neither the losses nor decoding may read it)."""
    g = torch.Generator().manual_seed(0)
    free = 1 - t["mask"]
    size = t["size"] + free * 10 * torch.rand(t["size"].shape, generator=g)
    offset = t["offset"] + free * torch.rand(t["offset"].shape, generator=g)
    return size, offset


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("tasks") / "shapes", **SHAPES)


@pytest.fixture(scope="module")
def val_json(shapes_root: Path) -> dict[str, Any]:
    return json.loads((shapes_root / "annotations" / "instances_val.json").read_text())


def _val_file(root: Path) -> Path:
    return root / "annotations" / "instances_val.json"


def _perfect(annotations: list[dict[str, Any]], image_ids=None) -> list[dict[str, Any]]:
    """The ground-truth boxes as COCO results with score 1."""
    return [
        {
            "image_id": a["image_id"],
            "category_id": a["category_id"],
            "bbox": a["bbox"],
            "score": 1.0,
        }
        for a in annotations
        if image_ids is None or a["image_id"] in image_ids
    ]


# --------------------------------------------------------------------------- COCO mAP


def test_coco_map_perfect_and_empty(shapes_root: Path, val_json: dict[str, Any]) -> None:
    gt = load_coco(_val_file(shapes_root))
    dets = _perfect(val_json["annotations"])
    before = copy.deepcopy(dets)
    assert coco_map(gt, dets) == {"mAP": 1.0, "mAP50": 1.0}
    assert dets == before, "coco_map must not mutate the caller's detections"
    # The annotation file's path works as well as a COCO index.
    assert coco_map(_val_file(shapes_root), dets) == {"mAP": 1.0, "mAP50": 1.0}
    assert coco_map(gt, []) == {"mAP": 0.0, "mAP50": 0.0}


def test_coco_map_wrong_categories_score_zero(shapes_root: Path, val_json) -> None:
    gt = load_coco(_val_file(shapes_root))
    dets = _perfect(val_json["annotations"])
    for d in dets:  # right boxes, every one with the next category
        d["category_id"] = d["category_id"] % NUM_CLASSES + 1
    assert coco_map(gt, dets) == {"mAP": 0.0, "mAP50": 0.0}


def test_coco_map_partial_recall_matches_coco_definition(shapes_root: Path, val_json) -> None:
    gt = load_coco(_val_file(shapes_root))
    ids = sorted(im["id"] for im in val_json["images"])
    half = set(ids[: len(ids) // 2])
    result = coco_map(gt, _perfect(val_json["annotations"], half))
    # Every detection is right (precision 1), so a category's AP is the share of COCO's 101
    # recall thresholds that its recall (found / all of its boxes) reaches; mAP averages the
    # categories that have ground truth.
    thresholds = np.linspace(0.0, 1.0, 101)
    aps = []
    for cat in sorted({a["category_id"] for a in val_json["annotations"]}):
        boxes = [a for a in val_json["annotations"] if a["category_id"] == cat]
        recall = sum(a["image_id"] in half for a in boxes) / len(boxes)
        aps.append(np.count_nonzero(thresholds <= recall) / len(thresholds))
    expected = float(np.mean(aps))
    assert 0.0 < expected < 1.0
    assert result["mAP"] == pytest.approx(expected, abs=1e-9)
    assert result["mAP50"] == pytest.approx(expected, abs=1e-9)


def test_coco_map_image_ids_restricts_evaluation(shapes_root: Path, val_json) -> None:
    gt = load_coco(_val_file(shapes_root))
    ids = sorted(im["id"] for im in val_json["images"])
    subset = set(ids[: len(ids) // 2])
    dets = _perfect(val_json["annotations"], subset)
    # Detections of images outside the subset (here all wrong) must not count either.
    wrong = _perfect(val_json["annotations"], set(ids) - subset)
    for d in wrong:
        d["bbox"] = [0.0, 0.0, 1.0, 1.0]
    assert coco_map(gt, dets + wrong, image_ids=iter(subset)) == {"mAP": 1.0, "mAP50": 1.0}
    assert coco_map(gt, dets + wrong)["mAP"] < 1.0
    assert coco_map(gt, dets, image_ids=[]) == {"mAP": 0.0, "mAP50": 0.0}


def test_load_coco_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        load_coco(tmp_path / "missing.json")


# --------------------------------------------------------------------------- CenterNet pieces


def _val_targets(root: Path, image_size: int) -> list[dict[str, Any]]:
    """The targets of one batch of the whole validation split, as the datamodule collates them."""
    ds = CocoDetection(root / "val", _val_file(root), image_size)
    return detection_collate([ds[i] for i in range(len(ds))])[1]


@pytest.mark.parametrize("image_size", [64, 96])
def test_decode_inverts_make_targets(shapes_root: Path, image_size: int) -> None:
    targets = _val_targets(shapes_root, image_size)
    hw = (image_size // STRIDE, image_size // STRIDE)
    t = make_targets(targets, NUM_CLASSES, hw)
    assert t["heatmap"].shape == (len(targets), NUM_CLASSES, *hw)
    assert int(t["mask"].sum()) == sum(len(x["boxes"]) for x in targets)  # no centre collisions
    decoded = decode(_gaussian_logits(t["heatmap"]), *_off_centre_noise(t))
    for (boxes, scores, labels), target in zip(decoded, targets, strict=True):
        assert len(boxes) == len(target["boxes"]) > 0
        assert scores.max().item() == pytest.approx(1.0, abs=2 * EPS)
        for gt_box, gt_label in zip(target["boxes"], target["labels"], strict=True):
            err = (boxes - gt_box).abs().max(1).values
            best = int(err.argmin())
            assert err[best].item() < 1e-4, (gt_box, boxes)
            assert labels[best].item() == gt_label.item()


class _PerfectCenterNet(CenterNet):
    """A CenterNet whose head outputs are the training targets of the batch it is given.

    ``forward`` only sees the images, so the batch's targets are taken in the documented
    ``on_validation_batch_start`` hook, which Lightning calls with the batch just before
    ``validation_step``. Everything after the head outputs (``_losses``, ``decode``, the mapping
    back to original pixels, the gathering and COCO evaluation) is CenterNet's own code.
    """

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0):
        self._targets = batch[1]

    def forward(self, images: torch.Tensor):
        hw = (images.shape[-2] // STRIDE, images.shape[-1] // STRIDE)
        t = make_targets(self._targets, self.hparams.num_classes, hw)
        return _centre_logits(t["heatmap"]), *_off_centre_noise(t)


def test_centernet_validation_of_perfect_outputs_scores_map_one(shapes_root: Path) -> None:
    # 96 px inputs for 64 px images: scale 1.5, so boxes must be divided by it to score.
    dm = CocoDataModule(str(shapes_root), image_size=96, batch_size=3)
    (metrics,) = _trainer().validate(_PerfectCenterNet(width=4), datamodule=dm, verbose=False)
    assert metrics["val/mAP"] == pytest.approx(1.0, abs=1e-9)
    assert metrics["val/mAP50"] == pytest.approx(1.0, abs=1e-9)
    # Size and offset exact at the centres (the only cells their losses read), the heatmap only
    # off by the clamp.
    assert metrics["val/loss"] < 1e-3


def test_focal_loss() -> None:
    targets = [
        {"boxes": torch.tensor([[4.0, 8.0, 20.0, 30.0], [30.0, 2.0, 40.0, 12.0]]),
         "labels": torch.tensor([0, 2])},
        {"boxes": torch.tensor([[10.0, 10.0, 50.0, 44.0]]), "labels": torch.tensor([1])},
    ]  # fmt: skip
    heat = make_targets(targets, NUM_CLASSES, (16, 16))["heatmap"]
    perfect = focal_loss(_centre_logits(heat), heat)
    gaussian = focal_loss(_gaussian_logits(heat), heat)  # right peaks, too much mass around them
    blurred = focal_loss(_gaussian_logits(0.8 * heat + 0.05), heat)
    blank = focal_loss(torch.full_like(heat, -2.0), heat)
    wrong = focal_loss(_centre_logits(heat.flip(-1)), heat)  # confident, in the wrong places
    assert perfect.item() < 1e-6
    assert perfect < gaussian < blurred < blank < wrong
    for extreme in (1e4, -1e4, float("inf"), float("-inf")):
        assert torch.isfinite(focal_loss(torch.full_like(heat, extreme), heat))
    # Hand-computed: one centre at p = 1/2, one background cell (target 0) at p = 1/2 and one
    # cell of target 1/2 at p = 1/2; one centre to divide by.
    logit0 = torch.zeros(1, 1, 1, 3)
    target = torch.tensor([1.0, 0.0, 0.5]).view(1, 1, 1, 3)
    ln2 = math.log(2.0)
    expected = ln2 * 0.25 + ln2 * 0.25 + ln2 * 0.25 * 0.5**4
    assert focal_loss(logit0, target).item() == pytest.approx(expected, rel=1e-5)


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.mark.slow
def test_centernet_overfits_one_batch(shapes_root: Path) -> None:
    pl.seed_everything(0, verbose=False)
    dm = CocoDataModule(str(shapes_root), batch_size=2, hflip=False)
    model = CenterNet(width=8, optim={"base_lr": 1e-2, "base_batch_size": 2, "warmup_steps": 3})
    record = _Losses()
    trainer = _trainer(
        max_steps=30,
        overfit_batches=1,  # the same first batch every step (Lightning turns shuffling off)
        num_sanity_val_steps=0,
        check_val_every_n_epoch=1000,
        callbacks=[record],
    )
    trainer.fit(model, datamodule=dm)
    assert len(record.losses) == 30
    assert all(math.isfinite(x) for x in record.losses)
    assert sum(record.losses[-3:]) / 3 < 0.25 * record.losses[0], record.losses


def test_centernet_num_classes_mismatch(shapes_root: Path) -> None:
    dm = CocoDataModule(str(shapes_root), batch_size=2)
    with pytest.raises(ValueError, match=r"model\.num_classes=2 .*3 categories"):
        _trainer().validate(CenterNet(num_classes=2, width=4), datamodule=dm, verbose=False)
    with pytest.raises(ValueError, match=r"model\.num_classes"):
        CenterNet(num_classes=0)


# --------------------------------------------------------------------------- classifier


def test_largest_object_labels() -> None:
    targets = [
        {
            "image_id": 1,
            # areas 100, 400 (the largest, neither first nor last), 300
            "boxes": torch.tensor([[0.0, 0.0, 10.0, 10.0], [5.0, 5.0, 25.0, 25.0], [0, 0, 30, 10]]),
            "labels": torch.tensor([0, 2, 1]),
        },
        {"image_id": 2, "boxes": torch.tensor([[1.0, 2.0, 3.0, 4.0]]), "labels": torch.tensor([1])},
    ]
    assert largest_object_labels(targets).tolist() == [2, 1]
    empty = {"image_id": 7, "boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}
    with pytest.raises(ValueError, match="image 7 has no boxes"):
        largest_object_labels([targets[0], empty])


def test_largest_object_labels_on_dataset(shapes_root: Path, val_json) -> None:
    targets = _val_targets(shapes_root, 64)
    labels = largest_object_labels(targets).tolist()
    cats = sorted(c["id"] for c in val_json["categories"])
    for target, label in zip(targets, labels, strict=True):
        anns = [a for a in val_json["annotations"] if a["image_id"] == target["image_id"]]
        largest = max(anns, key=lambda a: a["bbox"][2] * a["bbox"][3])
        assert cats[label] == largest["category_id"]


def test_shape_classifier_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"model\.num_classes"):
        ShapeClassifier(num_classes=1)


# --------------------------------------------------------------------------- scaled LR


class _LRs(Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])


@pytest.mark.slow
def test_scaled_lr_peak_warmup_cosine_and_no_decay_groups(shapes_root: Path) -> None:
    base_lr, base_batch, warmup, steps = 0.01, 16, 3, 6
    dm = CocoDataModule(str(shapes_root), batch_size=2)
    model = ShapeClassifier(
        width=4,
        optim={"base_lr": base_lr, "base_batch_size": base_batch, "warmup_steps": warmup,
               "weight_decay": 0.05},
    )  # fmt: skip
    record = _LRs()
    trainer = _trainer(
        max_steps=steps, accumulate_grad_batches=2, limit_val_batches=0, callbacks=[record]
    )
    trainer.fit(model, datamodule=dm)
    assert global_batch_size(trainer, 2) == 4
    peak = base_lr * 2 * 1 * 2 / base_batch  # per device x world size x accumulation
    # Linear warmup from peak / (warmup + 1), the peak at step `warmup`, then the cosine to 0.
    factors = [1 / 4, 2 / 4, 3 / 4, 1.0, 0.5 * (1 + math.cos(math.pi / 3)), 0.25]
    assert record.lrs == pytest.approx([peak * f for f in factors], rel=1e-9)
    assert max(record.lrs) == pytest.approx(peak, rel=1e-9)

    (optimizer,) = trainer.optimizers
    decay, no_decay = ({id(p) for p in g["params"]} for g in optimizer.param_groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    bn = {
        id(p)
        for m in model.modules()
        if isinstance(m, torch.nn.BatchNorm2d)
        for p in m.parameters()
    }
    biases = {id(p) for name, p in model.named_parameters() if name.endswith("bias")}
    assert bn and id(model.fc.bias) in biases
    assert no_decay == bn | biases
    assert decay == {id(p) for p in model.parameters()} - no_decay
    assert id(model.fc.weight) in decay


@pytest.mark.parametrize(
    ("optim", "match"),
    [
        ({"lr": 0.1}, r"model\.optim has unknown keys \['lr'\]"),
        ({"name": "adam"}, r"model\.optim\.name"),
        ({"base_lr": 0.0}, r"model\.optim needs base_lr > 0"),
        ({"warmup_steps": -1}, r"model\.optim needs"),
    ],
)
def test_scaled_lr_rejects_bad_optim(optim: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScaledLRModule(optim)
    with pytest.raises(ValueError, match=match):
        CenterNet(optim=optim)


# The DDP identity below is checked in float64 over 20 seeds. In float32 it has no honest
# tolerance: the network has kinks (ReLU, the L1 losses, the focal loss's clamp), and a rounding
# difference that moves one activation across one moves every gradient upstream of it. Measured
# (2026-11-27, 20 seeds): the 2-rank float32 gradients of seed 10 sit 5.3e-4 (of each tensor's
# largest element) from the exact float64 ones while one float32 process sits 2.4e-6 from them;
# the other seeds differ by 1.3e-6 elementwise, past the atol 1e-6 the test had. In float64 no
# kink is crossed and the two summation orders (two halves all-reduced, one whole) agree to at
# most 149 eps64 of the tensor's largest element (3.3e-14; 20 seeds x 56 tensors): the bound is
# 2**10 eps64 of that element, the reductions' length times depth with room.
DDP_SEEDS = range(20)
DDP_BOUND = 2**10 * torch.finfo(torch.float64).eps


def _detector_batch(seed: int = 3) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """4 images whose halves hold 1 and 4 objects: per-rank and global counts differ."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(4, 3, 64, 64, generator=g)
    boxes = [
        [[4.0, 4.0, 20.0, 20.0]],
        [[30.0, 30.0, 50.0, 60.0]],
        [[2.0, 2.0, 12.0, 12.0], [40.0, 5.0, 60.0, 25.0]],
        [[10.0, 30.0, 30.0, 50.0], [35.0, 35.0, 55.0, 62.0]],
    ]
    targets = [{"boxes": torch.tensor(b), "labels": torch.arange(len(b)) % 3} for b in boxes]
    return images, targets


def _detector_grads(
    images: torch.Tensor, targets: list[dict[str, Any]], seed: int = 0
) -> list[torch.Tensor]:
    from syncbn_lightning import convert_sync_batchnorm

    torch.manual_seed(seed)
    model = convert_sync_batchnorm(CenterNet(num_classes=3, width=4)).train().double()
    losses, _ = model._losses((images.double(), targets))
    losses["loss"].backward()
    return [p.grad.clone() for p in model.parameters()]


def _ddp_detector_worker(rank: int, world: int) -> list[list[np.ndarray]]:
    import torch.distributed as dist

    runs = []
    for seed in DDP_SEEDS:
        images, targets = _detector_batch(seed)
        n = len(images) // world
        part = slice(rank * n, (rank + 1) * n)
        grads = _detector_grads(images[part], targets[part], seed)
        for g in grads:  # what DDP does with gradients
            dist.all_reduce(g)
            g /= world
        runs.append([g.numpy() for g in grads])  # by value: shared memory dies with the worker
    return runs


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_ddp_loss_gradient_equals_one_process_on_the_whole_batch() -> None:
    """With SyncBN and the object count averaged over ranks, 2 ranks x 2 images train exactly
    like 1 process x 4 images (the premise of the small-batch experiment's reference run), for
    20 seeds of the images and the weights, in float64 (see ``DDP_BOUND``)."""
    from _dist import run_distributed

    per_rank = run_distributed(_ddp_detector_worker, 2, timeout=280.0)
    for i, seed in enumerate(DDP_SEEDS):
        single = _detector_grads(*_detector_batch(seed), seed)
        for rank_runs in per_rank:
            for k, (got, want) in enumerate(zip(rank_runs[i], single, strict=True)):
                bound = DDP_BOUND * float(want.abs().max())
                torch.testing.assert_close(
                    torch.from_numpy(got),
                    want,
                    rtol=0,
                    atol=bound,
                    msg=lambda m, seed=seed, k=k: f"seed {seed}, parameter {k}: {m}",
                )
