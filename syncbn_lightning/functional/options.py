"""One frozen settings object, :class:`SyncOptions`: what a synchronized layer needs to normalize
and exchange, validated once, when it is made.

A layer holds its own complete :class:`SyncOptions` (``layer.sync_options``; its ``momentum``,
``eps``, ``impl``... attributes read and write it) and hands it to the autograd Function on every
call. The converter, :class:`~syncbn_lightning.SyncBNCallback` and ``SyncBNLayerSync`` make ONE
:class:`SyncOptions` from their arguments, in which :data:`KEEP` marks what each layer keeps of its
own (e.g. its momentum), and apply it to every layer with :meth:`SyncOptions.apply_to`, which
checks nothing again: each value was validated once, where it came in.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..ops.impl_names import check_impl
from .registry import check_exchange

__all__ = ["KEEP", "STATS_MODES", "SyncOptions", "check_stats_mode"]

STATS_MODES = ("N", "default")


class _Keep:
    """The value of a :class:`SyncOptions` field that a layer keeps as it is (``None`` is a
    momentum: the cumulative average)."""

    def __repr__(self) -> str:
        return "KEEP"

    def __reduce__(self) -> str:
        return "KEEP"  # pickles as the module's one instance


#: In a :class:`SyncOptions` (and as ``convert_sync_batchnorm(momentum=KEEP)``, the default): each
#: layer keeps its own value of this field.
KEEP: Any = _Keep()


@dataclasses.dataclass(frozen=True, slots=True)
class SyncOptions:
    """How a synchronized BatchNorm layer normalizes and exchanges its statistics.

    Args:
        momentum: weight of the new batch in the running-stat update; ``None``: the cumulative
            average ``1 / num_batches_tracked``. Default: ``0.1``.
        eps: added to the variance before the inverse square root. Default: ``1e-5``.
        impl: the kernels: ``"auto"``, ``"ext"``, ``"reference"``/``"ref"`` (stored as
            ``"ref"``), or ``None`` (the ``SYNCBN_IMPL`` environment variable at each call).
            Default: ``None``.
        stats_mode: ``"N"`` (ranks weighed by their number of values) or ``"default"`` (every
            non-empty rank weighs the same). Default: ``"N"``.
        exchange: the registered exchange strategy, or ``"auto"`` (see
            :func:`~syncbn_lightning.functional.exchange.resolve_exchange`). Default: ``"auto"``.
        force_sync: take the synchronized path even in a group of one rank. Default: ``False``.
        unbiased_running_var: update ``running_var`` with the unbiased group variance. Default:
            ``True``.

    Any field may be :data:`KEEP`: the options are then overrides, applied to a layer's own with
    :meth:`apply_to`; a layer's own options have no :data:`KEEP`.

    Raises:
        TypeError / ValueError: naming the argument and the accepted values.

    Example:
        >>> from syncbn_lightning.functional import KEEP, SyncOptions
        >>> layer = SyncOptions(momentum=0.01)
        >>> SyncOptions(momentum=KEEP, stats_mode="default").apply_to(layer).momentum
        0.01
    """

    momentum: float | None = 0.1
    eps: float = 1e-5
    impl: str | None = None
    stats_mode: str = "N"
    exchange: str = "auto"
    force_sync: bool = False
    unbiased_running_var: bool = True

    def __post_init__(self) -> None:
        _validate(self)

    def replace(self, **changes: Any) -> SyncOptions:
        """These options with ``changes`` (validated: a new object is made)."""
        return dataclasses.replace(self, **changes)

    def trusted_replace(self, **changes: Any) -> SyncOptions:
        """These options with ``changes`` that are already valid (e.g. ``force_sync`` flipped by
        the library itself): not checked again."""
        return _trusted(**{**{f: getattr(self, f) for f in _FIELDS}, **changes})

    def apply_to(self, base: SyncOptions) -> SyncOptions:
        """``base`` with this object's fields that are not :data:`KEEP` (both already validated,
        so nothing is checked again)."""
        values = {f: getattr(self, f) for f in _FIELDS}
        return _trusted(**{f: getattr(base, f) if v is KEEP else v for f, v in values.items()})

    @staticmethod
    def of_layer(momentum: Any, eps: Any, **rest: Any) -> SyncOptions:
        """The defaults with a BatchNorm layer's own ``momentum``, ``eps`` (and ``rest``), as they
        are: torch accepted them (or an earlier version of this layer did), and the converter
        keeps them unless told otherwise."""
        return _trusted(**{**_DEFAULTS, "momentum": momentum, "eps": eps, **rest})

    def check_complete(self) -> None:
        """Raise a ValueError if a field is :data:`KEEP` (options a layer can run with)."""
        kept = [f for f in _FIELDS if getattr(self, f) is KEEP]
        if kept:
            raise ValueError(f"a layer's SyncOptions need every field, got KEEP for {kept}")


_FIELDS = tuple(f.name for f in dataclasses.fields(SyncOptions))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SyncOptions)}


def _trusted(**values: Any) -> SyncOptions:
    """A :class:`SyncOptions` of values validated before, made without validating them again."""
    options = object.__new__(SyncOptions)
    for name, value in values.items():
        object.__setattr__(options, name, value)
    return options


def _validate(options: SyncOptions) -> None:
    """Check every field that is not :data:`KEEP` (normalizing ``impl``); each failure names the
    argument and the fix."""
    momentum, eps = options.momentum, options.eps
    if eps is not KEEP:
        _check_eps(eps)
        object.__setattr__(options, "eps", float(eps))
    if momentum is not KEEP and momentum is not None:
        _check_momentum(momentum)
        object.__setattr__(options, "momentum", float(momentum))
    if options.impl is not KEEP:
        object.__setattr__(options, "impl", check_impl(options.impl))
    if options.stats_mode is not KEEP:
        check_stats_mode(options.stats_mode)
    if options.exchange is not KEEP:
        check_exchange(options.exchange)
    for flag in ("force_sync", "unbiased_running_var"):
        if getattr(options, flag) is not KEEP:
            object.__setattr__(options, flag, bool(getattr(options, flag)))


def _check_eps(eps: Any) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float > 0, got {type(eps).__name__} {eps!r}")
    if not eps > 0 or math.isinf(eps):
        raise ValueError(f"eps must be a finite float > 0 (e.g. 1e-5), got {eps}")


def _check_momentum(momentum: Any) -> None:
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


def check_stats_mode(stats_mode: Any) -> str:
    """``stats_mode`` if it is one of :data:`STATS_MODES`, else a ValueError naming them."""
    if stats_mode not in STATS_MODES:
        raise ValueError(
            f"stats_mode must be 'N' (ranks weighed by their number of samples: the statistics "
            f"of the concatenated batch) or 'default' (every non-empty rank weighs the same), "
            f"got {stats_mode!r}"
        )
    return str(stats_mode)
