"""Counting the dispatcher operators a piece of code runs (``TorchDispatchMode``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...``: ``c.ops`` counts each operator overload by its name, e.g.
    ``"syncbn.stats_row.default"`` or ``"aten.add_.Tensor"``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def namespaces(self) -> set[str]:
        """The operator namespaces seen (``"aten"``, ``"syncbn"``, ...)."""
        return {name.split(".")[0] for name in self.ops}
