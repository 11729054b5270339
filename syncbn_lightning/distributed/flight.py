"""The flight recorder: every rank's last SyncBN collectives, for the error that names where the
ranks' sequences parted.

Collectives pair up by their order in a process group. When a job hangs or fails in one, the
question is which call each rank was in, and the first one at which the ranks did different
things. Every collective of a synchronized layer (forward exchange, backward sums, and the
error-path gather of the call-order check) is recorded *before* it is issued: the group and its
sequence number in that group, the op, the direction, the bytes, the layer tag and the layer's
call number. Recording is one fixed-size write into a ring buffer of :data:`DEFAULT_CAPACITY`
records (from C++ on the layer's C++ path, ``csrc/layer/flight.cpp``; its cost is in
``benchmarks/bench_host.py``). Nothing is recorded while ``torch.compile`` traces or a CUDA
graph replays.

**A recorder belongs to a job** (one default process group): the process's recorder is made on
the first collective and made anew when torch's default group is no longer the one it was made
in. Its ring is plain memory, or, when a flight directory is set (:func:`set_flight_dir`, or the
``SYNCBN_FLIGHT_DIR`` environment variable; :class:`~syncbn_lightning.SyncBNCallback` sets the
trainer's log folder, the training service its run folder), a memory-mapped file in it (the
kernel keeps its pages when the process is killed, and any process can read every rank's file
while the job hangs), laid out as :mod:`.flight_file` says (one new file per rank and job, its
blocks allocated up front); opening it removes the files of all but the last
:func:`flight_keep_jobs` jobs in the folder, never a running job's. When the file or the names
cannot be written, one warning says so and the ring stays in memory: recording never raises.
:func:`report_failure` logs where the ranks' records parted.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._shared import FLIGHT_WRITTEN_OFFSET
from . import flight_report
from .flight_file import (
    BACKWARD,
    CHECK,
    FORWARD,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    OP_CODES,
    RECORD,
    FlightRecord,
    decode,
    map_new_file,
    names_path,
    node_folder,
    prune_jobs,
    read_flight_dir,
    read_flight_file,
    read_layer_names,
)

__all__ = [
    "BACKWARD",
    "CHECK",
    "DEFAULT_CAPACITY",
    "DEFAULT_KEEP_JOBS",
    "FLIGHT_DIR_ENV",
    "KEEP_JOBS_ENV",
    "FORWARD",
    "OP_CODES",
    "FlightRecord",
    "FlightRecorder",
    "check_note",
    "current_recorder",
    "flight_dir",
    "flight_keep_jobs",
    "flight_recorder",
    "job_id",
    "layer_text",
    "next_call",
    "read_flight_dir",
    "read_flight_file",
    "read_layer_names",
    "record",
    "register_layer_name",
    "report_failure",
    "reset_flight_recorder",
    "set_flight_dir",
]

log = logging.getLogger(__name__)

#: Environment variable naming the directory of the file-backed recorders.
FLIGHT_DIR_ENV = "SYNCBN_FLIGHT_DIR"
#: Records each rank keeps (the oldest are overwritten).
DEFAULT_CAPACITY = 256
#: Jobs whose files a flight folder keeps (:func:`flight_keep_jobs`; the variable changes it).
DEFAULT_KEEP_JOBS = 10
KEEP_JOBS_ENV = "SYNCBN_FLIGHT_KEEP_JOBS"
# The default store's key under which the ranks of a job agree on its id.
_JOB_KEY = "syncbn_lightning/flight_job"

# Layer tag -> qualified name of every layer this process named (the converter names them); a
# file-backed recorder writes them beside its records, for readers in other processes.
_layer_names: dict[int, str] = {}
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


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


class FlightRecorder:
    """A ring buffer of :class:`FlightRecord` in memory or in a memory-mapped file.

    Args:
        capacity: records kept.
        path: the file to map, created for this recorder (``FileExistsError`` if it exists: an
            existing file is another recorder's), or ``None`` for plain memory.
        rank, world: this process's global rank and the world size (written to the header).
        job: the job's id (a reader groups the ranks' files by it).

    Raises:
        OSError: when ``path`` cannot be created, sized or mapped (the file is removed again).
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
        self.capacity, self.rank, self.world = capacity, rank, world
        self.path = None if path is None else Path(path)
        self.job = job
        size = HEADER_SIZE + capacity * RECORD.size
        self._buffer: bytearray | mmap.mmap = (
            bytearray(size) if self.path is None else map_new_file(self.path, size)
        )
        self._written = 0
        self._group_seq: dict[str, int] = {}
        self._calls: dict[int, int] = {}
        # Once attached: the C++ writer's ops, and the view whose memory it writes (see close).
        self._native: Any = None
        self._view: torch.Tensor | None = None
        HEADER.pack_into(
            self._buffer, 0, MAGIC, rank, world, os.getpid(), capacity, 0, job.encode()[:24]
        )
        self._names_path = None if self.path is None else names_path(self.path)
        if self._names_path is not None:
            self.write_names(_layer_names)

    def write_names(self, names: Mapping[int, str]) -> None:
        """Append ``names`` (tag -> layer name) to the names file (file-backed recorders); if that
        fails (the disk is full or gone), one warning and no more names are written."""
        if self._names_path is None or not names:
            return
        try:
            with open(self._names_path, "a") as f:
                f.writelines(f"{tag}\t{name}\n" for tag, name in names.items())
        except OSError as exc:
            self._names_path = None
            _warn_once(
                "names",
                "SyncBN flight recorder: cannot write the layers' names beside %s (%s); the "
                "records name layers by tag from now on",
                self.path,
                exc,
            )

    def attach_native(self) -> None:
        """Hand the ring and its counters to the C++ writer (``csrc/layer/flight.cpp``), which the
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
        offset = HEADER_SIZE + (self._written % self.capacity) * RECORD.size
        record = (seq, time.time(), nbytes, call, layer_tag, op, direction, group.encode()[:16])
        RECORD.pack_into(self._buffer, offset, *record)
        self._written += 1
        # The count last: a reader (or a kill) between the two sees the previous count.
        struct.pack_into("<q", self._buffer, FLIGHT_WRITTEN_OFFSET, self._written)

    def records(self) -> list[FlightRecord]:
        """The kept records, oldest first."""
        return decode(bytes(self._buffer))[1]

    def close(self) -> None:
        if self._native is not None:  # the C++ writer keeps the address only (a view needs the
            self._native.flight_detach()  # GIL to be freed): it lets go before the unmap
            self._native, self._view = None, None
        if isinstance(self._buffer, mmap.mmap):
            self._buffer.close()


# --------------------------------------------------- The process's recorder, and where it writes

_recorder: FlightRecorder | None = None
_recorder_world: Any = None  # the default group the recorder was made in
_flight_dir: str | None = None
_keep_jobs: int | None = None


def set_flight_dir(
    path: str | os.PathLike[str] | None, *, keep_jobs: int | None = None
) -> str | None:
    """Keep this process's flight records in files under ``path`` (``None``: the
    ``SYNCBN_FLIGHT_DIR`` environment variable, else memory); returns the folder set before. Takes
    effect with the next job's recorder (the current one is closed, a new one made when used).
    ``keep_jobs``: see :func:`flight_keep_jobs` (``None`` leaves it as it is)."""
    global _flight_dir, _keep_jobs
    if keep_jobs is not None and (type(keep_jobs) is not int or keep_jobs < 0):
        raise ValueError(f"keep_jobs must be an int >= 0 (0: keep all), got {keep_jobs!r}")
    _keep_jobs = _keep_jobs if keep_jobs is None else keep_jobs
    previous, _flight_dir = _flight_dir, None if path is None else str(path)
    reset_flight_recorder()
    return previous


def flight_keep_jobs() -> int:
    """How many jobs' files (the newest, the opening job's included) a job keeps in its node's
    folder when it opens its recorder: :func:`set_flight_dir`'s ``keep_jobs``, else
    ``SYNCBN_FLIGHT_KEEP_JOBS`` (``ValueError`` unless a whole number >= 0), else
    :data:`DEFAULT_KEEP_JOBS` (10); 0 keeps every job's."""
    if _keep_jobs is not None:
        return _keep_jobs
    value = os.environ.get(KEEP_JOBS_ENV, "").strip()
    if value and not value.isdigit():
        raise ValueError(
            f"{KEEP_JOBS_ENV} must be a whole number >= 0 (jobs kept; 0: all), got {value!r}"
        )
    return int(value) if value else DEFAULT_KEEP_JOBS


