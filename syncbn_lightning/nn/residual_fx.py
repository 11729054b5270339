"""The ``torch.fx`` half of ``fuse_residual``: the block classes a user names.

:func:`trace_block` traces a block's own ``forward`` one level deep (every child module a leaf),
once in training and once in eval mode, and rewrites each ``bn(x) + other`` whose sum feeds only
an activation the kernels fuse (an activation module, or ``F.relu``/``torch.relu``) into one call
of :func:`fused_tail`, provided the BatchNorm's output feeds nothing else. The result is two plain
functions ``forward(self, x)`` (one per mode) that :mod:`.residual` puts on a subclass of the
block's own class: the block keeps its identity, hooks, state_dict and pickles.

What a trace can and cannot guarantee, and so when the rewritten forward runs:

* ``self.training`` (of the block or its children) read by the forward: a trace per mode, each
  used only in its mode.
* optional arguments (``forward(x, shortcut=None)``): traced with their defaults; a call that
  passes anything beyond the one required input runs the class's own forward.
* a broadcast or type-promoting add (``bn(x) + self.bias`` of shape ``[1, C, 1, 1]``):
  :func:`fused_tail` checks the operands at every call and adds as the original code did
  when the shapes, dtypes or devices differ.
* the tail's modules: each call first checks, for every fused tail, that the BatchNorm is still
  a plain :class:`SyncBatchNorm` and the activation one the kernels fuse, with no hooks on
  either and no global module hooks (:func:`tail_intact`); otherwise the block's own forward
  runs, which calls them through ``__call__``.
* grad mode and autocast: fx records no context manager and no state a call sets, so a
  ``no_grad``, ``enable_grad``, ``inference_mode`` or ``autocast`` region (a ``with`` in the
  forward, in a helper method or a decorator, ``torch.set_grad_enabled(False)`` as a call, an
  ``ExitStack``) would vanish from the trace. Every node records the grad mode, inference mode
  and autocast state it was traced under, and each mode is traced twice, from opposite states
  (:mod:`.fx_trace`): a node recorded under another state than its trace's entry, or two
  traces that differ, refuse the class (:class:`~.fx_trace.Refusal`), whatever made the change.
* any other Python state the forward reads (an attribute changed after the conversion, a global
  flag, the input's Python type, a context manager other than those above) is fixed by the
  trace. That cannot be checked, which is why
  only classes a user names are traced (``docs/library.md``, "Fused residual tails").
"""

from __future__ import annotations

import hashlib
import inspect
import linecache
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.nn.modules.module as torch_module  # where torch keeps its global module hooks
from torch import fx, nn
from torch.fx._symbolic_trace import _assert_is_none

from ..ops.activations import fused_activation
from .batchnorm import SyncBatchNorm
from .checks import same_operands
from .fx_trace import Refusal, trace_one_level

__all__ = [
    "Refusal",
    "TracedForward",
    "fused_tail",
    "global_hooks_set",
    "optional_arguments",
    "plain_batchnorm",
    "tail_intact",
    "trace_block",
]

_ADDS = (operator.add, operator.iadd, torch.add)
_RELUS = (F.relu, torch.relu, torch.relu_)
_RELU = nn.ReLU()
_SPECIALIZED = "has been specialized"  # the text of fx's checks of a concrete argument


def plain_batchnorm(module: Any) -> bool:
    """Whether ``module`` is a :class:`SyncBatchNorm` whose call, ``forward`` and ``add_act`` are
    the library's own: ``add_act`` then computes what ``act(module(x) + r)`` computes (a subclass
    with a forward of its own, a wrapper or ``nn.Identity`` put there later is not)."""
    cls = type(module)
    if cls is SyncBatchNorm:
        return True
    return (
        isinstance(module, SyncBatchNorm)
        and cls.forward is SyncBatchNorm.forward
        and cls.add_act is SyncBatchNorm.add_act
        and cls._forward is SyncBatchNorm._forward
        and cls.__call__ is nn.Module.__call__
        and cls._call_impl is nn.Module._call_impl
    )


