"""The gather exchange: every rank's statistics row, all-gathered (``auto`` up to 8 ranks).

Per layer call, forward (the ``syncbn::`` operators, or their twins in
:mod:`syncbn_lightning.ops.reference.steps`):
    1. ``stats_row``: this rank's row ``[count, samples, layer_tag, call_tag, mean[C],
       mean_lo[C], m2[C]]`` (Welford statistics; the local mean as two acc-dtype numbers, exact to
       float64; ``count`` values per channel, ``samples`` = ``N``; the tags say which layer and
       which of its calls this is), written by the kernel into the buffer that is gathered;
    2. the Function all-gathers the rows over the group (``W * (3C + 4)`` values);
    3. ``merge_normalize``: count-weighted Chan merge of the rows in float64, the call-order check,
       the running-stat update (in place, skipped when the merged statistics are not finite) and
       the normalization with the group mean split into ``mean + mean_lo``, with the layer's
       activation applied in the same kernel when it has one.

The backward (:class:`~.exchange.SplitMeanBackward`): local ``[sum(dy), sum(dy * xmu)]`` and the
local weight/bias gradients, the sum over the group, the elementwise input gradient; with a fused
activation both steps recompute its input and use ``dy * act'(z)`` in place of ``dy``.

The split mean keeps outputs and gradients at float32's relative precision on the deviation when
``|mean| / std`` is large: ``(x - mean) - mean_lo`` is exact for ``x`` near the mean, where
``x - round(mean)`` would lose ``log10(|mean| / std)`` digits (the rows' ``mean_lo`` costs ``C``
values per rank, 50 % more bytes, and no extra collective).

The call-order check reads the merge's flag (``info[2]``); a mismatch is named from every rank's
row (:meth:`order_check`; the call reports it, :mod:`.order_report`). Nothing reads device memory
on the host, except on CUDA in eager mode when the local batch has fewer than 2 values per
channel (to raise torch's error when the whole group has just one); the CPU kernels check it for
free.
"""

from __future__ import annotations

import torch

from .exchange import Inputs, Merged, OrderCheck, SplitMeanBackward, SyncCall, kernels
from .registry import BUILTIN, register_exchange

__all__ = ["GatherExchange"]


class GatherExchange(SplitMeanBackward):
    """See the module docstring."""

    name = "gather"
    summary = BUILTIN["gather"][1]
    gathers = True
    uses_kernels = True

    def payload(self, inputs: Inputs, call: SyncCall) -> torch.Tensor:
        return kernels(call).stats_row(inputs.input, call.layer_tag, inputs.state.calls)

    def order_check(self, sent: torch.Tensor, received: torch.Tensor, call: SyncCall) -> OrderCheck:
        return OrderCheck(0, received, None, sent.numel())  # every rank's row names its layer

    def with_prior(
        self, inputs: Inputs, sent: torch.Tensor, received: torch.Tensor, prior: torch.Tensor
    ) -> torch.Tensor:
        # One more row, with this call's tags: the merge weighs it by its count like a rank's.
        row = torch.cat([prior[:2].to(sent.dtype), sent[2:4], prior[4:].to(sent.dtype)])
        return torch.cat([received, row])

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
        outputs = kernels(call).merge_normalize(
            input,
            received,
            weight,
            bias,
            *state.merge_updates(),
            options.momentum,
            options.eps,
            options.unbiased_running_var,
            call.act,
            call.act_param,
            options.stats_mode == "default",
            residual,
        )
        return self.merged(inputs, outputs, residual)


register_exchange(GatherExchange())
