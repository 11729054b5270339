"""Process groups: who normalizes with whom.

A *sync group* is the set of ranks whose batches are normalized together. ``None`` means the whole
world. Splitting the world into consecutive blocks, e.g. 8 ranks with ``group_size=2`` ->
``{0,1} {2,3} {4,5} {6,7}``, keeps the ranks of one block on the same machine under the usual rank
layout, so statistics travel over the fastest link. How many ranks a group has is decided by
:mod:`.group_sizes` (no torch: the service checks a config with it before torch is imported),
whose names are re-exported here.

SyncBN's collectives never share a process group with anyone else's. DDP launches its gradient
all-reduces asynchronously, from autograd hooks, while the backward goes on into SyncBN layers;
torch 2.13's gloo does not survive a functional all-gather issued while another collective of the
same group is in flight (crashes and hangs; docs/reliability.md has the measurements). On a group
of its own, at most one SyncBN collective is in flight at a time (each is waited for before the
layer goes on), and the group's order is the layers' call order, which the call-order tags check;
nothing else (DDP's hooks, Lightning's SIGTERM handler, a user's metric) can slip a collective into
it. So the world synchronizes through :func:`sync_world_group`, the world's ranks in a group of
their own, and :func:`new_sync_group` makes fresh groups; both take SyncBN's timeout
(:func:`set_sync_timeout`, else the default group's; ``dist.new_group`` would default to 30
minutes).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .call_order import watcher
from .collectives import backend_for_device
from .collectives import process_group as group_named
from .group_sizes import (
    DEFAULT_TARGET_NORM_BATCH,
    GroupSize,
    resolve_group_size,
    validate_group_size,
)
from .job import current_job

__all__ = [
    "DEFAULT_TARGET_NORM_BATCH",
    "GroupSize",
    "carries_device_tensors",
    "check_process_group",
    "group_name_of",
    "is_group",
    "made_group_name",
    "new_sync_group",
    "resolve_group_size",
    "set_sync_timeout",
    "sync_group_size",
    "sync_timeout",
    "sync_world_group",
    "validate_group_size",
    "watch_sync_group",
]


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
        The process group containing this rank (a new one, with :func:`sync_timeout`), or
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
    timeout = sync_timeout()
    for start in range(0, world, group_size):
        ranks = list(range(start, start + group_size))
        group = dist.new_group(ranks, timeout=timeout, group_desc=f"syncbn_{start}")
        if rank in ranks:
            mine = group
    _note_groups_made(timeout)
    watch_sync_group(mine)
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


def sync_world_group() -> dist.ProcessGroup:
    """The process group of SyncBN layers that synchronize over the whole world: every rank of
    the default group, in a group that only SyncBN's collectives use (see the module docstring).

    Made on first use and kept by the job (:class:`~.job.SyncJob`: a new default group, a new job,
    gets a new twin). Making it is collective: every rank must get here in the same order relative
    to other group creations. The converter, the callback and the plugin make it where they convert
    after ``init_process_group``; otherwise a layer's first synchronized call does (every rank of
    the world makes that call, as it joins the layer's collective with all of them).

    Raises:
        RuntimeError: when torch.distributed is not initialized.
    """
    job = current_job()
    if job is None:
        raise RuntimeError(
            "sync_world_group() needs an initialized default process group: call "
            "torch.distributed.init_process_group(...) first"
        )
    if job.world_twin is None:
        timeout = sync_timeout()
        twin = dist.new_group(timeout=timeout, group_desc="syncbn_world")
        job.world_twin = twin
        _note_groups_made(timeout)
        watch_sync_group(twin)
    return job.world_twin


def watch_sync_group(process_group: Any, cpu_queues: bool = False) -> None:
    """Have the job's call-order watcher (:mod:`.call_order.watcher`) watch the group a layer with
    ``process_group`` synchronizes through, in a running job (a group of the caller's, or the
    world's twin once made: this never makes a group), where its calls may queue their flags:
    the group carries device tensors (:func:`carries_device_tensors`), or ``cpu_queues`` (CPU
    calls queue them: the tests' switch, ``call_order/policy.py``). Called where SyncBN makes
    its groups (:func:`new_sync_group`, :func:`sync_world_group`)."""
    name = made_group_name(process_group)
    if name is not None and (cpu_queues or carries_device_tensors(name)):
        watcher.watch_group(name)


def carries_device_tensors(group: Any) -> bool:
    """Whether ``group`` (a ProcessGroup or its name) has a backend for other devices than the
    CPU (``nccl``, ``cpu:gloo,cuda:nccl``; not ``gloo``): only calls on device tensors leave
    their call-order flags to be read later, and a mismatch found late is what the watcher
    is for. On CPU every rank of the group fails at the call itself, from the gathered rows."""
    if isinstance(group, str):
        group = group_named(group)
    return backend_for_device(str(dist.get_backend_config(group)), "cuda") not in (None, "gloo")


def made_group_name(process_group: Any) -> str | None:
    """The name of the group a layer with ``process_group`` synchronizes through, if that group
    exists in the running job (as :func:`group_name_of`, but never making the world's twin):
    ``None`` outside a job, or for the world before its twin is made."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if isinstance(process_group, dist.ProcessGroup) and process_group is not dist.group.WORLD:
        return process_group.group_name
    job = current_job(create=False)
    twin = job.world_twin if job is not None else None
    return twin.group_name if twin is not None else None


def _world_group_name() -> str:
    return sync_world_group().group_name


# A constant to torch.compile: it runs while tracing (on every rank, as every rank compiles the
# same code), so compiled code synchronizes through the twin too. This marker is what
# torch.compiler.assume_constant_result sets; set directly, because that function imports
# torch._dynamo (1.7 s) and `import syncbn_lightning` must stay cheap (tests/test_groups.py checks
# that the public decorator still sets exactly this marker).
_world_group_name._dynamo_marked_constant = True  # type: ignore[attr-defined]


_sync_timeout: timedelta | None = None


def _note_groups_made(timeout: timedelta | None) -> None:
    """Keep on the job the timeout SyncBN made its groups with (:func:`set_sync_timeout`)."""
    job = current_job()
    if job is not None:
        job.groups_timeout = (timeout,)


def set_sync_timeout(timeout: timedelta | float | None) -> None:
    """The collective timeout of the process groups SyncBN makes (:func:`sync_world_group`,
    :func:`new_sync_group`; seconds or a timedelta); call it on every rank before SyncBN makes
    the job's groups: before ``new_sync_group``, ``SyncBNCallback``'s setup and the layers'
    first synchronized call. ``None`` (the default): the default group's. Set it shorter than the
    default group's: a rank that stops inside a SyncBN collective then ends the job after this
    long, while DDP's and Lightning's collectives on the default group (barriers while rank 0
    evaluates or saves alone) keep the longer one.

    Raises:
        ValueError: for a timeout that is not positive.
        RuntimeError: when SyncBN already made this job's groups with another timeout (a group
            keeps the timeout it was made with; a later job's groups take the new one).
    """
    global _sync_timeout
    if timeout is not None and not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout is not None and timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be > 0 seconds (or None), got {timeout}")
    job = current_job(create=False)
    made = job.groups_timeout if job is not None else None
    if made is not None and made[0] != (timeout or _default_timeout()):
        raise RuntimeError(
            f"set_sync_timeout({timeout}) came after SyncBN made this job's process groups "
            f"(with timeout {made[0]}), which keep the timeout they were made with: call it "
            f"on every rank before new_sync_group(), SyncBNCallback's setup and the layers' "
            f"first synchronized call (right after init_process_group)"
        )
    _sync_timeout = timeout


def sync_timeout() -> timedelta | None:
    """The timeout of the groups SyncBN makes: :func:`set_sync_timeout`'s, else the default
    group's."""
    return _sync_timeout if _sync_timeout is not None else _default_timeout()


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
