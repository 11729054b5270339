"""The flight recorder's files: their layout, and reading them (no torch: ``syncbn-flight`` reads a
job's records in a fraction of a second, in a process that never imports torch).

A flight directory holds one folder per node (``node<N>``) and in it, per rank and job, a ring
file ``flight_<job>_rank<R>.bin`` (a header and fixed-size little-endian records, written by
:mod:`.flight` and ``csrc/layer/flight.cpp``) and the layers' names beside it (``.names``: one
``tag<TAB>name`` line per layer). The job is an id every rank of a job shares (made once per job
through the default process group's store); a reader groups the files by the id in their header.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

try:
    import fcntl
except ImportError:  # Windows: a running job's files are told by their mtime alone
    fcntl = None  # type: ignore[assignment]

from .._shared import (
    FLIGHT_DIRECTIONS,
    FLIGHT_HEADER_FORMAT,
    FLIGHT_HEADER_SIZE,
    FLIGHT_OPS,
    FLIGHT_RECORD_FORMAT,
)

__all__ = [
    "BACKWARD",
    "CHECK",
    "FORWARD",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "OP_CODES",
    "RECORD",
    "FlightRecord",
    "decode",
    "in_use",
    "jobs_in",
    "map_new_file",
    "names_path",
    "node_folder",
    "prune_jobs",
    "read_flight_dir",
    "read_flight_file",
    "read_layer_names",
]

FORWARD, BACKWARD, CHECK = 0, 1, 2
DIRECTIONS = FLIGHT_DIRECTIONS
OPS = FLIGHT_OPS
OP_CODES = {name: code for code, name in enumerate(OPS)}

# File layout: a header, then `capacity` records; csrc/layer/flight.cpp writes the same layout
# (both from syncbn_lightning/_shared.py).
MAGIC = b"SBNFLT01"
HEADER = struct.Struct(FLIGHT_HEADER_FORMAT)  # magic, rank, world, pid, capacity, written, job
HEADER_SIZE = FLIGHT_HEADER_SIZE
# seq in group, time, bytes, call number, layer tag, op, direction, group name
RECORD = struct.Struct(FLIGHT_RECORD_FORMAT)


def layer_text(tag: float, names: Mapping[int, str]) -> str:
    """The layer whose tag is ``tag``, quoted, named from ``names`` (tag -> name)."""
    return repr(names.get(int(tag)) or f"<SyncBatchNorm tag {int(tag)}>")


class FlightRecord(NamedTuple):
    """One recorded collective of a synchronized layer."""

    group: str  #: the process group's name (``"0"`` is the default group)
    seq: int  #: its number among this rank's recorded collectives in ``group`` (from 0)
    op: str  #: ``"all_gather"`` or ``"all_reduce"``
    direction: str  #: ``"forward"``, ``"backward"`` or ``"check"`` (the call-order error path)
    nbytes: int  #: bytes this rank sent
    layer_tag: int  #: the layer's call-order tag
    call: int  #: the layer's call number on this rank (from 0), host-side
    time: float  #: ``time.time()`` when it was issued

    def what(self, names: Mapping[int, str] | None = None) -> str:
        """``backward all_gather of 'layer' (call #3, 264 B)``, the layer named from ``names``."""
        return (
            f"{self.direction} {self.op} of {layer_text(self.layer_tag, names or {})} "
            f"(call #{self.call + 1}, {self.nbytes} B)"
        )

    def key(self) -> tuple[str, str, int, int, int]:
        """What two ranks must agree on for the same collective."""
        return (self.op, self.direction, self.nbytes, self.layer_tag, self.call)


def decode(data: bytes) -> tuple[tuple[int, int, str], list[FlightRecord]]:
    """``((rank, world, job), records oldest first)`` of a recorder's bytes."""
    magic, rank, world, _pid, capacity, written, job = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError("not a SyncBN flight record (bad magic)")
    first = max(0, written - capacity)
    out = []
    for index in range(first, written):
        offset = HEADER_SIZE + (index % capacity) * RECORD.size
        seq, when, nbytes, call, tag, op, direction, group = RECORD.unpack_from(data, offset)
        name = group.rstrip(b"\0").decode(errors="replace")
        out.append(FlightRecord(name, seq, OPS[op], DIRECTIONS[direction], nbytes, tag, call, when))
    return (rank, world, job.rstrip(b"\0").decode(errors="replace")), out


def names_path(path: Path) -> Path:
    """The names file beside the ring file ``path``."""
    return path.with_suffix(".names")


def map_new_file(path: Path, size: int) -> mmap.mmap:
    """A new file at ``path`` (exclusively: never another recorder's) with ``size`` bytes of
    allocated blocks, mapped; on any failure the file is removed and the error raised (the file
    descriptor is closed either way: the map holds its own). The file is share-locked
    (``flock``) while the map lives, so that :func:`prune_jobs` in another process never removes
    a running job's file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if fcntl is not None:
            try:  # held by the map's own descriptor (a dup) until the map is closed
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                pass  # a file system without locks: the file's mtime alone keeps it
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)  # the blocks now, not at a write into the map
        else:
            os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return mapped


def node_folder() -> str:
    """This process's node's folder in a flight directory: ``node<N>`` from the launcher's node
    rank (torchrun's GROUP_RANK, SLURM_NODEID, Lightning's NODE_RANK), else the host's name."""
    for variable in ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK"):
        value = os.environ.get(variable, "")
        if value.isdigit():
            return f"node{value}"
    return f"host-{socket.gethostname()}"


def read_flight_file(path: str | os.PathLike[str]) -> tuple[int, str, list[FlightRecord]]:
    """``(rank, job, records)`` of one rank's file."""
    (rank, _world, job), records = decode(Path(path).read_bytes())
    return rank, job, records


def _ring_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Every ring file under ``directory`` (its node folders, or itself), newest last."""
    found = []
    for path in Path(directory).rglob("flight_*rank*.bin"):
        try:
            found.append((path.stat().st_mtime, str(path), path))
        except OSError:
            continue  # removed meanwhile (another job's pruning)
    return [path for _mtime, _name, path in sorted(found)]


def _read_header(path: Path) -> tuple[int, str] | None:
    """``(rank, job)`` from the header of the ring file ``path`` (its first bytes only), or
    ``None`` for another program's file, one cut short or gone."""
    try:
        with open(path, "rb") as f:
            data = f.read(HEADER_SIZE)
        magic, rank, _world, _pid, _capacity, _written, job = HEADER.unpack_from(data, 0)
    except (OSError, struct.error):
        return None
    if magic != MAGIC:
        return None
    return rank, job.rstrip(b"\0").decode(errors="replace")


def _job_files(directory: str | os.PathLike[str]) -> list[tuple[Path, int, str]]:
    """``(path, rank, job)`` of every readable ring file under ``directory``, newest last; only
    the headers are read."""
    out = []
    for path in _ring_files(directory):
        header = _read_header(path)
        if header is not None:
            out.append((path, *header))
    return out


def jobs_in(directory: str | os.PathLike[str]) -> list[str]:
    """The jobs whose records ``directory`` holds, the most recently written last (from the
    files' headers: no records are read)."""
    jobs: list[str] = []
    for _path, _rank, job in _job_files(directory):
        if job in jobs:
            jobs.remove(job)
        jobs.append(job)
    return jobs


def read_flight_dir(
    directory: str | os.PathLike[str], job: str | None = None
) -> dict[int, list[FlightRecord]]:
    """Every rank's records of ``job`` under ``directory`` (its node folders included), by global
    rank; ``job=None``: the most recently written job's. Only that job's files are read (the
    others' headers only); unreadable files are skipped."""
    files = _job_files(directory)
    if job is None:
        if not files:
            return {}
        job = files[-1][2]
    out = {}
    for path, _rank, file_job in files:
        if file_job != job:
            continue
        try:
            rank, _job, records = read_flight_file(path)
        except (OSError, ValueError, struct.error):
            continue  # cut short, or removed meanwhile
        out[rank] = records
    return out


def read_layer_names(directory: str | os.PathLike[str], job: str | None = None) -> dict[int, str]:
    """Tag -> layer name from the names files under ``directory`` (of ``job``'s files only, when
    given)."""
    names: dict[int, str] = {}
    for path, _rank, file_job in _job_files(directory):
        if job is not None and file_job != job:
            continue
        try:
            lines = names_path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            tag, _, name = line.partition("\t")
            if tag.isdigit() and name:
                names[int(tag)] = name
    return names


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
    files = [(path, job) for path, _rank, job in _job_files(folder) if job in old]
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
