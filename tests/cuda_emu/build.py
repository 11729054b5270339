"""Build the project's CUDA kernels as a CPU-tensor extension that runs them under SIMT emulation.

Nothing here copies a kernel: at build time every ``csrc/cuda/*.cu`` is rewritten line for line
into a C++ file in the build directory (``#line`` keeps compiler errors and emulator diagnostics on
the original file and line) and compiled with the stand-in headers of ``tests/cuda_emu/include``
(``cuda_runtime.h``, ``c10/cuda/*``, ``simt.h``), which ``-I`` puts before torch's own, and the
shared headers of ``csrc/include``. The CUDA headers ``csrc/cuda/*.cuh`` (kernel templates the
``.cu`` files instantiate) are rewritten the same way beside them, under their own names: a quoted
include searches the including file's own folder first, and ``-I`` puts that folder first, so the
rewritten ``.cu`` and ``.cuh`` files include the rewritten copies (the originals' folder,
``csrc/cuda``, is never on the include path). The rewrite changes three things and fails loudly
on anything it does not understand:

* launch sites ``k<<<grid, block, smem, stream>>>(args)`` become
  ``k | ::simt::kernel_name("k") | ::simt::launch_config(grid, block, smem, stream)(args)``;
* ``__shared__ T name[dims];`` becomes ``auto& name = ::simt::shared_var<T[dims]>([] {});`` (one
  copy per block, poisoned with 0xFF before the block starts; ``extern __shared__`` becomes the
  launch's dynamic shared memory);
* ``c10::DeviceType::CUDA`` (and ``at::kCUDA``/``c10::kCUDA``) becomes the CPU device type, so
  the entry points' device checks accept the CPU tensors the emulated kernels run on.

The build is cached like the main extension: ``$SYNCBN_CACHE_DIR/emu-<key>``, the key hashing the
``.cu`` sources and headers, the emulator's sources, the flags and the torch/Python versions, under
the same inter-process lock. ``SYNCBN_EMU_ASAN=1`` builds with AddressSanitizer (see the README).
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from types import ModuleType

from syncbn_lightning.ops import build as ops_build

EMU_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = EMU_DIR / "include"
ASAN_ENV = "SYNCBN_EMU_ASAN"
# Another copy of csrc/ to build instead (tests/test_cuda_emu_mutants.py builds mutated kernels).
CSRC_ENV = "SYNCBN_EMU_CSRC"

_CFLAGS = [
    "-O2",
    "-std=c++20",
    "-DWITH_CUDA",
    # Host floating point as written: no FMA contraction (a GPU contracts; tolerances cover it).
    "-ffp-contract=off",
    "-fno-omit-frame-pointer",
    "-Wno-unknown-pragmas",  # #pragma unroll
    # _longjmp between fiber stacks trips glibc's fortified longjmp check.
    "-U_FORTIFY_SOURCE",
]
_ASAN_FLAGS = ["-fsanitize=address", "-g"]


class RewriteError(ValueError):
    """A construct in a ``.cu`` file that the emulation's rewrite does not handle."""


_LAUNCH_OPEN = "<<<"
_LAUNCH_CLOSE = ">>>"
_SHARED = re.compile(r"(?P<extern>\bextern\s+)?\b__shared__\b(?P<decl>[^;{}]*);")
_DECLARATOR = re.compile(
    r"^\s*(?:(?:__align__|alignas)\s*\(\s*(?P<align>[^)]*)\)\s*)?(?P<type>.+?)\s*"
    r"\b(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)$",
    re.S,
)
_DEVICE_TYPES = (
    (re.compile(r"\bc10::DeviceType::CUDA\b"), "c10::DeviceType::CPU"),
    (re.compile(r"\b(at|c10)::kCUDA\b"), r"\1::kCPU"),
)


def _split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of one line: text from a ``//`` outside string literals is a comment."""
    in_string = False
    for i, ch in enumerate(line):
        if ch == '"' and (i == 0 or line[i - 1] != "\\"):
            in_string = not in_string
        elif not in_string and line.startswith("//", i):
            return line[:i], line[i:]
    return line, ""


_TEMPLATE_ARGS = re.compile(r"<[^<>]*>")
_TRAILING_NAME = re.compile(r"([A-Za-z_][\w:]*)\s*$")


def _kernel_before(code: str, origin: str, line: int) -> str:
    """The name of the kernel whose launch configuration starts at the end of ``code``."""
    tail = code[-2000:]
    while True:  # drop template argument lists, innermost first
        stripped = _TEMPLATE_ARGS.sub("", tail)
        if stripped == tail:
            break
        tail = stripped
    found = _TRAILING_NAME.search(tail)
    if found is None:
        raise RewriteError(f"{origin}:{line}: no kernel name before <<<")
    return found.group(1)


def _rewrite_launches(code: str, origin: str) -> str:
    """``k<<<cfg>>>(args)`` -> ``k | kernel_name("k") | launch_config(cfg)(args)``.

    ``<<<`` opens a launch configuration and the next ``>>>`` closes it; a ``>>>`` outside one
    closes nested templates and stays. Comments are left alone.
    """
    lines = code.split("\n")
    inside = False
    token = re.compile(r"<<<|>>>")
    for number, line in enumerate(lines, start=1):
        text, comment = _split_comment(line)
        out, last = [], 0
        for match in token.finditer(text):
            if match.group() == _LAUNCH_OPEN:
                if inside:
                    raise RewriteError(f"{origin}:{number}: nested <<< in a launch configuration")
                inside = True
                before = "\n".join([*lines[: number - 1], text[: match.start()]])
                name = _kernel_before(before, origin, number)
                out.append(
                    text[last : match.start()]
                    + f' | ::simt::kernel_name("{name}") | ::simt::launch_config('
                )
            elif inside:
                inside = False
                out.append(text[last : match.start()] + ")")
            else:
                out.append(text[last : match.end()])
            last = match.end()
        lines[number - 1] = "".join(out) + text[last:] + comment
    if inside:
        raise RewriteError(f"{origin}: a <<< launch configuration is never closed by >>>")
    return "\n".join(lines)


