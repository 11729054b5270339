"""Layer 5: convert_sync_batchnorm / revert_sync_batchnorm.

Contract: every BatchNorm1d/2d/3d (and torch's SyncBatchNorm) becomes our SyncBatchNorm sharing the
very same Parameter and buffer objects, keeping ``training``, ``requires_grad``, hyper-parameters
and the exact state_dict keys; revert restores the exact original classes; checkpoints move freely
between the converted and the plain model.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _convert_models import (
    HYPERPARAMETERS,
    C,
    Net,
    ScratchBatchNorm2d,
    TaggedBatchNorm2d,
    assert_same_objects,
    assert_state_dicts_equal,
    bn_modules,
    bn_types,
    make_input,
    make_net,
    requires_grad_flags,
    tensor_slots,
    training_flags,
)
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn_lightning
from syncbn_lightning import (
    BatchNormXd,
    SyncBatchNorm,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)


@pytest.fixture
def net() -> Net:
    return make_net()


# --------------------------------------------------------------------------------------------------
# convert


def test_fixture_covers_every_kind_of_batchnorm(net: Net) -> None:
    kinds = set(bn_types(net).values())
    assert {
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.SyncBatchNorm,
        TaggedBatchNorm2d,
    } <= kinds
    layers = bn_modules(net).values()
    assert any(not m.affine for m in layers)
    assert any(not m.track_running_stats for m in layers)
    assert any(m.momentum is None for m in layers)
    assert any(not m.training for m in layers)


def test_convert_replaces_every_batchnorm_and_nothing_else(net: Net) -> None:
    others = {n: m for n, m in net.named_modules() if not isinstance(m, _BatchNorm)}
    names = list(bn_modules(net))
    out = convert_sync_batchnorm(net)
    assert out is net
    assert list(bn_modules(net)) == names
    assert all(t is SyncBatchNorm for t in bn_types(net).values())
    assert_same_objects(
        others, {n: m for n, m in net.named_modules() if not isinstance(m, _BatchNorm)}
    )


def test_convert_shares_parameter_and_buffer_objects(net: Net) -> None:
    before = tensor_slots(net)
    convert_sync_batchnorm(net)
    assert_same_objects(before, tensor_slots(net))


def test_convert_keeps_training_flags(net: Net) -> None:
    before = training_flags(net)
    convert_sync_batchnorm(net)
    assert training_flags(net) == before


def test_convert_keeps_requires_grad(net: Net) -> None:
    before = requires_grad_flags(net)
    assert not all(before.values())
    convert_sync_batchnorm(net)
    assert requires_grad_flags(net) == before


@pytest.mark.parametrize("attr", HYPERPARAMETERS)
def test_convert_keeps_hyperparameters(net: Net, attr: str) -> None:
    before = {name: getattr(m, attr) for name, m in bn_modules(net).items()}
    convert_sync_batchnorm(net)
    assert {name: getattr(m, attr) for name, m in bn_modules(net).items()} == before


def test_convert_keeps_state_dict_keys_order_and_values(net: Net) -> None:
    before = {k: v.clone() for k, v in net.state_dict().items()}
    convert_sync_batchnorm(net)
    assert_state_dicts_equal(net.state_dict(), before)


def test_convert_keeps_state_dict_keys_of_subclass_with_non_persistent_buffer() -> None:
    model = nn.Sequential(ScratchBatchNorm2d(C))
    keys = list(model.state_dict())
    convert_sync_batchnorm(model)
    assert list(model.state_dict()) == keys
    revert_sync_batchnorm(model)
    assert list(model.state_dict()) == keys


def test_convert_passes_options_to_every_layer(net: Net) -> None:
    convert_sync_batchnorm(net, None, force_sync=True, unbiased_running_var=False)
    for m in bn_modules(net).values():
        assert m.process_group is None
        assert m.force_sync is True
        assert m.unbiased_running_var is False


def test_optimizer_built_before_conversion_holds_the_model_parameters(net: Net) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    convert_sync_batchnorm(net)
    held = opt.param_groups[0]["params"]
    params = list(net.parameters())
    assert len(held) == len(params)
    assert all(h is p for h, p in zip(held, params, strict=True))

    weight = net.head[1].weight
    before = weight.detach().clone()
    net(make_input()).square().sum().backward()
    opt.step()
    assert not torch.equal(weight, before)


def test_convert_twice_is_a_noop(net: Net) -> None:
    convert_sync_batchnorm(net)
    layers = bn_modules(net)
    slots = tensor_slots(net)
    assert convert_sync_batchnorm(net) is net
    assert_same_objects(layers, bn_modules(net))
    assert_same_objects(slots, tensor_slots(net))


def test_convert_bare_batchnorm_returns_the_new_layer() -> None:
    bn = nn.BatchNorm2d(C).eval()
    sync = convert_sync_batchnorm(bn)
    assert sync is not bn
    assert type(sync) is SyncBatchNorm
    assert sync.weight is bn.weight and sync.running_var is bn.running_var
    assert sync.training is False
    assert convert_sync_batchnorm(sync) is sync

    back = revert_sync_batchnorm(sync)
    assert type(back) is nn.BatchNorm2d
    assert back.weight is bn.weight and back.running_var is bn.running_var
    assert back.training is False


def test_convert_leaves_models_without_batchnorm_alone() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.GroupNorm(1, 3), nn.LayerNorm(3))
    children = list(model)
    assert convert_sync_batchnorm(model) is model
    assert_same_objects(dict(enumerate(children)), dict(enumerate(model)))


# --------------------------------------------------------------------------------------------------
# revert


def test_revert_restores_exact_classes(net: Net) -> None:
    types = bn_types(net)
    revert_sync_batchnorm(convert_sync_batchnorm(net))
    assert bn_types(net) == types
    assert type(net.body[2]) is nn.SyncBatchNorm
    assert type(net.stem.bn) is TaggedBatchNorm2d
    assert net.stem.bn.tag == "stem"


def test_revert_shares_parameter_and_buffer_objects(net: Net) -> None:
    before = tensor_slots(net)
    revert_sync_batchnorm(convert_sync_batchnorm(net))
    assert_same_objects(before, tensor_slots(net))


def test_revert_keeps_training_flags_and_requires_grad(net: Net) -> None:
    training, grads = training_flags(net), requires_grad_flags(net)
    revert_sync_batchnorm(convert_sync_batchnorm(net))
    assert training_flags(net) == training
    assert requires_grad_flags(net) == grads


def test_revert_keeps_changes_made_while_converted(net: Net) -> None:
    convert_sync_batchnorm(net)
    net.eval()
    net.head[1].eps = 1e-2
    revert_sync_batchnorm(net)
    assert not any(training_flags(net).values())
    assert net.head[1].eps == 1e-2


@pytest.mark.parametrize("attr", HYPERPARAMETERS)
def test_revert_keeps_hyperparameters(net: Net, attr: str) -> None:
    before = {name: getattr(m, attr) for name, m in bn_modules(net).items()}
    revert_sync_batchnorm(convert_sync_batchnorm(net))
    assert {name: getattr(m, attr) for name, m in bn_modules(net).items()} == before


def test_revert_keeps_state_dict(net: Net) -> None:
    before = {k: v.clone() for k, v in net.state_dict().items()}
    revert_sync_batchnorm(convert_sync_batchnorm(net))
    assert_state_dicts_equal(net.state_dict(), before)


@pytest.mark.parametrize(
    ("cls", "good", "bad"),
    [
        (nn.BatchNorm1d, (2, C, 3), (2, C, 3, 3)),
        (nn.BatchNorm2d, (2, C, 3, 3), (2, C, 3)),
        (nn.BatchNorm3d, (2, C, 3, 3, 3), (2, C, 3, 3)),
    ],
)
def test_reverted_layer_checks_input_dim_again(
    cls: type[nn.Module], good: tuple[int, ...], bad: tuple[int, ...]
) -> None:
    sync = convert_sync_batchnorm(cls(C))
    sync(torch.randn(bad))  # ours accepts any (N, C, *)
    back = revert_sync_batchnorm(sync)
    assert type(back) is cls
    back(torch.randn(good))
    with pytest.raises(ValueError, match="expected"):
        back(torch.randn(bad))


def test_revert_direct_syncbatchnorm_gives_batchnormxd() -> None:
    sync = SyncBatchNorm(C, eps=1e-3, momentum=None).eval()
    model = nn.Sequential(nn.Identity(), sync)
    revert_sync_batchnorm(model)
    back = model[1]
    assert type(back) is BatchNormXd
    assert type(revert_sync_batchnorm(SyncBatchNorm(C))) is BatchNormXd
    assert back.weight is sync.weight and back.running_mean is sync.running_mean
    assert back.training is False
    assert (back.eps, back.momentum) == (1e-3, None)
    assert list(back.state_dict()) == list(sync.state_dict())
    for shape in [(3, C), (3, C, 5), (3, C, 2, 2, 2)]:
        x = torch.randn(shape)
        torch.testing.assert_close(back(x), sync(x), rtol=0, atol=0)
    with pytest.raises(ValueError):
        back(torch.randn(C))


def test_batchnormxd_is_exported() -> None:
    assert syncbn_lightning.BatchNormXd is BatchNormXd
    assert "BatchNormXd" in syncbn_lightning.__all__


@pytest.mark.parametrize(
    "cast",
    [lambda m: m.double(), lambda m: m.to(torch.float64)],
    ids=["double", "to_float64"],
)
def test_revert_after_cast_keeps_current_buffers(
    net: Net, cast: Callable[[nn.Module], nn.Module]
) -> None:
    convert_sync_batchnorm(net)
    old_mean = net.head[1].running_mean
    cast(net)
    current = tensor_slots(net)
    assert net.head[1].running_mean is not old_mean  # the cast did replace the buffer
    revert_sync_batchnorm(net)
    assert_same_objects(current, tensor_slots(net))
    for name, m in bn_modules(net).items():
        if m.running_mean is not None:
            assert m.running_mean.dtype == torch.float64, name
            assert m.running_var.dtype == torch.float64, name
        if m.weight is not None:
            assert m.weight.dtype == torch.float64, name
    assert net(make_input().double()).dtype == torch.float64


class _ScaledBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm with a forward of its own, which a SyncBatchNorm would not reproduce."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


def _custom_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, C, 1), _ScaledBatchNorm2d(C), nn.BatchNorm2d(C))


def test_layer_with_its_own_forward_is_refused_by_name_and_nothing_changes() -> None:
    net = _custom_net()
    before = [type(m) for m in net]
    with pytest.raises(ValueError, match=r"cannot convert '1'.*_ScaledBatchNorm2d.*custom_forward"):
        convert_sync_batchnorm(net)
    assert [type(m) for m in net] == before


@pytest.mark.parametrize("mode", ["convert", "skip"])
def test_custom_forward_convert_or_skip(mode: str) -> None:
    net = convert_sync_batchnorm(_custom_net(), custom_forward=mode)
    assert type(net[2]) is SyncBatchNorm
    assert type(net[1]) is (SyncBatchNorm if mode == "convert" else _ScaledBatchNorm2d)
    assert type(revert_sync_batchnorm(net)[1]) is _ScaledBatchNorm2d


def test_custom_forward_must_be_a_known_mode() -> None:
    expected = r"custom_forward must be one of \('error', 'convert', 'skip'\)"
    with pytest.raises(ValueError, match=expected):
        convert_sync_batchnorm(_custom_net(), custom_forward="yes")
