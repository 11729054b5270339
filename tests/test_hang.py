"""A rank that hangs outside any collective (stopped with SIGSTOP): the job ends at the
process-group timeout (``launch.timeout_s``), and its log names each rank's last SyncBN collective
from the ranks' flight records (a stopped process's file is readable)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from test_faults import _children, _descendants, _environ, _kill, _start, _wait_for

TIMEOUT_S = 15  # launch.timeout_s of the job: a collective waits this long for the stopped rank


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_rank_ends_the_job_at_the_timeout_naming_the_ranks_last_syncbn_calls(
    tmp_path: Path,
) -> None:
    run, data = tmp_path / "run", tmp_path / "data"
    job, err = _start(
        run,
        data,
        "trainer.devices=2",
        "trainer.max_epochs=1000",
        f"launch.timeout_s={TIMEOUT_S}",
        # The default group's too (DDP's gradients): rank 1 may be stopped where rank 0's next
        # wait is there rather than in a SyncBN collective.
        f"launch.default_timeout_s={TIMEOUT_S * 3}",
    )
    pids = [job.pid]
    try:
        last = run / "checkpoints" / "last.ckpt"
        assert _wait_for(lambda: last.is_file() or job.poll() is not None, 180), "no checkpoint"
        assert job.poll() is None, err.read_text()[-3000:]
        (rank1,) = (p for p in _children(job.pid) if _environ(p).get("LOCAL_RANK") == "1")
        pids += _descendants(job.pid)
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        code = job.wait(timeout=TIMEOUT_S + 90)
        took = time.monotonic() - stopped
    finally:
        _kill(pids)
    assert code != 0
    assert took < TIMEOUT_S + 60, f"the job took {took:.1f} s to end after rank 1 stopped"
    log = (run / "train.log").read_text()
    report = log[log.index("SyncBN flight recorder") :]
    assert f"({run / '.syncbn'})" in report.splitlines()[0], report[:500]
    assert "rank 0: " in report and "rank 1: " in report, report[:3000]
