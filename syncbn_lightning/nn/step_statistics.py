"""Gradient accumulation: one running-statistics update per optimizer step.

With K micro-batches per optimizer step, torch's BatchNorm (and every library built on it)
updates its running statistics K times per step, each from a batch K times smaller: with momentum
0.1 and K = 4 the step's effective momentum is ``1 - 0.9**4 = 0.34``. Within one step the weights
do not change, so every micro-batch's statistics, on every rank, are samples of the same network:
:func:`step_statistics` merges them (count-weighted, in float64) and updates once.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..functional.accumulate import NORMALIZE_MODES, StepGroup, take_group
from ..functional.layer_call import commit_step, running_buffers, start_step
from ..functional.registry import get_exchange
from .batchnorm import SyncBatchNorm

__all__ = ["OpenStep", "open_step", "step_statistics"]


@contextlib.contextmanager
def step_statistics(model: nn.Module, normalize: str = "micro") -> Iterator[None]:
    """The micro-batches of one optimizer step: their training calls update no running
    statistic, and the step's end updates them once, from every call's statistics.

    Covers every :class:`~syncbn_lightning.SyncBatchNorm` of ``model`` (or of the model a
    ``DistributedDataParallel`` / FSDP wrapper holds), the layers without a group included.
    Inside, each layer keeps the count-weighted merge (float64, O(C), not a buffer) of the
    statistics its training calls normalized with: its group's, over every rank, micro-batch and
    call. At a normal exit each layer called in the step takes ONE update::

        running_mean <- (1 - momentum) * running_mean + momentum * mean_step
        running_var  <- the same with the step's variance over its whole count (unbiased unless
                        unbiased_running_var=False)
        num_batches_tracked += 1   (momentum=None: the cumulative average with that count)

    with the layers' rules: empty micro-batches add nothing, a step that saw no value or whose
    statistics are not finite updates nothing (the latter counted by ``nonfinite_skips``). No
    host sync.

    Args:
        model: the model, or its DDP/FSDP wrapper.
        normalize: ``"micro"`` (the default): each call normalizes with its own group's
            statistics, as without the context (outputs and gradients unchanged). ``"step"``:
            with those merged with the layer's earlier calls in the step (micro-batch k over
            every sample of micro-batches 1..k on every rank of its group; the earlier ones
            are constants in the backward), on the layer's own path. In the
            small-batch experiment's detector ``"step"`` trained far worse than ``"micro"``
            (docs/gradient-accumulation.md, "What it did to a detector"): prefer ``"micro"``.

    Raises:
        ValueError: ``normalize`` is not ``"micro"`` or ``"step"``; ``model`` holds
            :class:`~syncbn_lightning.SyncDataParallel` replicas; with ``"step"``, a layer has
            ``stats_mode="default"`` or an exchange that takes no earlier statistics.
        RuntimeError: a layer of ``model`` is inside another :func:`step_statistics` already
            (contexts do not nest: one per optimizer step).

    Example:
        >>> import torch, syncbn_lightning as sbl
        >>> net = sbl.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
        >>> with sbl.step_statistics(net):
        ...     for micro in torch.randn(4, 2, 3).unbind():
        ...         net(micro).sum().backward()
        >>> int(net[0].num_batches_tracked)
        1

    Note:
        On an exception inside, nothing is committed: the running statistics are as they were
        at entry. Eval-mode calls are untouched (they read the running statistics, as ever). A
        checkpoint's recompute adds nothing: it renormalizes with what its forward kept. The
        merge is not saved: a checkpoint taken mid-step resumes without the step's partial
        statistics. Plain BatchNorm layers (a model not converted) are beyond the context's
        reach: a warning names them, and they update at every micro-batch. The update reads
        each layer's ``momentum`` and ``unbiased_running_var`` as they were at the step's start.
        The step's memory (the merges, the copies of the running statistics: about 52 bytes
        per channel) is made at the first step of a kind of layers and kept, process-wide, for
        the next (at most :data:`~syncbn_lightning.functional.accumulate.KEPT_GROUPS` groups),
        so that a step starts with 2 or 3 ops.
    """
    step = open_step(model, normalize)
    try:
        yield
        step.commit()
    finally:
        step.close()


class OpenStep:
    """The layers of one :func:`step_statistics` between its start and its end, for code that
    starts and ends the step at separate places (the Lightning callback's hooks); made by
    :func:`open_step`. The layers that commit alike (device, dtype, momentum and variance rule,
    as at the step's start) form one :class:`~syncbn_lightning.functional.accumulate.StepGroup`,
    which merges and commits them with a fixed number of ops, and which the next step of the
    same layers takes again (:func:`~syncbn_lightning.functional.accumulate.take_group`)."""

    def __init__(self, layers: list[SyncBatchNorm], normalize: str = "micro") -> None:
        self.layers = layers
        alike: dict[tuple[Any, ...], list[SyncBatchNorm]] = {}
        for layer in layers:
            running_mean = layer._buffers["running_mean"]
            options = layer.sync_options
            key = (
                running_mean.device,
                running_mean.dtype,
                options.momentum,
                options.unbiased_running_var,
            )
            alike.setdefault(key, []).append(layer)
        self.groups: list[tuple[StepGroup, list[SyncBatchNorm]]] = []
        try:
            for (_, _, momentum, unbiased), members in alike.items():
                buffers = [running_buffers(layer) for layer in members]
                group = take_group(buffers, momentum, unbiased, normalize)
                self.groups.append((group, members))
                start_step(group, members)
        except BaseException:
            self.close()  # the layers started so far leave the step: a later one may start
            raise

    def commit(self) -> None:
        """The step's one update of every layer called in it (its end, at a normal exit), then
        :meth:`close`."""
        with torch.no_grad():
            for group, members in self.groups:
                commit_step(group, members)
        self.close()

    def close(self) -> None:
        """End the step without an update (after :meth:`commit`: nothing more)."""
        for layer in self.layers:
            layer._step_stats = None
        for group, _ in self.groups:
            group.release()
        self.layers, self.groups = [], []


def open_step(model: nn.Module, normalize: str = "micro") -> OpenStep:
    """Start a step of :func:`step_statistics` over ``model`` (its checks and refusals: see
    there); end it with :meth:`OpenStep.commit` or :meth:`OpenStep.close`."""
    if normalize not in NORMALIZE_MODES:
        raise ValueError(
            f"step_statistics(normalize=...) must be one of {NORMALIZE_MODES}, got {normalize!r}"
        )
    layers = _layers_of(model)
    if normalize == "step":
        for layer in layers:
            _check_step_mode(layer)
    return OpenStep(layers, normalize)


def _check_step_mode(layer: SyncBatchNorm) -> None:
    """Refuse a layer whose calls cannot normalize over the step so far: ``stats_mode=
    "default"`` (its ranks weigh alike, a step's calls would not) and an exchange that takes no
    earlier statistics (a custom one)."""
    name = layer.sync_name or type(layer).__name__
    options = layer.sync_options
    if options.stats_mode == "default":
        raise ValueError(
            f"step_statistics(normalize='step'): layer {name!r} has stats_mode='default' (each "
            f"rank weighs alike), which does not merge with earlier micro-batches: use "
            f"stats_mode='N', or normalize='micro'"
        )
    if options.exchange != "auto" and not get_exchange(options.exchange).takes_prior:
        raise ValueError(
            f"step_statistics(normalize='step'): layer {name!r} uses the exchange "
            f"{options.exchange!r}, which takes no earlier statistics (Exchange.takes_prior): "
            f"use exchange='auto', 'gather' or 'reduce', or normalize='micro'"
        )


def _layers_of(model: nn.Module) -> list[SyncBatchNorm]:
    """The synchronized layers of ``model`` the context covers, after its refusals, and one
    warning for the plain BatchNorm layers it cannot reach."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"step_statistics(model) takes the model (an nn.Module, or its DDP/FSDP wrapper), "
            f"got {type(model).__name__}"
        )
    layers, plain = [], []
    for name, module in model.named_modules():
        if isinstance(module, SyncBatchNorm):
            if not module.track_running_stats or module.running_mean is None:
                continue  # no running statistic to defer
            if module._step_stats is not None:
                raise RuntimeError(
                    f"step_statistics: layer {name or type(module).__name__!r} is inside "
                    f"another step_statistics context already: contexts do not nest (one per "
                    f"optimizer step); exit the outer one first"
                )
            layers.append(module)
        elif isinstance(module, _BatchNorm):
            plain.append(name)
    if any(layer.replica_group is not None for layer in layers) or _holds_replicas(model):
        raise ValueError(
            "step_statistics does not take a SyncDataParallel model yet: use "
            "DistributedDataParallel (one process per device) for gradient accumulation"
        )
    if plain:
        warnings.warn(
            f"step_statistics: {len(plain)} BatchNorm layer(s) of the model are not "
            f"SyncBatchNorm (first: {plain[0]!r}) and update their running statistics at every "
            f"micro-batch: convert the model first (syncbn_lightning.convert_sync_batchnorm)",
            stacklevel=5,  # the user's with statement (through open_step and contextlib)
        )
    return layers


def _holds_replicas(model: nn.Module) -> bool:
    """Whether ``model`` is, or holds, an ``nn.DataParallel`` (its replicas share the layers'
    state across threads)."""
    return any(isinstance(module, nn.DataParallel) for module in model.modules())
