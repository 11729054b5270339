"""The ``impl=`` choice's names and their check (no torch: the service checks a config with it
before torch is imported; :mod:`.dispatch` uses it and re-exports its names)."""

from __future__ import annotations

from typing import Any

__all__ = ["IMPL_ENV", "check_impl"]

IMPL_ENV = "SYNCBN_IMPL"
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
