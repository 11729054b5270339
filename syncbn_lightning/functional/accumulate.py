"""Statistics merged over many batches: count, mean and M2 per channel, in float64.

The one count-weighted merge of per-channel statistics that outlives a call (Chan et al.'s
parallel update): PreciseBN's population statistics (:mod:`syncbn_lightning.nn.precise_bn`)
accumulate with it, and so does any running-statistics policy of the layer's call that defers
its update (:mod:`.layer_call`'s one slot for it, ``_state``). A call's own exchange merges the
ranks' statistics in its kernels; this merges what calls return.
"""

from __future__ import annotations

import torch

__all__ = ["StatsAccumulator"]


class StatsAccumulator:
    """Count, mean and M2 of one layer's values, merged batch by batch, in float64 on
    ``device``; ``count`` is 0-d, ``mean`` and ``m2`` have one value per channel."""

    def __init__(self, channels: int, device: torch.device | str | None = None) -> None:
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.mean = torch.zeros(channels, dtype=torch.float64, device=device)
        self.m2 = torch.zeros(channels, dtype=torch.float64, device=device)

    def merge(self, n: float | torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Merge ``n`` more values of mean ``mean`` and sum of squared deviations ``m2``
        (per channel); ``n`` 0 changes nothing. No host sync: everything stays on the device."""
        total = self.count + n
        delta = mean.double() - self.mean
        weight = torch.where(total > 0, n / total.clamp(min=1), torch.zeros_like(total))
        self.mean += delta * weight
        self.m2 += m2.double() + delta.square() * (self.count * weight)
        self.count = total
