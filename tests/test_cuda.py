"""Layers 0-4 on a GPU: the CUDA kernels and the module on CUDA tensors (``pytest -m gpu``).

Skipped automatically without a CUDA device (see conftest.py). The kernels are compared against
the pure-PyTorch reference on the same device and against float64 truth computed on the CPU, on
fresh random data, every dtype, both layouts (2-D to 5-D), shapes that split a channel across
many blocks, odd spatial sizes (no vector path), unaligned views, empty batches and a tensor past
2^31 elements. Before every kernel call the CUDA caching allocator is "poisoned": a block of NaNs
is allocated and freed, so an output element a kernel forgets to write reads as NaN, never as a
lucky zero.
"""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from _convert_models import residual_net
from _dist import run_distributed
from _host_sync import run_without_host_sync
from _kernel_matrix import (
    BAND_KERNELS,
    DTYPES,
    OUT_TOL,
    SHAPES,
    base_input,
    check_overflow_band,
    check_primitives,
    layouts,
)
from _numerics import rel_err
from torch import nn

from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm, step_statistics
from syncbn_lightning.ops import build as ops_build

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ext():
    module = ops_build.load_extension()
    assert module.with_cuda, "the extension was built without its CUDA kernels"
    return module


def _poison(nbytes: int) -> None:
    """Leave a freed block of NaNs in the caching allocator for the next allocation to reuse."""
    block = torch.full((max(nbytes, 1) // 4 + 1024,), float("nan"), device="cuda")
    del block


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cuda_kernels_match_reference_and_float64(
    ext, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    torch.manual_seed(zlib.crc32(repr((shape, str(dtype), "cuda")).encode()))
    base = base_input(shape, dtype, "cuda")
    nbytes = base.numel() * base.element_size() + 4096
    for x in layouts(base):
        check_primitives(ext, x, poison=lambda: _poison(nbytes))


def test_cuda_merge_of_an_all_empty_group(ext) -> None:
    counts = torch.zeros(3, device="cuda")
    junk = torch.full((3, 4), float("nan"), device="cuda")
    mean, invstd, var = ext.merge_stats(counts, junk, junk, 1e-5, True)
    assert torch.equal(mean.cpu(), torch.zeros(4)) and torch.equal(var.cpu(), torch.zeros(4))
    torch.testing.assert_close(invstd.cpu(), torch.full((4,), 1e-5**-0.5))


def test_cuda_stats_are_accurate_for_large_means(ext) -> None:
    x = (torch.randn(13, 4, 99, 111, dtype=torch.float64) * 0.1 + 1e4).float()
    for layout in (x, x.contiguous(memory_format=torch.channels_last)):
        _mean, m2 = ext.local_stats(layout.cuda())
        truth = x.double().var((0, 2, 3), correction=0) * (13 * 99 * 111)
        assert ((m2.cpu().double() - truth).abs() / truth).max() < 1e-5


@pytest.mark.slow
def test_cuda_kernels_index_past_2_pow_31_elements(ext) -> None:
    """64-bit indexing: 2 channels x (2^30 + 7) bfloat16 values (4.3 GB)."""
    length = 2**30 + 7
    x = torch.empty(1, 2, length, dtype=torch.bfloat16, device="cuda")
    x[0, 0].normal_(1.0, 2.0)
    x[0, 1].normal_(-3.0, 0.5)
    assert x.numel() > 2**31
    mean, m2 = ext.local_stats(x)
    want_var = torch.tensor([4.0, 0.25], device="cuda")
    torch.testing.assert_close(mean, torch.tensor([1.0, -3.0], device="cuda"), atol=2e-3, rtol=0)
    torch.testing.assert_close(m2 / length, want_var, rtol=1e-2, atol=0)
    invstd = torch.rsqrt(m2 / length + 1e-5)
    y = ext.normalize(x, mean, invstd, None, None)
    tail = slice(length - 4096, length)  # the last elements need 64-bit offsets
    expect = ((x[0, :, tail].float() - mean[:, None]) * invstd[:, None]).to(torch.bfloat16)
    assert rel_err(y[0, :, tail], expect) <= 1e-2
    del y
    dy = torch.ones_like(x)
    sums = ext.backward_reduce(dy, x, mean, invstd, None, False, False)
    torch.testing.assert_close(
        sums[0], torch.full((2,), float(length), device="cuda"), rtol=1e-5, atol=0
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_cuda_elementwise_kernels_in_the_32_bit_overflow_band(ext, layout: str) -> None:
    """numel = INT32_MAX - 1000 on the scalar path, where a 32-bit grid-stride index wrapped
    (tests/test_cuda_emu.py runs the same check under emulation). 2 x 4.3 GB of float16."""
    for kernel in BAND_KERNELS:
        check_overflow_band(ext, kernel, layout, "cuda")


EXCHANGES = ["gather", "reduce"]


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_cuda_layer_runs_without_host_synchronization(
    ext, exchange: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward and backward of a synchronized layer issue no host sync (torch's sync debug mode)."""
    monkeypatch.setenv("SYNCBN_IMPL", "ext")
    layer = SyncBatchNorm(8, force_sync=True, exchange=exchange).cuda()
    x = torch.randn(4, 8, 16, 16, device="cuda", requires_grad=True)
    layer(x).sum().backward()  # warm-up: builds and loads outside the checked region
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_cuda_eager_train_steps_of_a_converted_model_never_sync_the_host(
    ext, exchange: str, channels_last: bool, fuse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole eager train steps (forward, loss, backward, SGD) of a converted model, with a
    one-rank NCCL group and every layer forced to synchronize, issue no host-device sync: the
    host runs ahead of the GPU, as with plain BatchNorm (the call-order flags are read once per
    step by the callback, outside this region). Also with the residual blocks' tails fused."""
    import torch.distributed as dist

    from syncbn_lightning import convert_sync_batchnorm

    monkeypatch.setenv("SYNCBN_IMPL", "ext")
    memory = torch.channels_last if channels_last else torch.contiguous_format
    dist.init_process_group("nccl", init_method=f"file://{_store_path()}", rank=0, world_size=1)
    try:
        net = residual_net()
        named = [type(net[3])] if fuse else False
        model = convert_sync_batchnorm(net, exchange=exchange, fuse_residual=named)
        assert hasattr(type(model[3]), "_syncbn_fused_from") is fuse
        model = model.cuda()
        model = model.to(memory_format=memory).train()
        for layer in model.modules():
            if isinstance(layer, SyncBatchNorm):
                layer.force_sync = True
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(4, 3, 16, 16, device="cuda").contiguous(memory_format=memory)
        y = torch.randint(0, 10, (4,), device="cuda")

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        step()  # warm-up: communicators, allocator pools and the optimizer's state exist first
        run_without_host_sync(step)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        dist.destroy_process_group()


def test_cuda_accumulated_steps_never_sync_the_host(ext, monkeypatch: pytest.MonkeyPatch) -> None:
    """Optimizer steps of 4 micro-batches inside ``step_statistics``, in both modes and on both
    exchanges, issue no host-device sync: the context's entry, the calls (each merging with the
    step's earlier statistics in ``"step"``), their merges and the one commit, with a one-rank
    NCCL group (made once: each costs NCCL's setup), half the layers forced to synchronize and
    the others taking the call of a layer without a group. Each step counts once in
    ``num_batches_tracked``."""
    import torch.distributed as dist

    monkeypatch.setenv("SYNCBN_IMPL", "ext")
    dist.init_process_group("nccl", init_method=f"file://{_store_path()}", rank=0, world_size=1)
    try:
        for exchange in EXCHANGES:
            for normalize in ("micro", "step"):
                _accumulated_steps_without_a_sync(exchange, normalize)
    finally:
        dist.destroy_process_group()


def _accumulated_steps_without_a_sync(exchange: str, normalize: str) -> None:
    """3 checked steps of :func:`test_cuda_accumulated_steps_never_sync_the_host` after one
    warm-up step (communicators, allocator pools, the optimizer's state, cached indices)."""
    model = convert_sync_batchnorm(residual_net(), exchange=exchange).cuda().train()
    layers = [m for m in model.modules() if isinstance(m, SyncBatchNorm)]
    for layer in layers[::2]:
        layer.force_sync = True
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xs = [torch.randn(2, 3, 16, 16, device="cuda") for _ in range(4)]
    ys = [torch.randint(0, 10, (2,), device="cuda") for _ in range(4)]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with step_statistics(model, normalize=normalize):
            for x, y in zip(xs, ys, strict=True):
                nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    step()
    torch.cuda.synchronize()
    before = [int(layer.num_batches_tracked) for layer in layers]
    run_without_host_sync(step)
    after = [int(layer.num_batches_tracked) for layer in layers]
    assert after == [n + 3 for n in before], (exchange, normalize)
    assert all(torch.isfinite(layer.running_var).all() for layer in layers), (exchange, normalize)


def _store_path() -> str:
    import tempfile

    return str(tempfile.mkdtemp(prefix="syncbn_store_")) + "/store"


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_cuda_layer_forward_can_be_captured_in_a_cuda_graph(
    ext, exchange: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", "ext")
    layer = SyncBatchNorm(8, force_sync=True, exchange=exchange).cuda()
    static_x = torch.randn(4, 8, 16, 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            layer(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = layer(static_x)
    fresh = torch.randn(4, 8, 16, 16, device="cuda") * 3 + 1
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    expect = torch.nn.functional.batch_norm(fresh, None, None, layer.weight, layer.bias, True)
    assert rel_err(static_y, expect) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "NHWC"])
@pytest.mark.parametrize("impl", ["ext", "auto"])
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_cuda_forced_sync_single_rank_matches_batchnorm2d(
    exchange: str,
    impl: str,
    channels_last: bool,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", impl)
    torch.manual_seed(11)
    ours = SyncBatchNorm(16, force_sync=True, exchange=exchange).cuda()
    theirs = nn.BatchNorm2d(16).cuda()
    x = (torch.randn(4, 16, 24, 20, device="cuda") * 2 + 1).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x1 = x.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    y1, y2 = ours(x1), theirs(x2)  # float32 parameters with half inputs, like AMP
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    tol = OUT_TOL[dtype] * 2
    assert rel_err(y1, y2) < tol and rel_err(x1.grad, x2.grad) < tol
    assert rel_err(ours.weight.grad, theirs.weight.grad) < tol
    assert rel_err(ours.bias.grad, theirs.bias.grad) < tol
    assert rel_err(ours.running_mean, theirs.running_mean) < 1e-5
    assert rel_err(ours.running_var, theirs.running_var) < 1e-4


# Two ranks on the one GPU (gloo carries CUDA tensors; NCCL refuses two ranks on one device).
# Each case: per-rank batch sizes (uneven; one rank empty), the exchange, |mean| / std, layout.
TWO_RANK_CASES = [
    (batches, exchange, offset, layout)
    for batches in ((3, 5), (4, 0))
    for exchange in ("gather", "reduce")
    for offset in (0.5, 1e4)
    for layout in ("nchw", "cl")
]


def _two_rank_input(case: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole group's float32 input and output gradient of ``case``, made on the CPU."""
    batches, _exchange, offset, _layout = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    full = torch.randn(sum(batches), 6, 10, 12, generator=gen, dtype=torch.float64) + offset
    return full.float(), torch.randn(full.shape, generator=gen)


def _two_rank_worker(rank: int, world: int) -> list[dict[str, np.ndarray]]:
    import os

    os.environ["SYNCBN_IMPL"] = "ext"
    results = []
    for case in TWO_RANK_CASES:
        batches, exchange, _offset, layout = case
        full, dy = _two_rank_input(case)
        start = sum(batches[:rank])
        mine = slice(start, start + batches[rank])
        layer = SyncBatchNorm(6, momentum=1.0, exchange=exchange).cuda()
        with torch.no_grad():
            layer.weight.copy_(torch.linspace(0.5, 1.5, 6))
            layer.bias.copy_(torch.linspace(-1.0, 1.0, 6))
        x = full[mine].cuda()
        if layout == "cl":
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(True)
        y = layer(x)
        y.backward(dy[mine].cuda())
        # numpy arrays, not tensors: the spawn harness shares returned tensors through
        # multiprocessing's resource_sharer, which failed on the GPU machine (FileNotFoundError).
        results.append(
            {
                "y": y.detach().cpu().numpy(),
                "dx": x.grad.cpu().numpy(),
                "dw": layer.weight.grad.cpu().numpy(),
                "db": layer.bias.grad.cpu().numpy(),
                "rm": layer.running_mean.cpu().numpy(),
                "rv": layer.running_var.cpu().numpy(),
            }
        )
    return results


@pytest.mark.distributed
def test_cuda_two_ranks_on_one_gpu_match_float64_on_both_exchanges(ext) -> None:
    """Two gloo ranks with CUDA tensors, both exchanges forced: outputs, input gradients, the
    ranks' summed parameter gradients and the running statistics within 1e-5 of float64
    BatchNorm on the concatenated batch, at |mean| / std 0.5 and 1e4, uneven and empty ranks."""
    by_rank = run_distributed(_two_rank_worker, 2, timeout=300)
    for i, case in enumerate(TWO_RANK_CASES):
        full, dy = _two_rank_input(case)
        got = [{k: torch.from_numpy(v) for k, v in ranks[i].items()} for ranks in by_rank]
        x = full.double().requires_grad_(True)
        weight = torch.linspace(0.5, 1.5, 6, dtype=torch.float64).requires_grad_(True)
        bias = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64).requires_grad_(True)
        running = [torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)]
        y = nn.functional.batch_norm(x, *running, weight, bias, True, 1.0, 1e-5)
        y.backward(dy.double())
        errors = {
            "y": rel_err(torch.cat([r["y"] for r in got]), y),
            "dx": rel_err(torch.cat([r["dx"] for r in got]), x.grad),
            # gamma/beta gradients are local (DDP averages them): their sum is the batch's.
            "dw": rel_err(sum(r["dw"] for r in got), weight.grad),
            "db": rel_err(sum(r["db"] for r in got), bias.grad),
            "rm": max(rel_err(r["rm"], running[0]) for r in got),
            "rv": max(rel_err(r["rv"], running[1]) for r in got),
        }
        assert max(errors.values()) <= 1e-5, (case, errors)


def _cuda_unused_branch_worker(rank: int, world: int, errors: str) -> str:
    """One CUDA step where rank 1's loss leaves the auxiliary head out: the backward's order flag
    is queued on the device and read by :func:`~syncbn_lightning.check_call_order` after it, as
    the callback does at each batch's end. The error propagates, as in a job; its text is also
    written to ``errors``/rank<R>.txt (the harness reports only the lowest failing rank's)."""
    from syncbn_lightning import CallOrderError, check_call_order, convert_sync_batchnorm

    class AuxNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8))
            self.body = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))
            self.aux = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.stem(x)
            return self.body(h), self.aux(h)

    torch.manual_seed(0)
    net = convert_sync_batchnorm(AuxNet()).cuda()
    out, aux = net(torch.randn(2, 3, 4, 4, device="cuda"))
    loss = out.square().mean() + (aux.square().mean() if rank == 0 else 0.0)
    try:
        loss.backward()
        check_call_order()
    except CallOrderError as exc:
        (Path(errors) / f"rank{rank}.txt").write_text(str(exc))
        raise
    return "ok"


@pytest.mark.distributed
def test_cuda_a_layer_unused_in_one_ranks_loss_raises_call_order_error(ext, tmp_path) -> None:
    """The backward's call-order flag on CUDA (queued, read after the backward): rank 1, whose
    backward has one synchronized layer fewer, raises CallOrderError naming its layer at the
    step's end, long before the group timeout; rank 0, left in a collective rank 1 never joins,
    fails at once when rank 1's process ends ("Connection closed by peer")."""
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank \d of 2 failed"):
        run_distributed(_cuda_unused_branch_worker, 2, str(tmp_path), timeout=120, pg_timeout_s=60)
    assert time.monotonic() - started < 40
    text = (tmp_path / "rank1.txt").read_text()
    assert text.startswith("The backward passes of SyncBatchNorm layers"), text
    assert "'body.1' (call #1)" in text, text


def _cuda_skipped_layer_worker(
    rank: int, world: int, device: str = "cuda", synchronize: bool = False
) -> tuple[str, int, int, float]:
    """Three forward steps where rank 1 skips `mid` (its `tail` meets rank 0's `mid`): the flags
    are copied to pinned memory and read at later calls once their events complete. Returns the
    error, the (step, call) of the layer call that raised it (``(-1, -1)``: only the syncing
    ``check_call_order`` after the steps found it; ``(-2, -2)``: nothing did), and the seconds
    from the first call to the error. ``synchronize``: the device finishes each call before the
    next (then every flag has landed by the next call's poll). SyncBN's groups time out after
    :data:`SKIPPED_TIMEOUT_S`. (``device="cpu"`` with ``set_queue_order_flags_on_cpu`` runs the
    same logic without a GPU.)"""
    from datetime import timedelta

    from syncbn_lightning import CallOrderError, check_call_order, convert_sync_batchnorm
    from syncbn_lightning.distributed.groups import set_sync_timeout

    set_sync_timeout(timedelta(seconds=SKIPPED_TIMEOUT_S))
    torch.manual_seed(0)
    names = ["stem", "mid", "tail"] if rank == 0 else ["stem", "tail"]
    net = convert_sync_batchnorm(
        nn.ModuleDict({name: nn.BatchNorm1d(4) for name in ("stem", "mid", "tail")})
    ).to(device)
    started = time.monotonic()
    try:
        for step in range(3):  # noqa: B007 - the except clause reads step and number
            for number, name in enumerate(names):  # noqa: B007
                net[name](torch.randn(3, 4, device=device))
                if synchronize:
                    torch.cuda.current_stream().synchronize()
    except CallOrderError as exc:
        return str(exc), step, number, time.monotonic() - started
    try:
        check_call_order()
    except CallOrderError as exc:
        return str(exc), -1, -1, time.monotonic() - started
    return "", -2, -2, time.monotonic() - started


#: SyncBN's collective timeout in the skipped-layer tests (the default group's is 60 s).
SKIPPED_TIMEOUT_S = 10.0


@pytest.mark.distributed
def test_cuda_a_skipped_layer_is_found_at_later_calls_when_each_call_has_landed(ext) -> None:
    """Each call synchronized: every queued flag has landed by the next call's poll, so both
    ranks raise CallOrderError naming the two layers from a layer call within the three steps
    (the flags read without a host sync of their own), never from ``check_call_order``."""
    results = run_distributed(
        _cuda_skipped_layer_worker, 2, "cuda", True, timeout=120, pg_timeout_s=60
    )
    for rank, (text, step, _number, _seconds) in enumerate(results):
        assert "'mid'" in text and "'tail'" in text, (rank, text)
        assert step >= 0, f"rank {rank}: found only by check_call_order (-1) or never (-2): {step}"


@pytest.mark.distributed
def test_cuda_a_skipped_layer_ends_both_ranks_with_call_order_error_without_a_sync(ext) -> None:
    """No sync per call: whether a flag has landed by the next poll is a race between host and
    device, so one rank may find the mismatch while the other goes on into a collective that
    will never complete. Both ranks still end with CallOrderError naming the two layers, within
    SyncBN's collective timeout and a margin (the one left waiting gets the error the other
    published: ``distributed/call_order/watcher.py``), never the backend's timeout error."""
    started = time.monotonic()
    results = run_distributed(_cuda_skipped_layer_worker, 2, timeout=120, pg_timeout_s=60)
    for rank, (text, step, _number, seconds) in enumerate(results):
        assert "'mid'" in text and "'tail'" in text, (rank, step, text)
        assert seconds < SKIPPED_TIMEOUT_S + 10, (rank, seconds)
    assert time.monotonic() - started < 60