def flight_dir() -> str | None:
    """Where this process's recorders write: :func:`set_flight_dir`'s folder, else the
    ``SYNCBN_FLIGHT_DIR`` environment variable, else ``None`` (memory)."""
    return _flight_dir or os.environ.get(FLIGHT_DIR_ENV) or None


def flight_recorder() -> FlightRecorder:
    """This process's recorder for the current job (see the module docstring), made on first use
    and anew when torch's default group changed."""
    global _recorder, _recorder_world
    world = dist.distributed_c10d.GroupMember.WORLD if dist.is_available() else None
    if _recorder is not None and _recorder_world is not world:
        reset_flight_recorder()
    if _recorder is None:
        _recorder, _recorder_world = _open_recorder(), world
    return _recorder


def job_id() -> str:
    """The id every rank of this job shares: made by the first rank to ask, kept in the default
    process group's store (``MASTER_ADDR:MASTER_PORT`` where there is none)."""
    fallback = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    try:
        store = dist.distributed_c10d._get_default_store()
        mine = f"{int(time.time())}-{uuid.uuid4().hex[:8]}"
        return bytes(store.compare_set(_JOB_KEY, "", mine)).decode()
    except Exception:  # no store, or one without compare_set: the launcher's address names it
        return fallback


def _open_recorder() -> FlightRecorder:
    if not (dist.is_available() and dist.is_initialized()):
        return FlightRecorder()
    rank, world, job = dist.get_rank(), dist.get_world_size(), job_id()
    directory = flight_dir()
    if directory:
        folder = Path(directory) / node_folder()
        safe = "".join(c if c.isalnum() or c in "-." else "-" for c in job)
        keep = flight_keep_jobs()  # a bad SYNCBN_FLIGHT_KEEP_JOBS raises before a file is made
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for suffix in ("", *(f"-{n}" for n in range(1, 100))):
                path = folder / f"flight_{safe}_rank{rank}{suffix}.bin"
                try:
                    recorder = FlightRecorder(path=path, rank=rank, world=world, job=job)
                except FileExistsError:
                    continue  # another recorder's file (an earlier recorder of this process)
                prune_jobs(folder, keep, job, rank)
                return recorder
            raise FileExistsError(f"flight_{safe}_rank{rank}-1..99.bin all exist")
        except OSError as exc:
            _warn_once(
                f"file:{folder}",
                "SyncBN flight recorder: cannot keep a file in %s (%s); recording in memory",
                folder,
                exc,
            )
    return FlightRecorder(rank=rank, world=world, job=job)


def current_recorder() -> FlightRecorder | None:
    """This process's recorder if one was made (no collective recorded yet: ``None``)."""
    return _recorder


def reset_flight_recorder() -> None:
    """Forget this process's recorder (a new job, or a test); the next record makes a new one."""
    global _recorder, _recorder_world
    if _recorder is not None:
        _recorder.close()
    _recorder, _recorder_world = None, None
    flight_report.reset_report()


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


def report_failure(reason: str, directory: str | os.PathLike[str] | None = None) -> str | None:
    """Log (ERROR, once per job) what the flight records say after ``reason`` failed: every
    rank's records of this job under ``directory`` (default: this process's flight directory),
    and this rank's own. Returns the text (``None`` when already reported or nothing was
    recorded)."""
    own = _recorder
    directory = directory or flight_dir()
    job = own.job if own is not None else None
    by_rank = read_flight_dir(directory, job) if directory else {}
    names = {**_layer_names, **(read_layer_names(directory, job) if directory else {})}
    if own is not None and own.rank not in by_rank:
        by_rank[own.rank] = own.records()
    return flight_report.report_once(reason, by_rank, names, directory)
