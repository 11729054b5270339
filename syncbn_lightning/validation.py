"""Checks of the layer's and the converter's hyper-parameters, shared by the module (layer 4), the
converter and the Lightning setup: each failure names the argument and the fix."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["validate_hyperparameters", "is_group"]


def validate_hyperparameters(
    num_features: Any, eps: Any, momentum: Any, process_group: Any
) -> None:
    """Raise a TypeError/ValueError naming the argument unless ``num_features`` is a positive
    int, ``eps`` a finite float > 0, ``momentum`` in [0, 1] or None and ``process_group`` a
    group (see :func:`is_group`) or None."""
    if isinstance(num_features, bool) or not isinstance(num_features, int):
        raise TypeError(
            f"num_features must be an int (the number of channels), got "
            f"{type(num_features).__name__} {num_features!r}"
        )
    if num_features <= 0:
        raise ValueError(f"num_features must be > 0 (the number of channels), got {num_features}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float > 0, got {type(eps).__name__} {eps!r}")
    if not eps > 0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite float > 0 (e.g. 1e-5), got {eps}")
    if momentum is not None:
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
            raise TypeError(
                f"momentum must be a float in [0, 1] or None (cumulative average), got "
                f"{type(momentum).__name__} {momentum!r}"
            )
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(
                f"momentum must be in [0, 1] or None (cumulative average), got {momentum}; torch "
                f"convention: the weight of the new batch (TF/Keras momentum m is 1 - m here)"
            )
    if process_group is not None and not is_group(process_group):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup or None (world), got "
            f"{type(process_group).__name__}; create one with syncbn_lightning.new_sync_group()"
        )


def is_group(process_group: Any) -> bool:
    """A ProcessGroup, or what ``dist.new_group(ranks)`` returns on a rank outside ``ranks``
    (``GroupMember.NON_GROUP_MEMBER``), which ``torch.nn.SyncBatchNorm`` accepts too: every rank
    can then convert the same model; only training such a layer there fails (see
    :func:`~syncbn_lightning.groups.sync_group_size`)."""
    if isinstance(process_group, dist.ProcessGroup):
        return True
    return dist.is_available() and process_group is dist.GroupMember.NON_GROUP_MEMBER
