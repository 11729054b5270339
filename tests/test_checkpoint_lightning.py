"""Activation checkpointing inside a LightningModule's forward, with SyncBNCallback converting its
layers under DDP (2 gloo ranks): the fit equals the same fit unchecked, and every layer counts
each step once."""

from __future__ import annotations

import pytest
from _lightning import BNNet, CheckpointedBNNet, fit_ranks
from _numerics import rel_err

from syncbn_lightning import SyncBNCallback

# Real Trainers on 2 gloo processes (20-40 s each on 2 cores): outside the fast check.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_a_checkpointed_lightning_module_fits_as_the_unchecked_one(tmp_path) -> None:
    steps = 4
    runs = {
        name: fit_ranks(
            tmp_path,
            name,
            2,
            [SyncBNCallback(log_every_n_steps=1)],
            model=model(batch_size=[3, 2]),
            max_steps=steps,
        )
        for name, model in (("checked", CheckpointedBNNet), ("plain", BNNet))
    }
    for checked, plain in zip(runs["checked"], runs["plain"], strict=True):
        assert checked["sync_layers"] == plain["sync_layers"] == 2
        for key, value in plain["state"].items():
            if key.endswith("num_batches_tracked"):
                assert int(checked["state"][key]) == int(value) == steps, key
            else:
                assert rel_err(checked["state"][key], value) <= 1e-6, key
