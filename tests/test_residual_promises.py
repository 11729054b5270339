"""A fused block keeps its modules' promises (issue 54): hooks, grad mode, pruning, later edits.

A fused call is taken only where it is the same call as the block's own forward. Each case here
is checked against the unfused conversion of the same model with the same hooks or edits, on a
one-rank gloo group with ``force_sync`` (every kernel and collective of the synchronized path
runs), in float64: outputs, input and parameter gradients, buffers, and what every hook saw.
Each test also asserts which path ran (the fused layer call, or the block's own forward), so it
proves the path it names. Two ranks: the ``distributed`` tests at the end.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_distributed
from _timm import import_timm
from test_residual import _torchvision
from torch import nn
from torch.nn.utils import parametrize, prune

from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm
from syncbn_lightning.nn.residual import FUSED_FROM, fuse_residual_blocks
from syncbn_lightning.nn.residual_fx import global_hooks_set

RTOL, ATOL = 1e-10, 1e-12


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _UserBlock(nn.Module):
    """A user's block, named in ``fuse_residual``: conv → BN → + x → activation module."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)) + x)


class _NoGradShortcut(nn.Module):
    """A projection shortcut computed under ``no_grad``: its weight must get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.proj = nn.Conv2d(4, 4, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            shortcut = self.proj(x)
        return F.relu(self.bn(self.conv(x)) + shortcut)


class _AutocastHead(nn.Module):
    """Its head under ``torch.autocast`` (bfloat16 on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.conv(x)
        return F.relu(self.bn(y.to(x.dtype)) + x)


class _EnableGradInside(nn.Module):
    """An ``enable_grad`` region in a function defined inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def head(t: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                return self.conv(t)

        return F.relu(self.bn(head(x)) + x)


class _NoGradDecorated(nn.Module):
    """A whole forward under ``@torch.no_grad()`` (the decorator's wrapper has the ``with``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)) + x)


class _Projected(nn.Module):
    """conv → BN → + projected shortcut → ReLU: the base of the cases below, whose shortcut
    projection ``proj`` runs under a state fx would not record."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.proj = nn.Conv2d(4, 4, 1, bias=False)

    def tail(self, x: torch.Tensor, shortcut: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)) + shortcut)


class _NoGradHelper(_Projected):
    """``no_grad`` in a helper method the forward calls (its own code has no ``with``)."""

    def _shortcut(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(x, self._shortcut(x))


class _SetGradCall(_Projected):
    """``torch.set_grad_enabled(False)`` as a call, then back on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.set_grad_enabled(False)
        shortcut = self.proj(x)
        torch.set_grad_enabled(True)
        return self.tail(x, shortcut)


class _ExitStackShortcut(_Projected):
    """``no_grad`` entered through an ``ExitStack``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            shortcut = self.proj(x)
        return self.tail(x, shortcut)


class _ReadsGradMode(_Projected):
    """A path chosen by grad mode: the trace would fix the one it saw."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(x, self.proj(x) if torch.is_grad_enabled() else x)


class _ProfiledHead(_Projected):
    """A ``with`` that changes neither grad mode nor autocast: fused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("head"):
            shortcut = self.proj(x)
        return self.tail(x, shortcut)


# Each block: (build, fuse_residual, tail BatchNorm's name, its activation's name, input shape).
BLOCKS: dict[str, tuple[Callable[[], nn.Module], Any, str, str, tuple[int, ...]]] = {
    "user": (_UserBlock, [_UserBlock], "bn", "act", (3, 4, 5, 5)),
    "torchvision BasicBlock": (
        lambda: _torchvision().models.resnet.BasicBlock(4, 4),
        True,
        "bn2",
        "relu",
        (3, 4, 5, 5),
    ),
    "torchvision Bottleneck": (
        lambda: _torchvision().models.resnet.Bottleneck(8, 2),
        True,
        "bn3",
        "relu",
        (3, 8, 5, 5),
    ),
    "timm BasicBlock": (
        lambda: import_timm().models.resnet.BasicBlock(4, 4),
        True,
        "bn2",
        "act2",
        (3, 4, 5, 5),
    ),
    "timm Bottleneck": (
        lambda: import_timm().models.resnet.Bottleneck(8, 2),
        True,
        "bn3",
        "act3",
        (3, 8, 5, 5),
    ),
}


def _fused_ran(output: torch.Tensor) -> bool:
    """Whether ``output`` came out of the fused layer call (its autograd node is the layer's),
    not out of the block's own forward (an activation's)."""
    return "SyncBatchNorm" in output.grad_fn.name()


def _pair(model: nn.Module, fuse: Any) -> tuple[nn.Module, nn.Module]:
    """The unfused and the fused conversion of ``model`` (float64, force_sync); the fused one
    has every block of the model fused."""
    model = model.double()
    unfused = convert_sync_batchnorm(copy.deepcopy(model), force_sync=True)
    fused = convert_sync_batchnorm(copy.deepcopy(model), force_sync=True, fuse_residual=fuse)
    assert any(hasattr(type(m), FUSED_FROM) for m in fused.modules())
    return unfused, fused


def _step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, input and parameter gradients and buffers of one call of ``model`` on ``x``."""
    x = x.detach().clone().requires_grad_()
    out = model(x)
    result = {"output": out, "fused": torch.tensor(_fused_ran(out))}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.square().sum(), [x, *(p for _, p in params)], allow_unused=True)
    result["grad:x"] = grads[0]
    result.update({f"grad:{n}": g for (n, _), g in zip(params, grads[1:], strict=True)})
    result.update({f"buffer:{n}": b.clone() for n, b in model.named_buffers()})
    return {k: v.detach() for k, v in result.items() if v is not None}


def _assert_same(got: dict[str, Any], want: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if key in skip:
            continue
        torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL, msg=key)


def _input(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# Hooks: on the tail BatchNorm, on the activation, and torch's global module hooks
# ------------------------------------------------------------------------------------------------


def _hook(kind: str, bn: nn.Module, act: nn.Module, seen: list[str]) -> list[Any]:
    """Register the hook ``kind`` on ``bn``/``act`` (or globally); its handles. Every hook notes
    its calls in ``seen``; the forward hooks change what they see, so a skipped one shows in the
    results too."""
    if kind == "bn forward pre-hook":
        return [bn.register_forward_pre_hook(lambda m, i: seen.append("pre"))]
    if kind == "bn forward hook":
        return [bn.register_forward_hook(lambda m, i, o: (seen.append("post"), o * 0.5)[1])]
    if kind == "bn backward hook":
        return [bn.register_full_backward_hook(lambda m, gi, go: seen.append("backward"))]
    if kind == "activation forward hook":
        return [act.register_forward_hook(lambda m, i, o: (seen.append("act"), o + 0.25)[1])]
    assert kind == "global forward hook", kind

    def note(module: nn.Module, inputs: Any, output: Any) -> None:
        seen.append(type(module).__name__)

    return [nn.modules.module.register_module_forward_hook(note)]


HOOKS = (
    "bn forward pre-hook",
    "bn forward hook",
    "bn backward hook",
    "activation forward hook",
    "global forward hook",
)


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("block", list(BLOCKS))
def test_hooks_on_the_tail_run_as_in_the_unfused_block(one_rank, block: str, hook: str) -> None:
    """With the hook set, the fused block runs its own forward: every hook call the unfused block
    makes, and its results (or its error: torch refuses a full backward hook on a module whose
    output the block then adds to in place, ``out += identity``). Removed, the fused call is
    taken again."""
    build, fuse, bn_name, act_name, shape = BLOCKS[block]
    torch.manual_seed(0)
    unfused, fused = _pair(build(), fuse)
    x = _input(shape)
    calls: dict[str, list[str]] = {}
    results: dict[str, Any] = {}
    for name, net in (("unfused", unfused), ("fused", fused)):
        seen: list[str] = []
        handles = _hook(kind=hook, bn=getattr(net, bn_name), act=getattr(net, act_name), seen=seen)
        try:
            results[name] = _step(net, x)
        except RuntimeError as exc:
            results[name] = str(exc)
        finally:
            for handle in handles:
                handle.remove()
        calls[name] = seen
    assert calls["fused"] == calls["unfused"], calls
    if isinstance(results["unfused"], str):
        assert results["fused"] == results["unfused"]
        assert "BackwardHookFunction" in results["unfused"] and hook == "bn backward hook"
    else:
        assert calls["unfused"]
        assert not results["fused"]["fused"]
        _assert_same(results["fused"], results["unfused"])
    again = _step(fused, x)  # no hooks: the fused call again, the same results
    assert again["fused"]
    _assert_same(again, _step(unfused, x), skip=("fused",))


# ------------------------------------------------------------------------------------------------
# Pruning and parametrizations of the tail BatchNorm
# ------------------------------------------------------------------------------------------------


def _train(model: nn.Module, x: torch.Tensor, steps: int = 2) -> dict[str, torch.Tensor]:
    """``steps`` SGD steps of ``model`` on ``x``; the last step's results and the parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        x_grad = x.detach().clone().requires_grad_()
        out = model(x_grad)
        out.square().sum().backward()
        optimizer.step()
    result = {"output": out.detach(), "grad:x": x_grad.grad}
    result.update({f"param:{n}": p.detach().clone() for n, p in model.named_parameters()})
    result.update({f"grad:{n}": p.grad for n, p in model.named_parameters()})
    result.update({f"buffer:{n}": b.clone() for n, b in model.named_buffers()})
    return result


def _resnet18() -> nn.Module:
    """torchvision's ResNet-18 (seeded), its BatchNorm weights and biases drawn (not all 1 and 0:
    pruning by magnitude then has no ties to break)."""
    torch.manual_seed(0)
    model = _torchvision().models.resnet18(weights=None, num_classes=5)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            nn.init.uniform_(module.weight, 0.5, 1.5)
            nn.init.uniform_(module.bias, -0.5, 0.5)
    return model


def test_a_pruned_tail_batchnorm_of_a_fused_resnet_trains_as_the_unfused_one(one_rank) -> None:
    """Network slimming: ``l1_unstructured`` on tail BatchNorms of a fused ResNet-18 (a block
    with and one without a downsample). The pruning's forward pre-hook sends those blocks to
    their own forward; two SGD steps equal the unfused pruned model's."""
    unfused, fused = _pair(_resnet18(), True)
    for net in (unfused, fused):
        for bn in (net.layer1[0].bn2, net.layer2[0].bn2):
            prune.l1_unstructured(bn, "weight", 0.5)
    paths: list[bool] = []
    for block in (fused.layer1[0], fused.layer1[1], fused.layer2[0], fused.layer2[1]):
        block.register_forward_hook(lambda m, i, o: paths.append(_fused_ran(o)))
    x = _input((2, 3, 32, 32))
    got, want = _train(fused, x), _train(unfused, x)
    assert paths == [False, True, False, True] * 2  # the pruned blocks run their own forward
    _assert_same(got, want)
    assert int((fused.layer1[0].bn2.weight == 0).sum()) == 32  # half of 64 channels masked
    assert fused.layer1[0].bn2.weight_orig.grad is not None


class _Positive(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return F.softplus(weight)


def test_a_parametrized_tail_batchnorm_keeps_the_fused_path_and_its_results(one_rank) -> None:
    """``register_parametrization`` on the tail BatchNorm's weight: the layer reads the weight
    through it, on the fused path too."""
    torch.manual_seed(0)
    unfused, fused = _pair(_torchvision().models.resnet.BasicBlock(4, 4), True)
    for net in (unfused, fused):
        parametrize.register_parametrization(net.bn2, "weight", _Positive())
    x = _input((3, 4, 5, 5))
    got, want = _step(fused, x), _step(unfused, x)
    assert got["fused"] and not want["fused"]
    _assert_same(got, want, skip=("fused",))


# ------------------------------------------------------------------------------------------------
# Grad mode and autocast changed or read by a named class's forward
# ------------------------------------------------------------------------------------------------

# Each class the conversion refuses, and what its WARNING names.
STATE_CLASSES: dict[type, str] = {
    _NoGradDecorated: "its forward changes grad mode",
    _NoGradShortcut: "its forward changes grad mode",
    _AutocastHead: "its forward changes cpu autocast",
    _EnableGradInside: "its forward changes grad mode",
    _NoGradHelper: "its forward changes grad mode",
    _SetGradCall: "its forward changes grad mode",
    _ExitStackShortcut: "its forward changes grad mode",
    _ReadsGradMode: "its forward reads grad mode or autocast",
}


def test_a_named_class_whose_forward_changes_grad_mode_or_autocast_is_not_fused(
    one_rank, caplog
) -> None:
    """fx records no context manager and no state a call sets: a class whose forward changes
    grad mode or autocast (a ``with``, a decorator, a helper method, a call, an ``ExitStack``)
    or chooses its path by them is left as it was, with one WARNING per class naming it and the
    reason, and computes what the unfused model computes (a ``no_grad`` shortcut's projection
    gets no gradient). A ``with`` that changes neither (``record_function``) is fused."""
    torch.manual_seed(0)
    refused = list(STATE_CLASSES)
    model = nn.Sequential(
        *(cls() for cls in refused for _ in range(2)), _ProfiledHead(), _UserBlock()
    )
    unfused = convert_sync_batchnorm(copy.deepcopy(model).double(), force_sync=True)
    with caplog.at_level(logging.DEBUG, logger="syncbn_lightning"):
        fused = convert_sync_batchnorm(
            copy.deepcopy(model).double(),
            force_sync=True,
            fuse_residual=[*refused, _ProfiledHead, _UserBlock],
        )
    n = 2 * len(refused)
    assert [hasattr(type(m), FUSED_FROM) for m in fused] == [False] * n + [True, True]
    lines = [r for r in caplog.records if "fuse_residual" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING] * len(refused)
    for index, (record, cls) in enumerate(zip(lines, refused, strict=True)):
        text = record.getMessage()
        assert f"left every {cls.__name__} block as it was ({2 * index}, {2 * index + 1})" in text
        assert STATE_CLASSES[cls] in text, text
    x = _input((3, 4, 5, 5))
    got, want = _step(fused, x), _step(unfused, x)
    _assert_same(got, want, skip=("fused",))
    for i, cls in enumerate(refused):  # the projections run under no_grad get no gradient
        if cls in (_NoGradShortcut, _NoGradHelper, _SetGradCall, _ExitStackShortcut):
            assert (
                f"grad:{2 * i}.proj.weight" not in got
                and f"grad:{2 * i + 1}.proj.weight" not in got
            )
    assert "grad:0.conv.weight" not in got and "grad:x" not in got  # _NoGradDecorated is first
    assert f"grad:{n}.proj.weight" in got and f"grad:{n - 1}.proj.weight" in got
    assert got["fused"] and not want["fused"]  # the last two blocks are fused


def test_a_trace_leaves_grad_mode_and_autocast_as_it_found_them(one_rank) -> None:
    """A forward that sets a state and leaves it (``set_grad_enabled(False)`` as its last call)
    is refused, and the conversion restores the caller's grad mode, inference mode and
    autocast (on, dtype), here all other than torch's defaults."""

    class _Leaves(_Projected):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.tail(x, x)
            torch.set_grad_enabled(False)
            return out

    def state() -> tuple[Any, ...]:
        return (
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
        )

    block = convert_sync_batchnorm(_Leaves().double(), force_sync=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        before = state()
        fuse_residual_blocks(block, [_Leaves])
        assert state() == before == (False, False, True, torch.float16)
    assert not hasattr(type(block), FUSED_FROM)
    with torch.inference_mode():
        before = state()
        fuse_residual_blocks(block, [_Leaves])
        assert state() == before and before[1]


class _InferenceOff(_Projected):
    """An ``inference_mode(False)`` region: a state only the probe's entry shows changed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(False):
            shortcut = self.proj(x)
        return self.tail(x, shortcut)


class _MaybeFrozen(_Projected):
    """A shortcut under ``no_grad`` in some blocks only: the class is refused whole."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.frozen = frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.frozen:
            with torch.no_grad():
                return self.tail(x, self.proj(x))
        return self.tail(x, self.proj(x))


def test_a_class_refused_by_a_later_block_is_refused_whole(one_rank, caplog) -> None:
    """A block fused before another of its class was refused goes back too, and the one
    WARNING names both; an ``inference_mode(False)`` region is refused as well."""
    model = nn.Sequential(_MaybeFrozen(False), _MaybeFrozen(True), _InferenceOff(), _UserBlock())
    model = convert_sync_batchnorm(model.double(), force_sync=True)
    with caplog.at_level(logging.WARNING, logger="syncbn_lightning"):
        fused = fuse_residual_blocks(model, [_MaybeFrozen, _InferenceOff, _UserBlock])
    assert fused == ["3"]
    assert [type(m) for m in model] == [_MaybeFrozen, _MaybeFrozen, _InferenceOff, type(model[3])]
    text = caplog.text
    assert "left every _MaybeFrozen block as it was (0, 1): its forward changes grad mode" in text
    off = "left every _InferenceOff block as it was (2): its forward changes grad mode, inference"
    assert off in text


# What ``Module._call_impl`` reads beside the four dicts ``global_hooks_set`` checks: subsets of
# ``_global_forward_hooks`` (a hook registered with ``always_call`` or ``with_kwargs`` is in it).
_GLOBAL_SUBSETS = {"_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs"}


def test_the_global_hooks_checked_are_the_ones_module_call_reads() -> None:
    """Pins ``global_hooks_set`` against torch: every ``_global_*`` dict ``Module._call_impl``
    reads makes it true when not empty (the subsets through the dict that holds them), and
    every public ``register_module_*`` hook makes it true until removed."""
    module = nn.modules.module
    read = set(re.findall(r"\b_global_\w+", inspect.getsource(nn.Module._call_impl)))
    assert read >= {"_global_forward_hooks", "_global_forward_pre_hooks"}, read
    assert not global_hooks_set()
    for name in sorted(read - _GLOBAL_SUBSETS):
        hooks = getattr(module, name)
        hooks[-1] = lambda *args: None
        try:
            assert global_hooks_set(), name
        finally:
            del hooks[-1]
    register = [
        lambda hook: module.register_module_forward_pre_hook(hook),
        lambda hook: module.register_module_forward_hook(hook),
        lambda hook: module.register_module_forward_hook(hook, always_call=True),
        lambda hook: module.register_module_full_backward_hook(hook),
    ]
    if hasattr(module, "register_module_full_backward_pre_hook"):
        register.append(lambda hook: module.register_module_full_backward_pre_hook(hook))
    if "with_kwargs" in inspect.signature(module.register_module_forward_hook).parameters:
        register.append(lambda hook: module.register_module_forward_hook(hook, with_kwargs=True))
    for index, make in enumerate(register):
        handle = make(lambda *args, **kwargs: None)
        try:
            assert global_hooks_set(), index
        finally:
            handle.remove()
        assert not global_hooks_set(), index


# ------------------------------------------------------------------------------------------------
# The tail edited after the conversion
# ------------------------------------------------------------------------------------------------


class _Wrapped(nn.Module):
    """A wrapper put around the tail BatchNorm later."""

    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.inner = bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 0.5


class _HalfSyncBatchNorm(SyncBatchNorm):
    """A SyncBatchNorm subclass with a forward of its own."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 0.5


def _replacement(kind: str, bn: SyncBatchNorm, force_sync: bool = True) -> nn.Module:
    if kind == "nn.Identity (conv-BN folding)":
        return nn.Identity()
    if kind == "a wrapper":
        return _Wrapped(bn)
    if kind == "a SyncBatchNorm subclass with its own forward":
        half = _HalfSyncBatchNorm(bn.num_features, force_sync=force_sync).double()
        half.load_state_dict(bn.state_dict())
        return half
    assert kind == "a fresh SyncBatchNorm", kind
    fresh = SyncBatchNorm(bn.num_features, force_sync=force_sync).double()
    fresh.load_state_dict(bn.state_dict())
    return fresh


@pytest.mark.parametrize(
    "kind",
    [
        "nn.Identity (conv-BN folding)",
        "a wrapper",
        "a SyncBatchNorm subclass with its own forward",
        "a fresh SyncBatchNorm",
    ],
)
@pytest.mark.parametrize("block", ["user", "torchvision BasicBlock"])
def test_a_tail_batchnorm_replaced_after_fusion_runs_the_blocks_own_forward(
    one_rank, block: str, kind: str
) -> None:
    """Anything but a plain SyncBatchNorm put in the tail's place later sends the block to its
    own forward; a plain one keeps the fused call."""
    build, fuse, bn_name, _, shape = BLOCKS[block]
    torch.manual_seed(0)
    unfused, fused = _pair(build(), fuse)
    for net in (unfused, fused):
        setattr(net, bn_name, _replacement(kind, getattr(net, bn_name)))
    x = _input(shape)
    got, want = _step(fused, x), _step(unfused, x)
    assert got["fused"] is not None and bool(got["fused"]) == (kind == "a fresh SyncBatchNorm")
    _assert_same(got, want, skip=("fused",))


@pytest.mark.parametrize("act", ["tanh", "silu"])
@pytest.mark.parametrize("block", ["user", "torchvision BasicBlock"])
def test_an_activation_replaced_later_is_fused_only_if_the_kernels_fuse_it(
    one_rank, block: str, act: str
) -> None:
    """A guard of the check, not of a bug: an activation the kernels cannot fuse (tanh) runs in
    the block's own forward, one they fuse (SiLU) keeps the fused call; both exact."""
    build, fuse, _, act_name, shape = BLOCKS[block]
    torch.manual_seed(0)
    unfused, fused = _pair(build(), fuse)
    for net in (unfused, fused):
        setattr(net, act_name, nn.Tanh() if act == "tanh" else nn.SiLU())
    x = _input(shape)
    got, want = _step(fused, x), _step(unfused, x)
    assert bool(got["fused"]) == (act == "silu") and not want["fused"]
    _assert_same(got, want, skip=("fused",))


# ------------------------------------------------------------------------------------------------
# Two gloo ranks, float64: fused against unfused, for every case above
# ------------------------------------------------------------------------------------------------

SIZES = [3, 1]
RANK_CASES = (
    "user: bn forward hook",
    "user: activation forward hook",
    "torchvision BasicBlock: bn forward hook",
    "torchvision BasicBlock: activation forward hook",
    "torchvision Bottleneck: bn forward hook",
    "torchvision Bottleneck: activation forward hook",
    "timm BasicBlock: bn forward hook",
    "timm BasicBlock: activation forward hook",
    "no_grad shortcut",
    "user: nn.Identity (conv-BN folding)",
    "torchvision BasicBlock: a SyncBatchNorm subclass with its own forward",
)


def _rank_case(case: str) -> tuple[nn.Module, Any, Callable[[nn.Module], None], tuple[int, ...]]:
    """The model of ``case`` (seeded), its ``fuse_residual``, the edit made to both conversions
    and the whole batch's shape."""
    torch.manual_seed(0)
    if case == "no_grad shortcut":
        return _NoGradShortcut(), [_NoGradShortcut], lambda net: None, (4, 4, 5, 5)
    block, edit = case.split(": ")
    build, fuse, bn_name, act_name, shape = BLOCKS[block]
    shape = (sum(SIZES), *shape[1:])
    if edit in HOOKS:

        def change(net: nn.Module) -> None:
            _hook(edit, getattr(net, bn_name), getattr(net, act_name), [])

    else:

        def change(net: nn.Module) -> None:
            setattr(net, bn_name, _replacement(edit, getattr(net, bn_name), force_sync=False))

    return build(), fuse, change, shape


def _case_on_rank(case: str, rank: int, fuse_it: bool) -> dict[str, torch.Tensor]:
    model, fuse, change, shape = _rank_case(case)
    net = convert_sync_batchnorm(model.double().train(), fuse_residual=fuse if fuse_it else False)
    change(net)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    part = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    result = _step(net, x[part])
    for key, value in result.items():
        if key.startswith("grad:") and key != "grad:x":
            dist.all_reduce(value)
    return result


def _cases_rank(rank: int, world: int, cases: tuple[str, ...]) -> dict[str, Any]:
    """Every case's results on this rank, or the error it raised (the same on every rank: the
    ranks run the same code), so that one failing case does not hide the others."""
    results: dict[str, Any] = {}
    for case in cases:
        try:
            results[case] = {fuse: _case_on_rank(case, rank, fuse) for fuse in (False, True)}
        except Exception as exc:  # reported by the parent, with every other case's verdict
            results[case] = f"{type(exc).__name__}: {exc}"
    return results


def _case_failure(ranks: list[dict[str, Any]], case: str) -> str | None:
    """Why the fused conversion of ``case`` differs from the unfused one on the ranks, or
    ``None``."""
    if isinstance(ranks[0][case], str):
        return ranks[0][case]
    if any(bool(r[case][fuse]["fused"]) for r in ranks for fuse in (False, True)):
        return "the fused call ran: the block's own forward should have"
    unfused = {k: v for k, v in ranks[0][case][False].items() if k != "fused"}
    fused = {k: v for k, v in ranks[0][case][True].items() if k != "fused"}
    for key in ("output", "grad:x"):
        unfused[key] = torch.cat([r[case][False][key] for r in ranks])
        fused[key] = torch.cat([r[case][True][key] for r in ranks])
    if sorted(fused) != sorted(unfused):
        return f"results differ in keys: {sorted(set(fused) ^ set(unfused))}"
    for key, value in unfused.items():
        try:
            torch.testing.assert_close(fused[key], value, rtol=RTOL, atol=ATOL)
        except AssertionError as exc:
            return f"{key}: {str(exc).splitlines()[0]}"
    return None


def _compare_ranks(ranks: list[dict[str, Any]], cases: tuple[str, ...]) -> None:
    failures = {case: _case_failure(ranks, case) for case in cases}
    assert {k: v for k, v in failures.items() if v is not None} == {}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_every_case_on_two_ranks_matches_the_unfused_model_in_float64() -> None:
    """Hooks on the tail BatchNorm and the activation (a user block, torchvision's and timm's),
    the ``no_grad`` shortcut and replaced tail BatchNorms, on 2 gloo ranks with batches of 3 and
    1: outputs, input gradients, summed parameter gradients and running statistics of the fused
    conversion equal the unfused one's."""
    import_timm()  # the timm cases need it: skip here, not in the workers
    ranks = run_distributed(_cases_rank, len(SIZES), RANK_CASES, timeout=300.0)
    _compare_ranks(ranks, RANK_CASES)


def _pruned_rank(rank: int, world: int) -> dict[str, Any]:
    """Two SGD steps of the pruned ResNet-18, unfused and fused, on this rank's part of the
    batch (gradients averaged over the ranks before each step, as DDP does)."""
    model = _resnet18().double().train()
    x = torch.randn(sum(SIZES), 3, 32, 32, generator=torch.Generator().manual_seed(2)).double()
    part = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    results = {}
    for fuse in (False, True):
        net = convert_sync_batchnorm(copy.deepcopy(model), fuse_residual=fuse)
        for bn in (net.layer1[0].bn2, net.layer2[0].bn2):
            prune.l1_unstructured(bn, "weight", 0.5)
        paths: list[bool] = []
        for block in (net.layer1[0], net.layer1[1]):
            block.register_forward_hook(lambda m, i, o, seen=paths: seen.append(_fused_ran(o)))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            optimizer.zero_grad()
            x_part = x[part].clone().requires_grad_()
            out = net(x_part)
            out.square().sum().backward()
            for p in net.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
        result = {"output": out.detach(), "grad:x": x_part.grad}
        result.update({f"param:{n}": p.detach().clone() for n, p in net.named_parameters()})
        result.update({f"grad:{n}": p.grad for n, p in net.named_parameters()})
        result.update({f"buffer:{n}": b.clone() for n, b in net.named_buffers()})
        result["fused"] = torch.tensor(False)  # the head's output: the blocks' paths below
        results[fuse] = result
        assert paths == ([False, True] if fuse else [False, False]) * 2, paths
    return {"pruned resnet18": results}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_pruned_fused_resnet_on_two_ranks_matches_the_unfused_model_in_float64() -> None:
    """Network slimming on 2 gloo ranks: two steps of the fused and the unfused pruned ResNet-18
    give the same outputs, gradients, parameters and running statistics."""
    _torchvision()
    ranks = run_distributed(_pruned_rank, len(SIZES), timeout=300.0)
    _compare_ranks(ranks, ("pruned resnet18",))
