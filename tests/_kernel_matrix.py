"""The CUDA kernels' test matrix, shared by the GPU tests and their CPU emulation.

``tests/test_cuda.py`` runs it on a GPU with the compiled extension; ``tests/test_cuda_emu.py``
runs the same ``csrc/cuda/*_cuda.cu`` kernels on CPU tensors under the SIMT emulation. Each case
checks all five primitives against the pure-PyTorch reference on the same device and against
float64 truth computed on the CPU, for every layout of the input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _numerics import rel_err, sum_err

from syncbn_lightning.ops import reference as R

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SHAPES = [
    (6, 5),  # (N, C) matrix
    (64, 40),  # channels-last vector path (C % 8 == 0)
    (100, 3),  # channels-last scalar path, C < 32: a partial channel tile
    (3, 5, 17),
    (4, 5, 7, 7),  # S = 49: scalar path, several channels per warp walk
    (3, 5, 37, 41),  # S = 1517 > 256 threads: the index walk's carry branch
    (2, 33, 16, 16),  # C > 32 and odd: two channel tiles in channels-last
    (2, 4, 200, 168),  # 67k values per channel: the reduction splits every channel
    (4, 3, 64, 64),  # C = 3: channels-last reduction split across blocks
    (9000, 1),  # C = 1: one channel, split channels-last reduction
    (2, 5, 3, 4, 5),
    (0, 5, 4, 4),
    (1, 300, 9, 9),
    (3, 4099, 2, 2),  # C >= 4096, odd: many channel blocks
    (8, 4096),
]
# Statistics accumulate in float32 (float64) in another order than the reference and the truth.
STAT_TOL = {torch.float64: 1e-12}
OUT_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def dense_layouts(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` contiguous and, for 3-D to 5-D, channels-last (the kernels' two native layouts)."""
    out = [x.contiguous()]
    if x.dim() == 4:
        out.append(x.contiguous(memory_format=torch.channels_last))
    elif x.dim() == 5:
        out.append(x.contiguous(memory_format=torch.channels_last_3d))
    elif x.dim() == 3:
        out.append(x.transpose(1, 2).contiguous().transpose(1, 2))  # (N, L, C) storage
    return out


def layouts(x: torch.Tensor) -> list[torch.Tensor]:
    """:func:`dense_layouts` and an unaligned view (no 16-byte alignment: no vector path)."""
    out = dense_layouts(x)
    if x.numel() > 0:  # a view 1 element into its storage: no 16-byte alignment, scalar path
        flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        view = flat[1:].view(x.shape)
        view.copy_(x)
        out.append(view)
    return out


def truth_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (mean, m2) of ``x`` in float64 on the CPU."""
    dims = [d for d in range(x.dim()) if d != 1]
    x64 = x.detach().cpu().double()
    if x64.numel() == 0:
        zeros = torch.zeros(x.shape[1], dtype=torch.float64)
        return zeros, zeros.clone()
    mean = x64.mean(dims)
    view = [1, -1] + [1] * (x.dim() - 2)
    return mean, ((x64 - mean.view(view)) ** 2).sum(dims)


def backward_sums(
    dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(float64 sum, float64 sum of magnitudes) of backward_reduce's four outputs' terms."""
    dims = [d for d in range(x.dim()) if d != 1]
    view = [1, -1] + [1] * (x.dim() - 2)
    g, xmu = dy.cpu().double(), x.cpu().double() - mean.cpu().double().view(view)
    terms = [g, g * xmu, g * xmu * invstd.cpu().double().view(view), g]
    return [(t.sum(dims), t.abs().sum(dims)) for t in terms]


