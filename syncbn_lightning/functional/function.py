"""The one synchronized BatchNorm autograd Function, and its functional form.

Per layer call, ONE collective forward and ONE backward, whatever the exchange strategy
(:mod:`.exchange` says which steps a strategy fills in)::

    forward   payload -> all_gather, or sum over the group -> merge (statistics, running stats,
              output)
    backward  local sums -> sum over the group -> input gradient

"Synchronized" means the group is normalized as one batch: with per-rank counts ``n_r`` the mean is
``sum_r n_r mean_r / sum_r n_r``, so uneven batches are exact, and a rank with an empty batch
(``N = 0``) contributes ``n_r = 0`` but still joins both collectives. Gradients of weight and bias
are the local ones (DDP averages them like any other parameter's); the backward's collective runs
only when the input needs a gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .._compat import TRACED_NEEDS_INPUT_GRAD
from .._shared import CALL_ORDER_MARK, SHIFT_MARK
from ..distributed.call_order.checks import note_order_flag, poll_order_checks, queue_order_check
from ..distributed.call_order.policy import queues_order_flag
from ..distributed.collectives import all_gather, sum_over_group
from ..distributed.flight import recorder as flight
from ..distributed.groups import group_name_of
from ..ops.dispatch import uses_extension
from ..ops.reference import check_group_count

# The built-in exchanges register themselves when imported: here, with the Function, so that a
# first call under torch.compile finds them registered (an import cannot be traced).
from . import gather as _gather  # noqa: F401
from . import reduce as _reduce  # noqa: F401
from .exchange import Inputs, LayerState, OrderCheck, SyncCall
from .options import SyncOptions
from .order_report import report, report_queued
from .registry import get_exchange

__all__ = ["SyncBatchNormFunction", "sync_batch_norm"]


class SyncBatchNormFunction(torch.autograd.Function):
    """``apply(input, weight, bias, state, call[, residual]) -> (output, mean, var, info)``.

    Args:
        input: ``(N, C, *)``, any layout; ``weight``, ``bias``: ``[C]`` or ``None``.
        state: the :class:`~.exchange.LayerState` the call updates in place (running statistics,
            counters).
        call: the :class:`~.exchange.SyncCall`: the group, its size, the layer's tag, the
            exchange strategy, the layer's :class:`~.options.SyncOptions` (momentum, eps,
            stats_mode...), the kernels and the fused activation.
        residual: optional, the input's shape and dtype: added before the activation, ``output
            = act(z + residual)`` (a residual block's tail in one kernel; gradient
            ``dy * act'(z + residual)``). Only for exchanges with
            :attr:`~.exchange.Exchange.fuses_residual`.

    Returns:
        ``output`` (differentiable), and, not differentiable, the group mean, the group variance
        used for the running-stat update (unbiased unless ``options.unbiased_running_var`` is
        false) and ``info = [count, samples, order_ok, finite, layer_tag, call_tag]``: the group's
        element count per channel and number of samples (the sum of every rank's ``N``; it rides
        in the same collective, so batch-size tracking costs no communication), whether every
        rank's call-order tags agreed, whether the group statistics were finite, and the call's
        two tags.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        state: LayerState,
        call: SyncCall,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        inputs, exchange = Inputs(input, weight, bias, state), call.exchange
        if call.kept is not None:  # a checkpoint's recompute: the forward's statistics
            merged = exchange.again(inputs, call.kept, call, residual)
            note = (flight.FORWARD, call.layer_tag, call.kept.flight_call)
        else:
            sent = exchange.payload(inputs, call)
            note = (flight.FORWARD, call.layer_tag, flight.next_call(call.layer_tag))
            if exchange.gathers:
                received = all_gather(sent, call.group, call.world_size, note)
            else:  # all-reduced, or gathered for the merge to sum (sum_over_group says where)
                received = sum_over_group(sent, call.group, call.world_size, note)
            check = exchange.order_check(sent, received, call)
            if state.prior is not None:  # normalize="step": the step's earlier statistics too
                received = exchange.with_prior(inputs, sent, received, state.prior)
            try:
                if residual is None:
                    merged = exchange.merge(inputs, sent, received, call)
                else:
                    merged = exchange.merge(inputs, sent, received, call, residual=residual)
            except RuntimeError as exc:
                _report_at_once(exc, check, call)
                raise
            if check is not None:
                _check_order(merged.info, 2, check, call, state.order, input, False)
            if call.keep is not None:  # a checkpoint's forward: what its recompute takes
                call.keep.extend((*exchange.kept_stats(merged), note[2]))
            if state.prior is not None:  # normalize="step": this merge, the next call's prior
                state.prior.copy_(exchange.prior_of(merged, call))
        if state.order is None:
            ctx.save_for_backward(*merged.saved)
        else:  # compiled: the backward notes its order flag there (a graph input it may mutate)
            ctx.save_for_backward(*merged.saved, state.order)
        ctx.notes_order = state.order is not None
        ctx.call = call
        ctx.flight_call = note[2]
        ctx.mark_non_differentiable(merged.mean, merged.var, merged.info)
        return merged.output, merged.mean, merged.var, merged.info

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_output: torch.Tensor | None, *_unused: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            # create_graph=True: the result must refuse a second derivative rather than give a
            # silently wrong one. Only then, as once_differentiable costs host time per call.
            return _backward_once(ctx, grad_output)
        return _backward(ctx, grad_output)


_NO_GRADS: tuple[None, ...] = (None,) * 6  # one per argument of forward


def _backward(ctx: Any, grad_output: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Local sums, ONE collective (only when the input needs a gradient), the input gradient."""
    if grad_output is None:  # grads are not materialized: nothing flows back through output
        return _NO_GRADS
    call: SyncCall = ctx.call
    poll_order_checks()  # flags the device has written since the last call (no host sync)
    saved, order = ctx.saved_tensors, None
    if ctx.notes_order:
        saved, order = saved[:-1], saved[-1]
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    if not TRACED_NEEDS_INPUT_GRAD and torch.compiler.is_compiling():
        need_input = True  # (a trace there may read it False: _compat says where)
    exchange = call.exchange
    local = exchange.local_grads(grad_output, saved, call)
    grad_input = None
    if need_input:
        note = (flight.BACKWARD, call.layer_tag, ctx.flight_call)
        # In place: the local sums are not read again (their error path reads the saved tags).
        summed = sum_over_group(local.sums, call.group, call.world_size, note, in_place=True)
        check = exchange.backward_order_check(summed, local, call)
        try:
            grad_input, order_ok = exchange.checked_grad_input(grad_output, summed, local, call)
        except RuntimeError as exc:
            _report_at_once(exc, check, call)
            raise
        if check is not None and order_ok is not None:
            _check_order(order_ok, 0, check, call, order, saved[0], True)
    return (
        grad_input,
        local.grad_weight if need_weight else None,
        local.grad_bias if need_bias else None,
        None,
        None,
        local.grad_residual,
    )


_backward_once = once_differentiable(_backward)


def _report_at_once(exc: RuntimeError, check: OrderCheck | None, call: SyncCall) -> None:
    """The kernels raised ``exc``: where it is their call-order error (found at once, on the
    CPU, by every rank of the group at this call), raise the CallOrderError naming each rank's
    layer instead (the caller re-raises ``exc`` otherwise: the reduce exchange's differing
    running means name their own fix)."""
    text = str(exc)
    if check is not None and CALL_ORDER_MARK in text and SHIFT_MARK not in text:
        report(*check, call.group, call.world_size, call.layer_tag, True)


def _check_order(
    flags: torch.Tensor,
    index: int,
    check: OrderCheck,
    call: SyncCall,
    order: torch.Tensor | None,
    input: torch.Tensor,
    backward: bool,
) -> None:
    """The call-order flag ``flags[index]`` of a call whose kernels did not check it at once
    (a device whose flags would cost a host sync to read, or the tests' switch): compiled code
    notes it on the layer's status ``order``; eager code queues it, with what :func:`report`
    names a mismatch from, to be read by a later call or :func:`check_call_order`. A forward on
    fewer than two values per channel also checks the group's count on the host (torch's error
    when the whole group has just one)."""
    if not queues_order_flag(input):
        return  # the kernels checked it at once
    if order is not None:
        note_order_flag(order, flags[index], flags[5] if not backward else check.aux[5], backward)
        return
    args = (*check, call.group, call.world_size, call.layer_tag)
    queue_order_check(flags, index, report_queued, *args, group=call.group)
    tiny = not backward and input.numel() < 2 * input.shape[1]
    if tiny and not torch.compiler.is_compiling():
        check_group_count(int(flags[0].item()), input, call.world_size)


def sync_batch_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    process_group: dist.ProcessGroup | None,
    world_size: int,
    unbiased: bool = True,
    layer_tag: int = 0,
    calls: torch.Tensor | None = None,
    impl: str | None = None,
    stats_mode: str = "N",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Functional form of :class:`SyncBatchNormFunction` (gather exchange) without running
    statistics.

    ``layer_tag`` and ``calls`` (an int64 counter on the input's device, incremented per call)
    identify the call for the call-order check; equal on all ranks for the same layer and call.
    ``impl``: ``"auto"``, ``"ext"``, ``"reference"`` or ``None`` (the ``SYNCBN_IMPL`` default);
    ``stats_mode``: ``"N"`` or ``"default"``, see :class:`~syncbn_lightning.SyncBatchNorm`.

    Returns:
        ``(output, mean, var, count, samples)``: ``count`` and ``samples`` are 0-d tensors.
    """
    options = SyncOptions(
        eps=eps, impl=impl, stats_mode=stats_mode, exchange="gather", unbiased_running_var=unbiased
    )
    if calls is None:
        calls = torch.zeros(1, dtype=torch.long, device=input.device)
    exchange = get_exchange("gather")
    fused = uses_extension(input.device.type, options.impl)
    call = SyncCall(group_name_of(process_group), world_size, layer_tag, exchange, options, fused)
    state = LayerState(None, None, None, None, calls)
    output, mean, var, info = SyncBatchNormFunction.apply(input, weight, bias, state, call)
    return output, mean, var, info[0], info[1]
