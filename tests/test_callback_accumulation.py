"""``SyncBNCallback`` under ``Trainer(accumulate_grad_batches=K)``: the micro-batches of each
optimizer step run inside ``step_statistics`` by default (one running-statistics update per
step), and ``step_statistics=None`` keeps torch's K updates.

Real ``ddp_spawn`` Trainers on 2 CPU processes, checked against one process that runs every
rank's micro-batches itself (the same samples per micro-batch, the loss scaled by 1/K as
Lightning scales it); and the service, ``train.py trainer.accumulate_grad_batches=2
data.batch_size=1`` with ``bn.step_statistics`` on and off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _lightning import BNNet, fit_ranks, make_data, make_net
from _numerics import rel_err
from _service import RENDEZVOUS_VARS, tiny_cfg

import syncbn_lightning.app.train as app
from syncbn_lightning import SyncBNCallback, convert_sync_batchnorm, step_statistics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD, PER_RANK, ACCUMULATE, STEPS = 2, 2, 2, 2


def _reference(mode: str | None) -> dict[str, torch.Tensor]:
    """One process over what the ranks saw: micro-batch m of step s holds every rank's
    ``PER_RANK`` samples (``DistributedSampler(shuffle=False)``: rank r holds r, r + 2, ...),
    inside ``step_statistics(net, mode)`` (``None``: outside)."""
    x, y = make_data()
    net = convert_sync_batchnorm(make_net())  # no group: plain BatchNorm's maths
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    micro = 0
    for _ in range(STEPS):
        opt.zero_grad()
        context = step_statistics(net, mode) if mode is not None else _Nothing()
        with context:
            for _ in range(ACCUMULATE):
                rows = [(r, j) for r in range(WORLD) for j in range(PER_RANK)]
                idx = [(micro * PER_RANK + j) * WORLD + r for r, j in rows]
                (F.cross_entropy(net(x[idx]), y[idx]) / ACCUMULATE).backward()
                micro += 1
        opt.step()
    return {f"net.{k}": v for k, v in net.state_dict().items()}


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


@pytest.mark.parametrize("mode", ["micro", "step", None])
def test_one_update_per_optimizer_step_by_default(tmp_path, mode: str | None) -> None:
    callback = SyncBNCallback() if mode == "micro" else SyncBNCallback(step_statistics=mode)
    ranks = fit_ranks(
        tmp_path,
        str(mode),
        WORLD,
        [callback],
        model=BNNet(batch_size=PER_RANK),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
    )
    want = _reference(mode)
    updates = STEPS if mode is not None else STEPS * ACCUMULATE
    for rank, got in enumerate(ranks):
        for key, value in want.items():
            if key.endswith("num_batches_tracked"):
                assert int(got["state"][key]) == updates, (rank, key)
            elif key.endswith(("running_mean", "running_var", "weight", "bias")):
                assert rel_err(got["state"][key], value) <= 1e-5, (rank, key)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("key", "updates"), [("micro", 1), ("step", 1), ("null", 2)])
def test_the_service_takes_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, updates: int
) -> None:
    for var in RENDEZVOUS_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    overrides = ["trainer.devices=2", "trainer.max_steps=1", "logger=csv"]
    overrides += ["trainer.accumulate_grad_batches=2", "data.batch_size=1"]
    cfg = tiny_cfg(tmp_path, tmp_path / "data", *overrides, f"bn.step_statistics={key}")
    app.train(cfg)
    ckpt = torch.load(tmp_path / "out" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 1
    tracked = [v for k, v in ckpt["state_dict"].items() if k.endswith("num_batches_tracked")]
    assert tracked and all(int(t) == updates for t in tracked), tracked


def test_auto_group_size_counts_the_step_in_step_mode(tmp_path) -> None:
    # 2 ranks x 2 samples x 2 micro-batches, target 4: with normalize="step" one rank's step
    # reaches it (groups of 1 rank, each last call over 4 samples); without, 2 ranks would.
    callback = SyncBNCallback(
        group_size="auto", target_norm_batch=4, step_statistics="step", log_every_n_steps=1
    )
    ranks = fit_ranks(
        tmp_path,
        "auto_step",
        WORLD,
        [callback],
        model=BNNet(batch_size=PER_RANK),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
    )
    assert ranks[0]["group_sizes"] == [1, 1]
    assert ranks[0]["callback_metrics"]["SyncBNCallback"]["bn/norm_batch_size"] == 4
