"""Process-group helpers for group-wise synchronization.

A *sync group* is the set of ranks whose batches are normalized together. ``None`` means the whole
default group (the world). Splitting the world into consecutive blocks, e.g. 8 ranks with
``group_size=2`` -> ``{0,1} {2,3} {4,5} {6,7}``, keeps the ranks of one block on the same machine
under the usual rank layout, so statistics travel over the fastest link.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["new_sync_group", "sync_group_size"]


def new_sync_group(group_size: int | None) -> dist.ProcessGroup | None:
    """Split the world into consecutive blocks of ``group_size`` ranks; return this rank's block.

    Must be called on every rank, in the same order relative to other group creations, because
    ``torch.distributed.new_group`` is collective.

    Args:
        group_size: ranks per sync group. ``None`` or the world size means the whole world, for
            which ``None`` (the default group) is returned and no group is created. ``1`` gives
            every rank its own group, i.e. plain per-rank BatchNorm.

    Returns:
        The process group containing this rank, or ``None`` for the whole world.

    Raises:
        RuntimeError: when ``torch.distributed`` is not initialized.
        TypeError: when ``group_size`` is not an int or None.
        ValueError: when ``group_size < 1`` or does not divide the world size.

    Example:
        >>> # on each of 4 ranks, after dist.init_process_group("gloo", ...):
        >>> # group = new_sync_group(2)   # ranks {0,1} and {2,3}
        >>> # model = convert_sync_batchnorm(model, process_group=group)
    """
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise TypeError(
            f"group_size must be an int or None (whole world), got {type(group_size).__name__} "
            f"{group_size!r}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "new_sync_group() needs an initialized default process group: call "
            "torch.distributed.init_process_group(...) first"
        )
    world = dist.get_world_size()
    if group_size is None or group_size == world:
        return None
    if group_size < 1 or world % group_size != 0:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the world size {world}; "
            f"valid values: {divisors} or None for the whole world"
        )
    rank = dist.get_rank()
    mine = None
    for start in range(0, world, group_size):
        ranks = list(range(start, start + group_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def sync_group_size(process_group: dist.ProcessGroup | None) -> int:
    """Number of ranks that synchronize through ``process_group`` (1 without torch.distributed).

    Raises:
        ValueError: when this rank is not a member of ``process_group``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    size = dist.get_world_size(process_group)
    if size < 1:
        raise ValueError(
            f"this rank (global rank {dist.get_rank()}) is not a member of the layer's "
            f"process_group; give every rank the group it belongs to (see new_sync_group)"
        )
    return size
