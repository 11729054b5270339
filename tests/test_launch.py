"""The rank launcher (``syncbn_lightning.app.launch``) with real child processes.

Children are tiny Python scripts written to ``tmp_path``; they report what they saw (their
environment, their pid, the result of a gloo all-reduce) through files. Nothing is mocked: exit
codes, kills and the rendezvous are real.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _service import listening_sockets

from syncbn_lightning.app.launch import (
    RANK_CONFIG_ENV,
    RankLauncher,
    free_port,
    launched_externally,
    restored_environ,
)

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK")
ENV_KEYS = (*RENDEZVOUS, RANK_CONFIG_ENV)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No rendezvous variables inherited from the shell running the tests."""
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)


def _script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


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
    return [*_script(tmp_path, "pid_child.py", PID_CHILD), str(tmp_path)]


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


def _pids(tmp_path: Path, local_ranks) -> list[int]:
    files = [tmp_path / f"pid{r}" for r in local_ranks]
    assert _wait_for(lambda: all(f.exists() for f in files)), "children did not start"
    return [int(f.read_text()) for f in files]


@pytest.mark.distributed
@pytest.mark.timeout(60)
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


def _is_zombie(pid: int) -> bool:
    """Killed but not yet reaped by its parent (the launcher reaps on leaving the block)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


ENV_CHILD = """
    import json, os, sys
    keys = {keys!r}
    rank = os.environ["LOCAL_RANK"]
    with open(os.path.join(sys.argv[1], "env" + rank + ".json"), "w") as f:
        json.dump({{k: os.environ.get(k) for k in keys}}, f)
"""


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("devices", "num_nodes", "node_rank"), [(3, 1, None), (2, 2, 1)])
def test_children_get_the_documented_environment(
    tmp_path, monkeypatch, devices: int, num_nodes: int, node_rank: int | None
) -> None:
    if node_rank is not None:  # a later node of a multi-node job: rendezvous given by the user
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29123")
        monkeypatch.setenv("NODE_RANK", str(node_rank))
    monkeypatch.setenv("SYNCBN_TEST_MARKER", "kept")
    before = dict(os.environ)
    command = [*_script(tmp_path, "env_child.py", ENV_CHILD.format(keys=ENV_KEYS)), str(tmp_path)]
    config = tmp_path / "job.yaml"
    with RankLauncher(command, config, devices=devices, num_nodes=num_nodes, log_dir=tmp_path):
        assert os.environ["LOCAL_RANK"] == "0"
        assert os.environ["WORLD_SIZE"] == str(devices * num_nodes)
        assert os.environ["NODE_RANK"] == str(node_rank or 0)
        port = os.environ["MASTER_PORT"]
        addr = os.environ["MASTER_ADDR"]
        assert RANK_CONFIG_ENV not in os.environ
    assert dict(os.environ) == before

    if node_rank is not None:
        assert (port, addr) == ("29123", "127.0.0.1")
    seen = {int(p.stem[3:]): json.loads(p.read_text()) for p in sorted(tmp_path.glob("env*.json"))}
    assert sorted(seen) == list(range(1, devices))
    for local, env in seen.items():
        assert env == {
            "MASTER_ADDR": addr,
            "MASTER_PORT": port,
            "NODE_RANK": str(node_rank or 0),
            "WORLD_SIZE": str(devices * num_nodes),
            "LOCAL_RANK": str(local),
            RANK_CONFIG_ENV: str(config),
        }
        # Logs are named by global rank.
        assert (tmp_path / f"rank{(node_rank or 0) * devices + local}.log").is_file()


@pytest.mark.distributed
@pytest.mark.timeout(60)
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
def test_child_failing_after_parent_finished_is_reported(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAIL_RANK", "1")
    launcher = RankLauncher(_pid_child(tmp_path), tmp_path / "cfg", devices=2, log_dir=tmp_path)
    # The block ends at once, long before the child exits: the failure is found while reaping.
    with pytest.raises(RuntimeError, match="rank 1 failed with exit code 3"):
        with launcher:
            pass


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_clean_exit_of_all_ranks(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLEEP_S", "0.3")
    launcher = RankLauncher(_pid_child(tmp_path), tmp_path / "cfg", devices=3, log_dir=tmp_path)
    with launcher:
        pass
    assert [proc.returncode for _, proc, _ in launcher._children] == [0, 0]


@pytest.mark.distributed
@pytest.mark.timeout(60)
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


def test_multi_node_needs_rendezvous_variables(tmp_path, monkeypatch) -> None:
    cmd = [sys.executable, "-c", "pass"]
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT, NODE_RANK"):
        RankLauncher(cmd, tmp_path / "c", devices=2, num_nodes=2)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match=r"needs NODE_RANK set on every node") as info:
        RankLauncher(cmd, tmp_path / "c", devices=2, num_nodes=2)
    assert "MASTER_PORT" not in str(info.value)
    monkeypatch.setenv("NODE_RANK", "0")
    RankLauncher(cmd, tmp_path / "c", devices=2, num_nodes=2)  # complete: accepted
    with pytest.raises(ValueError, match="devices and num_nodes must be >= 1"):
        RankLauncher(cmd, tmp_path / "c", devices=0)
    with pytest.raises(ValueError, match="abort_after_s must be > 0 or None"):
        RankLauncher(cmd, tmp_path / "c", devices=2, abort_after_s=0)


_CLUSTER_PREFIXES = ("SLURM_", "LSB_", "JSM_", "TORCHELASTIC_")


def test_launched_externally(monkeypatch) -> None:
    for key in list(os.environ):
        if key.startswith(_CLUSTER_PREFIXES):
            monkeypatch.delenv(key)
    assert not launched_externally()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launched_externally()
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun
    assert launched_externally()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_NTASKS", "4")  # srun
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert launched_externally()


def test_free_port_and_restored_environ(monkeypatch) -> None:

    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # still free
    monkeypatch.setenv("SYNCBN_TEST_A", "1")
    before = dict(os.environ)
    with pytest.raises(ZeroDivisionError), restored_environ():
        os.environ["SYNCBN_TEST_B"] = "2"
        del os.environ["SYNCBN_TEST_A"]
        1 / 0  # noqa: B018
    assert dict(os.environ) == before


GLOO_CHILD = """
    import json, os, sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    cfg = json.load(open(os.environ["{config_env}"]))
    rank = int(os.environ["NODE_RANK"]) * cfg["devices"] + int(os.environ["LOCAL_RANK"])
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=30),
    )
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        with open(os.path.join(cfg["out"], f"sum{{rank}}.txt"), "w") as f:
            f.write(repr(t.item()))
        dist.barrier()
    finally:
        dist.destroy_process_group()
