"""A synchronized layer's call, as its module ends in it: :func:`sync_forward` (the synchronized
call) or :func:`plain_forward` (plain BatchNorm: eval, or training without a group).

:class:`~syncbn_lightning.SyncBatchNorm` decides whether a training call synchronizes
(:func:`call_plan`: the call's plan, or ``None``) and makes one of these two calls. A
synchronized call:

1. takes the layer's **plan** (:func:`plan_of`, through :func:`call_plan`): what does not
   change from call to call (the group's name and size, the exchange, whether the C++ operator
   runs, the operator's settings in its schema's order), made once and kept on the layer while
   what it came from is the layer's still (its :class:`~.options.SyncOptions`, its process
   group, torch's default group, its name, ``SYNCBN_IMPL``, the device type: the plan's key);
2. asks what **kind of call** it is (:func:`~.recompute.call_kind`: plain, a checkpoint's
   forward, or its recompute), which fixes what the call updates (:func:`_state`: the running
   statistics and the call counter, or nothing in a recompute), what it keeps, and, inside
   ``step_statistics(normalize="step")``, the step's earlier statistics it merges with
   (:func:`_step_of_call`, on either path);
3. makes **one call**: the C++ operator ``syncbn::sync_batch_norm`` (eager CPU tensors, and CUDA
   ones where :func:`~syncbn_lightning.ops.dispatch.cpp_path` says so: one operator per
   direction, its autograd node in C++), or the Python
   :class:`~.function.SyncBatchNormFunction` (compiled code, a CUDA graph's capture, a custom
   exchange, the pure-PyTorch reference, DataParallel replicas);
4. records the batch (``layer.last_batch``, a :class:`BatchRecord`) and keeps a checkpointed
   forward's statistics.

Both paths compute the same, bitwise (``tests/test_native_path.py``).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._compat import functorch_active
from ..distributed.call_order import watcher
from ..distributed.call_order.checks import mark_status_used, poll_order_checks
from ..distributed.call_order.policy import queues_order_flags_on
from ..distributed.flight import recorder as flight
from ..distributed.groups import group_name_of, sync_group_size
from ..ops.dispatch import IMPL_ENV, cpp_path, python_checks_first, uses_extension
from .accumulate import StepGroup, StepStatistics
from .exchange import LayerState, SyncCall
from .function import SyncBatchNormFunction
from .native import native_op, register_python_kernels
from .recompute import PLAIN, CallKind, call_kind, keep, pack_kept
from .registry import BUILTIN, get_exchange, resolve_exchange

__all__ = [
    "BatchRecord",
    "PythonPath",
    "check_dims",
    "check_input",
    "commit_step",
    "start_step",
    "functorch_error",
    "SyncPlan",
    "affine_of",
    "call_plan",
    "forward_function",
    "plain_forward",
    "plan_of",
    "python_path",
    "running_buffers",
    "settings_in_schema_order",
    "sync_forward",
]

_GROUPS: Any = dist.distributed_c10d.GroupMember if dist.is_available() else None
_NO_ACT = (0, 0.0)
_NO_RUNNING = (None, None, None, None)


class BatchRecord(NamedTuple):
    """What a :class:`~syncbn_lightning.SyncBatchNorm` layer saw in its last training forward.

    Kept for monitoring (batch-size tracking, train/test-gap metrics) without any extra
    communication or host synchronization: the tensors are the ones the forward computed anyway.

    Attributes:
        local_samples: ``N`` of this rank's input.
        mean: the group's batch mean per channel (``None`` without synchronization, i.e. a group
            of one rank, in which case the group is this rank alone).
        var: the group's batch variance per channel as used for ``running_var`` (unbiased unless
            ``unbiased_running_var=False``; ``None`` without synchronization).
        info: the merge's ``[count, samples, order_ok, finite, layer_tag, call_tag]`` tensor
            (``None`` without sync); read through :attr:`samples` and :attr:`count`.
    """

    local_samples: int
    mean: torch.Tensor | None = None
    var: torch.Tensor | None = None
    info: torch.Tensor | None = None

    @property
    def samples(self) -> torch.Tensor | None:
        """0-d tensor, the sum of ``N`` over the sync group (``None`` without sync)."""
        return None if self.info is None else self.info[1]

    @property
    def count(self) -> torch.Tensor | None:
        """0-d tensor, the group's number of values per channel (``None`` without sync)."""
        return None if self.info is None else self.info[0]


