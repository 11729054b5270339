"""Every collective call of the library, in one place.

A synchronized layer call issues exactly two: the forward exchange (:func:`all_gather` of each
rank's row, or :func:`all_reduce` of each rank's sums, as the layer's exchange strategy says) and
the backward one (:func:`sum_over_group`). Compiled code and CUDA-graph capture take torch's
functional collectives (``torch.ops._c10d_functional``), which ``torch.compile`` traces into the
graph, addressing the group by its name (:func:`~.groups.group_name_of`). Two other ways:

* a :class:`~.replicas.ReplicaGroup` (the replicas of ``nn.DataParallel``, threads of one process)
  in place of a group name exchanges in-process;
* eager calls (not compiling, not capturing a CUDA graph on NCCL) call the process group's own
  methods (``ProcessGroup._allgather_base`` / ``allreduce`` with options made once), skipping
  ``torch.distributed``'s Python wrappers: on a gloo group with CUDA tensors (two ranks sharing
  one GPU, where NCCL refuses) torch 2.11's functional collectives kill the process (SIGSEGV),
  and on NCCL and gloo alike an eager functional collective costs several times the host time of
  the process group's own method (measured: ``benchmarks/RESULTS.md``, "GPU: the eager step
  profiled" and "CPU: host cost of one layer, before and after the eager collectives change").

The eager helpers at the end (:func:`gather_rows`, :func:`all_reduce_`) serve the measurements and
maintenance around training (monitoring, PreciseBN, reconciliation of running statistics), which
run outside any compiled graph.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._compat import put_back_backward_context, take_backward_context, use_count
from .._shared import GATHER_SUM_MAX_RANKS
from . import job  # noqa: F401  (importing it registers the exit handler: the job ends, then the drain)
from .flight import recorder as flight
from .replicas import ReplicaGroup

__all__ = [
    "GATHER_SUM_MAX_RANKS",
    "Group",
    "Note",
    "all_gather",
    "all_gather_single",
    "all_reduce",
    "all_reduce_",
    "backend_for_device",
    "gather_rows",
    "gather_sums_up_to",
    "group_ranks",
    "on_failure",
    "process_group",
    "report_collective_failure",
    "sum_over_group",
    "sums_gathered",
]

#: Where a layer call's collectives go: a process group's name, the replicas of a DataParallel
#: layer, or ``None`` (no torch.distributed: nothing to communicate).
Group = str | ReplicaGroup | None
#: What the flight recorder notes of a layer's collective: ``(direction, layer_tag, call)``, see
#: :mod:`.flight` (``call`` -1: not recorded, e.g. while compiling).
Note = tuple[int, int, int]

_functional = torch.ops._c10d_functional
#: The longest a gloo collective waits for its worker to let go of its tensors (:func:`_run`).
_RELEASE_WAIT_S = 1.0
# How long it looks again at once (the worker lets go microseconds after the wait ends), then how
# long it sleeps between looks (the worker may be off the CPU on a busy machine).
_RELEASE_SPIN_S = 2e-5
_RELEASE_POLL_S = 5e-5

log = logging.getLogger(__name__)
# The options of the eager calls, made once: ProcessGroup methods take them as they are.
_GATHER_OPTIONS: Any = None
_SUM_OPTIONS: Any = None
if dist.is_available():
    from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions

    _GATHER_OPTIONS = AllgatherOptions()
    _SUM_OPTIONS = AllreduceOptions()  # reduceOp SUM, the default


def all_gather(
    tensor: torch.Tensor, group: Group, world_size: int, note: Note | None = None
) -> torch.Tensor:
    """Every rank's 1-D ``tensor`` concatenated in rank order (``[world_size * numel]``): ONE
    collective, recorded with ``note`` (:mod:`.flight`). ``tensor`` itself without a group."""
    if group is None:
        return tensor
    if not isinstance(group, str):  # the replicas of nn.DataParallel: an in-process exchange
        return group.all_gather(tensor)
    if note is not None:
        flight.record(group, "all_gather", tensor, note)
    if torch.compiler.is_compiling():
        return _functional.wait_tensor(
            _functional.all_gather_into_tensor(tensor, world_size, group)
        )
    process_group = _eager_group(tensor, group)
    try:  # not a context manager: its generator costs a few us of host time per call
        if process_group is None:
            return _functional.wait_tensor(
                _functional.all_gather_into_tensor(tensor, world_size, group)
            )
        gathered = tensor.new_empty(world_size * tensor.numel())
        _run(process_group, process_group._allgather_base, (gathered, tensor, _GATHER_OPTIONS))
        return gathered
    except RuntimeError as exc:
        _report(exc, "all_gather", group)
        raise


def all_reduce(
    tensor: torch.Tensor, group: str | None, note: Note | None = None, in_place: bool = False
) -> torch.Tensor:
    """``tensor`` summed over the group: ONE all-reduce, recorded with ``note`` (``tensor`` itself
    without a group). Into a new tensor, unless ``in_place``: then an eager call may sum into
    ``tensor`` itself (the caller never reads it again; saves a copy per call)."""
    if group is None:
        return tensor
    if note is not None:
        flight.record(group, "all_reduce", tensor, note)
    if torch.compiler.is_compiling():
        return _functional.wait_tensor(_functional.all_reduce(tensor, "sum", group))
    process_group = _eager_group(tensor, group)
    try:
        if process_group is None:
            return _functional.wait_tensor(_functional.all_reduce(tensor, "sum", group))
        summed = tensor if in_place else tensor.clone()
        _run(process_group, process_group.allreduce, ([summed], _SUM_OPTIONS))
        return summed
    except RuntimeError as exc:
        _report(exc, "all_reduce", group)
        raise


def _run(process_group: Any, method: Any, args: tuple[Any, ...]) -> None:
    """Issue the collective ``method(*args)`` of ``process_group``, wait for it, and on gloo also
    until the group's worker thread has let go of its tensors.

    A gloo worker thread releases a finished work after the waiting caller has moved on. What it
    releases last must not need the GIL: if that happens after the interpreter began to finalize,
    CPython ends the thread inside the work's noexcept destructor and the process aborts
    ("terminate called without an active exception"; docs/reliability.md). Two things in a work
    would: the Python object torch's backward stashes in the thread's state, which the work copies
    (set aside while issuing, :func:`~syncbn_lightning._compat.take_backward_context`; the C++ path
    sets aside every stashed object, ``layer_comm.cpp``), and a tensor whose Python object
    the caller dropped while the work still held it (torch then hands the Python object to the
    tensor). So on gloo the call returns once the work's tensors are back to their holders before
    the call (usually at once: the worker lets go microseconds after the wait ends; at most
    :data:`_RELEASE_WAIT_S`). NCCL's works are released by its watchdog, much later: not waited
    for.
    """
    tensors = [arg for arg in _flat(args) if isinstance(arg, torch.Tensor)]
    holders = [use_count(tensor) for tensor in tensors]
    aside = take_backward_context()
    try:
        work = method(*args)
    finally:
        put_back_backward_context(aside)
    work.wait()
    del work
    if tensors and _on_gloo(dist.get_backend_config(process_group), tensors[0].device.type):
        _until_released(tensors, holders)


@functools.lru_cache(maxsize=64)
def _on_gloo(config: str, device: str) -> bool:
    """Whether a group whose ``get_backend_config`` is ``config`` runs ``device``'s collectives
    on gloo (a ``name()`` of ``"nccl"`` may still send CPU tensors to gloo)."""
    return backend_for_device(config, device) == "gloo"


def backend_for_device(config: str, device: str) -> str | None:
    """The backend a group whose ``get_backend_config`` is ``config`` (``"gloo"``, ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``) runs ``device``'s (a device type) collectives on; ``None`` where
    it has none for that device."""
    if ":" not in config:
        return config
    return dict(part.split(":", 1) for part in config.split(",")).get(device)


def _flat(args: tuple[Any, ...]) -> list[Any]:
    """``args`` with its lists (a collective's tensor lists) spread out."""
    return [item for arg in args for item in (arg if isinstance(arg, list) else [arg])]


def _until_released(tensors: list[torch.Tensor], holders: list[int]) -> None:
    """Wait until each of ``tensors`` has no more holders than ``holders`` says (the C++
    references; ``None`` where torch cannot count them: no wait), yielding the CPU, for at most
    :data:`_RELEASE_WAIT_S` in all."""
    deadline = 0.0
    for tensor, count in zip(tensors, holders, strict=True):
        while count is not None and use_count(tensor) > count:
            now = time.monotonic()
            if not deadline:  # the worker is usually microseconds away: look again before sleeping
                deadline = now + _RELEASE_WAIT_S
                spin_until = now + _RELEASE_SPIN_S
                while use_count(tensor) > count and time.monotonic() < spin_until:
                    pass
            elif now > deadline:
                log.warning(
                    "SyncBN: gloo's worker still held a collective's tensors %.1f s after it "
                    "finished (%d holders, %d expected); going on. If the process exits now, "
                    "the worker may release them after Python finalized (docs/reliability.md)",
                    _RELEASE_WAIT_S,
                    use_count(tensor),
                    count,
                )
                return
            else:
                time.sleep(_RELEASE_POLL_S)


def _report(exc: RuntimeError, op: str, group: Group) -> None:
    """Log a failed collective, then run the failure checks on its ``group`` (the call-order
    check raises the CallOrderError another rank published, where that is why it failed); the
    caller re-raises ``exc`` otherwise."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    report_collective_failure(op, first[:200])
    if isinstance(group, str):
        for check in _failure_checks:
            check(group)


#: Run with a failed collective's group before its error propagates (:func:`on_failure`).
_failure_checks: list[Callable[[str], None]] = []


def on_failure(check: Callable[[str], None]) -> None:
    """Run ``check(group)`` when a collective of ``group`` fails, before its error propagates
    (``check`` may raise an error that says why it failed: :mod:`.call_order` registers the
    published mismatch's)."""
    if check not in _failure_checks:
        _failure_checks.append(check)


def report_collective_failure(op: str, reason: str) -> None:
    """Log what the flight recorder knows when a SyncBN collective ``op`` failed with ``reason``
    (a peer died, the transport refused, the process-group timeout); the caller lets the error
    propagate (the C++ path too: ``syncbn::collective_failed``)."""
    flight.report_failure(f"a failed SyncBN {op} ({reason})")


def sum_over_group(
    sums: torch.Tensor,
    group: Group,
    world_size: int,
    note: Note | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """The backward's ``sums`` of every rank of the group, ONE collective: all-reduced (``[2C]``),
    or all-gathered (``[W * 2C]``, rows to be summed in rank order by the caller) in process
    (DataParallel replicas) and on CPU in groups of up to :data:`GATHER_SUM_MAX_RANKS` ranks.

    gloo's all_gather of a few KB has the lower latency and a much shorter tail than its
    all_reduce (measured on 2 ranks: ``benchmarks/RESULTS.md``), and the fixed summation order
    makes the result bitwise identical on every rank. Large groups and CUDA tensors (NCCL) use
    all_reduce, in place when ``in_place`` (see :func:`all_reduce`).
    """
    if group is None:
        return sums
    in_process = not isinstance(group, str)
    if in_process or sums_gathered(sums.device.type, world_size):
        return all_gather(sums, group, world_size, note)
    return all_reduce(sums, group, note, in_place)


def sums_gathered(device_type: str, world_size: int) -> bool:
    """Whether a process group of ``world_size`` ranks on ``device_type`` exchanges sums (the
    backward's, the reduce exchange's) by all_gather, summed in rank order by the caller, rather
    than all_reduce: CPU groups of up to :data:`GATHER_SUM_MAX_RANKS` ranks (the C++ path's twin:
    ``sum_over_group`` in ``csrc/layer/layer_comm.cpp``; :func:`gather_sums_up_to` changes the
    limit for tests)."""
    return device_type == "cpu" and world_size <= _gather_sum_max_ranks


#: sums_gathered's limit (GATHER_SUM_MAX_RANKS, unless a test switched it).
_gather_sum_max_ranks = GATHER_SUM_MAX_RANKS


@contextlib.contextmanager
def gather_sums_up_to(ranks: int) -> Iterator[None]:
    """A test switch: CPU groups all-gather their sums only up to ``ranks`` ranks (0: never), on
    both paths, so that the all-reduce branch CUDA groups take runs on CPU tensors; restored on
    exit. For tests and benchmarks; the layers' results differ only in the summation order.

    Raises:
        RuntimeError: when the extension is not loaded (its C++ path keeps its own copy of the
            limit): call ``syncbn_lightning.ops.build.load_extension()`` first.
    """
    global _gather_sum_max_ranks
    if not hasattr(torch.ops.syncbn, "set_gather_sum_max_ranks"):
        raise RuntimeError(
            "gather_sums_up_to: load the extension first (syncbn_lightning.ops.build"
            ".load_extension()), so that the C++ path's limit is switched too"
        )
    before = _gather_sum_max_ranks
    _gather_sum_max_ranks = ranks
    torch.ops.syncbn.set_gather_sum_max_ranks(ranks)
    try:
        yield
    finally:
        _gather_sum_max_ranks = before
        torch.ops.syncbn.set_gather_sum_max_ranks(before)


def _eager_group(tensor: torch.Tensor, group_name: str) -> Any:
    """The process group ``group_name``, whose methods an eager call (not compiling) invokes
    directly; ``None`` while a CUDA graph is being captured on a group other than gloo (graphs
    take the functional collectives). See the module docstring for why."""
    group = process_group(group_name)
    if tensor.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return group
    return group if dist.get_backend(group) == "gloo" else None


def group_ranks(group: Group, world_size: int) -> list[int]:
    """The global ranks of ``group`` (for messages); ``0..world_size-1`` without a process group
    (DataParallel replicas: their indices)."""
    if not isinstance(group, str) or not dist.is_initialized():
        return list(range(world_size))
    return list(dist.get_process_group_ranks(process_group(group)))


def process_group(name: str) -> dist.ProcessGroup:
    """The process group called ``name`` (``ProcessGroup.group_name``) in this job."""
    # A private helper of torch, imported where used: builds of torch without distributed support
    # import this module too.
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


# ------------------------------------------------------------------------------------------------
# Eager collectives around training (monitoring, PreciseBN, running-stat reconciliation)
# ------------------------------------------------------------------------------------------------


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """``output`` = every rank's ``input`` concatenated along dim 0 (torch 2.13 renamed
    ``all_gather_into_tensor`` to ``all_gather_single``); looked up per call so that wrappers
    installed on ``torch.distributed`` (profilers, counters) see it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's 1-D ``row`` stacked into ``[W, len(row)]`` with ONE collective.

    Without torch.distributed the result is ``row`` as a single row.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return row.unsqueeze(0)
    world = dist.get_world_size(group)
    out = row.new_empty(world * row.numel())
    all_gather_single(out, row.contiguous(), group=group)
    return out.view(world, -1)


def all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Sum ``tensor`` over ``group`` (default: the world) in place, eagerly."""
    dist.all_reduce(tensor, group=group)
