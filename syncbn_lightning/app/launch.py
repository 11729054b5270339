"""Starting the other DDP processes of one training job from a config file, not from ``sys.argv``.

Lightning's ``strategy="ddp"`` launcher re-runs the parent's command line for ranks 1..N-1. Under
a Hydra multirun (``-m bn.group_size=1,2,4``) that command line is the whole sweep, so each child
starts a sweep of its own. :class:`RankLauncher` instead starts every child with the *resolved
config of the current job*, written to a file, so all ranks of a job train with exactly the same
values. The children are ordinary Lightning DDP processes: the launcher sets the environment
Lightning's own ``LightningEnvironment`` reads (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
``NODE_RANK``, ``LOCAL_RANK``), so Lightning treats them as created externally, exactly as under
``torchrun``. Jobs started by torchrun, SLURM or LSF are left to Lightning's cluster environments.

Failure handling: when a child dies, a watchdog thread kills the others at once, so that the
parent's next collective fails instead of waiting for the process-group timeout, and ends the
parent after ``abort_after_s`` if it is busy elsewhere. Children die with the parent
(``PR_SET_PDEATHSIG`` on Linux). They are plain ``subprocess`` children: torch.distributed.elastic's
``start_processes`` and its watch and kill do not fit a job whose rank 0 trains in this process
(see ``RankLauncher._start``, ``RankLauncher._watch`` and docs/service.md).

Rendezvous: on a single node the launcher hosts the job's ``TCPStore`` itself, on a socket bound to
``127.0.0.1`` (torch's own store, started by rank 0, listens on every interface), and every rank,
this one included, joins it as a client (``TORCHELASTIC_USE_AGENT_STORE``, the contract torchrun's
agent uses). gloo is pinned to the loopback interface (``GLOO_SOCKET_IFNAME=lo``) unless set. So
nothing of a single-node job is reachable from other machines. Multi-node jobs rendezvous as
Lightning/torch do (the store must be reachable from the other nodes).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RANK_CONFIG_ENV",
    "RankLauncher",
    "child_command",
    "free_port",
    "launched_externally",
    "missing_rendezvous",
    "restored_environ",
]

log = logging.getLogger(__name__)

RANK_CONFIG_ENV = "SYNCBN_RANK_CONFIG"
"""Set in a child's environment to the config file it must train with."""
FLIGHT_DIR_ENV = "SYNCBN_FLIGHT_DIR"
"""Where every rank's SyncBN flight recorder writes (``syncbn_lightning.distributed.flight``)."""


def free_port() -> int:
    """A TCP port that was free on the loopback interface a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launched_externally() -> bool:
    """Whether something else (torchrun, SLURM, LSF, our own launcher) created this process as
    one rank of a job, so that no process must be started here."""
    if "LOCAL_RANK" in os.environ:
        return True
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    return any(env.detect() for env in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment))


def missing_rendezvous(num_nodes: int) -> list[str]:
    """The variables a multi-node job started without torchrun/SLURM lacks on this node
    (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``); none are needed on a single node."""
    if num_nodes <= 1:
        return []
    return [k for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if k not in os.environ]


def _loopback_store() -> tuple[Any, int]:
    """A ``TCPStore`` server listening on ``127.0.0.1`` only, and its port.

    The port is chosen by the kernel while binding, so no other process can take it between
    choosing and listening (as it could with :func:`free_port`).
    """
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = int(sock.getsockname()[1])
        options = {"is_master": True, "wait_for_workers": False, "master_listen_fd": sock.fileno()}
        try:
            store = TCPStore("127.0.0.1", port, **options)
        except NotImplementedError:
            # torch 2.4's default (libuv) server cannot take a listening descriptor; its legacy
            # server can, and the ranks' clients speak to either.
            store = TCPStore("127.0.0.1", port, use_libuv=False, **options)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns (and closes) the descriptor now
    return store, port


def _describe(code: int) -> str:
    """How a child ended, from its ``Popen.returncode``: ``failed with exit code 3`` or
    ``was killed by SIGKILL (exit code -9)``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"failed with exit code {code}"


