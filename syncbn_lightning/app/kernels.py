"""The C++ extension of a job of the service: built on first use (or loaded from the cache) before
training, on a line of its own, while the node's other ranks start as soon as a core is free.

A first build compiles two units at once (``ops/build_units.py``); on a 2-core machine the shorter
one ends several seconds before the other, and the core it frees is where the job's other ranks
import torch and Lightning (:meth:`KernelBuild.wait_for_a_free_core`). They then wait for the
build's lock and load what it built. With a warm cache, or with more cores than units, nothing
waits.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

__all__ = ["KernelBuild", "prepare_kernels"]

log = logging.getLogger("train")

#: How often :meth:`KernelBuild.wait_for_a_free_core` looks at the build's directory.
POLL_S = 0.2


def _uses_kernels(cfg: DictConfig) -> bool:
    """Whether the job's layers use the C++ extension: synchronized, not the reference."""
    return bool(cfg.bn.sync) and cfg.bn.implementation != "ref"


def prepare_kernels(cfg: DictConfig) -> float | None:
    """Build (first run) or load (cached) the C++ extension before training starts, so that the
    build neither runs inside the first training step (whose time the progress bar's ETA extends
    to the whole run) nor writes into the bar's line; says which, with its time, on a line of its
    own.

    Nothing is done with ``bn.sync=false`` or ``bn.implementation=ref``. With ``auto`` a failed
    build is logged in one line and training goes on with the pure-PyTorch reference (the layers
    warn once with the cause); with ``ext`` the :class:`~syncbn_lightning.ExtensionBuildError`
    propagates.

    Returns:
        The seconds the build or load took, or ``None`` when nothing was loaded.
    """
    from syncbn_lightning.ops.build import ExtensionBuildError, build_dir, load_extension
    from syncbn_lightning.ops.build_lock import build_running

    if not _uses_kernels(cfg):
        return None
    directory = build_dir()
    cached = any(directory.glob("*.so"))
    another = not cached and build_running(directory)  # this rank waits for another's build
    backend_log = logging.getLogger("syncbn_lightning.ops.build")
    level = backend_log.level
    backend_log.setLevel(max(logging.WARNING, backend_log.getEffectiveLevel()))  # one line: ours
    started = time.perf_counter()
    try:
        load_extension()
    except ExtensionBuildError as e:
        if cfg.bn.implementation == "ext":
            raise
        log.warning(
            "kernels: the C++ extension could not be built (%s); training uses the pure-PyTorch "
            "reference (same results, slower)",
            str(e).splitlines()[0][:300],
        )
        return None
    finally:
        backend_log.setLevel(level)
    seconds = time.perf_counter() - started
    how = "compiled (once; later runs load it)"
    if cached or another:
        how = "loaded from the cache" if cached else "loaded once another process built it"
    log.info("kernels: C++ extension %s in %.1f s (%s)", how, seconds, directory)
    return seconds


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class KernelBuild:
    """:func:`prepare_kernels` on a thread of its own, started at once.

    :meth:`wait_for_a_free_core` returns when the build is done or compiles fewer units than
    this process has cores (a build directory whose ninja file an earlier, killed build wrote is
    not read: the wait then lasts to the build's end); :meth:`result` waits for it and returns
    :func:`prepare_kernels`'s result, or raises its error. :meth:`settle` is for the way out: a
    build still running then is waited for, so that no half-written build is left behind by an
    error of the main thread (a Ctrl-C in a terminal stops the compiler itself, which ends it).
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._started = time.time()
        self._seconds: float | None = None
        self._error: BaseException | None = None
        self._directory: Path | None = None
        if _uses_kernels(cfg):
            from syncbn_lightning.ops.build import build_dir

            self._directory = build_dir()
        self._thread = threading.Thread(
            target=self._run, args=(cfg,), name="syncbn-kernel-build", daemon=True
        )
        self._thread.start()

    def _run(self, cfg: DictConfig) -> None:
        try:
            self._seconds = prepare_kernels(cfg)
        except BaseException as exc:  # handed to the caller by result()
            self._error = exc

    def compiling(self) -> int | None:
        """Units the build is compiling now: the object files its ninja file names that were
        not written since the build started (``None``: no build of this run has begun)."""
        if self._directory is None:
            return None
        ninja = self._directory / "build.ninja"
        try:
            if ninja.stat().st_mtime < self._started - 1.0:
                return None  # an earlier build's file: this run's may not have begun
            objects = re.findall(r"^build (\S+\.o):", ninja.read_text(), re.MULTILINE)
        except OSError:
            return None
        if not objects:  # torch writes the file in place: read while written, it names none yet
            return None
        done = 0
        for name in objects:
            try:
                done += (self._directory / name).stat().st_mtime >= self._started
            except OSError:
                continue
        return len(objects) - done

    def wait_for_a_free_core(self) -> None:
        """Return once the build is done, or compiles fewer units than this process has cores."""
        cores = _cores()
        while self._thread.is_alive():
            running = self.compiling()
            if running is not None and running < cores:
                return
            self._thread.join(POLL_S)

    def raise_if_failed(self) -> None:
        """Raise the build's error now if it has already ended with one."""
        if not self._thread.is_alive() and self._error is not None:
            raise self._error

    def result(self, stop: Callable[[], bool] | None = None) -> float | None:
        """Wait for the build; :func:`prepare_kernels`'s result, or its error raised here.

        Raises:
            RuntimeError: when ``stop()`` turns true first (the launcher saw a rank die).
        """
        while self._thread.is_alive():
            if stop is not None and stop():
                raise RuntimeError("a rank of the job ended while the C++ extension was built")
            self._thread.join(POLL_S)
        if self._error is not None:
            raise self._error
        return self._seconds

    def settle(self) -> None:
        """Wait for a build still running (the way out of an error); says so on a line first."""
        if self._thread.is_alive():
            log.info("kernels: waiting for the C++ extension's build to end before exiting")
            self._thread.join()
