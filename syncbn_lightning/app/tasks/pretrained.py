"""Initialize a detector's backbone from a classifier trained on the same backbone.

``python train.py recipe=backbone_pretrain`` trains
:class:`~syncbn_lightning.app.tasks.classifier.BackboneClassifier` (the detector's
``TinyBackbone`` with a pooling classifier on top) with a large batch; ``model.init_backbone=
<its checkpoint>`` then starts a ``CenterNet`` from its backbone: weights, BatchNorm affine and
running statistics, as ImageNet-pretrained backbones start detectors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

__all__ = ["load_backbone"]

PREFIX = "backbone."


def load_backbone(backbone: nn.Module, path: str | Path) -> None:
    """Load the ``backbone.*`` tensors of the Lightning checkpoint at ``path`` into ``backbone``.

    Every tensor of ``backbone`` must be in the checkpoint with the same shape (strict), so a
    checkpoint of another width or of another model is refused rather than half loaded.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the checkpoint has no ``backbone.*`` tensors, or they do not fit.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"model.init_backbone={str(path)!r}: no such file; give the checkpoint of a "
            "`python train.py recipe=backbone_pretrain` run "
            "(<its output dir>/checkpoints/last.ckpt)"
        )
    state = torch.load(path, map_location="cpu", weights_only=True).get("state_dict", {})
    ours = {k[len(PREFIX) :]: v for k, v in state.items() if k.startswith(PREFIX)}
    if not ours:
        raise ValueError(
            f"model.init_backbone={str(path)!r} holds no 'backbone.*' weights: it is not a "
            "checkpoint of BackboneClassifier (recipe=backbone_pretrain)"
        )
    try:
        backbone.load_state_dict(ours, strict=True)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        raise ValueError(
            f"model.init_backbone={str(path)!r} does not fit this backbone ({first}); "
            "pretrain with the same model.width"
        ) from None
