"""Comparing the ranks' flight records (:mod:`.flight`): where their SyncBN collectives parted.

:func:`first_divergence` finds, per process group, the first collective the ranks recorded
differently, or the first one some rank has not issued (where the others wait);
:func:`describe_flight` says it in a few lines; :func:`report_once` logs that once per job
(:func:`.flight.report_failure` gathers the records: the library calls it when one of its
collectives fails or a call-order check fails, the service when a job fails); :func:`main` is
``syncbn-flight``, the same from the files after the fact. No torch: ``syncbn-flight`` runs in a
fraction of a second.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from .file import FlightRecord, jobs_in, read_flight_dir, read_layer_names

__all__ = [
    "Divergence",
    "describe_flight",
    "first_divergence",
    "main",
    "report_directory",
    "report_once",
    "reset_report",
]

log = logging.getLogger(__name__)


class Divergence(NamedTuple):
    """Where the ranks of one group parted (see :func:`first_divergence`)."""

    group: str
    #: the last collective every rank did the same (``None``: none in the records kept).
    agreed: FlightRecord | None
    #: the first collective number at which they differ, and what each rank did there
    #: (``None`` for a rank that never issued it).
    seq: int
    at: dict[int, FlightRecord | None]


def first_divergence(by_rank: Mapping[int, Iterable[FlightRecord]]) -> list[Divergence]:
    """For each group, the first collective the ranks recorded differently, or, where none differ
    in the records kept, the first one some rank has not issued (where the others wait).

    A group's members are the ranks with records of it. Groups whose ranks all stopped at the
    same collective, doing the same, are left out.
    """
    groups: dict[str, dict[int, dict[int, FlightRecord]]] = {}
    for rank, records in by_rank.items():
        for r in records:
            groups.setdefault(r.group, {}).setdefault(rank, {})[r.seq] = r
    out = []
    for group, ranks in sorted(groups.items()):
        start = max(min(seqs) for seqs in ranks.values())  # the oldest seq every rank still has
        end = max(max(seqs) for seqs in ranks.values())
        agreed = None
        for seq in range(start, end + 1):
            at = {rank: seqs.get(seq) for rank, seqs in sorted(ranks.items())}
            keys = {None if r is None else r.key() for r in at.values()}
            if len(keys) > 1:
                out.append(Divergence(group, agreed, seq, at))
                break
            agreed = next(iter(at.values()))
    return out


def describe_flight(
    by_rank: Mapping[int, list[FlightRecord]],
    last: int = 3,
    names: Mapping[int, str] | None = None,
) -> str:
    """A few lines on ``by_rank`` (every rank's records, or only this rank's): per group, the last
    collective the ranks agreed on and the first at which they differ; with one rank's records,
    its last ``last`` collectives. Layers are named from ``names`` (tag -> name, e.g.
    :func:`read_layer_names`) or this process's."""
    if not by_rank or not any(by_rank.values()):
        return "no SyncBN collective was recorded"
    if len(by_rank) == 1:
        rank, records = next(iter(by_rank.items()))
        lines = [f"rank {rank}'s last SyncBN collectives (the other ranks' are not at hand):"]
        lines += [
            f"  collective {r.seq + 1} of group {r.group!r}: {r.what(names)}"
            for r in records[-last:]
        ]
        return "\n".join(lines)
    lines = []
    for d in first_divergence(by_rank):
        head = f"group {d.group!r}: "
        if d.agreed is not None:
            head += (
                f"the ranks agree up to collective {d.agreed.seq + 1} ({d.agreed.what(names)}); "
            )
        head += f"at collective {d.seq + 1} they differ:"
        lines.append(head)
        for rank, r in d.at.items():
            did = r.what(names) if r is not None else "has not issued it (it is elsewhere, or dead)"
            lines.append(f"  rank {rank}: {did}")
    if not lines:
        ends = {rank: records[-1] for rank, records in by_rank.items() if records}
        lines.append("the ranks' SyncBN collectives agree; each rank's last one:")
        lines += [
            f"  rank {rank}: collective {r.seq + 1}, {r.what(names)}"
            for rank, r in sorted(ends.items())
        ]
    return "\n".join(lines)


_reported = False


def reset_report() -> None:
    """Let the next failure be reported again (a new job in this process, or a test)."""
    global _reported
    _reported = False


def report_once(
    reason: str,
    by_rank: dict[int, list[FlightRecord]],
    names: Mapping[int, str],
    directory: str | os.PathLike[str] | None = None,
) -> str | None:
    """Log (ERROR, once per job: until :func:`reset_report`) what ``by_rank``, the ranks'
    records, say after ``reason`` failed; ``directory``: where they were read from. Returns the
    text (``None`` when already reported or nothing was recorded)."""
    global _reported
    if _reported or not any(by_rank.values()):
        return None
    _reported = True
    where = f" ({directory})" if directory else ""
    text = f"SyncBN flight recorder{where} after {reason}:\n{describe_flight(by_rank, 3, names)}"
    log.error("%s", text)
    return text


def report_directory(reason: str, directory: str | os.PathLike[str]) -> str | None:
    """:func:`report_once` of the latest job's records in ``directory`` (a process that holds
    no recorder of its own: the service's launcher, after a rank failed)."""
    jobs = jobs_in(directory)
    if not jobs:
        return None
    names = read_layer_names(directory, jobs[-1])
    return report_once(reason, read_flight_dir(directory, jobs[-1]), names, directory)


def main(argv: list[str] | None = None) -> int:
    """``syncbn-flight DIR``: what the ranks' flight records in ``DIR`` (a job's ``.syncbn``
    folder, or ``$SYNCBN_FLIGHT_DIR``) say, readable after every process of the job is gone,
    killed ones included. Exit status 1 if the ranks differ, 2 if there are no records."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="syncbn-flight",
        description="Where the ranks' SyncBN collectives parted, from their flight records.",
    )
    parser.add_argument(
        "directory", help="a flight folder (a job's .syncbn), with its node folders"
    )
    parser.add_argument("--last", type=int, default=3, help="collectives shown per rank")
    parser.add_argument(
        "--job", default=None, help="the job whose records to read (default: the latest written)"
    )
    args = parser.parse_args(argv)
    jobs = jobs_in(args.directory)
    job = args.job if args.job is not None else (jobs[-1] if jobs else None)
    by_rank = read_flight_dir(args.directory, job) if job is not None else {}
    if not by_rank:
        print(f"no SyncBN flight records (flight_*rank*.bin) of a job in {args.directory}")
        return 2
    names = read_layer_names(args.directory, job)
    if len(jobs) > 1:
        print(f"job {job!r} (the folder holds {len(jobs)} jobs; --job picks another)")
    print(describe_flight(by_rank, args.last, names))
    ranks = ", ".join(f"rank {rank}: {len(records)}" for rank, records in sorted(by_rank.items()))
    print(f"(records kept: {ranks})")
    return 1 if first_divergence(by_rank) and len(by_rank) > 1 else 0
