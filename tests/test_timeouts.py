"""Two timeouts (issue 49, item 4): SyncBN's own groups keep the short one (``launch.timeout_s``),
the default group (DDP, Lightning's barriers, rank-0-only work) a long one
(``launch.default_timeout_s``). A job whose rank 0 works alone for longer than the short timeout
while the others wait in a barrier finishes; with one timeout for both (the old setting) the
waiting rank died at the short one. A rank stopped inside a SyncBN collective still ends the job
at the short timeout: ``tests/test_hang.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from test_faults import QUICK, ROOT, _env

from syncbn_lightning.distributed.groups import set_sync_timeout, sync_timeout

SHORT_S = 10


def test_set_sync_timeout_takes_seconds_or_a_timedelta_and_refuses_nonpositive() -> None:
    try:
        set_sync_timeout(12)
        assert sync_timeout() == timedelta(seconds=12)
        set_sync_timeout(timedelta(minutes=1))
        assert sync_timeout() == timedelta(minutes=1)
        with pytest.raises(ValueError, match="timeout must be > 0 seconds"):
            set_sync_timeout(0)
    finally:
        set_sync_timeout(None)


def test_set_sync_timeout_after_the_jobs_groups_exist_raises_naming_the_fix(tmp_path) -> None:
    """Once SyncBN made this job's groups, another timeout would change nothing: it raises.
    The same timeout again is fine, and the next job's groups take a new one."""
    import torch.distributed as dist

    from syncbn_lightning.distributed.groups import sync_world_group

    try:
        for job, first in enumerate((5, 7)):
            store = f"file://{tmp_path}/store{job}"
            dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
            try:
                set_sync_timeout(first)
                twin = sync_world_group()
                set_sync_timeout(first)  # what the groups have: nothing to refuse
                with pytest.raises(RuntimeError, match="before new_sync_group"):
                    set_sync_timeout(30)
                assert sync_timeout() == timedelta(seconds=first)
                assert twin is sync_world_group()
            finally:
                dist.destroy_process_group()
    finally:
        set_sync_timeout(None)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_rank_zero_alone_longer_than_the_short_timeout_does_not_end_the_job(
    tmp_path: Path,
) -> None:
    run, data = tmp_path / "run", tmp_path / "data"
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        *QUICK,
        f"paths.data_dir={data}",
        f"hydra.run.dir={run}",
        "trainer.devices=2",
        "trainer.max_epochs=2",
        "trainer.check_val_every_n_epoch=1",
        f"launch.timeout_s={SHORT_S}",
        "+callbacks.slow._target_=_slow_rank0.SlowRankZeroValidation",
        f"+callbacks.slow.seconds={SHORT_S * 2}",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "final:" in (run / "train.log").read_text()
