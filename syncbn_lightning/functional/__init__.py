"""The synchronized computation: one autograd Function (:mod:`.function`), one frozen settings
object (:mod:`.options`), and the exchange strategies behind one small interface
(:mod:`.exchange`), found by name in one registry (:mod:`.registry`).

The built-in strategies are registered here, one line each; a new one is a file with an
:class:`~.exchange.Exchange` subclass and a line below (or a :func:`register_exchange` call of
its own).
"""

from .exchange import Exchange, Inputs, LayerState, LocalGrads, Merged, Saved, SyncCall
from .function import SyncBatchNormFunction, sync_batch_norm
from .gather import GatherExchange
from .options import KEEP, STATS_MODES, SyncOptions, check_stats_mode
from .reduce import ReduceExchange
from .registry import (
    AUTO_REDUCE_ABOVE,
    check_exchange,
    exchange_names,
    get_exchange,
    register_exchange,
    resolve_exchange,
)

register_exchange(GatherExchange())
register_exchange(ReduceExchange())

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
