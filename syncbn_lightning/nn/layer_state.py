"""What a synchronized layer keeps between calls besides its buffers: its name and call-order
tag, its call and non-finite counters, and the record of its last training batch."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch
from torch import nn

from ..distributed.call_order.checks import register_layer_name, register_order_status
from ..distributed.call_order.policy import queues_order_flags_on
from ..distributed.call_order.tags import TAG_LIMIT, name_tag
from ..distributed.groups import group_name_of
from ..functional.layer_call import BatchRecord  # (its home; pickles name it here)

__all__ = [
    "OPTION_ATTRIBUTES",
    "BatchRecord",
    "SyncCallState",
    "name_sync_layers",
    "option_property",
]

#: Attributes that older versions kept on the layer itself and now live in its SyncOptions.
OPTION_ATTRIBUTES = (
    "momentum",
    "eps",
    "impl",
    "stats_mode",
    "exchange",
    "force_sync",
    "unbiased_running_var",
)


def option_property(name: str, doc: str) -> property:
    """A layer attribute that reads ``sync_options.<name>``; assigning a different value makes new
    (validated) options."""

    def get(self: Any) -> Any:
        return getattr(self.sync_options, name)

    def set_(self: Any, value: Any) -> None:
        current = getattr(self.sync_options, name)
        if value is not current and value != current:
            self.sync_options = self.sync_options.replace(**{name: value})

    return property(get, set_, doc=doc)


log = logging.getLogger("syncbn_lightning")

# Construction order of layers built directly (not by the converter): their call-order tag until
# they get a name. Models built the same way on every rank get the same numbers.
_SERIALS = itertools.count(1)


class SyncCallState:
    """The per-layer state of synchronized calls (a base of
    :class:`~syncbn_lightning.SyncBatchNorm`)."""

    running_mean: torch.Tensor | None  # the BatchNorm buffer, on the layer's device

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
    # Where compiled calls on a device that queues its order flags note them (made on first use).
    _order: torch.Tensor | None = None
    # Inside step_statistics: the step's running-statistics policy (functional/accumulate.py);
    # not state (a pickle or a copy leaves it behind: resuming drops a partial step).
    _step_stats: Any = None

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

    def _name_with_tag(self, name: str, tag: int) -> None:
        """:meth:`set_sync_name` with ``tag`` for the call-order tag instead of the name's hash
        (where two layers of one model would share one: :func:`name_sync_layers`)."""
        self.sync_name = name
        self._named_tag = (name, int(tag) % TAG_LIMIT)
        register_layer_name(self._named_tag[1], name)

    def _number_layer(self) -> None:
        """Give a layer built directly its construction number (its tag until it is named)."""
        self._sync_serial = next(_SERIALS)

    def _tag_of(self, name: str) -> int:
        tag = name_tag(name)
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

    def _place_order_status(self, device: torch.device | None) -> None:
        """Make the layer's call-order status, or move it, onto ``device`` (the layer's, ``None``
        without tensors) when calls there queue their order flags; compiled calls note their
        flags there (:func:`~syncbn_lightning.distributed.call_order.note_order_flag`). Eager
        only (construction, conversion, ``.to()``): a compiled graph can mutate only a tensor
        that existed before it was traced."""
        if device is None or not queues_order_flags_on(device):
            return
        if self._order is None:
            register_order_status(self._order_entry)
        elif self._order.device == device:
            return
        self._order = torch.zeros(3, dtype=torch.float32, device=device)

    def _order_entry(self) -> tuple[torch.Tensor | None, int, Any]:
        """What ``check_call_order`` reads: the status, the layer's tag and group."""
        group = getattr(self, "replica_group", None) or group_name_of(
            getattr(self, "process_group", None)
        )
        return self._order, self.layer_tag, group


def name_sync_layers(module: nn.Module) -> None:
    """Give every :class:`~syncbn_lightning.SyncBatchNorm` in ``module`` its qualified name
    (``sync_name``).

    The name fixes the layer's call-order tag (the same on every rank of the same model) and
    names it in call-order errors. Tags are hashes of the names; where two layers of ``module``
    would share one, the later layer (in module order, the same on every rank) takes the first
    free hash of its name with a salt, so that no two layers of one model share a tag (a DEBUG
    line says which). :func:`convert_sync_batchnorm` calls this; call it yourself for a model
    whose SyncBatchNorm layers you built directly.
    """
    taken: dict[int, str] = {}
    for name, child in module.named_modules():
        if not isinstance(child, SyncCallState):
            continue
        name = name or type(module).__name__
        salt, tag = 0, name_tag(name)
        while taken.get(tag, name) != name:
            salt += 1
            tag = name_tag(name, salt)
        if salt:
            log.debug(
                "SyncBatchNorm layers %r and %r hash to one call-order tag: %r takes tag %d",
                taken[name_tag(name)],
                name,
                name,
                tag,
            )
        taken[tag] = name
        if salt:
            child._name_with_tag(name, tag)
        else:
            child.set_sync_name(name)
