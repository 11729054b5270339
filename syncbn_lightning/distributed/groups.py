"""Process groups and group-size rules: who normalizes with whom.

A *sync group* is the set of ranks whose batches are normalized together. ``None`` means the whole
world. Splitting the world into consecutive blocks, e.g. 8 ranks with ``group_size=2`` ->
``{0,1} {2,3} {4,5} {6,7}``, keeps the ranks of one block on the same machine under the usual rank
layout, so statistics travel over the fastest link.

SyncBN's collectives never share a process group with anyone else's. Collectives pair up by their
order *within a group*, and the layers' order is the one thing the call-order tags check; DDP's
gradient all-reduces, Lightning's and the user's collectives on the default group are issued by
other code on its own schedule (DDP's from autograd hooks as buckets fill, Lightning's SIGTERM
handler from a signal), so on a shared group the interleaving of the two streams must come out
the same on every rank, which nothing guarantees. So the world is synchronized through
:func:`sync_world_group`, the world's ranks in a group of their own, and :func:`new_sync_group`
makes fresh groups; both take the default group's timeout (``dist.new_group`` would default to
30 minutes). docs/reliability.md tells the hang this prevents.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TARGET_NORM_BATCH",
    "GroupSize",
    "check_process_group",
    "group_name_of",
    "is_group",
    "new_sync_group",
    "resolve_group_size",
    "sync_group_size",
    "sync_world_group",
    "validate_group_size",
]

GroupSize = int | Literal["node", "auto"] | None

DEFAULT_TARGET_NORM_BATCH = 4
"""The normalization batch ``group_size="auto"`` aims for unless told otherwise (the callback's
and ``bn.target_norm_batch``'s default): the knee of the small-batch experiment's norm-batch
sweep, the smallest normalization batch from which no larger one was better there by more than
1 point and two standard errors (``docs/choosing-normalization.md``, which also says how far a
small synthetic task carries; ``tests/test_choice_docs.py`` keeps the two equal). It was 32
before that measurement.
"""
_GROUP_SIZE_HELP = (
    "None (the whole world), an int that divides the world size, 'node' (the processes of one "
    "machine) or 'auto' (the smallest group reaching target_norm_batch samples)"
)


def new_sync_group(group_size: int | None) -> dist.ProcessGroup | None:
    """Split the world into consecutive blocks of ``group_size`` ranks; return this rank's block.

    Must be called on every rank, in the same order relative to other group creations, because
    ``torch.distributed.new_group`` is collective.

    Args:
        group_size: ranks per sync group. ``None`` or the world size means the whole world, for
            which ``None`` is returned (layers with ``process_group=None`` synchronize through
            :func:`sync_world_group`). ``1`` gives every rank its own group, i.e. plain per-rank
            BatchNorm.

    Returns:
        The process group containing this rank (a new one, with the default group's timeout), or
        ``None`` for the whole world.

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
    timeout = _default_timeout()
    for start in range(0, world, group_size):
        ranks = list(range(start, start + group_size))
        group = dist.new_group(ranks, timeout=timeout, group_desc=f"syncbn_{start}")
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
            f"process_group, so it cannot train the layer with it (evaluation works); give "
            f"every rank the group it belongs to (see new_sync_group)"
        )
    return size


def resolve_group_size(
    group_size: GroupSize,
    world_size: int,
    processes_per_node: int,
    per_rank_batch: int | None = None,
    target_norm_batch: int = DEFAULT_TARGET_NORM_BATCH,
) -> int:
    """The number of ranks per sync group that ``group_size`` means in this run.

    Args:
        group_size: ``None`` -> ``world_size``; an int -> itself (must divide ``world_size``);
            ``"node"`` -> ``processes_per_node``; ``"auto"`` -> the smallest divisor ``d`` of
            ``world_size`` with ``d * per_rank_batch >= target_norm_batch``, or ``world_size``
            when no divisor reaches it.
        world_size: number of processes.
        processes_per_node: processes on one machine (Lightning: ``trainer.num_devices``).
        per_rank_batch: samples per BN forward on one rank; required for ``"auto"``.
        target_norm_batch: the normalization batch ``"auto"`` aims for.

    Raises:
        ValueError: when the size does not divide ``world_size`` or ``"auto"`` lacks the batch.
    """
    if group_size is None:
        return world_size
    if group_size == "node":
        size = processes_per_node
    elif group_size == "auto":
        if per_rank_batch is None or per_rank_batch < 1:
            raise ValueError(
                "group_size='auto' needs the per-device batch size, but the train DataLoader does "
                "not expose one (batch_size=None with a custom batch_sampler?): pass an explicit "
                "SyncBNCallback(group_size=...)"
            )
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        return next((d for d in divisors if d * per_rank_batch >= target_norm_batch), world_size)
    else:
        size = group_size
    if size < 1 or world_size % size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"group_size={group_size!r} means {size} ranks per sync group, which does not divide "
            f"the world size {world_size} (num_nodes x devices): use one of {divisors}, None, "
            f"'node' or 'auto'"
        )
    return size


