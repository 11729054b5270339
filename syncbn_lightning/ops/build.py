"""The C++ extension: lazy JIT build, build cache and import.

Which implementation a layer uses (the extension or the reference) is :mod:`.dispatch`'s choice;
the compile-only check of the CUDA sources (no GPU needed) is :mod:`.compile_check`.

The extension is built on first use, never at import or test collection. Its build directory is
``$SYNCBN_CACHE_DIR/<key>`` (default root ``~/.cache/syncbn_lightning``, created ``0700``), where
the key hashes the sources and headers (paths and bytes), compiler flags, the CUDA architectures
and the visible GPUs' compute capabilities (CUDA builds), the torch/CUDA/Python versions and the
interpreter, so a change of any of them triggers a rebuild and never loads a stale binary. If the
CUDA part fails to build, the CPU kernels are built alone (one warning naming the cause), unless
``SYNCBN_REQUIRE_CUDA_BUILD=1`` makes a build without CUDA kernels an error (the GPU check's
build step: a GPU machine must not test CPU kernels by accident). The compile itself runs under
an inter-process lock, and a completed build loads without it (:mod:`.build_lock`). Beside the
library the build records what it links (:mod:`.link_record`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .._compat import cuda_arch_flags
from .._files import shipped_dir
from .._shared import (
    HEADER_PATH,
    TEXT_DIGEST_LINE,
    header_digest,
    text_digest,
    values_digest,
)
from .build_lock import (
    BUILD_TIMEOUT_ENV,
    BUILT_MARK,
    HEARTBEAT_S,
    MEASURED_BUILD_S,
    ExtensionBuildError,
    build_locked,
)
from .build_units import write_units
from .fakes import register_fakes
from .link_record import link_record

__all__ = [
    "BUILD_TIMEOUT_ENV",
    "BUILT_MARK",
    "CUDA_CFLAGS",
    "HEARTBEAT_S",
    "MEASURED_BUILD_S",
    "PRIMITIVES",
    "REQUIRE_CUDA_ENV",
    "ExtensionBuildError",
    "build_dir",
    "build_locked",
    "check_shared_header",
    "cache_root",
    "csrc_dir",
    "csrc_files",
    "describe_build_dir",
    "include_dir",
    "load_extension",
    "source_key",
    "sources_digest",
]

CACHE_ENV = "SYNCBN_CACHE_DIR"
#: ``1``: a build without CUDA kernels is an error, naming why it has none (else: one warning,
#: and the CPU kernels alone).
REQUIRE_CUDA_ENV = "SYNCBN_REQUIRE_CUDA_BUILD"


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


def _cuda_build_blockers(csrc: Path) -> list[str]:
    """Why the CUDA twins would not be compiled (empty: they are): they need a CUDA torch, a
    visible GPU, a toolkit and ``.cu`` sources."""
    from torch.utils import cpp_extension

    blockers = []
    if not torch.version.cuda:
        blockers.append(f"torch {torch.__version__} is a build without CUDA")
    elif not torch.cuda.is_available():
        blockers.append("no CUDA device is visible (torch.cuda.is_available() is False)")
    if not cpp_extension.CUDA_HOME:
        blockers.append("no CUDA toolkit was found (set CUDA_HOME, or put nvcc on PATH)")
    if not csrc_files(csrc, ".cu"):
        blockers.append(f"{csrc} holds no .cu sources")
    return blockers


def _cuda_required() -> bool:
    return os.environ.get(REQUIRE_CUDA_ENV, "").strip() == "1"


def sources_digest(csrc: Path) -> str:
    """A 16-hex-digit digest of the extension's sources and headers under ``csrc`` (their paths
    relative to it and their bytes): what a recorded GPU pass names the extension by
    (:mod:`.dispatch`, ``native_cuda_default``), whatever machine or torch built it."""
    digest = hashlib.sha256()
    for path in csrc_files(csrc, ".cpp", ".cu", ".h", ".cuh"):
        digest.update(path.relative_to(csrc).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


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
    flags = cuda_arch_flags()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    capabilities = tuple(torch.cuda.get_device_capability(i) for i in range(count))
    return flags, capabilities


def _build_spec(cuda: bool | None = None) -> dict[str, Any]:
    """Sources, flags and cache key of the extension; ``cuda`` forces the CUDA part on or off
    (``None``: on when torch, a GPU, the toolkit and ``.cu`` sources are all there)."""
    csrc = csrc_dir()
    with_cuda = not _cuda_build_blockers(csrc) if cuda is None else cuda
    sources = csrc_files(csrc, ".cpp", *([".cu"] if with_cuda else []))
    cflags = ["-O3", "-DNDEBUG", "-fopenmp", *_cpu_arch_flags()] + (
        ["-DWITH_CUDA"] if with_cuda else []
    )
    cuda_cflags = list(CUDA_CFLAGS) if with_cuda else []
    ldflags = ["-fopenmp"]
    targets = _cuda_targets() if with_cuda else ()
    headers = csrc_files(csrc, ".h", ".cuh")
    key = source_key(sources + headers, (cflags, cuda_cflags, targets, ldflags))
    return {
        "name": f"syncbn_lightning_ext_{key}",
        "key": key,
        "csrc": csrc,
        "sources": [str(p) for p in sources],
        "include": str(include_dir(csrc)),
        "cflags": cflags,
        "cuda_cflags": cuda_cflags,
        "ldflags": ldflags,
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


def check_shared_header(csrc: Path) -> None:
    """Refuse to build or load against a ``shared_constants.h`` made from other values than
    ``_shared.py``'s (its recorded :func:`~syncbn_lightning._shared.values_digest`), or edited by
    hand (its recorded :func:`~syncbn_lightning._shared.text_digest`): the C++ side would
    disagree with Python on the exchanges' layouts and the flight records.

    Raises:
        ExtensionBuildError: naming the header, both digests and the command that regenerates it.
    """
    header = csrc / HEADER_PATH
    text = header.read_text() if header.is_file() else ""
    recorded = header_digest(text)
    fix = (
        "run `python tools/shared_header.py` in the source checkout and rebuild; an installed "
        "package needs reinstalling"
    )
    if recorded != values_digest():
        raise ExtensionBuildError(
            f"{header} is stale against syncbn_lightning/_shared.py (it records values digest "
            f"{recorded}, the module's values are {values_digest()}): {fix}"
        )
    if header_digest(text, TEXT_DIGEST_LINE) != text_digest(text):
        raise ExtensionBuildError(
            f"{header} was edited by hand (its text digest does not match its text): change the "
            f"value in syncbn_lightning/_shared.py instead, then {fix}"
        )


def _build_and_import() -> ModuleType:
    """Build the extension; if its CUDA part fails, warn once and build the CPU kernels alone
    (CUDA tensors then use the reference), rather than losing the CPU kernels too. Checks the
    generated header first (:func:`check_shared_header`). With ``SYNCBN_REQUIRE_CUDA_BUILD=1``
    a build without CUDA kernels raises instead, naming why."""
    csrc = csrc_dir()
    check_shared_header(csrc)
    spec = _build_spec()
    if _cuda_required() and not spec["with_cuda"]:
        raise ExtensionBuildError(
            f"{REQUIRE_CUDA_ENV}=1, but the extension would have no CUDA kernels: "
            + "; ".join(_cuda_build_blockers(csrc))
        )
    try:
        return _build_from(spec)
    except Exception as exc:
        if not spec["with_cuda"] or _cuda_required():
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
    directory = build_dir(spec)
    library = build_locked(
        spec["name"],
        directory,
        sources=write_units([Path(s) for s in spec["sources"]], directory),
        include_paths=[spec["include"]],
        cflags=spec["cflags"],
        ldflags=spec["ldflags"],
        with_cuda=spec["with_cuda"],
        cuda_cflags=spec["cuda_cflags"],
        python_module=False,
    )
    module = _primitives(spec["name"], spec["with_cuda"])
    module.static_libstdcxx = link_record(Path(library))["static_libstdcxx"]  # type: ignore[attr-defined]
    module.sources_digest = sources_digest(spec["csrc"])  # type: ignore[attr-defined]
    return module


#: The primitives ``csrc/ops/primitives.cpp`` registers as ``syncbn::`` operators.
PRIMITIVES = ("local_stats", "merge_stats", "normalize", "backward_reduce", "backward_elemt")


def _primitives(name: str, with_cuda: bool) -> ModuleType:
    """What :func:`load_extension` returns for the loaded library ``name``: the five primitives
    (``torch.ops.syncbn.<primitive>``, the same signatures as :mod:`.reference`'s) and
    ``with_cuda``, whether the build has CUDA kernels; :func:`_build_from` adds
    ``static_libstdcxx`` (:mod:`.link_record`) and ``sources_digest`` (:func:`sources_digest`).
    The fused steps are ``torch.ops.syncbn.<step>``."""
    module = ModuleType(name, "syncbn_lightning's C++ kernels: the primitives (syncbn:: operators)")
    for primitive in PRIMITIVES:
        setattr(module, primitive, getattr(torch.ops.syncbn, primitive))
    module.with_cuda = with_cuda  # type: ignore[attr-defined]
    return module
