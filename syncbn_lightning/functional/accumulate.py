"""Statistics merged over many batches: count, mean and M2 per channel, in float64.

The one count-weighted merge of per-channel statistics that outlives a call (Chan et al.'s
parallel update, :func:`merge_into`): PreciseBN's population statistics
(:mod:`syncbn_lightning.nn.precise_bn`) accumulate with it, and so does the running-statistics
policy that defers a layer's update to the end of an optimizer step (:class:`StepGroup` and its
layers' :class:`StepStatistics`, plugged into :mod:`.layer_call`'s one slot for it, ``_state``,
by :func:`syncbn_lightning.step_statistics`). A call's own exchange merges the ranks' statistics
in its kernels; this merges what calls return.

The merge and the step's commit are ``torch._foreach_*`` ops over every layer at once: a step
costs a fixed number of dispatcher ops (kernels on a GPU) however many layers it covers.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
from typing import Any

import torch

__all__ = [
    "NORMALIZE_MODES",
    "StatsAccumulator",
    "StepGroup",
    "StepStatistics",
    "merge_into",
    "take_group",
]

#: The ``normalize=`` modes of :func:`syncbn_lightning.step_statistics`.
NORMALIZE_MODES = ("micro", "step")

_F64 = torch.float64


def merge_into(
    count: torch.Tensor,
    mean: torch.Tensor,
    m2: torch.Tensor,
    counts: torch.Tensor,
    means: torch.Tensor,
    m2s: torch.Tensor,
) -> None:
    """Merge ``k`` batches into one accumulator, in place, float64: it holds ``count`` values
    (``[1]``, or one per channel, ``[C]``) of mean ``mean`` and sum of squared deviations
    ``m2`` per channel (``[C]``); batch ``j`` holds ``counts[j]`` values (``[k, 1]`` or
    ``[k, C]``, whole numbers; 0: an empty batch, whose finite row adds nothing) of mean
    ``means[j]`` and deviations ``m2s[j]`` (``[k, C]``, any floating dtype).

    The deviations are taken from the merged mean (the parallel update of Chan et al. for
    ``k + 1`` parts at once), so the result does not depend on the batches' order beyond
    rounding. A fixed number of ops for any ``k`` (and, laid side by side, any number of
    layers); no host sync."""
    total = count + counts.sum(0)
    merged = (count * mean + (counts * means).sum(0)) / total.clamp_min(1)
    spread = (counts * (means - merged).square()).sum(0)
    m2.add_(m2s.sum(0) + spread + count * (mean - merged).square())
    mean.copy_(merged)
    count.copy_(total)


class StatsAccumulator:
    """Count, mean and M2 of one layer's values, merged batch by batch (:func:`merge_into`), in
    float64 on ``device``; ``count`` is ``[1]``, ``mean`` and ``m2`` have one value per
    channel."""

    def __init__(self, channels: int, device: torch.device | str | None = None) -> None:
        self.count = torch.zeros(1, dtype=_F64, device=device)
        self.mean = torch.zeros(channels, dtype=_F64, device=device)
        self.m2 = torch.zeros(channels, dtype=_F64, device=device)

    def merge_rows(self, counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor) -> None:
        """Merge ``k`` batches: ``counts`` ``[k]`` values per channel (0: an empty batch, whose
        row must be finite), their ``means`` and sums of squared deviations ``m2s`` (``[k,
        C]``, any floating dtype). No host sync."""
        merge_into(self.count, self.mean, self.m2, counts.to(_F64).view(-1, 1), means, m2s)

    def merge(self, n: float | torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Merge one batch: ``n`` values (a whole number, or a tensor of one) of mean ``mean``
        and sum of squared deviations ``m2`` per channel."""
        count = torch.as_tensor(n, dtype=_F64, device=self.count.device).view(1, 1)
        merge_into(self.count, self.mean, self.m2, count, mean.view(1, -1), m2.view(1, -1))


# How a pending call's values read (its first field): a group's unbiased or biased variance over
# info[0] values, or (a float: the eps) a plain batch's count and invstd.
_GROUP_UNBIASED, _GROUP_BIASED = "unbiased", "biased"

_Call = tuple[Any, Any, torch.Tensor, torch.Tensor]