"""


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_gloo_rendezvous_through_the_launcher(tmp_path) -> None:
    assert not dist.is_initialized()
    devices = 2
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"devices": devices, "out": str(tmp_path)}))
    command = _script(tmp_path, "gloo_child.py", GLOO_CHILD.format(config_env=RANK_CONFIG_ENV))
    with RankLauncher(command, config, devices=devices, log_dir=tmp_path):
        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=int(os.environ["NODE_RANK"]) * devices + int(os.environ["LOCAL_RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timedelta(seconds=30),
        )
        try:
            t = torch.tensor([1.0])
            dist.all_reduce(t)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    assert t.item() == 3.0  # ranks 0 and 1 contribute 1 and 2
    assert float((tmp_path / "sum1.txt").read_text()) == 3.0


# A rank that joins the group, then waits in a barrier until the parent has looked at its sockets.
BARRIER_CHILD = """
    import os
    from datetime import timedelta
    import torch.distributed as dist
    dist.init_process_group(
        "gloo", init_method="env://", rank=int(os.environ["LOCAL_RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=30),
    )
    dist.barrier()
    dist.destroy_process_group()
"""


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_single_node_rendezvous_listens_on_loopback_only(tmp_path) -> None:
    command = _script(tmp_path, "barrier_child.py", BARRIER_CHILD)
    launcher = RankLauncher(command, tmp_path / "cfg", devices=2, log_dir=tmp_path)
    with launcher:
        port = int(os.environ["MASTER_PORT"])
        dist.init_process_group(
            "gloo", init_method="env://", rank=0, world_size=2, timeout=timedelta(seconds=30)
        )
        try:
            (_, child, _) = launcher._children[0]
            # the child is waiting in the barrier, its sockets still open
            sockets = listening_sockets(os.getpid()) | listening_sockets(child.pid)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    store = {addr for addr, p in sockets if p == port}
    assert store == {"127.0.0.1"}, sockets  # the store, at MASTER_PORT, on loopback only
    # gloo's listeners of both ranks are on loopback as well
    gloo = {(addr, p) for addr, p in sockets if p != port}
    assert gloo and {addr for addr, _ in gloo} == {"127.0.0.1"}, sockets
