"""Compile the CUDA sources without a GPU: ``nvcc -c`` of every ``.cu`` under ``csrc/``, a host
syntax check of every ``.cpp`` under it, and of the two units the extension compiles them as
(:mod:`.build_units`), with the extension's flags and ``-DWITH_CUDA`` (what CI's compile check
runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import build
from .build import CUDA_CFLAGS, ExtensionBuildError
from .build_units import write_units

__all__ = ["DEFAULT_CHECK_ARCH", "cuda_compile_check", "unity_compile_check"]

# The architecture the compile check targets when none is given: the H100 the kernels are tuned on.
DEFAULT_CHECK_ARCH = "sm_90"


def _nvcc() -> str | None:
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME:
        candidate = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("nvcc")


def cuda_compile_check(
    out_dir: Path, arch: str = DEFAULT_CHECK_ARCH, timeout_s: float = 600.0
) -> list[Path]:
    """Compile the CUDA sources to objects with torch's headers, without a GPU (nothing is linked).

    Each ``.cu`` under ``csrc/`` (``cuda/``) goes through ``nvcc -c`` with the extension's flags
    and cpp_extension's common nvcc flags for ``arch``, and each ``.cpp`` under it (every folder)
    through the host compiler with ``-fsyntax-only -DWITH_CUDA`` (the CUDA branch of the
    dispatch); the include path is ``csrc/include``, as in the extension's build. This catches
    syntax and template errors on machines that only have ``nvcc``. With a CPU-only torch wheel
    the generated ``c10/cuda/impl/cuda_cmake_macros.h`` is missing; it only defines an export
    macro for Windows shared builds, so the check defines ``C10_CUDA_NO_CMAKE_CONFIGURE_FILE``
    instead (the real build, with a CUDA torch, has the header).

    Returns:
        The object files written to ``out_dir``.

    Raises:
        ExtensionBuildError: when ``nvcc`` is missing or a compilation fails (with its output).
    """
    from torch.utils import cpp_extension

    nvcc = _nvcc()
    if nvcc is None:
        raise ExtensionBuildError("nvcc not found: set CUDA_HOME or put nvcc on PATH")
    csrc = build.csrc_dir()  # looked up per call: tests point it at a mutated copy
    out_dir.mkdir(parents=True, exist_ok=True)
    includes, defines = _includes_and_defines(csrc)
    objects: list[Path] = []
    commands: list[list[str]] = []
    for source in build.csrc_files(csrc, ".cu"):
        obj = out_dir / f"{source.stem}.o"
        commands.append(
            [
                nvcc,
                "-c",
                str(source),
                "-o",
                str(obj),
                "-std=c++20",
                f"-arch={arch}",
                "-Xcompiler",
                "-fPIC",
                *cpp_extension.COMMON_NVCC_FLAGS,
                *CUDA_CFLAGS,
                *defines,
                *includes,
            ]
        )
        objects.append(obj)
    for source in build.csrc_files(csrc, ".cpp"):
        commands.append(_host_syntax_check(source, includes, defines))
    _run_all(commands, timeout_s)
    return objects


def unity_compile_check(out_dir: Path, timeout_s: float = 600.0) -> list[Path]:
    """Check the units the extension compiles its ``.cpp`` files as (:func:`.build_units
    .write_units`: each unit one translation unit of many files) with ``-DWITH_CUDA``, as the
    extension's CUDA build compiles them: a clash between two files of one unit (two ``static``
    helpers of one name, a macro of one file changing the next) that only the CUDA branch has
    fails here, without a GPU.

    Returns:
        The units checked (written to ``out_dir``).

    Raises:
        ExtensionBuildError: when a unit does not compile (with the compiler's output).
    """
    csrc = build.csrc_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    includes, defines = _includes_and_defines(csrc)
    units = [Path(unit) for unit in write_units(build.csrc_files(csrc, ".cpp"), out_dir)]
    _run_all([_host_syntax_check(unit, includes, defines) for unit in units], timeout_s)
    return units


def _includes_and_defines(csrc: Path) -> tuple[list[str], list[str]]:
    """The include flags (``csrc/include``, torch's) and the defines the checks compile with."""
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in [str(build.include_dir(csrc)), *cpp_extension.include_paths()]]
    defines: list[str] = []
    torch_include = Path(cpp_extension.include_paths()[0])
    if not (torch_include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file():
        defines.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    return includes, defines


def _host_syntax_check(source: Path, includes: list[str], defines: list[str]) -> list[str]:
    """The host compiler's syntax check of ``source`` with ``-DWITH_CUDA``."""
    return [
        os.environ.get("CXX", "c++"),
        "-std=c++20",
        "-fsyntax-only",
        "-DTORCH_EXTENSION_NAME=syncbn_check",
        "-DWITH_CUDA",
        *defines,
        *includes,
        f"-I{sysconfig.get_paths()['include']}",
        str(source),
    ]


def _run_all(commands: list[list[str]], timeout_s: float) -> None:
    # One compiler per core at a time (nvcc of the two .cu files dominates: ~2x on 2 cores).
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda command: _check_compiles(command, timeout_s), commands))


def _check_compiles(command: list[str], timeout_s: float) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise ExtensionBuildError(
            f"compile check timed out after {timeout_s:.0f} s: {' '.join(command)}"
        ) from exc
    if done.returncode != 0:
        raise ExtensionBuildError(
            f"compile check failed (exit {done.returncode}): {' '.join(command)}\n"
            f"{(done.stdout + done.stderr)[-4000:]}"
        )
