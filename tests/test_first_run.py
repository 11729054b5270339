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
import threading
import time
from pathlib import Path
from typing import Any

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


# ------------------------------------------------------------------------------------------------
# The node's other ranks start once a core is free of the first build (app/kernels.py)
# ------------------------------------------------------------------------------------------------


def _build_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int) -> Any:
    """A KernelBuild whose build directory is ``tmp_path`` and whose build runs until the test
    writes ``done``, on a machine of ``cores`` cores; its ninja file names two units."""
    from syncbn_lightning.app import kernels

    def build() -> float:
        while not (tmp_path / "done").exists():
            time.sleep(0.01)
        return 1.5

    monkeypatch.setattr(kernels, "prepare_kernels", lambda cfg: build())
    monkeypatch.setattr(kernels, "_cores", lambda: cores)
    monkeypatch.setattr(ops_build, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(kernels, "POLL_S", 0.01)
    return kernels.KernelBuild(_cfg())


def _write_ninja(directory: Path) -> None:
    """The build's ninja file, whole at once (the waiter polls it every 10 ms: a file read half
    written would name one unit of the two)."""
    (directory / "build.ninja.part").write_text(
        "build unity_kernels.o: compile unity_kernels.cpp\n"
        "build unity_operators.o: compile unity_operators.cpp\n"
        "build ext.so: link unity_kernels.o unity_operators.o\n"
    )
    os.replace(directory / "build.ninja.part", directory / "build.ninja")


def test_the_other_ranks_wait_while_every_core_compiles(tmp_path: Path, monkeypatch) -> None:
    """2 cores: no ninja file yet, then two units compiling: the wait goes on; once one unit's
    object is written, a core is free and it returns; result() waits for the build's end."""
    kernels = _build_in(tmp_path, monkeypatch, cores=2)
    waiter = threading.Thread(target=kernels.wait_for_a_free_core)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and kernels.compiling() is None
    _write_ninja(tmp_path)
    waiter.join(0.3)
    assert waiter.is_alive() and kernels.compiling() == 2
    (tmp_path / "unity_kernels.o").write_bytes(b"")
    waiter.join(5.0)
    assert not waiter.is_alive() and kernels.compiling() == 1
    (tmp_path / "done").touch()
    assert kernels.result() == 1.5


def test_a_ninja_file_read_while_written_counts_as_not_begun(tmp_path, monkeypatch) -> None:
    """torch writes ``build.ninja`` in place: read between its truncation and its text, it names
    no unit, and the wait must not take that for a free core."""
    kernels = _build_in(tmp_path, monkeypatch, cores=2)
    (tmp_path / "build.ninja").write_text("")
    assert kernels.compiling() is None
    _write_ninja(tmp_path)
    assert kernels.compiling() == 2
    (tmp_path / "done").touch()
    assert kernels.result() == 1.5


def test_with_more_cores_than_units_nothing_waits_for_a_unit(tmp_path, monkeypatch) -> None:
    kernels = _build_in(tmp_path, monkeypatch, cores=4)
    _write_ninja(tmp_path)
    started = time.perf_counter()
    kernels.wait_for_a_free_core()
    assert time.perf_counter() - started < 5.0 and kernels.compiling() == 2
    (tmp_path / "done").touch()
    assert kernels.result() == 1.5


def test_an_earlier_builds_ninja_file_and_objects_do_not_count(tmp_path, monkeypatch) -> None:
    """Files older than the build (a directory an earlier, killed build left) say nothing: an
    old ninja file (torch rewrites it only when its text changes) leaves the wait to the build's
    end; a new one counts only this build's objects."""
    _write_ninja(tmp_path)
    (tmp_path / "unity_kernels.o").write_bytes(b"")
    old = time.time() - 60
    for name in ("build.ninja", "unity_kernels.o"):
        os.utime(tmp_path / name, (old, old))
    kernels = _build_in(tmp_path, monkeypatch, cores=2)
    assert kernels.compiling() is None
    _write_ninja(tmp_path)  # this build's ninja file: the old object is not this build's
    assert kernels.compiling() == 2
    (tmp_path / "done").touch()
    kernels.result()


def test_the_builds_error_is_raised_by_result(tmp_path: Path, monkeypatch) -> None:
    from syncbn_lightning.app import kernels

    def fail(cfg: Any) -> float:
        raise ops_build.ExtensionBuildError("the compiler failed")

    monkeypatch.setattr(kernels, "prepare_kernels", fail)
    build = kernels.KernelBuild(_cfg())
    build.wait_for_a_free_core()  # the thread ended: nothing to wait for
    # before the launcher starts a rank (app/train.py), and again from result()
    with pytest.raises(ops_build.ExtensionBuildError, match="the compiler failed"):
        build.raise_if_failed()
    with pytest.raises(ops_build.ExtensionBuildError, match="the compiler failed"):
        build.result()


def test_a_rank_that_died_ends_the_wait_and_the_way_out_waits_for_the_build(
    tmp_path: Path, monkeypatch
) -> None:
    """result(stop) raises once stop() is true (the launcher saw a rank die) while the build
    still runs; settle() then waits for the build to end, and raise_if_failed() says nothing
    of a build that is still running."""
    kernels = _build_in(tmp_path, monkeypatch, cores=2)
    kernels.raise_if_failed()
    with pytest.raises(RuntimeError, match="a rank of the job ended while the C\\+\\+ extension"):
        kernels.result(stop=lambda: True)
    threading.Timer(0.3, (tmp_path / "done").touch).start()
    started = time.perf_counter()
    kernels.settle()
    assert time.perf_counter() - started >= 0.2 and kernels.result() == 1.5
