"""SyncBN's load on a job's store: what the call-order watchers of many ranks ask one TCPStore.

    python benchmarks/store_load.py [--ranks 1024] [--groups 1] [--seconds 30]

One real ``TCPStore`` server in this process and ``--ranks`` client connections to it, each
standing for one rank's watcher (``distributed/call_order/watcher.py``) of a job whose calls
queue their order flags (CUDA), with ``--groups`` SyncBN groups per rank, while no mismatch is
published (the steady state):

* ``before``: the watchers before the job object (fcb894c): one thread and one connection per
  group, each asking ``check`` of its group's key every 0.2 s. Its loop is replicated here (two
  lines: wait 0.2 s, check);
* ``now``: the job's watcher itself (``group_abort._Watcher`` and its thread, ``_watch``), one per
  rank for all of its groups, with the module's ``CHECK_S`` and ``LIVE_S``.

Each connection counts its requests (a proxy around it) for ``--seconds`` after every watcher
started; prints one markdown row per design: threads, requests/s for the whole job (measured, and
nominal: connections / period) and per rank. On the 2-core VM 4,096 connections (1,024 ranks x 4
groups, "before") did not finish connecting within 300 s; 1,024 x 1 and 200 x 4 run
(benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from syncbn_lightning.distributed.call_order import watcher as group_abort

_OLD_POLL_S = 0.2  # group_abort.POLL_S at fcb894c


class Counting:
    """A store connection that counts its requests."""

    def __init__(self, connection: Any) -> None:
        self.connection, self.requests = connection, 0

    def check(self, keys: list[str]) -> bool:
        self.requests += 1
        return self.connection.check(keys)

    def get(self, key: str) -> bytes:
        self.requests += 1
        return self.connection.get(key)


def _old_watch(connection: Counting, key: str, stop: threading.Event) -> None:
    """The per-group watcher's loop before the job object (fcb894c's ``_watch``, the job-liveness
    check aside: it asked torch, not the store)."""
    while not stop.wait(_OLD_POLL_S):
        if connection.check([key]):
            return


def _connect(port: int) -> Counting:
    return Counting(
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    )


def run_before(port: int, ranks: int, groups: int, seconds: float) -> tuple[int, int]:
    """(threads, requests) of the per-group watchers over ``seconds``."""
    stop = threading.Event()
    connections = [_connect(port) for _ in range(ranks * groups)]
    threads = [
        threading.Thread(target=_old_watch, args=(c, f"syncbn/abort/{i % groups}", stop))
        for i, c in enumerate(connections)
    ]
    for thread in threads:
        thread.start()
    start = sum(c.requests for c in connections)
    time.sleep(seconds)
    done = sum(c.requests for c in connections) - start
    stop.set()
    for thread in threads:
        thread.join()
    return len(threads), done


def run_now(port: int, ranks: int, groups: int, seconds: float) -> tuple[int, int]:
    """(threads, requests) of the job watchers (the package's own) over ``seconds``."""
    watchers = []
    for rank in range(ranks):
        job = SimpleNamespace(
            id=f"bench-{rank}", is_current=lambda: True, published=set(), signalled={}
        )
        watcher = group_abort._Watcher(job, _connect(port))  # type: ignore[arg-type]
        watcher.groups = frozenset(str(g) for g in range(groups))
        watchers.append((watcher, watcher.connection))
    for watcher, _ in watchers:
        watcher.start()
    time.sleep(group_abort.LIVE_S)  # every watcher asked once, at its start
    start = sum(c.requests for _, c in watchers)
    time.sleep(seconds)
    done = sum(c.requests for _, c in watchers) - start
    for watcher, _ in watchers:
        watcher.stop_event.set()
    for watcher, _ in watchers:
        watcher.stop()
    return ranks, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--groups", type=int, default=1, help="SyncBN groups per rank")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    rows = [
        ("before (fcb894c: a thread per group, check every 0.2 s)", run_before, _OLD_POLL_S),
        (
            f"now (one job watcher per rank, check every {group_abort.CHECK_S:g} s)",
            run_now,
            group_abort.CHECK_S,
        ),
    ]
    print(
        f"{args.ranks} simulated ranks x {args.groups} SyncBN group(s), one TCPStore, "
        f"{args.seconds:g} s each, no mismatch published\n"
    )
    print("| watchers | threads | requests/s, job | nominal | requests/s per rank |")
    print("|---|---:|---:|---:|---:|")
    for name, run, period in rows:
        threads, requests = run(server.port, args.ranks, args.groups, args.seconds)
        rate = requests / args.seconds
        per_connection_groups = args.groups if run is run_before else 1
        nominal = args.ranks * per_connection_groups / period
        print(f"| {name} | {threads} | {rate:,.0f} | {nominal:,.0f} | {rate / args.ranks:.3f} |")


if __name__ == "__main__":
    main()
