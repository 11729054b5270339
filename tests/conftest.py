"""Shared test configuration: GPU auto-skip, the session's flight folder, queued call-order flags,
and (with ``SYNCBN_PATH_REPORT``) the report of which path each test's layers took
(``_path_report.py``).

Every SyncBN flight record the suite writes (``distributed/flight.py``), in this process and in
every process it starts, goes to one temporary folder made for the session
(``SYNCBN_FLIGHT_DIR``) and removed at its end: never into the checkout (a callback's default
folder is ``.syncbn`` under the working directory). A test of where records go by default removes
the variable itself (``monkeypatch.delenv``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

FLIGHT_DIR_ENV = "SYNCBN_FLIGHT_DIR"
_session_flight_dir: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    import _path_report

    _path_report.install()  # SYNCBN_PATH_REPORT only: which path each test's layers took
    folder = tempfile.mkdtemp(prefix="syncbn-flight-")
    _session_flight_dir.append(folder)
    os.environ[FLIGHT_DIR_ENV] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _session_flight_dir:
        shutil.rmtree(folder, ignore_errors=True)
        if os.environ.get(FLIGHT_DIR_ENV) == folder:
            del os.environ[FLIGHT_DIR_ENV]


@pytest.fixture
def inline_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For a test that compiles a module holding SyncBN whole: dynamo's switch that torch 2.4
    needs to set the attributes of a compiled module's submodules, on for the test, in this
    process and (by its environment variable) in the processes it starts; the default of the
    later releases, left alone there (2.13 deprecates it: always on; docs/kernels.md gives it to
    users)."""
    from syncbn_lightning._torch import release

    if release(torch.__version__)[:2] >= (2, 8):
        yield
        return
    monkeypatch.setenv("TORCHDYNAMO_INLINE_INBUILT_NN_MODULES", "1")
    with torch._dynamo.config.patch(inline_inbuilt_nn_modules=True):
        yield


@pytest.fixture
def queued_flags() -> Iterator[None]:
    """CPU calls leave their call-order flags for later, as CUDA calls do (the device path's
    logic on CPU tensors); the queue is emptied after the test."""
    from syncbn_lightning.distributed.call_order import checks as call_order
    from syncbn_lightning.distributed.call_order.policy import set_queue_order_flags_on_cpu

    set_queue_order_flags_on_cpu(True)
    try:
        yield
    finally:
        set_queue_order_flags_on_cpu(False)
        call_order._pending.clear()
        if _ring_loaded():
            torch.ops.syncbn.order_ring_clear()


def _ring_loaded() -> bool:
    """Whether the extension (and so the C++ path's order ring) is loaded in this process."""
    from syncbn_lightning.ops import build

    return build._ext_module is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