def _batches(calls: list[_Call]) -> tuple[list[torch.Tensor], ...]:
    """``(counts, divisors, means, variances)`` of ``calls``, in their order, the calls of each
    rule converted at once: a call's M2 is its variance times its divisor (``[1]`` each, float64,
    like its count; its variance and mean have one value per channel)."""
    counts: list[Any] = [None] * len(calls)
    divisors: list[Any] = [None] * len(calls)
    means: list[Any] = [call[2] for call in calls]
    variances: list[Any] = [call[3] for call in calls]
    rules: collections.defaultdict[Any, list[int]] = collections.defaultdict(list)
    for index, call in enumerate(calls):
        rules[call[0]].append(index)
    for rule, indices in rules.items():
        if isinstance(rule, float):  # plain batches: var = invstd ** -2 - eps, rounded as var + eps
            device = calls[indices[0]][2].device
            host = torch.tensor([[float(calls[i][1])] for i in indices], dtype=_F64)
            ns = divs = list(host.to(device, non_blocking=True).unbind())
            plain = torch._foreach_pow([calls[i][3] for i in indices], -2)
            torch._foreach_sub_(plain, rule)
            torch._foreach_clamp_min_(plain, 0)
            for i, var in zip(indices, plain, strict=True):
                variances[i] = var
        else:
            n = torch.stack([calls[i][1] for i in indices])[:, :1].to(_F64)
            ns = list(n.unbind())
            divs = list((n - 1).unbind()) if rule == _GROUP_UNBIASED else ns
        for i, count, divisor in zip(indices, ns, divs, strict=True):
            counts[i], divisors[i] = count, divisor
    return counts, divisors, means, variances


#: Calls a layer keeps before its group merges them (the step's memory stays O(C): at most this
#: many results of C values a layer); the merge costs the same for one call a layer or many.
PENDING_CALLS = 8


