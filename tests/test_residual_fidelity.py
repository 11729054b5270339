"""``fuse_residual`` never changes what a model computes, or what it is (issue 47).

Each block here is written the way people write them, and each case is checked against the
unfused conversion of the same model on a one-rank gloo group with ``force_sync`` (every kernel
and collective of the synchronized path runs), in float64 at float64's tolerance: training and
eval mode, with and without a block's optional arguments, a broadcast add and type-promoting
adds, the block's class and hooks, and pickles (``pickle``, ``torch.save``/``torch.load``,
``copy.deepcopy``) of torchvision, timm and fx-rewritten blocks. Several ranks:
``tests/test_residual_dist.py``.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _timm import import_timm
from test_residual import _torchvision
from torch import nn

from syncbn_lightning import convert_sync_batchnorm, revert_sync_batchnorm
from syncbn_lightning.nn.residual import FUSED_FROM

RTOL, ATOL = 1e-10, 1e-12


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Dropout(nn.Module):
    """Ends in ``F.dropout(y, 0.5, self.training)``: what the forward reads of its mode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(F.relu(self.bn(self.conv(x)) + x), 0.5, self.training)


class _Optional(nn.Module):
    """``forward(x, scale=None)``: a branch on an optional argument."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor, scale: Any = None) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if scale is not None:
            y = y * scale
        return F.relu(y + x)


class _BroadcastBias(nn.Module):
    """``relu(bn(x) + self.b)`` with ``b`` of shape ``[1, C, 1, 1]``: a broadcast add."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.b = nn.Parameter(torch.linspace(-1, 1, 4).view(1, 4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)) + self.b)


class _Promoting(nn.Module):
    """``+`` of a wider dtype (the sum is float64) and ``+=`` of one (the sum keeps float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn1, self.bn2 = (
            nn.Conv2d(4, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.BatchNorm2d(4),
        )
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.act(self.bn1(self.conv(x)) + x.double())
        y = self.bn2(self.conv(x))
        y += wide
        return self.act(y)


class _UserBottleneck(nn.Module):
    """A user's copy of torchvision's Bottleneck, ``downsample`` declared after ``bn3`` as
    torchvision declares it (the state_dict's order differs from the order of use)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes * 4:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False), nn.BatchNorm2d(planes * 4)
            )
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


def _user_bottlenecks() -> nn.Module:
    return nn.Sequential(_UserBottleneck(4, 2, stride=2), _UserBottleneck(8, 2))


def _pair(model: nn.Module, fuse: Any) -> tuple[nn.Module, nn.Module]:
    """The unfused and the fused conversion of ``model`` (float64, force_sync)."""
    model = model.double()
    unfused = convert_sync_batchnorm(copy.deepcopy(model), force_sync=True)
    fused = convert_sync_batchnorm(copy.deepcopy(model), force_sync=True, fuse_residual=fuse)
    return unfused, fused


def _fused_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if hasattr(type(m), FUSED_FROM)]


