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

**A recorder belongs to a job** (:class:`~.job.SyncJob`, one default process group): the job's
recorder is made on its first collective and closed when the job ends. Its ring is plain memory, or,
when a flight directory is set (:func:`set_flight_dir`, or the ``SYNCBN_FLIGHT_DIR`` environment
variable; :class:`~syncbn_lightning.SyncBNCallback` sets the trainer's log folder, the training
service its run folder), a memory-mapped file in it (the kernel keeps its pages when the process is
killed, and any process can read every rank's file while the job hangs), laid out as
:mod:`.file` says (one new file per rank and job, its blocks allocated up front); opening it
removes the files of all but the last :func:`flight_keep_jobs` jobs in the folder, never a running
job's. When the file or the names cannot be written, one warning says so and the ring stays in
memory: recording never raises. :func:`report_failure` logs where the ranks' records parted.

The folder's files: ``recorder.py`` (which recorder a job writes, and where; what it records),
``writer.py`` (the ring, in memory or a memory-mapped file, written from Python or by the C++
writer), ``file.py`` (the files' layout and reading, the one ``layer_text``), ``folder.py`` (node
folders, pruning old jobs' files) and ``report.py`` (where the ranks parted; ``syncbn-flight``).
Only the recorder and the writer import torch (this package itself imports nothing), so that the
report CLI reads a folder without importing torch.
"""

import importlib
from typing import Any

#: The package's modules: ``from syncbn_lightning.distributed.flight import report`` asks the
#: package for the name before it imports the module, which must not import the recorder (torch).
_MODULES = {"file", "folder", "recorder", "report", "writer"}


def __getattr__(name: str) -> Any:
    """The recorder's ``name`` (``syncbn_lightning.distributed.flight.set_flight_dir``, as the docs
    name it, and the module path of the recorder before it was a folder), imported on first use,
    then kept here: the package itself imports no torch."""
    if name in _MODULES or name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(".recorder", __name__), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value
