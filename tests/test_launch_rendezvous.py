"""The rank launcher's rendezvous (``syncbn_lightning.app.launch``): the environment the children
get, multi-node validation, a real gloo rendezvous through the launcher, and where it listens.

Children are tiny Python scripts written to ``tmp_path`` that report what they saw through files;
the failure and process-lifecycle tests are in ``test_launch.py``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _service import RENDEZVOUS_VARS, listening_sockets, write_script

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
    for key in (*RENDEZVOUS_VARS, RANK_CONFIG_ENV):
        monkeypatch.delenv(key, raising=False)


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
@pytest.mark.slow
def test_children_get_the_documented_environment(
    tmp_path, monkeypatch, devices: int, num_nodes: int, node_rank: int | None
) -> None:
    if node_rank is not None:  # a later node of a multi-node job: rendezvous given by the user
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29123")
        monkeypatch.setenv("NODE_RANK", str(node_rank))
    monkeypatch.setenv("SYNCBN_TEST_MARKER", "kept")
    before = dict(os.environ)
    command = [
        *write_script(tmp_path, "env_child.py", ENV_CHILD.format(keys=ENV_KEYS)),
        str(tmp_path),
    ]
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
@pytest.mark.slow
def test_gloo_rendezvous_through_the_launcher(tmp_path) -> None:
    assert not dist.is_initialized()
    devices = 2
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"devices": devices, "out": str(tmp_path)}))
    command = write_script(tmp_path, "gloo_child.py", GLOO_CHILD.format(config_env=RANK_CONFIG_ENV))
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
@pytest.mark.slow
def test_single_node_rendezvous_listens_on_loopback_only(tmp_path) -> None:
    command = write_script(tmp_path, "barrier_child.py", BARRIER_CHILD)
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