def _set_environ(values: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(values)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class RankLauncher:
    """Context manager that makes the current process local rank 0 and starts local ranks
    ``1..devices-1`` running ``command`` with ``config_file``.

    Args:
        command: the child's command line, e.g. ``[sys.executable, "train.py"]``; the child finds
            its config in the ``SYNCBN_RANK_CONFIG`` environment variable.
        config_file: the resolved config every rank trains with.
        devices: processes on this node.
        num_nodes: nodes of the job. With more than one, ``MASTER_ADDR``, ``MASTER_PORT`` and
            ``NODE_RANK`` must be set on every node (as for Lightning's own launcher); with one,
            the rendezvous is on loopback at a fresh free port (the variables are ignored).
        log_dir: where each child's stdout/stderr go (``rank<global rank>.log``).
        grace_s: how long children get to exit after the parent finished, before being killed.
        abort_after_s: after a child died (and the others were killed), how long this process
            gets to leave the block on its own; then the watchdog logs the failure and ends it
            with exit code 1. ``None``: never. This bounds how long a broken job lingers, whatever
            the parent is doing (a collective fails at once, but validation or a checkpoint
            write does not).

    Raises:
        RuntimeError: on leaving the block, when a child failed (naming its rank, how it ended,
            e.g. ``was killed by SIGKILL (exit code -9)``, and its log, with the log's last
            lines), or did not exit within ``grace_s``.
        ValueError: for a multi-node job whose rendezvous variables are missing.

    Note:
        ``os.environ`` is restored on exit, so that a Hydra multirun can launch the next job from
        the same process. On a single node the rendezvous store lives until the block ends:
        destroy the process group inside it.
    """

    def __init__(
        self,
        command: Sequence[str],
        config_file: str | Path,
        devices: int,
        num_nodes: int = 1,
        log_dir: str | Path = ".",
        grace_s: float = 120.0,
        abort_after_s: float | None = 30.0,
    ) -> None:
        if devices < 1 or num_nodes < 1:
            raise ValueError(f"devices and num_nodes must be >= 1, got {devices}, {num_nodes}")
        if abort_after_s is not None and abort_after_s <= 0:
            raise ValueError(f"abort_after_s must be > 0 or None, got {abort_after_s}")
        missing = missing_rendezvous(num_nodes)
        if missing:
            raise ValueError(
                f"trainer.num_nodes={num_nodes} without torchrun/SLURM needs {', '.join(missing)} "
                "set on every node (NODE_RANK=0 on the node at MASTER_ADDR)"
            )
        self.command = list(command)
        self.config_file = Path(config_file)
        self.devices, self.num_nodes = devices, num_nodes
        self.log_dir = Path(log_dir)
        self.grace_s = grace_s
        self.abort_after_s = abort_after_s
        self._store: Any = None
        self._children: list[tuple[int, subprocess.Popen[bytes], Path]] = []  # (rank, proc, log)
        self._failed: tuple[int, int, Path] | None = None  # (rank, exit code, log): the first
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._env_before: dict[str, str] = {}

    def __enter__(self) -> RankLauncher:
        self._env_before = dict(os.environ)
        node_rank = int(os.environ.get("NODE_RANK", "0"))
        try:
            if self.num_nodes == 1:
                # A fresh store per job, on loopback: a MASTER_PORT left in the environment (by an
                # earlier job of this process, or exported) may still be held by that job's store.
                self._store, port = _loopback_store()
                os.environ["MASTER_ADDR"] = "127.0.0.1"
                os.environ["MASTER_PORT"] = str(port)
                os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # all ranks are clients
                # torch 2.4 prefixes the agent store's keys with this (a KeyError without it).
                os.environ.setdefault("TORCHELASTIC_RESTART_COUNT", "0")
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ["NODE_RANK"] = str(node_rank)
            os.environ["WORLD_SIZE"] = str(self.devices * self.num_nodes)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            # Every rank's SyncBN flight recorder in a file here, so that whoever sees the job
            # fail names where the ranks' collectives parted (distributed/flight/).
            os.environ[FLIGHT_DIR_ENV] = str(self.log_dir)
            for local in range(1, self.devices):
                self._start(node_rank * self.devices + local, local)
        except BaseException:
            # __exit__ is not called when __enter__ raises: undo what was done so far here.
            self._kill_all()
            self._store = None
            _set_environ(self._env_before)
            raise
        os.environ["LOCAL_RANK"] = "0"
        log.info(
            "started %d more process(es) for this job (logs: %s/rank*.log), rendezvous %s:%s",
            self.devices - 1,
            self.log_dir,
            os.environ["MASTER_ADDR"],
            os.environ["MASTER_PORT"],
        )
        threading.Thread(target=self._watch, name="syncbn-rank-watchdog", daemon=True).start()
        return self

    def _start(self, rank: int, local: int) -> None:
        """Start one child, stdout and stderr in its log, dying with this process.

        Not elastic's ``start_processes``: it cannot ask a child to die with its parent (no
        ``preexec_fn``), writes stdout and stderr to two files, and installs signal handlers in
        the calling process that turn Ctrl-C into its ``SignalException`` (this process trains).
        """
        env = {**os.environ, "LOCAL_RANK": str(local), RANK_CONFIG_ENV: str(self.config_file)}
        path = self.log_dir / f"rank{rank}.log"
        with open(path, "wb") as out:
            proc = subprocess.Popen(
                self.command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        self._children.append((rank, proc, path))

    def has_failed(self) -> bool:
        """Whether the watchdog saw a started rank end badly (it then stops the job)."""
        return self._failed is not None

    def _first_failure(self) -> tuple[int, int, Path] | None:
        """``(rank, exit code, log)`` of the lowest rank that has ended badly, if any."""
        for rank, proc, path in self._children:
            code = proc.poll()
            if code not in (None, 0):
                return rank, code, path
        return None

    def _kill_all(self, wait_s: float = 5.0) -> None:
        """SIGKILL the children still running, then reap them (for at most ``wait_s``)."""
        for _, proc, _ in self._children:
            if proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + wait_s
        for _, proc, _ in self._children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))

    def _watch(self) -> None:
        # Our own poll, not elastic's PContext.wait: on a failure that sends SIGTERM (which
        # Lightning's ranks catch) and waits 30 s; a dead peer must break the collectives now.
        while not self._stop.wait(0.2):
            failed = self._first_failure()
            if failed is None:
                continue
            with self._lock:
                if self._stop.is_set():
                    return  # the block is ending: __exit__ tells failures from its own kills
                self._failed = failed
            log.error("rank %d %s; stopping the job", failed[0], _describe(failed[1]))
            self._kill_all()
            self._abort_if_stuck(*failed)
            return

    def _abort_if_stuck(self, rank: int, code: int, path: Path) -> None:
        """Give this process ``abort_after_s`` to leave the block after ``rank`` died, then end
        it: it is blocked somewhere no failure reaches (not in a collective)."""
        if self.abort_after_s is None or self._stop.wait(self.abort_after_s):
            return
        message = (
            f"rank {rank} {_describe(code)}; this process (local rank 0) did not stop within "
            f"{self.abort_after_s:g} s (launch.abort_after_s), ending it; see {path}"
        )
        log.critical(message)
        _report_flight(f"rank {rank} {_describe(code)}", self.log_dir)
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"error: {message}\n")
            sys.stderr.flush()
        os._exit(1)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        with self._lock:
            self._stop.set()
        try:
            if exc is None:
                self._reap()
            else:
                # Was it because a child had died? A dead peer breaks this process's collective
                # at once, often before the watchdog's next look, and the child may need a
                # moment more to become reapable.
                deadline = time.monotonic() + 0.5
                while self._failed is None and time.monotonic() < deadline:
                    self._failed = self._first_failure()
                    time.sleep(0.02)
                self._kill_all()  # their exit codes are ours, not failures of theirs
            if self._failed is not None:
                rank, code, path = self._failed
                _report_flight(f"rank {rank} {_describe(code)}", self.log_dir)
                # When a child died first, the parent's own error is only the broken collective.
                raise RuntimeError(
                    f"rank {rank} {_describe(code)}; its log {path} ends with:\n" + _tail(path)
                ) from exc
        finally:
            self._store = None  # stops the rendezvous server (the process group is gone)
            _set_environ(self._env_before)

    def _reap(self) -> None:
        """This process finished: wait up to ``grace_s`` for the children to finish too."""
        deadline = time.monotonic() + self.grace_s
        for rank, proc, path in self._children:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self._kill_all()
                raise RuntimeError(
                    f"rank {rank} did not exit within {self.grace_s:g} s after rank 0 "
                    f"finished (killed); see {path}"
                ) from None
        self._failed = self._failed or self._first_failure()


def _report_flight(reason: str, directory: Path) -> None:
    """Log where the ranks' SyncBN collectives parted, from their flight records in ``directory``
    (once per process: a rank's own failure may have logged it already)."""
    from syncbn_lightning.distributed.flight import report as flight_report

    with contextlib.suppress(Exception):  # a report must never hide the failure itself
        flight_report.report_directory(reason, directory)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(unreadable: {e})"
    return "\n".join("    " + line for line in text[-lines:])


@contextlib.contextmanager
def restored_environ() -> Iterator[None]:
    """Restore ``os.environ`` on exit (Lightning and W&B set process-wide variables)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        _set_environ(before)


def child_command() -> list[str]:
    """The command a child rank runs: this interpreter on the service's entry module, which trains
    with the config file named by ``RANK_CONFIG_ENV`` (the same from a clone or an install)."""
    return [sys.executable, "-m", "syncbn_lightning.app.train"]
