"""Layer 6: SyncBNCallback and SyncBNLayerSync with real Lightning Trainers on real gloo ranks.

Multi-process runs use ``strategy="ddp_spawn"`` (Lightning's own spawn launcher) and, once, the
``ddp`` launcher in a subprocess. Each rank writes what it ended with through ``Probe``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from _lightning import (
    BNNet,
    bn_state,
    fit_ranks,
    load_ranks,
    make_data,
    quiet_trainer,
    single_process_reference,
    trainer,
)
from _numerics import rel_err
from torch import nn

from syncbn_lightning import SyncBNCallback, SyncBNLayerSync, update_bn_stats
from syncbn_lightning.distributed.group_sizes import auto_group_summary
from syncbn_lightning.distributed.groups import DEFAULT_TARGET_NORM_BATCH, resolve_group_size

# Real Trainers on several gloo processes (20-80 s each on 2 cores): outside the fast check.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


# ----------------------------------------------------------------------------- parity


def test_two_ranks_match_one_process_with_twice_the_batch(tmp_path):
    steps = 4
    synced = fit_ranks(
        tmp_path,
        "sync",
        2,
        [SyncBNCallback(log_every_n_steps=1)],
        model=BNNet(batch_size=2, build_in_configure_model=True),
        max_steps=steps,
    )
    local = fit_ranks(tmp_path, "local", 2, [], max_steps=steps)
    want = {f"net.{k}": v for k, v in single_process_reference(steps, 2, 2).state_dict().items()}
    for rank, got in enumerate(synced):
        assert got["sync_layers"] == 2, "layers built in configure_model were not converted"
        assert got["optimizer_holds_model_params"]
        for key, value in want.items():
            if key.endswith("num_batches_tracked"):
                assert int(got["state"][key]) == steps
            else:
                assert rel_err(got["state"][key], value) <= 1e-5, (rank, key)
    # Without the callback each rank normalizes its own 2 samples: measurably different.
    diffs = [rel_err(local[0]["state"][k], want[k]) for k in bn_state(want)]
    assert max(diffs) > 1e-2, diffs


def test_layer_sync_plugin_matches_callback(tmp_path):
    steps = 3
    plugin = fit_ranks(tmp_path, "plugin", 2, [], plugins=[SyncBNLayerSync()], max_steps=steps)
    want = {f"net.{k}": v for k, v in single_process_reference(steps, 2, 2).state_dict().items()}
    assert plugin[0]["sync_layers"] == 2
    for key, value in bn_state(want).items():
        assert rel_err(plugin[1]["state"][key], value) <= 1e-5, key


# ----------------------------------------------------------------------------- groups


def test_group_size_two_on_four_ranks(tmp_path):
    model = BNNet(batch_size=2, n=64)  # 8 steps per epoch: no epoch end within max_steps
    kept = fit_ranks(
        tmp_path, "kept", 4, [SyncBNCallback(group_size=2, reconcile=False)], model, max_steps=3
    )
    assert all(r["group_sizes"] == [2, 2] for r in kept)
    assert all(r["ddp_forward_sync_buffers"] is False for r in kept)
    stats = [bn_state(r["state"]) for r in kept]
    for key in stats[0]:
        assert torch.equal(stats[0][key], stats[1][key]), key  # shared inside the pair {0, 1}
        assert torch.equal(stats[2][key], stats[3][key]), key  # and inside {2, 3}
        assert rel_err(stats[0][key], stats[2][key]) > 1e-3, key  # different across pairs
    assert kept[0]["callback_metrics"]["SyncBNCallback"]["bn/divergence_max"] > 0
    # Documented semantics: after fit every rank holds the average of the groups' statistics.
    merged = fit_ranks(
        tmp_path, "merged", 4, [SyncBNCallback(group_size=2)], BNNet(2, n=64), max_steps=3
    )
    for key in stats[0]:
        want = torch.stack([s[key] for s in stats]).double().mean(0)
        for rank in range(4):
            assert rel_err(merged[rank]["state"][key], want) <= 1e-6, (rank, key)


def test_auto_group_size_and_small_batch_warning_once(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "always")  # spawned ranks: show every warning issued
    # 2 ranks x 2 samples: target 2 -> groups of 1 rank; no warning (norm batch 2 >= 2).
    small = fit_ranks(
        tmp_path,
        "auto1",
        2,
        [SyncBNCallback(group_size="auto", target_norm_batch=2, log_every_n_steps=1)],
        max_steps=3,
    )
    assert small[0]["group_sizes"] == [1, 1]
    assert small[0]["callback_metrics"]["SyncBNCallback"]["bn/norm_batch_size"] == 2
    # target 8 -> no divisor of 2 reaches 8: the whole world (4 samples), warned exactly once.
    big = fit_ranks(
        tmp_path,
        "auto2",
        2,
        [SyncBNCallback(group_size="auto", target_norm_batch=8, log_every_n_steps=1)],
        max_steps=3,
    )
    assert big[0]["group_sizes"] == [2, 2]
    err = capfd.readouterr().err
    assert err.count("below target_norm_batch=8") == 1, err
    assert "below target_norm_batch=2" not in err


# ----------------------------------------------------------------------------- PreciseBN


@pytest.mark.parametrize(
    ("at", "schedule"),
    [
        ("fit_end", {"max_steps": 3}),
        # One epoch of 8 steps, then one validation batch: PreciseBN runs with the final weights.
        ("validation", {"max_steps": -1, "max_epochs": 1, "limit_val_batches": 1}),
    ],
)
def test_precise_bn_gives_population_stats(tmp_path, at, schedule):
    got = fit_ranks(
        tmp_path,
        "precise",
        2,
        [SyncBNCallback(precise_bn_batches=100, precise_bn_at=at, momentum=0.3)],
        **schedule,
    )
    assert got[0]["momentum"] == [0.3, 0.3]  # restored after the PreciseBN pass
    model = BNNet()
    model.load_state_dict(got[0]["state"])
    x, _ = make_data()
    with torch.no_grad():
        first_bn_input = model.net[0](x).double()
    want_mean = first_bn_input.mean(dim=(0, 2, 3))
    want_var = first_bn_input.var(dim=(0, 2, 3))  # unbiased, over both ranks' 32 samples
    assert rel_err(got[0]["state"]["net.1.running_mean"], want_mean) <= 1e-5
    assert rel_err(got[1]["state"]["net.1.running_var"], want_var) <= 1e-5


def test_update_bn_stats_restores_momentum_and_modes_on_error():
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, momentum=None), nn.Dropout())
    net.eval()
    before = copy.deepcopy(net.state_dict())
    calls = []

    def forward(batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return net(batch)

    with pytest.raises(RuntimeError, match="boom"):
        update_bn_stats(net, [torch.randn(8, 4) for _ in range(4)], 4, forward=forward)
    assert net[1].momentum is None
    assert not any(m.training for m in net.modules())
    for key, value in before.items():
        assert torch.equal(net.state_dict()[key], value), key


# ----------------------------------------------------------------------------- errors, modes


def test_sync_batchnorm_true_is_refused_before_training(tmp_path):
    with pytest.raises(Exception, match=r"cannot be combined with Trainer\(sync_batchnorm=True\)"):
        trainer(2, [SyncBNCallback()], sync_batchnorm=True).fit(BNNet())


def test_group_size_that_does_not_divide_world_is_refused(tmp_path):
    with pytest.raises(Exception, match=r"group_size=3 .*does not divide the world size 2"):
        trainer(2, [SyncBNCallback(group_size=3)]).fit(BNNet())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"group_size": 0}, ValueError, "group_size must be >= 1"),
        ({"group_size": "world"}, TypeError, "group_size must be"),
        ({"group_size": 2.0}, TypeError, "group_size must be"),
        ({"momentum": 1.5}, ValueError, "momentum must be in"),
        ({"momentum": "0.1"}, TypeError, "momentum must be"),
        ({"eps": -1.0}, ValueError, "eps must be"),
        ({"target_norm_batch": 0}, ValueError, "target_norm_batch"),
        ({"log_every_n_steps": 0}, ValueError, "log_every_n_steps"),
        ({"precise_bn_batches": -1}, ValueError, "precise_bn_batches"),
        ({"precise_bn_at": "epoch"}, ValueError, "precise_bn_at"),
        ({"on_nonfinite": "skip"}, ValueError, "on_nonfinite must be one of"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        SyncBNCallback(**kwargs)


def test_plugin_refuses_auto():
    with pytest.raises(TypeError, match="group_size"):
        SyncBNLayerSync(group_size="auto")


def _one_process(tmp_path, callbacks, **kwargs) -> pl.Trainer:
    options = {"limit_val_batches": 0, "default_root_dir": str(tmp_path)}
    return quiet_trainer(callbacks=callbacks, **{**options, **kwargs})


def test_single_device_leaves_model_alone(tmp_path, caplog):
    model = BNNet()
    cb = SyncBNCallback()
    with caplog.at_level("INFO"):
        _one_process(tmp_path, [cb], max_steps=1).fit(model)
    assert type(model.net[1]) is nn.BatchNorm2d
    assert "nothing to synchronize" in caplog.text


@pytest.mark.parametrize(
    ("spec", "world", "per_node", "batch", "target", "want"),
    [
        (None, 8, 4, None, 32, 8),
        (2, 8, 4, None, 32, 2),
        ("node", 8, 4, None, 32, 4),
        ("auto", 8, 4, 4, 32, 8),
        ("auto", 8, 4, 4, 16, 4),
        ("auto", 8, 4, 16, 32, 2),
        ("auto", 8, 4, 64, 32, 1),
        ("auto", 6, 6, 2, 32, 6),
        ("auto", 6, 6, 4, 12, 3),
    ],
)
def test_resolve_group_size(spec, world, per_node, batch, target, want):
    assert resolve_group_size(spec, world, per_node, batch, target) == want


def test_ddp_popen_launcher_in_a_subprocess(tmp_path):
    """``strategy="ddp"`` re-runs the script for rank 1: run it as its own program."""
    script = tmp_path / "fit_ddp.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            from _lightning import BNNet, Probe, trainer
            from syncbn_lightning import SyncBNCallback
            if __name__ == "__main__":
                cb = SyncBNCallback(log_every_n_steps=1)
                trainer(2, [cb, Probe({str(tmp_path)!r})], strategy="ddp").fit(BNNet())
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = load_ranks(str(tmp_path), 2)
    assert [r["sync_layers"] for r in ranks] == [2, 2]
    for key, value in bn_state(ranks[0]["state"]).items():
        assert torch.equal(ranks[1]["state"][key], value), key
    assert ranks[0]["callback_metrics"]["SyncBNCallback"]["bn/global_batch_size"] == 4.0


def test_auto_summary_says_which_norm_batch_and_why() -> None:
    line = auto_group_summary(8, 2, 16, DEFAULT_TARGET_NORM_BATCH)
    assert line == (
        "SyncBNCallback: group_size='auto' -> normalization batch 16 (8 ranks x 2 samples): the "
        "smallest group of the 16 ranks reaching target_norm_batch=16 (the default: where "
        "BatchNorm's ImageNet accuracy stops falling, see docs/choosing-normalization.md)"
    )
    line = auto_group_summary(2, 2, 2, 32)
    assert line.endswith(
        "normalization batch 4 (2 ranks x 2 samples): no group of the 2 ranks reaches "
        "target_norm_batch=32: the whole world (set by you)"
    )


@pytest.mark.parametrize(("per_rank", "group"), [(8, 2), (2, 8), (4, 4), (16, 1), (1, 16)])
def test_auto_reaches_the_default_target_of_16(per_rank: int, group: int) -> None:
    """The default target: 8 images per process sync in pairs (16 images), 2 in groups of 8."""
    assert SyncBNCallback(group_size="auto").target_norm_batch == 16
    assert resolve_group_size("auto", 16, 8, per_rank_batch=per_rank) == group
