"""Statistics merged over many batches: count, mean and M2 per channel, in float64.

The one count-weighted merge of per-channel statistics that outlives a call (Chan et al.'s
parallel update): PreciseBN's population statistics (:mod:`syncbn_lightning.nn.precise_bn`)
accumulate with it, and so does the running-statistics policy that defers a layer's update to
the end of an optimizer step (:class:`StepStatistics`, plugged into :mod:`.layer_call`'s one slot
for it, ``_state``, by :func:`syncbn_lightning.step_statistics`). A call's own exchange merges the
ranks' statistics in its kernels; this merges what calls return.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NORMALIZE_MODES", "StatsAccumulator", "StepStatistics"]

#: The ``normalize=`` modes of :func:`syncbn_lightning.step_statistics`.
NORMALIZE_MODES = ("micro", "step")


class StatsAccumulator:
    """Count, mean and M2 of one layer's values, merged batch by batch, in float64 on
    ``device``; ``count`` is 0-d, ``mean`` and ``m2`` have one value per channel."""

    def __init__(self, channels: int, device: torch.device | str | None = None) -> None:
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.mean = torch.zeros(channels, dtype=torch.float64, device=device)
        self.m2 = torch.zeros(channels, dtype=torch.float64, device=device)

    def merge_rows(self, counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor) -> None:
        """Merge ``k`` batches at once: ``counts`` ``[k]`` values per channel (whole numbers; 0:
        an empty batch, whose row must be finite and adds nothing), their ``means`` and sums of
        squared deviations ``m2s`` (``[k, C]``, any floating dtype). Exact in float64: the
        deviations are taken from the merged mean (the two-pass form of Chan's update). No host
        sync: everything stays on the device."""
        counts = counts.to(torch.float64)
        weights = counts.unsqueeze(1)
        total = self.count + counts.sum()
        mean = (self.mean * self.count + (weights * means).sum(0)) / total.clamp(min=1)
        spread = (weights * (means - mean).square()).sum(0)
        self.m2 += m2s.sum(0) + spread + self.count * (self.mean - mean).square()
        self.count, self.mean = total, mean

    def merge(self, n: float | torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """:meth:`merge_rows` of one batch: ``n`` values (a whole number, or a 0-d tensor of
        one) of mean ``mean`` and sum of squared deviations ``m2`` per channel."""
        counts = torch.as_tensor(n, dtype=torch.float64, device=self.count.device).reshape(1)
        self.merge_rows(counts, mean.unsqueeze(0), m2.unsqueeze(0))

    def to(self, device: torch.device) -> StatsAccumulator:
        """This accumulator, its values moved to ``device`` (itself when already there)."""
        if self.mean.device != device:
            moved = (t.to(device) for t in (self.count, self.mean, self.m2))
            self.count, self.mean, self.m2 = moved
        return self


# How a pending call's values read (its first field): a group's unbiased or biased variance over
# info[0] values, or (a float: the eps) a plain batch's count and invstd.
_GROUP_UNBIASED, _GROUP_BIASED = "unbiased", "biased"


def _rows(calls: list[tuple[Any, Any, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """``(counts, means, m2s)`` of pending calls of one rule, for
    :meth:`StatsAccumulator.merge_rows`."""
    rule = calls[0][0]
    means = torch.stack([call[2] for call in calls])
    spreads = torch.stack([call[3] for call in calls])
    if isinstance(rule, float):  # plain batches: var = invstd ** -2 - eps, rounded as var + eps
        counts = torch.tensor([call[1] for call in calls], dtype=torch.float64, device=means.device)
        variances = (spreads.pow(-2) - rule).clamp(min=0)
        return counts, means, variances * counts.unsqueeze(1)
    counts = torch.stack([call[1] for call in calls])[:, 0].to(torch.float64)
    divisors = counts - 1 if rule == _GROUP_UNBIASED else counts
    return counts, means, spreads * divisors.unsqueeze(1)


#: Calls a step keeps before it merges them (its memory stays O(C): at most this many results of
#: C values a layer), and merges at once: one merge of many costs about what one of one does.
PENDING_CALLS = 8


class StepStatistics:
    """One layer's running-statistics policy for the training calls of one optimizer step
    (:func:`syncbn_lightning.step_statistics`): the calls update no running statistic, each
    adds the statistics it normalized with (:meth:`add`), and :meth:`commit` makes the step's
    one update from their merge.

    Each call normalizes with its own group's statistics (``normalize="micro"``, the one mode
    built).

    Attributes:
        stats: the merge of the step's calls so far, in float64 on the layer's device; not a
            buffer, so neither the ``state_dict`` nor DDP's broadcast carries it.
        pending: calls added and not merged yet (their results as they came, at most
            :data:`PENDING_CALLS`): eager calls merge in batches, compiled ones at once.
        scratch: what the kernels update in place of the layer's running mean, variance and
            ``num_batches_tracked``: copies made at the step's start, which move as the
            layer's would without the context (so the reduce exchange's shift, the running
            mean, is the one it would read there) and are dropped at its end.
        called: whether a call added to it (a layer not called in the step is left alone).
    """

    __slots__ = ("called", "pending", "scratch", "stats")

    def __init__(
        self,
        running_mean: torch.Tensor,
        running_var: torch.Tensor,
        num_batches_tracked: torch.Tensor,
    ) -> None:
        self.stats = StatsAccumulator(running_mean.shape[0], running_mean.device)
        self.pending: list[tuple[Any, Any, torch.Tensor, torch.Tensor]] = []
        self.scratch = (running_mean.clone(), running_var.clone(), num_batches_tracked.clone())
        self.called = False

    def add_group(
        self, info: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, unbiased: bool
    ) -> None:
        """Add a synchronized call's result: its group's ``mean`` and ``var`` per channel
        (unbiased, ``M2 / (count - 1)``, or not, ``M2 / count``) over ``info[0]`` values per
        channel (0: an empty group, which adds nothing)."""
        self._add((_GROUP_UNBIASED if unbiased else _GROUP_BIASED, info, mean, var))

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
        self._add((eps, count, mean.detach(), invstd.detach()))
        return output

    def _add(self, call: tuple[Any, Any, torch.Tensor, torch.Tensor]) -> None:
        """Keep ``call`` (a rule of :func:`_rows`, then its values) to merge, or merge it now
        in compiled code (a list that grows would recompile each call)."""
        self.called = True
        if torch.compiler.is_compiling():
            self.stats.to(call[2].device).merge_rows(*_rows([call]))
            return
        self.pending.append(call)
        if len(self.pending) == PENDING_CALLS:
            self._merge_pending()

    def _merge_pending(self) -> None:
        """Merge the pending calls into :attr:`stats`, those of each rule at once."""
        rules: dict[Any, list[Any]] = {}
        for call in self.pending:
            rules.setdefault(call[0], []).append(call)
        for calls in rules.values():
            self.stats.to(calls[0][2].device).merge_rows(*_rows(calls))
        self.pending.clear()

    def commit(
        self,
        running_mean: torch.Tensor,
        running_var: torch.Tensor,
        num_batches_tracked: torch.Tensor,
        nonfinite: torch.Tensor,
        momentum: float | None,
        unbiased: bool,
    ) -> None:
        """The step's one update, in place, by the merges' rules: ``num_batches_tracked`` counts
        it where the step's statistics are finite (``nonfinite`` where not), and the running
        statistics move by ``momentum`` (``None``: the cumulative average, ``1 /
        num_batches_tracked``) towards the step's mean and variance (unbiased unless not),
        unless those are not finite or the step saw no value. No host sync."""
        if not self.called:
            return
        self._merge_pending()
        stats = self.stats
        device = running_mean.device
        count, mean, m2 = stats.to(device).count, stats.mean, stats.m2
        var = m2 / (count - 1 if unbiased else count).clamp(min=1)
        finite = (mean.isfinite() & var.isfinite()).all()
        num_batches_tracked.add_(finite)
        nonfinite.add_(~finite)
        update = finite & (count > 0)
        factor: float | torch.Tensor = (
            momentum
            if momentum is not None
            else (num_batches_tracked.clamp(min=1).to(running_mean.dtype).reciprocal())
        )
        for running, step in ((running_mean, mean), (running_var, var)):
            # Towards itself (no change) where the step is not taken.
            running.lerp_(torch.where(update, step.to(running.dtype), running), factor)
