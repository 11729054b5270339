"""The flight recorder's files: their layout, and reading them (no torch: ``syncbn-flight`` reads a
job's records in a fraction of a second, in a process that never imports torch).

A flight directory holds one folder per node (``node<N>``) and in it, per rank and job, a ring
file ``flight_<job>_rank<R>.bin`` (a header and fixed-size little-endian records, written by
:mod:`.flight` and ``csrc/flight.cpp``) and the layers' names beside it (``.names``: one
``tag<TAB>name`` line per layer). The job is an id every rank of a job shares (made once per job
through the default process group's store); a reader groups the files by the id in their header.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

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
    "jobs_in",
    "names_path",
    "read_flight_dir",
    "read_flight_file",
    "read_layer_names",
]

FORWARD, BACKWARD, CHECK = 0, 1, 2
DIRECTIONS = ("forward", "backward", "check")
OPS = ("all_gather", "all_reduce")
OP_CODES = {name: code for code, name in enumerate(OPS)}

# File layout: a header, then `capacity` records; csrc/flight.cpp writes the same layout.
MAGIC = b"SBNFLT01"
HEADER = struct.Struct("<8siiiiq24s")  # magic, rank, world, pid, capacity, written, job
HEADER_SIZE = 64
# seq in group, time, bytes, call number, layer tag, op, direction, group name
RECORD = struct.Struct("<qdqqiBB2x16s")


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


def read_flight_file(path: str | os.PathLike[str]) -> tuple[int, str, list[FlightRecord]]:
    """``(rank, job, records)`` of one rank's file."""
    (rank, _world, job), records = decode(Path(path).read_bytes())
    return rank, job, records


def _ring_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Every ring file under ``directory`` (its node folders, or itself), newest last."""
    found = [p for p in Path(directory).rglob("flight_*rank*.bin") if p.is_file()]
    return sorted(found, key=lambda p: (p.stat().st_mtime, str(p)))


def _readable(directory: str | os.PathLike[str]) -> list[tuple[Path, int, str, list[FlightRecord]]]:
    out = []
    for path in _ring_files(directory):
        try:
            rank, job, records = read_flight_file(path)
        except (OSError, ValueError, struct.error):
            continue  # another program's file, or one cut short
        out.append((path, rank, job, records))
    return out


def jobs_in(directory: str | os.PathLike[str]) -> list[str]:
    """The jobs whose records ``directory`` holds, the most recently written last."""
    jobs: list[str] = []
    for _path, _rank, job, _records in _readable(directory):
        if job in jobs:
            jobs.remove(job)
        jobs.append(job)
    return jobs


def read_flight_dir(
    directory: str | os.PathLike[str], job: str | None = None
) -> dict[int, list[FlightRecord]]:
    """Every rank's records of ``job`` under ``directory`` (its node folders included), by global
    rank; ``job=None``: the most recently written job's. Unreadable files are skipped."""
    readable = _readable(directory)
    if job is None:
        if not readable:
            return {}
        job = readable[-1][2]
    return {rank: records for _path, rank, file_job, records in readable if file_job == job}


def read_layer_names(directory: str | os.PathLike[str], job: str | None = None) -> dict[int, str]:
    """Tag -> layer name from the names files under ``directory`` (of ``job``'s files only, when
    given)."""
    names: dict[int, str] = {}
    for path, _rank, file_job, _records in _readable(directory):
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
