"""The C++ path's queued call-order flags and its device plan, driven on CPU.

On CUDA tensors ``syncbn::sync_batch_norm`` cannot read a call's order flag without a host
sync, so each direction queues it in the C++ path's order ring (``csrc/layer/order_ring.h``:
a pinned slot and an event per flag on CUDA), polled before each later collective and drained by
``check_call_order``; Python runs only when a flag reads 0. Here CPU calls on the C++ path queue
their flags the same way (``set_queue_order_flags_on_cpu``; the CPU kernels still raise a
mismatch at once, and the CPU's store has its copy at once), which runs every host step of that
path but the pinned copy and the event; those run under the CUDA emulation
(``tests/test_cuda_emu_order_ring.py``). The reports of a queued flag that reads 0 are checked by
queueing such a flag through ``syncbn::queue_order_flag``. The device plan
(``SYNCBN_NATIVE_CUDA``) is checked where no GPU is needed. What only a GPU shows is
``benchmarks/gpu_check.sh native``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _package_calls import PLAN_CALLS, package_calls

from syncbn_lightning import CallOrderError, SyncBatchNorm, check_call_order
from syncbn_lightning.distributed.call_order import checks as call_order
from syncbn_lightning.distributed.call_order import watcher as group_abort
from syncbn_lightning.distributed.job import current_job
from syncbn_lightning.functional import layer_call as sync_plan
from syncbn_lightning.functional import native
from syncbn_lightning.ops import dispatch
from syncbn_lightning.ops.reference.steps import ROW_HEADER


@pytest.fixture
def one_rank(tmp_path) -> Iterator[str]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _kinds() -> list[str]:
    """The kinds of the reports of the flags queued in the C++ path's ring, oldest first."""
    queued = torch.ops.syncbn.order_ring_queued()
    return [native.KINDS[kind] for kind in queued[0::2]]


@pytest.mark.parametrize("exchange", ["gather", "reduce"])
def test_each_direction_hands_its_flag_to_the_queue(one_rank, queued_flags, exchange) -> None:
    layer = SyncBatchNorm(4, force_sync=True, exchange=exchange)
    x = torch.randn(3, 4, 5, requires_grad=True)
    y = layer(x)
    assert layer._sync_plan.native and layer._sync_plan.settings["queue_order_flags"]
    kind = "gathered_rows" if exchange == "gather" else "reduce_sums"
    assert _kinds() == [kind]
    y.sum().backward()
    # The backward's check before its collective read the forward's flag (landed: a CPU copy).
    assert _kinds() == ["backward_sums"]
    check_call_order()  # reads what is left: in order
    assert _kinds() == [] and call_order._pending == []


def test_without_queueing_nothing_is_handed_over(one_rank) -> None:
    layer = SyncBatchNorm(4, force_sync=True)
    layer(torch.randn(3, 4, 5, requires_grad=True)).sum().backward()
    assert not layer._sync_plan.settings["queue_order_flags"]
    assert _kinds() == [] and call_order._pending == []


def _queue(flags: torch.Tensor, kind: str, data, aux, width, group, layer_tag=3, tiny=None):
    """Queue ``flags``' order flag in the C++ path's ring, as a call of ``kind`` does."""
    native.register_python_kernels()
    torch.ops.syncbn.queue_order_flag(
        flags,
        2 if kind != "backward_sums" else 0,
        native.KINDS.index(kind),
        data,
        aux,
        width,
        group,
        1,
        layer_tag,
        tiny,
    )


def test_a_queued_gather_flag_that_reads_zero_names_each_rank_s_layer(queued_flags) -> None:
    from syncbn_lightning.distributed.flight.recorder import register_layer_name

    register_layer_name(11, "backbone.bn1")
    register_layer_name(12, "backbone.bn2")
    channels = 2
    width = ROW_HEADER + 3 * channels
    rows = torch.zeros(2, width)
    rows[0, 2:4] = torch.tensor([11.0, 0.0])
    rows[1, 2:4] = torch.tensor([12.0, 0.0])
    info = torch.tensor([8.0, 4.0, 0.0, 1.0, 11.0, 0.0])  # order_ok (info[2]) = 0
    _queue(info, "gathered_rows", rows.view(-1), rows.view(-1), width, None)
    ran = r"rank 0 ran 'backbone.bn1'.*rank 1 ran 'backbone.bn2'"
    with pytest.raises(CallOrderError, match=ran):
        check_call_order()
    assert call_order._pending == []


