"""The flight recorder's writer: a ring of fixed-size records in memory or in a memory-mapped
file, laid out as :mod:`.file` says, written from Python or handed to the C++ writer
(``csrc/layer/flight.cpp``). Which recorder a job writes to, and where, is :mod:`.flight`'s."""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # Windows: pruning tells a running job's files by their header's pid alone
    fcntl = None  # type: ignore[assignment]

from ..._shared import FLIGHT_WRITTEN_OFFSET
from .file import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    RECORD,
    FlightRecord,
    decode,
    layer_names,
    names_path,
)

__all__ = ["DEFAULT_CAPACITY", "FlightRecorder", "map_new_file", "warn_once"]

log = logging.getLogger("syncbn_lightning.distributed.flight")

#: Records each rank keeps (the oldest are overwritten).
DEFAULT_CAPACITY = 256
_warned: set[str] = set()


def warn_once(key: str, message: str, *args: Any) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def map_new_file(path: Path, size: int) -> mmap.mmap:
    """A new file at ``path`` (exclusively: never another recorder's) with ``size`` bytes of
    allocated blocks, mapped; on any failure the file is removed and the error raised (the file
    descriptor is closed either way: the map holds its own). The file is share-locked
    (``flock``) while the map lives, so that :func:`~.folder.prune_jobs` in another
    process never removes a running job's file."""
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


class FlightRecorder:
    """A ring buffer of :class:`FlightRecord` in memory or in a memory-mapped file.

    Args:
        capacity: records kept.
        path: the file to map, created for this recorder (``FileExistsError`` if it exists: an
            existing file is another recorder's), or ``None`` for plain memory.
        rank, world: this process's global rank and the world size (written to the header).
        job: the job's id (a reader groups the ranks' files by it).
        names: tag -> layer name written beside a file's records (``None``: every layer this
            process named so far, :data:`layer_names`).

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
        names: Mapping[int, str] | None = None,
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
            self.write_names(layer_names if names is None else names)

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
            warn_once(
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
        """Stop writing the file: the C++ writer lets go, the file is unmapped and the ring kept
        in memory, so that :meth:`records` still reads it (an ended job's recorder). Idempotent."""
        if self._native is not None:  # the C++ writer keeps the address only (a view needs the
            self._native.flight_detach()  # GIL to be freed): it lets go before the unmap
            self._native, self._view = None, None
        if isinstance(self._buffer, mmap.mmap):
            mapped, self._buffer = self._buffer, bytearray(self._buffer)
            mapped.close()
