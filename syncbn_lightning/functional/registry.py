"""The exchange strategies, by name: ONE registry, and the one place ``"auto"`` is resolved.

A strategy (:class:`~.exchange.Exchange`) is registered under its ``name`` with
:func:`register_exchange`. The built-in ``gather`` and ``reduce`` are known here by name and by
their one-line summaries (:data:`BUILTIN`) and register themselves when their modules are first
imported, which the first lookup does: checking a name (``SyncOptions``, the service's config
check) needs no torch. Layers name their strategy in ``SyncOptions.exchange`` (checked against
this registry) and find it per call with :func:`resolve_exchange`.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

__all__ = [
    "AUTO_REDUCE_ABOVE",
    "BUILTIN",
    "check_exchange",
    "exchange_names",
    "get_exchange",
    "register_exchange",
    "resolve_exchange",
]

#: ``exchange="auto"`` on GPUs reduces in groups of more than this many ranks and gathers up to
#: it (one node of 8 GPUs gathers; across nodes NCCL's tree all-reduce takes ``2 log2 P`` steps
#: where its ring all-gather takes ``P - 1``: the alpha-beta model of docs/scaling.md). CPU
#: tensors (gloo) always gather: measured on 2 to 16 gloo ranks, the reduce exchange was never the
#: faster (gloo's all-reduce is a ring too, twice the all-gather's steps; benchmarks/RESULTS.md).
AUTO_REDUCE_ABOVE = 8


class _Strategy(Protocol):
    name: str
    summary: str


#: The built-in strategies: name -> (their module, the one line that says what they send).
BUILTIN = {
    "gather": (
        "syncbn_lightning.functional.gather",
        "all-gather every rank's statistics: bytes grow with the group size",
    ),
    "reduce": (
        "syncbn_lightning.functional.reduce",
        "one all-reduce of per-channel float64 sums: O(C) bytes for any group",
    ),
}

_STRATEGIES: dict[str, Any] = {}


def _known() -> dict[str, str]:
    """Every strategy's name and summary: the built-ins first, then what was registered."""
    known = {name: summary for name, (_module, summary) in BUILTIN.items()}
    known.update({name: s.summary for name, s in _STRATEGIES.items()})
    return known


def register_exchange(strategy: _Strategy) -> _Strategy:
    """Make ``strategy`` (an :class:`~.exchange.Exchange` instance) available as
    ``exchange=strategy.name``; returns it. Registering a name again replaces the strategy.

    Raises:
        ValueError: for the reserved name ``"auto"``.
    """
    if strategy.name == "auto":
        raise ValueError("'auto' is not a strategy's name: it picks one (resolve_exchange)")
    _STRATEGIES[strategy.name] = strategy
    return strategy


def exchange_names() -> tuple[str, ...]:
    """The strategies' names: the built-ins, then the others in registration order."""
    return tuple(_known())


def check_exchange(exchange: Any, name: str = "exchange") -> str:
    """``exchange`` if it is ``"auto"`` or a registered strategy, else a ValueError naming ``name``
    and every accepted value with what it does."""
    known = _known()
    if exchange != "auto" and exchange not in known:
        choices = [f"{n!r} ({summary})" for n, summary in known.items()]
        choices.append(f"'auto' (on GPUs, reduce in groups of more than {AUTO_REDUCE_ABOVE} ranks)")
        raise ValueError(
            f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, got {exchange!r}"
        )
    return str(exchange)


def get_exchange(name: str) -> Any:
    """The strategy registered as ``name``, a built-in imported on first use (KeyError if none
    is)."""
    if name not in _STRATEGIES and name in BUILTIN:
        importlib.import_module(BUILTIN[name][0])  # registers itself
    return _STRATEGIES[name]


def resolve_exchange(
    exchange: str, world_size: int, group: Any, device_type: str | None = None
) -> Any:
    """The strategy a layer with ``exchange`` uses in a sync group of ``world_size`` ranks for
    tensors on ``device_type``: ``"auto"`` is ``gather`` for CPU tensors, and otherwise
    ``reduce`` in groups of more than :data:`AUTO_REDUCE_ABOVE` ranks and ``gather`` up to it
    (``device_type=None``: that rule); ``group`` is the layer's group name, or a DataParallel
    replica group, which is in-process and always gathers."""
    if group is not None and not isinstance(group, str):
        return get_exchange("gather")
    if exchange == "auto":
        reduce = device_type != "cpu" and world_size > AUTO_REDUCE_ABOVE
        return get_exchange("reduce" if reduce else "gather")
    return get_exchange(exchange)
