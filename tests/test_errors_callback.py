"""Sections 7-8 of ``docs/errors.md``: ``SyncBNCallback`` and ``SyncBNLayerSync`` arguments, and
the callback with a Trainer.

Each test triggers the error of its row with the row's input and asserts the row's exception type
and message through :func:`_errors_doc.expect_row` (the doc is the one source of both). Trainer
errors come from ``SyncBNCallback.setup(trainer, module, "fit")`` on a real (not yet launched)
Trainer, which is what ``Trainer.fit`` runs on every rank before training.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from _errors_doc import clean_environment, expect_row
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn

from syncbn_lightning import SyncBNCallback, SyncBNLayerSync
from syncbn_lightning.distributed.groups import resolve_group_size


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher or cluster variables, the default kernels, W&B quiet."""
    clean_environment(monkeypatch)


class _BNModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _setup(callback: SyncBNCallback, **trainer_kwargs: object) -> None:
    """Run the callback's ``setup("fit")`` hook on a 2-process CPU Trainer, as fit does per rank."""
    options: dict[str, object] = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": "ddp_spawn",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(trainer_kwargs)
    trainer = pl.Trainer(callbacks=[callback], **options)
    callback.setup(trainer, _BNModule(), "fit")


# ----------------------------------------------------------------------------- 7. callback args


def test_callback_group_size_zero() -> None:
    with expect_row():
        SyncBNCallback(group_size=0)


def test_callback_group_size_unknown_name() -> None:
    with expect_row():
        SyncBNCallback(group_size="world")  # type: ignore[arg-type]


def test_callback_momentum_above_one() -> None:
    with expect_row():
        SyncBNCallback(momentum=1.5)


def test_callback_eps_negative() -> None:
    with expect_row():
        SyncBNCallback(eps=-1.0)


def test_callback_target_norm_batch_zero() -> None:
    with expect_row():
        SyncBNCallback(target_norm_batch=0)


def test_callback_log_every_n_steps_zero() -> None:
    with expect_row():
        SyncBNCallback(log_every_n_steps=0)


def test_callback_precise_bn_batches_negative() -> None:
    with expect_row():
        SyncBNCallback(precise_bn_batches=-1)


def test_callback_precise_bn_at_unknown() -> None:
    with expect_row():
        SyncBNCallback(precise_bn_at="epoch")  # type: ignore[arg-type]


def test_callback_on_nonfinite_unknown() -> None:
    with expect_row():
        SyncBNCallback(on_nonfinite="skip")  # type: ignore[arg-type]


def test_callback_single_process_unknown() -> None:
    with expect_row():
        SyncBNCallback(single_process="always")  # type: ignore[arg-type]


def test_callback_step_statistics_unknown() -> None:
    with expect_row():
        SyncBNCallback(step_statistics="batch")  # type: ignore[arg-type]


def test_callback_precise_bn_forward_not_callable() -> None:
    with expect_row():
        SyncBNCallback(precise_bn_forward=3)  # type: ignore[arg-type]


def test_callback_auto_without_batch_size() -> None:
    with expect_row():
        resolve_group_size("auto", 4, 4, per_rank_batch=None)


def test_callback_state_from_another_version() -> None:
    with expect_row():
        SyncBNCallback().load_state_dict({"version": 2})


def test_plugin_group_size_auto() -> None:
    with expect_row():
        SyncBNLayerSync(group_size="auto")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- 8. with a Trainer


def test_trainer_sync_batchnorm_true() -> None:
    with expect_row():
        _setup(SyncBNCallback(), sync_batchnorm=True)


def test_trainer_callback_and_plugin() -> None:
    with expect_row():
        _setup(SyncBNCallback(), plugins=[SyncBNLayerSync()])


def test_trainer_plugin_and_sync_batchnorm_true() -> None:
    with expect_row():
        _setup(SyncBNCallback(), plugins=[SyncBNLayerSync()], sync_batchnorm=True)


def test_trainer_strategy_not_ddp() -> None:
    with expect_row():
        _setup(SyncBNCallback(), strategy=ModelParallelStrategy())


def test_trainer_group_size_not_dividing_world() -> None:
    with expect_row():
        _setup(SyncBNCallback(group_size=3))


def test_trainer_broadcast_buffers_with_groups() -> None:
    strategy = DDPStrategy(broadcast_buffers=True, start_method="spawn")
    with expect_row():
        _setup(SyncBNCallback(group_size="auto"), strategy=strategy)
