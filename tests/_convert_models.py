"""The model zoo of the converter tests: every kind of BatchNorm (1d/2d/3d, torch's SyncBatchNorm,
user subclasses with extra attributes and non-persistent buffers, affine=False,
track_running_stats=False, momentum=None) nested in custom modules, Sequential and ModuleList, and
helpers that compare tensors, flags and state_dicts; a small residual network for the
device tests. Module level, so that the models pickle.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

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


class ResidualBlock(nn.Module):
    """conv-BN, the input added, ReLU: the residual tail ``fuse_residual`` fuses."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)) + x)


def residual_net(seed: int = 0) -> nn.Sequential:
    """conv-BN-ReLU, two :class:`ResidualBlock` (``net[3]``, ``net[4]``) and a head: a converted
    ResNet's layer kinds in a few layers (3 input channels, 10 outputs)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        ResidualBlock(16), ResidualBlock(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, 10),
    )  # fmt: skip


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
