"""A flight directory's housekeeping: which node folder a process writes to, and removing old
jobs' files without touching a running job's (no torch).

Every rank's recorder opens its file in its node's folder (:func:`node_folder`); the node's first
process prunes the folder to the newest jobs (:func:`prune_jobs`), leaving any file a live
recorder may hold (:func:`in_use`): a shared ``flock`` where the file system has one, else the
liveness of the process the file's header names.
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: a running job's files are told by their header's pid alone
    fcntl = None  # type: ignore[assignment]

from .file import HEADER, MAGIC, job_files, jobs_in, names_path

__all__ = ["in_use", "node_folder", "prune_jobs"]


def node_folder() -> str:
    """This process's node's folder in a flight directory: ``node<N>`` from the launcher's node
    rank (torchrun's GROUP_RANK, SLURM_NODEID, Lightning's NODE_RANK), else the host's name."""
    for variable in ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK"):
        value = os.environ.get(variable, "")
        if value.isdigit():
            return f"node{value}"
    return f"host-{socket.gethostname()}"


def in_use(path: Path) -> bool:
    """Whether a live recorder (of any process on this machine) may hold the ring file ``path``:
    it keeps a shared ``flock`` on it while mapped; where that lock cannot be asked (no
    ``fcntl``; a file system without working ``flock``, such as Lustre without ``-o flock`` or
    some NFS mounts), the file counts as in use while the process its header names is alive (a
    reused pid keeps an old file a while longer, never the reverse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # gone, or not ours to read: nothing to prune either
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False  # nobody holds it (closing the descriptor releases this lock)
            except BlockingIOError:
                return True
            except OSError:
                pass  # no working flock here: ask the header's process
        return _writer_alive(os.read(fd, HEADER.size))
    finally:
        os.close(fd)


def _writer_alive(header: bytes) -> bool:
    """Whether the process a ring file's ``header`` names (its pid) is alive on this machine;
    ``True`` for a header too short or foreign to read (never remove what cannot be told)."""
    try:
        magic, _rank, _world, pid, *_rest = HEADER.unpack_from(header, 0)
    except struct.error:
        return True
    if magic != MAGIC:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's (EPERM)
        return True
    return True


def prune_jobs(
    folder: str | os.PathLike[str], keep: int, current: str, rank: int | None = None
) -> list[Path]:
    """Remove the ring and names files of all but the ``keep`` most recently written jobs in
    ``folder`` (``current``, the job opening its recorder, always among them; ``keep`` 0: remove
    nothing). A job still running keeps writing its files, so it stays among the newest, and a
    file a live recorder may hold (:func:`in_use`) is never removed, however old. With ``rank``
    (the caller's global rank), only the node's first process prunes: ``LOCAL_RANK`` 0, or rank 0
    where the launcher set no ``LOCAL_RANK``. Returns the files removed; files another process
    removed first are skipped."""
    if keep < 1 or (rank is not None and int(os.environ.get("LOCAL_RANK", rank)) != 0):
        return []
    jobs = [job for job in jobs_in(folder) if job != current]
    old = set(jobs[: max(len(jobs) - (keep - 1), 0)])
    files = [(path, job) for path, _rank, job in job_files(folder) if job in old]
    running = {job for path, job in files if in_use(path)}
    removed = []
    for path, job in files:
        if job in running:
            continue
        for part in (path, names_path(path)):
            try:
                part.unlink()
            except FileNotFoundError:
                continue
            except OSError:
                break  # not ours to remove (permissions): leave the job as it is
            removed.append(part)
    return removed
