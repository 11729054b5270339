"""Failures of a running job, with real processes: a rank killed mid-training, a checkpoint write
killed half-way, where the rendezvous listens, and what a resume agrees to unpickle.

Jobs run as users run them (``python train.py ...`` subprocesses, our launcher, gloo); the tests
find the job's processes through ``/proc`` (children of the launcher, their environment, their
sockets). Every test kills whatever it started, whatever happened.
"""

from __future__ import annotations

import csv
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
from _service import RENDEZVOUS_VARS, TINY, listening_sockets
from hydra import compose, initialize_config_dir

import syncbn_lightning.app.train as app

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ABORT_S = 20  # launch.abort_after_s of the killed job: the bound on how long it may linger
# A short, quick job: the classifier on 16 training images (2 steps per epoch on 4 ranks); the
# tests set the epochs.
QUICK = [
    "model=classifier",
    "logger=csv",
    *(o for o in TINY if not o.startswith("trainer.max_epochs=")),
]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in RENDEZVOUS_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


# ----------------------------------------------------------------------------- /proc helpers


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(k) for k in task.read_text().split()]
        except OSError:
            pass
    return kids


def _descendants(pid: int) -> list[int]:
    found, todo = [], _children(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo += _children(child)
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie runs nothing; its parent just has not reaped it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        if _running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_for(predicate: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def _job_processes(mentioning: Iterable[str]) -> list[tuple[int, str]]:
    """Every process whose command line or environment mentions one of the strings."""
    hits = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
        except OSError:
            continue
        text = cmdline + " " + " ".join(f"{k}={v}" for k, v in _environ(pid).items())
        if _running(pid) and any(s in text for s in mentioning):
            hits.append((pid, cmdline))
    return hits


# ----------------------------------------------------------------------------- jobs


def _command(run: Path, data: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "train.py"),
        *QUICK,
        f"paths.data_dir={data}",
        f"hydra.run.dir={run}",
        *overrides,
    ]


def _env() -> dict[str, str]:
    env = {**os.environ, "WANDB_SILENT": "true"}
    env.pop("LOCAL_RANK", None)
    return env


def _start(run: Path, data: Path, *overrides: str) -> tuple[subprocess.Popen[bytes], Path]:
    """The job in the background; its stdout and stderr go to ``<run>.out`` / ``<run>.err``."""
    run.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{run}.out", "wb") as out, open(f"{run}.err", "wb") as err:
        job = subprocess.Popen(
            _command(run, data, *overrides), cwd=ROOT, env=_env(), stdout=out, stderr=err
        )
    return job, Path(f"{run}.err")


def _steps(run: Path) -> list[int]:
    """Global steps of the training rows of a job's CSV metrics."""
    steps = []
    for path in sorted((run / "csv").glob("version_*/metrics.csv")):
        with open(path) as f:
            steps += [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert steps, f"no training rows under {run / 'csv'}"
    return steps


# ----------------------------------------------------------------------------- killed rank


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkilled_rank_fails_the_job_fast_and_the_last_checkpoint_resumes(tmp_path: Path) -> None:
    run, data = tmp_path / "run", tmp_path / "data"
    job, err = _start(
        run, data, "trainer.devices=4", "trainer.max_epochs=1000", f"launch.abort_after_s={ABORT_S}"
    )
    pids = [job.pid]
    try:
        last = run / "checkpoints" / "last.ckpt"
        assert _wait_for(lambda: last.is_file() or job.poll() is not None, 180), "no checkpoint"
        assert job.poll() is None, err.read_text()[-3000:]
        ranks = {int(_environ(p).get("LOCAL_RANK", -1)): p for p in _children(job.pid)}
        assert sorted(ranks) == [1, 2, 3], ranks  # rank 0 is the launcher itself
        pids += _descendants(job.pid)
        os.kill(ranks[2], signal.SIGKILL)
        killed = time.monotonic()
        code = job.wait(timeout=ABORT_S + 60)
        took = time.monotonic() - killed
        gone = _wait_for(lambda: not any(_running(p) for p in pids), 5)
    finally:
        _kill(pids)
    stderr = err.read_text()
    message = next((line for line in stderr.splitlines() if "rank 2 " in line), "")
    print(f"SIGKILL of rank 2 -> exit code {code} after {took:.2f} s: {message}")  # (-s)
    assert code != 0
    assert took < ABORT_S + 5, f"the job took {took:.1f} s to exit after rank 2 died"
    assert "rank 2 was killed by SIGKILL" in stderr, stderr[-3000:]
    # The flight recorder's files outlive the killed rank: the log names each rank's last SyncBN
    # collective (or the first one rank 2 never issued).
    log = (run / "train.log").read_text()
    assert "SyncBN flight recorder" in log and "rank 2: " in log, log[-3000:]
    assert gone, [p for p in pids if _running(p)]
    config = run / ".syncbn" / "config.yaml"
    assert not _job_processes([str(run), str(config)])  # no process of the job anywhere

    before = torch.load(last, map_location="cpu", weights_only=True)
    epoch, step = before["epoch"], before["global_step"]
    assert step > 0
    resumed = tmp_path / "resumed"
    more = [f"ckpt_path={last}", f"trainer.max_epochs={epoch + 2}"]  # one more epoch
    proc = subprocess.run(
        _command(resumed, data, "trainer.devices=4", *more),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = torch.load(resumed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert after["epoch"] == epoch + 1 and after["global_step"] > step
    assert min(_steps(resumed)) >= step  # continued from the checkpoint, not from step 0


# A writer of ever newer "last.ckpt" files, SIGKILLed at varied moments by its parent, which then
# loads what is on disk. The writer saves with the CheckpointIO of the Trainer the service builds.
KILLED_WRITER = """
    import json, os, signal, sys, time
    from pathlib import Path
    import torch
    from hydra import compose, initialize_config_dir
    sys.path.insert(0, {root!r})
    from syncbn_lightning.app import train

    out = Path(sys.argv[1])
    with initialize_config_dir({conf!r}, version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={{out}}", "logger=none"])
    io = train._build_trainer(cfg, [], []).strategy.checkpoint_io
    target = out / "checkpoints" / "last.ckpt"
    weights = {{"w": torch.randn(24_000_000)}}  # 96 MB: a write takes a while
    io.save_checkpoint({{"state_dict": weights, "global_step": 0}}, target)
    tmpdir = Path(os.environ["TMPDIR"])
    rounds = []
    for delay in {delays!r}:
        pid = os.fork()
        if pid == 0:
            step = 1
            while True:
                io.save_checkpoint({{"state_dict": weights, "global_step": step}}, target)
                step += 1
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        left = [p.name for p in target.parent.iterdir() if p != target]
        left += [p.name for p in tmpdir.iterdir()]
        try:
            ckpt = torch.load(target, map_location="cpu", weights_only=True)
            loaded = ckpt["global_step"]
        except Exception as e:
            loaded = repr(e)[:200]
        rounds.append({{"delay": delay, "loaded": loaded, "leftovers": left}})
        for name in os.listdir(tmpdir):
            os.unlink(tmpdir / name)
    print(json.dumps({{"io": type(io).__name__, "rounds": rounds}}))
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_checkpoint_killed_while_written_leaves_a_loadable_last_ckpt(tmp_path: Path) -> None:
    # $TMPDIR on another filesystem when there is one (as /tmp on tmpfs with outputs on NFS):
    # a temporary file there cannot be renamed into place, only copied.
    shm = Path("/dev/shm")
    other_fs = shm.is_dir() and os.stat(shm).st_dev != os.stat(tmp_path).st_dev
    tmpdir = Path(shm / f"syncbn-test-{os.getpid()}") if other_fs else tmp_path / "tmp"
    tmpdir.mkdir()
    script = tmp_path / "writer.py"
    delays = [0.1 + 0.1 * i for i in range(12)]
    script.write_text(
        textwrap.dedent(KILLED_WRITER).format(root=str(ROOT), conf=str(CONF), delays=delays)
    )
    try:
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "out")],
            env={**_env(), "TMPDIR": str(tmpdir)},
            capture_output=True,
            text=True,
            timeout=150,
        )
    finally:
        for path in tmpdir.iterdir():
            path.unlink()
        tmpdir.rmdir()
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    rounds = report["rounds"]
    print(json.dumps(report, indent=1))  # for the record (-s)
    bad = [r for r in rounds if not isinstance(r["loaded"], int)]
    assert not bad, f"{report['io']}: a kill mid-write left a last.ckpt that does not load: {bad}"
    # The test proves something only if kills did land in the middle of writes.
    assert any(r["leftovers"] for r in rounds), rounds


# ----------------------------------------------------------------------------- rendezvous


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_single_node_job_listens_on_loopback_only(tmp_path: Path) -> None:
    run, data = tmp_path / "run", tmp_path / "data"
    job, err = _start(run, data, "trainer.devices=2", "trainer.max_epochs=2", "evaluate=false")
    pids = [job.pid]
    seen: dict[int, set[tuple[str, int]]] = {}
    master_port = None
    try:
        deadline = time.monotonic() + 200
        while job.poll() is None and time.monotonic() < deadline:
            tree = [job.pid, *_descendants(job.pid)]
            pids += [p for p in tree if p not in pids]
            for pid in tree:
                seen.setdefault(pid, set()).update(listening_sockets(pid))
                if master_port is None and "MASTER_PORT" in _environ(pid):
                    master_port = int(_environ(pid)["MASTER_PORT"])
            time.sleep(0.1)
        code = job.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        _kill(pids)
    assert code == 0, err.read_text()[-3000:]
    assert master_port is not None, "never saw a rank's environment"
    sockets = set().union(*seen.values())
    store = {addr for addr, port in sockets if port == master_port}
    print(f"MASTER_PORT {master_port}; LISTEN sockets of the job: {sorted(sockets)}")
    assert store, f"nothing of the job listened on MASTER_PORT {master_port}: {sockets}"
    assert store <= {"127.0.0.1", "::1"}, f"the rendezvous store listens on {store}"
    # Nothing else of the job (gloo's own listeners included) is reachable from outside either.
    assert {addr for addr, _ in sockets} <= {"127.0.0.1", "::1"}, sockets


# ----------------------------------------------------------------------------- weights_only


class _Payload:
    """Unpickling this runs ``os.makedirs(path)``: code a ``weights_only`` load never runs."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.makedirs, (self.path,))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_refuses_to_run_code_from_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch.load's default is weights_only=True, but this variable flips the default (not an
    # explicit weights_only=True): only a caller that asks for weights_only stays safe.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": _Payload(marker)}, evil)
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                *QUICK,
                "recipe=detection_large_batch",  # one process, no DDP
                "logger=none",
                f"paths.output_dir={tmp_path / 'out'}",
                f"paths.data_dir={tmp_path / 'data'}",
                f"ckpt_path={evil}",
            ],
        )
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        app.train(cfg)
    assert not marker.exists(), "resuming ran code stored in the checkpoint"


@pytest.mark.parametrize("value", ["0", "-5", "true", "soon"])
def test_bad_abort_after_s_is_a_config_error(tmp_path: Path, value: str) -> None:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"paths.output_dir={tmp_path / 'out'}",
                f"paths.data_dir={tmp_path / 'data'}",
                "data.synthetic.num_train=16",
                f"launch.abort_after_s={value}",
            ],
        )
    with pytest.raises(app.ConfigError, match=r"^launch.abort_after_s="):
        app.validate(cfg)
    assert not (tmp_path / "out").exists()
