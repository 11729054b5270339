"""The flight recorder belongs to a job, keeps its files wherever the job was launched, never
touches another job's file and never raises (issue 49, items 1 and 2).

* A new default process group (a new job in the same process) gets a new recorder: its rank,
  world, sequence numbers and file are the new job's.
* Files: ``<dir>/node<N>/flight_<job>_rank<R>.bin``, created exclusively (an existing file, another
  job's, is neither truncated nor mapped), removed again when it cannot be sized or mapped; a disk
  that refuses the file or the names gives one warning and the in-memory ring.
* Where: ``set_flight_dir`` (plain PyTorch), ``SYNCBN_FLIGHT_DIR``, and ``SyncBNCallback``'s
  default, the trainer's log folder.
* ``syncbn-flight`` reads a folder without importing torch, in under a second.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _lightning import BNNet, trainer

from syncbn_lightning import SyncBatchNorm, SyncBNCallback, convert_sync_batchnorm
from syncbn_lightning.distributed.flight import recorder as flight
from syncbn_lightning.distributed.flight import recorder as flight_recorder
from syncbn_lightning.distributed.flight import writer as flight_writer
from syncbn_lightning.distributed.flight.file import HEADER, jobs_in, read_flight_dir
from syncbn_lightning.distributed.flight.folder import in_use, node_folder, prune_jobs


@pytest.fixture(autouse=True)
def _fresh_recorder(monkeypatch):
    # Not the session's folder (conftest.py): these tests name theirs, or check the default.
    monkeypatch.delenv(flight.FLIGHT_DIR_ENV, raising=False)
    monkeypatch.delenv(flight.KEEP_JOBS_ENV, raising=False)
    flight.set_flight_dir(None)
    yield
    flight.set_flight_dir(None)


def _job(tmp_path: Path, name: str) -> None:
    """One job of one rank: a synchronized layer's forward and backward."""
    store = tmp_path / f"store-{name}"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        layer = SyncBatchNorm(3, force_sync=True)
        layer.set_sync_name(f"{name}.bn")
        layer(torch.randn(4, 3, requires_grad=True)).sum().backward()
    finally:
        dist.destroy_process_group()


def _ring_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("flight_*rank*.bin"))


def test_each_job_in_a_process_gets_its_own_recorder_and_file(tmp_path: Path) -> None:
    flight.set_flight_dir(tmp_path / "records")
    _job(tmp_path, "first")
    first = flight.current_recorder()
    _job(tmp_path, "second")
    second = flight.current_recorder()
    assert second is not first and second.job != first.job
    assert [r.seq for r in second.records()] == [0, 1]  # its own sequence, from 0
    files = _ring_files(tmp_path / "records")
    assert len(files) == 2 and all(f.parent.name.startswith(("node", "host-")) for f in files)
    assert jobs_in(tmp_path / "records") == [first.job, second.job]
    for job, name in ((first.job, "first"), (second.job, "second")):
        (records,) = read_flight_dir(tmp_path / "records", job).values()
        assert [r.direction for r in records] == ["forward", "backward"], name


def test_an_existing_file_is_neither_truncated_nor_mapped(tmp_path: Path) -> None:
    path = tmp_path / "flight_job_rank0.bin"
    path.write_bytes(b"another job's records")
    with pytest.raises(FileExistsError):
        flight.FlightRecorder(path=path)
    assert path.read_bytes() == b"another job's records"
    flight.set_flight_dir(tmp_path / "records")
    _job(tmp_path, "one")
    made = _ring_files(tmp_path / "records")
    flight.reset_flight_recorder()  # a second recorder of the same job: another file
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s2", rank=0, world_size=1)
    try:
        flight.flight_recorder()
    finally:
        dist.destroy_process_group()
    assert made[0].exists() and len(_ring_files(tmp_path / "records")) == 2