def _shared_replacement(match: re.Match[str], origin: str, code: str) -> str:
    line = code.count("\n", 0, match.start()) + 1
    decl = match.group("decl")
    parsed = _DECLARATOR.match(decl)
    if parsed is None or "," in decl or "=" in decl:
        raise RewriteError(
            f"{origin}:{line}: cannot rewrite `__shared__{decl};` for the CUDA emulation: declare "
            f"one array or scalar per __shared__ statement, without an initializer"
        )
    kind, name, dims = parsed.group("type").strip(), parsed.group("name"), parsed.group("dims")
    newlines = "\n" * match.group(0).count("\n")
    if match.group("extern"):
        if dims.replace(" ", "") != "[]":
            raise RewriteError(f"{origin}:{line}: `extern __shared__` must declare `name[]`")
        return f"{kind}* {name} = ::simt::extern_shared<{kind}>();{newlines}"
    align = parsed.group("align")
    type_id = f"{kind}{dims.strip()}"
    if align:
        return (
            f"auto& {name} = ::simt::shared_var_aligned<{type_id}, ({align})>([] {{}});{newlines}"
        )
    return f"auto& {name} = ::simt::shared_var<{type_id}>([] {{}});{newlines}"


def rewrite_cuda_source(text: str, origin: str) -> str:
    """The emulation's C++ twin of the CUDA source ``text`` (from ``origin``), line for line.

    Raises:
        RewriteError: on a launch or ``__shared__`` declaration the rewrite cannot handle.
    """
    code = _rewrite_launches(text, origin)
    code = _SHARED.sub(lambda m: _shared_replacement(m, origin, code), code)
    for pattern, replacement in _DEVICE_TYPES:
        code = pattern.sub(replacement, code)
    if code.count("\n") != text.count("\n"):
        raise RewriteError(f"{origin}: the rewrite changed the number of lines")
    return f'#line 1 "{origin}"\n{code}'


def _csrc() -> Path:
    override = os.environ.get(CSRC_ENV)
    return Path(override).resolve() if override else ops_build.csrc_dir()


def _cu_sources() -> list[Path]:
    return [*ops_build.csrc_files(_csrc(), ".cu"), EMU_DIR / "selftest.cu"]


def _cu_headers() -> list[Path]:
    return ops_build.csrc_files(_csrc(), ".cuh")


def _asan() -> bool:
    return os.environ.get(ASAN_ENV, "") == "1"


_lock = threading.Lock()
_module: ModuleType | None = None


def load_emulator() -> ModuleType:
    """Build (first time) and import the emulation extension; cached per process and on disk.

    The module exposes the CUDA entry points of ``csrc/cuda/entry_cuda.cu`` on CPU tensors (the five
    primitives ``local_stats``, ``merge_stats``, ``normalize``, ``backward_reduce``,
    ``backward_elemt`` and the four fused steps), ``set_schedule``, ``take_diagnostics``,
    ``take_launches``, ``take_stats`` and the emulator's self-test kernels (``selftest``).
    """
    global _module
    with _lock:
        if _module is None:
            _module = _build()
        return _module


def _build() -> ModuleType:
    csrc = _csrc()
    cu_sources = _cu_sources()
    fixed_sources = [
        *sorted(EMU_DIR.glob("simt_*.cpp")),
        EMU_DIR / "bindings.cpp",
        EMU_DIR / "order_ring_probe.cpp",
        csrc / "ops" / "common.cpp",
        csrc / "ops" / "step_helpers.cpp",
        csrc / "layer" / "order_ring.cpp",
    ]
    headers = (
        sorted(INCLUDE_DIR.rglob("*.h"))
        + sorted(EMU_DIR.glob("*.h"))
        + ops_build.csrc_files(csrc, ".h", ".cuh")
    )
    cflags = _CFLAGS + (_ASAN_FLAGS if _asan() else [])
    ldflags = _ASAN_FLAGS if _asan() else []
    key = ops_build.source_key(
        [*cu_sources, *fixed_sources, *headers, Path(__file__)], (cflags, ldflags)
    )
    directory = ops_build.cache_root() / f"emu-{key}"
    generated = directory / "generated"
    generated.mkdir(mode=0o700, parents=True, exist_ok=True)
    sources = []
    for source in [*cu_sources, *_cu_headers()]:
        is_header = source.suffix == ".cuh"
        target = generated / (source.name if is_header else f"{source.stem}.emu.cpp")
        text = rewrite_cuda_source(source.read_text(), str(source))
        if not target.is_file() or target.read_text() != text:
            target.write_text(text)
        if not is_header:
            sources.append(str(target))
    return ops_build.build_locked(
        f"syncbn_emu_{key}",
        directory,
        sources=sources + [str(p) for p in fixed_sources],
        # The rewritten .cuh files first, then the stand-ins and the shared headers, then the
        # layer's (order_ring.h, for the probe); the originals' folder (csrc/cuda) is never on
        # the path.
        include_paths=[
            str(generated),
            str(INCLUDE_DIR),
            str(ops_build.include_dir(csrc)),
            str(csrc / "layer"),
        ],
        cflags=cflags,
        ldflags=ldflags,
    )
