"""The values ``model.norm`` takes and their checks (no torch: the service checks a config with
them before it imports torch; :mod:`.norms` builds the layers)."""

from __future__ import annotations

__all__ = ["NORMS", "check_norm", "check_norm_init"]

NORMS = ("bn", "gn", "frozen_bn")
"""The values ``model.norm`` takes."""


def check_norm(norm: str) -> str:
    """``norm`` if it is one of :data:`NORMS`, else a ``ValueError`` naming ``model.norm``."""
    if norm not in NORMS:
        raise ValueError(f"model.norm must be one of {NORMS}, got {norm!r}")
    return norm


def check_norm_init(norm: str, init_backbone: str | None) -> str:
    """:func:`check_norm`, and a ``ValueError`` for ``frozen_bn`` without the pretrained backbone
    it freezes (a detector's ``model.init_backbone``)."""
    if check_norm(norm) == "frozen_bn" and not init_backbone:
        raise ValueError(
            "model.norm=frozen_bn fixes every normalization's statistics and affine, which "
            "without pretrained values are the identity (no normalization at all): set "
            "model.init_backbone=<the checkpoint of a recipe=backbone_pretrain run>, "
            "or use model.norm=bn or gn"
        )
    return norm
