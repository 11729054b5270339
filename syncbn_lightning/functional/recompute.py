"""What kind of training call a layer call is, under activation checkpointing: the recompute
repeats nothing.

``torch.utils.checkpoint`` runs a segment's forward twice: once in the forward pass, and again
during the backward to rebuild what it did not keep. Every torch BatchNorm updates its running
statistics both times (pytorch/pytorch#96136), and torch's SyncBatchNorm repeats its collective.
:func:`call_kind` tells the three kinds of training call apart, once per call, and the layer's
call (:mod:`.layer_call`) runs each kind on either path without asking again:

* **plain**: statistics exchanged, running statistics updated, the call counted;
* **a checkpoint's forward** (``CallKind.keep``, the checkpoint): the same, and the call keeps
  its statistics (:class:`Kept`: O(C) values, on the checkpoint's own object, the reentrant
  checkpoint's autograd context or the non-reentrant checkpoint's frame, so they are freed with
  the graph);
* **a recompute** (a forward while autograd's engine runs a backward on the thread,
  ``CallKind.recompute``): it takes what its forward kept (``CallKind.kept``), normalizes with it
  (the merges' own normalize: bitwise the first output) and makes the same autograd node, saving
  the same tensors, so that the backward runs the layer's backward (its one collective) with the
  first forward's statistics. It updates no running statistic, counts nothing
  (``num_batches_tracked``, the call-order counter) and leaves ``last_batch`` as the forward set
  it. Where the forward kept nothing (a release or a layout of ``torch.utils.checkpoint`` not
  recognized: ``_compat.py``; a checkpoint nested in a recompute; a saved-tensors hook of the
  user's inside the checkpoint), it exchanges again (the same rows, so the same statistics) and
  still updates nothing. A layer without a group recomputes its local statistics (the same
  input, so the same output) without touching its buffers.

A checkpoint's calls are matched by their order: the recompute of a segment calls the layers its
forward called, in the same order (a ``retain_graph=True`` backward recomputes again, from the
start).

``SYNCBN_RECOMPUTE=repeat`` turns all of this off (torch's behaviour: a recompute exchanges and
updates again), for comparisons (``benchmarks/bench_checkpoint.py``); ``reuse`` (the default) is
the above. It is read at each recompute and at each checkpointed forward, never on other calls.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, NamedTuple

import torch

from .._compat import (
    checkpoint_forward_segment,
    checkpoint_recompute_segment,
    current_graph_task,
    top_saved_tensors_hooks,
)
from .._shared import INFO_FIELDS, KEPT_PER_CHANNEL

__all__ = [
    "KEPT_PARTS",
    "PLAIN",
    "RECOMPUTE_ENV",
    "CallKind",
    "Kept",
    "RecomputeOrderError",
    "call_kind",
    "keep",
    "pack_kept",
    "reuse_enabled",
]

#: :attr:`Kept.stats`' parts, in order: ``KEPT_PER_CHANNEL`` of one value per channel, then two
#: infos of ``INFO_FIELDS`` values.
KEPT_PARTS = ("mean", "mean_lo", "invstd", "var", "info", "grad_info")
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
    """What a checkpointed forward call keeps for its recompute: the merge's statistics in one
    vector of the acc dtype, laid out as ``KEPT_PER_CHANNEL`` says (mean, mean_lo, invstd and
    var, ``C`` values each, then info and grad_info), and the flight recorder's number of the
    call (its backward's collective is noted with it). Both paths keep and take this vector."""

    layer: weakref.ref[Any]
    shape: tuple[int, ...]
    stats: torch.Tensor
    flight_call: int

    def part(self, name: str) -> torch.Tensor:
        """The kept ``name`` (one of :data:`KEPT_PARTS`): a view of :attr:`stats`."""
        channels, index = self.shape[1], KEPT_PARTS.index(name)
        if index < KEPT_PER_CHANNEL:
            return self.stats[index * channels : (index + 1) * channels]
        start = KEPT_PER_CHANNEL * channels + (index - KEPT_PER_CHANNEL) * INFO_FIELDS
        return self.stats[start : start + INFO_FIELDS]

    mean = property(lambda self: self.part("mean"))
    mean_lo = property(lambda self: self.part("mean_lo"))
    invstd = property(lambda self: self.part("invstd"))
    var = property(lambda self: self.part("var"))
    info = property(lambda self: self.part("info"))
    grad_info = property(lambda self: self.part("grad_info"))


class CallKind(NamedTuple):
    """What one training call is (:func:`call_kind`; the module docstring)."""

    #: a checkpoint's recompute: nothing updated or counted, no last-batch record.
    recompute: bool = False
    #: with ``recompute``: what its forward kept (``None``: exchange again).
    kept: Kept | None = None
    #: a checkpoint's forward: the checkpoint the call keeps its statistics on.
    keep: Any = None


#: A plain training call.
PLAIN = CallKind()


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


def call_kind(layer: Any, input: torch.Tensor, synchronized: bool = True) -> CallKind:
    """The kind of the training call of ``layer`` on ``input`` (the module docstring): the one
    place that decides it. ``synchronized``: the call exchanges statistics (a layer without a
    group keeps nothing, and its recompute takes nothing). Outside a checkpoint this costs two
    calls into torch.

    Raises:
        RecomputeOrderError: a recompute calls another layer, or another input shape, than the
            forward's call at the same position.
    """
    task = current_graph_task()
    if task != -1:  # a forward while a backward runs on this thread: a checkpoint's recompute
        if not reuse_enabled():
            return PLAIN
        return CallKind(True, _find_kept(layer, input, task) if synchronized else None)
    if torch.is_grad_enabled() and top_saved_tensors_hooks(False) is None:
        return PLAIN  # (a reentrant checkpoint's forward runs without grad, the other with hooks)
    segment = checkpoint_forward_segment() if synchronized else None
    if segment is None or not reuse_enabled():
        return PLAIN
    return CallKind(keep=segment)


def pack_kept(*stats: torch.Tensor) -> torch.Tensor:
    """The Python path's :attr:`Kept.stats` from the merge's ``mean, mean_lo, invstd, var, info,
    grad_info`` (the C++ path packs the same in ``csrc/layer/layer.cpp``)."""
    return torch.cat(stats)


def keep(segment: Any, layer: Any, input: torch.Tensor, stats: torch.Tensor, call: int) -> None:
    """Keep a forward call's statistics (``stats``: :attr:`Kept.stats`; ``call``: its flight
    recorder number) on ``segment``, the checkpoint :func:`call_kind` found."""
    kept = segment.__dict__.get(_KEPT)
    if kept is None:
        kept = segment.__dict__[_KEPT] = []
    kept.append(Kept(weakref.ref(layer), tuple(input.shape), stats, call))


def _find_kept(layer: Any, input: torch.Tensor, backward: int) -> Kept | None:
    """What ``layer``'s forward kept for this recompute call (``backward``: the graph task
    running it), or ``None`` where it kept nothing (see the module docstring).

    Raises:
        RecomputeOrderError: see :func:`call_kind`.
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
