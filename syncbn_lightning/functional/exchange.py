"""The exchange interface: how the ranks of a sync group combine their statistics.

The one autograd Function (:mod:`.function`) runs every synchronized layer call the same way, and
an :class:`Exchange` strategy fills in the steps that differ::

    forward   sent = exchange.payload(inputs, call)        what travels forward (this rank's)
              received = all_gather(sent)  if exchange.gathers  else  sum_over_group(sent)
              merged = exchange.merge(inputs, sent, received, call)   statistics, output
    backward  local = exchange.local_grads(dy, saved, call)  what travels back (+ local dW, dB)
              summed = sum_over_group(local.sums)          (only when the input needs a gradient)
              grad_input = exchange.grad_input(dy, summed, local, call)

Every collective is the Function's (:mod:`syncbn_lightning.distributed.collectives`), so a
strategy computes, and never communicates except on an error path. A new strategy is one file
with a subclass and one :func:`~.registry.register_exchange` line (``tests/test_exchange_toy.py``
shows one that all-gathers float64 rows).

Contract of every strategy: statistics of the group as one batch (count-weighted; ``stats_mode``
as :class:`~syncbn_lightning.SyncBatchNorm` defines it); an empty local batch still takes part
(its payload says it is empty); running statistics updated in place, skipped when the group
statistics are not finite or the group is empty; the call-order tags checked (see
:mod:`syncbn_lightning.distributed.call_order`); no host synchronization on CUDA tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

import torch

from ..distributed import flight
from ..distributed.call_order import (
    call_order_error,
    note_order_flag,
    queue_order_check,
    raise_if_out_of_order,
)
from ..distributed.call_order.policy import queues_order_flag
from ..distributed.collectives import Group, all_gather, group_ranks
from ..distributed.flight import layer_text
from ..ops.reference import CALL_ORDER_MARK
from ..ops.reference import steps as reference_steps
from ..ops.reference.steps import GRAD_HEADER, header_tags
from .options import SyncOptions

__all__ = [
    "Exchange",
    "Inputs",
    "LayerState",
    "LocalGrads",
    "Merged",
    "Saved",
    "SplitMeanBackward",
    "SyncCall",
    "kernels",
    "raise_backward_order",
]

#: The tensors a strategy's forward keeps for its backward (saved by the Function).
Saved = tuple[torch.Tensor | None, ...]


class LayerState(NamedTuple):
    """The layer's tensors a synchronized call updates in place (``None``: the layer keeps none)."""

    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    num_batches_tracked: torch.Tensor | None
    #: int64 counter of the running-stat updates skipped for non-finite statistics.
    nonfinite: torch.Tensor | None
    #: int64 counter of the layer's synchronized calls (the call-order tag); always given.
    calls: torch.Tensor
    #: compiled calls on devices that queue their order flags: the layer's status, where the
    #: forward and the backward note their flags (``distributed.call_order.note_order_flag``).
    order: torch.Tensor | None = None


class SyncCall(NamedTuple):
    """Where one layer call synchronizes, and with what."""

    #: the group's name, a DataParallel replica group, or ``None`` (nothing to communicate).
    group: Group
    #: ranks in the group.
    world_size: int
    #: the layer's call-order tag (equal on every rank for the same layer).
    layer_tag: int
    #: the strategy (found by :func:`~.registry.resolve_exchange`).
    exchange: Exchange
    #: the layer's settings (momentum, eps, stats_mode...), validated when they were made.
    options: SyncOptions
    #: run the ``syncbn::`` operators (else the reference twin), see ``ops.dispatch``.
    fused: bool
    #: the activation fused after the normalization (``ops.activations``; 0: none).
    act: int = 0
    act_param: float = 0.0
    #: a checkpoint's recompute of a call whose forward kept its statistics
    #: (:class:`~.recompute.Kept`): the call is :meth:`Exchange.again`, no collective.
    kept: Any = None
    #: a checkpointed forward's list, which the Function extends with what the strategy keeps
    #: (:meth:`Exchange.kept_stats`) and the call's flight-recorder number.
    keep: list[Any] | None = None


class Inputs(NamedTuple):
    """The tensors of one layer call: the input, the affine parameters (``None`` without), and
    the state the call updates in place."""

    input: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    state: LayerState


class Merged(NamedTuple):
    """What :meth:`Exchange.merge` returns."""

    output: torch.Tensor
    #: the group's mean per channel (acc dtype).
    mean: torch.Tensor
    #: the group's variance as used for ``running_var`` (unbiased unless the options say not).
    var: torch.Tensor
    #: ``[count, samples, order_ok, finite, layer_tag, call_tag]``: the group's values per
    #: channel and samples, whether the ranks' tags agreed, whether the statistics are finite,
    #: and this call's tags (which the backward's sums carry back).
    info: torch.Tensor
    #: the tensors the strategy's backward needs.
    saved: Saved