def test_a_queued_backward_flag_that_reads_zero_names_this_rank_s_layer(queued_flags) -> None:
    from syncbn_lightning.distributed.flight.recorder import register_layer_name

    register_layer_name(21, "head.bn")
    summed = torch.zeros(16 + 2 * 3)
    grad_info = torch.tensor([6.0, 3.0, 1.0, 1.0, 21.0, 4.0])
    _queue(torch.zeros(1), "backward_sums", summed, grad_info, summed.numel(), None)
    with pytest.raises(CallOrderError, match=r"backward of 'head.bn' \(call #5\)"):
        check_call_order()


def test_a_queued_flag_is_read_before_the_next_call_s_collective(one_rank, queued_flags) -> None:
    """The next synchronized call reads the landed flags before its collective and raises there:
    not only the step's ``check_call_order``, and before the call joins the collective (its
    running statistics are untouched)."""
    summed, grad_info = torch.zeros(22), torch.tensor([6.0, 3.0, 1.0, 1.0, 21.0, 0.0])
    _queue(torch.zeros(1), "backward_sums", summed, grad_info, 22, None)
    layer = SyncBatchNorm(4, force_sync=True)
    with pytest.raises(CallOrderError):
        layer(torch.randn(3, 4, 5) + 5)
    assert layer._sync_plan.native
    assert torch.equal(layer.running_mean, torch.zeros(4)) and _kinds() == []


def test_flags_that_read_one_run_no_python(one_rank, queued_flags) -> None:
    """Steps whose flags all read 1 run no Python of the package beyond the forward's plan:
    queueing, polling and reading the flags are C++, and the backward runs no Python at all."""
    layer = SyncBatchNorm(4, force_sync=True)
    x = torch.randn(3, 4, 5, requires_grad=True)
    layer(x).sum().backward()  # the plan, the watcher
    outputs: list[torch.Tensor] = []
    for _ in range(3):
        calls = package_calls(lambda: outputs.append(layer(x)))
        assert package_calls(outputs[-1].sum().backward) == []
        assert set(calls) <= PLAN_CALLS, calls
        assert _kinds() == ["backward_sums"]


def test_a_published_mismatch_is_raised_before_the_next_collective(one_rank, queued_flags) -> None:
    """Another rank's mismatch, as the watcher leaves it: the C++ path's next call raises it
    before joining a collective (the documented CallOrderError, not the collective's error)."""
    layer = SyncBatchNorm(4, force_sync=True)
    layer(torch.randn(3, 4, 5))
    job = current_job()
    group_abort._signal(job, "g", "global rank 1 found: a mismatch")
    try:
        with pytest.raises(CallOrderError, match="global rank 1 found: a mismatch"):
            layer(torch.randn(3, 4, 5) + 5)
        assert torch.equal(layer.num_batches_tracked, torch.tensor(1))
    finally:
        job.signalled.clear()
        group_abort._set_signalled(False)
    layer(torch.randn(3, 4, 5))  # cleared: the calls go on
    assert torch.equal(layer.num_batches_tracked, torch.tensor(2))


def test_a_stale_signal_is_cleared_by_the_first_check(one_rank, queued_flags) -> None:
    """A signal whose message the running job does not hold (an earlier job's): the first check
    drops it and tells the C++ path, whose later calls ask Python nothing more."""
    layer = SyncBatchNorm(4, force_sync=True)
    layer(torch.randn(3, 4, 5))
    group_abort._set_signalled(True)
    first = package_calls(lambda: layer(torch.randn(3, 4, 5)))
    assert "checks.py:raise_if_published" in first and not group_abort.signalled()
    later = package_calls(lambda: layer(torch.randn(3, 4, 5)))
    assert "checks.py:raise_if_published" not in later


