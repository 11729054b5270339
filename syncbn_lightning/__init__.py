"""syncbn_lightning: synchronized BatchNorm for PyTorch (CPU/gloo and GPU/NCCL) and Lightning.

Public API:
    SyncBatchNorm: drop-in for ``torch.nn.SyncBatchNorm`` that also runs on CPU.
    SyncBatchNormAct: SyncBatchNorm + activation fused in its kernels (timm's BatchNormAct2d).
    convert_sync_batchnorm / revert_sync_batchnorm: swap a model's BatchNorm layers and back.
    new_sync_group: split the world into consecutive groups of ranks that normalize together.
    update_bn_stats: PreciseBN, population statistics over real batches.
    SyncDataParallel / join_replicas: nn.DataParallel whose replicas normalize as one batch.
    SyncBNCallback / SyncBNLayerSync: the Lightning callback and plugin (imported on first use,
        so that ``import syncbn_lightning`` does not import Lightning).

The layers below, each importing only from those under it: ``ops`` (kernels, reference, build,
activations) and ``distributed`` (groups, collectives, call order), ``functional`` (the autograd
Function, its options and exchange strategies), ``nn`` (the modules and converter), ``lightning``
(callback and plugin); the training service ``app`` on top.
"""

import importlib
from typing import Any

from . import _legacy
from .distributed.call_order import CallOrderError, check_call_order
from .distributed.groups import new_sync_group
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

__all__ = [
    "SyncBatchNorm",
    "SyncBatchNormAct",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "name_sync_layers",
    "CallOrderError",
    "check_call_order",
    "new_sync_group",
    "BatchNormXd",
    "BatchNormActXd",
    "update_bn_stats",
    "SyncDataParallel",
    "join_replicas",
    "SyncBNCallback",
    "SyncBNLayerSync",
]
# Imported on first use: they need Lightning (the [lightning] extra).
_LIGHTNING_NAMES = {"SyncBNCallback": "callback", "SyncBNLayerSync": "layer_sync"}

_legacy.install()


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_NAMES:
        module = importlib.import_module(f".lightning.{_LIGHTNING_NAMES[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'syncbn_lightning' has no attribute {name!r}")


__version__ = "0.1.0"
