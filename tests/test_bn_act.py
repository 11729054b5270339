"""Layer 4: :class:`SyncBatchNormAct` in one process, against BatchNorm then the activation module.

The synchronized path (``force_sync``) with the activation fused into the kernels (ext and
reference), the fallback for activations and drops the kernels do not fuse, the local path, the
state_dict, the argument checks and the revert of a layer built directly.
"""

from __future__ import annotations

import pytest
import torch
from _numerics import assert_one_graph_and_compiled_matches_eager
from torch import nn

from syncbn_lightning import (
    BatchNormActXd,
    SyncBatchNormAct,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from syncbn_lightning.ops.activations import (
    ACTIVATIONS,
    activate,
    activation_grad,
    by_name,
    fused_activation,
)

FUSABLE = {
    "identity": nn.Identity(),
    "relu": nn.ReLU(inplace=True),
    "leaky_relu": nn.LeakyReLU(0.3),
    "silu": nn.SiLU(),
    "hardswish": nn.Hardswish(),
    "gelu": nn.GELU(),
    "relu6": nn.ReLU6(),
}


def _pair(act: nn.Module, drop: nn.Module | None = None, **kwargs) -> tuple[nn.Module, nn.Module]:
    """(ours with force_sync, BatchNorm2d -> drop -> act) with equal parameters, float64."""
    torch.manual_seed(0)
    ours = SyncBatchNormAct(6, act=act, drop=drop, force_sync=True, **kwargs).double()
    bn = nn.BatchNorm2d(6).double()
    with torch.no_grad():
        for layer in (ours, bn):
            layer.weight.copy_(torch.linspace(0.5, 1.5, 6))
            layer.bias.copy_(torch.linspace(-1, 1, 6))
    return ours, nn.Sequential(bn, drop or nn.Identity(), act)


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    bn = layer if isinstance(layer, SyncBatchNormAct) else layer[0]
    return [y.detach(), x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var]


@pytest.mark.parametrize("impl", ["ext", "reference"])
@pytest.mark.parametrize("name", list(FUSABLE))
def test_fused_forward_and_backward_equal_batchnorm_then_activation(name: str, impl: str) -> None:
    ours, want = _pair(FUSABLE[name], impl=impl)
    assert ours.fused_activation == fused_activation(FUSABLE[name]) is not None
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, 7, 4, generator=gen, dtype=torch.float64) * 2 + 0.3
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    for got, expect in zip(_fwd_bwd(ours, x, dy), _fwd_bwd(want, x, dy), strict=True):
        torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("act", "drop"),
    [
        (nn.GELU(approximate="tanh"), None),  # not fused: applied as a module
        (nn.Mish(), None),
        (nn.ReLU(), nn.Dropout(p=0.0)),  # a drop before the activation: both as modules
    ],
    ids=["gelu-tanh", "mish", "dropout"],
)
def test_unfused_activation_or_drop_runs_as_modules(act: nn.Module, drop: nn.Module | None) -> None:
    ours, want = _pair(act, drop, impl="ext")
    assert ours.fused_activation is None
    x = torch.randn(4, 6, 3, 3, dtype=torch.float64)
    dy = torch.randn_like(x)
    for got, expect in zip(_fwd_bwd(ours, x, dy), _fwd_bwd(want, x, dy), strict=True):
        torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-12)


def test_local_path_and_eval_apply_the_activation() -> None:
    layer = SyncBatchNormAct(3, act="silu")  # no process group: F.batch_norm, then SiLU
    x = torch.randn(4, 3, 5)
    torch.testing.assert_close(layer(x), nn.SiLU()(nn.BatchNorm1d(3)(x)))
    layer.eval()
    expect = nn.functional.silu(nn.functional.batch_norm(x, layer.running_mean, layer.running_var))
    torch.testing.assert_close(layer(x), expect)


def test_state_dict_keys_and_revert_of_a_layer_built_directly() -> None:
    layer = SyncBatchNormAct(4, act=nn.PReLU(4))  # an activation with a parameter of its own
    assert list(layer.state_dict()) == [
        "weight", "bias", "running_mean", "running_var", "num_batches_tracked", "act.weight",
    ]  # fmt: skip
    plain = revert_sync_batchnorm(layer)
    assert type(plain) is BatchNormActXd and plain.act is layer.act
    assert list(plain.state_dict()) == list(layer.state_dict())
    x = torch.randn(3, 4, 2, 2)
    expect = layer.act(nn.functional.batch_norm(x, None, None, training=True))
    torch.testing.assert_close(plain(x), expect)
    again = convert_sync_batchnorm(plain)  # and back: BatchNorm + act is what it runs
    assert type(again) is SyncBatchNormAct and again.act is layer.act


def test_bad_act_and_drop_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"act='swish' is not a known activation"):
        SyncBatchNormAct(4, act="swish")
    with pytest.raises(TypeError, match=r"act must be an nn\.Module or None"):
        SyncBatchNormAct(4, act=torch.relu)
    with pytest.raises(TypeError, match=r"drop must be an nn\.Module or None"):
        SyncBatchNormAct(4, drop=0.1)
    assert type(SyncBatchNormAct(4, act=None).act) is nn.Identity


@pytest.mark.parametrize("name", [a.name for a in ACTIVATIONS if a.name != "identity"])
def test_reference_activation_and_derivative_match_torch(name: str) -> None:
    """activate / activation_grad against the torch modules and their autograd, kinks included."""
    module, code = FUSABLE[name], by_name(name).code
    param = 0.3 if name == "leaky_relu" else 0.0
    z = torch.cat([torch.linspace(-8, 8, 4001, dtype=torch.float64), torch.tensor([0.0, -3, 3, 6])])
    z.requires_grad_(True)
    out = module(z.clone()) if name == "relu" else module(z)  # ReLU(inplace) on a leaf's clone
    (grad,) = torch.autograd.grad(out.sum(), z)
    torch.testing.assert_close(activate(z.detach(), code, param), out.detach())
    ours = activation_grad(z.detach(), code, param)
    kinks = z.detach().abs() == 3
    outer = (z.detach()[kinks] > 0).to(grad.dtype)  # the outer pieces' slopes: 0 at -3, 1 at 3
    if name == "hardswish" and not torch.equal(grad[kinks], outer):
        # torch 2.4 takes the inner piece's slope at some kinks (-0.5 at -3, 1.5 at 3, by code
        # path); later releases (2.8 checked) the outer pieces', as the fused kernels do.
        assert torch.equal(ours[kinks], outer)
        ours, grad = ours[~kinks], grad[~kinks]
    torch.testing.assert_close(ours, grad)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ext", "reference"])
def test_compiles_to_one_graph_and_matches_eager(impl: str) -> None:
    """The fused layer's operators carry the activation as arguments: dynamo traces it whole."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3), SyncBatchNormAct(6, act="silu", force_sync=True, impl=impl)
    )
    assert_one_graph_and_compiled_matches_eager(net, torch.randn(4, 3, 8, 8))