# ------------------------------------------------------------------------------------------------
# The two calls a module ends in
# ------------------------------------------------------------------------------------------------


#: The plan :func:`call_plan` gives a synchronized call in compiled code and in DataParallel
#: replicas: the Python path, which finds its own per call (:func:`python_path`).
PER_CALL: Any = object()


def call_plan(layer: Any, device: str) -> Any:
    """How ``layer``'s training call on tensors of ``device`` (a device type) runs: ``None``,
    plain BatchNorm (:func:`plain_forward`); else the plan of its synchronized call
    (:func:`sync_forward`): DataParallel replicas, a group of more than one rank, ``force_sync``,
    or inside ``step_statistics(normalize="step")`` (a call's statistics merge with the step's
    earlier ones: the synchronized call, also without a group, :meth:`SyncPlan.merge_only`).
    The layer's :class:`SyncPlan` for ``device`` (made once, :func:`plan_of`), or
    :data:`PER_CALL` for replicas and while ``torch.compile`` traces (which reads the group
    itself). The one place a call asks whether it is compiled."""
    if layer.replica_group is not None:
        return PER_CALL
    if torch.compiler.is_compiling():
        group = layer.sync_options.force_sync or sync_group_size(layer.process_group) > 1
        return PER_CALL if group or _stepwise(layer) is not None else None
    plan = plan_of(layer, device)
    if plan.synchronizes:
        return plan
    return None if _stepwise(layer) is None else plan.merge_only(layer)


def _stepwise(layer: Any) -> StepStatistics | None:
    """The layer's step inside ``step_statistics(normalize="step")``, else ``None``."""
    step: StepStatistics | None = layer._step_stats
    return step if step is not None and step.normalize == "step" else None


def _step_of_call(layer: Any, kind: CallKind) -> StepStatistics | None:
    """The step whose earlier statistics (its :attr:`~.accumulate.StepStatistics.prior`) this
    call of ``layer`` merges with its group's, on either path: inside
    ``step_statistics(normalize="step")``, except for a checkpoint's recompute, which
    renormalizes from what its forward kept; else ``None``.

    Raises:
        RuntimeError: for a recompute whose forward kept nothing (torch 2.4's non-reentrant
            checkpoint): exchanging again would normalize it over other samples.
    """
    step = _stepwise(layer)
    if step is None or not kind.recompute:
        return step
    if kind.kept is None:
        raise RuntimeError(
            f"step_statistics(normalize='step'): the checkpoint's recompute of layer "
            f"{layer.sync_name or type(layer).__name__!r} found nothing its forward kept (a "
            f"non-reentrant checkpoint on a torch release whose forward cannot be found), and "
            f"exchanging again would normalize it over other samples than its forward: use "
            f"checkpoint(..., use_reentrant=True), or normalize='micro'"
        )
    return None


def plain_forward(layer: Any, input: torch.Tensor) -> torch.Tensor:
    """Plain BatchNorm of ``input`` (torch's own forward: eval with the running statistics, or
    training with the local batch's), after the layer's input checks. A checkpoint's recompute
    of a training call updates nothing: the same kernels on the same input (so the same output),
    with throwaway copies of the running statistics; inside
    :func:`~syncbn_lightning.step_statistics` a call updates nothing either, and adds its batch's
    statistics to the step's."""
    weight, bias = affine_of(layer)
    _check_call_input(layer, input, weight)
    running_mean = layer._buffers["running_mean"]
    if not layer.training:
        return torch.nn.modules.batchnorm._BatchNorm.forward(layer, input)
    kind = PLAIN if torch.compiler.is_compiling() else call_kind(layer, input, False)
    if kind.recompute:
        running_var = layer._buffers["running_var"]
        if layer.track_running_stats and running_mean is not None:
            running_mean, running_var = running_mean.clone(), running_var.clone()
        else:
            running_mean = running_var = None
        momentum = 0.0 if layer.momentum is None else layer.momentum
        return torch.nn.functional.batch_norm(
            input, running_mean, running_var, weight, bias, True, momentum, layer.eps
        )
    layer.last_batch = BatchRecord(int(input.shape[0]))
    step: StepStatistics | None = layer._step_stats
    if step is not None:
        return step.batch_norm(input, weight, bias, layer.eps)
    return torch.nn.modules.batchnorm._BatchNorm.forward(layer, input)