def global_hooks_set() -> bool:
    """Whether any of torch's global module hooks is registered (``register_module_forward_hook``
    and the like): then every module's ``__call__`` runs them, and no fused call may skip one."""
    m = torch_module
    return bool(
        m._global_forward_hooks
        or m._global_forward_pre_hooks
        or m._global_backward_hooks
        or m._global_backward_pre_hooks
    )


def _hooked(module: nn.Module) -> bool:
    """Whether ``module.__call__`` would run hooks of the module's own (the dicts torch's
    ``_call_impl`` reads to choose its fast path)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def tail_intact(bn: Any, act: Any) -> bool:
    """Whether :func:`fused_tail` ``(bn, x, r, act, ...)`` is the same call as ``act(bn(x) + r)``
    through the modules' ``__call__``: ``bn`` a :func:`plain_batchnorm`, ``act`` ``"relu"`` or an
    activation module the kernels fuse, neither with hooks. Global module hooks are the caller's
    check (:func:`global_hooks_set`, once per block call). A few dict and type checks."""
    if not plain_batchnorm(bn) or _hooked(bn):
        return False
    if isinstance(act, str):
        return True
    return isinstance(act, nn.Module) and not _hooked(act) and fused_activation(act) is not None


def fused_tail(
    bn: SyncBatchNorm, input: torch.Tensor, residual: Any, act: Any, inplace: bool
) -> torch.Tensor:
    """``act(bn(input) + residual)`` as the rewritten code calls it: one
    :meth:`SyncBatchNorm.add_act` call when the operands match; otherwise BatchNorm, the add
    (``+=`` when ``inplace``: the result keeps the normalized output's dtype, as ``out +=
    shortcut`` does) and ``act`` (a module, or ``"relu"``) one by one."""
    module = _RELU if act == "relu" else act
    if inplace and not same_operands(input, residual):
        output = bn(input)
        output += residual
        return module(output)
    return bn.add_act(input, residual, module)


@dataclass(frozen=True)
class TracedForward:
    """A block's rewritten forward: ``modes[block.training](block, x)``, the generated source
    of each (eval first), which names the subclass that holds them, and the fused tails of
    both: ``(BatchNorm, activation)`` module paths, ``None`` for ``F.relu``/``torch.relu``."""

    modes: tuple[Callable[..., Any], Callable[..., Any]]
    sources: tuple[str, str]
    tails: tuple[tuple[str, str | None], ...]

    def intact(self, block: nn.Module) -> bool:
        """Whether every fused tail of ``block`` is still :func:`tail_intact` (the global module
        hooks are the caller's check)."""
        for bn_path, act_path in self.tails:
            bn = _child(block, bn_path)
            act = "relu" if act_path is None else _child(block, act_path)
            if not tail_intact(bn, act):
                return False
        return True


def _child(block: nn.Module, path: str) -> Any:
    """The submodule at ``path`` (a direct child's name, or dotted), ``None`` if there is none."""
    if "." not in path:
        return block._modules.get(path)  # not Module.__getattr__: ~0.7 us per name
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def _activation_of(node: fx.Node, block: nn.Module) -> Any:
    """The fusable activation ``node`` computes (a module, or ``"relu"``), else ``None``."""
    if node.op == "call_module":
        act = block.get_submodule(str(node.target))
        return act if fused_activation(act) is not None and len(node.args) == 1 else None
    if node.op == "call_function" and node.target in _RELUS and len(node.args) == 1:
        return "relu"
    return None


def _rewrite(graph: fx.Graph, block: nn.Module) -> list[tuple[str, str | None]]:
    """Replace every BatchNorm → add → activation of ``graph`` by one :func:`fused_tail` call;
    returns the module paths of each (BatchNorm, activation), ``None`` for a functional ReLU."""
    done: list[tuple[str, str | None]] = []
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.users) != 1 or len(node.args) != 1 or node.kwargs:
            continue
        if not isinstance(block.get_submodule(str(node.target)), SyncBatchNorm):
            continue
        add = next(iter(node.users))
        if add.op != "call_function" or add.target not in _ADDS or add.kwargs:
            continue
        if len(add.args) != 2 or len(add.users) != 1:
            continue
        inplace = add.target is operator.iadd
        if inplace and add.args[0] is not node:
            continue  # `other += bn(x)` changes `other` itself, which others may read
        other = add.args[1] if add.args[0] is node else add.args[0]
        act_node = next(iter(add.users))
        act = _activation_of(act_node, block)
        if act is None or not isinstance(other, fx.Node) or other is node:
            continue
        with graph.inserting_before(act_node):
            bn = graph.get_attr(str(node.target))
            act_arg = act if act == "relu" else graph.get_attr(str(act_node.target))
            fused = graph.call_function(fused_tail, (bn, node.args[0], other, act_arg, inplace))
        act_node.replace_all_uses_with(fused)
        for dead in (act_node, add, node):
            graph.erase_node(dead)
        done.append((str(node.target), None if act == "relu" else str(act_node.target)))
    return done


