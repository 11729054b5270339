"""Run a function on N real gloo processes and collect what each returns.

Every worker: initializes the default group through a fresh FileStore (no ports), with an explicit
timeout; runs ``fn(rank, world_size, *args)``; sends back the result or its traceback; then
``barrier()`` and ``destroy_process_group()`` (a barrier first: tearing down gloo while a peer is
still in its last collective can abort the process). The parent fails the test if any worker
raises, dies, or does not finish within ``timeout`` seconds, and never leaves processes behind.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import _path_report
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CTX = mp.get_context("spawn")


def _serialize(value: Any) -> bytes:
    """``value`` as torch.save bytes. Tensors put on a torch.multiprocessing queue as they are
    travel as file descriptors that the parent fetches from the worker's resource sharer, which
    is gone once the worker exits (FileNotFoundError under load); bytes need no worker."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _deserialize(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
    pg_timeout_s: float,
) -> None:
    os.environ.update(env)
    _path_report.install()  # (SYNCBN_PATH_REPORT only)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        try:
            out = fn(rank, world_size, *args)
            results.put((rank, "ok", _serialize(out)))
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; results by rank.

    ``fn`` must be importable (defined at module level). Raises ``AssertionError`` naming the
    failing rank with its traceback, or a ``TimeoutError`` if the workers do not all report.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        results = _CTX.Queue()
        procs = [
            _CTX.Process(
                target=_worker,
                args=(r, world_size, init_file, fn, args, env or {}, results, pg_timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        collected: dict[int, Any] = {}
        errors: dict[int, str] = {}
        first_error = datetime.datetime.max
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(collected) + len(errors) < world_size:
                if errors and datetime.datetime.now() > first_error + datetime.timedelta(seconds=3):
                    break  # peers of a failed rank would only wait for the group timeout
                remaining = (deadline - datetime.datetime.now()).total_seconds()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{world_size - len(collected) - len(errors)} of {world_size} workers did "
                        f"not finish {fn.__name__} within {timeout:.0f} s; errors so far: {errors}"
                    )
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead and results.empty():
                        raise AssertionError(
                            f"worker(s) died without reporting: "
                            f"{[(procs.index(p), p.exitcode) for p in dead]}; errors: {errors}"
                        ) from None
                    continue
                if status == "ok":
                    collected[rank] = _deserialize(payload)
                else:
                    errors[rank] = payload
                if status != "ok" and len(errors) == 1:
                    first_error = datetime.datetime.now()
            for p in procs:
                # After a failure the peers may be stuck in a collective (that is what the failing
                # tests show): a few seconds, then they are killed, not the whole timeout.
                remaining = (deadline - datetime.datetime.now()).total_seconds()
                p.join(timeout=5.0 if errors else max(1.0, remaining))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        if errors:
            first = min(errors)
            raise AssertionError(f"rank {first} of {world_size} failed:\n{errors[first]}")
        return [collected[r] for r in range(world_size)]
