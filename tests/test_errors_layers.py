"""Sections 2-6 of ``docs/errors.md``: ``SyncBatchNorm`` (constructor and forward), the converter,
``new_sync_group`` and ``step_statistics``.

Each test triggers the error of its row with the row's input and asserts the row's exception type
and message through :func:`_errors_doc.expect_row` (the doc is the one source of both).
Group-size errors that need a world of 4 use torch's in-process ``fake`` backend; the checks they
exercise run before any collective.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _errors_doc import clean_environment, expect_row
from torch import nn
from torch.utils.checkpoint import checkpoint

from syncbn_lightning import (
    CallOrderError,
    SyncBatchNorm,
    SyncDataParallel,
    convert_sync_batchnorm,
    new_sync_group,
    revert_sync_batchnorm,
    step_statistics,
)
from syncbn_lightning.functional import recompute
from syncbn_lightning.functional.gather import GatherExchange
from syncbn_lightning.functional.registry import register_exchange


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher or cluster variables, the default kernels, W&B quiet."""
    clean_environment(monkeypatch)


@pytest.fixture
def world_of_4() -> Iterator[None]:
    """This process as rank 0 of a 4-rank default group (torch's in-process ``fake`` backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- 2. constructor


def test_bn_num_features_zero() -> None:
    with expect_row():
        SyncBatchNorm(0)


def test_bn_num_features_not_int() -> None:
    with expect_row():
        SyncBatchNorm(2.5)  # type: ignore[arg-type]


def test_bn_stats_mode_unknown() -> None:
    with expect_row():
        SyncBatchNorm(4, stats_mode="mean")


def test_bn_eps_zero() -> None:
    with expect_row():
        SyncBatchNorm(4, eps=0.0)


def test_bn_eps_nan() -> None:
    with expect_row():
        SyncBatchNorm(4, eps=float("nan"))


def test_bn_eps_string() -> None:
    with expect_row():
        SyncBatchNorm(4, eps="1e-5")  # type: ignore[arg-type]


def test_bn_momentum_above_one() -> None:
    with expect_row():
        SyncBatchNorm(4, momentum=1.5)


def test_bn_momentum_string() -> None:
    with expect_row():
        SyncBatchNorm(4, momentum="0.1")  # type: ignore[arg-type]


def test_bn_process_group_wrong_type() -> None:
    with expect_row():
        SyncBatchNorm(4, process_group=2)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- 3. forward


def test_bn_input_not_a_tensor() -> None:
    with expect_row():
        SyncBatchNorm(4)([1.0, 2.0])


def test_bn_input_one_dim() -> None:
    with expect_row():
        SyncBatchNorm(4)(torch.randn(4))


def test_bn_input_wrong_channels() -> None:
    with expect_row():
        SyncBatchNorm(4)(torch.randn(2, 5, 3))


def test_bn_input_integer() -> None:
    with expect_row():
        SyncBatchNorm(4)(torch.ones(2, 4, 3, dtype=torch.int64))


def test_bn_input_dtype_differs_from_weight() -> None:
    with expect_row():
        SyncBatchNorm(4)(torch.randn(2, 4, 3, dtype=torch.float64))


def test_bn_input_on_other_device() -> None:
    with expect_row():
        SyncBatchNorm(4)(torch.randn(2, 4, 3, device="meta"))


def test_bn_one_value_per_channel() -> None:
    with expect_row():
        SyncBatchNorm(3)(torch.randn(1, 3))


def test_bn_one_value_per_channel_in_the_group() -> None:
    with expect_row():
        SyncBatchNorm(3, force_sync=True)(torch.randn(1, 3))


def test_bn_process_group_without_this_rank(world_of_4: None) -> None:
    bn = SyncBatchNorm(3)
    bn.process_group = dist.new_group([2, 3])  # what rank 0 gets for a group it is not in
    with expect_row():
        bn(torch.randn(4, 3))


def test_bn_input_dtype_differs_from_running_stats() -> None:
    with expect_row():
        SyncBatchNorm(4, affine=False)(torch.randn(2, 4, 3, dtype=torch.float64))


def _skipping_rank(rank: int, world: int) -> BaseException | None:
    net = convert_sync_batchnorm(
        nn.ModuleDict({"stem": nn.BatchNorm1d(4), "head": nn.BatchNorm1d(4)})
    )
    try:
        if rank == 0:
            net["stem"](torch.randn(3, 4))
        net["head"](torch.randn(3, 4))
    except CallOrderError as exc:
        return exc
    return None


@pytest.mark.distributed
@pytest.mark.slow
def test_bn_call_order_differs_across_ranks() -> None:
    errors = run_distributed(_skipping_rank, 2, timeout=60, pg_timeout_s=30)
    assert errors[0] is not None and str(errors[0]) == str(errors[1])  # every rank raises
    with expect_row():
        raise errors[0]


def _unused_output_rank(rank: int, world: int) -> BaseException | None:
    net = convert_sync_batchnorm(
        nn.ModuleDict({"stem": nn.BatchNorm1d(4), "aux": nn.BatchNorm1d(4)})
    )
    x = torch.randn(3, 4, requires_grad=True)
    out, aux = net["stem"](x), net["aux"](x)
    loss = out.sum() + (aux.square().sum() if rank == 0 else 0.0)  # rank 1 leaves `aux` out
    try:
        loss.backward()
    except CallOrderError as exc:
        return exc
    return None


@pytest.mark.distributed
@pytest.mark.slow
def test_bn_backward_skipped_on_one_rank() -> None:
    errors = run_distributed(_unused_output_rank, 2, timeout=60, pg_timeout_s=30)
    assert errors[0] is not None and str(errors[0]) == str(errors[1])  # every rank raises
    with expect_row():
        raise errors[0]


# ----------------------------------------------------------------------------- 4. convert/revert


def test_convert_uninitialized_lazy_layer() -> None:
    with expect_row():
        convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.LazyBatchNorm2d()))


def test_convert_process_group_wrong_type() -> None:
    with expect_row():
        convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), "world")  # type: ignore[arg-type]


def test_convert_not_a_module() -> None:
    with expect_row():
        convert_sync_batchnorm("model")  # type: ignore[arg-type]


def test_revert_not_a_module() -> None:
    with expect_row():
        revert_sync_batchnorm(None)  # type: ignore[arg-type]


def test_revert_restores_the_input_rank_check() -> None:
    back = revert_sync_batchnorm(convert_sync_batchnorm(nn.BatchNorm2d(4)))
    with expect_row():
        back(torch.randn(2, 4, 3))


def test_revert_direct_layer_one_dim_input() -> None:
    back = revert_sync_batchnorm(SyncBatchNorm(4))
    with expect_row():
        back(torch.randn(4))


def test_bn_synchronized_inside_a_torch_func_transform() -> None:
    layer = SyncBatchNorm(4, force_sync=True)
    x = torch.randn(3, 4, 5)

    def loss(weight: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, {"weight": weight}, (x,)).sum()

    with expect_row():
        torch.func.grad(loss)(layer.weight.detach())


def test_bn_recompute_calls_other_layers_than_its_checkpointed_forward() -> None:
    model = nn.Sequential(SyncBatchNorm(3, force_sync=True), SyncBatchNorm(3, force_sync=True))
    flips = iter([False, True])

    def run(x: torch.Tensor) -> torch.Tensor:  # the recompute swaps the two layers
        first, second = (model[1], model[0]) if next(flips) else (model[0], model[1])
        return second(first(x).relu())

    y = checkpoint(run, torch.randn(4, 3, 5, requires_grad=True), use_reentrant=True)
    with expect_row():
        y.sum().backward()


def test_bn_recompute_setting_unknown(monkeypatch) -> None:
    monkeypatch.setenv("SYNCBN_RECOMPUTE", "sometimes")
    layer = SyncBatchNorm(3, force_sync=True)
    with expect_row():
        checkpoint(layer, torch.randn(4, 3, 5, requires_grad=True), use_reentrant=True)


def test_jit_script_names_revert() -> None:
    model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).eval()
    with expect_row():
        torch.jit.script(model)


# ----------------------------------------------------------------------------- 5. groups


def test_group_without_process_group() -> None:
    with expect_row():
        new_sync_group(2)


def test_group_size_not_int() -> None:
    with expect_row():
        new_sync_group(2.0)  # type: ignore[arg-type]


def test_group_size_not_dividing_world(world_of_4: None) -> None:
    with expect_row():
        new_sync_group(3)


def test_group_size_zero(world_of_4: None) -> None:
    with expect_row():
        new_sync_group(0)


def test_group_size_larger_than_world(world_of_4: None) -> None:
    with expect_row():
        new_sync_group(8)


# ----------------------------------------------------------------------------- 6. step_statistics


def test_step_statistics_normalize_unknown() -> None:
    with expect_row():
        with step_statistics(nn.Sequential(SyncBatchNorm(3)), normalize="batch"):
            pass


def test_step_statistics_step_mode_stats_mode_default() -> None:
    with expect_row():
        with step_statistics(nn.Sequential(SyncBatchNorm(3, stats_mode="default")), "step"):
            pass


def test_step_statistics_step_mode_custom_exchange() -> None:
    register_exchange(_NoPrior())
    with expect_row():
        with step_statistics(nn.Sequential(SyncBatchNorm(3, exchange="no_prior")), "step"):
            pass


def test_step_statistics_step_mode_recompute_without_its_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As on torch 2.4, where the non-reentrant checkpoint's forward cannot be found
    monkeypatch.setattr(recompute, "checkpoint_forward_segment", lambda: None)
    layer = SyncBatchNorm(3, force_sync=True)
    with step_statistics(layer, "step"):
        y = checkpoint(layer, torch.randn(4, 3, requires_grad=True), use_reentrant=False)
        with expect_row():
            y.sum().backward()


class _NoPrior(GatherExchange):
    """A custom exchange that takes no earlier statistics (as one written before them)."""

    name = "no_prior"
    summary = "the gather exchange without earlier statistics (a test's)"
    takes_prior = False


def test_step_statistics_nested() -> None:
    model = nn.Sequential(SyncBatchNorm(3))
    with step_statistics(model):
        with expect_row():
            with step_statistics(model):
                pass


def test_step_statistics_data_parallel() -> None:
    with expect_row():
        with step_statistics(SyncDataParallel(nn.Sequential(SyncBatchNorm(3)))):
            pass


def test_step_statistics_not_a_module() -> None:
    model = nn.Sequential(SyncBatchNorm(3))
    with expect_row():
        with step_statistics(model.parameters()):  # type: ignore[arg-type]
            pass