def test_a_file_that_cannot_be_mapped_is_removed(tmp_path: Path, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise OSError("no map for you")

    monkeypatch.setattr(flight_writer.mmap, "mmap", refuse)
    path = tmp_path / "flight_job_rank0.bin"
    with pytest.raises(OSError, match="no map for you"):
        flight.FlightRecorder(path=path)
    assert not path.exists()


def test_an_unwritable_disk_gives_one_warning_and_the_memory_ring(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """The ring's file cannot be made (ENOSPC at fallocate), then the names cannot be written:
    one warning each, records in memory, no exception from the converter or the layer."""

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(flight_writer.os, "posix_fallocate", full)
    monkeypatch.setattr(flight_writer, "_warned", set())
    flight.set_flight_dir(tmp_path / "records")
    with caplog.at_level(logging.WARNING, logger=flight_recorder.log.name):
        for name in ("a", "b"):
            _job(tmp_path, name)
    recorder = flight.current_recorder()
    assert recorder.path is None and len(recorder.records()) == 2  # in memory
    assert not _ring_files(tmp_path / "records")
    warnings = [r for r in caplog.records if "cannot keep a file" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    # A job's recorder whose names file fails later: converting a model still works.
    monkeypatch.undo()
    flight.set_flight_dir(tmp_path / "records")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store-c", rank=0, world_size=1)
    try:
        assert flight.flight_recorder().path is not None
        monkeypatch.setattr(flight_writer, "_warned", set())

        def no_names(*args, **kwargs):
            raise OSError(30, "Read-only file system")

        monkeypatch.setattr("builtins.open", no_names)
        with caplog.at_level(logging.WARNING, logger=flight_recorder.log.name):
            # New names (a name this process registered before is not written again).
            for name in ("unwritable_first", "unwritable_second"):
                model = torch.nn.ModuleDict({name: torch.nn.BatchNorm1d(3)})
                model = convert_sync_batchnorm(model)
        monkeypatch.undo()
    finally:
        dist.destroy_process_group()
    assert isinstance(model["unwritable_second"], SyncBatchNorm)
    assert sum("cannot write the layers' names" in r.getMessage() for r in caplog.records) == 1


def test_the_flight_package_imports_its_modules_without_torch() -> None:
    """``from ...flight import report`` (app/launch.py's form) asks the package for ``report``
    before importing the module: that must not load the recorder, and torch with it. The
    recorder's names still resolve on the package (the docs' dotted paths)."""
    code = (
        "import sys\n"
        "from syncbn_lightning.distributed.flight import file, folder, report\n"
        "print('torch' in sys.modules)\n"
        "import syncbn_lightning.distributed.flight as flight\n"
        "print(flight.set_flight_dir.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "syncbn_lightning.distributed.flight.recorder"], (
        done.stdout
    )


def test_syncbn_flight_reads_a_folder_without_torch_in_under_a_second(tmp_path: Path) -> None:
    flight.set_flight_dir(tmp_path / "records")
    _job(tmp_path, "read")
    code = (
        "import sys, time\n"
        "start = time.perf_counter()\n"
        "from syncbn_lightning.distributed.flight.report import main\n"
        "code = main([sys.argv[1]])\n"
        "print('torch' in sys.modules, round(time.perf_counter() - start, 3), code)\n"
    )
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "records")],
        capture_output=True,
        text=True,
        check=True,
    )
    torch_loaded, seconds, code = done.stdout.strip().splitlines()[-1].split()
    assert torch_loaded == "False", done.stdout
    assert float(seconds) < 1.0, done.stdout
    assert code == "0" and "forward all_gather of 'read.bn'" in done.stdout, done.stdout
    assert time.perf_counter() - started < 10


def _plain_rank(rank: int, world: int, directory: str) -> list[str]:
    flight.set_flight_dir(directory)
    net = convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
    net(torch.randn(2, 3, requires_grad=True)).sum().backward()
    return [p.name for p in Path(directory).rglob("flight_*rank*.bin")]


@pytest.mark.slow
@pytest.mark.distributed
def test_plain_pytorch_keeps_records_where_set_flight_dir_says(tmp_path: Path) -> None:
    run_distributed(_plain_rank, 2, str(tmp_path / "records"), timeout=120)
    by_rank = read_flight_dir(tmp_path / "records")
    assert sorted(by_rank) == [0, 1]
    assert all(len(records) == 2 for records in by_rank.values())


@pytest.mark.distributed
@pytest.mark.slow
def test_the_callback_keeps_records_in_the_trainers_log_folder(tmp_path: Path) -> None:
    trainer(2, [SyncBNCallback()], default_root_dir=str(tmp_path)).fit(BNNet())
    folder = tmp_path / ".syncbn"
    by_rank = read_flight_dir(folder)
    assert sorted(by_rank) == [0, 1], list(folder.rglob("*"))
    assert len({r.call for r in by_rank[0]}) >= 4  # the layers' calls of the training steps


