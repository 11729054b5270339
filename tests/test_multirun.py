"""Layer 7: a multirun (``python train.py -m ...``) validates every job's config before the first
job starts (``syncbn_lightning.app.config.ValidateJobs``, a Hydra callback).

The command line is run as users run it (a subprocess); a sweep with one bad combination must fail
at once with the one-line error the single job would give, having trained and written nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _service import RENDEZVOUS_VARS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("sweep", "bad"),
    [
        (["bn.group_size=1,3"], "bn.group_size=3: group_size=3 means 3 ranks per sync group, "),
        # Each value is fine alone: only the combination devices=2, group_size=4 is not.
        (["trainer.devices=2,4", "bn.group_size=2,4"], "bn.group_size=4: "),
    ],
    ids=["one_key", "combination"],
)
@pytest.mark.slow
def test_bad_combination_fails_before_the_first_job(
    tmp_path: Path, sweep: list[str], bad: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "trainer=cpu",
            *sweep,
            f"paths.data_dir={tmp_path / 'data'}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,  # a stray multirun/ or outputs/ would land here
        env={**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}"), proc.stderr[-3000:]
    assert "world size 2 " in lines[0]
    assert "Launching" not in proc.stdout  # Hydra's sweeper never started a job
    assert list(tmp_path.iterdir()) == [], "a multirun that fails its check writes nothing"
