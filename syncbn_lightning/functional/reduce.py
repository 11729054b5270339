"""The reduce exchange: ONE all-reduce of O(C) values, whatever the group size (``auto`` above 8
ranks; in CPU groups of up to 8 ranks an all-gather of them, as the backward's sums).

The gather exchange (:mod:`.gather`) all-gathers one row of ``3C + 4`` values per rank: the bytes
every rank receives grow as ``P * C`` and a ring all-gather takes ``P - 1`` steps. The reduce
exchange sends, per rank, the per-channel sums of the batch shifted by ``K``, the layer's running
mean (the same tensor on every rank of a sync group), accumulated in float64::

    [count, samples, nonempty, tag checks[12], S1[C] = w * sum(x - K), S2[C] = w * sum((x - K)^2)]

and sums them over the group with ONE all-reduce (``w = 1`` for ``stats_mode="N"``, ``1 / n_r``
for ``"default"``), so its size is ``8 * (15 + 2C)`` bytes whatever the group size. In CPU
groups of up to 8 ranks (gloo) the vectors are all-gathered instead and the merge sums them in
rank order (:func:`~syncbn_lightning.distributed.collectives.sum_over_group`, the backward's
rule): gloo's ring all-reduce takes twice the all-gather's steps, and at that size the bytes do
not matter (measured: docs/scaling.md). With
``D = sum(count)`` (``"N"``) or ``sum(nonempty)`` (``"default"``)::

    mean = K + S1 / D,   var = S2 / D - (S1 / D)^2   (biased; running_var: * n / (n - 1))

Numerics: the shift makes ``S2 / D - (S1 / D)^2`` cancel only by ``((mean - K) / std)^2``; at the
first step (``K = 0``) and ``|mean| / std = 1e4`` that is 1e8, which float64 (16 digits) leaves with
~8 correct digits. The float64 mean is then split into ``m_hi + m_lo`` (two acc-dtype numbers) and
the layer normalizes ``((x - m_hi) - m_lo) * invstd``: ``x - m_hi`` is exact in float32 for ``x``
near the mean, so outputs and gradients keep float32's relative precision on the *deviation*
instead of losing ``log10(|mean| / std)`` digits to the rounding of the mean.

Call order: the layer and call tags (and a fingerprint of ``K``) travel as 12-bit chunks ``c`` with
their squares ``c^2``; every rank checks ``sum(c) == P c`` and ``sum(c^2) == P c^2``, which holds on
one rank iff all ranks sent the same chunk (then the chunks' variance over ranks is 0), so all
ranks detect a mismatch at the same call. Only then (an error path every rank takes) do they
all-gather their tags to raise :class:`~syncbn_lightning.CallOrderError` (the call's report,
:mod:`.order_report`: the strategy only says where the tags are, :meth:`order_check`).

Backward is the gather exchange's (:class:`~.exchange.SplitMeanBackward`): local ``[sum(dy),
sum(dy * xmu)]``, ONE collective summing them (the Function's), the elementwise input gradient.

Each step is one ``syncbn::`` operator (``reduce_sums``: one pass over the input accumulating in
float64; ``reduce_merge_normalize``: the checks, the merge, the running statistics and the output),
or its twin in :mod:`syncbn_lightning.ops.reference.steps` (``impl="reference"``).
"""

from __future__ import annotations

import torch

from .._shared import REDUCE_HEADER
from .exchange import Inputs, Merged, OrderCheck, SplitMeanBackward, SyncCall, kernels
from .registry import BUILTIN, register_exchange

__all__ = ["ReduceExchange", "reduce_payload_numel"]


def reduce_payload_numel(channels: int) -> int:
    """Number of float64 values one reduce-exchange all-reduce carries for ``channels``."""
    return REDUCE_HEADER + 2 * channels


class ReduceExchange(SplitMeanBackward):
    """See the module docstring."""

    name = "reduce"
    summary = BUILTIN["reduce"][1]
    gathers = False
    uses_kernels = True

    def payload(self, inputs: Inputs, call: SyncCall) -> torch.Tensor:
        state, equal = inputs.state, call.options.stats_mode == "default"
        return kernels(call).reduce_sums(
            inputs.input, state.running_mean, call.layer_tag, state.calls, equal
        )

    def order_check(self, sent: torch.Tensor, received: torch.Tensor, call: SyncCall) -> OrderCheck:
        return OrderCheck(1, sent, received, sent.numel())  # the tags were summed: this rank's

    def with_prior(
        self, inputs: Inputs, sent: torch.Tensor, received: torch.Tensor, prior: torch.Tensor
    ) -> torch.Tensor:
        # The earlier calls' sums, shifted by the K this call's sums were (the running mean),
        # added to the first rank's: no tag chunk (0 keeps the ranks' check), no rank counted.
        channels = (prior.numel() - 4) // 3
        stats = prior[4:].double()
        n = prior[0].double()
        shift = inputs.state.running_mean
        offset = stats[:channels] + stats[channels : 2 * channels]
        if shift is not None:
            offset = offset - shift.detach().double()
        s1, s2 = n * offset, stats[2 * channels :] + n * offset * offset
        header = torch.cat([prior[:2].double(), sent.new_zeros(REDUCE_HEADER - 2)])
        extra = torch.cat([header, s1, s2])
        return torch.cat([received[: sent.numel()] + extra, received[sent.numel() :]])

    def merge(
        self,
        inputs: Inputs,
        sent: torch.Tensor,
        received: torch.Tensor,
        call: SyncCall,
        residual: torch.Tensor | None = None,
    ) -> Merged:
        input, weight, bias, state = inputs
        options = call.options
        outputs = kernels(call).reduce_merge_normalize(
            input,
            received,
            sent,
            weight,
            bias,
            *state.merge_updates(),
            options.momentum,
            options.eps,
            options.unbiased_running_var,
            options.stats_mode == "default",
            call.world_size,
            call.act,
            call.act_param,
            residual,
        )
        return self.merged(inputs, outputs, residual)


register_exchange(ReduceExchange())
