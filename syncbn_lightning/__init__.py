"""syncbn_lightning: synchronized BatchNorm for PyTorch (CPU/gloo and GPU/NCCL) and Lightning.

Public API:
    SyncBatchNorm: drop-in for ``torch.nn.SyncBatchNorm`` that also runs on CPU.
    convert_sync_batchnorm / revert_sync_batchnorm: swap a model's BatchNorm layers and back.
    new_sync_group: split the world into consecutive groups of ranks that normalize together.
"""

from .batchnorm import SyncBatchNorm
from .convert import BatchNormXd, convert_sync_batchnorm, revert_sync_batchnorm
from .groups import new_sync_group

__all__ = [
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "new_sync_group",
    "BatchNormXd",
]
__version__ = "0.1.0"