class LocalGrads(NamedTuple):
    """What :meth:`Exchange.local_grads` returns."""

    #: this rank's part of the backward exchange, summed over the group by the Function.
    sums: torch.Tensor
    #: the local parameter gradients (not all-reduced: DDP averages them).
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor
    #: what the strategy's :meth:`Exchange.grad_input` needs: saved tensors, values computed
    #: once for both steps.
    carry: Any = None
    #: with a fused residual (:attr:`Exchange.fuses_residual`), the residual's gradient
    #: ``dy * act'(z + residual)``; ``None`` without one.
    grad_residual: torch.Tensor | None = None
    #: set by the Function for compiled calls: :attr:`LayerState.order`, where the built-in
    #: strategies' :meth:`Exchange.grad_input` notes the backward's flag.
    order: torch.Tensor | None = None


class Exchange(ABC):
    """A strategy for exchanging a layer's statistics; see the module docstring."""

    #: the ``exchange=`` name it is registered under.
    name: ClassVar[str]
    #: one line on what it sends, for error messages and docs.
    summary: ClassVar[str]
    #: ``True``: the payloads are all-gathered (every rank's, in rank order); ``False``: summed
    #: (all-reduced, or gathered where :func:`~syncbn_lightning.distributed.collectives
    #: .sum_over_group` gathers, for :meth:`merge` to sum in rank order).
    gathers: ClassVar[bool]
    #: whether it runs the ``syncbn::`` operators when the extension is available (``impl=``).
    uses_kernels: ClassVar[bool] = False
    #: whether :meth:`merge` takes ``residual=`` (a tensor added before the fused activation,
    #: ``act(z + residual)``) and :meth:`local_grads` returns its gradient (``grad_residual``).
    #: Layers of strategies without it add the residual after the synchronized call.
    fuses_residual: ClassVar[bool] = False

    #: whether a checkpoint's recompute rebuilds a call from what its forward kept
    #: (:meth:`kept_stats`, :meth:`again`) instead of exchanging again.
    keeps: ClassVar[bool] = False

    def kept_stats(self, merged: Merged) -> tuple[torch.Tensor, ...]:
        """What a checkpointed forward keeps for its recompute besides ``merged``'s mean, var
        and info: ``(mean_lo, invstd, grad_info)``, as the strategy's backward takes them (only
        for strategies that :attr:`keeps`)."""
        raise NotImplementedError(f"the {self.name!r} exchange keeps nothing for a recompute")

    def again(
        self, inputs: Inputs, kept: Any, call: SyncCall, residual: torch.Tensor | None = None
    ) -> Merged:
        """A checkpoint's recompute of a call from what its forward kept (``kept``:
        :class:`~syncbn_lightning.functional.recompute.Kept`): the same output, the same saved
        tensors, no collective, nothing updated (only for strategies that :attr:`keeps`)."""
        raise NotImplementedError(f"the {self.name!r} exchange keeps nothing for a recompute")

    @abstractmethod
    def payload(self, inputs: Inputs, call: SyncCall) -> torch.Tensor:
        """This rank's 1-D payload for the forward collective; advances ``inputs.state.calls``."""

    @abstractmethod
    def merge(
        self, inputs: Inputs, sent: torch.Tensor, received: torch.Tensor, call: SyncCall
    ) -> Merged:
        """The group's statistics from ``received`` (gathered payloads, or their sum or every
        rank's as :attr:`gathers` says; ``sent`` is this rank's), the call-order check, the
        running-stat update and the normalized (activated) output. Strategies with
        :attr:`fuses_residual` also take ``residual=`` (the output is then
        ``act(z + residual)``)."""

    @abstractmethod
    def local_grads(self, grad_output: torch.Tensor, saved: Saved, call: SyncCall) -> LocalGrads:
        """This rank's backward sums (to be summed over the group) and parameter gradients."""

    @abstractmethod
    def grad_input(
        self, grad_output: torch.Tensor, summed: torch.Tensor, local: LocalGrads, call: SyncCall
    ) -> torch.Tensor:
        """The input gradient from ``summed``: the group's sums (``[2C]``), or every rank's
        (``[W * 2C]`` in rank order) when :func:`~syncbn_lightning.distributed.collectives
        .sum_over_group` gathered them; ``local`` is what :meth:`local_grads` returned, its
        ``carry`` holding what this step needs of the saved tensors."""


def kernels(call: SyncCall) -> Any:
    """The fused steps ``call`` runs: the ``syncbn::`` operators, or their pure-PyTorch twins
    (:mod:`syncbn_lightning.ops.reference.steps`, the same names and signatures)."""
    return torch.ops.syncbn if call.fused else reference_steps


