"""Layer 6: what SyncBNCallback logs and keeps in checkpoints, with real Lightning Trainers on
real gloo ranks: bn/* metrics written by Lightning in the rows of the module's own metrics and in
``trainer.callback_metrics``, W&B offline runs, non-finite batches, the single-process monitor
mode, and the callback state across resumes (also with another ``group_size``).
"""

from __future__ import annotations

import csv
import glob
import os

import lightning.pytorch as pl
import pytest
import torch
from _lightning import (
    BNNet,
    NaNBatchNet,
    bn_state,
    fit_ranks,
    quiet_trainer,
    trainer,
)
from _numerics import rel_err
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from syncbn_lightning import SyncBatchNorm, SyncBNCallback
from syncbn_lightning.app.report import find_metrics_files, read_metrics

# Real Trainers on several gloo processes: outside the fast check.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _csv_rows(save_dir: str, key: str = "bn/global_batch_size") -> list[dict[str, str]]:
    """The CSVLogger rows under ``save_dir`` that hold ``key``."""
    (path,) = glob.glob(os.path.join(save_dir, "**", "metrics.csv"), recursive=True)
    with open(path) as f:
        return [row for row in csv.DictReader(f) if row.get(key)]


def test_batch_sizes_and_drift_in_csv_logger(tmp_path):
    # Rank 0 takes batches of 3, rank 1 of 2, over 4 samples each: steps of 3+2 then 1+2.
    # "local" (groups of one rank): the norm batch is the smallest rank's, and the train/test
    # gap is still measured (one-rank groups take the synchronized path to record their stats).
    runs = {
        "plain": ({}, {}, [5.0, 3.0, 5.0, 3.0], [5.0, 3.0, 5.0, 3.0]),
        "accum": ({}, {"accumulate_grad_batches": 2}, [8.0, 8.0], [3.0, 3.0]),
        # normalize="step": the second micro-batch normalizes over both (5 + 3)
        "accum_step": (
            {"step_statistics": "step"},
            {"accumulate_grad_batches": 2},
            [8.0, 8.0],
            [8.0, 8.0],
        ),
        "local": ({"group_size": 1}, {}, [5.0, 3.0, 5.0, 3.0], [2.0, 1.0, 2.0, 1.0]),
    }
    for name, (cb_args, extra, want_global, want_norm) in runs.items():
        logger = CSVLogger(str(tmp_path / f"logs_{name}"))
        ranks = fit_ranks(
            tmp_path,
            name,
            2,
            [SyncBNCallback(**cb_args)],
            BNNet(batch_size=[3, 2], n=8),
            max_epochs=2,
            max_steps=-1,
            logger=logger,
            log_every_n_steps=1,
            **extra,
        )
        rows = _csv_rows(str(tmp_path / f"logs_{name}"))
        # Written by Lightning with the module's own metrics: the same rows, steps and epochs.
        loss_steps = [r["step"] for r in _csv_rows(str(tmp_path / f"logs_{name}"), "train_loss")]
        assert [r["step"] for r in rows] == loss_steps, name
        assert all(r["epoch"] != "" for r in rows), name
        assert ranks[0]["trainer_callback_metrics"]["bn/global_batch_size"] == want_global[-1]
        assert ranks[1]["trainer_callback_metrics"]["bn/samples_seen"] == 16.0
        assert [float(r["bn/global_batch_size"]) for r in rows] == want_global, name
        assert [float(r["bn/norm_batch_size"]) for r in rows] == want_norm, name
        if name.startswith("accum"):  # micro-batches of 3+2, then 1+2 samples
            last = 3.0 if name == "accum" else 8.0
            assert [float(r["bn/norm_batch_size_first"]) for r in rows] == [5.0, 5.0]
            assert [float(r["bn/norm_batch_size_last"]) for r in rows] == [last, last]
        else:  # logged only under accumulation
            assert not rows[-1].get("bn/norm_batch_size_first"), name
        assert float(rows[-1]["bn/samples_seen"]) == 16.0
        last = rows[-1]
        for metric in ("drift_mean", "drift_var", "gap_mean", "gap_std", "divergence"):
            assert f"bn/{metric}_max" in last and f"bn/{metric}_avg" in last, metric
        if name != "local":
            assert float(last["bn/divergence_max"]) == 0.0  # one group: identical running stats
        assert float(last["bn/drift_mean_max"]) > 0.0
        assert float(last["bn/gap_std_avg"]) > 0.0