def _run(
    model: nn.Module, x: torch.Tensor, call: Callable[..., torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Output, input and parameter gradients, buffers of one call of ``model`` on ``x`` (dropout
    drawn from seed 7)."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(7)
    out = (call or model)(x)
    result = {"output": out}
    if model.training:
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(out.square().sum(), [x, *params], allow_unused=True)
        result["grad:x"] = grads[0]
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        result.update({f"grad:{n}": g for n, g in zip(names, grads[1:], strict=True)})
    result.update({f"buffer:{n}": b.clone() for n, b in model.named_buffers()})
    return {k: v.detach() for k, v in result.items() if v is not None}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL, msg=key)


def _both_modes(unfused: nn.Module, fused: nn.Module, x: torch.Tensor, **kwargs: Any) -> None:
    for training in (True, False, True):
        unfused.train(training), fused.train(training)
        got = _run(fused, x, lambda t: fused(t, **kwargs))
        _assert_same(got, _run(unfused, x, lambda t: unfused(t, **kwargs)))


def test_a_block_reading_its_mode_computes_the_same_in_train_and_eval(one_rank) -> None:
    torch.manual_seed(0)
    unfused, fused = _pair(_Dropout(), [_Dropout])
    assert _fused_names(fused) == [""]
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    _both_modes(unfused, fused, x)
    fused.eval()
    first, second = fused(x), fused(x)
    assert torch.equal(first, second)  # eval: no dropout
    assert float((first == 0).double().mean()) < 0.6  # ReLU's zeros only, not dropout's 74 %


def test_a_block_with_optional_arguments_computes_the_same_with_and_without_them(
    one_rank,
) -> None:
    torch.manual_seed(0)
    unfused, fused = _pair(_Optional(), [_Optional])
    assert _fused_names(fused) == [""]
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    _both_modes(unfused, fused, x)
    _both_modes(unfused, fused, x, scale=2.0)
    scale = torch.rand(1, 4, 1, 1, dtype=torch.float64)
    for training in (True, False):
        unfused.train(training), fused.train(training)
        torch.testing.assert_close(fused(x, scale), unfused(x, scale), rtol=RTOL, atol=ATOL)


def test_a_broadcast_add_never_reaches_the_fused_kernel(one_rank) -> None:
    torch.manual_seed(0)
    unfused, fused = _pair(_BroadcastBias(), [_BroadcastBias])
    assert _fused_names(fused) == [""]
    _both_modes(unfused, fused, torch.randn(3, 4, 5, 5, dtype=torch.float64))
    layer, x = fused.bn, torch.randn(3, 4, 5, 5, dtype=torch.float64)
    bias = torch.randn(1, 4, 1, 1, dtype=torch.float64)
    torch.testing.assert_close(layer.add_act(x, bias, nn.ReLU()), F.relu(unfused.bn(x) + bias))


def test_type_promoting_adds_keep_the_dtype_the_unfused_code_gives(one_rank) -> None:
    torch.manual_seed(0)
    model = _Promoting()
    unfused = convert_sync_batchnorm(copy.deepcopy(model), force_sync=True)
    fused = convert_sync_batchnorm(
        copy.deepcopy(model), force_sync=True, fuse_residual=[_Promoting]
    )
    assert _fused_names(fused) == [""]
    x = torch.randn(3, 4, 5, 5)
    want, got = unfused(x), fused(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)


def test_the_torchvision_layout_of_a_users_bottleneck_is_fused_and_exact(one_rank) -> None:
    """``downsample`` declared after ``bn3``: fused (the module order of the state_dict is not
    the order of use), same keys, the same train and eval results."""
    torch.manual_seed(0)
    model = _user_bottlenecks()
    unfused, fused = _pair(model, [_UserBottleneck])
    assert _fused_names(fused) == ["0", "1"]
    assert list(fused.state_dict()) == list(model.state_dict())
    _both_modes(unfused, fused, torch.randn(3, 4, 8, 8, dtype=torch.float64))


def test_a_fused_block_keeps_its_class_and_hooks(one_rank) -> None:
    tv = _torchvision()
    torch.manual_seed(0)
    model = nn.Sequential(tv.models.resnet.BasicBlock(4, 4), _UserBottleneck(4, 1))
    calls: list[str] = []
    model[0].register_forward_hook(lambda m, i, o: calls.append("tv"))
    model[1].register_forward_pre_hook(lambda m, i: calls.append("user-pre"))
    fused = convert_sync_batchnorm(model, force_sync=True, fuse_residual=[_UserBottleneck])
    assert _fused_names(fused) == ["0", "1"]
    assert isinstance(fused[0], tv.models.resnet.BasicBlock)
    assert isinstance(fused[1], _UserBottleneck)
    assert type(fused[0]).__name__ == "BasicBlock" and "BasicBlock(" in repr(fused)
    fused[1].register_forward_hook(lambda m, i, o: calls.append("user-post"))
    fused(torch.randn(2, 4, 6, 6))
    assert calls == ["tv", "user-pre", "user-post"]
    reverted = revert_sync_batchnorm(fused)
    assert type(reverted[0]) is tv.models.resnet.BasicBlock and type(reverted[1]) is _UserBottleneck


def _copies(model: nn.Module) -> dict[str, nn.Module]:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return {
        "pickle": pickle.loads(pickle.dumps(model)),
        "torch.save": torch.load(buffer, weights_only=False),
        "deepcopy": copy.deepcopy(model),
    }


PICKLE_MODELS = ("torchvision resnet18", "timm resnet18d", "fx-rewritten user blocks")


def _pickle_model(name: str) -> tuple[nn.Module, Any]:
    """The model called ``name`` and its ``fuse_residual``; built inside the test, so a missing
    torchvision or timm skips that test only (never the module, at import)."""
    torch.manual_seed(0)
    if name == "torchvision resnet18":
        return _torchvision().models.resnet18(weights=None, num_classes=5), True
    if name == "timm resnet18d":
        return import_timm().create_model("resnet18d", num_classes=5), True
    return (
        nn.Sequential(_user_bottlenecks(), nn.Conv2d(8, 4, 1), _Dropout(), _Optional()),
        [_UserBottleneck, _Dropout, _Optional],
    )


@pytest.mark.parametrize("name", PICKLE_MODELS)
def test_fused_models_survive_pickle_torch_save_and_deepcopy(one_rank, name: str) -> None:
    model, fuse = _pickle_model(name)
    fused = convert_sync_batchnorm(model.double(), force_sync=True, fuse_residual=fuse)
    names = _fused_names(fused)
    assert names
    x = torch.randn(2, 3 if "resnet" in name else 4, 32, 32, dtype=torch.float64)
    for how, loaded in _copies(fused).items():
        assert _fused_names(loaded) == names, how
        assert [type(m).__qualname__ for m in loaded.modules()] == [
            type(m).__qualname__ for m in fused.modules()
        ], how
        source = copy.deepcopy(fused) if how != "deepcopy" else fused
        _assert_same(_run(loaded, x), _run(source, x))
        assert _copies(loaded)["pickle"] is not None  # a loaded model pickles again


def test_a_known_block_whose_drop_path_is_set_later_takes_its_own_forward(one_rank) -> None:
    timm = import_timm()
    torch.manual_seed(0)
    unfused, fused = _pair(timm.create_model("resnet18d", num_classes=5), True)
    assert len(_fused_names(fused)) == 8
    for net in (unfused, fused):
        net.layer1[0].drop_path = nn.Dropout(0.5)
    _both_modes(unfused, fused, torch.randn(2, 3, 32, 32, dtype=torch.float64))


def test_a_named_class_that_cannot_be_fused_or_is_absent_is_logged(caplog) -> None:
    class _NoTail(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(x) * 2

    class _Absent(nn.Module):
        pass

    class _TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor, shortcut: torch.Tensor) -> torch.Tensor:
            return F.relu(self.bn(x) + shortcut)

    model = nn.Sequential(_NoTail(), _TwoInputs())
    with caplog.at_level(logging.WARNING, logger="syncbn_lightning"):
        fused = convert_sync_batchnorm(model, fuse_residual=[_NoTail, _Absent, _TwoInputs])
    assert not _fused_names(fused)
    text = caplog.text
    assert "left 0 (_NoTail) as it was: no BatchNorm -> add -> activation" in text
    assert "left 1 (_TwoInputs) as it was: its forward takes a second required argument" in text
    assert "has no module of class" in text and "_Absent (named in fuse_residual)" in text


@pytest.mark.slow
def test_dla34_computes_what_the_unfused_model_computes(one_rank) -> None:
    """timm's DLA blocks take ``forward(x, shortcut=None, children=None)`` and its root a list:
    not known, so ``fuse_residual=True`` leaves them; named, the calls with one input run fused
    and the others the block's own forward, all exact."""
    timm = import_timm()
    dla = import_timm().models.dla
    torch.manual_seed(0)
    model = timm.create_model("dla34", num_classes=5)
    unfused, known_only = _pair(model, True)
    assert not _fused_names(known_only)
    fused = convert_sync_batchnorm(
        copy.deepcopy(model).double(), force_sync=True, fuse_residual=[dla.DlaBasic, dla.DlaRoot]
    )
    basic = [n for n, m in model.named_modules() if isinstance(m, dla.DlaBasic)]
    assert _fused_names(fused) == basic and len(basic) == 12  # dla34's roots have no shortcut
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    _assert_same(_run(known_only, x), _run(copy.deepcopy(unfused), x))
    _both_modes(unfused, fused, x)
