"""The exchange interface: how the ranks of a sync group combine their statistics.

The one autograd Function (:mod:`.function`) runs every synchronized layer call the same way, and
an :class:`Exchange` strategy fills in the steps that differ::

    forward   sent = exchange.payload(inputs, call)        what travels forward (this rank's)
              received = all_gather(sent)  if exchange.gathers  else  sum_over_group(sent)
              merged = exchange.merge(inputs, sent, received, call)   statistics, output
    backward  local = exchange.local_grads(dy, saved, call)  what travels back (+ local dW, dB)
              summed = sum_over_group(local.sums)          (only when the input needs a gradient)
              grad_input, flag = exchange.checked_grad_input(dy, summed, local, call)

Every collective is the Function's (:mod:`syncbn_lightning.distributed.collectives`), and so is
the call-order check: a strategy computes, and says where a mismatch would be found
(:meth:`Exchange.order_check`, :meth:`Exchange.backward_order_check`: an
:class:`OrderCheck`); the Function reads the flag at once or queues it, and
reports a mismatch (:mod:`.order_report`). The built-in strategies import no collective, no
flight recorder and no call-order queue. A new strategy is one file with a subclass and one
:func:`~.registry.register_exchange` line (``tests/test_exchange_toy.py`` shows one that
all-gathers float64 rows and checks the order itself).

Contract of every strategy: statistics of the group as one batch (count-weighted; ``stats_mode``
as :class:`~syncbn_lightning.SyncBatchNorm` defines it); an empty local batch still takes part
(its payload says it is empty); running statistics updated in place, skipped when the group
statistics are not finite or the group is empty; the call-order tags checked (by the strategy
itself, or by the call where the strategy says where: see
:mod:`syncbn_lightning.distributed.call_order`); no host synchronization on CUDA tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

import torch

from ..ops.reference import steps as reference_steps
from .options import SyncOptions

__all__ = [
    "Exchange",
    "Inputs",
    "LayerState",
    "LocalGrads",
    "Merged",
    "OrderCheck",
    "Saved",
    "SplitMeanBackward",
    "SyncCall",
    "kernels",
]

#: The tensors a strategy's forward keeps for its backward (saved by the Function).
Saved = tuple[torch.Tensor | None, ...]


class OrderCheck(NamedTuple):
    """Where a call's call-order mismatch is found, as a strategy says it: ``kind`` (an index of
    :data:`~.order_report.KINDS`), the data (the gathered rows; the reduce exchange's vector
    sent; the backward's summed sums), ``aux`` (the summed vector; the merge's grad_info; else
    ``None``) and ``width``, one rank's share of the data."""

    kind: int
    data: torch.Tensor
    aux: torch.Tensor | None
    width: int


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
    #: ``step_statistics(normalize="step")``: the statistics of the layer's earlier calls in the
    #: optimizer step (a row of :meth:`Exchange.prior_of`; zeros before the first), one more
    #: input of the merge (:meth:`Exchange.with_prior`), which the Function then overwrites in
    #: place with this call's merge, the next call's, as the C++ operator does. (Not a Python
    #: list the Function appends to, which compiled code on torch 2.8 cannot mutate inside a
    #: Function.)
    prior: torch.Tensor | None = None

    def merge_updates(self) -> tuple[Any, Any, Any, Any]:
        """The four tensors the merge kernels update in place, in their order: ``running_mean``,
        ``running_var``, ``num_batches_tracked``, ``nonfinite``. (Named, not a slice: dynamo
        2.8 fails on a slice of a named tuple, an internal error.)"""
        return self.running_mean, self.running_var, self.num_batches_tracked, self.nonfinite


