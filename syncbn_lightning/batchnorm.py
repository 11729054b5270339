"""The ``SyncBatchNorm`` module (layer 4)."""

from __future__ import annotations

import copy
import itertools
import zlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from .call_order import register_layer_name
from .exchange import ReduceSyncBatchNormFunction, check_exchange, resolve_exchange
from .function import TAG_LIMIT, SyncBatchNormFunction, check_stats_mode
from .groups import group_name_of, sync_group_size
from .impl import check_impl
from .validation import validate_hyperparameters

__all__ = ["SyncBatchNorm", "BatchRecord"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Construction order of layers built directly (not by the converter): their call-order tag until
# they get a name. Models built the same way on every rank get the same numbers.
_SERIALS = itertools.count(1)


class BatchRecord(NamedTuple):
    """What a :class:`SyncBatchNorm` layer saw in its last training forward.

    Kept for monitoring (batch-size tracking, train/test-gap metrics) without any extra
    communication or host synchronization: the tensors are the ones the forward computed anyway.

    Attributes:
        local_samples: ``N`` of this rank's input.
        mean: the group's batch mean per channel (``None`` without synchronization, i.e. a group
            of one rank, in which case the group is this rank alone).
        var: the group's batch variance per channel as used for ``running_var`` (unbiased unless
            ``unbiased_running_var=False``; ``None`` without synchronization).
        info: the merge's ``[count, samples, order_ok, finite]`` tensor (``None`` without sync);
            read through :attr:`samples` and :attr:`count`.
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


class SyncBatchNorm(_BatchNorm):
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
            of every rank's ``[count, mean, M2]`` row: ``P * (2C + 4)`` values received per rank),
            ``"reduce"`` (one all-reduce of per-channel float64 sums shifted by the running mean:
            ``2C + 15`` values whatever the group size ``P``; plain torch operations, see
            :mod:`syncbn_lightning.exchange`) or ``"auto"`` (reduce in groups of more than 8
            ranks, gather up to 8). Both give the same statistics (the reduce exchange keeps the
            float64 mean, so it also stays accurate when ``|mean| / std`` is large); the backward
            is the same. DataParallel replicas always gather. Default: ``"auto"``.

    Shape:
        - Input: ``(N, C, *)``; Output: same shape, dtype and memory format.

    Raises:
        TypeError / ValueError: on invalid constructor arguments or inputs; the message names the
            argument and the fix.

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
    #: The last training forward's :class:`BatchRecord` (``None`` before the first one); read and
    #: cleared by :class:`~syncbn_lightning.SyncBNCallback`. A class default, so layers made by the
    #: converter (which bypasses ``__init__``) have it too.
    last_batch: BatchRecord | None = None
    #: The layer's qualified name in its model, set by :func:`convert_sync_batchnorm` (and so by the
    #: callback); it names the layer in call-order errors and fixes its call-order tag.
    sync_name: str | None = None
    _sync_serial: int = 0
    _named_tag: tuple[str, int] | None = None
    # Per-layer int64 counters on the layer's device (created on first use; not state): the calls
    # of the synchronized path (the call-order tag) and the skipped non-finite updates.
    _calls: torch.Tensor | None = None
    _nonfinite: torch.Tensor | None = None
    #: The implementation asked for (``"auto"``, ``"ext"``, ``"ref"``; ``None``: ``SYNCBN_IMPL``).
    impl: str | None = None
    #: How ranks are weighed in the group statistics: ``"N"`` (by sample count) or ``"default"``.
    stats_mode: str = "N"
    #: The forward's statistics exchange: ``"auto"``, ``"gather"`` or ``"reduce"``.
    exchange: str = "auto"
    #: Under :class:`~syncbn_lightning.SyncDataParallel`: this copy's exchange with the other
    #: replicas (set by ``join_replicas``; it replaces the process group).
    replica_group: Any = None

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
        validate_hyperparameters(num_features, eps, momentum, process_group)
        impl = check_impl(impl)
        stats_mode = check_stats_mode(stats_mode)
        exchange = check_exchange(exchange)
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
        self.force_sync = bool(force_sync)
        self.unbiased_running_var = bool(unbiased_running_var)
        self.impl = impl
        self.stats_mode = stats_mode
        self.exchange = exchange
        self._sync_serial = next(_SERIALS)
        self._match_torch_class()

    @property
    def layer_tag(self) -> int:
        """The id this layer sends with its statistics for the call-order check.

        A hash of :attr:`sync_name` when the layer has one (equal on every rank of a model built
        the same way), else its construction number in this process. Computed when the name is
        set, so that the forward (and torch.compile) only reads an int."""
        if self._named_tag is not None and self._named_tag[0] == self.sync_name:
            return self._named_tag[1]
        if self.sync_name is None:
            return self._sync_serial % TAG_LIMIT
        return self._tag_of(self.sync_name)

    def set_sync_name(self, name: str) -> None:
        """Name the layer (its qualified name in the model) for call-order checks and errors."""
        self.sync_name = name
        register_layer_name(self._tag_of(name), name)

    def _tag_of(self, name: str) -> int:
        tag = zlib.crc32(name.encode()) % TAG_LIMIT
        self._named_tag = (name, tag)
        return tag

    def nonfinite_skips(self) -> torch.Tensor:
        """How many running-stat updates were skipped because the synchronized batch statistics
        were NaN or inf: the layer's 0-d int64 counter on the buffers' device, updated in place
        (copy it to keep a snapshot; reading its value syncs on CUDA)."""
        device = self.running_mean.device if self.running_mean is not None else None
        if self._nonfinite is None:
            return torch.zeros((), dtype=torch.long, device=device)
        if device is not None and self._nonfinite.device != device:
            self._nonfinite = self._nonfinite.to(device)
        return self._nonfinite.view(())

    def _counters(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The call and non-finite counters on ``device`` (moved there with their values)."""
        if self._calls is None or self._calls.device != device:
            self._calls = _counter_on(self._calls, device)
        if self._nonfinite is None or self._nonfinite.device != device:
            self._nonfinite = _counter_on(self._nonfinite, device)
        return self._calls, self._nonfinite

    def _apply(self, fn: Any, recurse: bool = True) -> SyncBatchNorm:
        super()._apply(fn, recurse)
        self._match_torch_class()
        return self

    def _match_torch_class(self) -> None:
        """Be a ``torch.nn.SyncBatchNorm`` too exactly when off the CPU (see torch_class.py)."""
        from .torch_class import match_torch_class

        match_torch_class(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A pickle (torch.load of a whole model) keeps the class it was saved with, but
        # map_location may have put the tensors elsewhere: the class follows the tensors.
        super().__setstate__(state)
        self._match_torch_class()

    def _get_name(self) -> str:
        return (
            "SyncBatchNorm"
            if type(self).__name__ == "SyncBatchNormOnDevice"
            else super()._get_name()
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncBatchNorm:
        """A deep copy that shares the process group (a ProcessGroup cannot be copied; the copy
        synchronizes with the same ranks, e.g. an EMA or a compiled twin of the model)."""
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects input of shape (N, C, *) with at least 2 dims, got "
                f"{input.dim()}-D input of shape {tuple(input.shape)}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._forward(input, None)[0]

    def _forward(
        self, input: torch.Tensor, activation: tuple[int, float] | None
    ) -> tuple[torch.Tensor, bool]:
        """The normalized ``input``, and whether ``activation`` (a code and parameter of
        :mod:`.activation`) was applied too: by the synchronized kernels, never on the local path
        (plain ``F.batch_norm``), which leaves it to the caller."""
        # Parameters and buffers read from their dicts: Module.__getattr__ costs ~0.7 us of host
        # time per name, a tenth of the layer's own host cost on a small tensor.
        params, buffers = self._parameters, self._buffers
        weight, running_mean = params["weight"], buffers["running_mean"]
        self._check_input(input, weight if weight is not None else running_mean)
        replicas = self.replica_group
        if not self.training:
            world_size = 1
        elif replicas is not None:
            world_size = replicas.size
        else:
            world_size = sync_group_size(self.process_group)
        if world_size == 1 and not (self.training and self.force_sync):
            if self.training:
                self.last_batch = BatchRecord(int(input.shape[0]))
            return super().forward(input), False
        output = self._forward_sync(
            input, world_size, weight, params["bias"], running_mean, buffers, activation or (0, 0.0)
        )
        return output, activation is not None

    def _forward_sync(
        self,
        input: torch.Tensor,
        world_size: int,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        buffers: dict[str, torch.Tensor | None],
        activation: tuple[int, float],
    ) -> torch.Tensor:
        """The synchronized training forward: statistics over the group, running stats updated
        in place by the merge (non-finite group statistics skip the update, see
        :meth:`nonfinite_skips`; an all-empty group leaves them alone as torch does), and the
        fused ``activation`` (code 0: none)."""
        calls, nonfinite = self._counters(input.device)
        track = self.track_running_stats and running_mean is not None
        group = self.replica_group or group_name_of(self.process_group)
        reduce = resolve_exchange(self.exchange, world_size, group) == "reduce"
        function = ReduceSyncBatchNormFunction if reduce else SyncBatchNormFunction
        output, mean, var, info = function.apply(
            input,
            weight,
            bias,
            running_mean if track else None,
            buffers["running_var"] if track else None,
            buffers["num_batches_tracked"] if track else None,
            nonfinite if track else None,
            calls,
            self.momentum,
            float(self.eps),
            group,
            world_size,
            self.unbiased_running_var,
            self.layer_tag,
            self.impl,
            self.stats_mode == "default",
            *activation,
        )
        self.last_batch = BatchRecord(int(input.shape[0]), mean, var, info)
        return output

    def _check_input(self, input: torch.Tensor, reference: torch.Tensor | None) -> None:
        """Raise a TypeError/ValueError naming the fix unless ``input`` fits the layer;
        ``reference``: the weight, else the running mean, else ``None`` (nothing to match)."""
        if not isinstance(input, torch.Tensor):
            raise TypeError(
                f"SyncBatchNorm input must be a torch.Tensor, got {type(input).__name__}"
            )
        self._check_input_dim(input)
        if not input.is_floating_point():
            raise TypeError(
                f"SyncBatchNorm input must be floating point (float16, bfloat16, float32, "
                f"float64), got {input.dtype}: convert it, e.g. input.float()"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm input has {input.shape[1]} channels (dim 1) but the layer was "
                f"built with num_features={self.num_features}: use "
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
        if input.dtype != reference.dtype and not _dtypes_compatible(input.dtype, reference.dtype):
            what = "weight" if reference is self.weight else "running_mean"
            raise TypeError(
                f"SyncBatchNorm input dtype {input.dtype} does not match the layer's {what} dtype "
                f"{reference.dtype}: cast the model (model.to({input.dtype})) or the input; "
                f"float16/bfloat16 inputs may also use float32 parameters"
            )

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
        self._match_torch_class()  # load_state_dict(assign=True) may have moved the tensors

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: dist.ProcessGroup | None = None, **kwargs: Any
    ) -> torch.nn.Module:
        """torch's classmethod form, ``SyncBatchNorm.convert_sync_batchnorm(module, group)``:
        :func:`syncbn_lightning.convert_sync_batchnorm` (same arguments), so the layers are ours
        (``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` makes torch's, which refuse CPU)."""
        from .convert import convert_sync_batchnorm

        return convert_sync_batchnorm(module, process_group, **kwargs)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.force_sync:
            text += ", force_sync=True"
        if not self.unbiased_running_var:
            text += ", unbiased_running_var=False"
        if self.impl is not None:
            text += f", impl={self.impl!r}"
        if self.stats_mode != "N":
            text += f", stats_mode={self.stats_mode!r}"
        if self.exchange != "auto":
            text += f", exchange={self.exchange!r}"
        return text


def _counter_on(counter: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A one-element int64 counter on ``device``: ``counter`` moved there, or a new one at 0."""
    if counter is None:
        return torch.zeros(1, dtype=torch.long, device=device)
    return counter.reshape(1).to(device)


def _dtypes_compatible(input_dtype: torch.dtype, param_dtype: torch.dtype) -> bool:
    return input_dtype == param_dtype or (
        input_dtype in _HALF_DTYPES and param_dtype == torch.float32
    )
