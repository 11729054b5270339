"""Fused BatchNorm + residual add + activation (issue 42), in one process.

The operators (``merge_normalize``/``reduce_merge_normalize`` with ``residual``,
``grad_sums_residual``) against their pure-PyTorch twins; :meth:`SyncBatchNorm.add_act` against
BatchNorm, add and activation as modules (a one-rank gloo group, ``force_sync``: every kernel
and collective of the synchronized path runs); ``convert_sync_batchnorm(fuse_residual=True)`` on
torchvision's and timm's ResNets and on named fx-traceable blocks, its refusals, revert and
checkpoints. What a fused block must keep (results in every mode and call, class, hooks, pickles):
``tests/test_residual_fidelity.py``. Several ranks: ``tests/test_residual_dist.py``.
"""

from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch
import torch.nn.functional as F
from _fused_cases import FUSED_SHAPES, channels_last, compare, rank_inputs, run_fused
from _numerics import assert_one_graph_and_compiled_matches_eager
from _timm import THIRD_PARTY, import_timm
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from syncbn_lightning.nn.residual import FUSED_FROM
from syncbn_lightning.ops.activations import ACTIVATIONS
from syncbn_lightning.ops.build import load_extension
from syncbn_lightning.ops.reference import steps as reference

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2}
FUSABLE = {a.name: a for a in ACTIVATIONS}


@pytest.fixture(scope="module")
def ops():
    load_extension()
    return torch.ops.syncbn


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group: with ``force_sync`` every collective of the sync path runs."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("act", [0, 1, 2, 3, 5])  # none, relu, leaky_relu, silu, gelu
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
@pytest.mark.parametrize(("sizes", "channels", "spatial"), [FUSED_SHAPES[1], FUSED_SHAPES[4]])
def test_operators_with_a_residual_match_reference(
    ops, sizes, channels, spatial, exchange, dtype, act
) -> None:
    """Uneven and empty ranks, both layouts: outputs, sums, parameter, input and residual
    gradients, running statistics."""
    xs = rank_inputs(sizes, channels, spatial, dtype, seed=act + 17)
    options = {"exchange": exchange, "act": act, "act_param": 0.2, "residual": True}
    for layout in (xs, channels_last(xs)):
        compare(
            run_fused(ops, layout, **options),
            run_fused(reference, layout, **options),
            TOLERANCE[dtype],
        )


@pytest.mark.parametrize("impl", ["ops", "reference"])
def test_a_residual_of_another_shape_or_dtype_is_refused_naming_it(ops, impl) -> None:
    steps = ops if impl == "ops" else reference
    x = torch.randn(3, 4, 5)
    rows = steps.stats_row(x, 1, torch.zeros(1, dtype=torch.long))
    merge = (x, rows, None, None, None, None, None, None, 0.1, 1e-5, True, 1, 0.0, False)
    with pytest.raises(RuntimeError, match=r"`residual` must have the input's shape"):
        steps.merge_normalize(*merge, torch.randn(3, 4, 6))
    with pytest.raises(RuntimeError, match=r"`residual` must have the input's dtype"):
        steps.merge_normalize(*merge, torch.randn(3, 4, 5, dtype=torch.float64))
    out = steps.merge_normalize(*merge[:-1])
    with pytest.raises(RuntimeError, match=r"`residual` must have the input's shape"):
        steps.grad_sums_residual(x, x, out[1], out[3], None, None, x[:2], 1)


def _pair(impl: str, exchange: str) -> tuple[SyncBatchNorm, nn.BatchNorm2d]:
    """A synchronized layer and plain BatchNorm with the same (non-trivial) state, float64."""
    torch.manual_seed(0)
    layer = SyncBatchNorm(6, force_sync=True, impl=impl, exchange=exchange).double()
    nn.init.uniform_(layer.weight, 0.5, 1.5)
    nn.init.uniform_(layer.bias, -0.5, 0.5)
    plain = nn.BatchNorm2d(6).double()
    plain.load_state_dict(layer.state_dict())
    return layer, plain


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.args: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        self.args.append(args)
        return func(*args, **(kwargs or {}))

    def operand(self, name: str, index: int) -> object:
        """Argument ``index`` of the one call of the operator ``name``."""
        (args,) = [a for n, a in zip(self.names, self.args, strict=True) if n == name]
        return args[index]


