"""The in-process exchange of ``nn.DataParallel`` replicas: an all-gather among threads.

``nn.DataParallel`` runs copies of the module on several devices in threads of one process. The
copies of each synchronized layer exchange their statistics through a :class:`ReplicaExchange`
(one per layer), each holding a :class:`ReplicaGroup` (the exchange and its own index) where a
process group would be: every copy hands its tensor in, the last to arrive concatenates them in
replica order on the first copy's device (the master), and each copy takes the result back to its
own device. :mod:`syncbn_lightning.nn.data_parallel` joins the copies after ``replicate``.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["DEFAULT_TIMEOUT_S", "ReplicaExchange", "ReplicaGroup"]

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
