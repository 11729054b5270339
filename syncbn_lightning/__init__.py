"""syncbn_lightning: synchronized BatchNorm for PyTorch (CPU/gloo and GPU/NCCL) and Lightning.

Public API:
    SyncBatchNorm: drop-in for ``torch.nn.SyncBatchNorm`` that also runs on CPU.
    SyncBatchNormAct: SyncBatchNorm + activation fused in its kernels (timm's BatchNormAct2d).
    convert_sync_batchnorm / revert_sync_batchnorm: swap a model's BatchNorm layers and back.
    new_sync_group: split the world into consecutive groups of ranks that normalize together.
    update_bn_stats: PreciseBN, population statistics over real batches.
    step_statistics: one running-statistics update per optimizer step (gradient accumulation).
    SyncDataParallel / join_replicas: nn.DataParallel whose replicas normalize as one batch.
    SyncBNCallback / SyncBNLayerSync: the Lightning callback and plugin (the ``[lightning]``
        extra).

Every name is imported on first use (``import syncbn_lightning`` imports neither torch nor
Lightning).

The layers below, each importing only from those under it: ``ops`` (kernels, reference, build,
activations) and ``distributed`` (groups, collectives, call order), ``functional`` (the autograd
Function, its options and exchange strategies), ``nn`` (the modules and converter), ``lightning``
(callback and plugin); the training service ``app`` on top.
"""

import importlib
from typing import TYPE_CHECKING, Any

from . import _legacy, _torch

_torch.check_torch()  # below the supported floor: one ImportError naming both releases

if TYPE_CHECKING:  # what type checkers and the API docs see; at run time, __getattr__ below
    from .distributed.call_order.checks import CallOrderError, check_call_order
    from .distributed.groups import new_sync_group
    from .functional.recompute import RecomputeOrderError
    from .lightning.callback import SyncBNCallback
    from .lightning.layer_sync import SyncBNLayerSync
    from .nn.batchnorm import SyncBatchNorm
    from .nn.batchnorm_act import BatchNormActXd, SyncBatchNormAct
    from .nn.convert import (
        BatchNormXd,
        convert_sync_batchnorm,
        name_sync_layers,
        revert_sync_batchnorm,
    )
    from .nn.data_parallel import SyncDataParallel, join_replicas
    from .nn.precise_bn import update_bn_stats
    from .nn.step_statistics import step_statistics

__all__ = [
    "SyncBatchNorm",
    "SyncBatchNormAct",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "name_sync_layers",
    "CallOrderError",
    "RecomputeOrderError",
    "check_call_order",
    "new_sync_group",
    "BatchNormXd",
    "BatchNormActXd",
    "update_bn_stats",
    "step_statistics",
    "SyncDataParallel",
    "join_replicas",
    "SyncBNCallback",
    "SyncBNLayerSync",
]
# Where each public name lives. They are imported on first use (PEP 562), so that `import
# syncbn_lightning` costs no import of torch (about 2 s): the service's config check runs before
# torch is needed, and a user's `from syncbn_lightning import SyncBatchNorm` imports what it uses.
_WHERE = {
    "SyncBatchNorm": "nn.batchnorm",
    "SyncBatchNormAct": "nn.batchnorm_act",
    "BatchNormActXd": "nn.batchnorm_act",
    "convert_sync_batchnorm": "nn.convert",
    "revert_sync_batchnorm": "nn.convert",
    "name_sync_layers": "nn.convert",
    "BatchNormXd": "nn.convert",
    "CallOrderError": "distributed.call_order.checks",
    "RecomputeOrderError": "functional.recompute",
    "check_call_order": "distributed.call_order.checks",
    "new_sync_group": "distributed.groups",
    "update_bn_stats": "nn.precise_bn",
    "step_statistics": "nn.step_statistics",
    "SyncDataParallel": "nn.data_parallel",
    "join_replicas": "nn.data_parallel",
    # The Lightning extra.
    "SyncBNCallback": "lightning.callback",
    "SyncBNLayerSync": "lightning.layer_sync",
}

_legacy.install()


#: The subpackages, imported on first attribute access too (``syncbn_lightning.ops.build``
#: after a bare ``import syncbn_lightning``, as with an eager package root).
_SUBPACKAGES = frozenset({"app", "distributed", "functional", "lightning", "nn", "ops"})


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'syncbn_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"
