"""PreciseBN: replace the running EMA with true population statistics.

The running statistics of BatchNorm are an exponential moving average of batch statistics taken
while the weights were still changing, over small (often per-rank) batches. "Rethinking Batch in
BatchNorm" (Wu & Johnson, 2021) shows that recomputing them with the final weights over many
samples closes much of the train/test gap. :func:`update_bn_stats` does that exactly: it runs
``num_batches`` training-mode forwards, accumulates every layer's per-channel count, mean and M2
with Chan's parallel merge in float64, merges them across all ranks with ONE collective at the end,
and writes ``running_mean = mean`` and ``running_var = M2 / (n - 1)`` (``M2 / n`` for layers with
``unbiased_running_var=False``) over the ``n`` values of all ranks and batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..distributed.collectives import gather_rows
from ..functional.accumulate import StatsAccumulator
from ..ops.dispatch import ops_for
from .running_stats import running_stat_layers

__all__ = ["update_bn_stats"]


class _Accumulator(StatsAccumulator):
    """A layer's accumulator for PreciseBN, fed by a forward pre-hook with its input's local
    statistics."""

    def hook(self, _module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach()
        n = x.numel() // x.shape[1]
        if n == 0:
            return
        # A SyncBatchNorm's own implementation choice (impl=), else SYNCBN_IMPL.
        mean, m2 = ops_for(x, getattr(_module, "impl", None)).local_stats(x)
        self.merge(float(n), mean, m2)


@torch.no_grad()
def update_bn_stats(
    model: nn.Module,
    batches: Iterable[Any],
    num_batches: int,
    forward: Callable[[Any], Any] | None = None,
) -> int:
    """Recompute the running statistics of every BatchNorm layer of ``model`` over real batches.

    Must be called on every rank with the same ``num_batches`` (the layers' own collectives run in
    each forward). The model is put in training mode for the pass (so that the layers normalize
    with batch statistics, as in training) and every module's mode is restored afterwards;
    ``momentum`` and ``num_batches_tracked`` are restored too, even when a forward raises.

    Args:
        model: the model; every ``_BatchNorm`` with running stats is updated.
        batches: an iterable of batches; only the first ``num_batches`` are used.
        num_batches: how many batches to run (>= 1). All ranks must pass the same number.
        forward: ``forward(batch)`` runs the model on one batch. Default: ``model(batch)``.

    Returns:
        The number of batches actually used on this rank (fewer when ``batches`` is shorter).

    Raises:
        ValueError: when ``num_batches < 1``, or when ``batches`` yields nothing on every rank.

    Example:
        >>> import torch, torch.nn as nn
        >>> net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        >>> data = [torch.randn(8, 4) for _ in range(5)]
        >>> update_bn_stats(net, data, num_batches=5)
        5

    Note:
        The result is the mean and variance of every value the layer saw across all ranks and
        batches, weighted by count; it does not depend on momentum or on the order of batches.
        Layers later in the network see inputs normalized with batch statistics, as during
        training (the standard PreciseBN approximation).
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(f"num_batches must be an int >= 1, got {num_batches!r}")
    run = forward if forward is not None else model
    layers = [bn for _, bn in running_stat_layers(model)]
    if not layers:
        return 0
    saved_modes = [(m, m.training) for m in model.modules()]
    saved = [
        (
            bn,
            bn.momentum,
            None if bn.num_batches_tracked is None else bn.num_batches_tracked.clone(),
        )
        for bn in layers
    ]
    accumulators = [_Accumulator(bn.num_features, bn.running_mean.device) for bn in layers]
    handles = [
        bn.register_forward_pre_hook(acc.hook) for bn, acc in zip(layers, accumulators, strict=True)
    ]
    # Inside an open step_statistics (the callback's, under gradient accumulation), the pass
    # must not add to the step's merge: its layers leave the step for the pass.
    steps = [(bn, bn.__dict__.pop("_step_stats", None)) for bn in layers]
    used = 0
    try:
        for bn in layers:
            bn.momentum = 0.0  # the pass must not move the EMA; the hooks collect the statistics
        model.train()
        for batch in batches:
            if used >= num_batches:
                break
            run(batch)
            used += 1
    finally:
        for bn, step in steps:
            if step is not None:
                bn.__dict__["_step_stats"] = step
        for h in handles:
            h.remove()
        for module, mode in saved_modes:
            module.training = mode
        for bn, momentum, tracked in saved:
            bn.momentum = momentum
            if tracked is not None and bn.num_batches_tracked is not None:
                bn.num_batches_tracked.copy_(tracked)
    _write_population_stats(layers, accumulators)
    return used


def _write_population_stats(layers: list[_BatchNorm], accumulators: list[_Accumulator]) -> None:
    """Merge the accumulators over all ranks (one all_gather) and write the running stats."""
    row = torch.cat([torch.cat([a.count.view(1), a.mean, a.m2]) for a in accumulators])
    rows = gather_rows(row)
    offset = 0
    for bn in layers:
        width = 1 + 2 * bn.num_features
        merged = _Accumulator(bn.num_features, row.device)
        # Every rank's row at once (a rank that saw nothing sends zeros, which add nothing).
        parts = rows[:, offset : offset + width]
        merged.merge_rows(
            parts[:, 0], parts[:, 1 : 1 + bn.num_features], parts[:, 1 + bn.num_features :]
        )
        offset += width
        n = float(merged.count)
        if n == 0:
            raise ValueError(
                "update_bn_stats saw no data on any rank: pass a non-empty `batches` iterable"
            )
        unbiased = getattr(bn, "unbiased_running_var", True)
        var = merged.m2 / max(n - 1.0, 1.0) if unbiased else merged.m2 / n
        bn.running_mean.copy_(merged.mean)
        bn.running_var.copy_(var)
