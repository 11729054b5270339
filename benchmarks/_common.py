"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set (or leave alone, for ``None``) an environment variable, restoring it afterwards."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else what :mod:`platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"
