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
  (:func:`_entry_state`): a node recorded under another state than its trace's entry, or two
  traces that differ, refuse the class (:class:`Refusal`), whatever made the change.
* any other Python state the forward reads (an attribute changed after the conversion, a global
  flag, the input's Python type, a context manager other than those above) is fixed by the
  trace. That cannot be checked, which is why
  only classes a user names are traced (``docs/library.md``, "Fused residual tails").
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import linecache
import operator
import warnings
from collections.abc import Callable, Iterator
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
# The device types whose autocast state a trace records, with the dtype its probe sets (the
# flags are plain thread-local state: setting CUDA's needs no GPU).
_AUTOCAST = (("cpu", torch.bfloat16), ("cuda", torch.float16))
_STATE = "syncbn_context"  # the key of a node's recorded state in ``node.meta``


@dataclass(frozen=True)
class Refusal:
    """Why a block's forward is not rewritten. ``whole_class``: the reason lies in the class's
    code (its forward changes grad mode or autocast, or reads them), so the caller refuses
    every block of the class with one line."""

    reason: str
    whole_class: bool = False


def _context_state() -> tuple[Any, ...]:
    """What a ``with`` (or a call) can change that fx does not record: grad mode, inference mode
    and, per device type of ``_AUTOCAST``, whether autocast is on and its dtype."""
    autocast = tuple(
        (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device, _ in _AUTOCAST
    )
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), *autocast)


def _state_names(entry: tuple[Any, ...], seen: tuple[Any, ...]) -> str:
    """The states that differ between ``entry`` and ``seen`` (of :func:`_context_state`)."""
    names = ["grad mode", "inference mode"] + [f"{device} autocast" for device, _ in _AUTOCAST]
    return ", ".join(n for n, a, b in zip(names, entry, seen, strict=True) if a != b)


@contextlib.contextmanager
def _entry_state(probe: bool) -> Iterator[None]:
    """Trace under grad mode on and autocast off, or (``probe``) the opposite: grad mode off
    and autocast on, so an ``enable_grad`` or ``autocast(enabled=False)`` region changes the
    state too. Restores every state on exit, including one the forward set and left."""
    saved = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d, _ in _AUTOCAST]
    grad = torch.is_grad_enabled()
    try:
        torch.set_grad_enabled(not probe)
        for device, dtype in _AUTOCAST:
            torch.set_autocast_enabled(device, probe)
            torch.set_autocast_dtype(device, dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. autocast("cuda") without a GPU, twice over
            yield
    finally:
        torch.set_grad_enabled(grad)
        for device, enabled, dtype in saved:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)


def _changed_state(graph: fx.Graph, entry: tuple[Any, ...]) -> str | None:
    """The first node of ``graph`` traced under another state than ``entry``, as a reason."""
    for node in graph.nodes:
        seen = node.meta.get(_STATE, entry)
        if seen != entry:
            return (
                f"its forward changes {_state_names(entry, seen)} (at {node.format_node()}), "
                "which torch.fx does not record (a no_grad, enable_grad, inference_mode or "
                "autocast region, a with block or a call, would be lost)"
            )
    return None


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

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta[_STATE] = _context_state()
        return node


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


def _trace(block: nn.Module, defaults: dict[str, Any], probe: bool) -> fx.Graph | Refusal:
    """``block``'s forward traced one level deep from the entry state ``probe`` chooses
    (:func:`_entry_state`), or why not: fx cannot follow it, or a node was traced under another
    grad mode or autocast state than the entry's."""
    with _entry_state(probe):
        entry = _context_state()
        try:
            graph = _OneLevel().trace(block, concrete_args=defaults or None)
        except Exception as exc:  # fx raises many types for code it cannot follow
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            return Refusal(f"torch.fx cannot trace it ({first})")
    changed = _changed_state(graph, entry)
    return graph if changed is None else Refusal(changed, whole_class=True)


def trace_block(block: nn.Module) -> TracedForward | Refusal:
    """``block``'s forward rewritten (see the module docstring), or why it cannot be: its
    signature has more than one required input, fx cannot trace it, it changes or reads grad
    mode or autocast (:func:`_trace`, a reason for the whole class), or its training-mode trace
    has no BatchNorm → add → activation tail."""
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
            graph, probe = _trace(block, defaults, False), _trace(block, defaults, True)
            for result in (graph, probe):
                if isinstance(result, Refusal):
                    return result
            assert isinstance(graph, fx.Graph) and isinstance(probe, fx.Graph)
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
