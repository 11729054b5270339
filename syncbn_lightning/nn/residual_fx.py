"""The ``torch.fx`` half of ``fuse_residual``: blocks of classes :mod:`.residual` does not know.

A candidate is a module with a :class:`~syncbn_lightning.SyncBatchNorm` among its direct children
(containers and the known block classes aside). Its own ``forward`` is traced one level deep
(every child module a leaf), and each ``bn(x) + other`` whose sum feeds only an activation the
kernels fuse (an activation module, or ``F.relu``/``torch.relu``) becomes one call of
:meth:`SyncBatchNorm.add_act <syncbn_lightning.SyncBatchNorm.add_act>`, provided the
BatchNorm's output feeds nothing else. The block is then replaced by the resulting
``GraphModule``, which holds the same child objects under the same names (the rewrite is refused
when the state_dict keys would change). The original block is kept beside it, outside the module
tree, for :func:`unfuse_traced_blocks`.

What fx cannot trace (control flow on tensor values, calls it cannot see through), what has no
such tail, and the model's root module are left as they were, with a DEBUG line saying why.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..ops.activations import fused_activation
from .batchnorm import SyncBatchNorm

__all__ = ["fuse_traced_blocks", "unfuse_traced_blocks"]

log = logging.getLogger("syncbn_lightning")

_ORIGINAL_BLOCK = "_syncbn_original_block"
_ADDS = (operator.add, operator.iadd, torch.add)
_RELUS = (F.relu, torch.relu, torch.relu_)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def add_act(
    bn: SyncBatchNorm, input: torch.Tensor, residual: torch.Tensor, act: Any
) -> torch.Tensor:
    """What a rewritten graph calls: ``bn.add_act(input, residual, act)``; ``act`` is a module
    or ``"relu"`` (a functional ReLU in the traced code)."""
    return bn.add_act(input, residual, _RELU if act == "relu" else act)


_RELU = nn.ReLU()
torch.fx.wrap("add_act")  # a leaf for any later trace of a rewritten block


class _OneLevel(fx.Tracer):
    """Traces a module's own forward: every child module is a leaf."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _activation_of(node: fx.Node, block: nn.Module) -> Any:
    """The fusable activation ``node`` computes (a module, or ``"relu"``), else ``None``."""
    if node.op == "call_module":
        act = block.get_submodule(str(node.target))
        return act if fused_activation(act) is not None else None
    if node.op == "call_function" and node.target in _RELUS and len(node.args) == 1:
        return "relu"
    return None


def _rewrite(graph: fx.Graph, block: nn.Module) -> int:
    """Replace every BatchNorm → add → activation of ``graph`` by one ``add_act`` call; returns
    how many."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.users) != 1 or len(node.args) != 1:
            continue
        if not isinstance(block.get_submodule(str(node.target)), SyncBatchNorm):
            continue
        add = next(iter(node.users))
        if add.op != "call_function" or add.target not in _ADDS or add.kwargs:
            continue
        if len(add.args) != 2 or len(add.users) != 1:
            continue
        other = add.args[1] if add.args[0] is node else add.args[0]
        act_node = next(iter(add.users))
        act = _activation_of(act_node, block)
        if act is None or not isinstance(other, fx.Node):
            continue
        with graph.inserting_before(act_node):
            bn = graph.get_attr(str(node.target))
            act_arg = act if act == "relu" else graph.get_attr(str(act_node.target))
            fused = graph.call_function(add_act, (bn, node.args[0], other, act_arg))
        act_node.replace_all_uses_with(fused)
        for dead in (act_node, add, node):
            graph.erase_node(dead)
        done += 1
    return done


def _candidate(module: nn.Module) -> bool:
    return not isinstance(module, (SyncBatchNorm, *_CONTAINERS)) and any(
        isinstance(child, SyncBatchNorm) for child in module.children()
    )


def _traced(name: str, block: nn.Module) -> fx.GraphModule | None:
    """``block`` rewritten, or ``None`` (logged) when it cannot be."""
    try:
        graph = _OneLevel().trace(block)
    except Exception as exc:  # fx raises many types for code it cannot follow
        log.debug(
            "fuse_residual: left %s (%s) as it was: torch.fx cannot trace it (%s)",
            name,
            type(block).__name__,
            str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
        )
        return None
    if _rewrite(graph, block) == 0:
        log.debug(
            "fuse_residual: left %s (%s) as it was: no BatchNorm -> add -> activation "
            "tail in its traced forward",
            name,
            type(block).__name__,
        )
        return None
    graph.lint()
    rewritten = fx.GraphModule(block, graph, class_name=type(block).__name__)
    if list(rewritten.state_dict()) != list(block.state_dict()):
        log.debug(
            "fuse_residual: left %s (%s) as it was: its traced forward leaves out some of "
            "its parameters or buffers (the state_dict keys would change)",
            name,
            type(block).__name__,
        )
        return None
    rewritten.train(block.training)
    object.__setattr__(rewritten, _ORIGINAL_BLOCK, block)
    return rewritten


def fuse_traced_blocks(model: nn.Module, skip: set[str]) -> list[str]:
    """Rewrite the candidate blocks of ``model`` (not the root, not the names in ``skip``, nor
    inside them) through ``torch.fx``; returns the rewritten blocks' names."""
    done: list[str] = []
    for name, block in list(model.named_modules()):
        if not name or any(name == s or name.startswith(s + ".") for s in skip | set(done)):
            continue
        if hasattr(block, _ORIGINAL_BLOCK) or hasattr(type(block), "_syncbn_fused_from"):
            continue
        if not _candidate(block):
            continue
        rewritten = _traced(name, block)
        if rewritten is None:
            continue
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).add_module(child, rewritten)
        done.append(name)
    return done


def unfuse_traced_blocks(model: nn.Module) -> nn.Module:
    """Put back every block :func:`fuse_traced_blocks` replaced; returns ``model``, or its
    original when ``model`` itself is a rewritten block."""
    original = getattr(model, _ORIGINAL_BLOCK, None)
    if original is not None:
        original.training = model.training
        return original
    for name, block in list(model.named_modules()):
        original = getattr(block, _ORIGINAL_BLOCK, None)
        if original is not None and name:
            original.training = block.training  # its own flag stayed outside the module tree
            parent, _, child = name.rpartition(".")
            model.get_submodule(parent).add_module(child, original)
    return model
