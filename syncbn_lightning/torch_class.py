"""Our SyncBatchNorm as a ``torch.nn.SyncBatchNorm`` wherever torch's own can run (layer 2, beside
the module).

Code written for torch recognizes a synchronized BatchNorm by
``isinstance(layer, torch.nn.SyncBatchNorm)``: DDP logs ``has_sync_bn`` from it, and Lightning's
``TorchSyncBatchNorm.revert`` and user code look for it. But DDP also raises "SyncBatchNorm layers
only work with GPU modules" for any CPU module that holds such an instance, which would end
CPU/gloo training. So a layer is an ``nn.SyncBatchNorm`` exactly when its parameters and buffers
are off the CPU: moving it (``.to``, ``.cuda``, ``.cpu``: every ``Module._apply``), constructing it
with a ``device`` or converting a model that lives there sets its class to
:class:`SyncBatchNormOnDevice`, a subclass of both with no code of its own, and back to
:class:`~syncbn_lightning.SyncBatchNorm` on the CPU. The forward, the state_dict and the hyper-
parameters are the same in both classes; ``repr`` prints ``SyncBatchNorm`` for both, while tools
that print ``type(m).__name__`` (Lightning's ModelSummary) show ``SyncBatchNormOnDevice`` on a GPU.
Pickles and ``load_state_dict(assign=True)`` re-check the class: they can put tensors elsewhere.

Subclasses of :class:`~syncbn_lightning.SyncBatchNorm` keep their own class everywhere (switching
it would lose their methods); one that wants the torch identity on GPUs lists
``torch.nn.SyncBatchNorm`` as a second base itself.
"""

from __future__ import annotations

import itertools

from torch import nn

from .batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNormOnDevice", "match_torch_class"]


class SyncBatchNormOnDevice(SyncBatchNorm, nn.SyncBatchNorm):
    """A :class:`~syncbn_lightning.SyncBatchNorm` whose tensors are off the CPU: the same layer,
    and also a ``torch.nn.SyncBatchNorm`` for ``isinstance`` checks (see the module docstring).

    Usually not constructed by hand: a SyncBatchNorm takes this class when it moves to a GPU (or
    is made there) and leaves it when it moves back to the CPU; ``SyncBatchNormOnDevice(...)``
    takes the constructor's arguments and ends up in the class its ``device`` calls for. Its
    forward is ours (first in the MRO), so torch's ``nn.SyncBatchNorm.forward`` never runs.
    """


def match_torch_class(layer: SyncBatchNorm) -> None:
    """Give ``layer`` the class its device calls for: :class:`SyncBatchNormOnDevice` when its first
    parameter or buffer is on a device other than the CPU, else :class:`SyncBatchNorm` (also when
    it has no tensors at all). Subclasses are left as they are."""
    cls = type(layer)
    if cls is not SyncBatchNorm and cls is not SyncBatchNormOnDevice:
        return
    tensors = itertools.chain(layer.parameters(recurse=False), layer.buffers(recurse=False))
    first = next(tensors, None)
    off_cpu = first is not None and first.device.type != "cpu"
    layer.__class__ = SyncBatchNormOnDevice if off_cpu else SyncBatchNorm