class StepStatistics:
    """One layer's running-statistics policy for the training calls of one optimizer step
    (:func:`syncbn_lightning.step_statistics`): the calls update no running statistic, each
    adds the statistics it normalized with (:meth:`add_group`, :meth:`batch_norm`), and its
    :class:`StepGroup`'s commit makes the step's one update from their merge.

    With ``normalize="micro"`` each call normalizes with its own group's statistics; with
    ``"step"`` with those merged with the layer's earlier calls in the step (:attr:`prior`, one
    more input of the exchange's merge), and the last call's merge is the step's.

    Attributes:
        normalize: ``"micro"`` or ``"step"``.
        prior: with ``"step"``, the merged statistics of the layer's calls so far, as the
            exchanges take them (:meth:`~.exchange.Exchange.prior_of`), in the layer's row of
            its group's :attr:`~StepGroup.rows`, which every call overwrites in place (before
            the first call zeros, which add nothing: a compiled call sees a tensor either way).
        group: the layers it commits with.
        index: its place in them.
        pending: calls added and not merged yet (their results as they came, at most
            :data:`PENDING_CALLS`): eager calls merge in batches, compiled ones at once.
        scratch: what the kernels update in place of the layer's running mean, variance and
            ``num_batches_tracked``: copies taken at the step's start, which move as the
            layer's would without the context (so the reduce exchange's shift, the running
            mean, is the one it would read there); the buffers never see them.
        called: whether a call added to it (a layer not called in the step is left alone).
    """

    def __init__(
        self, group: StepGroup, index: int, scratch: tuple[torch.Tensor, ...], normalize: str
    ) -> None:
        self.group, self.index, self.scratch, self.normalize = group, index, scratch, normalize
        self.pending: list[_Call] = []
        self.prior: torch.Tensor | None = None
        self.called = False

    def wrote_prior(self) -> None:
        """``normalize="step"``: a call has written its merged statistics (the step's so far)
        into :attr:`prior` in place (the C++ operator, or the Function from
        :meth:`~.exchange.Exchange.prior_of`); the next call merges them with its group's and
        the commit takes the last as the step's."""
        self.called = True

    def add_group(
        self, info: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, unbiased: bool
    ) -> None:
        """Add a synchronized call's result: its group's ``mean`` and ``var`` per channel
        (unbiased, ``M2 / (count - 1)``, or not, ``M2 / count``) over ``info[0]`` values per
        channel (0: an empty group, which adds nothing); constants of the merge
        (:func:`_constant`)."""
        rule = _GROUP_UNBIASED if unbiased else _GROUP_BIASED
        self._add((rule, _constant(info), _constant(mean), _constant(var)))

    def batch_norm(
        self,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """A plain training call in the step (a layer without a group): torch's batch norm of
        ``input`` with its batch's statistics and no running statistics, whose mean and
        inverse standard deviation (float32 or wider; ``var = invstd ** -2 - eps``, biased) the
        step adds. An empty batch adds nothing."""
        if input.numel() == 0:  # (torch's batch_norm takes it, its native kernel does not)
            return torch.nn.functional.batch_norm(input, None, None, weight, bias, True, 0.0, eps)
        output, mean, invstd = torch.native_batch_norm(
            input, weight, bias, None, None, True, 0.0, eps
        )
        count = input.numel() // input.shape[1]
        self._add((eps, count, _constant(mean), _constant(invstd)))
        return output

    def _add(self, call: _Call) -> None:
        """Keep ``call`` (a rule of :func:`_batches`, then its values) to merge, or merge it now
        in compiled code (a list that grows would recompile each call)."""
        self.called = True
        if torch.compiler.is_compiling():
            places: list[_Call | None] = [None] * len(self.group.layers)
            places[self.index] = call
            self.group.merge([places])
            return
        self.pending.append(call)
        if len(self.pending) == PENDING_CALLS:
            self.group.merge_pending()


def _constant(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a constant of the step's merge: detached where autograd tracks it, and
    always in compiled code, where it costs nothing at run time (torch 2.4's trace sees a
    Function's statistics as untracked, and its compiled merge failed on them undetached). (Not
    detached otherwise in eager code: a detach is a dispatcher op even then, 2 per call of a
    plain layer on torch 2.13 and 4 on 2.4 and 2.8.)"""
    if tensor.requires_grad or torch.compiler.is_compiling():
        return tensor.detach()
    return tensor


@functools.lru_cache(maxsize=64)
def _channel_index(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """For layers of ``sizes`` channels laid side by side: each channel's layer, and each
    layer's first channel (int64, on ``device``; kept, as every step of a model asks again)."""
    layer_of_channel = [layer for layer, size in enumerate(sizes) for _ in range(size)]
    first_channel = list(itertools.accumulate(sizes[:-1], initial=0))
    host = torch.tensor(layer_of_channel + first_channel)
    return host.to(device, non_blocking=True).split([len(layer_of_channel), len(sizes)])


@functools.lru_cache(maxsize=64)
def _row_index(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """For layers of ``sizes`` channels whose step rows (:attr:`StepStatistics.prior`, ``[count,
    samples, tags[2], mean[C], mean_lo[C], m2[C]]``) lie end to end: where, per channel of every
    layer, its layer's count is, then its own mean, mean's low part and M2 (four runs of
    ``sum(sizes)`` places, int64, on ``device``; kept, as :func:`_channel_index`)."""
    places: list[list[int]] = [[], [], [], []]
    starts = itertools.accumulate((4 + 3 * size for size in sizes), initial=0)
    for start, size in zip(starts, sizes, strict=False):  # (one start more than layers)
        places[0] += [start] * size
        for part, first in enumerate((4, 4 + size, 4 + 2 * size), 1):
            places[part] += range(start + first, start + first + size)
    host = torch.tensor([place for part in places for place in part])
    return host.to(device, non_blocking=True)


#: What makes two groups alike (:func:`take_group`): the layers' channels, their running
#: statistics' device and dtype, their momentum and variance rule, and the ``normalize`` mode.
GroupKind = tuple[tuple[int, ...], torch.device, torch.dtype, "float | None", bool, str]

#: Groups kept between steps, at most this many (process-wide, not per model: a model's step
#: takes one per kind of its layers, and its next step takes the same ones back).
KEPT_GROUPS = 8
# Idle groups by kind and by the CUDA stream their ops ran on (None off CUDA): a group is taken
# again only on its stream, whose order puts its next start after its last commit.
_IDLE: dict[tuple[GroupKind, Any], StepGroup] = {}
_IDLE_LOCK = threading.Lock()


def _stream_of(device: torch.device) -> Any:
    """The stream a step's ops on ``device`` run on now (``None`` off CUDA)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def take_group(
    buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    momentum: float | None,
    unbiased: bool,
    normalize: str,
) -> StepGroup:
    """A :class:`StepGroup` for the layers holding ``buffers`` (each ``(running_mean,
    running_var, num_batches_tracked)``; one device and dtype), started (:meth:`StepGroup.start`):
    an idle one of the same kind on the same stream, as an earlier step left it (that of the same
    layers, or of any alike: :meth:`StepGroup.release`), else a new one. A step that takes idle
    groups makes no memory and starts with 2 ops (``"micro"``) or 3 (``"step"``)."""
    running_mean = buffers[0][0]
    sizes = tuple(layer[0].shape[0] for layer in buffers)
    kind = (sizes, running_mean.device, running_mean.dtype, momentum, unbiased, normalize)
    key = (kind, _stream_of(running_mean.device))
    with _IDLE_LOCK:
        group = _IDLE.pop(key, None)
    if group is None:
        group = StepGroup(*kind)
    group.start(buffers)
    group.key = key
    return group


class StepGroup:
    """The layers of one step that commit together (same device, running-statistics dtype,
    momentum and variance rule), their merges side by side in one float64 buffer: per channel
    of every layer a count, a mean and an M2. Merging and committing cost a fixed number of ops
    for the whole group, however many layers and calls. Taken at a step's start
    (:func:`take_group`: an idle one of its :data:`GroupKind`, else a new one) and released at
    its end, for the next step alike.

    Args:
        sizes: each layer's channels.
        device: where the layers' running statistics are.
        dtype: their dtype.
        momentum: the layers' momentum (``None``: the cumulative average).
        unbiased: whether ``running_var`` takes the unbiased variance.
        normalize: what the layers' calls normalize with (:class:`StepStatistics`).
    """

    def __init__(
        self,
        sizes: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        momentum: float | None,
        unbiased: bool,
        normalize: str = "micro",
    ) -> None:
        self.key: tuple[GroupKind, Any] | None = None  # where it waits when idle (take_group)
        self.momentum, self.unbiased, self.device = momentum, unbiased, device
        self.sizes = list(sizes)
        total = sum(sizes)
        self.state = torch.zeros(4 * total + 1, dtype=_F64, device=device)
        self.counts, self.means, self.m2s, zeros, _ = self.state.split([total] * 4 + [1])
        self.no_count = self.state[-1:]  # the count of a layer's empty place in a merge
        self.no_values = list(zeros.split(self.sizes))  # its mean and M2
        self.layer_of_channel, self.first_channel = _channel_index(sizes, device)
        # Per value of a commit (every layer's means, then every layer's variances): its layer.
        self.layer_of_value = self.layer_of_channel.repeat(2)
        # The copies the calls update, laid side by side; each step's start refreshes them.
        runnings = torch.zeros(2 * total, dtype=dtype, device=device).split(self.sizes * 2)
        tracked = torch.zeros(len(sizes), dtype=torch.long, device=device).unbind()
        scratch = [(runnings[i], runnings[len(sizes) + i], tracked[i]) for i in range(len(sizes))]
        self.scratch = [t for layer in scratch for t in layer]
        self.layers = [
            StepStatistics(self, index, copies, normalize) for index, copies in enumerate(scratch)
        ]
        self.rows: torch.Tensor | None = None
        if normalize == "step":
            # In the dtype of the calls' statistics (float32 for a float32 or half layer): both
            # paths write a call's merge into its layer's row, which keeps its dtype (a compiled
            # call would recompile on another).
            widths = [4 + 3 * size for size in sizes]
            row_dtype = torch.promote_types(dtype, torch.float32)
            self.rows = torch.zeros(sum(widths), dtype=row_dtype, device=device)
            for layer, row in zip(self.layers, self.rows.split(widths), strict=True):
                layer.prior = row

    def start(self, buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Ready the group for a step of the layers holding ``buffers``: no merge yet (with
        ``"step"``, rows of zeros, whose count adds nothing), the copies taken from their running
        statistics now, no layer called."""
        self.state.zero_()
        if self.rows is not None:
            self.rows.zero_()
        torch._foreach_copy_(self.scratch, [t for layer in buffers for t in layer])
        for layer in self.layers:
            layer.pending.clear()
            layer.called = False

    def release(self) -> None:
        """The step has ended: keep the group for the next step of its kind on its stream (the
        most recent :data:`KEPT_GROUPS`; one made under ``torch.inference_mode`` is not kept, as
        its tensors could not be written outside it)."""
        if self.key is None or self.state.is_inference():
            return
        with _IDLE_LOCK:
            _IDLE[self.key] = self
            while len(_IDLE) > KEPT_GROUPS:
                del _IDLE[next(iter(_IDLE))]

    def _check_device(self, tensor: torch.Tensor, what: str) -> None:
        """Refuse ``tensor`` (``what`` it is) on another device than the step's."""
        if tensor.device != self.device:
            raise RuntimeError(
                f"step_statistics: {what} on {tensor.device}, its step's statistics are on "
                f"{self.device}: move the model before the step starts or after it ends"
            )

    def merge(self, rounds: list[list[_Call | None]]) -> None:
        """Merge ``rounds`` of calls, one place per layer in each (``None``: none of that
        layer's), into the layers' merges: every call at once."""
        calls = [call for places in rounds for call in places if call is not None]
        for call in calls:
            self._check_device(call[2], "a layer's call ran")
        converted = [iter(part) for part in _batches(calls)]
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for places in rounds:
            for index, call in enumerate(places):
                empty = (self.no_count, self.no_count, self.no_values[index], self.no_values[index])
                for part, values, nothing in zip(parts, converted, empty, strict=True):
                    part.append(nothing if call is None else next(values))
        shape = (len(rounds), -1)
        counts, divisors = (
            torch.cat(part).view(shape).index_select(1, self.layer_of_channel) for part in parts[:2]
        )
        means, variances = (torch.cat(part).view(shape) for part in parts[2:])
        merge_into(self.counts, self.means, self.m2s, counts, means, variances * divisors)

    def merge_pending(self) -> None:
        """Merge every layer's pending calls (the ``j``-th of each in round ``j``)."""
        depth = max(len(layer.pending) for layer in self.layers)
        if depth:
            pending = [
                layer.pending + [None] * (depth - len(layer.pending)) for layer in self.layers
            ]
            self.merge([list(places) for places in zip(*pending, strict=True)])
        for layer in self.layers:
            layer.pending.clear()

    def merged(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's count, mean and M2 per channel of every layer (float64): the merge of the
        calls added (``"micro"``); with ``"step"``, the rows the layers' last calls wrote, each
        the merge of its layer's calls in the step (a layer not called: zeros)."""
        if self.rows is None:
            self.merge_pending()
            return self.counts, self.means, self.m2s
        places = _row_index(tuple(self.sizes), self.device)
        count, mean, mean_lo, m2 = self.rows.to(_F64).index_select(0, places).view(4, -1).unbind()
        return count, mean + mean_lo, m2

    def commit(
        self,
        buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        nonfinite: list[torch.Tensor],
    ) -> None:
        """The step's one update of every layer called in it, in place, by the merges' rules:
        its ``buffers`` (``(running_mean, running_var, num_batches_tracked)``, as the layer
        holds them now) take it; ``num_batches_tracked`` counts it where the layer's
        statistics are finite (its ``nonfinite`` counter where not), and the running statistics
        move by the momentum (``None``: the cumulative average, ``1 / num_batches_tracked``)
        towards the step's mean and variance, unless those are not finite or the step saw no
        value. No host sync; a fixed number of ops (about 30) for the whole group."""
        called = [layer.index for layer in self.layers if layer.called]
        if not called:
            return
        for running_mean, _, _ in buffers:
            self._check_device(running_mean, "a layer's running statistics are")
        counts, means, m2s = self.merged()
        var = m2s / (counts - 1 if self.unbiased else counts).clamp_min(1)
        values = torch.cat([means, var])  # every layer's means, then every layer's variances
        # A sum of |values| is finite exactly when every value is (float64 does not overflow on
        # statistics of float32 or half values), and x * 0 == 0 exactly when x is finite. (Not
        # index_add_: on CUDA its deterministic mode takes another kernel; these sums have one.)
        sums = torch._foreach_norm(values.split(self.sizes * 2), 1)
        finite = torch.stack(sums).mul(0).eq(0).view(2, -1).all(0)
        flags = torch.cat([finite, finite.logical_not()]).unbind()  # counted, then skipped
        skipped_at = len(self.sizes)
        torch._foreach_add_(
            [buffers[i][2] for i in called] + [nonfinite[i] for i in called],
            [flags[i] for i in called] + [flags[skipped_at + i] for i in called],
        )
        # False for a layer not called: its count is 0.
        update = finite & counts.index_select(0, self.first_channel).gt(0)
        if self.momentum is None:
            steps = torch.stack([layer[2] for layer in buffers]).clamp_min(1)
            factors = update / steps.to(_F64)
        else:
            factors = update.to(_F64).mul_(self.momentum)
        dtype = buffers[0][0].dtype
        weights = factors.index_select(0, self.layer_of_value).to(dtype)
        # Where not updated the weight is 0 and the target 0, not inf or nan (whose product with
        # 0 is nan): the value stays, exactly.
        targets = values.nan_to_num_(0.0, 0.0, 0.0).to(dtype)
        runnings = [layer[0] for layer in buffers] + [layer[1] for layer in buffers]
        torch._foreach_lerp_(runnings, targets.split(self.sizes * 2), weights.split(self.sizes * 2))
