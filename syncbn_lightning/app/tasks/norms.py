"""The normalization layers the service's models can be built with: ``model.norm``.

* ``bn``: ``nn.BatchNorm2d`` (what ``SyncBNCallback`` converts to SyncBN when DDP starts);
* ``gn``: ``nn.GroupNorm`` with :func:`gn_groups` groups: per-sample statistics, no
  communication and no running statistics, so the batch size does not enter at all;
* ``frozen_bn``: :class:`FrozenBatchNorm2d`, BatchNorm whose statistics and affine are constants
  (detectron2's default for a pretrained backbone). Without pretrained values it is the identity.

The library's converter only converts ``torch.nn.modules.batchnorm._BatchNorm`` subclasses, so it
leaves GroupNorm and frozen layers as they are (tested).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .norm_choice import NORMS, check_norm

__all__ = ["NORMS", "FrozenBatchNorm2d", "check_norm", "gn_groups", "make_norm"]


#: GroupNorm's groups (Wu & He 2018 use 32 in every layer) ...
GN_GROUPS = 32
#: ... unless that leaves fewer channels per group than this; the GN paper's ablation over the
#: number of channels per group finds its middle values about as good as 32 groups, and its
#: extremes (1 channel, as InstanceNorm; all channels, as LayerNorm) worse.
GN_MIN_CHANNELS_PER_GROUP = 4


def gn_groups(channels: int) -> int:
    """GroupNorm's number of groups for ``channels``: 32, or fewer where channels are few, so that
    every group has at least 4 channels (16 channels: 4 groups; 32: 8; 64: 16; 128 and up: 32).
    Always divides ``channels`` (our models' widths are powers of two)."""
    groups = min(GN_GROUPS, max(1, channels // GN_MIN_CHANNELS_PER_GROUP))
    while channels % groups:
        groups -= 1
    return groups


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm2d with fixed statistics and affine: ``y = (x - mean) / sqrt(var + eps) * w + b``.

    The four are buffers, not parameters: no optimizer updates them and no mode changes them
    (train and eval compute the same thing). The semantics of torchvision's
    ``torchvision.ops.FrozenBatchNorm2d`` (torchvision is not a dependency of the service); its
    state dict has the same keys, and loading a ``BatchNorm2d`` state dict into it drops
    ``num_batches_tracked``. Not a ``_BatchNorm`` subclass, so ``convert_sync_batchnorm`` and
    ``SyncBNCallback`` leave it alone.
    """

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        state_dict.pop(prefix + "num_batches_tracked", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.view(1, -1, 1, 1).to(x.dtype) + shift.view(1, -1, 1, 1).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}"


def make_norm(norm: str, channels: int) -> nn.Module:
    """A fresh normalization layer of kind ``norm`` (one of :data:`NORMS`) for ``channels``."""
    if check_norm(norm) == "gn":
        return nn.GroupNorm(gn_groups(channels), channels)
    if norm == "frozen_bn":
        return FrozenBatchNorm2d(channels)
    return nn.BatchNorm2d(channels)
