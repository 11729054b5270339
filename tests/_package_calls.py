"""Which of the package's Python functions a call runs: the C++ path promises to run none in a
backward, and only the plan's in a forward (``sys.setprofile`` on this thread)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import syncbn_lightning

PACKAGE = str(Path(syncbn_lightning.__file__).resolve().parent)


def package_calls(fn: Callable[[], Any]) -> list[str]:
    """The package's Python functions called while ``fn()`` runs (this thread), as
    ``file.py:function``, in call order."""
    seen: list[str] = []

    def probe(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            seen.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")

    sys.setprofile(probe)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


#: The package's Python a training forward on the C++ path runs, its plan made: the layer's
#: forward, the plan's checks, the kind of call, one operator call and the batch's record.
PLAN_CALLS = frozenset(
    {
        "batchnorm.py:forward",
        "batchnorm.py:_forward",
        "layer_call.py:call_plan",
        "layer_call.py:plan_of",
        "layer_call.py:_impl_env",
        "layer_call.py:sync_forward",
        "recompute.py:call_kind",
        "layer_call.py:_native_call",
        "layer_call.py:affine_of",
        "layer_call.py:_state",
        "layer_call.py:_record",
    }
)
