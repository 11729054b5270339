"""The synchronized computation: one autograd Function (:mod:`.function`), one frozen settings
object (:mod:`.options`), and the exchange strategies behind one small interface
(:mod:`.exchange`), found by name in one registry (:mod:`.registry`).

The built-in strategies register themselves (one line at the end of their file, and a line of
:data:`~.registry.BUILTIN`); a new one is a file with an :class:`~.exchange.Exchange` subclass
and a :func:`register_exchange` call. The names below are imported on first use (PEP 562): the
options and the registry need no torch, so the service checks a config with them before torch is
imported.
"""

import importlib
from typing import Any

__all__ = [
    "AUTO_REDUCE_ABOVE",
    "KEEP",
    "STATS_MODES",
    "Exchange",
    "GatherExchange",
    "Inputs",
    "LayerState",
    "LocalGrads",
    "Merged",
    "ReduceExchange",
    "Saved",
    "SyncBatchNormFunction",
    "SyncCall",
    "SyncOptions",
    "check_exchange",
    "check_stats_mode",
    "exchange_names",
    "get_exchange",
    "register_exchange",
    "resolve_exchange",
    "sync_batch_norm",
]

_WHERE = {
    "Exchange": "exchange",
    "Inputs": "exchange",
    "LayerState": "exchange",
    "LocalGrads": "exchange",
    "Merged": "exchange",
    "Saved": "exchange",
    "SyncCall": "exchange",
    "SyncBatchNormFunction": "function",
    "sync_batch_norm": "function",
    "GatherExchange": "gather",
    "ReduceExchange": "reduce",
    "KEEP": "options",
    "STATS_MODES": "options",
    "SyncOptions": "options",
    "check_stats_mode": "options",
    "AUTO_REDUCE_ABOVE": "registry",
    "check_exchange": "registry",
    "exchange_names": "registry",
    "get_exchange": "registry",
    "register_exchange": "registry",
    "resolve_exchange": "registry",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value
