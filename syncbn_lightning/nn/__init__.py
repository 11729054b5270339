"""The modules: :class:`~syncbn_lightning.SyncBatchNorm` (:mod:`.batchnorm`, usable wherever
``torch.nn.SyncBatchNorm`` is, with its state between calls in :mod:`.layer_state` and its
argument checks in :mod:`.checks`), :class:`~syncbn_lightning.SyncBatchNormAct`
(:mod:`.batchnorm_act`), the converter and reverter (:mod:`.convert`), the fused residual
tails of ``fuse_residual=True`` (:mod:`.residual`, :mod:`.residual_fx`), ``nn.DataParallel``
support (:mod:`.data_parallel`), PreciseBN (:mod:`.precise_bn`) and running-statistics metrics
(:mod:`.running_stats`). Imports torch only.
"""

# The layer classes and the residual fusion register themselves with the converter when their
# modules are imported.
from . import batchnorm, batchnorm_act, residual  # noqa: F401
