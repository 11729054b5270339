"""The C++ extension: lazy JIT build, build cache and import.

Which implementation a layer uses (the extension or the reference) is :mod:`.dispatch`'s choice;
the compile-only check of the CUDA sources (no GPU needed) is :mod:`.compile_check`.

The extension is built on first use, never at import or test collection. Its build directory is
``$SYNCBN_CACHE_DIR/<key>`` (default root ``~/.cache/syncbn_lightning``, created ``0700``), where
the key hashes the sources and headers (paths and bytes), compiler flags, the CUDA architectures
and the visible GPUs' compute capabilities (CUDA builds), the torch/CUDA/Python versions and the
interpreter, so a change of any of them triggers a rebuild and never loads a stale binary. If the
CUDA part fails to build, the CPU kernels are built alone (one warning naming the cause). Builds
are serialized across processes with an ``flock`` (released by the kernel if the builder dies);
holding it, a leftover ``lock`` file from torch's builder can only come from a build that was
killed, and is removed. A completed build is marked, and later loads take neither the lock nor
ninja's check.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .._files import shipped_dir
from .fakes import register_fakes

__all__ = [
    "BUILT_MARK",
    "CUDA_CFLAGS",
    "HEARTBEAT_S",
    "MEASURED_BUILD_S",
    "PRIMITIVES",
    "ExtensionBuildError",
    "build_dir",
    "build_locked",
    "cache_root",
    "csrc_dir",
    "csrc_files",
    "describe_build_dir",
    "include_dir",
    "load_extension",
    "source_key",
]

CACHE_ENV = "SYNCBN_CACHE_DIR"
BUILD_TIMEOUT_ENV = "SYNCBN_BUILD_TIMEOUT"
#: The file a build directory gets once its library is whole (written under the build lock).
BUILT_MARK = ".syncbn_built"

log = logging.getLogger(__name__)


class ExtensionBuildError(RuntimeError):
    """The C++ extension could not be built or loaded."""


def csrc_dir() -> Path:
    """Where the C++/CUDA sources are: a source checkout's ``csrc/`` or the installed copy. Its
    folders: ``include/`` (shared headers: the one include path), ``ops/`` (the step operators,
    host helpers), ``cpu/`` and ``cuda/`` (kernels), ``layer/`` (the layer operator)."""
    hint = "reinstall syncbn_lightning (C++ sources)"
    return shipped_dir("csrc", "_csrc", "include/syncbn.h", ExtensionBuildError, hint)


def include_dir(csrc: Path) -> Path:
    """The include path of ``csrc``'s sources (the kernels' own headers sit beside them)."""
    return csrc / "include"


def csrc_files(csrc: Path, *suffixes: str) -> list[Path]:
    """The files under ``csrc`` (every folder) ending in ``suffixes``, sorted per suffix."""
    return [path for suffix in suffixes for path in sorted(csrc.rglob(f"*{suffix}"))]


def _cuda_build_enabled(csrc: Path) -> bool:
    """Whether to compile the CUDA twins: only with a CUDA torch, a toolkit and ``.cu`` sources."""
    from torch.utils import cpp_extension

    toolkit = torch.version.cuda and torch.cuda.is_available() and cpp_extension.CUDA_HOME
    return bool(toolkit and csrc_files(csrc, ".cu"))


# nvcc flags of the extension's .cu sources (cpp_extension adds its own: c++20, the no-half-
# operator macros, the architectures). No --use_fast_math: the kernels are memory-bound, and its
# approximate division would cost the Welford updates accuracy for no measurable speed.
CUDA_CFLAGS = ("-O3", "-DNDEBUG", "-DWITH_CUDA")


def _cpu_arch_flags() -> list[str]:
    # Named ISA flags rather than -march=native: the cache key then says exactly what the binary
    # needs, and a cache shared by different hosts of the same capability stays valid.
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        return ["-mavx2", "-mfma", "-mf16c"]
    return []


def source_key(files: list[Path], extra: tuple[Any, ...]) -> str:
    """A 16-hex-digit cache key of ``files`` (resolved path and bytes), ``extra`` and the
    toolchain.

    The torch, CUDA and Python versions, the interpreter (its environment's prefix and resolved
    path) and the machine architecture are always part of the key, so a build made by another of
    them is never loaded, and two virtual environments never take turns rebuilding one directory.
    The files' paths are too: ninja's build file names them, so two checkouts of the same sources
    (a clone and a worktree, a clone and an installed wheel) sharing one directory would rebuild
    it in turns, each holding the build lock for the whole compile while every rank that loads
    the extension waits.
    """
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.resolve()).encode())
        digest.update(path.read_bytes())
    for item in (
        *extra,
        torch.__version__,
        torch.version.cuda,
        sys.version_info[:2],
        sys.prefix,
        os.path.realpath(sys.executable),
        platform.machine(),
    ):
        digest.update(repr(item).encode())
    return digest.hexdigest()[:16]


def _cuda_targets() -> tuple[Any, ...]:
    """What a CUDA build is compiled for and run on: cpp_extension's ``-gencode`` flags (from
    ``TORCH_CUDA_ARCH_LIST``, or the visible GPUs when it is unset) and the visible devices'
    compute capabilities. Part of the cache key, so a cache shared by machines with different GPUs
    never loads a binary built for another architecture."""
    from torch.utils import cpp_extension

    try:
        flags: tuple[str, ...] = tuple(cpp_extension._get_cuda_arch_flags())
    except Exception as exc:  # a private helper of torch: it must not break the build
        flags = (f"<arch flags unavailable: {type(exc).__name__}>",)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    capabilities = tuple(torch.cuda.get_device_capability(i) for i in range(count))
    return flags, capabilities


def _build_spec(cuda: bool | None = None) -> dict[str, Any]:
    """Sources, flags and cache key of the extension; ``cuda`` forces the CUDA part on or off
    (``None``: on when torch, a GPU, the toolkit and ``.cu`` sources are all there)."""
    csrc = csrc_dir()
    with_cuda = _cuda_build_enabled(csrc) if cuda is None else cuda
    sources = csrc_files(csrc, ".cpp", *([".cu"] if with_cuda else []))
    cflags = ["-O3", "-DNDEBUG", "-fopenmp", *_cpu_arch_flags()] + (
        ["-DWITH_CUDA"] if with_cuda else []
    )
    cuda_cflags = list(CUDA_CFLAGS) if with_cuda else []
    targets = _cuda_targets() if with_cuda else ()
    headers = csrc_files(csrc, ".h", ".cuh")
    key = source_key(sources + headers, (cflags, cuda_cflags, targets))
    return {
        "name": f"syncbn_lightning_ext_{key}",
        "key": key,
        "sources": [str(p) for p in sources],
        "include": str(include_dir(csrc)),
        "cflags": cflags,
        "cuda_cflags": cuda_cflags,
        "with_cuda": with_cuda,
    }


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "syncbn_lightning"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


def build_dir(spec: dict[str, Any] | None = None) -> Path:
    """The build directory of ``spec`` (default: the current sources, flags and versions),
    created if needed."""
    path = cache_root() / (spec or _build_spec())["key"]
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


@contextmanager
def _build_lock(directory: Path, timeout_s: float) -> Iterator[None]:
    """Exclusive inter-process lock on ``directory``; raises after ``timeout_s`` of waiting."""
    with open(directory / ".syncbn_build.flock", "w") as handle:
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


_ext_lock = threading.Lock()
_ext_module: ModuleType | None = None
_ext_error: ExtensionBuildError | None = None


def load_extension() -> ModuleType:
    """Build (first time) and import the extension; cached per process.

    Raises:
        ExtensionBuildError: when the build or import fails; the message holds the compiler's
            output tail and the build directory. A failure is remembered for the process.
    """
    global _ext_module, _ext_error
    with _ext_lock:
        if _ext_module is not None:
            return _ext_module
        if _ext_error is not None:
            raise _ext_error
        try:
            module = _build_and_import()
            register_fakes()  # the operators exist once the module is loaded
            _ext_module = module
        except ExtensionBuildError as exc:
            _ext_error = exc
            raise
        except Exception as exc:  # compiler missing, ninja missing, import errors, ...
            text = str(exc).strip()
            where = describe_build_dir()
            _ext_error = ExtensionBuildError(
                f"building the C++ extension failed ({type(exc).__name__}) in {where}: "
                f"...{text[-2000:]}\nIf a previous build was killed, a leftover `lock` file in "
                f"that directory makes torch wait forever; syncbn_lightning removes it when it "
                f"holds the build lock, or delete the directory by hand."
            )
            raise _ext_error from exc
        return _ext_module


def describe_build_dir() -> str:
    """The build directory of the current sources, for messages (never raises)."""
    try:
        return str(build_dir())
    except Exception:
        return "<unknown build directory>"


def _build_and_import() -> ModuleType:
    """Build the extension; if its CUDA part fails, warn once and build the CPU kernels alone
    (CUDA tensors then use the reference), rather than losing the CPU kernels too."""
    spec = _build_spec()
    try:
        return _build_from(spec)
    except Exception as exc:
        if not spec["with_cuda"]:
            raise
        cause = str(exc).strip()
        warnings.warn(
            f"syncbn_lightning: building the CUDA kernels failed ({type(exc).__name__}: "
            f"...{cause[-600:]}); building the CPU kernels only, so CUDA tensors will use the "
            f"pure-PyTorch reference. Build dir: {cache_root() / spec['key']}",
            RuntimeWarning,
            stacklevel=4,
        )
        return _build_from(_build_spec(cuda=False))


def _build_from(spec: dict[str, Any]) -> ModuleType:
    build_locked(
        spec["name"],
        build_dir(spec),
        sources=spec["sources"],
        include_paths=[spec["include"]],
        cflags=spec["cflags"],
        ldflags=["-fopenmp"],
        with_cuda=spec["with_cuda"],
        cuda_cflags=spec["cuda_cflags"],
        python_module=False,
    )
    return _primitives(spec["name"], spec["with_cuda"])


#: The primitives ``csrc/ops/primitives.cpp`` registers as ``syncbn::`` operators.
PRIMITIVES = ("local_stats", "merge_stats", "normalize", "backward_reduce", "backward_elemt")


def _primitives(name: str, with_cuda: bool) -> ModuleType:
    """What :func:`load_extension` returns for the loaded library ``name``: the five primitives
    (``torch.ops.syncbn.<primitive>``, the same signatures as :mod:`.reference`'s) and
    ``with_cuda``, whether the build has CUDA kernels. The fused steps are
    ``torch.ops.syncbn.<step>``."""
    module = ModuleType(name, "syncbn_lightning's C++ kernels: the primitives (syncbn:: operators)")
    for primitive in PRIMITIVES:
        setattr(module, primitive, getattr(torch.ops.syncbn, primitive))
    module.with_cuda = with_cuda  # type: ignore[attr-defined]
    return module


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
    if not python_module and (directory / BUILT_MARK).exists():
        try:  # built from exactly these sources and flags (the key): no lock, no ninja
            torch.ops.load_library(str(library))
            return str(library)
        except OSError as exc:  # removed by hand since: build again, under the lock
            log.info("extension %s: loading %s failed (%s); building it", name, library, exc)
    timeout_s = float(os.environ.get(BUILD_TIMEOUT_ENV, "900"))
    with _build_lock(directory, timeout_s):
        stale = directory / "lock"
        if stale.exists():
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
    return loaded


#: The first build of the CPU kernels, measured on an idle 2-core machine (docs/kernels.md says
#: how); the one figure the announcement, the README and the docs quote.
MEASURED_BUILD_S = 57
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
