"""Synchronized BatchNorm under ``torch.nn.DataParallel``: one process, several devices.

``nn.DataParallel`` copies the module onto each device for every forward (``replicate``) and runs
the copies in threads. Without help each copy's :class:`SyncBatchNorm` would normalize only its own
slice of the batch (torch.distributed is not involved). :class:`SyncDataParallel` joins the copies
of each layer after ``replicate``: they then exchange their statistics inside the process, through
the same autograd path as across processes, with a :class:`ReplicaGroup` in place of the process
group. Per layer call there is one exchange forward (each copy's statistics row) and one backward
(its gradient sums): every copy hands its tensor to the exchange, the last to arrive concatenates
them in replica order on the first copy's device (the master), and each copy takes the result
back to its own device, merges and normalizes. So the replicas normalize as one batch, uneven
slices included, and all compute bitwise the same statistics. Running statistics are updated on
every copy; ``DataParallel`` keeps the first copy's, which share the module's buffers.

The design follows the DataParallel SyncBN of vacancy/Synchronized-BatchNorm-PyTorch (master and
worker copies joined after replication); the statistics themselves are this package's
count-weighted merge.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..distributed.replicas import DEFAULT_TIMEOUT_S, ReplicaExchange, ReplicaGroup
from .batchnorm import SyncBatchNorm

__all__ = ["SyncDataParallel", "join_replicas"]


def join_replicas(replicas: Sequence[nn.Module], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Make the copies of every :class:`SyncBatchNorm` in ``replicas`` (copies of one module, as
    ``nn.DataParallel.replicate`` returns them) synchronize with each other.

    Each copy also gets its own call counters (the copies start equal, so their call-order tags
    agree). Call it on every set of replicas before running them; :class:`SyncDataParallel` does.
    """
    per_replica = [[m for m in r.modules() if isinstance(m, SyncBatchNorm)] for r in replicas]
    if len({len(layers) for layers in per_replica}) > 1:
        raise ValueError("the replicas hold different numbers of SyncBatchNorm layers")
    for copies in zip(*per_replica, strict=True):
        exchange = ReplicaExchange(len(copies), timeout_s)
        for index, layer in enumerate(copies):
            layer.replica_group = ReplicaGroup(exchange, index)
            layer._calls = None
            layer._nonfinite = None


class SyncDataParallel(nn.DataParallel):
    """``torch.nn.DataParallel`` whose replicas synchronize their :class:`SyncBatchNorm` layers.

    Args: those of ``nn.DataParallel`` (``module``, ``device_ids``, ``output_device``, ``dim``).

    Example (on a machine with 2 GPUs)::

        model = SyncDataParallel(convert_sync_batchnorm(model), device_ids=[0, 1])

    Note:
        The replicas normalize as one batch: the statistics of the whole input batch, whatever
        its split over the devices (see the module docstring). On CPU, or with one device,
        ``nn.DataParallel`` runs the module itself and nothing is exchanged.
    """

    def replicate(self, module: nn.Module, device_ids: Sequence[int]) -> list[nn.Module]:
        replicas = super().replicate(module, device_ids)
        join_replicas(replicas)
        return replicas
