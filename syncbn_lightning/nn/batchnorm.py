"""The ``SyncBatchNorm`` module, and its ``torch.nn.SyncBatchNorm`` identity off the CPU.

Code written for torch recognizes a synchronized BatchNorm by
``isinstance(layer, torch.nn.SyncBatchNorm)``: DDP logs ``has_sync_bn`` from it, and Lightning's
``TorchSyncBatchNorm.revert`` and user code look for it. But DDP also raises "SyncBatchNorm layers
only work with GPU modules" for any CPU module that holds such an instance, which would end
CPU/gloo training. So a layer is an ``nn.SyncBatchNorm`` exactly when its parameters and buffers
are off the CPU: moving it (``.to``, ``.cuda``, ``.cpu``: every ``Module._apply``), constructing it
with a ``device`` or converting a model that lives there sets its class to
:class:`SyncBatchNormOnDevice`, a subclass of both with no code of its own, and back to
:class:`SyncBatchNorm` on the CPU. The forward, the state_dict and the hyper-parameters are the
same in both classes; ``repr`` prints ``SyncBatchNorm`` for both, while tools that print
``type(m).__name__`` (Lightning's ModelSummary) show ``SyncBatchNormOnDevice`` on a GPU. Pickles
and ``load_state_dict(assign=True)`` re-check the class: they can put tensors elsewhere.
Subclasses of :class:`SyncBatchNorm` keep their own class everywhere (switching it would lose
their methods); one that wants the torch identity on GPUs lists ``torch.nn.SyncBatchNorm`` as a
second base itself.
"""

from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..distributed.groups import check_process_group
from ..functional.layer_call import (
    BatchRecord,  # noqa: F401  (pickles of 0.1 name it here)
    SyncPlan,
    call_plan,
    check_dims,
    plain_forward,
    sync_forward,
)
from ..functional.options import SyncOptions
from ..ops.activations import fused_activation
from .checks import check_num_features, refuse_scripting, same_operands
from .convert import BatchNormXd, convert_sync_batchnorm, register_sync_class, torch_forward
from .layer_state import OPTION_ATTRIBUTES, SyncCallState
from .layer_state import option_property as _option

__all__ = ["SyncBatchNorm", "SyncBatchNormOnDevice", "match_torch_class", "traced_call"]

# What a deep copy makes anew, or leaves behind: the plan (the process group, the operator) and a
# step_statistics merge (the copy is not in the step).
_NOT_COPIED = ("_sync_plan", "_step_stats")