def test_wandb_offline_run_holds_metrics(tmp_path, monkeypatch):
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="syncbn-test")
    try:
        fit_ranks(
            tmp_path,
            "wandb",
            2,
            [SyncBNCallback()],
            max_steps=2,
            logger=logger,
            log_every_n_steps=1,
        )
    finally:
        # Rank 0 is this process: its run stays wandb.run (a later WandbLogger would reuse it).
        wandb.finish()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    with open(run_file, "rb") as f:
        blob = f.read()
    for key in (b"bn/global_batch_size", b"bn/norm_batch_size", b"bn/drift_mean_max"):
        assert key in blob, key
    assert b"bn/layers/gap_mean" in blob  # per-layer histogram
    assert b"bn/layers" in blob


def test_resume_mid_fit_continues_and_checkpoint_loads_into_plain_model(tmp_path):
    # 8 samples over 2 ranks taking batches of 3 and 2: steps of 3+2 and 1+2 samples, 2 per epoch.
    # Stop after epoch 1, resume for epoch 2. Measured at steps 1 and 4 only, so the checkpoint
    # falls between measurements with unequal per-rank counts (1 and 2) not yet logged.
    ckpt_dir = tmp_path / "ckpt"
    first = ModelCheckpoint(dirpath=str(ckpt_dir), save_top_k=-1)
    epochs = {"max_steps": -1, "max_epochs": 1}
    fit_ranks(
        tmp_path,
        "first",
        2,
        [SyncBNCallback(log_every_n_steps=4), first],
        BNNet(batch_size=[3, 2], n=8),
        enable_checkpointing=True,
        **epochs,
    )
    (ckpt,) = glob.glob(str(ckpt_dir / "*.ckpt"))
    epochs["max_epochs"] = 2
    resumed = fit_ranks(
        tmp_path,
        "resumed",
        2,
        [SyncBNCallback(log_every_n_steps=4, revert_on_fit_end=True)],
        BNNet(batch_size=[3, 2], n=8),
        ckpt_path=ckpt,
        **epochs,
    )
    straight = fit_ranks(
        tmp_path,
        "straight",
        2,
        [SyncBNCallback(log_every_n_steps=4)],
        BNNet(batch_size=[3, 2], n=8),
        **epochs,
    )
    for key, value in straight[0]["state"].items():
        assert rel_err(resumed[0]["state"][key].double(), value.double()) <= 1e-6, key
    metrics = resumed[0]["callback_metrics"]["SyncBNCallback"]
    assert metrics["bn/samples_seen"] == 16.0  # 2 epochs x 8 samples, across the resume
    assert metrics == pytest.approx(straight[0]["callback_metrics"]["SyncBNCallback"])
    checkpoint = torch.load(ckpt, weights_only=False)
    plain = BNNet()
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    assert type(plain.net[1]) is nn.BatchNorm2d
    assert checkpoint["callbacks"]
    assert resumed[0]["fit_end_bn_classes"] == ["BatchNorm2d", "BatchNorm2d"]


def test_nan_batch_is_skipped_counted_and_logged(tmp_path):
    logger = CSVLogger(str(tmp_path / "logs"))
    ranks = fit_ranks(
        tmp_path,
        "nan",
        2,
        [SyncBNCallback()],
        NaNBatchNet(nan_batch=1, n=16),
        max_steps=3,
        logger=logger,
        log_every_n_steps=1,
    )
    rows = _csv_rows(str(tmp_path / "logs"))
    # Step 1 is measured before the NaN batch; both BN layers then skip it (the NaN spreads).
    assert [float(r["bn/nonfinite_skipped"]) for r in rows] == [0.0, 2.0, 2.0]
    for rank in ranks:
        stats = bn_state(rank["state"])
        assert stats and all(torch.isfinite(v).all() for v in stats.values())


def test_nan_batch_raises_on_every_rank_with_on_nonfinite_raise(tmp_path):
    with pytest.raises(Exception, match=r"2 running-stat update\(s\) skipped .*net\.1 \(1x\)"):
        trainer(2, [SyncBNCallback(log_every_n_steps=1, on_nonfinite="raise")], max_steps=3).fit(
            NaNBatchNet(nan_batch=1, n=16)
        )


