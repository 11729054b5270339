"""``SyncBatchNormAct``: the synchronized layer followed by an activation, fused in its kernels."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..ops.activations import fused_activation, make_activation, optional_module
from .batchnorm import SyncBatchNorm, traced_call
from .convert import register_sync_class

__all__ = ["BatchNormActXd", "SyncBatchNormAct"]

# timm's BatchNorm + drop + activation classes (module, name): SyncBatchNormAct reproduces them.
_TIMM_NORM_ACT = {
    ("timm.layers.norm_act", "BatchNormAct2d"),
    ("timm.layers.norm_act", "SyncBatchNormAct"),
}


class SyncBatchNormAct(SyncBatchNorm):
    r"""A :class:`SyncBatchNorm` followed by ``drop`` and an activation: ``act(drop(bn(x)))``, with
    the activation fused into the synchronized kernels. timm's ``BatchNormAct2d`` (and
    timm's ``SyncBatchNormAct``) convert to it, keeping their ``act`` and ``drop`` modules and
    their state_dict keys; :func:`~syncbn_lightning.revert_sync_batchnorm` gives the timm class
    back.

    Args:
        num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype,
            force_sync, unbiased_running_var, impl, stats_mode: as :class:`SyncBatchNorm`.
        act: the activation: an ``nn.Module``, or the name of one the kernels fuse (a row of
            :data:`syncbn_lightning.ops.activations.ACTIVATIONS`: ``"relu"``, ``"leaky_relu"``
            (slope 0.01), ``"silu"``...); ``None`` is the identity. Default: ``"relu"`` (timm's
            default).
        drop: a module applied between the normalization and the activation (timm's
            ``drop_layer``, e.g. DropBlock); ``None`` is the identity. Default: ``None``.

    Raises:
        TypeError / ValueError: as :class:`SyncBatchNorm`, and for an ``act``/``drop`` that is
            neither a module, a known name nor None.

    Example:
        >>> import torch
        >>> from syncbn_lightning import SyncBatchNormAct
        >>> layer = SyncBatchNormAct(8, act="silu")
        >>> layer(torch.randn(4, 8, 5, 5)).shape   # no process group: BatchNorm2d, then SiLU
        torch.Size([4, 8, 5, 5])

    Note:
        The statistics, running-stat updates and gradient semantics are those of
        :class:`SyncBatchNorm`; the activation changes only what flows in and out. In the
        synchronized training forward, the activations of
        :data:`~syncbn_lightning.ops.activations.ACTIVATIONS` (``nn.ReLU``, ``nn.SiLU``,
        ``nn.GELU()``...: exact types, ``drop`` the identity) are computed inside the normalize
        kernel, in float32 for float16/bfloat16
        inputs with one rounding at the end, and the backward recomputes the activation's input
        from the saved input instead of storing it: one pass over the tensor fewer each way than
        BatchNorm then the activation. Any other ``act`` or ``drop`` runs as its own module
        after the normalization, with the same results. Outside synchronization (eval, a group of
        one rank) the layer is ``F.batch_norm`` followed by ``drop`` and ``act``, as timm's.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        act: nn.Module | str | None = "relu",
        drop: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        act_module = make_activation(act)
        drop_module = optional_module(drop, "drop")
        super().__init__(
            num_features,
            eps,
            momentum,
            affine,
            track_running_stats,
            process_group,
            device,
            dtype,
            **kwargs,
        )
        self.drop = drop_module
        self.act = act_module

    @property
    def fused_activation(self) -> tuple[int, float] | None:
        """The activation's code and parameter the synchronized kernels apply
        (:data:`~syncbn_lightning.ops.activations.ACTIVATIONS`), or ``None`` when ``act`` is not
        one they reproduce or ``drop`` is not the identity (then both run as modules)."""
        if type(self._modules["drop"]) is not nn.Identity:
            return None
        return fused_activation(self._modules["act"])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if type(input) is not torch.Tensor and isinstance(input, torch.fx.Proxy):
            return traced_call(self, input)  # one node: normalization, drop and activation
        output, applied = self._forward(input, self.fused_activation)
        if applied:
            return output
        return self._modules["act"](self._modules["drop"](output))


class BatchNormActXd(_BatchNorm):
    """Plain BatchNorm of any input rank followed by ``drop`` and ``act``: what
    :func:`~syncbn_lightning.revert_sync_batchnorm` turns a :class:`SyncBatchNormAct` into when it
    was not made by the converter (its original class is unknown). Same state_dict keys."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(super().forward(input)))


def _timm_norm_act(owner: type) -> bool:
    """Whether ``owner`` (the class defining a layer's forward) is timm's BatchNorm + drop + act,
    or ours reverted."""
    return owner is BatchNormActXd or (owner.__module__, owner.__name__) in _TIMM_NORM_ACT


register_sync_class(SyncBatchNormAct, plain=BatchNormActXd, replaces=_timm_norm_act)
