"""One-level ``torch.fx`` tracing of a block's forward for :mod:`.residual_fx`, which records
what fx does not: the grad mode, inference mode and autocast state each node was traced under.

fx runs a forward once with proxies and keeps the calls, not the Python around them: a ``with
torch.no_grad()``, an ``autocast`` region, ``torch.set_grad_enabled(False)`` as a call or an
``ExitStack`` that enters one leave no node, so the rewritten forward would run without them.
:func:`trace_one_level` stores each node's state in ``node.meta`` and refuses a trace in which a
node's state differs from the trace's entry state; a caller traces twice, from opposite entry
states (:func:`_entry_state`), so that a region that turns a state on is caught as well as one
that turns it off, and compares the two graphs to catch a forward that reads the state.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

__all__ = ["Refusal", "trace_one_level"]

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
    """Trace under grad mode on, inference mode off and autocast off, or (``probe``) the
    opposite: inference mode on (grad mode off with it) and autocast on, so that an
    ``enable_grad``, ``inference_mode(False)`` or ``autocast(enabled=False)`` region changes the
    state too. Restores grad mode, inference mode and autocast on exit, including a state the
    forward set and left."""
    saved = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d, _ in _AUTOCAST]
    grad = torch.is_grad_enabled()
    try:
        with torch.inference_mode(probe):  # restores the caller's inference mode on exit
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


def trace_one_level(block: nn.Module, defaults: dict[str, Any], probe: bool) -> fx.Graph | Refusal:
    """``block``'s forward traced one level deep (every child module a leaf, in-place arithmetic
    kept in place; optional arguments fixed at ``defaults``) from the entry state ``probe``
    chooses (:func:`_entry_state`), or why not: fx cannot follow it, or a node was traced under
    another grad mode or autocast state than the entry's (a reason for the whole class)."""
    with _entry_state(probe):
        entry = _context_state()
        try:
            graph = _OneLevel().trace(block, concrete_args=defaults or None)
        except Exception as exc:  # fx raises many types for code it cannot follow
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            return Refusal(f"torch.fx cannot trace it ({first})")
    changed = _changed_state(graph, entry)
    return graph if changed is None else Refusal(changed, whole_class=True)
