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

import zlib

import numpy as np
import pytest
import torch
from _dist import run_distributed
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

from syncbn_lightning import SyncBatchNorm
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


def test_cuda_layer_runs_without_host_synchronization(ext, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward of a synchronized layer issue no host sync (torch's sync debug mode)."""
    monkeypatch.setenv("SYNCBN_IMPL", "ext")
    layer = SyncBatchNorm(8, force_sync=True).cuda()
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


def test_cuda_layer_forward_can_be_captured_in_a_cuda_graph(
    ext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", "ext")
    layer = SyncBatchNorm(8, force_sync=True).cuda()
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
def test_cuda_forced_sync_single_rank_matches_batchnorm2d(
    impl: str, channels_last: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", impl)
    torch.manual_seed(11)
    ours = SyncBatchNorm(16, force_sync=True).cuda()
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
TWO_RANK_BATCHES = [(3, 5), (4, 0)]  # uneven; one rank empty


def _two_rank_worker(
    rank: int, world: int, batches: tuple[int, ...], seed: int
) -> dict[str, np.ndarray]:
    import os

    os.environ["SYNCBN_IMPL"] = "ext"
    torch.manual_seed(seed)
    full = torch.randn(sum(batches), 6, 10, 12) * 2 + 0.5
    dy = torch.randn_like(full)
    start = sum(batches[:rank])
    mine = slice(start, start + batches[rank])
    layer = SyncBatchNorm(6).cuda()
    x = full[mine].cuda().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    y = layer(x)
    y.backward(dy[mine].cuda())
    # numpy arrays, not tensors: the spawn harness shares returned tensors through
    # multiprocessing's resource_sharer, which failed on the GPU machine (FileNotFoundError).
    return {
        "y": y.detach().cpu().numpy(),
        "dx": x.grad.cpu().numpy(),
        "dw": layer.weight.grad.cpu().numpy(),
        "db": layer.bias.grad.cpu().numpy(),
        "rm": layer.running_mean.cpu().numpy(),
        "rv": layer.running_var.cpu().numpy(),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("batches", TWO_RANK_BATCHES, ids=str)
def test_cuda_two_ranks_on_one_gpu_equal_one_process_on_the_concatenated_batch(
    ext, batches: tuple[int, ...]
) -> None:
    results = [
        {k: torch.from_numpy(v) for k, v in r.items()}
        for r in run_distributed(_two_rank_worker, len(batches), batches, 7, timeout=300)
    ]
    torch.manual_seed(7)
    full = torch.randn(sum(batches), 6, 10, 12) * 2 + 0.5
    dy = torch.randn_like(full)
    bn = nn.BatchNorm2d(6).cuda()
    x = full.cuda().requires_grad_(True)
    y = bn(x)
    y.backward(dy.cuda())
    y_all = torch.cat([r["y"] for r in results])
    dx_all = torch.cat([r["dx"] for r in results])
    assert rel_err(y_all, y.detach().cpu()) < 1e-5 and rel_err(dx_all, x.grad.cpu()) < 1e-5
    # gamma/beta gradients are local (DDP averages them): their sum is the full-batch gradient.
    assert rel_err(sum(r["dw"] for r in results), bn.weight.grad.cpu()) < 1e-5
    assert rel_err(sum(r["db"] for r in results), bn.bias.grad.cpu()) < 1e-5
    for r in results:
        assert rel_err(r["rm"], bn.running_mean.cpu()) < 1e-6
        assert rel_err(r["rv"], bn.running_var.cpu()) < 1e-6
