"""The service's DDP strategy: one timeout for the start of the job, another for its collectives.

A process-group timeout serves twice in torch: how long ``init_process_group`` waits for every
rank at the rendezvous, and how long each collective waits afterwards. They want different values:
ranks start in seconds to minutes (imports on a busy machine, a node that boots later), while a
collective of a healthy job waits seconds, so its timeout is what bounds a hung job.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.distributed_c10d import _set_pg_timeout
from typing_extensions import override

__all__ = ["TimedDDPStrategy"]


class TimedDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose ``timeout`` covers the rendezvous only: once the process
    group is up, its collectives (and those of every group made from it, SyncBN's included) time
    out after ``collective_timeout``.

    Args:
        collective_timeout: the timeout of every collective after the rendezvous
            (``launch.timeout_s``).
        **kwargs: ``DDPStrategy``'s, ``timeout`` being the rendezvous's
            (``launch.start_timeout_s``).
    """

    def __init__(self, collective_timeout: timedelta, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.collective_timeout = collective_timeout

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        # torch's private setter (public since 2.2 as torch.distributed.distributed_c10d's
        # _set_pg_timeout; no public equivalent): the only way to change a live group's timeout.
        _set_pg_timeout(self.collective_timeout)