def test_a_full_ring_is_drained_before_the_next_flag(queued_flags) -> None:
    """A flag beyond the ring's slots: every flag queued is read first (a host sync on a
    device), then the new one is queued; a zero among them raises there."""
    from syncbn_lightning._shared import ORDER_FLAG_SLOTS

    summed, grad_info = torch.zeros(22), torch.tensor([6.0, 3.0, 1.0, 1.0, 21.0, 0.0])
    for _ in range(ORDER_FLAG_SLOTS):
        _queue(torch.ones(1), "backward_sums", summed, grad_info, 22, None)
    assert len(_kinds()) == ORDER_FLAG_SLOTS
    _queue(torch.ones(1), "backward_sums", summed, grad_info, 22, None)
    assert len(_kinds()) == 1
    for index in range(ORDER_FLAG_SLOTS - 1):
        flag = torch.zeros(1) if index == 7 else torch.ones(1)
        _queue(flag, "backward_sums", summed, grad_info, 22, None, layer_tag=index)
    with pytest.raises(CallOrderError, match="call #1"):
        _queue(torch.ones(1), "backward_sums", summed, grad_info, 22, None)
    assert _kinds() == []


def test_a_tiny_input_checks_the_group_count_on_the_host(queued_flags) -> None:
    info = torch.tensor([1.0, 1.0, 1.0, 1.0, 3.0, 0.0])  # one value per channel in the group
    rows = torch.zeros(ROW_HEADER + 3)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        _queue(info, "gathered_rows", rows, rows, rows.numel(), None, tiny=torch.ones(1, 1))


# ------------------------------------------------------------------------------------------------
# The device plan
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"), [(None, False), ("0", False), ("", False), ("1", True)]
)
def test_native_cuda_reads_its_variable(monkeypatch, value, expected) -> None:
    if value is None:
        monkeypatch.delenv("SYNCBN_NATIVE_CUDA", raising=False)
    else:
        monkeypatch.setenv("SYNCBN_NATIVE_CUDA", value)
    assert dispatch.native_cuda() is expected


def test_a_bad_native_cuda_value_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("SYNCBN_NATIVE_CUDA", "yes")
    with pytest.raises(ValueError, match=r"SYNCBN_NATIVE_CUDA='yes' is not valid: use 1 .* or 0"):
        dispatch.native_cuda()


def test_a_plan_is_made_per_kind_of_device(one_rank, monkeypatch) -> None:
    """Calls on tensors that are not on the CPU (``meta`` here: no GPU needed) make a plan for
    their device: the Python path unless SYNCBN_NATIVE_CUDA=1 and the device is CUDA; called
    on CPU tensors again, a CPU plan."""
    monkeypatch.setenv("SYNCBN_NATIVE_CUDA", "1")
    layer = SyncBatchNorm(4, force_sync=True)
    cpu_plan = sync_plan.plan_of(layer, "cpu")
    assert cpu_plan.native and cpu_plan.cpu
    assert sync_plan.plan_of(layer, "cpu") is cpu_plan
    layer.to("meta")
    other = sync_plan.plan_of(layer, "meta")
    assert other is not cpu_plan and not other.cpu and not other.native  # meta: not CUDA
    layer.to_empty(device="cpu")
    assert sync_plan.plan_of(layer, "cpu").native


@pytest.fixture
def record_passes(monkeypatch) -> Iterator[Any]:
    """``record_passes(*entries)``: the recorded GPU passes for the test, SYNCBN_NATIVE_CUDA
    unset (the passes decide)."""
    from syncbn_lightning.ops import dispatch, native_passes

    def record(*entries: dict[str, str]) -> None:
        monkeypatch.setattr(native_passes, "PASSES", entries)
        dispatch.native_cuda_default.cache_clear()

    monkeypatch.delenv("SYNCBN_NATIVE_CUDA", raising=False)
    record()
    yield record
    dispatch.native_cuda_default.cache_clear()


def test_cuda_layers_default_to_the_cpp_path_only_on_a_recorded_pass(
    record_passes, monkeypatch
) -> None:
    """Unset, SYNCBN_NATIVE_CUDA is what the recorded passes say of this tree: no pass, or a
    pass of other Python files or other C++ sources, keeps the Python path; a pass of exactly
    these puts CUDA layers on the C++ path. Set, the variable decides."""
    from syncbn_lightning.ops import build, dispatch

    here = {"extension": build.load_extension().sources_digest}
    here["python"] = dispatch.python_path_digest()
    assert dispatch.native_cuda() is False  # nothing recorded
    for stale in ({**here, "python": "0" * 16}, {**here, "extension": "f" * 16}):
        record_passes(stale)
        assert dispatch.native_cuda() is False, stale
    record_passes({**here, "device": "NVIDIA H200", "date": "2026-12-01"})
    assert dispatch.native_cuda() is True
    monkeypatch.setenv("SYNCBN_NATIVE_CUDA", "0")
    assert dispatch.native_cuda() is False