class SyncCall(NamedTuple):
    """Where one layer call synchronizes, and with what."""

    #: the group's name, a DataParallel replica group, or ``None`` (nothing to communicate).
    group: Any
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

    #: whether :meth:`merge` takes the statistics of earlier calls as one more input
    #: (:meth:`with_prior`, :meth:`prior_of`): ``step_statistics(normalize="step")``.
    takes_prior: ClassVar[bool] = False

    def with_prior(
        self, inputs: Inputs, sent: torch.Tensor, received: torch.Tensor, prior: torch.Tensor
    ) -> torch.Tensor:
        """``received`` with ``prior`` (a row of :meth:`prior_of`: the same layer's earlier calls
        in the step, merged) as one more part of the group, for :meth:`merge` (only for
        strategies that :attr:`takes_prior`)."""
        raise NotImplementedError(f"the {self.name!r} exchange takes no earlier statistics")

    def prior_of(self, merged: Merged, call: SyncCall) -> torch.Tensor:
        """What :meth:`with_prior` takes for the next call: ``merged``'s statistics as one
        gathered row ``[count, samples, 0, 0, mean[C], mean_lo[C], m2[C]]`` (the tags are the
        next call's), in the statistics' dtype."""
        raise NotImplementedError(f"the {self.name!r} exchange takes no earlier statistics")

    def order_check(
        self, sent: torch.Tensor, received: torch.Tensor, call: SyncCall
    ) -> OrderCheck | None:
        """Where the call finds a call-order mismatch of the forward: the merge's flag is
        ``info[2]``, and a mismatch is named from what this returns (``None``, the default: the
        strategy checks the order itself, or not at all). Pure computation: the call reads,
        queues and reports."""
        return None

    def backward_order_check(
        self, summed: torch.Tensor, local: LocalGrads, call: SyncCall
    ) -> OrderCheck | None:
        """As :meth:`order_check`, for the backward, whose flag
        :meth:`checked_grad_input` returns."""
        return None

    def checked_grad_input(
        self, grad_output: torch.Tensor, summed: torch.Tensor, local: LocalGrads, call: SyncCall
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`grad_input` and the backward's call-order flag (a one-element tensor, nonzero
        when the ranks' tags agreed; ``None``, the default: none to check)."""
        return self.grad_input(grad_output, summed, local, call), None

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
    takes_prior = True

    def prior_of(self, merged: Merged, call: SyncCall) -> torch.Tensor:
        mean, var, info = merged.mean, merged.var, merged.info
        count = info[:2].to(mean.dtype)  # count, samples
        # var divides M2 by count - 1 (unbiased) or count, at least 1: the same divisor back.
        divisor = (count[:1] - 1 if call.options.unbiased_running_var else count[:1]).clamp_min(1)
        return torch.cat([count, count.new_zeros(2), mean, merged.saved[3], var * divisor])

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

    @staticmethod
    def merged(
        inputs: Inputs, outputs: tuple[torch.Tensor, ...], residual: torch.Tensor | None
    ) -> Merged:
        """The merge kernels' ``(output, mean, mean_lo, invstd, var, info, grad_info)`` as
        :class:`Merged`, saving what this backward takes."""
        output, mean, mean_lo, invstd, var, info, grad_info = outputs
        input, weight, bias, _state = inputs
        saved = (input, weight, mean, mean_lo, invstd, grad_info, bias, residual)
        return Merged(output, mean, var, info, saved)

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

    def backward_order_check(
        self, summed: torch.Tensor, local: LocalGrads, call: SyncCall
    ) -> OrderCheck:
        grad_info = local.carry[5]  # the forward's tags, which this rank's sums carried
        return OrderCheck(2, summed, grad_info, local.sums.numel())

    def checked_grad_input(
        self, grad_output: torch.Tensor, summed: torch.Tensor, local: LocalGrads, call: SyncCall
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input, weight, mean, mean_lo, invstd, grad_info, bias, _residual = local.carry
        # With a fused residual the activation's gradient is already in grad_residual.
        fused = local.grad_residual is not None
        return kernels(call).grad_input(
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

    def grad_input(
        self, grad_output: torch.Tensor, summed: torch.Tensor, local: LocalGrads, call: SyncCall
    ) -> torch.Tensor:
        return self.checked_grad_input(grad_output, summed, local, call)[0]
