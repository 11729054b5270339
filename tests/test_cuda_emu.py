"""Layer 0 without a GPU: the kernels of ``csrc/cuda/*.cu`` run on CPU tensors under SIMT emulation.

``pytest -m cuda_emu``. The CUDA source is rewritten at build time (``tests/cuda_emu/build.py``)
and every kernel runs with one fiber per CUDA thread, one block at a time, under three thread
schedules (forward, reverse, seeded random); shared memory and every output are poisoned with
NaN first, and any diagnostic of the emulation (a barrier some threads skip, a shuffle naming an
exited lane, divergent warp ops, deadlock, a launch configuration CUDA rejects) fails the launch.
The matrix is the GPU tests' own (``tests/_kernel_matrix.py``). By default a quick selection
runs (every shape and dtype under the forward schedule, every shape under reverse and random
in float32, and ``normalize`` in the 32-bit index band); ``SYNCBN_EMU_FULL=1`` runs
every combination.

The emulation checks the kernels' logic: indexing, synchronization, reductions and numerics
with host floating point (no FMA contraction, so results match a GPU within tolerance, not
bitwise). It has no memory model, no concurrency between blocks and says nothing about speed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from _kernel_matrix import DTYPES, SHAPES, base_input, check_primitives, layouts
from cuda_emu.build import load_emulator

# The emulation build takes minutes on 2 cores: outside the fast check (`-m cuda_emu` runs it).
pytestmark = [pytest.mark.cuda_emu, pytest.mark.slow]

FULL = os.environ.get("SYNCBN_EMU_FULL") == "1"
SCHEDULES = [("forward", 0), ("reverse", 0), ("random", 1)]


def _in_quick_matrix(dtype: torch.dtype, schedule: str) -> bool:
    # Synchronization does not depend on the dtype: the other orders run in float32 only.
    return schedule == "forward" or dtype == torch.float32


CASES = [
    pytest.param(shape, dtype, order, seed, id=f"{shape}-{dtype}-{order}")
    for shape in SHAPES
    for dtype in DTYPES
    for order, seed in SCHEDULES
    if FULL or _in_quick_matrix(dtype, order)
]


@pytest.fixture(scope="module")
def emu():
    module = load_emulator()
    module.set_schedule("forward", 0)
    yield module
    module.set_schedule("forward", 0)


@pytest.fixture
def clean(emu):
    """Clears the emulator's records before a test and requires no diagnostic after it."""
    emu.take_diagnostics()
    emu.take_launches()
    emu.take_stats()
    yield emu
    assert emu.take_diagnostics() == []


@pytest.mark.parametrize(("shape", "dtype", "order", "seed"), CASES)
def test_emulated_kernels_match_reference_and_float64(
    clean, shape: tuple[int, ...], dtype: torch.dtype, order: str, seed: int
) -> None:
    clean.set_schedule(order, seed)
    torch.manual_seed(zlib.crc32(repr((shape, str(dtype), "cuda")).encode()))
    for x in layouts(base_input(shape, dtype, "cpu")):
        check_primitives(clean, x)
    assert clean.take_stats()["launches"] > 0  # the emulated kernels ran, not a fallback


def _all_outputs(emu, x: torch.Tensor) -> list[torch.Tensor]:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = x.shape[1]
    mean, m2 = emu.local_stats(x)
    counts = torch.tensor([x.numel() // c, 7.0], dtype=acc)
    g_mean, invstd, var = emu.merge_stats(
        counts, torch.stack([mean, mean * 0.5]), torch.stack([m2, m2 + 1]), 1e-5, True
    )
    w = torch.linspace(0.5, 1.5, c, dtype=acc)
    y = emu.normalize(x, g_mean, invstd, w, None)
    values = torch.sin(torch.arange(x.numel(), dtype=torch.float64)).reshape(x.shape)
    dy = torch.empty_like(x).copy_(values)  # x's strides, whatever its layout
    sums = emu.backward_reduce(dy, x, g_mean, invstd, w, True, True)
    gx = emu.backward_elemt(dy, x, g_mean, invstd, w, sums[0], sums[1], counts.sum())
    return [mean, m2, g_mean, invstd, var, y, *sums, gx]


@pytest.mark.parametrize(
    "shape", [(2, 4, 200, 168), (4, 3, 64, 64), (9000, 1), (3, 5, 37, 41)], ids=str
)
def test_kernels_are_bitwise_deterministic_across_thread_schedules(
    clean, shape: tuple[int, ...]
) -> None:
    """Fixed-order folds: the result does not depend on which thread or block runs first."""
    torch.manual_seed(3)
    base = base_input(shape, torch.float32, "cpu")
    for x in layouts(base)[:2]:
        runs = []
        for order, seed in SCHEDULES:
            clean.set_schedule(order, seed)
            runs.append(_all_outputs(clean, x))
        for other in runs[1:]:
            for a, b in zip(runs[0], other, strict=True):
                assert torch.equal(a, b)


def test_the_matrix_covers_every_kernel_path(clean) -> None:
    """Split reductions in both layouts, the fold, vector and scalar elementwise paths."""
    clean.set_schedule("forward", 0)
    for shape in SHAPES:
        for x in layouts(base_input(shape, torch.float32, "cpu")):
            if x.numel():
                _all_outputs(clean, x)
    launches = clean.take_launches()
    split = {r["kernel"] for r in launches if r["grid"][1] > 1}
    assert {"reduce_channels_first_kernel", "reduce_channels_last_kernel"} <= split
    kernels = {r["kernel"] for r in launches}
    assert {
        "fold_partials_kernel",
        "chan_merge_kernel",
        "elemt_channels_first_kernel",
        "elemt_channels_last_kernel",
    } <= kernels
    elementwise = [r["function"] for r in launches if r["kernel"].startswith("elemt_")]
    assert any("VEC = 1;" in f for f in elementwise) and any("VEC = 4;" in f for f in elementwise)
    # channels-last reductions: the 16-byte vector launch and the scalar one (two launch sites)
    assert len({r["site"] for r in launches if r["kernel"] == "reduce_channels_last_kernel"}) == 2
    many_channels = [r for r in launches if r["kernel"] == "reduce_channels_last_kernel"]
    assert max(r["grid"][0] for r in many_channels) >= 4096 // 32  # C >= 4096: 128 channel tiles


BAND_CASES = [("normalize", "channels_last")] + (
    [
        ("backward_elemt", "channels_last"),
        ("normalize", "channels_first"),
        ("backward_elemt", "channels_first"),
    ]
    if FULL
    else []
)


@pytest.mark.slow
@pytest.mark.parametrize(("kernel", "layout"), BAND_CASES)
def test_elementwise_kernels_in_the_32_bit_overflow_band(kernel: str, layout: str) -> None:
    """numel = INT32_MAX - 1000 on the scalar path: 32-bit indices whose grid-stride step wrapped
    read and wrote ~4 GiB outside the buffers. In a subprocess, since that is a crash here too."""
    done = subprocess.run(
        [sys.executable, "-m", "cuda_emu.band", kernel, layout],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    output = (done.stdout + done.stderr)[-3000:]
    if done.returncode < 0:
        pytest.fail(f"{kernel} ({layout}) was killed by {signal.Signals(-done.returncode).name}")
    assert done.returncode == 0 and output.startswith("ok"), output
