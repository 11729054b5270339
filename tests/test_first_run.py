"""Layer 7: what a new user's first run shows (``syncbn_lightning.app.train.prepare_kernels``).

The C++ extension is built (or loaded from the cache) before ``trainer.fit``, with a line of its
own saying which and how long, so that the build is not inside training step 1 (where the
progress bar's ETA would extend it to the whole run) and is not printed into the bar's line.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _service import RENDEZVOUS_VARS
from hydra import compose, initialize_config_dir

from syncbn_lightning.app.train import prepare_kernels, train
from syncbn_lightning.ops import build as ops_build

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*overrides: str):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=["paths.output_dir=/unused", *overrides])


def test_prepare_kernels_loads_the_extension_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        seconds = prepare_kernels(_cfg())
    assert seconds is not None and seconds >= 0
    assert ops_build._ext_module is not None  # training step 1 finds it loaded
    ours = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: ")]
    assert len(ours) == 1, caplog.text
    assert "C++ extension" in ours[0] and f"{ops_build.build_dir()}" in ours[0]
    # the backend's own "ready in" line is folded into ours
    assert not [r for r in caplog.records if "ready in" in r.getMessage()]


@pytest.mark.parametrize("overrides", [["bn.implementation=ref"], ["bn=local", "bn.sync=false"]])
def test_prepare_kernels_does_nothing_without_the_extension(
    overrides: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail() -> None:
        raise AssertionError("load_extension must not be called")

    monkeypatch.setattr(ops_build, "load_extension", fail)
    assert prepare_kernels(_cfg(*overrides)) is None


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_sanity_recipe_learns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python train.py recipe=classifier_sanity`` as shipped (2 gloo ranks, SyncBN, 14 epochs)
    ends well above chance (1/3 on three classes); the former recipe ended at 0.36. About a
    minute on 2 cores."""
    for var in RENDEZVOUS_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(
        "recipe=classifier_sanity",
        "logger=none",
        f"paths.output_dir={tmp_path / 'out'}",
        f"paths.data_dir={tmp_path / 'data'}",
        "data.synthetic.progress=false",
        "trainer.enable_progress_bar=false",
    )
    metrics = train(cfg)
    assert metrics["val/acc"] > 0.6, metrics
    assert metrics["bn/norm_batch_size"] == 32  # SyncBN over both ranks' 16 images


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_first_run_builds_before_the_progress_bar(tmp_path: Path) -> None:
    """A fresh build cache, as on a new machine: the build announcement and the result line come
    before the first progress bar, each on a line of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "SYNCBN_RANK_CONFIG")}
    env.update(SYNCBN_CACHE_DIR=str(tmp_path / "cache"), WANDB_SILENT="true")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "logger=none",
            f"paths.data_dir={tmp_path / 'data'}",
            f"hydra.run.dir={tmp_path / 'run'}",
            "data.synthetic.num_train=8",
            "data.synthetic.num_val=4",
            "data.synthetic.progress=false",
            "trainer.max_epochs=1",
            "bn.precise_bn_batches=1",
            "trainer.enable_progress_bar=true",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream: the order of log lines and bar updates
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.replace("\r", "\n").splitlines()
    announce = next(i for i, line in enumerate(lines) if "compiling the C++" in line)
    done = next(i for i, line in enumerate(lines) if "kernels: C++ extension compiled" in line)
    # tqdm's bar ("Epoch 0: ...") or, where `rich` is installed, Lightning's rich one ("Epoch 0/0").
    bar = next(i for i, line in enumerate(lines) if re.search(r"Epoch 0[:/]", line))
    assert announce < done < bar
    for i in (announce, done):  # log lines of their own, not glued to a bar update
        assert lines[i].startswith("[") and "it/s" not in lines[i], lines[i]