def test_single_device_monitor_logs_the_batch_and_keeps_plain_bn_numerics(tmp_path):
    """single_process="monitor": a one-process reference run gets the bn/* metrics of DDP runs,
    and its layers compute what plain BatchNorm computes."""
    plain, monitored = BNNet(batch_size=4), BNNet(batch_size=4)
    cb = SyncBNCallback(single_process="monitor", precise_bn_batches=2)
    for model, callbacks, logger in (
        (plain, [], False),
        (monitored, [cb], CSVLogger(str(tmp_path), name="csv")),
    ):
        quiet_trainer(
            callbacks=callbacks,
            default_root_dir=str(tmp_path),
            limit_val_batches=0,
            max_steps=3,
            logger=logger,
            log_every_n_steps=1,
        ).fit(model)
    assert isinstance(monitored.net[1], SyncBatchNorm) and monitored.net[1].force_sync
    assert cb.resolved_group_size == 1
    series = read_metrics(find_metrics_files(tmp_path)[0])
    assert [v for _, v in series["bn/norm_batch_size"]] == [4.0, 4.0, 4.0]
    assert [v for _, v in series["bn/global_batch_size"]] == [4.0, 4.0, 4.0]
    assert "bn/gap_std_max" in series and "bn/drift_mean_max" in series
    # Same weights after 3 steps as plain BN (up to float rounding of the two kernels).
    for a, b in zip(plain.parameters(), monitored.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_resume_with_another_group_size_keeps_the_state_and_warns(tmp_path, capfd):
    """The state key does not depend on the settings: samples_seen continues across a resume
    with another group_size, and the change is said once."""
    ckpt_dir = tmp_path / "ckpt"
    saver = ModelCheckpoint(dirpath=str(ckpt_dir), save_top_k=-1, every_n_train_steps=2)
    fit_ranks(
        tmp_path,
        "first",
        2,
        [SyncBNCallback(group_size=1), saver],
        max_steps=2,
        enable_checkpointing=True,
        log_every_n_steps=2,
    )
    (ckpt,) = glob.glob(str(ckpt_dir / "*.ckpt"))
    assert list(torch.load(ckpt, weights_only=False)["callbacks"]).count("SyncBNCallback") == 1
    capfd.readouterr()
    resumed = fit_ranks(
        tmp_path, "resumed", 2, [SyncBNCallback()], max_steps=4, ckpt_path=ckpt, log_every_n_steps=2
    )
    err = capfd.readouterr().err
    assert (
        err.count(
            "resuming a run that normalized over groups of 1 of 2 ranks with groups of 2 of 2"
        )
        == 1
    ), err
    # BNNet: 2 samples per rank and step, 4 steps in all (measured at step 4).
    assert resumed[0]["callback_metrics"]["SyncBNCallback"]["bn/samples_seen"] == 16.0


def test_checkpoint_without_callback_state_warns(tmp_path):
    ckpt = tmp_path / "plain.ckpt"
    first = quiet_trainer(default_root_dir=str(tmp_path), max_steps=1, limit_val_batches=0)
    first.fit(BNNet())
    first.save_checkpoint(str(ckpt))
    cb = SyncBNCallback(single_process="monitor")
    resumed = quiet_trainer(
        callbacks=[cb], default_root_dir=str(tmp_path), max_steps=2, limit_val_batches=0
    )
    with pytest.warns(UserWarning, match=r"the checkpoint holds no SyncBNCallback state"):
        resumed.fit(BNNet(), ckpt_path=str(ckpt))


def test_state_saved_under_the_settings_key_is_read():
    """Checkpoints of earlier versions keyed the state by the settings."""
    state = SyncBNCallback().state_dict()
    checkpoint = {"callbacks": {"SyncBNCallback{'group_size': 2}": state}}
    SyncBNCallback().on_load_checkpoint(None, None, checkpoint)  # type: ignore[arg-type]
    assert checkpoint["callbacks"]["SyncBNCallback"] is state


class _NoBatchNorm(BNNet):
    """BNNet with its BatchNorm layers replaced by identities."""

    def __init__(self) -> None:
        super().__init__()
        self.net[1] = nn.Identity()
        self.net[4] = nn.Identity()


class _FrozenBatchNorm(BNNet):
    """BNNet whose BatchNorm layers stay in eval mode while training (frozen BN)."""

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        for m in self.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


def test_model_without_batchnorm_is_told_so(tmp_path):
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False, enable_progress_bar=False
    )
    cb = SyncBNCallback()
    with pytest.warns(UserWarning, match=r"_NoBatchNorm has no BatchNorm layer .* does nothing"):
        cb.setup(trainer, _NoBatchNorm(), "fit")
    assert not cb._active


def test_frozen_batchnorm_logs_no_batch_size_and_says_why(tmp_path):
    cb = SyncBNCallback(single_process="monitor")
    trainer = quiet_trainer(
        callbacks=[cb],
        default_root_dir=str(tmp_path),
        limit_val_batches=0,
        max_steps=2,
        log_every_n_steps=1,
    )
    with pytest.warns(UserWarning, match=r"none of the 2 converted BatchNorm layers normalized"):
        trainer.fit(_FrozenBatchNorm())
    assert "bn/norm_batch_size" not in trainer.callback_metrics
    assert "bn/global_batch_size" not in cb.last_metrics
    assert "bn/nonfinite_skipped" in trainer.callback_metrics
