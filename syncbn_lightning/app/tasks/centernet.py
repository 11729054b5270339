"""A compact CenterNet ("Objects as Points", Zhou et al. 2019) with BatchNorm everywhere.

The detector predicts, at stride 4, a per-class centre heatmap, the box size and the sub-pixel
centre offset. Backbone, neck and all three heads use ``Conv-BN-ReLU`` blocks, so with 1-4 images
per device every one of its BN layers sees a tiny batch: the case SyncBN is for.

Batches are ``(images [B, 3, S, S], targets)`` as produced by
:class:`syncbn_lightning.app.tasks.datamodule.CocoDataModule`; box coordinates are input pixels, and
validation maps predictions back to original image pixels (``/ scale``) for COCO mAP.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .base import ScaledLRModule
from .coco_eval import coco_map, load_coco
from .norm_choice import check_norm_init
from .norms import make_norm
from .pretrained import load_backbone

__all__ = ["CenterNet", "CenterNetHead", "ConvBNReLU", "TinyBackbone", "decode", "make_targets"]

STRIDE = 4


class ConvBNReLU(nn.Sequential):
    """``Conv2d(bias=False) -> BatchNorm2d -> ReLU`` (another normalization with ``norm``, one
    of :data:`~.norms.NORMS`)."""

    def __init__(self, cin: int, cout: int, k: int = 3, stride: int = 1, norm: str = "bn") -> None:
        super().__init__(
            nn.Conv2d(cin, cout, k, stride, k // 2, bias=False),
            make_norm(norm, cout),
            nn.ReLU(inplace=True),
        )


class _Residual(nn.Module):
    def __init__(self, c: int, norm: str = "bn") -> None:
        super().__init__()
        self.body = nn.Sequential(ConvBNReLU(c, c, norm=norm), nn.Conv2d(c, c, 3, 1, 1, bias=False))
        self.bn = make_norm(norm, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn(self.body(x)))


class TinyBackbone(nn.Module):
    """Four stride-2 stages (strides 2, 4, 8, 16) and a top-down neck back to stride 4.

    Returns one ``2 x width``-channel feature map at stride 4. ``norm``: every normalization
    layer's kind (:data:`~.norms.NORMS`).
    """

    def __init__(self, width: int = 16, norm: str = "bn") -> None:
        super().__init__()
        w, n = width, norm
        self.stem = ConvBNReLU(3, w, stride=2, norm=n)
        self.s4 = nn.Sequential(ConvBNReLU(w, 2 * w, stride=2, norm=n), _Residual(2 * w, n))
        self.s8 = nn.Sequential(ConvBNReLU(2 * w, 4 * w, stride=2, norm=n), _Residual(4 * w, n))
        self.s16 = nn.Sequential(ConvBNReLU(4 * w, 8 * w, stride=2, norm=n), _Residual(8 * w, n))
        self.lat8 = ConvBNReLU(4 * w, 4 * w, k=1, norm=n)
        self.top8 = ConvBNReLU(8 * w, 4 * w, k=1, norm=n)
        self.lat4 = ConvBNReLU(2 * w, 2 * w, k=1, norm=n)
        self.top4 = ConvBNReLU(4 * w, 2 * w, k=1, norm=n)
        self.out = ConvBNReLU(2 * w, 2 * w, norm=n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c4 = self.s4(self.stem(x))
        c8 = self.s8(c4)
        c16 = self.s16(c8)
        p8 = self.lat8(c8) + F.interpolate(self.top8(c16), size=c8.shape[-2:], mode="nearest")
        p4 = self.lat4(c4) + F.interpolate(self.top4(p8), size=c4.shape[-2:], mode="nearest")
        return self.out(p4)


class CenterNetHead(nn.Module):
    """Heatmap (logits, one channel per class), size (w, h in feature cells) and offset heads."""

    def __init__(
        self, channels: int, num_classes: int, prior: float = 0.1, norm: str = "bn"
    ) -> None:
        super().__init__()
        c = channels
        self.heatmap = nn.Sequential(ConvBNReLU(c, c, norm=norm), nn.Conv2d(c, num_classes, 1))
        self.size = nn.Sequential(ConvBNReLU(c, c, norm=norm), nn.Conv2d(c, 2, 1))
        self.offset = nn.Sequential(ConvBNReLU(c, c, norm=norm), nn.Conv2d(c, 2, 1))
        # Start every location at a low object probability, as CenterNet does, so that the focal
        # loss of the many background cells does not swamp the first steps.
        nn.init.constant_(self.heatmap[-1].bias, -math.log((1 - prior) / prior))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.heatmap(x), self.size(x), self.offset(x)


def make_targets(
    targets: list[dict[str, Any]], num_classes: int, out_hw: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """CenterNet training targets for a batch.

    Each box puts an elliptical Gaussian (sigma = box side / 6 x 0.54, as TTFNet) on its class
    channel, peaking at 1 on the integer centre cell; overlapping Gaussians keep the maximum. The
    size target is (w, h) in feature cells, the offset target the centre's fractional part.

    Returns:
        ``heatmap [B, K, H, W]``, ``size [B, 2, H, W]``, ``offset [B, 2, H, W]``, ``mask
        [B, 1, H, W]`` (1 at object centres; a later box at the same cell wins).
    """
    h, w = out_hw
    b = len(targets)
    heat = torch.zeros(b, num_classes, h, w)
    size = torch.zeros(b, 2, h, w)
    offset = torch.zeros(b, 2, h, w)
    mask = torch.zeros(b, 1, h, w)
    ys = torch.arange(h, dtype=torch.float32).view(h, 1)
    xs = torch.arange(w, dtype=torch.float32).view(1, w)
    for i, t in enumerate(targets):
        for box, label in zip(t["boxes"].float() / STRIDE, t["labels"].tolist(), strict=True):
            bw, bh = (box[2] - box[0]).item(), (box[3] - box[1]).item()
            cx, cy = ((box[0] + box[2]) / 2).item(), ((box[1] + box[3]) / 2).item()
            ix, iy = min(max(int(cx), 0), w - 1), min(max(int(cy), 0), h - 1)
            sx, sy = max(bw * 0.54 / 6, 0.3), max(bh * 0.54 / 6, 0.3)
            g = torch.exp(-((xs - ix) ** 2) / (2 * sx**2) - ((ys - iy) ** 2) / (2 * sy**2))
            heat[i, label] = torch.maximum(heat[i, label], g)
            size[i, :, iy, ix] = torch.tensor([bw, bh])
            offset[i, :, iy, ix] = torch.tensor([cx - ix, cy - iy])
            mask[i, 0, iy, ix] = 1.0
    return {"heatmap": heat, "size": size, "offset": offset, "mask": mask}


def focal_loss(
    logits: torch.Tensor, target: torch.Tensor, normalizer: torch.Tensor | None = None
) -> torch.Tensor:
    """CenterNet's penalty-reduced focal loss (alpha 2, beta 4), summed and divided by
    ``normalizer`` (default: the number of object centres in ``target``), at least 1."""
    p = logits.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = target.eq(1).float()
    pos_loss = -(torch.log(p) * (1 - p) ** 2 * pos).sum()
    neg_loss = -(torch.log(1 - p) * p**2 * (1 - target) ** 4 * (1 - pos)).sum()
    count = pos.sum() if normalizer is None else normalizer
    return (pos_loss + neg_loss) / count.clamp_min(1.0)


def _mean_over_ranks(counts: torch.Tensor) -> torch.Tensor:
    """``counts`` averaged over the ranks of the default group (one all_reduce); as is outside
    torch.distributed.

    Dividing each rank's summed loss by the *average* object count makes DDP's gradient average
    equal the gradient of (sum over all ranks' images) / (all objects): exactly the loss one
    process computes on the concatenated batch. Dividing by the rank's own count instead weights
    the images of a rank with few objects up, and that differs more the fewer images a rank has.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return counts
    total = counts.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def decode(
    heat_logits: torch.Tensor, size: torch.Tensor, offset: torch.Tensor, top_k: int = 100
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Boxes from the head outputs: 3x3 max-pool peaks, the ``top_k`` best over all classes.

    Returns:
        Per image ``(boxes [k, 4] x1y1x2y2 in input pixels, scores [k], labels [k])``.
    """
    heat = heat_logits.sigmoid()
    peaks = heat * (F.max_pool2d(heat, 3, 1, 1) == heat)
    b, k, h, w = heat.shape
    scores, idx = peaks.flatten(1).topk(min(top_k, k * h * w))
    labels = idx // (h * w)
    cell = idx % (h * w)
    cy, cx = (cell // w).float(), (cell % w).float()
    out = []
    for i in range(b):
        sz = size[i].flatten(1)[:, cell[i]].clamp_min(0)
        off = offset[i].flatten(1)[:, cell[i]]
        x, y = cx[i] + off[0], cy[i] + off[1]
        boxes = torch.stack([x - sz[0] / 2, y - sz[1] / 2, x + sz[0] / 2, y + sz[1] / 2], 1)
        keep = scores[i] > 0.001
        out.append((boxes[keep] * STRIDE, scores[i][keep], labels[i][keep]))
    return out


class CenterNet(ScaledLRModule):
    """A small one-stage anchor-free detector (CenterNet) as a LightningModule.

    Args:
        num_classes: object classes; must match the datamodule's (checked in ``setup``).
        width: channels of the first stage (stages double it); 16 trains in minutes on a CPU.
        size_weight: weight of the L1 size loss (CenterNet: 0.1).
        offset_weight: weight of the L1 offset loss (CenterNet: 1).
        top_k: detections kept per image at validation (COCO counts 100).
        norm: the normalization of every layer (:data:`~.norms.NORMS`): ``bn`` (BatchNorm,
            which ``SyncBNCallback`` syncs), ``gn`` (GroupNorm) or ``frozen_bn`` (BatchNorm with
            fixed statistics and affine; needs ``init_backbone``: the heads' frozen layers are
            the identity, as detectron2's heads have no normalization).
        init_backbone: a checkpoint of ``BackboneClassifier`` (``recipe=backbone_pretrain``)
            whose backbone, normalization statistics included, initializes this one when
            fitting starts (a resumed run then loads its own checkpoint over it).
        optim: see :class:`~syncbn_lightning.app.tasks.base.ScaledLRModule`.

    Note:
        Logs ``train/loss`` (and its three parts), ``val/loss`` and COCO ``val/mAP``,
        ``val/mAP50`` with ``batch_size=`` given explicitly (a detection batch's first tensor is
        not its batch size). Under DDP each rank decodes its share of the validation set; one
        ``all_gather_object`` brings the detections to rank 0, which evaluates and broadcasts the
        two numbers, so every rank logs the same mAP. Images the DistributedSampler repeated to
        even out the shards are counted once. In training the losses are divided by the object
        count averaged over ranks (one scalar all_reduce per step), as detectron2 does, so that a
        DDP step's gradient is one process's gradient on the concatenated batch (with SyncBN
        over the world, exactly; tested).
    """

    SCORES = ("val/mAP", "val/mAP50")

    def __init__(
        self,
        num_classes: int = 3,
        width: int = 16,
        size_weight: float = 0.1,
        offset_weight: float = 1.0,
        top_k: int = 100,
        optim: dict[str, Any] | None = None,
        monitor: str = "val/mAP",
        norm: str = "bn",
        init_backbone: str | None = None,
    ) -> None:
        super().__init__(optim, monitor)
        if num_classes < 1 or width < 1 or top_k < 1:
            raise ValueError(
                f"model.num_classes, model.width and model.top_k must be >= 1, got "
                f"{num_classes}, {width}, {top_k}"
            )
        check_norm_init(norm, init_backbone)
        self.save_hyperparameters()
        self.backbone = TinyBackbone(width, norm)
        self.head = CenterNetHead(2 * width, num_classes, norm=norm)
        self._val_dets: list[dict[str, Any]] = []
        self._val_ids: list[int] = []
        self._coco: Any = None

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.hparams.get("init_backbone"):
            load_backbone(self.backbone, self.hparams.init_backbone)
        dm = getattr(self.trainer, "datamodule", None)
        classes = getattr(dm, "num_classes", None)
        if classes is not None and classes != self.hparams.num_classes:
            raise ValueError(
                f"model.num_classes={self.hparams.num_classes} but the dataset has {classes} "
                f"categories: set model.num_classes={classes}"
            )

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.head(self.backbone(images))

    def _losses(self, batch: Any) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
        images, targets = batch
        out = self(images)
        t = make_targets(targets, self.hparams.num_classes, tuple(out[0].shape[-2:]))
        t = {k: v.to(images.device) for k, v in t.items()}
        counts = torch.stack([t["heatmap"].eq(1).sum(), t["mask"].sum()]).float()
        if self.training:  # every rank trains the same number of steps (drop_last, DDP sampler)
            counts = _mean_over_ranks(counts)
        centres, n = counts[0], counts[1].clamp_min(1.0)
        losses = {
            "heatmap": focal_loss(out[0], t["heatmap"], centres),
            "size": (F.l1_loss(out[1], t["size"], reduction="none") * t["mask"]).sum() / n,
            "offset": (F.l1_loss(out[2], t["offset"], reduction="none") * t["mask"]).sum() / n,
        }
        losses["loss"] = (
            losses["heatmap"]
            + self.hparams.size_weight * losses["size"]
            + self.hparams.offset_weight * losses["offset"]
        )
        return losses, out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        losses, _ = self._losses(batch)
        size = len(batch[1])
        self.log("train/loss", losses["loss"], prog_bar=True, batch_size=size)
        for k in ("heatmap", "size", "offset"):
            self.log(f"train/loss_{k}", losses[k], batch_size=size)
        return losses["loss"]

    def on_validation_epoch_start(self) -> None:
        self._val_dets, self._val_ids = [], []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        losses, out = self._losses(batch)
        self.log("val/loss", losses["loss"], batch_size=len(batch[1]), sync_dist=True)
        category_ids = self.trainer.datamodule.category_ids
        for (boxes, scores, labels), t in zip(
            decode(*out, top_k=self.hparams.top_k), batch[1], strict=True
        ):
            h, w = t["orig_size"]
            boxes = boxes / t["scale"]
            boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)
            boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h)
            self._val_ids.append(int(t["image_id"]))
            for box, score, label in zip(
                boxes.tolist(), scores.tolist(), labels.tolist(), strict=True
            ):
                bw, bh = box[2] - box[0], box[3] - box[1]
                if bw > 0 and bh > 0:
                    self._val_dets.append(
                        {
                            "image_id": int(t["image_id"]),
                            "category_id": int(category_ids[label]),
                            "bbox": [box[0], box[1], bw, bh],
                            "score": score,
                        }
                    )

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        shards = [(self._val_ids, self._val_dets)]
        if dist.is_available() and dist.is_initialized() and self.trainer.world_size > 1:
            shards = [None] * dist.get_world_size()
            dist.all_gather_object(shards, (self._val_ids, self._val_dets))
        result = None
        if self.trainer.is_global_zero:
            result = self._evaluate(shards)
        result = self.trainer.strategy.broadcast(result, src=0)
        # Every rank holds the same numbers; sync_dist averages identical values (and keeps
        # Lightning from warning about epoch-level metrics that are not synchronized).
        batch = max(len(self._val_ids), 1)
        self.log("val/mAP", result["mAP"], batch_size=batch, sync_dist=True)
        self.log("val/mAP50", result["mAP50"], batch_size=batch, sync_dist=True)

    def _evaluate(self, shards: list[Any]) -> dict[str, float]:
        seen: set[int] = set()
        dets: list[dict[str, Any]] = []
        for ids, rank_dets in shards:
            # An image padded into two shards is scored once: the first rank that saw it owns it.
            new = set(ids) - seen
            dets += [d for d in rank_dets if d["image_id"] in new]
            seen |= new
        if self._coco is None:
            self._coco = load_coco(self.trainer.datamodule.val_annotation_file)
        return coco_map(self._coco, dets, image_ids=seen)
