"""The service keeps its flight records in the run's folder however it was launched (issue 49,
item 1): by ``torchrun`` (which sets no ``SYNCBN_FLIGHT_DIR``, where the service's own launcher
does), one folder for the node, one file per rank, of one job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_faults import QUICK, ROOT, _env

from syncbn_lightning.distributed.flight.file import jobs_in, read_flight_dir


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_torchrun_job_keeps_every_ranks_records_in_its_run_folder(tmp_path: Path) -> None:
    run, data = tmp_path / "run", tmp_path / "data"
    env = _env()
    env.pop("SYNCBN_FLIGHT_DIR", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(ROOT / "train.py"), *QUICK, f"paths.data_dir={data}", f"hydra.run.dir={run}",
        "trainer.devices=2",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    folder = run / ".syncbn"
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("flight_*rank*.bin"))
    assert [f.split("/")[0] for f in files] == ["node0", "node0"], files  # torchrun's GROUP_RANK
    assert len(jobs_in(folder)) == 1, files
    by_rank = read_flight_dir(folder)
    assert sorted(by_rank) == [0, 1] and all(by_rank.values())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_srun_job_keeps_every_ranks_records_in_its_node_folder(tmp_path: Path) -> None:
    """What ``srun --ntasks=2`` gives each task (its SLURM variables), set by hand: one
    process per rank, each naming its node by ``SLURM_NODEID``."""
    run, data = tmp_path / "run", tmp_path / "data"
    command = [
        sys.executable, str(ROOT / "train.py"), *QUICK, f"paths.data_dir={data}",
        f"hydra.run.dir={run}", "trainer.devices=2",
    ]  # fmt: skip
    tasks = []
    for rank in range(2):
        env = _env()
        env.pop("SYNCBN_FLIGHT_DIR", None)
        env.update(
            SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="3",
            SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="train", SLURM_NODELIST="127.0.0.1",
        )  # fmt: skip
        out = open(tmp_path / f"task{rank}.log", "w")
        tasks.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out), out))
    try:
        codes = [task.wait(timeout=400) for task, _ in tasks]
    finally:
        for task, out in tasks:
            if task.poll() is None:
                task.kill()
            out.close()
    logs = "".join((tmp_path / f"task{r}.log").read_text()[-2000:] for r in range(2))
    assert codes == [0, 0], logs
    folder = run / ".syncbn"
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("flight_*rank*.bin"))
    assert [f.split("/")[0] for f in files] == ["node3", "node3"], (files, logs)
    assert sorted(read_flight_dir(folder)) == [0, 1]
