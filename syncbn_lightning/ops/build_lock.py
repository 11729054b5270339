"""Compiling an extension under an inter-process lock (:func:`build_locked`), for
:mod:`.build` and the CUDA emulation build (``tests/cuda_emu``).

Builds of one build directory are serialized across processes with an ``flock`` (released by the
kernel if the builder dies); holding it, a leftover ``lock`` file from torch's builder can only come
from a build that was killed, and is removed, where torch marks a build by the file's existence
(2.13 and older); torch 2.14 flocks that file instead and leaves it after every build. A completed
build is marked (:data:`BUILT_MARK`), and later loads of its library take neither the lock nor
ninja's check. A fresh build is announced, then followed by a line every :data:`HEARTBEAT_S`
seconds.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from .._compat import torch_build_lock_is_flock

__all__ = [
    "BUILD_TIMEOUT_ENV",
    "BUILT_MARK",
    "HEARTBEAT_S",
    "MEASURED_BUILD_S",
    "ExtensionBuildError",
    "build_locked",
    "build_running",
]

BUILD_TIMEOUT_ENV = "SYNCBN_BUILD_TIMEOUT"
#: The file a build directory gets once its library is whole (written under the build lock).
BUILT_MARK = ".syncbn_built"
_LOCK_FILE = ".syncbn_build.flock"  # flocked by the process that builds or loads

# The build's messages, wherever they come from, under one logger (users' logs name it).
log = logging.getLogger(f"{__package__}.build")


class ExtensionBuildError(RuntimeError):
    """The C++ extension could not be built or loaded."""


def build_locked(
    name: str,
    directory: Path,
    *,
    sources: list[str],
    include_paths: list[str],
    cflags: list[str],
    ldflags: list[str],
    with_cuda: bool = False,
    cuda_cflags: list[str] | None = None,
    python_module: bool = True,
) -> Any:
    """Compile extension ``name`` in ``directory`` under the inter-process build lock and load it.

    Once a build in ``directory`` has completed (its :data:`BUILT_MARK` file), a shared library
    (``python_module=False``) is loaded at once, without the lock or ninja's check: the
    directory's key already fixes its sources, flags and toolchain, and the ranks of a node load
    it side by side instead of one after another.

    A ``lock`` file that torch's builder left behind (its build was killed) is removed first; the
    wait for another builder is bounded by ``SYNCBN_BUILD_TIMEOUT`` (default 900 s). A fresh build
    is announced in one line and followed by a line every :data:`HEARTBEAT_S` seconds with the
    time elapsed. Also used by the CUDA emulation build in ``tests/cuda_emu``.

    Returns:
        The imported module (``python_module``: a pybind11 extension), or the path of the shared
        library, loaded with ``torch.ops.load_library`` (its operators are ``torch.ops.<ns>``).
    """
    from torch.utils import cpp_extension

    library = directory / f"{name}.so"
    if not python_module and _load_built(name, directory, library):
        return str(library)
    timeout_s = float(os.environ.get(BUILD_TIMEOUT_ENV, "900"))
    with _build_lock(directory, timeout_s):
        if not python_module and _load_built(name, directory, library):
            return str(library)  # another process built it while this one waited
        stale = directory / "lock"
        if stale.exists() and not torch_build_lock_is_flock():
            warnings.warn(
                f"syncbn_lightning: removing a stale build lock {stale} left by a killed build",
                RuntimeWarning,
                stacklevel=3,
            )
            stale.unlink()
        fresh = not library.exists()
        started = time.perf_counter()
        with _heartbeat(name, directory, with_cuda) if fresh else nullcontext():
            loaded = cpp_extension.load(
                name=name,
                sources=sources,
                extra_include_paths=include_paths,
                extra_cflags=cflags,
                extra_cuda_cflags=cuda_cflags or [],
                extra_ldflags=ldflags,
                build_directory=str(directory),
                with_cuda=with_cuda,
                is_python_module=python_module,
                verbose=False,
            )
        (directory / BUILT_MARK).touch()  # under the lock, after the library is whole
    seconds = time.perf_counter() - started
    log.info("extension %s ready in %.1f s (%s)", name, seconds, directory)
    # (torch up to 2.4 returns None for a shared library it loaded, later releases its path)
    return loaded if python_module else str(library)


def _load_built(name: str, directory: Path, library: Path) -> bool:
    """Load ``library`` if a build in ``directory`` completed (:data:`BUILT_MARK`): built from
    exactly these sources and flags (the directory's key), so without the lock or ninja's check.
    False when not built, or when loading fails (removed by hand since: build it again)."""
    if not (directory / BUILT_MARK).exists():
        return False
    try:
        torch.ops.load_library(str(library))
        return True
    except OSError as exc:
        log.info("extension %s: loading %s failed (%s); building it", name, library, exc)
        return False


#: The first build of the CPU kernels, measured on an idle 2-core machine (docs/kernels.md says
#: how); the one figure the announcement, the README and the docs quote.
MEASURED_BUILD_S = 17
#: Seconds between two "still compiling" lines of a build.
HEARTBEAT_S = 10.0


@contextmanager
def _heartbeat(name: str, directory: Path, with_cuda: bool) -> Iterator[None]:
    """One line before a build (nothing else is on screen while it runs), then one every
    :data:`HEARTBEAT_S` seconds with the time elapsed, until the block ends."""
    what = "C++/CUDA" if with_cuda else "C++"
    expected = f"about {MEASURED_BUILD_S} s on an idle 2-core machine"
    expected += ", plus the CUDA kernels" if with_cuda else ""
    log.warning(
        "syncbn_lightning: compiling the %s extension %s once (%s); later runs load it from %s",
        what,
        name,
        expected,
        directory,
    )
    started = time.perf_counter()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            log.warning(
                "syncbn_lightning: still compiling the %s extension, %.0f s so far",
                what,
                time.perf_counter() - started,
            )

    thread = threading.Thread(target=beat, name="syncbn-build-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def build_running(directory: Path) -> bool:
    """Whether a process (this one or another) holds the build lock of ``directory`` now: a
    build there is under way, or a process is loading what one left."""
    try:
        handle = open(directory / _LOCK_FILE, "a")
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


@contextmanager
def _build_lock(directory: Path, timeout_s: float) -> Iterator[None]:
    """Exclusive inter-process lock on ``directory``; raises after ``timeout_s`` of waiting."""
    with open(directory / _LOCK_FILE, "w") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ExtensionBuildError(
                        f"waited {timeout_s:.0f} s for another process building the extension in "
                        f"{directory}; if no build is running, that process is hung: kill it, or "
                        f"raise {BUILD_TIMEOUT_ENV}"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
