"""Layer 5, the converted model's state: checkpoints move between the converted and the plain
model, a converted model computes what the plain one does without torch.distributed, lazy layers
and wrong process groups give clear errors, and copies/pickles revert to the original classes.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _convert_models import (
    C,
    Net,
    assert_same_objects,
    assert_state_dicts_equal,
    bn_types,
    make_input,
    make_net,
    tensor_slots,
    train_steps,
    training_flags,
)
from torch import nn

from syncbn_lightning import (
    SyncBatchNorm,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)


@pytest.fixture
def net() -> Net:
    return make_net()


# --------------------------------------------------------------------------------------------------
# checkpoints and numerics


def _save_and_load(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    torch.save(state, path)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("force_sync", [False, True], ids=["local", "synchronized_path"])
def test_checkpoint_of_converted_model_loads_into_plain_model(
    tmp_path: Path, force_sync: bool
) -> None:
    # force_sync trains through the synchronized Function (packed collective row, merge kernels).
    converted = convert_sync_batchnorm(make_net(seed=0), force_sync=force_sync)
    stats = converted.head[1].running_mean.clone()
    train_steps(converted)
    assert not torch.equal(converted.head[1].running_mean, stats)

    plain = make_net(seed=1)
    result = plain.load_state_dict(
        _save_and_load(converted.state_dict(), tmp_path / "converted.pt"), strict=True
    )
    assert not result.missing_keys and not result.unexpected_keys
    assert_state_dicts_equal(plain.state_dict(), converted.state_dict())
    x = make_input(seed=99)
    torch.testing.assert_close(plain.eval()(x), converted.eval()(x))


def test_checkpoint_of_plain_model_loads_into_converted_model(tmp_path: Path) -> None:
    plain = make_net(seed=0)
    stats = plain.head[1].running_mean.clone()
    train_steps(plain)
    assert not torch.equal(plain.head[1].running_mean, stats)

    converted = convert_sync_batchnorm(make_net(seed=1))
    result = converted.load_state_dict(
        _save_and_load(plain.state_dict(), tmp_path / "plain.pt"), strict=True
    )
    assert not result.missing_keys and not result.unexpected_keys
    assert_state_dicts_equal(converted.state_dict(), plain.state_dict())
    x = make_input(seed=99)
    torch.testing.assert_close(converted.eval()(x), plain.eval()(x))


@pytest.mark.parametrize("all_training", [False, True], ids=["mixed_modes", "all_training"])
def test_converted_model_matches_plain_model_without_distributed(
    net: Net, all_training: bool
) -> None:
    assert not (dist.is_available() and dist.is_initialized())
    if all_training:
        net.train()
    plain = copy.deepcopy(net)
    converted = convert_sync_batchnorm(net)
    for step in range(3):
        xs = [make_input(seed=step).requires_grad_() for _ in range(2)]
        out_plain, out_conv = plain(xs[0]), converted(xs[1])
        torch.testing.assert_close(out_conv, out_plain, rtol=0, atol=0)
        out_plain.square().sum().backward()
        out_conv.square().sum().backward()
        torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=0, atol=0)
    assert_state_dicts_equal(converted.state_dict(), plain.state_dict())
    for (name, p), q in zip(converted.named_parameters(), plain.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
        else:
            assert p.grad is None and q.grad is None, name


# --------------------------------------------------------------------------------------------------
# errors


def test_convert_uninitialized_lazy_batchnorm_raises() -> None:
    model = nn.Sequential(nn.Conv2d(3, C, 1), nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match="forward pass"):
        convert_sync_batchnorm(model)


def test_convert_initialized_lazy_batchnorm_reverts_to_batchnorm2d() -> None:
    model = nn.Sequential(nn.LazyBatchNorm2d())
    model(torch.randn(2, C, 3, 3))
    convert_sync_batchnorm(model)
    assert type(model[0]) is SyncBatchNorm and model[0].num_features == C
    revert_sync_batchnorm(model)
    assert type(model[0]) is nn.BatchNorm2d


@pytest.mark.parametrize("group", ["world", 0, object()], ids=["str", "int", "object"])
def test_convert_rejects_process_group_of_wrong_type(net: Net, group: object) -> None:
    types = bn_types(net)
    with pytest.raises(TypeError, match="process_group"):
        convert_sync_batchnorm(net, group)  # type: ignore[arg-type]
    assert bn_types(net) == types  # nothing was converted


# --------------------------------------------------------------------------------------------------
# copies


def _pickle_round_trip(model: nn.Module) -> nn.Module:
    return pickle.loads(pickle.dumps(model))


@pytest.mark.parametrize("clone", [copy.deepcopy, _pickle_round_trip], ids=["deepcopy", "pickle"])
def test_copied_converted_model_reverts_to_original_classes(
    net: Net, clone: Callable[[nn.Module], nn.Module]
) -> None:
    types = bn_types(net)
    convert_sync_batchnorm(net)
    twin = clone(net)
    assert all(t is SyncBatchNorm for t in bn_types(twin).values())
    assert_state_dicts_equal(twin.state_dict(), net.state_dict())
    assert twin.head[1].weight is not net.head[1].weight
    assert training_flags(twin) == training_flags(net)

    slots = tensor_slots(twin)
    revert_sync_batchnorm(twin)
    assert bn_types(twin) == types
    assert twin.stem.bn.tag == "stem"
    assert_same_objects(slots, tensor_slots(twin))
    assert_state_dicts_equal(twin.state_dict(), net.state_dict())
    assert all(t is SyncBatchNorm for t in bn_types(net).values())  # the original is untouched
