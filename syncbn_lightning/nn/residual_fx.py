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
* any other Python state the forward reads (an attribute changed after the conversion, a global
  flag, the input's Python type) is fixed by the trace. That cannot be checked, which is why
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
from torch import fx, nn
from torch.fx._symbolic_trace import _assert_is_none

from ..ops.activations import fused_activation
from .batchnorm import SyncBatchNorm
from .checks import same_operands

__all__ = ["TracedForward", "fused_tail", "optional_arguments", "trace_block"]

_ADDS = (operator.add, operator.iadd, torch.add)
_RELUS = (F.relu, torch.relu, torch.relu_)
_RELU = nn.ReLU()
_SPECIALIZED = "has been specialized"  # the text of fx's checks of a concrete argument


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
    """A block's rewritten forward: ``modes[block.training](block, x)``, and the generated source
    of each (eval first), which names the subclass that holds them."""

    modes: tuple[Callable[..., Any], Callable[..., Any]]
    sources: tuple[str, str]


class _InPlaceProxy(fx.Proxy):
    """An fx Proxy that records ``a += b`` as ``operator.iadd``: fx's own has no in-place
    operators, so Python runs ``a = a + b`` and the trace loses that the sum keeps ``a``'s dtype
    (``out += shortcut`` with a wider shortcut is not ``out + shortcut``)."""

    def _in_place(self, op: Callable[[Any, Any], Any], other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    def __iadd__(self, other: Any) -> fx.Proxy:
        return self._in_place(operator.iadd, other)

    def __isub__(self, other: Any) -> fx.Proxy:
        return self._in_place(operator.isub, other)

    def __imul__(self, other: Any) -> fx.Proxy:
        return self._in_place(operator.imul, other)

    def __itruediv__(self, other: Any) -> fx.Proxy:
        return self._in_place(operator.itruediv, other)


class _OneLevel(fx.Tracer):
    """Traces a module's own forward: every child module is a leaf; in-place arithmetic stays
    in place."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _InPlaceProxy(node, self)


def _activation_of(node: fx.Node, block: nn.Module) -> Any:
    """The fusable activation ``node`` computes (a module, or ``"relu"``), else ``None``."""
    if node.op == "call_module":
        act = block.get_submodule(str(node.target))
        return act if fused_activation(act) is not None and len(node.args) == 1 else None
    if node.op == "call_function" and node.target in _RELUS and len(node.args) == 1:
        return "relu"
    return None


def _rewrite(graph: fx.Graph, block: nn.Module) -> int:
    """Replace every BatchNorm → add → activation of ``graph`` by one :func:`fused_tail` call;
    returns how many."""
    done = 0
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
        done += 1
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


def trace_block(block: nn.Module) -> TracedForward | str:
    """``block``'s forward rewritten (see the module docstring), or why it cannot be: fx cannot
    trace it, its signature has more than one required input, or its training-mode trace has no
    BatchNorm → add → activation tail."""
    defaults = optional_arguments(type(block))
    if isinstance(defaults, str):
        return defaults
    name = type(block).__name__
    flags = [m.training for m in block.modules()]
    modes: list[Callable[..., Any]] = []
    sources: list[str] = []
    try:
        for training in (False, True):
            block.train(training)
            try:
                graph = _OneLevel().trace(block, concrete_args=defaults or None)
            except Exception as exc:  # fx raises many types for code it cannot follow
                first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                return f"torch.fx cannot trace it ({first})"
            if _rewrite(graph, block) == 0 and training:
                return "no BatchNorm -> add -> activation tail in its traced forward"
            _drop_specialization_checks(graph)
            graph.lint()
            source, function = _compile(graph, name)
            modes.append(function)
            sources.append(source)
    finally:
        for module, flag in zip(block.modules(), flags, strict=True):
            module.training = flag
    return TracedForward((modes[0], modes[1]), (sources[0], sources[1]))
