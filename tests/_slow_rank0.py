"""A callback for the service's timeout test (``tests/test_timeouts.py``): rank 0 alone spends
``seconds`` at the end of every validation epoch, as it does evaluating COCO or writing files."""

from __future__ import annotations

import time

import lightning.pytorch as pl


class SlowRankZeroValidation(pl.Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            time.sleep(self.seconds)
