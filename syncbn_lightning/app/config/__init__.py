"""The service's config, checked in one home: ``checks.py`` (what needs neither torch, Lightning nor
W&B: run on the command line before any is imported), ``keys.py`` (unknown keys under ``bn``,
``trainer`` and ``data``, with the closest valid one) and ``jobs.py`` (the checks that build
the job's nodes, the config groups' builders, and the Hydra callback that validates every job of
a multirun before its first directory).

Importing the package imports the checks (they register the configs' resolvers, and import no
torch). The ``_target_`` strings written before these files had a folder
(``syncbn_lightning.app.config.bn_callback``, ``...ValidateJobs``) still resolve: those names are
loaded from ``jobs.py`` on first use (PEP 562), so that the command line's check imports no
Lightning.
"""

import importlib
from typing import Any

from . import checks  # noqa: F401  (the configs' resolvers)

#: ``jobs.py``'s names, where earlier configs name them.
_JOBS = {"ValidateJobs", "ValidateSweep", "bn_callback", "build", "sweep_overrides", "validate"}


def __getattr__(name: str) -> Any:
    """``jobs.py``'s ``name`` (imported on first use, then kept here)."""
    if name not in _JOBS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".jobs", __name__), name)
    globals()[name] = value
    return value
