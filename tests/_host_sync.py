"""Whether GPU work runs without a host-device sync: torch's sync debug mode around it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def run_without_host_sync(fn: Callable[[], Any], times: int = 3) -> None:
    """Call ``fn()`` ``times`` times under ``torch.cuda.set_sync_debug_mode("error")`` (a host
    sync raises), the device synchronized before and after (outside the checked region), and the
    previous mode restored."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(times):
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
