"""Layer 7: a bad config on the command line (``python train.py``, ``syncbn-train``) is refused
within a second, in one line, with exit code 2, and leaves nothing on disk.

The command runs as a user runs it, in a fresh interpreter from an empty working directory,
without ``hydra.run.dir``: a refused config must not leave the default ``outputs/<date>/<time>/``
behind. The check imports neither torch, Lightning nor W&B (``syncbn_lightning.app.config.checks``;
the package root and the library modules it reads import lazily); the second includes the
interpreter's start and Hydra's composition.

Two bounds (on the best of up to three runs where the first took a second). The wall time and the
CPU time stay under 1 s whenever the command did not wait for a CPU (its run-queue wait behind
other processes, from ``/proc/self/schedstat``, plus the time the hypervisor took from the virtual
CPUs, ``/proc/stat``'s steal, under a tenth of its wall time): on the idle 2-core
development machine it takes about 0.6-0.8 s of CPU, where one composition takes 0.6 s. That second
is a second of that machine: where one composition takes longer (CI's machines have been a quarter
slower, 0.75-0.83 s, and the check 1.01-1.06 s), the bound grows in proportion. On a loaded machine
(the fast suite must also pass with every core busy) the neighbours' share of the CPUs is not the
command's to bound, and its CPU time (user + system, the kernel's accounting of the child) grows
too: so there the CPU bound is relative, at most 2 times the CPU of Hydra composing the service's
config once, run the same way just before (the least any check of a command line does; the check
composes it once or twice). Importing torch as well, the mistake this guards against, costs another
2.2 s of CPU and fails it; the command's interpreter also reports whether torch was imported at
all.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from _service import RENDEZVOUS_VARS

from syncbn_lightning.app.config.checks import check_command_line

ROOT = Path(__file__).resolve().parents[1]

#: What the first check must not import (seconds each), and what it needs none of.
HEAVY_MODULES = ("torch", "lightning", "wandb", "matplotlib", "pycocotools", "PIL")


#: The check's CPU time, at most this many times Hydra's composing the config once (module
#: docstring): the check composes it once or twice and checks it.
FLOOR_FACTOR = 2.0

#: One composition's CPU seconds on the development machine, for which "within a second" is stated.
DEV_FLOOR_CPU = 0.62

#: Runs ``train.py`` (argv[2:]) and writes its main thread's run-queue wait, in ns, and whether
#: torch was imported, to argv[1].
_TIMED = """
import atexit, runpy, sys
def _waited(path):
    with open(path, "w") as f:
        f.write(open("/proc/self/schedstat").read().split()[1])
        f.write(" torch" if "torch" in sys.modules else " -")
atexit.register(_waited, sys.argv[1])
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass
class Timed:
    """A finished ``train.py`` command and its times in seconds."""

    returncode: int
    stdout: str
    stderr: str
    wall: float
    cpu: float
    waited: float
    stolen: float
    imported_torch: bool

    @property
    def cpu_was_there(self) -> bool:
        """Whether the command had a CPU whenever it could run: its run-queue wait plus the time
        the hypervisor took from the virtual CPUs under it, under a tenth of its wall time."""
        return self.waited + self.stolen < 0.1 * self.wall


