"""Helpers for the tests of the training service's processes (train.py, the rank launcher)."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

CONF = Path(__file__).resolve().parents[1] / "conf"


def wandb_transaction_log(run_dir: Path) -> bytes:
    """The bytes of the ``run-*.wandb`` file of the offline W&B run in ``run_dir``, once W&B has
    written all of it.

    ``run.finish()`` does not wait for that: it waits for the run's exit record to be handled,
    then only *informs* W&B's service process that the run is done (``inform_finish``, sent
    without waiting for an answer), and the service closes the run's stream, flushing the last
    records of the file (the final ``run.log`` calls, the summary), some time later. Under load
    a test reading the file right after ``finish()`` intermittently misses them.
    ``wandb.teardown()`` is what W&B documents as "waits for W&B to finish": it shuts the
    service down and waits for the process to exit, after it closed every stream.
    """
    import wandb

    wandb.teardown()
    (run_file,) = run_dir.glob("run-*.wandb")
    return run_file.read_bytes()


#: Variables a launcher or an earlier in-process run (Lightning's ddp_spawn) leaves behind; they
#: change how a job rendezvouses, so tests of the service start without them.
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK")


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """``(address, port)`` of the TCP sockets ``pid`` holds in the LISTEN state (from /proc).

    Empty for a process that has exited (its /proc entries are gone).
    """
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return set()
    inodes = set()
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A = TCP_LISTEN
                continue
            addr, port = fields[1].split(":")
            raw = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def write_script(tmp_path: Path, name: str, body: str) -> list[str]:
    """``body`` (dedented) as ``tmp_path/name``; returns the command that runs it."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


# A run small enough for 2 cores: 16 training images, 8 for validation, one epoch.
TINY = [
    "data.synthetic.num_train=16",
    "data.synthetic.num_val=8",
    "data.synthetic.progress=false",
    "trainer.max_epochs=1",
    "trainer.check_val_every_n_epoch=1",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "bn.precise_bn_batches=2",
    "launch.timeout_s=60",
]


def compose_train(overrides: list[str]) -> DictConfig:
    """``python train.py OVERRIDES`` composed with Hydra's compose API."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=overrides)


def tiny_cfg(tmp: Path, data_dir: Path, *overrides: str) -> DictConfig:
    """The config of a :data:`TINY` run writing to ``tmp/out``, data generated in ``data_dir``."""
    paths = [f"paths.output_dir={tmp / 'out'}", f"paths.data_dir={data_dir}"]
    tiny = TINY
    if "data=coco" in overrides:  # no generator settings on a real dataset
        tiny = [o for o in TINY if not o.startswith("data.synthetic")]
    return compose_train([*paths, *tiny, *overrides])