def test_the_python_digest_follows_the_library_s_files(monkeypatch, tmp_path) -> None:
    """Any change of a library file changes the digest; the record of passes does not."""
    import shutil

    import syncbn_lightning
    from syncbn_lightning.ops import dispatch

    package = tmp_path / "syncbn_lightning"
    shutil.copytree(Path(syncbn_lightning.__file__).parent, package)
    monkeypatch.setattr(dispatch, "__file__", str(package / "ops" / "dispatch.py"))
    from syncbn_lightning.ops import native_passes

    monkeypatch.setattr(native_passes, "__file__", str(package / "ops" / "native_passes.py"))
    before = dispatch.python_path_digest()
    assert before == dispatch.python_path_digest()
    (package / "ops" / "native_passes.py").write_text("PASSES = ({'a': 'b'},)\n")
    assert dispatch.python_path_digest() == before
    plan = package / "functional" / "layer_call.py"
    plan.write_text(plan.read_text() + "\n")
    assert dispatch.python_path_digest() != before


def test_a_static_libstdcxx_puts_python_s_checks_in_front(one_rank, monkeypatch) -> None:
    """Where the extension links libstdc++ statically (the GPU image), the C++ path's calls run
    nn/checks.py's check_input first, so a wrong input is Python's exception there too; where it
    does not (here), the C++ path checks alone."""
    from syncbn_lightning.ops import build

    seen: list[int] = []
    real = sync_plan.check_input

    def spy(input, *args):
        seen.append(input.shape[1])
        return real(input, *args)

    monkeypatch.setattr(sync_plan, "check_input", spy)
    for static in (False, True):
        monkeypatch.setattr(build.load_extension(), "static_libstdcxx", static)
        layer = SyncBatchNorm(4, force_sync=True)
        layer(torch.randn(2, 4, 3))
        assert layer._sync_plan.native and layer._sync_plan.checks_first is static
        with pytest.raises(ValueError, match="3 channels"):
            layer(torch.randn(2, 3, 3))
        assert seen == ([4, 3] if static else []), (static, seen)
        seen.clear()


def test_a_setting_the_schema_names_but_the_plan_lacks_is_named(one_rank) -> None:
    from syncbn_lightning.functional.layer_call import settings_in_schema_order

    with pytest.raises(KeyError, match="world_size"):
        settings_in_schema_order(torch.ops.syncbn.sync_batch_norm.default, {"group": None})


def test_an_input_on_another_device_gets_the_python_path_s_error(one_rank, monkeypatch) -> None:
    """A CPU layer called on a meta tensor: a plan for meta (never the C++ path), and the
    layer's own message."""
    monkeypatch.setenv("SYNCBN_NATIVE_CUDA", "1")
    layer = SyncBatchNorm(4, force_sync=True)
    with pytest.raises(ValueError, match=r"model\.to\('meta'\)"):
        layer(torch.randn(2, 4, 3, device="meta"))
    assert layer._sync_plan.device == "meta" and not layer._sync_plan.native


def test_nothing_is_queued_for_a_layer_in_eval(one_rank, queued_flags) -> None:
    layer = SyncBatchNorm(4, force_sync=True).eval()
    layer(torch.randn(2, 4, 3))
    assert _kinds() == [] and call_order._pending == []


def test_module_protocol_keeps_the_queue(one_rank, queued_flags) -> None:
    """A pruned layer (its weight a plain attribute) takes the same path and hands its flags
    over as well."""
    from torch.nn.utils import prune

    layer = SyncBatchNorm(4, force_sync=True)
    prune.l1_unstructured(layer, "weight", 0.5)
    layer(torch.randn(2, 4, 3, requires_grad=True)).sum().backward()
    assert _kinds() == ["backward_sums"]