def test_the_callback_puts_the_process_folder_back_after_the_fit(tmp_path: Path) -> None:
    """The trainer's folder is this fit's: a later job of the process (here a one-process fit
    with the callback) keeps its records where it would have before."""
    before = flight.set_flight_dir(None)
    try:
        trainer(1, [SyncBNCallback()], strategy="auto", default_root_dir=str(tmp_path)).fit(BNNet())
        assert flight.flight_dir() is None
        flight.set_flight_dir(tmp_path / "mine")
        trainer(1, [SyncBNCallback()], strategy="auto", default_root_dir=str(tmp_path)).fit(BNNet())
        assert flight.flight_dir() == str(tmp_path / "mine")
    finally:
        flight.set_flight_dir(before)


# ------------------------------------------------------------------------------------------------
# Bounded: a folder keeps the last N jobs; running out of names warns; readers read one job
# ------------------------------------------------------------------------------------------------


def test_a_folder_keeps_the_last_jobs_and_removes_older_ones_when_a_job_opens(
    tmp_path: Path, monkeypatch
) -> None:
    folder = tmp_path / "records"
    flight.set_flight_dir(folder, keep_jobs=3)
    try:
        jobs = []
        for n in range(5):
            _job(tmp_path, f"job{n}")
            jobs.append(flight.current_recorder().job)
            assert jobs_in(folder) == jobs[-3:], n
        assert len(_ring_files(folder)) == 3
        assert len(list(folder.rglob("*.names"))) == 3  # the names go with their ring
        # The default, and the variable that changes it.
        flight.set_flight_dir(folder, keep_jobs=0)
        assert flight.flight_keep_jobs() == 0
        _job(tmp_path, "kept")
        assert len(jobs_in(folder)) == 4  # 0: nothing removed
    finally:
        flight.set_flight_dir(None, keep_jobs=flight.DEFAULT_KEEP_JOBS)
    assert flight.flight_keep_jobs() == flight.DEFAULT_KEEP_JOBS == 10
    monkeypatch.setattr(flight_recorder, "_keep_jobs", None)
    monkeypatch.setenv(flight.KEEP_JOBS_ENV, "1")
    assert flight.flight_keep_jobs() == 1
    flight.set_flight_dir(folder)
    _job(tmp_path, "alone")
    assert jobs_in(folder) == [flight.current_recorder().job]
    with pytest.raises(ValueError, match="keep_jobs must be an int >= 0"):
        flight.set_flight_dir(folder, keep_jobs=-1)
    for bad in ("-1", "ten", "2.5"):
        monkeypatch.setenv(flight.KEEP_JOBS_ENV, bad)
        with pytest.raises(ValueError, match=f"SYNCBN_FLIGHT_KEEP_JOBS must be .* got '{bad}'"):
            flight.flight_keep_jobs()


def test_a_running_jobs_file_is_kept_however_old(tmp_path: Path) -> None:
    """A job that has written nothing for a while (a long evaluation) while newer jobs opened in
    its folder keeps its file as long as its recorder lives; once closed, the next job's opening
    removes it."""
    folder = tmp_path / "records"
    flight.set_flight_dir(folder, keep_jobs=2)
    node = folder / node_folder()  # the folder this process's jobs write and prune
    node.mkdir(parents=True)
    idle = flight.FlightRecorder(capacity=8, path=node / "flight_idlejob_rank0.bin", job="idlejob")
    try:
        assert in_use(idle.path)
        hours_ago = time.time() - 7200
        os.utime(idle.path, (hours_ago, hours_ago))
        for n in range(3):
            _job(tmp_path, f"job{n}")
        assert idle.path.exists() and "idlejob" in jobs_in(folder)
    finally:
        idle.close()
        flight.set_flight_dir(None, keep_jobs=flight.DEFAULT_KEEP_JOBS)
    assert not in_use(idle.path)
    flight.set_flight_dir(folder, keep_jobs=2)
    _job(tmp_path, "after")
    assert not idle.path.exists() and len(jobs_in(folder)) == 2


