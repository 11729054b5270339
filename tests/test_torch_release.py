"""The smoke of one torch release: what must hold on every release from the declared floor
(``syncbn_lightning._torch.TORCH_FLOOR``) to the newest. CI runs this file again (slow tests
included) on the floor's torch in a venv of its own (``.ci/run``); ``benchmarks/torch_matrix.py``
runs it and the fast check on several releases and prints the table ``docs/torch-versions.md``
carries.

* ``import syncbn_lightning`` and the public names, before anything is built;
* the C++ extension builds, and a synchronized call takes its C++ path (one operator per
  direction, the backward a C++ autograd node);
* 2 gloo ranks, uneven batches (4 + 2), float64, conv-BN-ReLU-conv-BN converted: the C++ path
  equals ``nn.BatchNorm2d`` on the whole batch (outputs, input and parameter gradients, running
  statistics), without a hang;
* a Lightning fit on 2 CPU processes with ``SyncBNCallback`` converts, synchronizes and ends.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from torch import nn

import syncbn_lightning
from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm

SIZES = [4, 2]


def test_the_package_imports_and_names_its_floor() -> None:
    from syncbn_lightning import _torch

    for name in syncbn_lightning.__all__:
        assert getattr(syncbn_lightning, name) is not None, name
    assert _torch.release(torch.__version__) >= _torch.release(_torch.TORCH_FLOOR)


def test_the_extension_builds_and_a_call_takes_the_cpp_path(tmp_path) -> None:
    from syncbn_lightning.ops import build

    assert build.load_extension() is not None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        layer = SyncBatchNorm(4, force_sync=True)
        y = layer(torch.randn(3, 4, 5, requires_grad=True))
        assert layer._sync_plan.native
        assert y.grad_fn.name() == "syncbn::SyncBatchNormBackward", y.grad_fn.name()
        y.sum().backward()
    finally:
        dist.destroy_process_group()


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 5, 3, padding=1), nn.BatchNorm2d(5),
    ).double()  # fmt: skip


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(SIZES), 3, 5, 4, generator=g, dtype=torch.float64) * 2 + 1
    return x, torch.randn(sum(SIZES), 5, 5, 4, generator=g, dtype=torch.float64)


def _step(net: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    y = net(x)
    y.backward(dy)
    bns = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return {
        "y": y.detach(),
        "dx": x.grad,
        "grads": [p.grad for p in net.parameters()],
        "running": [t for m in bns for t in (m.running_mean, m.running_var)],
        "native": [getattr(m, "_sync_plan", None) and m._sync_plan.native for m in bns],
    }


def _rank_step(rank: int, world: int) -> dict[str, Any]:
    x, dy = _data()
    part = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    return _step(convert_sync_batchnorm(_net()), x[part], dy[part])


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_step_exactly_as_batchnorm_on_the_whole_batch() -> None:
    x, dy = _data()
    whole = _step(_net(), x, dy)
    ranks = run_distributed(_rank_step, 2, timeout=180, pg_timeout_s=60)
    tight = {"rtol": 1e-12, "atol": 1e-12}
    for rank, result in enumerate(ranks):
        part = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
        assert result["native"] == [True, True], result["native"]
        torch.testing.assert_close(result["y"], whole["y"][part], **tight)
        torch.testing.assert_close(result["dx"], whole["dx"][part], rtol=1e-10, atol=1e-10)
        for got, want in zip(result["running"], whole["running"], strict=True):
            torch.testing.assert_close(got, want, **tight)
    summed = [sum(g) for g in zip(*(r["grads"] for r in ranks), strict=True)]
    for got, want in zip(summed, whole["grads"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_lightning_fit_with_the_callback_synchronizes(tmp_path, monkeypatch) -> None:
    from _lightning import fit_ranks

    from syncbn_lightning import SyncBNCallback

    # A port an earlier fit of this process left in the environment may still be held.
    monkeypatch.delenv("MASTER_PORT", raising=False)

    ranks = fit_ranks(tmp_path, "fit", 2, [SyncBNCallback()], max_steps=2)
    for info in ranks:
        assert set(info["fit_end_bn_classes"]) == {"SyncBatchNorm"}, info
