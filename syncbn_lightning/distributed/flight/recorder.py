"""Which recorder a SyncBN job writes, and where, and what it records: the API of the flight
recorder, which :mod:`syncbn_lightning.distributed.flight` re-exports (see it for what is
recorded, when, and where the files go)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..job import SyncJob, current_job, on_job_end, store_job_id
from . import report
from .file import (
    BACKWARD,
    CHECK,
    FORWARD,
    OP_CODES,
    FlightRecord,
    layer_names,
    layer_text,
    read_flight_dir,
    read_flight_file,
    read_layer_names,
)
from .folder import node_folder, prune_jobs
from .writer import DEFAULT_CAPACITY, FlightRecorder, warn_once

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
    "layer_names",
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
#: Jobs whose files a flight folder keeps (:func:`flight_keep_jobs`; the variable changes it).
DEFAULT_KEEP_JOBS = 10
KEEP_JOBS_ENV = "SYNCBN_FLIGHT_KEEP_JOBS"


def register_layer_name(tag: int, name: str) -> None:
    """Remember that layer tag ``tag`` is the layer called ``name`` (in this process and in the
    recorder's names file)."""
    if layer_names.get(tag) == name:
        return
    layer_names[tag] = name
    recorder = _live_recorder()
    if recorder is not None:
        recorder.write_names({tag: name})


# --------------------------------------------------- The process's recorder, and where it writes

# The recorder outside a job (torch.distributed not initialized): memory only. A job keeps its own
# (:class:`~.job.SyncJob`), closed when the job ends; the last ended job's stays readable.
_recorder: FlightRecorder | None = None
_last_job_recorder: FlightRecorder | None = None
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
    """This process's recorder for the running job (see the module docstring), made on first use
    and kept by the job (:class:`~.job.SyncJob`, which closes it when it ends); outside a job,
    one in memory."""
    global _recorder
    job = current_job()
    if job is None:
        if _recorder is None:
            _recorder = FlightRecorder()
        return _recorder
    if job.recorder is None:
        if _recorder is not None:  # the records before the job are not the job's
            reset_flight_recorder()
        job.recorder = _open_recorder(job.id)
    return job.recorder  # type: ignore[return-value]


def job_id() -> str:
    """The id every rank of the running job shares (:attr:`.job.SyncJob.id`); outside a job,
    the launcher's address (``MASTER_ADDR:MASTER_PORT``)."""
    job = current_job()
    return job.id if job is not None else store_job_id()


def _open_recorder(job: str) -> FlightRecorder:
    """The running job's recorder: file-backed in the flight directory's node folder when one is
    set (pruning older jobs' files there), else, or when that fails (one warning), in memory."""
    rank, world = dist.get_rank(), dist.get_world_size()
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
            warn_once(
                f"file:{folder}",
                "SyncBN flight recorder: cannot keep a file in %s (%s); recording in memory",
                folder,
                exc,
            )
    return FlightRecorder(rank=rank, world=world, job=job)


def _live_recorder() -> FlightRecorder | None:
    """The recorder being written: the running job's, else the one outside a job (``None`` when
    neither was made)."""
    job = current_job(create=False)
    if job is not None and job.recorder is not None:
        return job.recorder  # type: ignore[return-value]
    return _recorder


def current_recorder() -> FlightRecorder | None:
    """This process's recorder if one was made (no collective recorded yet: ``None``): the
    running job's, else the one outside a job, else the last ended job's (closed, readable)."""
    recorder = _live_recorder()
    return recorder if recorder is not None else _last_job_recorder


def reset_flight_recorder() -> None:
    """Close and forget this process's recorder (a new flight folder, or a test); the next record
    makes a new one (the running job's, with a new file)."""
    global _recorder, _last_job_recorder
    job = current_job(create=False)
    recorders = [_recorder, job.recorder if job is not None else None]
    _recorder = _last_job_recorder = None
    if job is not None:
        job.recorder = None
    for recorder in recorders:
        if recorder is not None:
            recorder.close()  # type: ignore[union-attr]
    report.reset_report()


def _job_ended(job: SyncJob, had_signal: bool) -> None:
    global _last_job_recorder
    if job.recorder is not None:  # closed by the job: kept for reading until the next job's
        _last_job_recorder = job.recorder  # type: ignore[assignment]
    report.reset_report()  # the next job reports its own failure


on_job_end(_job_ended)


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
    own = current_recorder()
    directory = directory or flight_dir()
    job = own.job if own is not None else None
    by_rank = read_flight_dir(directory, job) if directory else {}
    names = {**layer_names, **(read_layer_names(directory, job) if directory else {})}
    if own is not None and own.rank not in by_rank:
        by_rank[own.rank] = own.records()
    return report.report_once(reason, by_rank, names, directory)
