"""The flight recorder (``syncbn_lightning.distributed.flight`` and ``.flight_report``): the ring
buffer, its file (readable by another process, after a kill too), the comparison of ranks'
records, the report a failed collective logs, and ``syncbn-flight``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _dist import run_distributed
from torch import nn

from syncbn_lightning import convert_sync_batchnorm
from syncbn_lightning.distributed.flight import recorder as flight
from syncbn_lightning.distributed.flight.recorder import (
    BACKWARD,
    FORWARD,
    FlightRecord,
    FlightRecorder,
    read_flight_dir,
    read_flight_file,
    read_layer_names,
)
from syncbn_lightning.distributed.flight.report import describe_flight, first_divergence


def _record(rec: FlightRecorder, layer: int, call: int, direction: int = FORWARD) -> None:
    rec.record("1", flight.OP_CODES["all_gather"], direction, 64, layer, call)


def test_the_ring_keeps_the_last_records_in_order() -> None:
    rec = FlightRecorder(capacity=4)
    for i in range(10):
        _record(rec, 100 + i, i)
    kept = rec.records()
    assert [r.seq for r in kept] == [6, 7, 8, 9]
    assert [r.layer_tag for r in kept] == [106, 107, 108, 109]
    assert kept[0].op == "all_gather" and kept[0].direction == "forward" and kept[0].nbytes == 64


def test_call_numbers_count_per_layer() -> None:
    rec = FlightRecorder()
    assert [rec.next_call(7), rec.next_call(7), rec.next_call(8), rec.next_call(7)] == [0, 1, 0, 2]


def test_a_file_backed_ring_is_read_by_another_process_after_a_kill(tmp_path: Path) -> None:
    """The writer is SIGKILLed; its pages stay in the file."""
    script = (
        "import os, sys, signal\n"
        "from syncbn_lightning.distributed.flight import recorder as flight\n"
        "flight.register_layer_name(5, 'net.bn')\n"
        "flight.register_layer_name(6, 'head.bn')\n"
        "rec = flight.FlightRecorder(capacity=8, path=sys.argv[1], rank=1, world=2, job='j')\n"
        "for i in range(11):\n"
        "    rec.record('1', 0, i % 2, 128, 5 + i % 2, i // 2)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    path = tmp_path / "flight_rank1.bin"
    done = subprocess.run([sys.executable, "-c", script, str(path)], check=False)
    assert done.returncode == -signal.SIGKILL
    rank, job, records = read_flight_file(path)
    assert (rank, job) == (1, "j")
    assert [r.seq for r in records] == list(range(3, 11))
    assert records[-1] == records[-1]._replace(
        group="1", op="all_gather", direction="forward", nbytes=128, layer_tag=5, call=5
    )
    assert read_layer_names(tmp_path) == {5: "net.bn", 6: "head.bn"}
    assert read_flight_dir(tmp_path, job="other") == {}
    assert list(read_flight_dir(tmp_path, job="j")) == [1]


def _records(calls: list[tuple[int, int, int]], nbytes: int = 64) -> list[FlightRecord]:
    return [
        FlightRecord("1", seq, "all_gather", ("forward", "backward")[d], nbytes, layer, call, 0.0)
        for seq, (layer, call, d) in enumerate(calls)
    ]


def test_the_first_collective_the_ranks_did_differently_is_named() -> None:
    same = [(1, 0, 0), (2, 0, 0), (2, 0, 1)]
    rank0 = _records([*same, (3, 0, 1), (1, 0, 1)])
    rank1 = _records([*same, (1, 0, 1)])
    (d,) = first_divergence({0: rank0, 1: rank1})
    assert d.seq == 3 and d.agreed == rank0[2]
    assert d.at[0].layer_tag == 3 and d.at[1].layer_tag == 1
    text = describe_flight({0: rank0, 1: rank1}, names={1: "stem", 2: "body", 3: "aux"})
    assert "the ranks agree up to collective 3 (backward all_gather of 'body'" in text
    assert "at collective 4 they differ:" in text
    assert "rank 0: backward all_gather of 'aux' (call #1, 64 B)" in text
    assert "rank 1: backward all_gather of 'stem' (call #1, 64 B)" in text


def test_a_rank_that_stopped_early_is_named_as_not_having_issued_the_next_one() -> None:
    calls = [(1, 0, 0), (2, 0, 0), (2, 0, 1)]
    (d,) = first_divergence({0: _records(calls), 1: _records(calls[:2])})
    assert d.seq == 2 and d.at[1] is None
    text = describe_flight({0: _records(calls), 1: _records(calls[:2])})
    assert "rank 1: has not issued it" in text


def test_ranks_that_agree_report_each_ranks_last_call_and_a_single_rank_its_last_ones() -> None:
    calls = [(1, 0, 0), (2, 0, 0), (2, 0, 1)]
    assert first_divergence({0: _records(calls), 1: _records(calls)}) == []
    text = describe_flight({0: _records(calls), 1: _records(calls)})
    assert (
        "the ranks' SyncBN collectives agree" in text and "rank 1: collective 3, backward" in text
    )
    one = describe_flight({0: _records(calls)}, last=2)
    assert "rank 0's last SyncBN collectives" in one and one.count("of group '1'") == 2


def test_rings_that_wrapped_are_compared_where_both_still_hold_records() -> None:
    """Rank 1 recorded more (its ring dropped more old records): the comparison starts at the
    oldest collective both kept."""
    calls = [(i % 5, i // 5, 0) for i in range(20)]
    rank0, rank1 = _records(calls)[6:], _records(calls)[9:]
    assert first_divergence({0: rank0, 1: rank1}) == []


def test_syncbn_flight_prints_the_divergence_and_exits_1(tmp_path: Path) -> None:
    for rank, last_layer in ((0, 3), (1, 4)):
        rec = FlightRecorder(path=tmp_path / f"flight_rank{rank}.bin", rank=rank, world=2)
        for layer in (1, 2, last_layer):
            _record(rec, layer, 0, BACKWARD)
        rec.close()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from syncbn_lightning.distributed.flight.report import main; "
            f"raise SystemExit(main([{str(tmp_path)!r}]))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert (
        "at collective 3 they differ" in done.stdout
        and "records kept: rank 0: 3, rank 1: 3" in done.stdout
    )


def _killed_peer_worker(rank: int, world: int, directory: str, report: str) -> str:
    """Rank 1 is SIGKILLed before its 4th layer call; rank 0's next collective fails at once and
    its report (every rank's file, read after the kill) names where each rank stopped."""
    handler = logging.FileHandler(report)
    logging.getLogger("syncbn_lightning.distributed.flight.report").addHandler(handler)
    net = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3)))
    for step in range(3):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        net(torch.randn(4, 3))
    return "no error"


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_killed_mid_step_leaves_records_that_name_where_each_rank_stopped(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report.log"
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 0 of 2 failed|died without reporting"):
        run_distributed(
            _killed_peer_worker,
            2,
            str(tmp_path),
            str(report),
            timeout=60,
            pg_timeout_s=30,
            env={"SYNCBN_FLIGHT_DIR": str(tmp_path)},
        )
    assert time.monotonic() - started < 45
    by_rank = read_flight_dir(tmp_path)
    assert [len(by_rank[r]) for r in (0, 1)] == [5, 4]  # rank 1 died before its 5th collective
    text = report.read_text()
    assert "SyncBN flight recorder" in text and "at collective 5 they differ" in text, text
    assert "rank 0: forward all_gather of '0' (call #3" in text, text
    assert "rank 1: has not issued it" in text, text
