"""Which implementation of the primitives a layer uses: the C++ extension or the reference.

Chosen per layer (``impl=`` of ``SyncBatchNorm``, the converter, the callback) or, where none is
given, by the ``SYNCBN_IMPL`` environment variable:

* ``auto`` (default): the compiled extension where it has kernels for the tensor's device, else the
  pure-PyTorch reference, with ONE warning naming the cause and the build directory.
* ``ext``: the extension or an error (a failed build raises instead of falling back).
* ``reference`` (``ref`` for short): always the reference (:mod:`.reference`).

The extension is built on first use by :mod:`.build`. Whether a synchronized call with a
built-in exchange is one C++ operator per direction (the C++ path) or the Python Function with
these kernels is :func:`cpp_path`'s answer: on CPU tensors whenever the extension serves them; on
CUDA tensors where ``SYNCBN_NATIVE_CUDA=1``, or, unset, where the sources match a recorded GPU
pass (:func:`native_cuda_default`, :mod:`.native_passes`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from . import native_passes, reference
from .build import ExtensionBuildError, describe_build_dir, load_extension
from .impl_names import (
    _IMPL_ALIASES,
    _IMPLS,
    IMPL_ENV,
    NATIVE_CUDA_ENV,
    check_impl,
    native_cuda_requested,
)

__all__ = [
    "IMPL_ENV",
    "check_impl",
    "cpp_path",
    "get_impl",
    "native_cuda",
    "native_cuda_default",
    "ops_for",
    "ops_for_device",
    "python_checks_first",
    "python_path_digest",
    "uses_extension",
]


def get_impl(impl: str | None = None) -> str:
    """The implementation to use: ``impl`` when given (see :func:`check_impl`), else the one
    ``SYNCBN_IMPL`` requests (``auto``, ``ext``, ``ref``/``reference``; default ``auto``).

    Raises:
        ValueError: when the variable (or ``impl``) holds anything else.
    """
    if impl is not None:
        return impl if impl in _IMPLS else str(check_impl(impl))
    value = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    value = _IMPL_ALIASES.get(value, value)
    if value not in _IMPLS:
        raise ValueError(
            f"{IMPL_ENV}={os.environ[IMPL_ENV]!r} is not valid: use one of auto, ext, ref "
            f"(reference)"
        )
    return value


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def ops_for(tensor: torch.Tensor, impl: str | None = None) -> Any:
    """The primitives to use for ``tensor``: the extension module or :mod:`reference`.

    Both expose ``local_stats``, ``merge_stats``, ``normalize``, ``backward_reduce`` and
    ``backward_elemt`` with identical signatures. ``impl``: see :func:`get_impl` (``None``: the
    ``SYNCBN_IMPL`` environment variable).

    Raises:
        ValueError: on an invalid ``impl``/``SYNCBN_IMPL``.
        ExtensionBuildError: with ``ext`` when the extension cannot serve ``tensor``.
    """
    return ops_for_device(tensor.device.type, impl)


def ops_for_device(device_type: str, impl: str | None = None) -> Any:
    """:func:`ops_for` for tensors on devices of type ``device_type`` (``"cpu"``, ``"cuda"``...)."""
    impl = get_impl(impl)
    if impl == "ref":
        return reference
    try:
        ext = load_extension()
    except ExtensionBuildError as exc:
        if impl == "ext":
            raise
        _warn_once(
            "build",
            f"syncbn_lightning: C++ extension unavailable, using the pure-PyTorch reference "
            f"(slower, same results). Cause: {str(exc)[:600]} Build dir: {describe_build_dir()}. "
            f"Set {IMPL_ENV}=ref to silence this, or {IMPL_ENV}=ext to make it an error.",
        )
        return reference
    if device_type == "cpu" or (device_type == "cuda" and ext.with_cuda):
        return ext
    message = (
        f"syncbn_lightning: the C++ extension has no kernels for {device_type} tensors in "
        f"this build; using the pure-PyTorch reference for them"
    )
    if impl == "ext":
        raise ExtensionBuildError(message + f" is not allowed with {IMPL_ENV}=ext")
    _warn_once(f"device:{device_type}", message + ".")
    return reference


_choice_lock = threading.Lock()
_choices: dict[tuple[str, str], bool] = {}


def uses_extension(device_type: str, impl: str | None = None) -> bool:
    """Whether layers on ``device_type`` with implementation ``impl`` (``None``: ``SYNCBN_IMPL``)
    run the ``syncbn::`` operators (else the reference).

    Decided by :func:`ops_for_device` (the implementation asked for, whether the extension builds
    and has kernels for the device), once per implementation and device type. ``torch.compile``
    calls it while tracing and bakes the answer into the graph, so a compiled model keeps the
    implementation it was compiled with.
    """
    key = (get_impl(impl), device_type)
    choice = _choices.get(key)
    if choice is None:
        with _choice_lock:
            choice = ops_for_device(device_type, key[0]) is not reference
            _choices[key] = choice
    return choice


# What @torch.compiler.assume_constant_result does (it sets this mark, which torch.compile reads
# when it traces a call), without that decorator's `import torch._dynamo`: about 1 s of every
# `import syncbn_lightning`, half of a command line's config check. tests/test_backend.py checks
# that the decorator still sets exactly this mark.
uses_extension._dynamo_marked_constant = True  # type: ignore[attr-defined]


#: The library's folders whose Python files a layer call runs through (the torch-only layers).
_PATH_PACKAGES = ("ops", "distributed", "functional", "nn")


def python_path_digest() -> str:
    """A 16-hex-digit digest of the torch-only library's Python files (``ops/``,
    ``distributed/``, ``functional/``, ``nn/`` and the package's private modules; paths relative
    to the package and bytes), :mod:`.native_passes` left out: with
    :func:`~syncbn_lightning.ops.build.sources_digest`, what a recorded GPU pass names."""
    package = Path(__file__).resolve().parents[1]
    files = sorted(package.glob("_*.py"))
    for folder in _PATH_PACKAGES:
        files += sorted((package / folder).rglob("*.py"))
    record = Path(native_passes.__file__).resolve()
    digest = hashlib.sha256()
    for path in files:
        if path.resolve() == record:
            continue
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def native_cuda_default() -> bool:
    """Whether CUDA layers take the C++ path with ``SYNCBN_NATIVE_CUDA`` unset: only where the
    loaded extension (its :func:`~syncbn_lightning.ops.build.sources_digest`) and the library's
    Python files (:func:`python_path_digest`) are those of a pass of
    ``benchmarks/gpu_check.sh native`` recorded in :mod:`.native_passes`. Decided once per
    process (the files do not change under a running program); without a recorded pass nothing
    is read."""
    if not native_passes.PASSES:
        return False
    try:
        extension = load_extension()
    except ExtensionBuildError:
        return False
    python = python_path_digest()
    return any(
        entry.get("extension") == extension.sources_digest and entry.get("python") == python
        for entry in native_passes.PASSES
    )


def python_checks_first() -> bool:
    """Whether Python's input checks must run in front of the C++ path's own: where the loaded
    extension links libstdc++ statically (:mod:`.link_record`), an ostream in torch's headers
    formatting a number there would crash the process instead of raising."""
    return bool(load_extension().static_libstdcxx)


def cpp_path(device_type: str, impl: str | None = None) -> bool:
    """Whether a synchronized call with a built-in exchange on ``device_type`` tensors takes the
    C++ path (one operator per direction): with the extension's kernels (:func:`uses_extension`
    for ``impl``), on the CPU, and on CUDA where ``SYNCBN_NATIVE_CUDA`` says so (unset: where
    these sources passed the GPU check, :func:`native_cuda_default`). Read when a layer makes its
    plan.

    Raises:
        ValueError: on a ``SYNCBN_NATIVE_CUDA`` other than 0 and 1 (read for any device but the
            CPU).
    """
    if device_type == "cpu":
        return uses_extension("cpu", impl)
    cuda = native_cuda()
    return device_type == "cuda" and cuda and uses_extension("cuda", impl)


def native_cuda() -> bool:
    """Whether CUDA layers take the C++ path: ``SYNCBN_NATIVE_CUDA`` (read now), and unset, where
    these sources passed the GPU check (:func:`native_cuda_default`).

    Raises:
        ValueError: on a value other than 0 and 1.
    """
    requested = native_cuda_requested(os.environ.get(NATIVE_CUDA_ENV))
    return native_cuda_default() if requested is None else requested
