"""The rank launcher (``syncbn_lightning.app.launch``) with real child processes: failures, kills,
the watchdog, reaping. The environment and the rendezvous are in ``test_launch_rendezvous.py``.

Children are tiny Python scripts written to ``tmp_path``; they report what they saw (their pid)
through files. Nothing is mocked: exit codes and kills are real.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _service import RENDEZVOUS_VARS, write_script

from syncbn_lightning.app.launch import RANK_CONFIG_ENV, RankLauncher


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No rendezvous variables inherited from the shell running the tests."""
    for key in (*RENDEZVOUS_VARS, RANK_CONFIG_ENV):
        monkeypatch.delenv(key, raising=False)


# A child that writes its pid to <dir>/pid<LOCAL_RANK>, then sleeps; local rank FAIL_RANK (if
# set) prints a line and exits with code 3 instead, local rank KILL_RANK SIGKILLs itself.
PID_CHILD = """
    import os, signal, sys, time
    from pathlib import Path
    rank = os.environ["LOCAL_RANK"]
    out = Path(sys.argv[1])
    (out / f"pid{rank}.tmp").write_text(str(os.getpid()))
    os.replace(out / f"pid{rank}.tmp", out / f"pid{rank}")
    if rank == os.environ.get("FAIL_RANK"):
        print(f"rank {rank} gives up", flush=True)
        sys.exit(3)
    if rank == os.environ.get("KILL_RANK"):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("SLEEP_S", "600")))
"""


