"""A small BatchNorm classifier on detection data: the class of each image's largest object.

The service's one-minute sanity run (``recipe=classifier_sanity``: one shape per image, 16 images
per process): same datamodule, same SyncBN callback, a metric (``val/acc``) that reaches about 0.9
in 14 epochs. On the default detection data (1-3 objects, 2 images per process) it stays near
chance: telling the largest of several objects apart needs more data and larger batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import ScaledLRModule
from .centernet import ConvBNReLU, TinyBackbone

__all__ = ["BackboneClassifier", "ShapeClassifier", "largest_object_labels"]


def largest_object_labels(targets: list[dict[str, Any]]) -> torch.Tensor:
    """Per image, the label of its largest box by area; images without boxes are an error."""
    labels = []
    for t in targets:
        boxes = t["boxes"]
        if len(boxes) == 0:
            raise ValueError(f"image {t['image_id']} has no boxes: the classifier needs one")
        area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        labels.append(t["labels"][area.argmax()])
    return torch.stack(labels)


class ShapeClassifier(ScaledLRModule):
    """Three stages of two ``Conv-BN-ReLU`` (the first of each with stride 2), global max pooling
    and a linear layer.

    Max pooling, not averaging: a shape's evidence (its corners and edges) sits in a few positions
    of a background-dominated map; averaging dilutes it with the background, and the former
    three-convolution, average-pooled version stayed near chance on the shapes data.

    Args:
        num_classes: classes (the datamodule's categories).
        width: channels of the first stage.
        norm: every normalization layer's kind (:data:`~.norms.NORMS`), ``bn`` by default.
        optim: see :class:`~syncbn_lightning.app.tasks.base.ScaledLRModule`.

    Note:
        Logs ``train/loss``, ``val/loss`` and ``val/acc`` (averaged over all ranks' samples).
    """

    SCORES = ("val/acc",)

    def __init__(
        self,
        num_classes: int = 3,
        width: int = 16,
        optim: dict[str, Any] | None = None,
        monitor: str = "val/acc",
        norm: str = "bn",
    ) -> None:
        super().__init__(optim, monitor)
        if num_classes < 2 or width < 1:
            raise ValueError(
                f"model.num_classes must be >= 2 and model.width >= 1, got {num_classes}, {width}"
            )
        self.save_hyperparameters()
        channels = self._build_features(width, norm)
        self.fc = nn.Linear(channels, num_classes)

    def _build_features(self, width: int, norm: str) -> int:
        """Create the feature extractor; return its output channels."""
        w = width
        self.features = nn.Sequential(
            ConvBNReLU(3, w, stride=2, norm=norm),
            ConvBNReLU(w, w, norm=norm),
            ConvBNReLU(w, 2 * w, stride=2, norm=norm),
            ConvBNReLU(2 * w, 2 * w, norm=norm),
            ConvBNReLU(2 * w, 4 * w, stride=2, norm=norm),
            ConvBNReLU(4 * w, 4 * w, norm=norm),
        )
        return 4 * w

    def _features(self, images: torch.Tensor) -> torch.Tensor:
        return self.features(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(self._features(images).amax((2, 3)))

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        images, targets = batch
        labels = largest_object_labels(targets).to(images.device)
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        sync = stage == "val"
        self.log(f"{stage}/loss", loss, batch_size=len(targets), prog_bar=True, sync_dist=sync)
        if stage == "val":
            acc = (logits.argmax(1) == labels).float().mean()
            self.log("val/acc", acc, batch_size=len(targets), sync_dist=True)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")


class BackboneClassifier(ShapeClassifier):
    """The detector's backbone (``CenterNet``'s :class:`~.centernet.TinyBackbone`, neck included)
    with global max pooling and a linear layer: the model ``recipe=backbone_pretrain`` trains, so
    that ``CenterNet(init_backbone=<its checkpoint>)`` starts from pretrained weights and
    BatchNorm statistics. Same arguments and metrics as :class:`ShapeClassifier`.
    """

    def _build_features(self, width: int, norm: str) -> int:
        self.backbone = TinyBackbone(width, norm)
        return 2 * width

    def _features(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(images)
