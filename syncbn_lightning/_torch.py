"""Which torch releases the package supports: the floor, and its check when the package is
imported (without importing torch: ``import syncbn_lightning`` stays light).

The floor is the oldest release on which the fast check passes (``docs/torch-versions.md``
carries the table, ``benchmarks/torch_matrix.py`` makes it). Below it, ``import
syncbn_lightning`` raises one ImportError naming the release found and the floor.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

__all__ = ["FLOOR_RELEASE", "TORCH_FLOOR", "check_torch", "installed_torch", "release"]

#: The oldest torch release the package supports (pyproject.toml's ``torch>=`` says the same;
#: ``tests/test_packaging.py`` checks the two agree).
TORCH_FLOOR = "2.4"
#: The floor's release that CI's smoke installs (``.ci/run``) and ``docs/torch-versions.md`` lists.
FLOOR_RELEASE = "2.4.1"


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"2.4.1+cu121"`` -> ``(2, 4, 1)``,
    ``"2.10.0a0"`` -> ``(2, 10, 0)``."""
    numbers = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()


def installed_torch() -> str | None:
    """The torch version this interpreter will import: the imported module's if torch is
    imported already, else the installed distribution's (``None`` when neither is there)."""
    module = sys.modules.get("torch")
    version = getattr(module, "__version__", None)
    if version is not None:
        return str(version)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def check_torch(version: str | None = None) -> None:
    """Raise ImportError when ``version`` (default: :func:`installed_torch`) is below
    :data:`TORCH_FLOOR`. Nothing when no torch is found: importing it then fails on first use,
    with torch's own error.

    Raises:
        ImportError: naming the release found and the floor.
    """
    found = installed_torch() if version is None else version
    if found is None or release(found) >= release(TORCH_FLOOR):
        return
    raise ImportError(
        f"syncbn_lightning needs torch >= {TORCH_FLOOR}, found torch {found}: install a newer "
        f"torch (pip install 'torch>={TORCH_FLOOR}'), or an older syncbn_lightning"
    )