def validate_group_size(group_size: Any, allow_auto: bool = True) -> None:
    """Raise a TypeError/ValueError naming the accepted values unless ``group_size`` is a value
    :func:`resolve_group_size` takes (``"auto"`` only where ``allow_auto``)."""
    allowed = ("node", "auto") if allow_auto else ("node",)
    if group_size is None or group_size in allowed:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(
            f"group_size must be {_GROUP_SIZE_HELP if allow_auto else 'None, an int or node'}, "
            f"got {type(group_size).__name__} {group_size!r}"
        )
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (1 = per-rank BatchNorm), got {group_size}")


def group_name_of(process_group: dist.ProcessGroup | None) -> str | None:
    """The name of the group a layer with ``process_group`` synchronizes through, as torch's
    functional collectives know it: ``None`` and the default group itself stand for the world,
    which synchronizes through :func:`sync_world_group`. ``None`` when torch.distributed is not
    initialized (there is nothing to communicate with)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if process_group is None or process_group is dist.group.WORLD:
        return _world_group_name()
    return process_group.group_name


_world_twin: tuple[Any, dist.ProcessGroup] | None = None  # (default group, SyncBN's twin of it)


def sync_world_group() -> dist.ProcessGroup:
    """The process group of SyncBN layers that synchronize over the whole world: every rank of
    the default group, in a group that only SyncBN's collectives use (see the module docstring).

    Made on first use and kept while the default group lives (a new default group gets a new
    twin). Making it is collective: every rank must get here in the same order relative to other
    group creations. The converter, the callback and the plugin make it where they convert after
    ``init_process_group``; otherwise a layer's first synchronized call does (every rank of the
    world makes that call, as it joins the layer's collective with all of them).

    Raises:
        RuntimeError: when torch.distributed is not initialized.
    """
    global _world_twin
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "sync_world_group() needs an initialized default process group: call "
            "torch.distributed.init_process_group(...) first"
        )
    world = dist.group.WORLD
    if _world_twin is None or _world_twin[0] is not world:
        twin = dist.new_group(timeout=_default_timeout(), group_desc="syncbn_world")
        _world_twin = (world, twin)
    return _world_twin[1]


def _world_group_name() -> str:
    return sync_world_group().group_name


# A constant to torch.compile: it runs while tracing (on every rank, as every rank compiles the
# same code), so compiled code synchronizes through the twin too. This marker is what
# torch.compiler.assume_constant_result sets; set directly, because that function imports
# torch._dynamo (1.7 s) and `import syncbn_lightning` must stay cheap (tests/test_groups.py checks
# that the public decorator still sets exactly this marker).
_world_group_name._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _default_timeout() -> timedelta | None:
    """The default group's collective timeout (``init_process_group(timeout=...)``), for groups
    made from it; ``None`` (torch's default) where the backend does not say."""
    world = dist.group.WORLD
    for device_type in getattr(world, "_device_types", None) or ():
        try:
            return world._get_backend(torch.device(device_type)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def is_group(process_group: Any) -> bool:
    """A ProcessGroup, or what ``dist.new_group(ranks)`` returns on a rank outside ``ranks``
    (``GroupMember.NON_GROUP_MEMBER``), which ``torch.nn.SyncBatchNorm`` accepts too: every rank
    can then convert the same model; only training such a layer there fails (see
    :func:`sync_group_size`)."""
    if isinstance(process_group, dist.ProcessGroup):
        return True
    return dist.is_available() and process_group is dist.GroupMember.NON_GROUP_MEMBER


def check_process_group(process_group: Any) -> None:
    """Raise a TypeError naming the fix unless ``process_group`` is a group (see
    :func:`is_group`) or None (the world)."""
    if process_group is not None and not is_group(process_group):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup or None (world), got "
            f"{type(process_group).__name__}; create one with syncbn_lightning.new_sync_group()"
        )
