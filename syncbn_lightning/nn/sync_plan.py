"""A synchronized layer's training call: what it decides once (its plan), and its two paths.

Per training call, a :class:`~syncbn_lightning.SyncBatchNorm` needs its group's size and name,
its exchange strategy, whether the extension's kernels run, and its settings as the operators
take them. None of that changes from call to call, so :func:`plan_of` works it out once and keeps
it on the layer (``_sync_plan``) for as long as the objects it came from are the layer's current
ones: its :class:`~syncbn_lightning.functional.SyncOptions`, its process group, torch's default
group, its name (the call-order tag) and the ``SYNCBN_IMPL`` variable. Assigning any of them
(``layer.momentum = 0.01``, a new process group, ``destroy_process_group``) makes a new plan at
the next call.

The two paths (``docs/architecture.md``, "Which path a call takes"):

* :func:`forward_native`, the C++ path: the built-in exchanges (gather, reduce) on CPU tensors,
  and on CUDA tensors where ``SYNCBN_NATIVE_CUDA=1``, with the extension's kernels, eager. One
  operator call, ``syncbn::sync_batch_norm`` (:mod:`syncbn_lightning.functional.native`), whose
  backward is a C++ autograd node.
* :func:`forward_function`, the Python path: everything else (CUDA tensors by default until
  ``benchmarks/gpu_check.sh native`` has passed on a GPU; code being compiled; a custom
  exchange; the pure-PyTorch reference; DataParallel replicas), through the Python
  :class:`~syncbn_lightning.functional.SyncBatchNormFunction`.

A plan is made for the device type of the input (CPU or not); a layer called on the other makes
a new one.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from .._compat import current_graph_task, functorch_active, top_saved_tensors_hooks
from ..distributed import flight
from ..distributed.call_order import mark_status_used, poll_order_checks, watcher
from ..distributed.call_order.policy import queues_order_flag, queues_order_flags_on
from ..distributed.groups import group_name_of, sync_group_size
from ..functional.exchange import LayerState, SyncCall
from ..functional.function import SyncBatchNormFunction
from ..functional.native import native_op, register_python_kernels
from ..functional.registry import BUILTIN, get_exchange, resolve_exchange
from ..ops.dispatch import IMPL_ENV, native_cuda_default, python_checks_first, uses_extension
from ..ops.impl_choice import NATIVE_CUDA_ENV, native_cuda_requested
from .checks import check_input, functorch_error
from .layer_state import BatchRecord
from .recompute import Kept, find_kept, keep, keeping, recompute_task

__all__ = [
    "SyncPlan",
    "affine_of",
    "forward_function",
    "forward_native",
    "plan_of",
    "settings_in_schema_order",
]

_GROUPS: Any = dist.distributed_c10d.GroupMember if dist.is_available() else None
_CPU = torch.device("cpu")
_NO_ACT = (0, 0.0)


# os.environ.get costs ~1 us of host time per call (it encodes the key); its dict of encoded keys
# is read directly where CPython has one (assignments through os.environ update it).
_ENVIRON: Any = getattr(os.environ, "_data", None)
_IMPL_KEY: Any = os.environ.encodekey(IMPL_ENV) if _ENVIRON is not None else IMPL_ENV  # type: ignore[attr-defined]


def _impl_env() -> Any:
    """``SYNCBN_IMPL`` as the environment holds it now (encoded where CPython encodes it)."""
    return _ENVIRON.get(_IMPL_KEY) if _ENVIRON is not None else os.environ.get(IMPL_ENV)


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


def _world() -> Any:
    """torch's default group (``None`` before ``init_process_group``)."""
    return _GROUPS.WORLD if _GROUPS is not None else None


def native_cuda() -> bool:
    """Whether CUDA layers take the C++ path (``SYNCBN_NATIVE_CUDA``, read when a plan is made;
    unset: where these sources passed the GPU check, :func:`~syncbn_lightning.ops.dispatch
    .native_cuda_default`).

    Raises:
        ValueError: on a value other than 0 and 1.
    """
    requested = native_cuda_requested(os.environ.get(NATIVE_CUDA_ENV))
    return native_cuda_default() if requested is None else requested