def _drop_specialization_checks(graph: fx.Graph) -> None:
    """Remove fx's per-call checks that an optional argument has its default: the rewritten
    forward runs only for calls that pass none (:func:`trace_block`)."""
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        if node.target not in (_assert_is_none, torch._assert):
            continue
        if not any(_SPECIALIZED in str(arg) for arg in node.args[1:]):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        for source in inputs:
            if source.op == "call_function" and source.target is operator.eq and not source.users:
                graph.erase_node(source)


def optional_arguments(cls: type) -> dict[str, Any] | str:
    """The defaults of ``cls.forward``'s optional parameters (traced as constants), or why the
    forward cannot be traced for calls with one input."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return "its forward has no signature to inspect"
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = parameters[0] if parameters else None
    if first is None or first.kind not in positional or first.default is not first.empty:
        return "its forward does not take one required positional input"
    defaults: dict[str, Any] = {}
    for parameter in parameters[1:]:
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            return f"its forward takes *args or **kwargs ({parameter})"
        if parameter.default is parameter.empty:
            return f"its forward takes a second required argument ({parameter.name})"
        defaults[parameter.name] = parameter.default
    return defaults


def _compile(graph: fx.Graph, name: str) -> tuple[str, Callable[..., Any]]:
    """The generated source of ``graph`` as a function ``forward(self, x, ...)``."""
    code = graph.python_code(root_module="self")
    digest = hashlib.sha1(code.src.encode()).hexdigest()[:12]
    filename = f"<fuse_residual {name} {digest}>"
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(True), filename)
    namespace = dict(code.globals)
    exec(compile(code.src, filename, "exec"), namespace)  # fx's own generated code
    return code.src, namespace["forward"]


def trace_block(block: nn.Module) -> TracedForward | Refusal:
    """``block``'s forward rewritten (see the module docstring), or why it cannot be: its
    signature has more than one required input, fx cannot trace it, it changes or reads grad
    mode or autocast (:func:`~.fx_trace.trace_one_level`, a reason for the whole class), or its
    training-mode trace has no BatchNorm → add → activation tail."""
    defaults = optional_arguments(type(block))
    if isinstance(defaults, str):
        return Refusal(defaults)
    name = type(block).__name__
    flags = [m.training for m in block.modules()]
    modes: list[Callable[..., Any]] = []
    sources: list[str] = []
    tails: dict[tuple[str, str | None], None] = {}
    try:
        for training in (False, True):
            block.train(training)
            graph = trace_one_level(block, defaults, probe=False)
            if isinstance(graph, Refusal):
                return graph
            probe = trace_one_level(block, defaults, probe=True)
            if isinstance(probe, Refusal):
                return probe
            if graph.python_code("self").src != probe.python_code("self").src:
                return Refusal(
                    "its forward reads grad mode or autocast (traced with each on and off, it "
                    "differs), which the trace would fix",
                    whole_class=True,
                )
            rewritten = _rewrite(graph, block)
            if not rewritten and training:
                return Refusal("no BatchNorm -> add -> activation tail in its traced forward")
            tails.update(dict.fromkeys(rewritten))
            _drop_specialization_checks(graph)
            graph.lint()
            source, function = _compile(graph, name)
            modes.append(function)
            sources.append(source)
    finally:
        for module, flag in zip(block.modules(), flags, strict=True):
            module.training = flag
    return TracedForward((modes[0], modes[1]), (sources[0], sources[1]), tuple(tails))
