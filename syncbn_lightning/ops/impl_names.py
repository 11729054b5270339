"""What a user may say about the implementation, and its check: the ``impl=`` values and the
``SYNCBN_IMPL`` and ``SYNCBN_NATIVE_CUDA`` variables (no torch: the service checks a config with
it before torch is imported). Which implementation then runs is :mod:`.dispatch`'s one answer."""

from __future__ import annotations

from typing import Any

__all__ = ["IMPL_ENV", "NATIVE_CUDA_ENV", "check_impl", "native_cuda_requested"]

IMPL_ENV = "SYNCBN_IMPL"
#: Whether CUDA layers take the C++ path (``1``) or the Python Function (``0``); unset: the C++
#: path only where this tree's sources passed ``benchmarks/gpu_check.sh native`` on a GPU
#: (:mod:`.native_passes`; ``docs/architecture.md``).
NATIVE_CUDA_ENV = "SYNCBN_NATIVE_CUDA"
_IMPLS = ("auto", "ext", "ref")
# The API spells the reference out; "ref" is the short form (and the environment variable's).
_IMPL_ALIASES = {"reference": "ref"}


def check_impl(impl: Any, name: str = "impl") -> str | None:
    """``impl`` in its short form (``"auto"``, ``"ext"`` or ``"ref"``; ``"reference"`` is
    ``"ref"``), or ``None``, which leaves the choice to ``SYNCBN_IMPL`` at each use.

    Raises:
        TypeError / ValueError: naming ``name`` and the accepted values.
    """
    if impl is None:
        return None
    accepted = (
        f"'auto' (the C++ kernels, else the pure-PyTorch reference with one warning), 'ext' (the "
        f"kernels or an error), 'reference', or None (the {IMPL_ENV} environment variable, "
        f"default 'auto')"
    )
    if not isinstance(impl, str):
        raise TypeError(f"{name} must be {accepted}, got {type(impl).__name__} {impl!r}")
    value = impl.strip().lower()
    value = _IMPL_ALIASES.get(value, value)
    if value not in _IMPLS:
        raise ValueError(f"{name}={impl!r} is not valid: use {accepted}")
    return value


def native_cuda_requested(value: str | None) -> bool | None:
    """Whether ``SYNCBN_NATIVE_CUDA`` set to ``value`` (``None``: unset) puts CUDA layers on the
    C++ path: ``"1"`` yes, ``"0"`` no, unset or empty ``None`` (the recorded GPU passes decide:
    :func:`~syncbn_lightning.ops.dispatch.native_cuda_default`).

    Raises:
        ValueError: on any other value, naming the variable and its two values.
    """
    if value is None or value.strip() == "":
        return None
    if value.strip() == "0":
        return False
    if value.strip() == "1":
        return True
    raise ValueError(
        f"{NATIVE_CUDA_ENV}={value!r} is not valid: use 1 (CUDA layers take the C++ path, "
        f"syncbn::sync_batch_norm) or 0 (the Python Function); unset, the C++ path only where "
        f"these sources passed benchmarks/gpu_check.sh native on a GPU"
    )