def check_primitives(ops: Any, x: torch.Tensor, poison: Callable[[], None] = lambda: None) -> None:
    """All five primitives of ``ops`` on ``x`` (one layout) against the reference and float64.

    ``poison`` runs before every kernel call (on a GPU: leave NaNs in the caching allocator, so
    an output element a kernel forgets to write reads as NaN).
    """
    dtype, device, shape = x.dtype, x.device, tuple(x.shape)
    acc = R.acc_dtype(dtype)
    stat_tol = STAT_TOL.get(dtype, 1e-5)
    poison()
    mean, m2 = ops.local_stats(x)
    assert mean.device == device and mean.dtype == acc and m2.dtype == acc
    t_mean, t_m2 = truth_stats(x)
    assert rel_err(mean, t_mean) <= stat_tol and rel_err(m2, t_m2) <= stat_tol
    r_mean, r_m2 = R.local_stats(x)
    assert rel_err(mean, r_mean) <= stat_tol and rel_err(m2, r_m2) <= stat_tol

    w = torch.rand(shape[1], dtype=acc, device=device) + 0.5
    b = torch.randn(shape[1], dtype=acc, device=device)
    counts = torch.tensor([x.numel() // shape[1], 5, 0], dtype=acc, device=device)
    junk = torch.full_like(mean, float("nan"))  # a zero-count rank's row must be ignored
    means = torch.stack([mean, torch.randn_like(mean), junk])
    m2s = torch.stack([m2, torch.rand_like(m2) * 4, junk])
    poison()
    merged = ops.merge_stats(counts, means, m2s, 1e-5, True)
    want = R.merge_stats(counts[:2], means[:2], m2s[:2], 1e-5, True)
    for got, ref in zip(merged, want, strict=True):
        assert torch.isfinite(got).all() and rel_err(got, ref) <= stat_tol
    g_mean, g_invstd, _ = merged

    poison()
    y = ops.normalize(x, g_mean, g_invstd, w, b)
    assert y.dtype == dtype and y.shape == x.shape and y.stride() == x.stride()
    assert rel_err(y, R.normalize(x, g_mean, g_invstd, w, b)) <= OUT_TOL[dtype]
    poison()
    y0 = ops.normalize(x, g_mean, g_invstd, None, None)
    assert rel_err(y0, R.normalize(x, g_mean, g_invstd, None, None)) <= OUT_TOL[dtype]

    dy = torch.randn(x.shape, dtype=torch.float64).to(dtype).to(device)
    poison()
    got = ops.backward_reduce(dy, x, g_mean, g_invstd, w, True, True)
    truths = backward_sums(dy, x, g_mean, g_invstd)
    for g, (truth, abs_sum) in zip(got, truths, strict=True):
        assert g.device == device and sum_err(g, truth, abs_sum) <= stat_tol
    total = counts.sum()
    poison()
    gx = ops.backward_elemt(dy, x, g_mean, g_invstd, w, got[0], got[1], total)
    rx = R.backward_elemt(dy, x, g_mean, g_invstd, w, got[0], got[1], total)
    assert gx.dtype == dtype and torch.isfinite(gx).all()
    assert rel_err(gx, rx) <= OUT_TOL[dtype]


def base_input(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """The matrix's input for ``shape``: mean 2, std 3, rounded to ``dtype``."""
    return (torch.randn(shape, dtype=torch.float64) * 3 + 2).to(dtype).to(device)


# The 32-bit index band: numel = INT32_MAX - 1000 (odd: the scalar path), where a 32-bit
# grid-stride index of the elementwise kernels wrapped before the fix.
BAND_NUMEL = 2**31 - 1 - 1000
BAND_KERNELS = ("normalize", "backward_elemt")
_BAND_EDGE = 4096


def check_overflow_band(ops: Any, kernel: str, layout: str, device: str) -> None:
    """``ops.<kernel>`` on a float16 input of :data:`BAND_NUMEL` elements, shape (1, 1, numel)
    for ``channels_first`` or (numel, 1) for ``channels_last``: the first and last 4096 outputs
    and a strided sample of the rest against the reference. Needs two 4.3 GB tensors (the input
    doubles as the output gradient of ``backward_elemt``)."""
    shape = (1, 1, BAND_NUMEL) if layout == "channels_first" else (BAND_NUMEL, 1)
    x = torch.full(shape, 1.5, dtype=torch.float16, device=device)
    flat = x.view(-1)
    torch.manual_seed(0)
    flat[:_BAND_EDGE] = torch.randn(_BAND_EDGE).half()
    flat[-_BAND_EDGE:] = torch.randn(_BAND_EDGE).half()
    one = {"dtype": torch.float32, "device": device}
    mean, invstd, weight = (torch.tensor([v], **one) for v in (0.25, 2.0, 0.75))
    sum_dy, sum_dy_xmu, count = (torch.tensor(v, **one) for v in ([3.0], [-2.0], 1e6))

    def run(impl: Any, part: torch.Tensor) -> torch.Tensor:
        if kernel == "normalize":
            return impl.normalize(part, mean, invstd, weight, None)
        return impl.backward_elemt(part, part, mean, invstd, weight, sum_dy, sum_dy_xmu, count)

    got = run(ops, x).view(-1)
    for name, index in (
        ("head", slice(0, _BAND_EDGE)),
        ("tail", slice(BAND_NUMEL - _BAND_EDGE, BAND_NUMEL)),
        ("sample", slice(_BAND_EDGE, BAND_NUMEL - _BAND_EDGE, 1_000_003)),
    ):
        want = run(R, flat[index].view(1, 1, -1)).view(-1)
        err = rel_err(got[index], want)
        assert err <= 2e-3, f"{kernel} {layout}: {name} differs from the reference by {err}"