class SplitMeanBackward(Exchange):
    """The backward of the built-in strategies: ``grad_sums`` and ``grad_input`` of the group mean
    split into ``mean + mean_lo``, whatever the forward exchanged. Their ``merge`` saves
    ``(input, weight, mean, mean_lo, invstd, grad_info, bias, residual)`` (``residual`` ``None``
    unless fused); ``grad_info`` carries the call's tags, which the sums carry back for the
    backward's call-order check.

    With a fused residual, ``grad_sums_residual`` computes ``g = dy * act'(z + residual)`` (the
    residual's gradient) and sums it in the same pass, and ``grad_input`` takes ``g`` for ``dy``
    without an activation."""

    fuses_residual = True
    keeps = True

    def kept_stats(self, merged: Merged) -> tuple[torch.Tensor, ...]:
        return merged.saved[3:6]  # mean_lo, invstd, grad_info

    def again(
        self, inputs: Inputs, kept: Any, call: SyncCall, residual: torch.Tensor | None = None
    ) -> Merged:
        input, weight, bias, _state = inputs
        output = kernels(call).renormalize(
            input,
            kept.mean,
            kept.mean_lo,
            kept.invstd,
            weight,
            bias,
            call.act,
            call.act_param,
            residual,
        )
        saved = (
            input,
            weight,
            kept.mean,
            kept.mean_lo,
            kept.invstd,
            kept.grad_info,
            bias,
            residual,
        )
        return Merged(output, kept.mean, kept.var, kept.info, saved)

    def local_grads(self, grad_output: torch.Tensor, saved: Saved, call: SyncCall) -> LocalGrads:
        input, weight, mean, mean_lo, invstd, grad_info, bias, residual = saved
        head = (grad_output, input, mean, invstd, weight, bias)
        tail = (call.act, call.act_param, mean_lo, grad_info)
        if residual is not None:
            sums, grad_weight, grad_bias, grad = kernels(call).grad_sums_residual(
                *head, residual, *tail
            )
            return LocalGrads(sums, grad_weight, grad_bias, saved, grad)
        sums, grad_weight, grad_bias = kernels(call).grad_sums(*head, *tail)
        return LocalGrads(sums, grad_weight, grad_bias, saved)

    def grad_input(
        self, grad_output: torch.Tensor, summed: torch.Tensor, local: LocalGrads, call: SyncCall
    ) -> torch.Tensor:
        input, weight, mean, mean_lo, invstd, grad_info, bias, _residual = local.carry
        # With a fused residual the activation's gradient is already in grad_residual.
        fused = local.grad_residual is not None
        try:
            grad, order_ok = kernels(call).grad_input(
                local.grad_residual if fused else grad_output,
                input,
                mean,
                invstd,
                weight,
                summed,
                grad_info,
                bias,
                0 if fused else call.act,
                call.act_param,
                mean_lo,
                call.world_size,
            )
        except RuntimeError as exc:
            if CALL_ORDER_MARK not in str(exc):
                raise
            raise_backward_order(summed, local.sums.numel(), grad_info, call, gather=True)
            raise
        if local.order is not None:  # compiled: noted on the layer, read by check_call_order
            note_order_flag(local.order, order_ok, grad_info[5], True)
        elif queues_order_flag(input) and not torch.compiler.is_compiling():
            width = local.sums.numel()
            queue_order_check(
                order_ok,
                0,
                raise_backward_order,
                summed,
                width,
                grad_info,
                call,
                False,
                group=call.group,
            )
        return grad


def raise_backward_order(
    summed: torch.Tensor, width: int, grad_info: torch.Tensor, call: SyncCall, gather: bool
) -> None:
    """The backward's tags disagree: raise :class:`~syncbn_lightning.CallOrderError` naming each
    rank's layer, read from the gathered rows, or, for all-reduced sums, gathered now when
    ``gather`` (an error path every rank of the group takes at the same call); from a queued
    CUDA check (no collective there), this rank's. This rank's tags are its forward's
    (``grad_info[4:6]``, the values its sums' header encodes: the sums may have been summed in
    place); ``width``: one rank's sums."""
    rows = summed.detach().cpu().view(-1, width)
    if rows.shape[0] > 1:
        tags = torch.tensor([header_tags(row[:GRAD_HEADER]) for row in rows], dtype=torch.float64)
        raise_if_out_of_order(tags, call.group, backward=True)
        return
    own = grad_info.detach()[4:6].to("cpu", torch.float64)
    if gather:
        note = flight.check_note(call.layer_tag)
        tags = all_gather(own.to(summed.device), call.group, call.world_size, note).cpu()
        raise_if_out_of_order(tags.view(-1, 2), call.group, backward=True)
        return
    layer, number = (int(v) for v in own.tolist())
    raise call_order_error(
        f"this rank ran the backward of {layer_text(layer)} (call #{number + 1}) while another "
        f"rank ran a different layer's or call's (its summed sums cannot name the others)",
        group_ranks(call.group, 1) if isinstance(call.group, str) else [],
        backward=True,
    )