def _steal_s() -> float:
    """The machine's stolen time so far (``/proc/stat``'s steal column: time a virtual CPU was
    runnable but the hypervisor ran something else), in seconds per CPU."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") / (os.cpu_count() or 1)


def _run_timed(cwd: Path, script: Path, *args: str) -> Timed:
    """``python SCRIPT ARGS`` in ``cwd``, timed."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}
    env.pop("SYNCBN_RANK_CONFIG", None)
    env.update(WANDB_SILENT="true", PYTHONPATH=str(ROOT))
    waited = cwd.parent / f"{cwd.name}.waited"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    steal_before = _steal_s()
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _TIMED, str(waited), str(script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    wall = time.perf_counter() - started
    stolen = _steal_s() - steal_before
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    ns, torch_flag = waited.read_text().split()
    return Timed(
        proc.returncode,
        proc.stdout,
        proc.stderr,
        wall,
        cpu,
        int(ns) / 1e9,
        stolen,
        torch_flag == "torch",
    )


def _train(cwd: Path, *args: str) -> Timed:
    """``python train.py ARGS`` in ``cwd``, timed."""
    return _run_timed(cwd, ROOT / "train.py", *args)


def _hydra_floor(tmp_path: Path) -> Timed:
    """Hydra composing the service's config once (the least any check of a command line does),
    run and timed as :func:`_train` runs ``train.py``."""
    script = tmp_path / "floor.py"
    script.write_text(
        "from hydra import compose, initialize_config_dir\n"
        f"with initialize_config_dir({str(ROOT / 'conf')!r}, version_base='1.3'):\n"
        "    compose('train')\n"
    )
    workdir = tmp_path / "floor"
    workdir.mkdir()
    return _run_timed(workdir, script)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bn.grup_size=2"], "unknown key bn.grup_size: did you mean bn.group_size?"),
        (["recipe=does_not_exist"], "recipe=does_not_exist: no such option of recipe: use one of "),
        (["bn.momentum=2"], "bn.momentum=2: momentum must be in [0, 1]"),
        (["bn.eps=-1"], "bn.eps=-1: eps must be a finite float > 0"),
        (["bn.group_size=3"], "bn.group_size=3: group_size=3 means 3 ranks per sync group"),
        (["model.norm=bogus"], "model.norm must be one of ('bn', 'gn', 'frozen_bn'), got 'bogus'"),
        (["launch.timeout_s=0"], "launch.timeout_s=0: use a positive number of seconds"),
    ],
    ids=["unknown_key", "unknown_recipe", "momentum", "eps", "group_size", "norm", "timeout"],
)
def test_a_bad_config_is_refused_in_1_s_in_one_line_leaving_nothing_without_torch(
    tmp_path: Path, args: list[str], message: str
) -> None:
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    floor = _hydra_floor(tmp_path)
    second = max(1.0, floor.cpu / DEV_FLOOR_CPU)  # a second of the development machine
    run = _train(workdir, *args)
    for _ in range(2):  # the best of up to 3 runs: a slow run or two are hiccups of the machine
        if max(run.cpu, run.wall) < second:
            break
        run = min(run, _train(workdir, *args), key=lambda r: max(r.cpu, r.wall))
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stdout == ""
    assert run.stderr.splitlines() == [run.stderr.rstrip("\n")], run.stderr  # one line
    assert run.stderr.startswith(f"error: {message}"), run.stderr
    assert list(workdir.iterdir()) == []  # no outputs/<date>/<time>/, no data
    assert not run.imported_torch
    times = (
        f"{run.wall:.2f} s wall, {run.cpu:.2f} s CPU, {run.waited:.2f} s waiting for a CPU, "
        f"{run.stolen:.2f} s stolen by the hypervisor; "
        f"one composition: {floor.cpu:.2f} s CPU"
    )
    assert run.cpu < FLOOR_FACTOR * floor.cpu, times
    if run.cpu_was_there:  # the absolute bounds
        assert run.cpu < second, f"{times}; bound {second:.2f} s"
        assert run.wall < second, f"{times}; bound {second:.2f} s"


@pytest.mark.slow
def test_a_value_only_the_model_checks_is_refused_before_any_directory(tmp_path: Path) -> None:
    """A value refused by a constructor (here the datamodule's) needs the heavy imports, and so
    is found later, but still before Hydra creates the run's directory."""
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    run = _train(workdir, "data.batch_size=0")
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr == "error: data.batch_size must be an int >= 1, got 0\n"
    assert list(workdir.iterdir()) == []


def test_the_command_line_check_imports_no_heavy_module() -> None:
    code = f"""
import json, sys
from syncbn_lightning.app.config.checks import check_command_line
check_command_line(["recipe=classifier_sanity", "bn.group_size=2", "trainer.devices=4"])
print(json.dumps([m for m in {HEAVY_MODULES!r} if m in sys.modules]))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == []


def test_syncbn_train_with_a_bad_key_imports_no_torch(tmp_path: Path) -> None:
    """``syncbn-train bn.grup_size=2``: the console script's entry refuses it without importing
    torch (or anything heavy)."""
    code = f"""
import atexit, json, sys
atexit.register(lambda: print(json.dumps([m for m in {HEAVY_MODULES!r} if m in sys.modules])))
sys.argv = ["syncbn-train", "bn.grup_size=2"]
from syncbn_lightning.app.cli import entry
entry()
"""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}
    env.pop("SYNCBN_RANK_CONFIG", None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr == "error: unknown key bn.grup_size: did you mean bn.group_size?\n"
    assert json.loads(done.stdout) == []
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["bn.group_size=2", "trainer.devices=4"],
        ["recipe=classifier_sanity", "logger=none"],
        ["bn=local,sync", "-m", "bn.momentum=0.2"],
        ["--help"],
        ["--cfg", "job", "bn.grup_size=2"],  # Hydra prints the config (and its own error)
    ],
)
def test_good_command_lines_pass(argv: list[str]) -> None:
    check_command_line(argv)
