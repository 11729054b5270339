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

import threading
from collections.abc import Sequence

import torch
from torch import nn

from .batchnorm import SyncBatchNorm

__all__ = ["ReplicaExchange", "ReplicaGroup", "SyncDataParallel", "join_replicas"]

DEFAULT_TIMEOUT_S = 300.0


class ReplicaExchange:
    """An all-gather among the ``size`` copies of one layer, run in threads of one process.

    Calls come in rounds: a round completes when every copy has handed in its tensor (copies of a
    layer call it in the same order: forward, then backward). A copy that waits longer than
    ``timeout_s`` for the others raises instead of hanging (a replica failed or skipped the
    layer).
    """

    def __init__(self, size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if size < 1:
            raise ValueError(f"an exchange needs at least one replica, got size={size}")
        self.size = size
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._round = 0
        self._slots: list[torch.Tensor | None] = [None] * size
        self._arrived = 0
        self._result: torch.Tensor | None = None

    def all_gather(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """Every copy's 1-D ``tensor`` concatenated in replica order, on ``tensor``'s device."""
        with self._cond:
            round_ = self._round
            self._slots[index] = tensor
            self._arrived += 1
            if self._arrived == self.size:
                master = self._slots[0]
                assert master is not None
                self._result = torch.cat([t.to(master.device) for t in self._slots])  # type: ignore[union-attr]
                self._slots = [None] * self.size
                self._arrived = 0
                self._round += 1
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: self._round != round_, self.timeout_s):
                raise RuntimeError(
                    f"SyncBatchNorm replica {index}: the other DataParallel replicas did not reach "
                    f"this layer within {self.timeout_s:g} s ({self._arrived} of {self.size} "
                    f"arrived); a replica failed or skipped the layer"
                )
            result = self._result
        assert result is not None
        # The next round needs this copy too, so the result cannot be replaced before this read.
        return result.to(tensor.device)


class ReplicaGroup:
    """What a layer copy synchronizes through under DataParallel: its exchange and its index."""

    def __init__(self, exchange: ReplicaExchange, index: int) -> None:
        self.exchange = exchange
        self.index = index
        self.size = exchange.size

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.exchange.all_gather(tensor, self.index)


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