@pytest.mark.parametrize(
    "act", [None, nn.ReLU(inplace=True), nn.LeakyReLU(0.3), nn.SiLU(), nn.Tanh()]
)
@pytest.mark.parametrize("channels_last_input", [False, True])
@pytest.mark.parametrize("exchange", ["gather", "reduce"])
@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_add_act_equals_batchnorm_add_activation(
    one_rank, impl, exchange, channels_last_input, act
) -> None:
    layer, plain = _pair(impl, exchange)
    x = torch.randn(4, 6, 5, 3, dtype=torch.float64)
    if channels_last_input:
        x = x.contiguous(memory_format=torch.channels_last)
    r = torch.randn(4, 6, 5, 3, dtype=torch.float64)
    x.requires_grad_(), r.requires_grad_()
    with _Ops() as seen:
        y = layer.add_act(x, r, act)
    dy = torch.randn_like(y)
    with _Ops() as seen_backward:
        got = torch.autograd.grad(y, (x, r, layer.weight, layer.bias), dy)
    z = plain(x) + r
    want_y = z if act is None else copy.deepcopy(act)(z)
    want = torch.autograd.grad(want_y, (x, r, plain.weight, plain.bias), dy)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.running_mean, plain.running_mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(layer.running_var, plain.running_var, rtol=1e-12, atol=1e-14)
    fused = not isinstance(act, nn.Tanh)  # tanh is not one the kernels fuse: added after
    if impl == "ext":  # fused: no add of its own, the residual given to the C++ path's steps
        assert ("aten.add.Tensor" in seen.names) is not fused, seen.names
        forward = seen.operand("syncbn.sync_batch_norm_forward.default", 8)  # its residual
        backward = seen_backward.operand("syncbn.sync_batch_norm_backward.default", 4)
        assert (forward is not None) is fused and (backward is not None) is fused


def test_add_act_outside_synchronization_is_plain_batchnorm_add_activation() -> None:
    layer, plain = SyncBatchNorm(3).double(), nn.BatchNorm2d(3).double()
    x, r = (
        torch.randn(2, 3, 4, 4, dtype=torch.float64),
        torch.randn(2, 3, 4, 4, dtype=torch.float64),
    )
    torch.testing.assert_close(layer.add_act(x, r, nn.ReLU()), F.relu(plain(x) + r))
    layer.eval(), plain.eval()
    torch.testing.assert_close(layer.add_act(x, r, nn.SiLU()), F.silu(plain(x) + r))


# ------------------------------------------------------------------------------------------------
# The converter
# ------------------------------------------------------------------------------------------------


def _torchvision():
    """torchvision as installed (the GPU image), else CI's copy (see tests/_timm.py)."""
    try:
        import torchvision
    except (ImportError, RuntimeError):
        import_timm()  # declares what torchvision's Python modules need to import
        sys.path.append(str(THIRD_PARTY))
        try:
            import torchvision
        finally:
            sys.path.remove(str(THIRD_PARTY))
    return torchvision


def _models() -> dict[str, nn.Module]:
    tv, timm = _torchvision(), import_timm()
    torch.manual_seed(0)
    return {
        "resnet18": tv.models.resnet18(weights=None, num_classes=5),
        "resnet50": tv.models.resnet50(weights=None, num_classes=5),
        "resnext50_32x4d": tv.models.resnext50_32x4d(weights=None, num_classes=5),
        "timm_resnet18d": timm.create_model("resnet18d", num_classes=5),
        "timm_resnet26": timm.create_model("resnet26", num_classes=5),
    }


BLOCKS = {
    "resnet18": 8,
    "resnet50": 16,
    "resnext50_32x4d": 16,
    "timm_resnet18d": 8,
    "timm_resnet26": 8,
}