class SyncPlan:
    """A layer's decisions for its training calls on one kind of device (see the module
    docstring).

    Attributes:
        native: whether calls take the C++ path.
        checks_first: whether Python's input checks run in front of the C++ path's own (where
            the extension links libstdc++ statically: :func:`~syncbn_lightning.ops.dispatch
            .python_checks_first`).
        device: the device type of the inputs the plan is for (``"cpu"``, ``"cuda"``, ...).
        cpu: whether that is the CPU.
        op: the C++ path's operator (``None`` on the Python path).
        world_size: ranks in the layer's sync group (1: the call is plain BatchNorm unless the
            layer forces synchronization).
        settings: the C++ operator's settings by name (its schema's: ``csrc/layer/layer.cpp``), made
            once: the group's name, its size, the call-order tag, the exchange, momentum, eps,
            the running variance's, the ranks' weights, whether call-order flags are queued, the
            channels. A call adds its tensors and its fused activation (``act``, ``act_param``).
        args: ``settings`` as the call passes them, in the order the operator's schema names
            them (:func:`settings_in_schema_order`): positional arguments cost the operator's
            Python binding ~4 us less per call than the same by keyword
            (``benchmarks/bench_op_args.py``).
        watched: for a C++ plan whose calls queue their call-order flags in a group, the
            :data:`~syncbn_lightning.distributed.call_order.watcher.watch_epoch` at which it had the
            job's watcher watch the group (again when the watcher was stopped since); else
            ``None``.
    """

    __slots__ = (
        "args",
        "checks_first",
        "cpu",
        "device",
        "impl",
        "name",
        "native",
        "op",
        "options",
        "process_group",
        "settings",
        "watched",
        "world",
        "world_size",
    )

    def __init__(self, layer: Any, world: Any, impl: Any, device: str) -> None:
        options = layer.sync_options
        self.options, self.process_group, self.world = options, layer.process_group, world
        self.name, self.impl = layer.sync_name, impl
        self.device, self.cpu = device, device == "cpu"
        self.world_size = sync_group_size(layer.process_group)
        self.native = self.checks_first = False
        self.op: Any = None
        self.settings: dict[str, Any] = {}
        self.args: tuple[Any, ...] = ()
        self.watched: int | None = None
        if self.world_size == 1 and not options.force_sync:
            return
        # Off the CPU: SYNCBN_NATIVE_CUDA, checked here; unset, the recorded passes decide below.
        requested = (
            None if device == "cpu" else native_cuda_requested(os.environ.get(NATIVE_CUDA_ENV))
        )
        if device not in ("cpu", "cuda") or requested is False:
            return
        group = group_name_of(layer.process_group)
        exchange = resolve_exchange(options.exchange, self.world_size, group, device)
        builtin = exchange.name in BUILTIN and exchange is get_exchange(exchange.name)
        if not (builtin and exchange.uses_kernels and uses_extension(device, options.impl)):
            return
        if device == "cuda" and requested is None and not native_cuda_default():
            return
        register_python_kernels()
        flight.flight_recorder()  # a new job's recorder (the C++ writer follows it)
        self.native, self.op = True, native_op()
        self.checks_first = python_checks_first()
        self.settings = {
            "group": group,
            "world_size": self.world_size,
            "layer_tag": layer.layer_tag,
            "reduce": exchange.name == "reduce",
            "momentum": options.momentum,
            "eps": options.eps,
            "unbiased": options.unbiased_running_var,
            "equal_rank_weights": options.stats_mode == "default",
            "queue_order_flags": queues_order_flags_on(torch.device(device)),
            "num_features": layer.num_features,
        }
        self.args = settings_in_schema_order(self.op, self.settings)
        if self.settings["queue_order_flags"] and group is not None:
            self.watch()

    def watch(self) -> None:
        """Have the job's watcher watch the plan's group (a queued flag that reads 0 on another
        rank is published there, :mod:`~syncbn_lightning.distributed.call_order.watcher`): the C++
        path queues its flags without Python, so the plan asks for it."""
        self.watched = watcher.watch_epoch
        watcher.watch_group(self.settings["group"])


