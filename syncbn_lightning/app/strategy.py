"""The service's DDP strategy: one timeout for the start of the job, two for its collectives.

A process-group timeout serves twice in torch: how long ``init_process_group`` waits for every
rank at the rendezvous, and how long each collective waits afterwards. They want different values:
ranks start in seconds to minutes (imports on a busy machine, a node that boots later). And the
collectives themselves are of two kinds: SyncBN's, every layer of every step, where every rank is
always at most a layer apart (a short timeout bounds a hung job), and those of the default group
(DDP's gradients, Lightning's barriers and broadcasts), where a healthy job can make every other
rank wait for minutes while rank 0 alone evaluates COCO, writes a checkpoint or prepares data.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.distributed_c10d import _set_pg_timeout
from typing_extensions import override

from syncbn_lightning.distributed.groups import set_sync_timeout

__all__ = ["TimedDDPStrategy"]


class TimedDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose ``timeout`` covers the rendezvous only: once the process
    group is up, the default group's collectives time out after ``collective_timeout`` and those
    of SyncBN's own groups (made after this) after ``sync_timeout``.

    Args:
        collective_timeout: the default group's timeout after the rendezvous
            (``launch.default_timeout_s``).
        sync_timeout: SyncBN's groups' (``launch.timeout_s``).
        **kwargs: ``DDPStrategy``'s, ``timeout`` being the rendezvous's
            (``launch.start_timeout_s``).
    """

    def __init__(
        self, collective_timeout: timedelta, sync_timeout: timedelta, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.collective_timeout, self.sync_timeout = collective_timeout, sync_timeout

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        # torch's private setter (public since 2.2 as torch.distributed.distributed_c10d's
        # _set_pg_timeout; no public equivalent): the only way to change a live group's timeout.
        _set_pg_timeout(self.collective_timeout)
        set_sync_timeout(self.sync_timeout)
