"""Which calls leave their call-order flag for later, and the tests' switch for CPU calls.

A synchronized call's call-order flag (whether every rank's tags agreed) is computed on the
input's device. On the CPU it is in host memory, so a mismatch raises at the call. Off the CPU,
reading it at once would cost a host sync per call, so it is queued and read later
(:mod:`.`'s queue, the C++ path's order ring). Tests run that device logic on CPU gloo ranks
with :func:`set_queue_order_flags_on_cpu`. No torch beyond the device type, and no import of
the package: the kernels' pure-PyTorch twins (``ops/reference/``) ask it too.
"""

from __future__ import annotations

import torch

__all__ = [
    "cpu_queues_order_flags",
    "queues_order_flag",
    "queues_order_flags_on",
    "set_queue_order_flags_on_cpu",
]

# Tests run the device path of the call-order check on CPU tensors (see queues_order_flag).
_QUEUE_ON_CPU = False


def queues_order_flag(input: torch.Tensor) -> bool:
    """Whether a call on ``input`` leaves its call-order flag on the device, to be read later
    (:mod:`syncbn_lightning.distributed.call_order`), instead of checking at once: true off CPU,
    where a check would cost a host sync per call. On CPU the payload is in host memory, so a
    mismatch raises at the call, except while :func:`set_queue_order_flags_on_cpu` is on (tests
    run the device path on gloo ranks with it)."""
    return queues_order_flags_on(input.device)


def queues_order_flags_on(device: torch.device) -> bool:
    """:func:`queues_order_flag` for calls on ``device``."""
    return device.type != "cpu" or _QUEUE_ON_CPU


def cpu_queues_order_flags() -> bool:
    """Whether CPU calls leave their call-order flags for later (only while
    :func:`set_queue_order_flags_on_cpu` is on)."""
    return _QUEUE_ON_CPU


def set_queue_order_flags_on_cpu(enabled: bool) -> None:
    """Make CPU calls of the pure-PyTorch kernels (``impl="reference"``) leave their call-order
    flags for later, as calls on CUDA tensors do (for tests; the C++ CPU kernels always check
    at once)."""
    global _QUEUE_ON_CPU
    _QUEUE_ON_CPU = enabled
