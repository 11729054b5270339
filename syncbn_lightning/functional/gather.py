"""The gather exchange: every rank's statistics row, all-gathered (the default up to 8 ranks).

Per layer call, forward (the ``syncbn::`` operators of :mod:`syncbn_lightning.ops`, or the same
steps of the reference):
    1. ``stats_row``: this rank's row ``[count, samples, layer_tag, call_tag, mean[C], m2[C]]``
       (Welford statistics; ``count`` values per channel, ``samples`` = ``N``; the tags say which
       layer and which of its calls this is), written by the kernel into the buffer that is
       gathered;
    2. the Function all-gathers the rows over the group (``W * (2C + 4)`` values);
    3. ``merge_normalize``: count-weighted Chan merge of the rows, the call-order check, the
       running-stat update (in place, skipped when the merged statistics are not finite) and the
       normalization, with the layer's activation applied in the same kernel when it has one.

Backward:
    1. ``grad_sums``: local ``[sum(dy), sum(dy * (x - mean))]`` and the local weight/bias gradients;
    2. the Function sums them over the group;
    3. ``grad_input``: the elementwise input gradient with the group-wide count.
With a fused activation both backward steps recompute its input from the saved input and use
``dy * act'(z)`` in place of ``dy``.

Nothing reads device memory on the host, except on CUDA in eager mode when the local batch has
fewer than 2 values per channel (to raise torch's error when the whole group has just one); the
CPU kernels check it for free.
"""

from __future__ import annotations

from typing import Any

import torch

from ..distributed.call_order import queue_order_check, raise_if_out_of_order
from ..distributed.collectives import Group
from ..ops import reference
from ..ops.reference import CALL_ORDER_MARK, ROW_HEADER
from .exchange import Exchange, Inputs, LocalGrads, Merged, Saved, SyncCall

__all__ = ["GatherExchange"]


def _ops(call: SyncCall) -> Any:
    return torch.ops.syncbn if call.fused else reference


def _activation(call: SyncCall, bias: torch.Tensor | None) -> tuple[Any, ...]:
    """The operators' activation arguments, only when there is one (the plain layer's calls stay
    as they were)."""
    return (bias, call.act, call.act_param) if call.act else ()


class GatherExchange(Exchange):
    """See the module docstring."""

    name = "gather"
    summary = "all-gather every rank's statistics: bytes grow with the group size"
    gathers = True
    uses_kernels = True

    def payload(self, inputs: Inputs, call: SyncCall) -> torch.Tensor:
        return _ops(call).stats_row(inputs.input, call.layer_tag, inputs.state.calls)

    def merge(
        self, inputs: Inputs, sent: torch.Tensor, received: torch.Tensor, call: SyncCall
    ) -> Merged:
        input, weight, bias, state = inputs
        options, rows, ranks, channels = call.options, received, None, input.shape[1]
        if options.stats_mode == "default":
            rows, ranks = _equal_rank_rows(rows, channels)
        try:
            output, mean, invstd, var, info = _ops(call).merge_normalize(
                input,
                rows,
                weight,
                bias,
                *state[:4],  # running_mean, running_var, num_batches_tracked, nonfinite
                options.momentum,
                options.eps,
                options.unbiased_running_var,
                *((call.act, call.act_param) if call.act else ()),
            )
        except RuntimeError as exc:
            if CALL_ORDER_MARK not in str(exc):
                raise
            raise_if_out_of_order(_row_tags(rows, channels), call.group)
            raise
        if input.device.type != "cpu":
            queue_order_check(info, 2, _report_order, rows, channels, call.group)
            if input.numel() < 2 * channels and not torch.compiler.is_compiling():
                reference.check_group_count(int(info[0].item()), input, call.world_size)
        if ranks is not None:
            info = _per_rank_count(info, ranks, input)
        saved = (input, weight, mean, invstd, info, bias if call.act else None)
        return Merged(output, mean, var, info, saved)

    def local_grads(self, grad_output: torch.Tensor, saved: Saved, call: SyncCall) -> LocalGrads:
        input, weight, mean, invstd, _info, bias = saved
        sums, grad_weight, grad_bias = _ops(call).grad_sums(
            grad_output, input, mean, invstd, weight, *_activation(call, bias)
        )
        return LocalGrads(sums, grad_weight, grad_bias, saved)

    def grad_input(
        self, grad_output: torch.Tensor, summed: torch.Tensor, local: LocalGrads, call: SyncCall
    ) -> torch.Tensor:
        input, weight, mean, invstd, info, bias = local.carry
        return _ops(call).grad_input(
            grad_output, input, mean, invstd, weight, summed, info, *_activation(call, bias)
        )


def _row_tags(rows: torch.Tensor, channels: int) -> torch.Tensor:
    """``[W, 2]``: every row's (layer_tag, call_tag)."""
    return rows.view(-1, ROW_HEADER + 2 * channels)[:, 2:ROW_HEADER]


def _report_order(rows: torch.Tensor, channels: int, group: Group) -> None:
    """A queued CUDA check failed: raise the error naming each rank's layer."""
    raise_if_out_of_order(_row_tags(rows, channels).cpu(), group)


def _equal_rank_rows(rows: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered rows reweighted so that every rank with a non-empty batch weighs the same
    (``stats_mode="default"``): each such rank's count becomes the mean count ``n / R`` (``R``
    non-empty ranks) and its ``M2`` that count times its biased variance. The count-weighted
    merge of these rows gives ``mean = sum_r mean_r / R`` and ``var = sum_r (var_r + (mean_r -
    mean)^2) / R`` (mmcv's equal-weight statistics) with the group's true count ``n``, so the
    unbiased running variance and the small-group check are as in ``"N"`` mode. Also returns
    ``R`` (a 0-d tensor). Equal batches leave the rows unchanged."""
    table = rows.view(-1, ROW_HEADER + 2 * channels)
    counts = table[:, :1]
    nonempty = (counts > 0).to(table.dtype)
    ranks = nonempty.sum()
    share = counts.sum() / ranks.clamp_min(1)
    m2 = table[:, ROW_HEADER + channels :] * (share / counts.clamp_min(1))
    head = table[:, 1 : ROW_HEADER + channels]
    return torch.cat([nonempty * share, head, m2], dim=1).view(-1), ranks


def _per_rank_count(info: torch.Tensor, ranks: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``info`` for the backward of ``stats_mode="default"``: the count ``R * n_r``. Each of this
    rank's ``n_r`` values weighs ``1 / (R n_r)`` in the statistics, so the input gradient is the
    count-weighted one with that count in place of the group's."""
    local = input.numel() // max(input.shape[1], 1)
    return torch.cat([(ranks * local).reshape(1).to(info.dtype), info[1:]])
