"""The flight recorder: every rank's last SyncBN collectives, for the error that names where the
ranks' sequences parted.

Collectives pair up by their order in a process group. When a job hangs or fails in one, the
question is which call each rank was in, and the first one at which the ranks did different
things. Every collective of a synchronized layer (forward exchange, backward sums, and the
error-path gather of the call-order check) is recorded *before* it is issued: the group and its
sequence number in that group, the op, the direction, the bytes, the layer tag and the layer's
call number. Recording is one fixed-size ``struct.pack_into`` into a ring buffer of
:data:`DEFAULT_CAPACITY` records (about 1 us of host time per collective;
``benchmarks/bench_host.py`` measures it). Nothing is recorded while ``torch.compile`` traces
(compiled code) or a CUDA graph replays (no Python runs).

The ring buffer is plain memory, or, when ``SYNCBN_FLIGHT_DIR`` names a directory (the training
service sets it to the job's ``.syncbn`` folder), a memory-mapped file ``flight_rank<R>.bin``
there: the kernel keeps its pages when the process is killed (SIGKILL, SIGABRT), and any process
can read every rank's file while the job hangs. :func:`read_flight_dir` reads them;
:mod:`.flight_report` compares the ranks' records and logs where they parted.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = [
    "BACKWARD",
    "CHECK",
    "DEFAULT_CAPACITY",
    "FLIGHT_DIR_ENV",
    "FORWARD",
    "FlightRecord",
    "FlightRecorder",
    "check_note",
    "current_recorder",
    "flight_recorder",
    "job_key",
    "next_call",
    "layer_text",
    "read_flight_dir",
    "read_flight_file",
    "read_layer_names",
    "register_layer_name",
    "record",
]

log = logging.getLogger(__name__)

#: Environment variable naming the directory of the file-backed recorders (one file per rank).
FLIGHT_DIR_ENV = "SYNCBN_FLIGHT_DIR"
#: Records each rank keeps (the oldest are overwritten).
DEFAULT_CAPACITY = 256

FORWARD, BACKWARD, CHECK = 0, 1, 2
_DIRECTIONS = ("forward", "backward", "check")
_OPS = ("all_gather", "all_reduce")
OP_CODES = {name: code for code, name in enumerate(_OPS)}

# File layout: a header, then `capacity` records. Records are little-endian and fixed-size so a
# reader in another process needs nothing but this module.
_MAGIC = b"SBNFLT01"
_HEADER = struct.Struct("<8siiiiq24s")  # magic, rank, world, pid, capacity, written, job
_HEADER_SIZE = 64
# seq in group, time, bytes, call number, layer tag, op, direction, group name
_RECORD = struct.Struct("<qdqqiBB2x16s")


# Layer tag -> qualified name, for every synchronized layer this process named (the converter names
# them); a file-backed recorder writes them beside its records, so readers in other processes can
# name layers they never built.
_layer_names: dict[int, str] = {}


def register_layer_name(tag: int, name: str) -> None:
    """Remember that layer tag ``tag`` is the layer called ``name`` (in this process and in the
    recorder's names file)."""
    if _layer_names.get(tag) == name:
        return
    _layer_names[tag] = name
    if _recorder is not None:
        _recorder.write_names({tag: name})


def layer_text(tag: float, names: Mapping[int, str] | None = None) -> str:
    """The name of the layer whose tag is ``tag``, quoted, from ``names`` or this process's."""
    name = (names or {}).get(int(tag)) or _layer_names.get(int(tag))
    return repr(name or f"<SyncBatchNorm tag {int(tag)}>")


class FlightRecord(NamedTuple):
    """One recorded collective of a synchronized layer."""

    group: str  #: the process group's name (``"0"`` is the default group)
    seq: int  #: its number among this rank's recorded collectives in ``group`` (from 0)
    op: str  #: ``"all_gather"`` or ``"all_reduce"``
    direction: str  #: ``"forward"``, ``"backward"`` or ``"check"`` (the call-order error path)
    nbytes: int  #: bytes this rank sent
    layer_tag: int  #: the layer's call-order tag (its name: :func:`layer_text`)
    call: int  #: the layer's call number on this rank (from 0), host-side
    time: float  #: ``time.time()`` when it was issued

    def what(self, names: Mapping[int, str] | None = None) -> str:
        """``backward all_gather of 'layer' (call #3, 264 B)``; the layer named from ``names`` (tag
        -> name, e.g. a file's), else from this process's layers."""
        return (
            f"{self.direction} {self.op} of {layer_text(self.layer_tag, names)} "
            f"(call #{self.call + 1}, {self.nbytes} B)"
        )

    def key(self) -> tuple[str, str, int, int, int]:
        """What two ranks must agree on for the same collective."""
        return (self.op, self.direction, self.nbytes, self.layer_tag, self.call)


class FlightRecorder:
    """A ring buffer of :class:`FlightRecord` in memory or in a memory-mapped file.

    Args:
        capacity: records kept.
        path: the file to map (created or truncated), or ``None`` for plain memory.
        rank, world: this process's global rank and the world size (written to the header).
        job: a string identifying the job (``MASTER_ADDR:MASTER_PORT``), so that a reader skips
            files an earlier job left in the same directory.
    """

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        path: str | os.PathLike[str] | None = None,
        rank: int = 0,
        world: int = 1,
        job: str = "",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.rank, self.world, self.path = capacity, rank, world, path
        size = _HEADER_SIZE + capacity * _RECORD.size
        self._file = None
        if path is None:
            self._buffer: bytearray | mmap.mmap = bytearray(size)
        else:
            self._file = open(path, "w+b")
            self._file.truncate(size)
            self._buffer = mmap.mmap(self._file.fileno(), size)
        self._written = 0
        self._group_seq: dict[str, int] = {}
        self._calls: dict[int, int] = {}
        # Once attached (attach_native), the C++ writer's ops and the view of the ring it holds.
        self._native: Any = None
        self._view: torch.Tensor | None = None
        self._job = job.encode()[:24]
        self._write_header()
        self._names_path = None if path is None else _names_path(Path(path))
        if self._names_path is not None:
            self._names_path.write_text("")
            self.write_names(_layer_names)

    def write_names(self, names: Mapping[int, str]) -> None:
        """Append ``names`` (tag -> layer name) to the names file (file-backed recorders)."""
        if self._names_path is not None and names:
            with open(self._names_path, "a") as f:
                f.writelines(f"{tag}\t{name}\n" for tag, name in names.items())

    def _write_header(self) -> None:
        _HEADER.pack_into(
            self._buffer,
            0,
            _MAGIC,
            self.rank,
            self.world,
            os.getpid(),
            self.capacity,
            self._written,
            self._job,
        )

    def attach_native(self) -> None:
        """Hand the ring and its counters to the C++ writer (``csrc/flight.cpp``), which the
        synchronized layer's C++ path records through; from then on this recorder's records and
        call numbers go through it too, so both paths keep one sequence per group and one call
        number per layer. Needs the extension loaded; idempotent."""
        if self._native is not None:
            return
        ops = torch.ops.syncbn
        view = torch.frombuffer(self._buffer, dtype=torch.uint8)
        groups, seqs = list(self._group_seq), list(self._group_seq.values())
        tags, calls = list(self._calls), list(self._calls.values())
        ops.flight_attach(view, self.capacity, self._written, groups, seqs, tags, calls)
        self._native, self._view = ops, view

    def next_call(self, layer_tag: int) -> int:
        """The call number of this call of the layer tagged ``layer_tag`` (0, 1, ...)."""
        if self._native is not None:
            return int(self._native.flight_next_call(layer_tag))
        call = self._calls.get(layer_tag, 0)
        self._calls[layer_tag] = call + 1
        return call

    def current_call(self, layer_tag: int) -> int:
        """The number of the layer's current call (its last :meth:`next_call`; 0 before any)."""
        if self._native is not None:
            return int(self._native.flight_current_call(layer_tag))
        return max(self._calls.get(layer_tag, 1) - 1, 0)

    def record(
        self, group: str, op: int, direction: int, nbytes: int, layer_tag: int, call: int
    ) -> None:
        """Append one collective (``op``: index into ``("all_gather", "all_reduce")``)."""
        if self._native is not None:
            self._native.flight_record(group, op, direction, nbytes, layer_tag, call)
            return
        seq = self._group_seq.get(group, 0)
        self._group_seq[group] = seq + 1
        offset = _HEADER_SIZE + (self._written % self.capacity) * _RECORD.size
        _RECORD.pack_into(
            self._buffer,
            offset,
            seq,
            time.time(),
            nbytes,
            call,
            layer_tag,
            op,
            direction,
            group.encode()[:16],
        )
        self._written += 1
        # The count last: a reader (or a kill) between the two sees the previous count.
        struct.pack_into("<q", self._buffer, 24, self._written)

    def records(self) -> list[FlightRecord]:
        """The kept records, oldest first."""
        return _decode(bytes(self._buffer))[1]

    def close(self) -> None:
        if self._native is not None:
            self._native.flight_detach()  # drops the C++ writer's view before the unmap
            self._native, self._view = None, None
        if isinstance(self._buffer, mmap.mmap):
            self._buffer.close()
        if self._file is not None:
            self._file.close()


def _decode(data: bytes) -> tuple[tuple[int, int, str], list[FlightRecord]]:
    """``((rank, world, job), records oldest first)`` of a recorder's bytes."""
    magic, rank, world, _pid, capacity, written, job = _HEADER.unpack_from(data, 0)
    if magic != _MAGIC:
        raise ValueError("not a SyncBN flight record (bad magic)")
    first = max(0, written - capacity)
    out = []
    for index in range(first, written):
        offset = _HEADER_SIZE + (index % capacity) * _RECORD.size
        seq, when, nbytes, call, tag, op, direction, group = _RECORD.unpack_from(data, offset)
        name = group.rstrip(b"\0").decode(errors="replace")
        out.append(
            FlightRecord(name, seq, _OPS[op], _DIRECTIONS[direction], nbytes, tag, call, when)
        )
    return (rank, world, job.rstrip(b"\0").decode(errors="replace")), out


def _names_path(path: Path) -> Path:
    return path.with_suffix(".names")


def read_flight_file(path: str | os.PathLike[str]) -> tuple[int, str, list[FlightRecord]]:
    """``(rank, job, records)`` of one rank's file."""
    (rank, _world, job), records = _decode(Path(path).read_bytes())
    return rank, job, records


def read_layer_names(directory: str | os.PathLike[str]) -> dict[int, str]:
    """Tag -> layer name from every names file in ``directory``."""
    names: dict[int, str] = {}
    for path in sorted(Path(directory).glob("flight_rank*.names")):
        for line in path.read_text(errors="replace").splitlines():
            tag, _, name = line.partition("\t")
            if tag.isdigit() and name:
                names[int(tag)] = name
    return names


def read_flight_dir(
    directory: str | os.PathLike[str], job: str | None = None
) -> dict[int, list[FlightRecord]]:
    """Every rank's records in ``directory`` (``flight_rank*.bin``), by global rank; with
    ``job``, only the files of that job. Unreadable files are skipped."""
    found: dict[int, list[FlightRecord]] = {}
    for path in sorted(Path(directory).glob("flight_rank*.bin")):
        try:
            rank, file_job, records = read_flight_file(path)
        except (OSError, ValueError, struct.error):
            continue
        if job is None or file_job == job:
            found[rank] = records
    return found


# ------------------------------------------------------------------------------------------------
# The process's recorder
# ------------------------------------------------------------------------------------------------

_recorder: FlightRecorder | None = None


def flight_recorder() -> FlightRecorder:
    """This process's recorder, made on first use: file-backed in ``$SYNCBN_FLIGHT_DIR`` when set
    (and torch.distributed is initialized, which names the rank), else in memory."""
    global _recorder
    if _recorder is None:
        _recorder = _open_recorder()
    return _recorder


def job_key() -> str:
    """This job's key in the recorders' files: ``MASTER_ADDR:MASTER_PORT``."""
    return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"


def _open_recorder() -> FlightRecorder:
    import torch.distributed as dist

    directory = os.environ.get(FLIGHT_DIR_ENV)
    if not (dist.is_available() and dist.is_initialized()):
        return FlightRecorder()
    rank, world = dist.get_rank(), dist.get_world_size()
    if directory:
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            path = Path(directory) / f"flight_rank{rank}.bin"
            return FlightRecorder(path=path, rank=rank, world=world, job=job_key())
        except OSError as exc:
            log.warning("SyncBN flight recorder: cannot map a file in %s (%s)", directory, exc)
    return FlightRecorder(rank=rank, world=world, job=job_key())


def current_recorder() -> FlightRecorder | None:
    """This process's recorder if one was made (no collective recorded yet: ``None``)."""
    return _recorder


def reset_flight_recorder() -> None:
    """Forget this process's recorder (a new job, or a test); the next record makes a new one."""
    global _recorder
    if _recorder is not None:
        _recorder.close()
    _recorder = None


def next_call(layer_tag: int) -> int:
    """The host-side call number of this synchronized call of the layer (-1 while compiling)."""
    if torch.compiler.is_compiling():
        return -1
    return flight_recorder().next_call(layer_tag)


def check_note(layer_tag: int) -> tuple[int, int, int]:
    """The note of the error-path gather of the layer's current call (its call-order check)."""
    if torch.compiler.is_compiling():
        return CHECK, layer_tag, -1
    return CHECK, layer_tag, flight_recorder().current_call(layer_tag)


def record(group: str, op: str, tensor: torch.Tensor, note: tuple[int, int, int]) -> None:
    """Record a collective ``op`` of ``tensor`` in ``group`` about to be issued; ``note`` is
    ``(direction, layer_tag, call)`` (nothing is recorded for ``call`` -1 or while compiling)."""
    direction, layer_tag, call = note
    if call < 0 or torch.compiler.is_compiling():
        return
    nbytes = tensor.numel() * tensor.element_size()
    flight_recorder().record(group, OP_CODES[op], direction, nbytes, layer_tag, call)