@pytest.mark.slow
def test_resnets_fuse_every_block_and_keep_their_results_and_state(one_rank) -> None:
    """torchvision ResNet/ResNeXt and timm resnet*/resnet*d: every residual block is rewritten;
    one float64 train step equals the unfused conversion; state_dict keys are the plain model's;
    the revert gives every original class back."""
    for name, model in _models().items():
        model = model.double().train()
        keys = list(model.state_dict())
        unfused = convert_sync_batchnorm(copy.deepcopy(model), force_sync=True)
        fused = convert_sync_batchnorm(copy.deepcopy(model), force_sync=True, fuse_residual=True)
        rewritten = [m for m in fused.modules() if hasattr(type(m), FUSED_FROM)]
        assert len(rewritten) == BLOCKS[name], name
        assert list(fused.state_dict()) == keys, name
        x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
        for net in (unfused, fused):
            net(x).square().sum().backward()
        for (key, a), b in zip(unfused.named_parameters(), fused.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=f"{name} {key}")
        for key, value in unfused.state_dict().items():
            torch.testing.assert_close(fused.state_dict()[key], value, msg=f"{name} {key}")
        reverted = revert_sync_batchnorm(fused)
        assert [type(m) for m in reverted.modules()] == [type(m) for m in model.modules()], name


def test_checkpoints_move_between_fused_unfused_and_plain_models() -> None:
    tv = _torchvision()
    torch.manual_seed(1)
    plain = tv.models.resnet18(weights=None, num_classes=5)
    fused = convert_sync_batchnorm(copy.deepcopy(plain), fuse_residual=True)
    unfused = convert_sync_batchnorm(tv.models.resnet18(weights=None, num_classes=5))
    for target, source in ((unfused, fused), (fused, plain), (plain, unfused)):
        target.load_state_dict(source.state_dict())
        for (key, a), b in zip(
            source.state_dict().items(), target.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), key
    x = torch.randn(2, 3, 32, 32)
    plain.eval(), fused.eval()
    torch.testing.assert_close(fused(x), plain(x))


def test_blocks_it_cannot_fuse_are_left_as_they_were_with_a_debug_line(caplog) -> None:
    """timm's SE-ResNet puts squeeze-excitation between the last BatchNorm and the add: left,
    each block named in a DEBUG line with the reason."""
    timm = import_timm()
    model = timm.create_model("seresnet18", num_classes=5)
    before = [type(m) for m in model.modules()]
    with caplog.at_level(logging.DEBUG, logger="syncbn_lightning"):
        converted = convert_sync_batchnorm(model, fuse_residual=True)
    assert not [m for m in converted.modules() if hasattr(type(m), FUSED_FROM)]
    lines = [r.getMessage() for r in caplog.records if "fuse_residual: left" in r.getMessage()]
    assert len(lines) == 8, lines
    assert "layer1.0 (BasicBlock)" in lines[0] and "squeeze-excitation" in lines[0], lines[0]
    reverted = revert_sync_batchnorm(converted)
    assert [type(m) for m in reverted.modules()] == before


class _ModuleAct(nn.Module):
    """conv → BN → + x → activation module (fx rewrites it)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)) + x)


class _FunctionalRelu(nn.Module):
    """In-place add, then ``torch.relu`` (fx rewrites it too)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        y += x
        return torch.relu(y)


class _DataDependent(nn.Module):
    """Control flow on a tensor's value: fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x)
        return F.relu(y + x) if x.sum() > 0 else F.relu(y - x)


class _BnUsedTwice(nn.Module):
    """The BatchNorm's output also feeds something else: not a tail to fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x)
        return F.relu(y + x) * y


