"""A synchronized layer under activation checkpointing: the recompute repeats nothing.

``torch.utils.checkpoint`` runs a segment's forward twice: once in the forward pass, and again
during the backward to rebuild what it did not keep. Every torch BatchNorm updates its running
statistics both times (pytorch/pytorch#96136), and torch's SyncBatchNorm repeats its collective.
Here a training call that is a recompute (a forward while autograd's engine runs a backward on
the thread) instead:

* takes the statistics its first forward computed (:class:`Kept`: O(C) tensors, kept on the
  checkpoint's own object, the reentrant checkpoint's autograd context or the non-reentrant
  checkpoint's frame, so they are freed with the graph), with no collective;
* normalizes with them (``syncbn::renormalize``, the merges' own normalize: bitwise the first
  output), and makes the same autograd node, saving the same tensors, so that the backward runs
  the layer's backward (its one collective) with the first forward's statistics;
* updates no running statistic, counts nothing (``num_batches_tracked``, the call-order
  counter), and leaves ``last_batch`` as the forward set it.

A checkpoint's calls are matched by their order: the recompute of a segment calls the layers its
forward called, in the same order (a ``retain_graph=True`` backward recomputes again, from the
start). Where the first forward could not keep its statistics (a release or a layout of
``torch.utils.checkpoint`` not recognized: ``_compat.py``; a checkpoint nested in a recompute; a
saved-tensors hook of the user's inside the checkpoint), the recompute exchanges again (the same
rows, so the same statistics) and still updates nothing. A layer without a group recomputes its
local statistics (the same input, so the same output) without touching its buffers.

``SYNCBN_RECOMPUTE=repeat`` turns all of this off (torch's behaviour: a recompute exchanges and
updates again), for comparisons (``benchmarks/bench_checkpoint.py``); ``reuse`` (the default) is
the above. It is read at each recompute and at each checkpointed forward, never on other calls.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .._compat import checkpoint_forward_segment, checkpoint_recompute_segment

__all__ = [
    "RECOMPUTE_ENV",
    "Kept",
    "RecomputeOrderError",
    "find_kept",
    "keep",
    "keeping",
    "plain_again",
    "recompute_task",
    "reuse_enabled",
]

#: ``reuse`` (the default): a recompute repeats nothing; ``repeat``: torch's behaviour.
RECOMPUTE_ENV = "SYNCBN_RECOMPUTE"

#: The attributes a checkpoint's object carries: its calls' kept statistics, and where the
#: recompute running now is (the backward's graph task, the position).
_KEPT = "_syncbn_kept"
_CURSOR = "_syncbn_recompute_at"


class RecomputeOrderError(RuntimeError):
    """A checkpoint's recompute called other synchronized layers, or other shapes, than its
    forward did."""


class Kept(NamedTuple):
    """What a checkpointed forward call keeps for its recompute (the merge's statistics, in the
    acc dtype, ``[C]``; ``info`` and ``grad_info`` as the merge returns them)."""

    layer: weakref.ref[Any]
    shape: tuple[int, ...]
    mean: torch.Tensor
    mean_lo: torch.Tensor
    invstd: torch.Tensor
    var: torch.Tensor
    info: torch.Tensor
    grad_info: torch.Tensor
    #: the flight recorder's number of the call (its backward's collective is noted with it).
    flight_call: int


def reuse_enabled() -> bool:
    """Whether ``SYNCBN_RECOMPUTE`` asks for the recompute to repeat nothing (``reuse``, also
    when unset) rather than torch's behaviour (``repeat``).

    Raises:
        ValueError: on another value, naming the variable and its two values.
    """
    value = os.environ.get(RECOMPUTE_ENV, "reuse").strip()
    if value in ("", "reuse"):
        return True
    if value == "repeat":
        return False
    raise ValueError(
        f"{RECOMPUTE_ENV}={value!r} is not valid: use reuse (a checkpoint's recompute takes its "
        "forward's statistics, the default) or repeat (it exchanges and updates again, as torch's "
        "layers do)"
    )


def recompute_task(task: int) -> int:
    """The backward whose checkpoint recomputes this training call: ``task``, the graph task
    ``_compat.current_graph_task()`` read (-1: none, the call is not a recompute), or ``-1``
    where ``SYNCBN_RECOMPUTE=repeat``. Callers on the per-call path read the task themselves
    and call this only when it is not -1 (no Python frame otherwise)."""
    return task if task != -1 and reuse_enabled() else -1  # (-1 stays -1 either way)


def keeping() -> Any:
    """The checkpoint whose forward this call runs in (``None``: none, not recognized, or
    ``SYNCBN_RECOMPUTE=repeat``)."""
    segment = checkpoint_forward_segment()
    return segment if segment is not None and reuse_enabled() else None


def keep(segment: Any, layer: Any, input: torch.Tensor, *stats: Any) -> None:
    """Keep a forward call's statistics on ``segment`` (``stats``: :class:`Kept`'s fields after
    ``shape``)."""
    kept = segment.__dict__.get(_KEPT)
    if kept is None:
        kept = segment.__dict__[_KEPT] = []
    kept.append(Kept(weakref.ref(layer), tuple(input.shape), *stats))


def find_kept(layer: Any, input: torch.Tensor, backward: int) -> Kept | None:
    """What ``layer``'s forward kept for this recompute call (``backward``: the graph task
    running it), or ``None`` where it kept nothing (see the module docstring).

    Raises:
        RecomputeOrderError: the recompute calls another layer, or another input shape, than
            the forward's call at the same position.
    """
    segment = checkpoint_recompute_segment()
    if segment is None:
        return None
    state = segment.__dict__
    kept: list[Kept] | None = state.get(_KEPT)
    if not kept:
        return None
    cursor = state.get(_CURSOR)
    position = cursor[1] if cursor is not None and cursor[0] == backward else 0
    state[_CURSOR] = (backward, position + 1)
    entry = kept[position] if position < len(kept) else None
    if entry is None or entry.layer() is not layer or entry.shape != tuple(input.shape):
        called = f"{type(layer).__name__} on an input of shape {tuple(input.shape)}"
        first = "nothing" if entry is None else f"an input of shape {entry.shape}"
        if entry is not None and entry.layer() is not layer:
            first = "another synchronized layer"
        raise RecomputeOrderError(
            f"activation checkpointing: the recompute's synchronized call #{position + 1} is "
            f"{called}, where the checkpoint's forward called {first}. The checkpointed "
            "function must call the same layers on the same shapes in the same order both "
            "times (no control flow on data, random choices or train/eval changes inside it)"
        )
    return entry


def plain_again(layer: Any, input: torch.Tensor, weight: Any, bias: Any) -> torch.Tensor:
    """The recompute of a training call without a group (plain BatchNorm): the same kernels on
    the same input (so the same output), with throwaway copies of the running statistics."""
    buffers = layer._buffers
    running_mean, running_var = buffers["running_mean"], buffers["running_var"]
    if layer.track_running_stats and running_mean is not None:
        running_mean, running_var = running_mean.clone(), running_var.clone()
    else:
        running_mean = running_var = None
    momentum = 0.0 if layer.momentum is None else layer.momentum
    return F.batch_norm(input, running_mean, running_var, weight, bias, True, momentum, layer.eps)
