"""``syncbn-train`` and ``python train.py``: check the command line's config, then run the job.

The check (:func:`.checks.check_command_line`) needs neither Lightning nor W&B, so a bad config
gets its one line and exit code 2 in about a second, before the seconds of importing them and
before Hydra creates the job's directory. Only then is the service (:mod:`.train`) imported and
Hydra's ``@hydra.main`` run. A rank started by the service's launcher skips the check: its config
is the job's, checked already.
"""

from __future__ import annotations

import os
import sys

from .config.checks import check_command_line, exit_on_config_error
from .launch import RANK_CONFIG_ENV

__all__ = ["entry"]


def entry() -> None:
    """``syncbn-train`` / ``python train.py``: a job (Hydra), or one of its ranks when started by
    the launcher."""
    if not os.environ.get(RANK_CONFIG_ENV):
        with exit_on_config_error():
            check_command_line(sys.argv[1:])
    from . import train  # Lightning, W&B, the models: seconds of imports

    train.entry()


if __name__ == "__main__":
    entry()
