"""Layer 3: the autograd Function.

* ``gradcheck`` in float64 of the whole Function (single rank, both implementations).
* On real gloo ranks, the hand-written backward (one packed all_reduce) equals autograd through a
  differentiable formulation of the same forward built from ``torch.distributed.nn.all_reduce``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from _dist import run_distributed
from _numerics import rel_err

from syncbn_lightning.functional import sync_batch_norm


@pytest.mark.parametrize("impl", ["ext", "ref"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("affine", [True, False])
def test_gradcheck_float64(
    impl: str, channels_last: bool, affine: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", impl)
    torch.manual_seed(0)
    x = torch.randn(3, 4, 3, 2, dtype=torch.float64) * 2 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    w = (torch.rand(4, dtype=torch.float64) + 0.5).requires_grad_(affine)
    b = torch.randn(4, dtype=torch.float64).requires_grad_(affine)

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return sync_batch_norm(x, w if affine else None, b if affine else None, 1e-5, None, 1)[0]

    assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-6, atol=1e-7)


def test_only_requested_gradients_are_computed() -> None:
    x = torch.randn(4, 3, 5)
    w = torch.ones(3, requires_grad=True)
    b = torch.zeros(3)
    y = sync_batch_norm(x, w, b, 1e-5, None, 1)[0]
    (gw,) = torch.autograd.grad(y.square().sum(), (w,))
    assert gw.shape == (3,) and b.grad is None


@pytest.mark.parametrize("impl", ["ext", "ref"])
def test_create_graph_gives_first_grads_and_refuses_a_second(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backward is not differentiable: with ``create_graph=True`` the first derivative is the
    usual one and differentiating it again raises instead of silently giving zero."""
    monkeypatch.setenv("SYNCBN_IMPL", impl)
    x = (torch.randn(4, 3, 5, dtype=torch.float64) * 2).requires_grad_(True)
    w = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_(True)
    b = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    y = sync_batch_norm(x, w, b, 1e-5, None, 1)[0]
    gx, gw = torch.autograd.grad(y.pow(3).sum(), (x, w), create_graph=True)
    plain = torch.nn.functional.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
    ex, ew = torch.autograd.grad(plain.pow(3).sum(), (x, w))
    assert rel_err(gx, ex) < 1e-10 and rel_err(gw, ew) < 1e-10
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


def _differentiable_sync_bn(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
) -> torch.Tensor:
    """The same maths through autograd: every sum over the group is a differentiable all_reduce."""
    dims = [0, *range(2, x.dim())]
    shape = (1, -1, *([1] * (x.dim() - 2)))
    count = dist_fn.all_reduce(torch.tensor([float(x.numel() // x.shape[1])], dtype=x.dtype))
    mean = dist_fn.all_reduce(x.sum(dims)) / count
    xmu = x - mean.view(shape)
    var = dist_fn.all_reduce(xmu.square().sum(dims)) / count
    return xmu * torch.rsqrt(var + eps).view(shape) * w.view(shape) + b.view(shape)


def _backward_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    sizes = [2, 0, 3][:world]
    out: dict[str, dict[str, float]] = {}
    for impl in ("ext", "ref"):
        os.environ["SYNCBN_IMPL"] = impl
        for channels_last in (False, True):
            gen = torch.Generator().manual_seed(11)
            full = torch.randn(sum(sizes), 3, 4, 5, generator=gen, dtype=torch.float64) * 3 - 1
            dy_full = torch.randn(full.shape, generator=gen, dtype=torch.float64)
            w = torch.rand(3, generator=gen, dtype=torch.float64) + 0.5
            b = torch.randn(3, generator=gen, dtype=torch.float64)
            lo = sum(sizes[:rank])
            x0 = full[lo : lo + sizes[rank]]
            if channels_last:
                x0 = x0.contiguous(memory_format=torch.channels_last)
            dy = dy_full[lo : lo + sizes[rank]]
            grads = []
            for fn in ("ours", "autograd"):
                x = x0.clone().requires_grad_(True)
                wp, bp = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
                if fn == "ours":
                    y = sync_batch_norm(x, wp, bp, 1e-5, None, world)[0]
                else:
                    y = _differentiable_sync_bn(x, wp, bp, 1e-5)
                y.backward(dy)
                # Both give each rank's local weight/bias gradient; compare the group sums.
                gw, gb = wp.grad.clone(), bp.grad.clone()
                dist.all_reduce(gw)
                dist.all_reduce(gb)
                grads.append((y.detach(), x.grad, gw, gb))
            (y1, gx1, gw1, gb1), (y2, gx2, gw2, gb2) = grads
            out[f"{impl}-cl{int(channels_last)}"] = {
                "output": rel_err(y1, y2),
                "grad_input": rel_err(gx1, gx2),
                "grad_weight": rel_err(gw1, gw2),
                "grad_bias": rel_err(gb1, gb2),
            }
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_handwritten_backward_equals_autograd_through_all_reduce(world: int) -> None:
    for rank, per_case in enumerate(run_distributed(_backward_worker, world)):
        for case, errors in per_case.items():
            bad = {k: v for k, v in errors.items() if v > 1e-10}
            assert not bad, f"rank {rank} {case}: {bad}"