def test_fx_rewrites_the_named_traceable_blocks_and_leaves_the_rest(one_rank, caplog) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(
        _ModuleAct(nn.SiLU()), _FunctionalRelu(), _DataDependent(), _BnUsedTwice()
    ).double()
    classes = [type(m) for m in model]
    unfused = convert_sync_batchnorm(copy.deepcopy(model), force_sync=True)
    with caplog.at_level(logging.DEBUG, logger="syncbn_lightning"):
        fused = convert_sync_batchnorm(copy.deepcopy(model), force_sync=True, fuse_residual=classes)
    assert [type(m).__name__ for m in fused] == [
        "_ModuleAct",
        "_FunctionalRelu",
        "_DataDependent",
        "_BnUsedTwice",
    ]
    assert all(isinstance(m, cls) for m, cls in zip(fused, classes, strict=True))
    assert [hasattr(type(m), FUSED_FROM) for m in fused] == [True, True, False, False]
    for block in fused[:2]:
        assert "fused_tail" in type(block)._syncbn_traced_forward.sources[1]
    refusals = {r.getMessage(): r.levelno for r in caplog.records if "left" in r.getMessage()}
    assert refusals == {
        next(k for k in refusals if k.startswith(prefix)): logging.WARNING
        for prefix in (
            "fuse_residual: left 2 (_DataDependent) as it was: torch.fx cannot trace it",
            "fuse_residual: left 3 (_BnUsedTwice) as it was: no BatchNorm -> add -> activation",
        )
    }, refusals
    assert list(fused.state_dict()) == list(model.state_dict())
    x = torch.randn(3, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    outs = [net(x) for net in (unfused, fused)]
    grads = [
        torch.autograd.grad(o.square().sum(), [x, *net.parameters()])
        for o, net in zip(outs, (unfused, fused), strict=True)
    ]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-9)  # conv biases: ~0 before BN
    fused.eval()
    reverted = revert_sync_batchnorm(fused)
    assert [type(m) for m in reverted] == [type(m) for m in model]
    assert not reverted[0].training and isinstance(reverted[0].bn, nn.BatchNorm2d)


def test_blocks_of_classes_not_named_are_not_traced(caplog) -> None:
    """``fuse_residual=True`` fuses the known classes only: a user's block is left to its own
    forward unless its class is named."""
    model = nn.Sequential(_ModuleAct(nn.ReLU()), _FunctionalRelu())
    with caplog.at_level(logging.DEBUG, logger="syncbn_lightning"):
        fused = convert_sync_batchnorm(copy.deepcopy(model), fuse_residual=True)
    assert [type(m) for m in fused] == [type(m) for m in model]
    assert "fuse_residual" not in caplog.text


def test_fuse_residual_takes_a_bool_or_block_classes() -> None:
    with pytest.raises(TypeError, match="fuse_residual must be True, False or a list"):
        convert_sync_batchnorm(nn.BatchNorm2d(3), fuse_residual="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"each entry must be a torch\.nn\.Module subclass"):
        convert_sync_batchnorm(nn.BatchNorm2d(3), fuse_residual=[int])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"cannot import the block class 'torch\.nn\.NoSuchBlock'"):
        convert_sync_batchnorm(nn.BatchNorm2d(3), fuse_residual=["torch.nn.NoSuchBlock"])
    net = nn.Sequential(_ModuleAct(nn.ReLU()))
    path = f"{_ModuleAct.__module__}._ModuleAct"
    converted = convert_sync_batchnorm(net, fuse_residual=[path])
    assert getattr(type(converted[0]), FUSED_FROM) is _ModuleAct


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_fused_blocks_compile_to_one_graph_and_match_eager(impl: str) -> None:
    """A fused torchvision BasicBlock (downsample included) and an fx-rewritten block: dynamo
    traces the fused operators whole (no process group: the kernels without collectives)."""
    tv = _torchvision()
    torch.manual_seed(0)
    down = nn.Sequential(nn.Conv2d(4, 8, 1, stride=2), nn.BatchNorm2d(8))
    tail = _ModuleAct(nn.ReLU())
    tail.conv, tail.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
    net = nn.Sequential(tv.models.resnet.BasicBlock(4, 8, stride=2, downsample=down), tail)
    net = convert_sync_batchnorm(net, force_sync=True, impl=impl, fuse_residual=[_ModuleAct])
    assert hasattr(type(net[0]), FUSED_FROM) and hasattr(type(net[1]), FUSED_FROM)
    assert_one_graph_and_compiled_matches_eager(net, torch.randn(4, 4, 8, 8))
