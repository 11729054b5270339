"""The service's config, checked in one home: ``checks.py`` (what needs neither torch, Lightning nor
W&B: run on the command line before any is imported), ``keys.py`` (unknown keys under ``bn``,
``trainer`` and ``data``, with the closest valid one) and ``jobs.py`` (the checks that build
the job's nodes, the config groups' builders, and the Hydra callback that validates every job of
a multirun before its first directory).

The checks' names are imported with the package (they register the configs' resolvers, and
import no torch); ``jobs.py``'s are loaded on first use (PEP 562), so that the command line's
check imports no Lightning. The configs' ``_target_`` strings
(``syncbn_lightning.app.config.bn_callback``, ``...ValidateJobs``) name them here.
"""

import importlib
from typing import Any

from .checks import (
    CONF_DIR,
    ConfigError,
    check_command_line,
    check_config,
    exit_on_config_error,
    global_batch,
    world,
)

__all__ = [
    "CONF_DIR",
    "ConfigError",
    "ValidateJobs",
    "ValidateSweep",
    "bn_callback",
    "build",
    "check_command_line",
    "check_config",
    "exit_on_config_error",
    "global_batch",
    "sweep_overrides",
    "validate",
    "world",
]

#: Loaded on first use: they import Lightning.
_LAZY = {"ValidateJobs", "ValidateSweep", "bn_callback", "build", "sweep_overrides", "validate"}


def __getattr__(name: str) -> Any:
    """``jobs.py``'s ``name`` (imported on first use, then kept here)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".jobs", __name__), name)
    globals()[name] = value
    return value
