"""The call-order check: ranks of a sync group must call their SyncBatchNorm layers, forward and
backward, in the same order.

Collectives pair up by order, so a rank that skips a layer, takes another branch or runs a layer a
different number of times would silently merge statistics of different layers. Every exchange
strategy sends each call's layer and call tags with its statistics, and the backward sends them back
with its sums (a 16-value header, see ``ops.reference.steps.grad_sums``), at no extra collective;
both are checked when the payload arrives: when the ranks' tags disagree, every rank of the group
raises :class:`CallOrderError` naming the layers and ranks (all ranks see the same payload, so they
all raise at the same call, and none is left waiting). A backward mismatch usually means a layer's
output was not used in the loss on some rank (its backward never runs there); the error says so and
how to fix it. On CPU tensors the check runs at once (the payload is in host memory); compiled code
raises the kernel's RuntimeError with the same facts, since a compiled graph cannot re-raise a
Python exception type. On CUDA tensors a check would cost a host sync per layer, so the strategy
leaves a flag on the device and queues it with :func:`queue_order_check`, which copies it to pinned
host memory behind the call's kernels and records an event. Every later synchronized call polls the
queue (:func:`poll_order_checks`: an event query per flag, no host sync), so a mismatch is found a
few layer calls after the device reached it, within the same step (the C++ path keeps its flags in a
queue of its own, in C++, polled the same way and registered here with :func:`register_queue`);
:func:`check_call_order` reads whatever is left at once (one host sync; the callback calls it before
each optimizer step, so a step with mixed statistics is never applied). The rank that finds a
mismatch this way tells its group's other ranks through the job's store and aborts the group
(:mod:`.watcher`), since they may be waiting in a collective it will never join. Compiled calls
cannot queue anything at run time: they note their flags on the layer's status tensor instead
(:func:`note_order_flag`), which :func:`check_call_order` reads. The errors and their messages are
:mod:`.errors`'. A mismatch that changes the payload size (e.g. the skipped layer has another
channel count) cannot be told apart by the payload: gloo then aborts the rank whose receive size
does not match within seconds, NCCL fails the collective at its timeout; the flight recorder
(:mod:`.flight`) names the first collective at which the ranks differed.

The folder's files: ``checks.py`` (the checks, the queue of device flags, ``check_call_order``),
``errors.py`` (``CallOrderError`` and its messages), ``tags.py`` (a layer's tag), ``policy.py``
(which calls queue their flags; the tests' switch for CPU calls) and ``watcher.py`` (a mismatch
found late ends the group's other ranks: the job's watcher).
"""

from .checks import CallOrderError, check_call_order

__all__ = ["CallOrderError", "check_call_order"]