def sync_forward(
    layer: Any,
    plan: Any,
    input: torch.Tensor,
    activation: tuple[int, float] | None,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, bool]:
    """The synchronized training call of ``layer`` on ``input`` (the module docstring), with
    the ``plan`` :func:`call_plan` gave it: ``act(bn(input) + residual)`` with the fused
    ``activation`` (a code and parameter of :mod:`syncbn_lightning.ops.activations`; ``None``:
    none) and ``residual`` (``None``: none); returns the output and whether the activation (and
    residual) were applied, which a custom exchange that fuses no residual leaves to the caller.

    Raises:
        RuntimeError: inside a ``torch.func`` transform, which no synchronized call can run in.
        TypeError / ValueError: on an input the layer cannot take (the layer's checks).
    """
    if plan is PER_CALL:
        return forward_function(layer, input, None, activation, residual)
    if functorch_active():  # a transform's wrapped tensors pass the layer's type check
        raise functorch_error()
    kind = call_kind(layer, input)
    # A CUDA graph's capture takes the Python path (its functional collectives, as capture on
    # NCCL needs; a replay runs no host code, so its host cost is moot). A tensor subclass, or an
    # input on another device than the plan's, takes it too (its checks name the fix).
    native = plan.native and type(input) is torch.Tensor
    if native and (plan.cpu or not torch.cuda.is_current_stream_capturing()):
        return _native_call(layer, plan, input, activation, residual, kind)
    return forward_function(layer, input, None, activation, residual, kind, plan)


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------


