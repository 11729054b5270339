"""The flight recorder's files: their layout, and reading them (no torch: ``syncbn-flight`` reads a
job's records in a fraction of a second, in a process that never imports torch). The writer is
:mod:`.writer`; a folder's housekeeping (which node's folder, pruning old jobs) is
:mod:`.folder`.

A flight directory holds one folder per node (``node<N>``) and in it, per rank and job, a ring
file ``flight_<job>_rank<R>.bin`` (a header and fixed-size little-endian records, written by
:mod:`.flight` and ``csrc/layer/flight.cpp``) and the layers' names beside it (``.names``: one
``tag<TAB>name`` line per layer). The job is an id every rank of a job shares (made once per job
through the default process group's store); a reader groups the files by the id in their header.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from ..._shared import (
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
    "job_files",
    "jobs_in",
    "layer_names",
    "layer_text",
    "names_path",
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


#: Tag -> qualified name of every layer this process named (the converter names them, through
#: :func:`~syncbn_lightning.distributed.flight.register_layer_name`); a file-backed recorder writes
#: them beside its records, for readers in other processes.
layer_names: dict[int, str] = {}


def layer_text(tag: float, names: Mapping[int, str] | None = None) -> str:
    """The layer whose tag is ``tag``, quoted, for messages and reports: named from ``names``
    (tag -> name, e.g. a flight folder's), else from this process's :data:`layer_names`."""
    name = (names if names is not None else layer_names).get(int(tag))
    return repr(name or f"<SyncBatchNorm tag {int(tag)}>")


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


def job_files(directory: str | os.PathLike[str]) -> list[tuple[Path, int, str]]:
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
    for _path, _rank, job in job_files(directory):
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
    files = job_files(directory)
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
    for path, _rank, file_job in job_files(directory):
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