def settings_in_schema_order(op: Any, settings: dict[str, Any]) -> tuple[Any, ...]:
    """``settings`` (the trailing arguments of ``op``, by name) in the order ``op``'s schema
    declares them, read from the schema.

    Raises:
        KeyError: naming a trailing argument of the schema that ``settings`` lacks.
    """
    names = [argument.name for argument in op._schema.arguments]
    first = names.index("group")
    return tuple(settings[name] for name in names[first:])


def plan_of(layer: Any, device: str = "cpu") -> SyncPlan:
    """``layer``'s plan for calls on tensors of ``device`` (a device type): the one it keeps
    while it still holds (see the module docstring), else a new one. An input on another device
    than the layer's tensors gets a plan too; the layer's input checks then refuse it."""
    plan: SyncPlan | None = layer._sync_plan
    world = _world()
    impl = _impl_env() if layer.sync_options.impl is None else None
    if (
        plan is None
        or plan.options is not layer.sync_options
        or plan.process_group is not layer.process_group
        or plan.world is not world
        or plan.name is not layer.sync_name
        or plan.impl != impl
        or plan.device != device
    ):
        plan = layer._sync_plan = SyncPlan(layer, world, impl, device)
    return plan


def forward_native(
    layer: Any,
    plan: SyncPlan,
    input: torch.Tensor,
    activation: tuple[int, float] | None,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """The C++ path (see :func:`forward_function` for what a call does): ``act(bn(input) +
    residual)`` with the fused ``activation`` (``None``: none) and ``residual`` (``None``:
    none), the layer's input checks included."""
    if functorch_active():  # a transform's wrapped tensors pass the layer's type check
        raise functorch_error()
    state = layer.__dict__
    params, buffers = state["_parameters"], state["_buffers"]
    try:  # affine_of, inlined (a Python call is ~0.1 us of this path's host cost)
        weight, bias = params["weight"], params["bias"]
    except KeyError:
        weight, bias = layer.weight, layer.bias
    running_mean = buffers["running_mean"]
    if plan.checks_first:
        if weight is not None:
            check_input(input, layer.num_features, weight, "weight")
        else:
            check_input(input, layer.num_features, running_mean, "running_mean")
    calls, nonfinite = layer._calls, layer._nonfinite
    if not plan.cpu:
        calls, nonfinite = layer._counters(input.device)
    elif calls is None or nonfinite is None or not (calls.is_cpu and nonfinite.is_cpu):
        calls, nonfinite = layer._counters(_CPU)
    if running_mean is None or not state["track_running_stats"]:
        running = (None, None, None, None)
    else:
        running = (running_mean, buffers["running_var"], buffers["num_batches_tracked"], nonfinite)
    act, act_param = activation or _NO_ACT
    if plan.watched is not None and plan.watched != watcher.watch_epoch:
        plan.watch()  # watchers were stopped (a fit's teardown) while this layer lives on
    # A checkpoint's recompute, or forward (nn/recompute.py); torch's C functions tell, without
    # a Python frame on other calls.
    task = current_graph_task()
    backward = recompute_task(task) if task != -1 else -1
    if backward != -1:
        kept = find_kept(layer, input, backward)
        if kept is not None:
            return _native_again(plan, input, weight, bias, residual, act, act_param, kept)
        running, calls = (None, None, None, None), calls.clone()  # exchanged again, not counted
        args = (residual, act, act_param, *plan.args)
        return plan.op(input, weight, bias, *running, calls, *args)[0]
    segment = None
    if not torch.is_grad_enabled() or top_saved_tensors_hooks(False) is not None:
        segment = keeping()
    if segment is None:
        output, mean, var, info = plan.op(
            input, weight, bias, *running, calls, residual, act, act_param, *plan.args
        )
    else:  # a checkpoint's forward: the op also returns what its recompute takes
        output, mean, var, info, *extra = torch.ops.syncbn.sync_batch_norm_kept.default(
            input, weight, bias, *running, calls, residual, act, act_param, *plan.args
        )
        mean_lo, invstd, grad_info, flight_call = extra
        keep(segment, layer, input, mean, mean_lo, invstd, var, info, grad_info, flight_call)
    # Module.__setattr__ costs ~2 us of host time per call; last_batch is a plain attribute.
    state["last_batch"] = BatchRecord(input.shape[0], mean, var, info)
    return output


def _native_again(
    plan: SyncPlan,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    act: int,
    act_param: float,
    kept: Kept,
) -> torch.Tensor:
    """The C++ path's recompute of a checkpointed call from what its forward kept
    (``syncbn::sync_batch_norm_again``: the same node, no collective, nothing updated)."""
    s = plan.settings
    return torch.ops.syncbn.sync_batch_norm_again.default(
        input,
        weight,
        bias,
        residual,
        kept.mean,
        kept.mean_lo,
        kept.invstd,
        kept.var,
        kept.info,
        kept.grad_info,
        kept.flight_call,
        act,
        act_param,
        s["group"],
        s["world_size"],
        s["layer_tag"],
        s["queue_order_flags"],
        s["num_features"],
    )


def forward_function(
    layer: Any,
    input: torch.Tensor,
    world_size: int,
    activation: tuple[int, float] | None,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, bool]:
    """The Python path of the synchronized training forward: statistics over the group, running
    stats updated in place (non-finite group statistics skip the update, see
    :meth:`~syncbn_lightning.SyncBatchNorm.nonfinite_skips`; an all-empty group leaves them alone
    as torch does), and the fused ``activation`` (None: none) after adding ``residual`` (None:
    none) when the exchange fuses residuals; returns the output and whether both were applied."""
    if not torch.compiler.is_compiling() and functorch_active():  # (not traceable)
        raise functorch_error()
    poll_order_checks()  # flags the device has written since the last call (no host sync)
    buffers = layer._buffers
    (weight, bias), running_mean = affine_of(layer), buffers["running_mean"]
    calls, nonfinite = layer._counters(input.device)
    track = layer.track_running_stats and running_mean is not None
    compiling = torch.compiler.is_compiling()
    # A checkpoint's recompute (nn/recompute.py): what the forward kept, else exchanged again
    # (and neither updates nor counts); a checkpoint's forward keeps for it.
    backward, segment, kept = -1, None, None
    if not compiling and layer.replica_group is None:
        task = current_graph_task()
        backward = recompute_task(task) if task != -1 else -1
        if backward != -1:
            kept = find_kept(layer, input, backward)
            track, calls = False, calls.clone()
        elif not torch.is_grad_enabled() or top_saved_tensors_hooks(False) is not None:
            segment = keeping()
    options = layer.sync_options
    group = layer.replica_group or group_name_of(layer.process_group)
    # Compiled code cannot queue flags at run time: it notes them on the layer's status instead
    # (made where the layer was placed; a layer without one keeps the forward's queued flags).
    order = layer._order if compiling and queues_order_flag(input) else None
    if order is not None:
        mark_status_used()
    state = LayerState(
        running_mean if track else None,
        buffers["running_var"] if track else None,
        buffers["num_batches_tracked"] if track else None,
        nonfinite if track else None,
        calls,
        order if order is not None and order.device == input.device else None,
    )
    exchange = resolve_exchange(options.exchange, world_size, group, input.device.type)
    fused = exchange.uses_kernels and uses_extension(input.device.type, options.impl)
    if residual is not None and not exchange.fuses_residual:
        activation = residual = None  # the caller adds and activates
    act = activation or (0, 0.0)
    kept_list = [] if segment is not None and exchange.keeps else None
    call = SyncCall(
        group, world_size, layer.layer_tag, exchange, options, fused, *act, kept, kept_list
    )
    if residual is None:
        output, mean, var, info = SyncBatchNormFunction.apply(input, weight, bias, state, call)
    else:
        output, mean, var, info = SyncBatchNormFunction.apply(
            input, weight, bias, state, call, residual
        )
    if backward == -1:
        if kept_list:
            mean_lo, invstd, grad_info, flight_call = kept_list
            keep(segment, layer, input, mean, mean_lo, invstd, var, info, grad_info, flight_call)
        layer.last_batch = BatchRecord(int(input.shape[0]), mean, var, info)
    return output, activation is not None