def affine_of(layer: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The weight and bias ``layer`` exposes, as ``layer.weight`` and ``layer.bias`` give them
    (torch's BatchNorm reads those too): its Parameters, or what pruning (a plain attribute
    recomputed by a pre-hook), a parametrization (a property) or ``functional_call`` put there.
    The Parameters are read from their dict while both are there (``Module.__getattr__`` costs
    ~0.7 us of host time per name)."""
    params = layer.__dict__["_parameters"]
    try:
        return params["weight"], params["bias"]
    except KeyError:  # pruned or parametrized: the name is no longer a Parameter of the layer
        return layer.weight, layer.bias


class PythonPath(NamedTuple):
    """What a call on the Python path synchronizes through: the group's name (``None``: no
    collective) or a DataParallel replica group, its size, the exchange strategy and whether it
    runs the ``syncbn::`` step operators (else their pure-PyTorch twins)."""

    group: Any
    world_size: int
    exchange: Any
    fused: bool


def python_path(layer: Any, device: str, world_size: int | None = None) -> PythonPath:
    """:class:`PythonPath` of ``layer`` for tensors of ``device`` (``world_size`` ``None``: its
    group's, or its replicas'). A group of one rank that the layer does not force to synchronize
    (a call that takes this path only to merge with the earlier calls of its optimizer step)
    issues no collective: one rank has nothing to exchange."""
    replicas = layer.replica_group
    if world_size is None:
        world_size = replicas.size if replicas is not None else sync_group_size(layer.process_group)
    options = layer.sync_options
    if replicas is None and world_size == 1 and not options.force_sync:
        group = None
    else:
        group = replicas or group_name_of(layer.process_group)
    exchange = resolve_exchange(options.exchange, world_size, group, device)
    return PythonPath(
        group, world_size, exchange, exchange.uses_kernels and uses_extension(device, options.impl)
    )


class SyncPlan:
    """A layer's decisions for its training calls on one kind of device (see the module
    docstring).

    Attributes:
        synchronizes: whether training calls synchronize (a group of more than one rank, or
            ``force_sync``).
        python: what the Python path takes (:class:`PythonPath`; ``None`` when not
            synchronizing).
        native: whether calls take the C++ path.
        checks_first: whether Python's input checks run in front of the C++ path's own (where
            the extension links libstdc++ statically: :func:`~syncbn_lightning.ops.dispatch
            .python_checks_first`).
        device: the device type of the inputs the plan is for (``"cpu"``, ``"cuda"``, ...).
        cpu: whether that is the CPU.
        op: the C++ path's operator (``None`` on the Python path).
        call: what a call calls to run ``op``: its C++ callable (:func:`_callable_of`).
        world_size: ranks in the layer's sync group (1: the call is plain BatchNorm unless the
            layer forces synchronization).
        settings: the C++ operator's settings by name (its schema's: ``csrc/layer/layer.cpp``),
            made once: the group's name, its size, the call-order tag, the exchange, momentum,
            eps, the running variance's, the ranks' weights, whether call-order flags are queued,
            the channels. A call adds its tensors, its kind and its fused activation.
        args: ``settings`` as the call passes them, in the order the operator's schema names
            them (:func:`settings_in_schema_order`): positional arguments cost the operator's
            Python binding ~4 us less per call than the same by keyword
            (``benchmarks/bench_op_args.py``).
        watched: for a plan whose calls queue their call-order flags in a group, the
            :data:`~syncbn_lightning.distributed.call_order.watcher.watch_epoch` at which it had
            the job's watcher watch the group (a later one makes a new plan: the watchers were
            stopped since, a fit's teardown); else ``None``.
        key: what the plan was made from (the layer's options, its process group, torch's
            default group, the layer's name, ``SYNCBN_IMPL``, the device type): it holds while
            the layer's are the same (:func:`plan_of`).
        merging: for a plan that does not synchronize, the one its calls take inside
            ``step_statistics(normalize="step")`` (:meth:`merge_only`; ``None`` until one asks).
    """

    __slots__ = (
        "args",
        "call",
        "checks_first",
        "cpu",
        "device",
        "exchange",
        "fused",
        "group",
        "impl",
        "key",
        "merging",
        "native",
        "op",
        "process_group",
        "python",
        "settings",
        "synchronizes",
        "watched",
        "world",
        "world_size",
    )

    def __init__(
        self, layer: Any, world: Any, impl: Any, device: str, merge_only: bool = False
    ) -> None:
        options = layer.sync_options
        self.process_group, self.world, self.impl = layer.process_group, world, impl
        self.device, self.cpu = device, device == "cpu"
        self.key = (options, layer.process_group, world, layer.sync_name, impl, device)
        self.world_size = sync_group_size(layer.process_group)
        self.synchronizes = self.world_size > 1 or options.force_sync
        self.native = self.checks_first = False
        self.op: Any = None
        self.call: Any = None
        self.python: PythonPath | None = None
        self.settings: dict[str, Any] = {}
        self.args: tuple[Any, ...] = ()
        self.watched: int | None = None
        self.merging: SyncPlan | None = None
        if not (self.synchronizes or merge_only):
            return
        self.python = python_path(layer, device, self.world_size)
        if isinstance(self.python.group, str) and queues_order_flags_on(torch.device(device)):
            # A group whose calls queue their flags: the job's watcher watches it from the
            # first plan on it (again after a teardown stopped it: the plan is then made anew).
            self.watched = watcher.watch_epoch
            watcher.watch_group(self.python.group)
        exchange = self.python.exchange
        builtin = exchange.name in BUILTIN and exchange is get_exchange(exchange.name)
        # (cpp_path first: off the CPU it checks SYNCBN_NATIVE_CUDA, whatever the kernels)
        if builtin and cpp_path(device, options.impl) and self.python.fused:
            self._use_cpp(layer)

    def merge_only(self, layer: Any) -> SyncPlan:
        """The plan of this (non-synchronizing) plan's calls inside
        ``step_statistics(normalize="step")``: the synchronized call, which merges the step's
        earlier statistics, on either path, without a collective (a group of one rank that the
        layer does not force has nothing to exchange: :func:`python_path`). Made at the first
        such call and kept with this plan."""
        if self.merging is None:
            self.merging = SyncPlan(layer, self.world, self.impl, self.device, merge_only=True)
        return self.merging

    def _use_cpp(self, layer: Any) -> None:
        """Take the C++ path: its operator, its settings in the schema's order, the hand-offs'
        Python kernels, the job's recorder and (where calls queue their flags) the watcher."""
        options = layer.sync_options
        register_python_kernels()
        flight.flight_recorder()  # a new job's recorder (the C++ writer follows it)
        self.native, self.op = True, native_op()
        self.call = _callable_of(self.op)
        self.checks_first = python_checks_first()
        assert self.python is not None
        self.settings = {
            "group": self.python.group,
            "world_size": self.world_size,
            "layer_tag": layer.layer_tag,
            "reduce": self.python.exchange.name == "reduce",
            "momentum": options.momentum,
            "eps": options.eps,
            "unbiased": options.unbiased_running_var,
            "equal_rank_weights": options.stats_mode == "default",
            "queue_order_flags": queues_order_flags_on(torch.device(self.device)),
            "num_features": layer.num_features,
        }
        self.args = settings_in_schema_order(self.op, self.settings)


def _callable_of(op: Any) -> Any:
    """The C++ callable behind ``op`` (an ``OpOverload``), which its ``__call__`` calls with the
    same arguments: one of the two micro-optimizations the layer call keeps (benchmarks/RESULTS.md,
    "The layer call's host cost, folded"), as that Python frame repacks the call's 25 arguments
    (3 K of the forward's ~150 K instructions). ``op`` itself where a release has no such
    attribute."""
    return getattr(op, "_op", op)


def settings_in_schema_order(op: Any, settings: dict[str, Any]) -> tuple[Any, ...]:
    """``settings`` (the trailing arguments of ``op``, by name) in the order ``op``'s schema
    declares them, read from the schema.

    Raises:
        KeyError: naming a trailing argument of the schema that ``settings`` lacks.
    """
    names = [argument.name for argument in op._schema.arguments]
    first = names.index("group")
    return tuple(settings[name] for name in names[first:])


# The other micro-optimization the layer call keeps (benchmarks/RESULTS.md, "One forward a newcomer
# can follow: host cost"): os.environ.get encodes the key on every call (0.6 us of a ~20 us
# forward); the dict of encoded keys, which os.environ's assignments update, is read directly
# where CPython has one.
_ENVIRON: Any = getattr(os.environ, "_data", None)
_IMPL_KEY: Any = os.environ.encodekey(IMPL_ENV) if _ENVIRON is not None else IMPL_ENV  # type: ignore[attr-defined]


def _impl_env() -> Any:
    """``SYNCBN_IMPL`` as the environment holds it now (encoded where CPython encodes it)."""
    return _ENVIRON.get(_IMPL_KEY) if _ENVIRON is not None else os.environ.get(IMPL_ENV)


def plan_of(layer: Any, device: str = "cpu") -> SyncPlan:
    """``layer``'s plan for calls on tensors of ``device`` (a device type): the one it keeps
    while it still holds (see the module docstring), else a new one. An input on another device
    than the layer's tensors gets a plan too; the layer's input checks then refuse it."""
    plan: SyncPlan | None = layer._sync_plan
    world = _GROUPS.WORLD if _GROUPS is not None else None
    options = layer.sync_options
    impl = _impl_env() if options.impl is None else None
    key = (options, layer.process_group, world, layer.sync_name, impl, device)
    if (
        plan is None
        or plan.key != key
        or (plan.watched is not None and plan.watched != watcher.watch_epoch)
    ):
        plan = layer._sync_plan = SyncPlan(layer, world, impl, device)
    return plan


# ------------------------------------------------------------------------------------------------
# What a call updates, and its two paths
# ------------------------------------------------------------------------------------------------


def _state(layer: Any, input: torch.Tensor, kind: CallKind) -> tuple[Any, ...]:
    """What the call updates in place, the one slot of its running-statistics policy:
    ``(running_mean, running_var, num_batches_tracked, nonfinite, calls)``, the layer's buffers,
    its non-finite counter and its call counter (the call-order tag), as
    :class:`~.exchange.LayerState` and the operator take them; in a checkpoint's recompute,
    nothing: no running statistic (``None``) and a copy of the call counter (the call is not
    counted); inside :func:`~syncbn_lightning.step_statistics` (the layer's
    :class:`~.accumulate.StepStatistics`), the step's copies of the running statistics and no
    counter of skips: the step's end updates the buffers once (:func:`commit_step`)."""
    # The counters, tested in place on the CPU (a torch.device per comparison costs more than
    # the test); elsewhere, or before the first call, _counters finds or makes them.
    calls, nonfinite = layer._calls, layer._nonfinite
    if (
        calls is None
        or nonfinite is None
        or not (input.is_cpu and calls.is_cpu and nonfinite.is_cpu)
    ):
        calls, nonfinite = _counters(layer, input)
    buffers = layer._buffers
    if kind.recompute:
        return (*_NO_RUNNING, calls.clone())
    if not layer.track_running_stats or buffers["running_mean"] is None:
        return (*_NO_RUNNING, calls)
    step: StepStatistics | None = layer._step_stats
    if step is not None:  # deferred: the kernels update the step's copies (its ``scratch``)
        return (*step.scratch, None, calls)
    return (
        buffers["running_mean"],
        buffers["running_var"],
        buffers["num_batches_tracked"],
        nonfinite,
        calls,
    )


def _counters(layer: Any, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's call and non-finite counters on ``input``'s device (one int64 each, not
    state: made at the first call, moved there with their values when the layer moves)."""
    calls, nonfinite = layer._calls, layer._nonfinite
    device = input.device
    if calls is not None and nonfinite is not None:
        if calls.device == device and nonfinite.device == device:
            return calls, nonfinite
    if calls is None or calls.device != device:
        calls = layer._calls = _counter_on(calls, device)
    if nonfinite is None or nonfinite.device != device:
        nonfinite = layer._nonfinite = _counter_on(nonfinite, device)
    return calls, nonfinite


def _counter_on(counter: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A one-element int64 counter on ``device``: ``counter`` moved there, or a new one at 0.
    A normal tensor also when made under ``torch.inference_mode`` (an inference tensor could not
    be counted on outside it)."""
    with torch.inference_mode(False):
        if counter is None:
            return torch.zeros(1, dtype=torch.long, device=device)
        return counter.reshape(1).to(device)


def _native_call(
    layer: Any,
    plan: SyncPlan,
    input: torch.Tensor,
    activation: tuple[int, float] | None,
    residual: torch.Tensor | None,
    kind: CallKind,
) -> tuple[torch.Tensor, bool]:
    """The C++ path: one operator call (its input checks included) with the kind's state,
    what a recompute takes (``kind.kept``) or whether to keep (``kind.keep``), and the step's
    earlier statistics (which the operator overwrites with this call's merge)."""
    weight, bias = affine_of(layer)
    if plan.checks_first:  # else the operator's own checks (the same messages) do
        _check_call_input(layer, input, weight)
    act, act_param = activation or _NO_ACT
    kept = kind.kept
    stats, call = (kept.stats, kept.flight_call) if kept is not None else (None, -1)
    step = None if layer._step_stats is None else _step_of_call(layer, kind)
    prior = None if step is None else step.prior
    output, mean, var, info, stats, flight_call = plan.call(
        input,
        weight,
        bias,
        *_state(layer, input, kind),
        residual,
        act,
        act_param,
        stats,
        call,
        kind.keep is not None,
        prior,
        *plan.args,
    )
    if step is not None:
        step.wrote_prior()  # (the operator wrote this call's merge into the row)
    _record(layer, input, kind, mean, var, info, stats, flight_call)
    return output, activation is not None


def forward_function(
    layer: Any,
    input: torch.Tensor,
    world_size: int | None,
    activation: tuple[int, float] | None,
    residual: torch.Tensor | None,
    kind: CallKind = PLAIN,
    plan: SyncPlan | None = None,
) -> tuple[torch.Tensor, bool]:
    """The Python path: :class:`~.function.SyncBatchNormFunction` with the kind's state (the
    layer's input checks first), through ``plan``'s :class:`PythonPath` (``None``: compiled
    code, DataParallel replicas and direct calls, which find theirs per call; ``world_size``
    ``None``: the group's).
    Statistics over the group, running stats updated in place (non-finite group statistics skip
    the update, see :meth:`~syncbn_lightning.SyncBatchNorm.nonfinite_skips`; an all-empty group
    leaves them alone as torch does), and the fused ``activation`` after adding ``residual`` when
    the exchange fuses residuals; returns the output and whether both were applied."""
    weight, bias = affine_of(layer)
    _check_call_input(layer, input, weight)
    poll_order_checks()  # flags the device has written since the last call (no host sync)
    if plan is not None and plan.python is not None and plan.device == input.device.type:
        path = plan.python
    else:  # compiled code, DataParallel replicas, a direct call
        path = python_path(layer, input.device.type, world_size)
    # Compiled code cannot queue flags at run time: it notes them on the layer's status instead
    # (made where the layer was placed, only on devices whose calls queue their flags).
    order = layer._order if torch.compiler.is_compiling() else None
    if order is not None and order.device == input.device:
        mark_status_used()
    else:
        order = None
    step = _step_of_call(layer, kind)
    prior = step.prior if step is not None else None
    state = LayerState(*_state(layer, input, kind), order=order, prior=prior)
    if residual is not None and not path.exchange.fuses_residual:
        activation = residual = None  # the caller adds and activates
    act, act_param = activation or _NO_ACT
    keeps: list[Any] | None = [] if kind.keep is not None and path.exchange.keeps else None
    call = SyncCall(
        path.group,
        path.world_size,
        layer.layer_tag,
        path.exchange,
        layer.sync_options,
        path.fused,
        act,
        act_param,
        kind.kept,
        keeps,
    )
    args = (input, weight, bias, state, call) + (() if residual is None else (residual,))
    output, mean, var, info = SyncBatchNormFunction.apply(*args)
    if step is not None:
        step.wrote_prior()  # (the Function wrote this call's merge into the row)
    stats, flight_call = None, -1
    if keeps:
        mean_lo, invstd, grad_info, flight_call = keeps
        stats = pack_kept(mean, mean_lo, invstd, var, info, grad_info)
    _record(layer, input, kind, mean, var, info, stats, flight_call)
    return output, activation is not None


def _record(
    layer: Any,
    input: torch.Tensor,
    kind: CallKind,
    mean: torch.Tensor,
    var: torch.Tensor,
    info: torch.Tensor,
    stats: torch.Tensor | None,
    flight_call: int,
) -> None:
    """After the call: a checkpointed forward keeps ``stats`` (:attr:`~.recompute.Kept.stats`)
    and its ``flight_call`` on its checkpoint; every call but a recompute records the batch
    (``last_batch``, a plain attribute set past ``Module.__setattr__``, which costs ~2 us of host
    time per call; dynamo traces ``object.__setattr__``, not a write into ``__dict__``) and,
    inside :func:`~syncbn_lightning.step_statistics`, adds its statistics to the step's."""
    if kind.recompute:
        return
    if stats is not None:
        keep(kind.keep, layer, input, stats, flight_call)
    object.__setattr__(layer, "last_batch", BatchRecord(input.shape[0], mean, var, info))
    step: StepStatistics | None = layer._step_stats
    if step is not None and step.normalize == "micro":  # ("step": the call set its prior)
        step.add_group(info, mean, var, layer.sync_options.unbiased_running_var)


def running_buffers(layer: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's ``(running_mean, running_var, num_batches_tracked)``, as it holds them now."""
    buffers = layer._buffers
    return buffers["running_mean"], buffers["running_var"], buffers["num_batches_tracked"]


def start_step(group: StepGroup, layers: list[Any]) -> None:
    """Give the ``layers`` of ``group`` their step (each its :class:`~.accumulate.StepStatistics`,
    which their calls read until :func:`commit_step`). Their counters are made now, eagerly, on
    their buffers' device: a layer without a group makes them at its first synchronized call,
    which inside ``normalize="step"`` may be compiled code, and an attribute that code adds to
    the layer fails its own guards at the next call (a recompile)."""
    for layer, step in zip(layers, group.layers, strict=True):
        _counters(layer, layer._buffers["running_mean"])
        layer._step_stats = step


def commit_step(group: StepGroup, layers: list[Any]) -> None:
    """The one running-statistics update of the ``layers`` of ``group`` called in an optimizer
    step (:meth:`~.accumulate.StepGroup.commit`, into their buffers, with their non-finite
    counters; a layer not called is left alone); :func:`~syncbn_lightning.step_statistics`
    calls this at its end."""
    buffers = [running_buffers(layer) for layer in layers]
    nonfinite = [
        _counters(layer, mean)[1] for layer, (mean, _, _) in zip(layers, buffers, strict=True)
    ]
    group.commit(buffers, nonfinite)


# ------------------------------------------------------------------------------------------------
# What a call must be given: each failure names the argument and the fix, before any kernel or
# collective runs (the C++ path checks the same, with the same messages, in
# csrc/layer/layer_checks.cpp)
# ------------------------------------------------------------------------------------------------


def _check_call_input(layer: Any, input: Any, weight: torch.Tensor | None) -> None:
    """:func:`check_input` of a call of ``layer`` (its first tensor: the weight, else the running
    mean)."""
    if weight is not None:
        check_input(input, layer.num_features, weight, "weight")
    else:
        check_input(input, layer.num_features, layer._buffers["running_mean"], "running_mean")


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def check_dims(input: torch.Tensor) -> None:
    """Raise a ValueError unless ``input`` has the shape ``(N, C, *)``."""
    if input.dim() < 2:
        raise ValueError(
            f"SyncBatchNorm expects input of shape (N, C, *) with at least 2 dims, got "
            f"{input.dim()}-D input of shape {tuple(input.shape)}"
        )


def check_input(
    input: Any, num_features: int, reference: torch.Tensor | None, reference_name: str
) -> None:
    """Raise a TypeError/ValueError naming the fix unless ``input`` fits a layer of
    ``num_features`` channels whose first tensor is ``reference`` (its weight, else its running
    mean, named ``reference_name``; ``None``: nothing to match)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"SyncBatchNorm input must be a torch.Tensor, got {type(input).__name__}")
    check_dims(input)
    if not input.is_floating_point():
        raise TypeError(
            f"SyncBatchNorm input must be floating point (float16, bfloat16, float32, "
            f"float64), got {input.dtype}: convert it, e.g. input.float()"
        )
    # While torch.jit.trace records, the comparison of a traced size would only warn that it
    # becomes a constant of the trace (it is one: the layer's channel count).
    if not torch.jit.is_tracing() and input.shape[1] != num_features:
        raise ValueError(
            f"SyncBatchNorm input has {input.shape[1]} channels (dim 1) but the layer was "
            f"built with num_features={num_features}: use "
            f"SyncBatchNorm({input.shape[1]}) or fix the preceding layer "
            f"(input shape {tuple(input.shape)})"
        )
    if reference is None:
        return
    if reference.device != input.device:
        raise ValueError(
            f"SyncBatchNorm input is on {input.device} but the layer's parameters/buffers are "
            f"on {reference.device}: move the model with model.to({str(input.device)!r})"
        )
    if input.dtype != reference.dtype and not (
        input.dtype in _HALF_DTYPES and reference.dtype == torch.float32
    ):
        raise TypeError(
            f"SyncBatchNorm input dtype {input.dtype} does not match the layer's "
            f"{reference_name} dtype {reference.dtype}: cast the model "
            f"(model.to({input.dtype})) or the input; float16/bfloat16 inputs may also use "
            f"float32 parameters"
        )


def functorch_error() -> RuntimeError:
    """The error of a synchronized call inside a ``torch.func`` transform
    (``syncbn_lightning._compat.functorch_active``), which no synchronized call can run in: its
    statistics are a collective over the process group, which a transform can neither batch
    (``vmap``) nor differentiate functionally (``grad``: the layer's autograd nodes, C++ and
    Python, are not functorch-aware)."""
    return RuntimeError(
        "SyncBatchNorm cannot synchronize its batch statistics inside a torch.func transform "
        "(grad, vmap, jacrev, vjp, ...): the exchange is a collective over the process group, "
        "which these transforms can neither batch nor differentiate. Inside the transform, put "
        "the layer in eval mode: it normalizes with its running statistics and communicates "
        "nothing."
    )
