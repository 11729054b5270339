"""Running-statistics health metrics and cross-rank reconciliation.

Everything here is plain torch / torch.distributed, so the metrics can be used from any training
loop; :class:`~syncbn_lightning.SyncBNCallback` calls them at its logging steps. All metrics are
dimensionless: differences of means are measured in units of the running standard deviation
``sqrt(running_var + eps)``, differences of variances relative to the running variance, so a value
of 0.1 means "a tenth of a standard deviation" for every layer whatever its scale.

Per layer:
    * ``drift_mean`` / ``drift_var``: EMA drift since the previous measurement,
      ``mean_c |mu_c - mu'_c| / sqrt(var'_c + eps)`` and
      ``mean_c |var_c - var'_c| / (var'_c + eps)``, primes marking the previous running stats.
    * ``divergence``: how far the ranks' running means are apart,
      ``max_{r,c} |mu_{r,c} - mean_r mu_{r,c}| / sqrt(mean_r var_{r,c} + eps)``; exactly 0 when
      every rank normalizes over the same group (the whole world), > 0 between separate groups.
    * ``gap_mean`` / ``gap_std``: the train/test inconsistency between the last synchronized batch
      statistics (what training normalized with) and the running statistics (what evaluation will
      use): ``mean_c |mu_batch - mu_run| / sqrt(var_run + eps)`` and
      ``mean_c |sqrt(var_batch + eps) / sqrt(var_run + eps) - 1|`` with the biased batch variance.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..distributed.collectives import all_reduce_
from .layer_state import BatchRecord

__all__ = [
    "running_stat_layers",
    "ema_drift",
    "train_test_gap",
    "rank_divergence",
    "summarize",
    "average_running_stats",
]

LAYER_METRICS = ("drift_mean", "drift_var", "divergence", "gap_mean", "gap_std")


def running_stat_layers(module: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """``(qualified name, layer)`` of every BatchNorm layer that keeps running statistics."""
    return [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None
    ]


def ema_drift(
    prev_mean: torch.Tensor,
    prev_var: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
) -> tuple[float, float]:
    """``(drift_mean, drift_var)`` of the running stats from ``prev_*`` to the current ones."""
    prev_var = prev_var.double()
    d_mean = (mean.double() - prev_mean.double()).abs() / (prev_var + eps).sqrt()
    d_var = (var.double() - prev_var).abs() / (prev_var + eps)
    return float(d_mean.mean()), float(d_var.mean())


def train_test_gap(
    record: BatchRecord, running_mean: torch.Tensor, running_var: torch.Tensor, eps: float
) -> tuple[float, float] | None:
    """``(gap_mean, gap_std)`` between a layer's last synchronized batch and its running stats.

    ``None`` when the record holds no batch statistics (the layer did not synchronize).
    ``record.var`` is the running-var flavour; it is converted to the biased variance that the
    forward normalized with (``M2 / n``), assuming the unbiased flavour when ``n > 1``.
    """
    if record.mean is None or record.var is None or record.count is None:
        return None
    count = record.count.double().clamp(min=1.0)
    batch_var = record.var.double() * ((count - 1.0) / count)
    run_std = (running_var.double() + eps).sqrt()
    gap_mean = (record.mean.double() - running_mean.double()).abs() / run_std
    gap_std = ((batch_var + eps).sqrt() / run_std - 1.0).abs()
    return float(gap_mean.mean()), float(gap_std.mean())


def rank_divergence(means: torch.Tensor, variances: torch.Tensor, eps: float) -> float:
    """Max over ranks and channels of ``|mu_r - mean_r mu_r| / sqrt(mean_r var_r + eps)``.

    Args:
        means: ``[W, C]`` running means of one layer on each of ``W`` ranks.
        variances: ``[W, C]`` running variances of the same layer.
        eps: the layer's eps.
    """
    means = means.double()
    center = means.mean(dim=0, keepdim=True)
    scale = (variances.double().mean(dim=0, keepdim=True) + eps).sqrt()
    return float(((means - center).abs() / scale).max())


def summarize(
    per_layer: Mapping[str, Mapping[str, float]], prefix: str = "bn/"
) -> dict[str, float]:
    """``{prefix + metric + "_max" | "_avg": value}``: max and mean of each metric over layers."""
    out: dict[str, float] = {}
    for metric in LAYER_METRICS:
        values = [m[metric] for m in per_layer.values() if metric in m]
        if values:
            out[f"{prefix}{metric}_max"] = max(values)
            out[f"{prefix}{metric}_avg"] = sum(values) / len(values)
    return out


@torch.no_grad()
def average_running_stats(
    layers: Iterable[_BatchNorm], group: dist.ProcessGroup | None = None
) -> None:
    """Replace every layer's running mean and variance with their average over the ranks of
    ``group`` (default: the world), with ONE all-reduce for all layers.

    Used to reconcile separate sync groups: each group keeps its own EMA during training, and the
    average over equally sized groups is the EMA of the count-weighted mean of all samples (the
    running mean is linear in the batch means) and the mean of the groups' within-group
    variances, i.e. the variance each group normalized with. ``num_batches_tracked`` is the same on
    every rank and stays as it is. A no-op without torch.distributed or with one rank.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    stats = [t for bn in layers for t in (bn.running_mean, bn.running_var) if t is not None]
    if not stats:
        return
    # fp64 so that averaging fp16/bf16/fp32 buffers adds no rounding beyond the final cast.
    packed = torch.cat([t.detach().reshape(-1).double() for t in stats])
    all_reduce_(packed, group=group)
    packed /= dist.get_world_size(group)
    offset = 0
    for t in stats:
        t.copy_(packed[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
