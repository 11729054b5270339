"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import contextlib
import os
import platform
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


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


def count_collectives(names: Iterable[str], counts: dict[str, int]) -> contextlib.ExitStack:
    """Wrap the ``torch.distributed`` functions ``names`` so that each call adds 1 to
    ``counts[name]``; the returned stack (usable as ``with``) restores them when closed.

    Names this torch does not have are skipped.
    """
    stack = contextlib.ExitStack()
    for name in names:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args: Any, _name: str = name, _fn: Any = original, **kwargs: Any) -> Any:
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        setattr(dist, name, counting)
        stack.callback(setattr, dist, name, original)
    return stack


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...``: ``c.ops`` counts each dispatcher operator overload by its
    name, e.g. ``"syncbn.stats_row.default"`` or ``"aten.add_.Tensor"`` (also used by the tests'
    op-count budgets, through ``benchmarks._common``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def namespaces(self) -> set[str]:
        """The operator namespaces seen (``"aten"``, ``"syncbn"``, ...)."""
        return {name.split(".")[0] for name in self.ops}