def _pid_child(tmp_path: Path) -> list[str]:
    return [*write_script(tmp_path, "pid_child.py", PID_CHILD), str(tmp_path)]


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pids(tmp_path: Path, local_ranks, timeout: float = 10.0) -> list[int]:
    files = [tmp_path / f"pid{r}" for r in local_ranks]
    assert _wait_for(lambda: all(f.exists() for f in files), timeout), "children did not start"
    return [int(f.read_text()) for f in files]


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_failing_child_stops_the_others_and_is_reported(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAIL_RANK", "2")
    start = time.monotonic()
    launcher = RankLauncher(
        _pid_child(tmp_path), tmp_path / "cfg", devices=3, log_dir=tmp_path, grace_s=2
    )
    with pytest.raises(RuntimeError) as info:
        with launcher:
            (sleeper,) = _pids(tmp_path, [1])
            # The watchdog kills the healthy child while the parent is still inside the block
            # (so that a parent blocked in a collective fails fast).
            assert _wait_for(lambda: not _alive(sleeper) or _is_zombie(sleeper), timeout=5)
    message = str(info.value)
    assert "rank 2 failed with exit code 3" in message
    assert "rank 2 gives up" in message  # the tail of the failed child's log
    assert str(tmp_path / "rank2.log") in message
    assert not _alive(sleeper)  # killed and reaped
    assert time.monotonic() - start < 10


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_child_killed_by_a_signal_is_reported_with_the_signal_name(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KILL_RANK", "2")
    launcher = RankLauncher(
        _pid_child(tmp_path), tmp_path / "cfg", devices=3, log_dir=tmp_path, grace_s=2
    )
    with pytest.raises(RuntimeError) as info:
        with launcher:
            (sleeper,) = _pids(tmp_path, [1])
            assert _wait_for(lambda: not _alive(sleeper) or _is_zombie(sleeper), timeout=5)
    assert "rank 2 was killed by SIGKILL (exit code -9)" in str(info.value)
    assert str(tmp_path / "rank2.log") in str(info.value)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_parent_failing_because_a_child_died_reports_the_child(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KILL_RANK", "1")
    launcher = RankLauncher(_pid_child(tmp_path), tmp_path / "cfg", devices=3, log_dir=tmp_path)
    with pytest.raises(RuntimeError) as info:
        with launcher:
            (pid,) = _pids(tmp_path, [1])
            # As a broken gloo collective does: fail as soon as the peer is gone, usually before
            # the watchdog's next look at the children.
            while _alive(pid) and not _is_zombie(pid):
                time.sleep(0.001)
            raise ConnectionError("Connection closed by peer")
    assert "rank 1 was killed by SIGKILL (exit code -9)" in str(info.value)
    assert isinstance(info.value.__cause__, ConnectionError)  # the parent's own error, chained


# A parent that stays busy (no collective to fail) after one of its children died.
STUCK_PARENT = """
    import sys, time
    sys.path.insert(0, {root!r})
    from syncbn_lightning.app.launch import RankLauncher
    command, out = {command!r}, {out!r}
    with RankLauncher(command, out + "/cfg", devices=3, log_dir=out, abort_after_s={abort!r}):
        time.sleep(600)
"""


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_parent_stuck_after_a_child_died_is_ended_after_abort_after_s(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("FAIL_RANK", "2")
    root = str(Path(__file__).resolve().parents[1])
    script = STUCK_PARENT.format(
        root=root, command=_pid_child(tmp_path), out=str(tmp_path), abort=1.0
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=50
    )
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    assert (
        "rank 2 failed with exit code 3; this process (local rank 0) did not stop within 1 s "
        "(launch.abort_after_s)" in proc.stderr
    ), proc.stderr
    assert took < 20  # imports + 1 s, not the parent's 600 s sleep
    pids = _pids(tmp_path, [1, 2])
    assert not any(_alive(pid) for pid in pids)  # killed, and reaped before the end


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_children_die_with_a_killed_parent(tmp_path) -> None:
    root = str(Path(__file__).resolve().parents[1])
    script = STUCK_PARENT.format(
        root=root, command=_pid_child(tmp_path), out=str(tmp_path), abort=None
    )
    pids: list[int] = []

    def running() -> list[int]:  # orphans are reaped by whoever adopts them: zombies are gone
        return [p for p in pids if _alive(p) and not _is_zombie(p)]

    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)])
    try:
        pids = _pids(tmp_path, [1, 2], timeout=30)
        parent.kill()  # SIGKILL: no __exit__, no watchdog; only the death signal is left
        parent.wait()
        assert _wait_for(lambda: not running()), running()
    finally:
        parent.kill()
        parent.wait()
        for pid in running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    """Killed but not yet reaped by its parent (the launcher reaps on leaving the block)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_parent_error_kills_children_and_propagates(tmp_path) -> None:
    launcher = RankLauncher(_pid_child(tmp_path), tmp_path / "cfg", devices=3, log_dir=tmp_path)
    start = time.monotonic()
    with pytest.raises(KeyError, match="parent failed"):
        with launcher:
            pids = _pids(tmp_path, [1, 2])
            raise KeyError("parent failed")
    assert time.monotonic() - start < 4  # killed at once, not after a grace period
    assert all(proc.poll() is not None for _, proc, _ in launcher._children)
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_child_outliving_grace_is_killed(tmp_path) -> None:
    launcher = RankLauncher(
        _pid_child(tmp_path), tmp_path / "cfg", devices=2, log_dir=tmp_path, grace_s=0.5
    )
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"rank 1 did not exit within .* s after rank 0 finished \(killed\)"
    ):
        with launcher:
            (pid,) = _pids(tmp_path, [1])
    assert time.monotonic() - start < 10
    assert not _alive(pid)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_child_failing_after_parent_finished_is_reported(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAIL_RANK", "1")
    launcher = RankLauncher(_pid_child(tmp_path), tmp_path / "cfg", devices=2, log_dir=tmp_path)
    # The block ends at once, long before the child exits: the failure is found while reaping.
    with pytest.raises(RuntimeError, match="rank 1 failed with exit code 3"):
        with launcher:
            pass


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_clean_exit_of_all_ranks(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLEEP_S", "0.3")
    launcher = RankLauncher(_pid_child(tmp_path), tmp_path / "cfg", devices=3, log_dir=tmp_path)
    with launcher:
        pass
    assert [proc.returncode for _, proc, _ in launcher._children] == [0, 0]


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_failed_start_restores_environment_and_stops_started_children(tmp_path) -> None:
    (tmp_path / "rank2.log").mkdir()  # the second child's log cannot be opened
    before = dict(os.environ)
    launcher = RankLauncher(_pid_child(tmp_path), tmp_path / "c", devices=3, log_dir=tmp_path)
    try:
        with pytest.raises(IsADirectoryError):
            with launcher:
                pass
        env_restored = dict(os.environ) == before
        started = [proc for _, proc, _ in launcher._children]  # rank 1, before rank 2 failed
        stopped = _wait_for(lambda: all(proc.poll() is not None for proc in started), 2)
        assert env_restored, "os.environ left modified"
        assert stopped, "rank 1 left running"
    finally:
        os.environ.clear()
        os.environ.update(before)
        for _, proc, _ in launcher._children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
