"""Layer 5: convert_sync_batchnorm / revert_sync_batchnorm.

Contract: every BatchNorm1d/2d/3d (and torch's SyncBatchNorm) becomes our SyncBatchNorm sharing the
very same Parameter and buffer objects, keeping ``training``, ``requires_grad``, hyper-parameters
and the exact state_dict keys; revert restores the exact original classes; checkpoints move freely
between the converted and the plain model.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn_lightning
from syncbn_lightning import (
    BatchNormXd,
    SyncBatchNorm,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)

C = 4
HYPERPARAMETERS = ("num_features", "eps", "momentum", "affine", "track_running_stats")


class TaggedBatchNorm2d(nn.BatchNorm2d):
    """A user subclass carrying an extra attribute (module level, so that it pickles)."""

    def __init__(self, num_features: int, tag: str) -> None:
        super().__init__(num_features)
        self.tag = tag


class ScratchBatchNorm2d(nn.BatchNorm2d):
    """A user subclass with a non-persistent buffer (never part of the state_dict)."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.register_buffer("scratch", torch.zeros(num_features), persistent=False)


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = TaggedBatchNorm2d(C, tag="stem")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class Net(nn.Module):
    """BatchNorm1d/2d/3d nested in a custom module, Sequential and ModuleList, plus edge cases."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = Stem()
        self.body = nn.Sequential(
            nn.BatchNorm2d(C, affine=False),
            nn.ReLU(),
            nn.SyncBatchNorm(C),
            nn.BatchNorm2d(C, track_running_stats=False),
        )
        self.branches = nn.ModuleList(
            [nn.BatchNorm3d(C, momentum=None), nn.BatchNorm3d(C, eps=1e-3, momentum=0.3)]
        )
        self.head = nn.Sequential(nn.Linear(C, C), nn.BatchNorm1d(C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.body(self.stem(x)).unsqueeze(2)
        for bn in self.branches:
            v = bn(v)
        return self.head(v.mean(dim=(2, 3, 4)))


def make_net(seed: int = 0) -> Net:
    """A Net with random affine parameters and running stats, mixed train/eval, some frozen."""
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, _BatchNorm):
                if m.affine:
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.normal_()
                if m.track_running_stats:
                    m.running_mean.normal_()
                    m.running_var.uniform_(0.5, 2.0)
                    m.num_batches_tracked.fill_(3)
    net.body[0].eval()
    net.branches[1].eval()
    net.stem.bn.weight.requires_grad_(False)
    net.head[1].bias.requires_grad_(False)
    return net


def make_input(seed: int = 1) -> torch.Tensor:
    return torch.randn(6, 3, 5, 5, generator=torch.Generator().manual_seed(seed))


def bn_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, _BatchNorm)}


def bn_types(model: nn.Module) -> dict[str, type]:
    return {name: type(m) for name, m in bn_modules(model).items()}


def tensor_slots(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every Parameter and buffer slot (None ones included), keyed by qualified name."""
    slots: dict[str, torch.Tensor | None] = {}
    for prefix, m in model.named_modules():
        for key, value in [*m._parameters.items(), *m._buffers.items()]:
            slots[f"{prefix}.{key}" if prefix else key] = value
    return slots


def assert_same_objects(before: dict[str, object], after: dict[str, object]) -> None:
    assert list(after) == list(before)
    for name, obj in before.items():
        assert after[name] is obj, name


def assert_state_dicts_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def training_flags(model: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in model.named_modules()}


def requires_grad_flags(model: nn.Module) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in model.named_parameters()}


def train_steps(model: nn.Module, steps: int = 3) -> None:
    with torch.no_grad():
        for step in range(steps):
            model(make_input(seed=10 + step))


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
