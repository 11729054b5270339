"""How many ranks normalize together, and whether that is enough: the group-size rules and the one
answer to "how many samples per normalization?" (no torch: the service checks a config with these
before it imports torch; :mod:`.groups` re-exports them).

:data:`DEFAULT_TARGET_NORM_BATCH` is the normalization batch (samples per BatchNorm forward in a
sync group) that ``group_size="auto"`` aims for, below which ``SyncBNCallback`` warns, and against
which the service's report reads ``bn/norm_batch_size``: :func:`norm_batch_verdict` gives all three
the same verdict and the same fix.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

__all__ = [
    "DEFAULT_TARGET_NORM_BATCH",
    "GroupSize",
    "NormBatchVerdict",
    "auto_group_summary",
    "norm_batch_verdict",
    "resolve_group_size",
    "validate_group_size",
]

GroupSize = int | Literal["node", "auto"] | None

DEFAULT_TARGET_NORM_BATCH = 16
"""The normalization batch ``group_size="auto"`` aims for unless told otherwise (the callback's
and ``bn.target_norm_batch``'s default), below which the callback warns and the report reads the
statistics as noisy.

16 rests on the strongest evidence at hand, the ImageNet curve of the GroupNorm paper (Wu & He,
"Group Normalization", ECCV 2018, Table 3: ResNet-50 with BatchNorm statistics per GPU, top-1
error 23.6 / 23.7 / 24.8 / 27.3 / 34.7 % at 32 / 16 / 8 / 4 / 2 images per GPU): BatchNorm at 16
is within 0.1 point of 32, at 8 it loses 1.2 and at 4 it loses 3.7. Our own sweep (a 0.5 M
parameter detector on synthetic shapes, docs/choosing-normalization.md) put its knee at 4; that
measures one toy task, and a default has to protect users who never read the docs, where a
larger group costs little (tens of microseconds per layer on GPUs). ``tests/test_choice_docs.py``
keeps the page and this value equal.
"""
_GROUP_SIZE_HELP = (
    "None (the whole world), an int that divides the world size, 'node' (the processes of one "
    "machine) or 'auto' (the smallest group reaching target_norm_batch samples)"
)


class NormBatchVerdict(NamedTuple):
    """What a normalization batch is worth against a target (:func:`norm_batch_verdict`)."""

    #: ``"noisy"`` (below the target), ``"enough"`` (from it) or ``"reliable"`` (from twice it).
    band: str
    #: One line, e.g. ``norm batch 4 < 16: statistics noisy; raise the batch ...``.
    text: str
    #: What to change, for ``"noisy"`` (else ``None``).
    fix: str | None


def norm_batch_verdict(
    norm_batch: float, global_batch: float | None = None, target: int = DEFAULT_TARGET_NORM_BATCH
) -> NormBatchVerdict:
    """The verdict on ``norm_batch`` samples per normalization against ``target``
    (``bn.target_norm_batch``): below it ``"noisy"``, from it ``"enough"``, from twice it
    ``"reliable"`` (on the cited curve BatchNorm at 16 images is within 0.1 point of 32). The fix
    of a noisy one depends on ``global_batch`` (the samples of one step over all ranks,
    ``bn/global_batch_size``; ``None``: unknown): syncing more ranks where the global batch
    reaches the target, else a larger batch per device or more devices. The callback's warning
    and the report's reading are this text."""
    norm = round(norm_batch)
    world = round(global_batch) if global_batch is not None else None
    of = f" of {world} (global batch)" if world is not None and world > norm else ""
    if norm >= 2 * target:
        return NormBatchVerdict(
            "reliable", f"norm batch {norm}{of} >= {2 * target}: statistics reliable", None
        )
    if norm >= target:
        text = f"norm batch {norm}{of} >= {target}: statistics enough ({2 * target}+ reliable)"
        return NormBatchVerdict("enough", text, None)
    if world is not None and world >= target:
        fix = f"sync more ranks: group_size='auto' syncs the smallest group reaching {target}"
    elif world is not None and world > norm:
        fix = (
            f"sync every rank (group_size=None) and raise the batch per device or the number "
            f"of devices: the global batch {world} is below {target}"
        )
    else:
        fix = "raise the batch per device or the number of devices"
    return NormBatchVerdict(
        "noisy", f"norm batch {norm}{of} < {target}: statistics noisy; {fix}", fix
    )


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


def auto_group_summary(size: int, batch: int, world: int, target: int) -> str:
    """The line the callback logs when ``group_size="auto"`` is decided: the normalization batch
    it chose, and why (the target, and where the target's default comes from)."""
    norm = size * batch
    if norm >= target:
        why = f"the smallest group of the {world} ranks reaching target_norm_batch={target}"
    else:
        why = f"no group of the {world} ranks reaches target_norm_batch={target}: the whole world"
    origin = (
        "the default: where BatchNorm's ImageNet accuracy stops falling, see "
        "docs/choosing-normalization.md"
        if target == DEFAULT_TARGET_NORM_BATCH
        else "set by you"
    )
    return (
        f"SyncBNCallback: group_size='auto' -> normalization batch {norm} ({size} ranks x "
        f"{batch} samples): {why} ({origin})"
    )
