"""Where the folders shipped with the package are: ``csrc/`` and ``conf/`` sit beside the package
in a source checkout and inside it (as ``_csrc``, ``conf``) once installed."""

from __future__ import annotations

from pathlib import Path

__all__ = ["shipped_dir"]

_PACKAGE = Path(__file__).resolve().parent


def shipped_dir(
    checkout_name: str, installed_name: str, marker: str, error: type[Exception], hint: str
) -> Path:
    """The first of ``<checkout>/<checkout_name>`` and ``<package>/<installed_name>`` that holds
    ``marker``.

    Raises:
        error: naming both places, what was looked for (``marker``) and ``hint``, the fix.
    """
    candidates = [_PACKAGE.parent / checkout_name, _PACKAGE / installed_name]
    for candidate in candidates:
        if (candidate / marker).is_file():
            return candidate
    raise error(f"{marker} is neither in {candidates[0]} nor in {candidates[1]}; {hint}")
