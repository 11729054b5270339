"""The checks of :class:`~syncbn_lightning.SyncBNCallback`'s arguments, without Lightning.

The callback runs :func:`check_callback_arguments` first thing in its constructor. It lives in a
module of its own that imports neither Lightning nor anything that does, so that a command line
(``syncbn-train bn.momentum=2``) is checked before the seconds of importing Lightning: the
service's config check calls it with the ``bn`` node's values and gets the callback's own
messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from ..distributed.group_sizes import DEFAULT_TARGET_NORM_BATCH, validate_group_size
from ..functional.options import KEEP, SyncOptions

__all__ = [
    "NONFINITE_ACTIONS",
    "STEP_STATISTICS",
    "PRECISE_AT",
    "SINGLE_PROCESS",
    "check_callback_arguments",
    "overrides",
]

NONFINITE_ACTIONS = ("warn", "raise", "ignore")
PRECISE_AT = ("fit_end", "validation")
SINGLE_PROCESS = ("leave", "monitor")
#: ``step_statistics=``: how a run with ``accumulate_grad_batches > 1`` updates the running
#: statistics and what its micro-batches normalize with (``None``: torch's way, an update per
#: micro-batch).
STEP_STATISTICS = ("micro", "step", None)


def overrides(
    momentum: float | None,
    eps: float | None,
    impl: str | None,
    stats_mode: str | None,
    exchange: str | None,
) -> SyncOptions:
    """The callback's and the plugin's settings as one validated :class:`SyncOptions` to apply to
    every layer: ``None`` keeps a layer's own momentum, eps, stats_mode and exchange; ``impl`` is
    set on every layer (``None``: the ``SYNCBN_IMPL`` environment variable)."""

    def keep(value: Any) -> Any:
        return KEEP if value is None else value

    return SyncOptions(
        momentum=keep(momentum),
        eps=keep(eps),
        impl=impl,
        stats_mode=keep(stats_mode),
        exchange=keep(exchange),
        force_sync=False,
        unbiased_running_var=KEEP,
    )


def _positive_int(name: str, value: Any, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_callback_arguments(
    group_size: Any = None,
    *,
    momentum: float | None = None,
    eps: float | None = None,
    impl: str | None = None,
    target_norm_batch: int = DEFAULT_TARGET_NORM_BATCH,
    log_every_n_steps: int | None = None,
    drift: bool = True,
    reconcile: bool = True,
    precise_bn_batches: int = 0,
    precise_bn_at: str = "fit_end",
    precise_bn_forward: Callable[..., Any] | None = None,
    revert_on_fit_end: bool = False,
    on_nonfinite: str = "warn",
    single_process: str = "leave",
    stats_mode: str | None = None,
    exchange: str | None = None,
    fuse_residual: bool | Sequence[Any] = False,
    flight_dir: Any = None,
    step_statistics: str | None = "micro",
) -> SyncOptions:
    """Check the arguments of :class:`~syncbn_lightning.SyncBNCallback` (the same names and
    defaults; ``tests/test_keys.py`` keeps the two signatures equal).

    Returns:
        The layers' settings (:func:`overrides` of ``momentum``, ``eps``, ``impl``,
        ``stats_mode`` and ``exchange``).

    Raises:
        TypeError / ValueError: naming the argument and the accepted values.
    """
    validate_group_size(group_size)
    if on_nonfinite not in NONFINITE_ACTIONS:
        raise ValueError(
            f"on_nonfinite must be one of {NONFINITE_ACTIONS} (what to do when a batch's "
            f"synchronized statistics are NaN/inf), got {on_nonfinite!r}"
        )
    if single_process not in SINGLE_PROCESS:
        raise ValueError(
            f"single_process must be one of {SINGLE_PROCESS} (what to do in a run of one "
            f"process: leave BatchNorm alone, or monitor it), got {single_process!r}"
        )
    if step_statistics not in STEP_STATISTICS:
        raise ValueError(
            f"step_statistics must be 'micro' (one running-statistics update per optimizer "
            f"step under accumulate_grad_batches), 'step' (the same, each micro-batch "
            f"normalized over the step so far) or None (torch's update per micro-batch), "
            f"got {step_statistics!r}"
        )
    options = overrides(momentum, eps, impl, stats_mode, exchange)
    _positive_int("target_norm_batch", target_norm_batch)
    _positive_int("log_every_n_steps", log_every_n_steps, allow_none=True)
    _positive_int("precise_bn_batches", precise_bn_batches, minimum=0)
    if precise_bn_at not in PRECISE_AT:
        raise ValueError(f"precise_bn_at must be one of {PRECISE_AT}, got {precise_bn_at!r}")
    if precise_bn_forward is not None and not callable(precise_bn_forward):
        raise TypeError("precise_bn_forward must be a callable fn(module, batch)")
    _check_fuse_residual(fuse_residual)
    if flight_dir is not None and not isinstance(flight_dir, (str, os.PathLike)):
        raise TypeError(
            f"flight_dir must be a folder's path (str or os.PathLike) or None (the trainer's log "
            f"folder), got {flight_dir!r}"
        )
    return options


def _check_fuse_residual(value: Any) -> None:
    """``fuse_residual``'s type: a bool, or a list of block classes or their import paths (the
    paths are imported, and the classes checked, where the callback is made)."""
    if isinstance(value, bool):
        return
    entries_ok = isinstance(value, Sequence) and not isinstance(value, (str, bytes))
    if entries_ok and all(isinstance(entry, (str, type)) for entry in value):
        return
    raise TypeError(
        f"fuse_residual must be True, False or a list of residual block classes (or their "
        f"import paths, 'package.module.Class') to trace with torch.fx, got {value!r}"
    )