class SyncBatchNorm(SyncCallState, _BatchNorm):
    r"""BatchNorm whose batch statistics are computed over a group of processes, on CPU and GPU.

    A drop-in for :class:`torch.nn.SyncBatchNorm` (same constructor and state_dict) that also runs
    on CPU tensors with the gloo backend, where torch's own refuses. Accepts any input of shape
    ``(N, C, *)``: 2-D to 5-D, channels-first or channels-last, float16/bfloat16/float32/float64.

    Args:
        num_features: ``C``, the number of channels of the input (dim 1).
        eps: added to the variance for numerical stability. Default: ``1e-5``.
        momentum: weight of the new batch in the running-stat update
            ``running = (1 - momentum) * running + momentum * batch``; ``None`` uses the cumulative
            average ``1 / num_batches_tracked``. Default: ``0.1``.
        affine: learn a per-channel scale (weight) and shift (bias). Default: ``True``.
        track_running_stats: keep ``running_mean``/``running_var`` for evaluation; if ``False``,
            batch statistics are used in eval mode too (local to each rank). Default: ``True``.
        process_group: the ranks to synchronize with (see :func:`new_sync_group`); ``None`` means
            the default (world) group. Default: ``None``.
        device: device of the parameters and buffers. Default: ``None``.
        dtype: dtype of the parameters and buffers. Default: ``None``.
        force_sync: run the synchronized kernels and the collectives even when the group has a
            single rank (or torch.distributed is not initialized); for benchmarks and tests.
            Default: ``False``.
        unbiased_running_var: update ``running_var`` with the unbiased group variance (torch); set
            ``False`` for the TF/Keras convention of the biased variance. Default: ``True``.
        impl: the kernels of the synchronized path: ``"auto"`` (the C++ extension where it has
            kernels for the input's device, else the pure-PyTorch reference with one warning),
            ``"ext"`` (the extension or an error), ``"reference"``; ``None`` reads the
            ``SYNCBN_IMPL`` environment variable at each call (default ``"auto"``).
            Default: ``None``.
        stats_mode: how the ranks' statistics are combined (mmcv's option): ``"N"`` weighs each
            rank by its number of values, which gives the statistics of the concatenated batch;
            ``"default"`` gives every rank with a non-empty batch the same weight, whatever its
            batch size (the same result when batches are equal; the gradient follows the same
            weights). Default: ``"N"``.
        exchange: how the ranks' statistics travel in the forward: ``"gather"`` (one all-gather
            of every rank's ``[count, mean, mean_lo, M2]`` row: ``P * (3C + 4)`` values received
            per rank), ``"reduce"`` (one all-reduce of per-channel float64 sums shifted by the
            running mean: ``2C + 15`` values whatever the group size ``P``; see
            :mod:`syncbn_lightning.functional.reduce`), another registered strategy, or ``"auto"``
            (on GPUs, reduce in groups of more than 8 ranks, gather up to 8; on CPUs, gather).
            Both give the same statistics, within 1e-7 of float64 even when ``|mean| / std`` is
            1e4, and share the backward. DataParallel replicas always gather. Default:
            ``"auto"``.

    Shape:
        - Input: ``(N, C, *)``; Output: same shape, dtype and memory format.

    The settings beyond torch's (and ``momentum``/``eps``) are held in one frozen, validated
    :class:`~syncbn_lightning.functional.SyncOptions`, ``layer.sync_options``; the attributes of
    the same names read it, and assigning one (``layer.momentum = 0.01``) makes a new, validated
    one.

    Raises:
        TypeError / ValueError: on invalid constructor arguments, attribute values or inputs; the
            message names the argument and the fix.

    Example:
        >>> import torch
        >>> from syncbn_lightning import SyncBatchNorm
        >>> bn = SyncBatchNorm(8)
        >>> y = bn(torch.randn(4, 8, 5, 5))   # no process group: exactly nn.BatchNorm2d
        >>> y.shape
        torch.Size([4, 8, 5, 5])

    Note:
        While training with a group of more than one rank, the mean and variance are those of the
        concatenation of all ranks' batches: each rank contributes its count ``n_r``, mean and
        ``M2`` and they are merged count-weighted (Chan et al.), so uneven batches are exact and a
        rank with an empty batch still joins the collectives (it must: every rank calls every layer
        in the same order). The output is normalized with the biased group variance; ``running_var``
        is updated with the unbiased one, ``M2 / (n - 1)`` over the whole group's count ``n``.
        ``num_batches_tracked`` counts the updates (forward calls, as in torch, except those whose
        group statistics were not finite: they leave the running stats alone). In eval mode with
        running stats the layer communicates nothing; without running stats it normalizes each
        rank's batch locally. Outside torch.distributed, or with a group of one rank, the layer
        computes exactly what ``nn.BatchNorm*`` computes (it calls the same function, so a NaN
        batch reaches the running stats there, as in torch). Gradients of weight and bias are the
        local ones; DDP averages them like any other parameter gradient.
    """

    _version = 2  # torch's _NormBase layout; bump with a migration in _load_from_state_dict.
    #: The layer's settings: momentum, eps and how it synchronizes (validated when made).
    sync_options: SyncOptions
    momentum = _option("momentum", "Weight of the new batch in the running-stat update.")
    eps = _option("eps", "Added to the variance before the inverse square root.")
    impl = _option("impl", "The kernels: 'auto', 'ext', 'ref', or None (SYNCBN_IMPL).")
    stats_mode = _option("stats_mode", "How ranks weigh in the group statistics: 'N', 'default'.")
    exchange = _option("exchange", "The forward's statistics exchange ('auto', 'gather', ...).")
    force_sync = _option("force_sync", "Synchronize even in a group of one rank.")
    unbiased_running_var = _option("unbiased_running_var", "running_var from the unbiased var.")
    #: Under :class:`~syncbn_lightning.SyncDataParallel`: this copy's exchange with the other
    #: replicas (set by ``join_replicas``; it replaces the process group).
    replica_group: Any = None
    #: The decisions of its training calls, made once
    #: (:mod:`syncbn_lightning.functional.layer_call`); ``None``: none yet.
    _sync_plan: SyncPlan | None = None

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        force_sync: bool = False,
        unbiased_running_var: bool = True,
        impl: str | None = None,
        stats_mode: str = "N",
        exchange: str = "auto",
    ) -> None:
        check_num_features(num_features)
        options = SyncOptions(  # its fields, in order
            momentum, eps, impl, stats_mode, exchange, force_sync, unbiased_running_var
        )
        check_process_group(process_group)
        # Before the base class's __init__, which assigns momentum and eps (to these values).
        object.__setattr__(self, "sync_options", options)
        # _BatchNorm's, not super(): in SyncBatchNormOnDevice the next class is nn.SyncBatchNorm,
        # whose sixth positional argument is process_group.
        _BatchNorm.__init__(
            self,
            num_features,
            eps,
            momentum,
            affine,
            track_running_stats,
            device=device,
            dtype=dtype,
        )
        self.process_group = process_group
        self._number_layer()
        match_torch_class(self)

    def _apply(self, fn: Any, recurse: bool = True) -> SyncBatchNorm:
        super()._apply(fn, recurse)
        match_torch_class(self)
        return self

    def _match_torch_class(self) -> None:
        """Be a ``torch.nn.SyncBatchNorm`` too exactly when off the CPU (the module docstring)."""
        match_torch_class(self)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_sync_plan", None)  # holds the process group and the operator: made anew
        state.pop("_step_stats", None)  # a step's partial merge is not kept
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Pickles of older versions hold the settings as attributes: they become the options.
        legacy = {k: state.pop(k) for k in OPTION_ATTRIBUTES if k in state}
        super().__setstate__(state)
        if "sync_options" not in self.__dict__:
            momentum, eps = legacy.pop("momentum", 0.1), legacy.pop("eps", 1e-5)
            self.__dict__["sync_options"] = SyncOptions.of_layer(momentum, eps, **legacy)
        # map_location may have put the tensors elsewhere: the class follows the tensors.
        match_torch_class(self)

    def _get_name(self) -> str:
        return "SyncBatchNorm" if type(self) is SyncBatchNormOnDevice else super()._get_name()

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncBatchNorm:
        """A deep copy that shares the process group (a ProcessGroup cannot be copied; the copy
        synchronizes with the same ranks, e.g. an EMA or a compiled twin of the model)."""
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        state = {k: v for k, v in self.__dict__.items() if k not in _NOT_COPIED}
        copied.__dict__.update(copy.deepcopy(state, memo))
        return copied

    def _check_input_dim(self, input: torch.Tensor) -> None:
        check_dims(input)

    # torch.jit.script asks every submodule first: refuse with the ways that work.
    __prepare_scriptable__ = refuse_scripting

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if type(input) is not torch.Tensor and isinstance(input, torch.fx.Proxy):
            return traced_call(self, input)
        return self._forward(input, None)[0]

    def add_act(
        self, input: torch.Tensor, residual: torch.Tensor, act: nn.Module | None = None
    ) -> torch.Tensor:
        """``act(self(input) + residual)``: the tail of a residual block (BatchNorm, the
        shortcut added, the activation) as one layer call.

        Synchronized training with ``act`` ``None`` or one of
        :data:`~syncbn_lightning.ops.activations.ACTIVATIONS` runs add and activation inside the
        normalize kernel, and the backward computes the residual's gradient ``dy * act'(z +
        residual)`` in the pass that sums it; anywhere else the same maths runs step by step.
        A ``residual`` of another shape (a broadcast add, e.g. a ``[1, C, 1, 1]`` bias), dtype
        or device is added by torch after the layer, as ``self(input) + residual`` would.
        ``convert_sync_batchnorm(..., fuse_residual=True)`` makes residual blocks call this
        (``docs/library.md``).
        """
        code = (0, 0.0) if act is None else fused_activation(act)
        if isinstance(input, torch.fx.Proxy):  # fx: the layer is one node, the add and act traced
            output = self(input)
        elif code is not None and same_operands(input, residual):
            output, applied = self._forward(input, code, residual)
            if applied:
                return output
        else:
            output = self._forward(input, None)[0]
        output = output + residual
        return output if act is None else act(output)

    def _forward(
        self,
        input: torch.Tensor,
        activation: tuple[int, float] | None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, bool]:
        """The normalized ``input``, and whether ``activation`` (a code and parameter of
        :mod:`syncbn_lightning.ops.activations`) was applied too, after adding ``residual`` when
        one is given: by the synchronized call, never by plain BatchNorm, which leaves both to
        the caller. A training call synchronizes where :func:`call_plan` gives it a plan; every
        other call is plain BatchNorm."""
        # (is_cpu first: reading input.device makes a torch.device, 0.4 us of the call)
        device = "cpu" if not isinstance(input, torch.Tensor) or input.is_cpu else input.device.type
        plan = call_plan(self, device) if self.training else None
        if plan is not None:
            return sync_forward(self, plan, input, activation, residual)
        return plain_forward(self, input), False

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Versions < 2 (torch < 0.4.1) lack num_batches_tracked; _NormBase fills it in. Our own
        # layout is torch's version 2, so plain BatchNorm and SyncBatchNorm checkpoints load into
        # each other unchanged. A future layout change bumps _version and migrates here.
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        match_torch_class(self)  # load_state_dict(assign=True) may have moved the tensors

    @classmethod
    def convert_sync_batchnorm(
        cls,
        module: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> torch.nn.Module:
        """torch's classmethod form, ``SyncBatchNorm.convert_sync_batchnorm(module, group)``:
        :func:`syncbn_lightning.convert_sync_batchnorm` (same arguments), so the layers are ours
        (``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` makes torch's, which refuse CPU)."""
        return convert_sync_batchnorm(module, process_group, **kwargs)

    def extra_repr(self) -> str:
        # torch formats its part from the instance's __dict__, where momentum and eps are not (they
        # are the options'): a view that has them.
        view = SimpleNamespace(**vars(self), momentum=self.momentum, eps=self.eps, bias=self.bias)
        text = _BatchNorm.extra_repr(view)  # type: ignore[arg-type]
        options = self.sync_options
        if options.force_sync:
            text += ", force_sync=True"
        if not options.unbiased_running_var:
            text += ", unbiased_running_var=False"
        if options.impl is not None:
            text += f", impl={options.impl!r}"
        if options.stats_mode != "N":
            text += f", stats_mode={options.stats_mode!r}"
        if options.exchange != "auto":
            text += f", exchange={options.exchange!r}"
        return text


class SyncBatchNormOnDevice(SyncBatchNorm, nn.SyncBatchNorm):
    """A :class:`SyncBatchNorm` whose tensors are off the CPU: the same layer, and also a
    ``torch.nn.SyncBatchNorm`` for ``isinstance`` checks (see the module docstring).

    Usually not constructed by hand: a SyncBatchNorm takes this class when it moves to a GPU (or
    is made there) and leaves it when it moves back to the CPU; ``SyncBatchNormOnDevice(...)``
    takes the constructor's arguments and ends up in the class its ``device`` calls for. Its
    forward is ours (first in the MRO), so torch's ``nn.SyncBatchNorm.forward`` never runs.
    """


def traced_call(layer: nn.Module, input: torch.fx.Proxy) -> torch.fx.Proxy:
    """The node of an fx trace (``torch.fx.symbolic_trace``, torchvision's
    ``create_feature_extractor``) for a call of ``layer``: one ``call_module`` node, as fx records
    ``torch.nn.SyncBatchNorm`` and the other BatchNorm classes (leaves of its default tracer).
    The layer's forward communicates and updates buffers, which a trace cannot follow; the
    traced graph calls the layer itself, so what the traced model computes is what the model
    computes. The tracer has already entered ``layer`` (its module path is the current one)."""
    tracer = input.tracer
    return tracer.create_proxy("call_module", tracer.path_of_module(layer), (input,), {})


def match_torch_class(layer: SyncBatchNorm) -> None:
    """Give ``layer`` the class its device calls for: :class:`SyncBatchNormOnDevice` when its first
    parameter or buffer is on a device other than the CPU, else :class:`SyncBatchNorm` (also when
    it has no tensors at all). Subclasses are left as they are. Every layer's call-order status
    follows it there (``_place_order_status``)."""
    tensors = itertools.chain(layer.parameters(recurse=False), layer.buffers(recurse=False))
    first = next(tensors, None)
    layer._place_order_status(None if first is None else first.device)
    cls = type(layer)
    if cls is not SyncBatchNorm and cls is not SyncBatchNormOnDevice:
        return
    off_cpu = first is not None and first.device.type != "cpu"
    layer.__class__ = SyncBatchNormOnDevice if off_cpu else SyncBatchNorm


register_sync_class(SyncBatchNorm, plain=BatchNormXd, replaces=torch_forward)