def test_running_out_of_file_names_warns_once_and_records_in_memory(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """Every name (``flight_<job>_rank0.bin``, ``-1`` ... ``-99``) taken: the fallback to memory
    says so, as every other fallback does."""

    real_open = os.open

    def taken(path, flags, *args, **kwargs):
        if "flight_" in str(path) and flags & os.O_EXCL:
            raise FileExistsError(17, "File exists", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", taken)
    monkeypatch.setattr(flight_writer, "_warned", set())
    flight.set_flight_dir(tmp_path / "records")
    with caplog.at_level(logging.WARNING, logger=flight_recorder.log.name):
        for name in ("a", "b"):
            _job(tmp_path, name)
    assert flight.current_recorder().path is None
    warnings = [r.getMessage() for r in caplog.records if "cannot keep a file" in r.getMessage()]
    assert len(warnings) == 1 and "all exist" in warnings[0], caplog.text


def test_syncbn_flight_and_the_failure_report_read_only_the_job_they_report(
    tmp_path: Path, monkeypatch
) -> None:
    from syncbn_lightning.distributed.flight import file as flight_file
    from syncbn_lightning.distributed.flight import report as flight_report

    folder = tmp_path / "records"
    flight.set_flight_dir(folder)
    for name in ("old", "older", "latest"):
        _job(tmp_path, name)
    latest = flight.current_recorder()
    flight.set_flight_dir(None)  # closes the recorders: what syncbn-flight sees after a job
    read: list[Path] = []
    real = flight_file.read_flight_file

    def counting(path):
        read.append(Path(path))
        return real(path)

    monkeypatch.setattr(flight_file, "read_flight_file", counting)
    assert flight_report.main([str(folder)]) == 0
    assert read == [latest.path], read
    read.clear()
    assert sorted(flight.read_flight_dir(folder, latest.job)) == [0]
    assert read == [latest.path], read


def _ring_of(path: Path, job: str, pid: int | None = None) -> Path:
    """A closed ring file of ``job`` whose header names ``pid`` (default: the process that wrote
    it, this one)."""
    recorder = flight.FlightRecorder(capacity=4, path=path, job=job)
    recorder.close()
    if pid is not None:
        data = bytearray(path.read_bytes())
        magic, rank, world, _pid, *rest = HEADER.unpack_from(data, 0)
        HEADER.pack_into(data, 0, magic, rank, world, pid, *rest)
        path.write_bytes(bytes(data))
    return path


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    return int(done.stdout)


@pytest.mark.parametrize("lock", ["no fcntl", "flock fails"])
def test_without_flock_a_file_whose_writer_lives_is_kept(tmp_path: Path, monkeypatch, lock) -> None:
    """Where flock cannot be asked (Lustre without -o flock, some NFS), a ring file counts as in
    use while the process its header names lives: a live job's file stays, a dead one's goes."""
    from syncbn_lightning.distributed.flight import folder as flight_folder

    folder = tmp_path / "node"
    folder.mkdir()
    live = _ring_of(folder / "flight_livejob_rank0.bin", "livejob")  # this process: alive
    dead = _ring_of(folder / "flight_deadjob_rank0.bin", "deadjob", _dead_pid())
    old = time.time() - 3600
    for path in (live, dead):
        os.utime(path, (old, old))
    if lock == "no fcntl":
        monkeypatch.setattr(flight_folder, "fcntl", None)
    else:

        def no_lock(fd: int, operation: int) -> None:
            raise OSError(37, "No locks available")  # ENOLCK

        monkeypatch.setattr(flight_folder.fcntl, "flock", no_lock)
    assert in_use(live) and not in_use(dead)
    removed = prune_jobs(folder, 1, "newjob")
    assert dead in removed and live.exists() and not dead.exists()


def test_only_the_nodes_first_process_prunes(tmp_path: Path, monkeypatch) -> None:
    """Every rank of a node opens its recorder in the same folder; one prunes it."""
    folder = tmp_path / "node"
    folder.mkdir()
    old = _ring_of(folder / "flight_oldjob_rank0.bin", "oldjob", _dead_pid())
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert prune_jobs(folder, 1, "newjob", rank=1) == [] and old.exists()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert prune_jobs(folder, 1, "newjob", rank=0) == [] and old.exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert old in prune_jobs(folder, 1, "newjob", rank=4) and not old.exists()
