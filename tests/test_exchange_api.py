"""The ``exchange`` setting: validation, plumbing (layer, converter, callback, bn config), the
``"auto"`` rule, call-order and running-mean checks of the reduce exchange, and torch.compile of
it (one graph, compiled == eager on two gloo ranks with an empty batch)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from omegaconf import OmegaConf
from test_compile import _explain, _train_side_by_side, bn_stack, resnet_style
from torch import nn

from syncbn_lightning import (
    CallOrderError,
    SyncBatchNorm,
    SyncBNCallback,
    check_call_order,
    convert_sync_batchnorm,
)
from syncbn_lightning.functional import AUTO_REDUCE_ABOVE, resolve_exchange

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "build",
    [
        lambda value: SyncBatchNorm(4, exchange=value),
        lambda value: convert_sync_batchnorm(nn.BatchNorm1d(4), exchange=value),
        lambda value: SyncBNCallback(exchange=value),
    ],
    ids=["layer", "converter", "callback"],
)
def test_invalid_exchange_names_the_argument_and_the_choices(build: Any) -> None:
    with pytest.raises(ValueError, match=r"exchange must be 'gather'.*'reduce'.*'auto'"):
        build("allreduce")


def test_exchange_reaches_the_layers() -> None:
    model = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), exchange="reduce")
    assert model[0].exchange == "reduce" and "exchange='reduce'" in repr(model[0])
    assert convert_sync_batchnorm(nn.BatchNorm2d(3)).exchange == "auto"
    assert SyncBatchNorm(3).exchange == "auto" and "exchange" not in repr(SyncBatchNorm(3))
    assert SyncBNCallback().exchange is None and SyncBNCallback(exchange="gather").exchange == (
        "gather"
    )


def test_auto_reduces_gpu_tensors_above_eight_ranks_and_gathers_cpu_tensors() -> None:
    assert AUTO_REDUCE_ABOVE == 8
    for device in ("cuda", None):  # None: the GPU rule
        got = [resolve_exchange("auto", p, "g", device).name for p in (2, 8, 9, 4096)]
        assert got == ["gather", "gather", "reduce", "reduce"], device
    assert [resolve_exchange("auto", p, "g", "cpu").name for p in (2, 9, 4096)] == ["gather"] * 3
    assert resolve_exchange("reduce", 2, "g").name == "reduce"
    assert resolve_exchange("gather", 64, "g").name == "gather"
    assert resolve_exchange("reduce", 64, object()).name == "gather"  # DataParallel replicas


def test_bn_config_passes_exchange_to_the_callback() -> None:
    from syncbn_lightning.app.config.jobs import bn_callback

    cfg = OmegaConf.load(ROOT / "conf" / "bn" / "sync.yaml")
    assert cfg.exchange == "auto"
    args = {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "_target_"}
    assert bn_callback(**args).exchange == "auto"
    args["exchange"] = "reduce"
    assert bn_callback(**args).exchange == "reduce"


def test_reduce_without_a_group_is_plain_batch_norm() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4) * 3 + 7
    bn = SyncBatchNorm(3, force_sync=True, exchange="reduce")
    plain = nn.BatchNorm1d(3)
    for _ in range(2):
        torch.testing.assert_close(bn(x), plain(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bn.running_mean, plain.running_mean)
    torch.testing.assert_close(bn.running_var, plain.running_var)
    assert int(bn.num_batches_tracked) == 2


def _order_worker(rank: int, world: int, compiled: bool) -> str:
    layers = nn.ModuleDict({name: SyncBatchNorm(4, exchange="reduce") for name in ("stem", "head")})
    for name, layer in layers.items():
        layer.set_sync_name(name)

    def run(x: torch.Tensor) -> torch.Tensor:  # rank 1 skips the stem's layer
        return layers["head"](layers["stem"](x) if rank == 0 else x)

    if compiled:
        run = torch.compile(run, backend="aot_eager", fullgraph=True)
    try:
        run(torch.randn(2, 4, 3))
    except CallOrderError as exc:
        return f"CallOrderError: {exc}"
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    return "no error"


@pytest.mark.distributed
@pytest.mark.slow
def test_reduce_call_order_mismatch_raises_on_every_rank_naming_both_layers() -> None:
    for rank, message in enumerate(run_distributed(_order_worker, 2, False)):
        assert message.startswith("CallOrderError"), (rank, message)
        assert "rank 0 ran 'stem' (call #1)" in message, message
        assert "rank 1 ran 'head' (call #1)" in message, message


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_reduce_call_order_mismatch_raises_on_every_rank() -> None:
    for message in run_distributed(_order_worker, 2, True, timeout=300):
        assert message.startswith("RuntimeError") and "syncbn call order" in message, message


def _shift_worker(rank: int, world: int) -> str:
    bn = SyncBatchNorm(4, exchange="reduce")
    with torch.no_grad():
        bn.running_mean.add_(rank)  # e.g. each rank loaded another checkpoint
    try:
        bn(torch.randn(2, 4, 3))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
@pytest.mark.slow
def test_reduce_refuses_running_means_that_differ_across_ranks() -> None:
    for message in run_distributed(_shift_worker, 2):
        assert "different running_mean" in message and "exchange='gather'" in message, message


def _compile_worker(rank: int, world: int, sizes: list[int]) -> dict[str, Any]:
    """explain of a ResNet-style model and eager vs compiled (aot_eager) training of a BN stack,
    every layer on the reduce exchange."""
    gen = torch.Generator().manual_seed(100 + rank)
    model = convert_sync_batchnorm(resnet_style(), exchange="reduce")
    out: dict[str, Any] = {"explain": _explain(copy.deepcopy(model), torch.randn(2, 3, 6, 6))}
    x = torch.randn(sizes[rank], 3, 6, 6, generator=gen) * 2 + 1
    stack = convert_sync_batchnorm(bn_stack(), exchange="reduce")
    out["steps"] = _train_side_by_side(stack, x, 3, "aot_eager")
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_reduce_exchange_is_one_graph_and_matches_eager() -> None:
    for rank, result in enumerate(run_distributed(_compile_worker, 2, [3, 0], timeout=600)):
        graphs, breaks, reasons = result["explain"]
        assert (graphs, breaks) == (1, 0), (rank, reasons)
        for step, diffs in enumerate(result["steps"]):
            worst = max(diffs, key=diffs.get)
            assert diffs[worst] <= 1e-5, (rank, step, worst, diffs[worst])


@pytest.mark.parametrize("mismatch", ["layer", "running_mean"])
def test_queued_reduce_check_names_this_ranks_layer_or_the_running_means(mismatch: str) -> None:
    """The deferred check CUDA layers queue (the flag in ``info[2]``, this rank's vector and the
    summed one), run here on CPU tensors: a tag mismatch names this rank's layer and call, a shift
    mismatch the running means."""
    from syncbn_lightning.distributed.call_order.checks import (
        queue_order_check,
        register_layer_name,
    )
    from syncbn_lightning.functional.order_report import KINDS, report_queued
    from syncbn_lightning.ops.reference import steps as reference_steps

    register_layer_name(77, "trunk.bn7")
    x, shift = torch.randn(2, 3, 4), torch.zeros(3)
    sent = reference_steps.reduce_sums(x, shift, 77, torch.full((1,), 4), False)
    tag, other_shift = (78, shift) if mismatch == "layer" else (77, shift + 1)
    other = reference_steps.reduce_sums(x, other_shift, tag, torch.full((1,), 4), False)
    info = torch.tensor([4.0, 2.0, 0.0, 1.0])
    report = (KINDS.index("reduce_sums"), sent, sent + other, sent.numel(), None, 2, 77)
    queue_order_check(info, 2, report_queued, *report)
    expected = CallOrderError if mismatch == "layer" else RuntimeError
    match = r"this rank ran 'trunk.bn7' \(call #5\)" if mismatch == "layer" else "running_mean"
    with pytest.raises(expected, match=match):
        check_call_order()
    check_call_order()  # the queue is empty again
