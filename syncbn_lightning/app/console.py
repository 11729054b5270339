"""What the service prints: its own lines, without the third-party notices every run used to show.

Filtered here, for the service's processes only (``syncbn-train`` and the ranks it starts);
the library installs no filter (``tests/test_console.py`` checks both):

* Lightning's advertisement for its LitLogger (``💡 Tip: For seamless cloud logging ...``), which
  every Trainer without a LitLogger logs once;
* torch 2.13's ``FutureWarning`` that ``isinstance(treespec, LeafSpec)`` is deprecated, which
  Lightning 2.6's pytree helper triggers on every rank at fit start;
* W&B's run summary (about 30 lines of sparklines and last values at ``finish()``) and header
  lines: the W&B run is made with ``settings={"quiet": True}`` (:mod:`.loggers`; a config can
  set ``+logger.wandb.settings.quiet=false``); the job's own last lines say where the run's
  files are and how to upload them;
* W&B's warning that "the anonymous setting has no effect": Lightning's ``WandbLogger`` passes
  ``anonymous=None`` to ``wandb.init``; the service's logger drops that argument (:mod:`.loggers`).
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_third_party"]

#: The logger of Lightning's ``rank_zero_info``.
LIGHTNING_INFO_LOGGER = "lightning.pytorch.utilities.rank_zero"


class _DropLitLoggerTip(logging.Filter):
    """Drops Lightning's LitLogger advertisement, passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("💡 Tip:") and "litlogger" in message)


_TIP_FILTER = _DropLitLoggerTip()


def quiet_third_party() -> None:
    """Install the service's filters in this process (idempotent)."""
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
    )
    logger = logging.getLogger(LIGHTNING_INFO_LOGGER)
    if _TIP_FILTER not in logger.filters:
        logger.addFilter(_TIP_FILTER)
