"""The SIMT emulation itself (``pytest -m cuda_emu``): its builtins give CUDA's answers, and each
class of kernel bug it promises to report is reported, naming the thread, op and line.

The kernels are in ``tests/cuda_emu/selftest.cu``, compiled through the same build-time rewrite
as ``csrc/cuda/*.cu``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_emu.build import RewriteError, load_emulator, rewrite_cuda_source

# Needs the emulation build (minutes on 2 cores): outside the fast check.
pytestmark = [pytest.mark.cuda_emu, pytest.mark.slow]

SCHEDULES = [("forward", 0), ("reverse", 0), ("random", 5)]


@pytest.fixture(scope="module")
def emu():
    module = load_emulator()
    yield module
    module.set_schedule("forward", 0)


@pytest.fixture
def fresh(emu):
    emu.set_schedule("forward", 0)
    emu.take_diagnostics()
    emu.take_launches()
    return emu


def _run(emu, name, x=None, grid=(1, 1, 1), block=(64, 1, 1), smem=0, arg=0, out=64):
    x = torch.zeros(1, dtype=torch.float64) if x is None else x
    return emu.selftest(name, x, list(grid), list(block), smem, arg, out)


@pytest.mark.parametrize(("order", "seed"), SCHEDULES)
def test_block_reduction_with_barriers_is_right_under_every_schedule(fresh, order, seed) -> None:
    fresh.set_schedule(order, seed)
    x = torch.randn(4 * 256, dtype=torch.float64)
    got = _run(fresh, "block_sum", x, grid=(4, 1, 1), block=(256, 1, 1), arg=1, out=4)
    torch.testing.assert_close(got, x.view(4, 256).sum(1))
    got = _run(fresh, "dynamic_shared_sum", x, grid=(4, 1, 1), block=(256, 1, 1), smem=2048, out=4)
    torch.testing.assert_close(got, x.view(4, 256).sum(1))
    assert fresh.take_diagnostics() == []


def test_a_missing_barrier_is_caught_by_the_schedules(fresh) -> None:
    """Without __syncthreads the tree reads slots others have not written: poison (NaN) under the
    forward order; the reverse order happens to be right, which is why all orders run."""
    x = torch.randn(256, dtype=torch.float64)
    results = {}
    for order, seed in SCHEDULES:
        fresh.set_schedule(order, seed)
        results[order] = _run(fresh, "block_sum", x, block=(256, 1, 1), arg=0, out=1)
    assert torch.isnan(results["forward"]).all()
    torch.testing.assert_close(results["reverse"], x.sum().view(1))
    assert not torch.allclose(results["random"], x.sum().view(1), equal_nan=False)


@pytest.mark.parametrize("width", [32, 16, 8, 4])
def test_warp_intrinsics_follow_cuda_semantics(fresh, width: int) -> None:
    x = torch.randn(64, dtype=torch.float64)
    got = _run(fresh, "warp_intrinsics", x, block=(64, 1, 1), arg=width, out=64 * 8).view(64, 8)
    for t in range(64):
        lane, warp = t % 32, t // 32
        base, seg = lane // width * width, lane % width
        w = x[warp * 32 : warp * 32 + 32]
        assert got[t, 0] == w[base + 3 % width]
        assert got[t, 1] == (w[lane - 1] if seg >= 1 else w[lane])
        assert got[t, 2] == (w[lane + 2] if seg + 2 < width else w[lane])
        assert got[t, 3] == w[lane ^ 1]
        assert int(got[t, 4]) == sum(1 << i for i in range(32) if w[i] > 0)
        assert got[t, 5] == float(bool((w > 2).any()))
        assert got[t, 6] == 1.0
        assert got[t, 7] == float((x > 0).sum())


def test_coordinates_of_a_3d_grid_of_3d_blocks(fresh) -> None:
    grid, block = (3, 2, 2), (4, 3, 2)
    got = _run(fresh, "coordinates", grid=grid, block=block, out=12 * 24 * 6).view(12, 24, 6)
    for b in range(12):
        bx, by, bz = b % 3, b // 3 % 2, b // 6
        for t in range(24):
            tx, ty, tz = t % 4, t // 4 % 3, t // 12
            assert got[b, t].tolist() == [tx, ty, tz, bx, by, bz]


def test_atomics_and_fresh_shared_memory(fresh) -> None:
    got = _run(fresh, "atomics", grid=(5, 1, 1), block=(96, 1, 1), out=2)
    assert got.tolist() == [480.0, 95.0]
    assert torch.isnan(_run(fresh, "read_unwritten_shared", block=(64, 1, 1))).all()
    assert torch.isnan(fresh.poisoned_empty(1000)).all()  # outputs of the entry points too


@pytest.mark.parametrize(
    ("kernel", "pattern"),
    [
        ("shuffle_after_early_exit", r"__shfl_down_sync at selftest.cu:\d+.*the mask names lane"),
        ("divergent_shuffle", r"called divergently .* __shfl_(down|xor)_sync at selftest.cu"),
        ("mask_without_caller", r"mask 0x00000002\): the mask does not include the calling lane"),
        ("read_outside_mask", r"lane 15 reads lane 16, which is not in the mask"),
        ("barrier_skipped", r"threads 5 exited without reaching this barrier|thread 5 exited"),
        ("divergent_barrier", r"divergent barrier"),
        ("deadlock", r"deadlock: .*threads 32 wait in __shfl_sync.*wait in __syncthreads"),
        ("static_shared_too_large", r"needs 52000 bytes .* more than the 48 KiB"),
    ],
)
@pytest.mark.parametrize(("order", "seed"), SCHEDULES)
def test_each_bug_class_fails_the_launch_with_a_diagnostic(
    fresh, kernel: str, pattern: str, order: str, seed: int
) -> None:
    fresh.set_schedule(order, seed)
    with pytest.raises(RuntimeError, match=r"CUDA kernel failed \(simt emulation\)") as info:
        _run(fresh, kernel, block=(64, 1, 1))
    assert f"of {kernel} launched at selftest.cu:" in str(info.value)
    diagnostics = fresh.take_diagnostics()
    assert len(diagnostics) == 1
    assert re.search(pattern, diagnostics[0]), diagnostics
    # The emulator recovers: the next launch runs normally.
    x = torch.randn(64, dtype=torch.float64)
    torch.testing.assert_close(_run(fresh, "block_sum", x, arg=1, out=1), x.sum().view(1))


@pytest.mark.parametrize(
    ("grid", "block", "smem", "pattern"),
    [
        ((1, 1, 1), (2048, 1, 1), 0, r"has 2048 threads; at most 1024"),
        ((1, 1, 1), (1, 1, 65), 0, r"blockDim.z <= 64"),
        ((1, 70000, 1), (32, 1, 1), 0, r"gridDim.y/z <= 65535"),
        ((0, 1, 1), (32, 1, 1), 0, r"dimension is 0"),
        ((1, 1, 1), (32, 1, 1), 64 * 1024, r"65536 bytes of dynamic shared memory"),
    ],
)
def test_launch_configurations_cuda_rejects_are_rejected(fresh, grid, block, smem, pattern) -> None:
    with pytest.raises(RuntimeError, match=r"invalid configuration argument: invalid launch") as e:
        _run(fresh, "noop", grid=grid, block=block, smem=smem)
    assert re.search(pattern, str(e.value))


def test_rewrite_preserves_lines_and_names_what_it_cannot_handle() -> None:
    source = (
        "template <typename T>\n"
        "void f(T* p) {\n"
        "  __shared__ float tile[32][33];\n"
        "  extern __shared__ double dyn[];\n"
        "  std::vector<std::vector<std::pair<int, int>>> nested;  // >>> stays\n"
        "  k<T>\n"
        "      <<<dim3(2, 1), 64, 0, s>>>(p);\n"
        "}\n"
    )
    out = rewrite_cuda_source(source, "/src/k.cu").split("\n")
    assert out[0] == '#line 1 "/src/k.cu"' and len(out) == source.count("\n") + 2
    assert out[3] == "  auto& tile = ::simt::shared_var<float[32][33]>([] {});"
    assert out[4] == "  double* dyn = ::simt::extern_shared<double>();"
    assert out[5] == source.split("\n")[4]  # a template's >>> and a comment's stay as they are
    assert (
        out[7].strip().startswith('| ::simt::kernel_name("k") | ::simt::launch_config(dim3(2, 1)')
    )
    with pytest.raises(RewriteError, match=r"k.cu:1: cannot rewrite .*one array"):
        rewrite_cuda_source("__shared__ float a[4], b[4];\n", "k.cu")
    with pytest.raises(RewriteError, match=r"never closed"):
        rewrite_cuda_source("k<<<1, 2>>(p);\n", "k.cu")


def test_the_asan_build_reports_an_out_of_bounds_write(emu) -> None:
    """Only meaningful in the AddressSanitizer build (README); in a subprocess, since ASan ends
    the process at the first report."""
    if not emu.asan:
        pytest.skip("the emulator was not built with SYNCBN_EMU_ASAN=1")
    code = (
        "import torch; from cuda_emu.build import load_emulator; "
        "load_emulator().selftest('write_past_the_end', torch.zeros(1, dtype=torch.float64), "
        "[1, 1, 1], [32, 1, 1], 0, 0, 32)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode != 0
    assert "heap-buffer-overflow" in done.stderr and "WRITE of size 8" in done.stderr, done.stderr
    assert "selftest.cu:" in done.stderr  # the report points into the kernel's source
