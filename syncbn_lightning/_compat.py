"""torch's private Python APIs the package uses, in one place, each with what it does where a
release lacks it. Checked on torch 2.4.1, 2.8.0, 2.13.0 and 2.14.1 (``benchmarks/torch_matrix.py``;
``docs/torch-versions.md`` lists them with the C++ ones).

* ``torch._C._are_functorch_transforms_active``: whether a ``torch.func`` transform runs (all
  checked releases). Missing: no transform is assumed, and torch's own error stands.
* ``Tensor._use_count``: a tensor's C++ references (all checked releases). Missing: a gloo
  collective does not wait for its worker to let go of the tensors (the exit-time guard of the
  Python path, ``distributed/collectives.py``).
* ``torch._C._is_key_in_tls``, ``_get_obj_in_tls``, ``_remove_obj_from_tls``,
  ``_stash_obj_in_tls``: the thread's stashed Python objects. torch's backward stashes its
  ``contextvars.Context`` there under ``"context"`` only on releases that also have
  ``_remove_obj_from_tls`` (2.13.0 and 2.14.1 here; not 2.4.1 or 2.8.0), so without it there
  is nothing to set aside.
* ``torch.utils.cpp_extension.FileLock`` (2.14.1): torch's JIT builder flocks the build
  directory's ``lock`` file and leaves it there; before (2.4.1 to 2.13.0) it marked a running
  build by the file's existence (``FileBaton``), so a file left by a killed build blocked every
  later build until removed (``ops/build_lock.py``).
* ``Store.clone`` (a store's own new connection, for the call-order watcher's thread; 2.8.0 on,
  not 2.4.1). Missing: the watcher shares the job's store object, whose every operation takes
  the store client's lock, so its checks may wait behind the main thread's.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "backward_stashes_context",
    "functorch_active",
    "put_back_backward_context",
    "store_connection",
    "take_backward_context",
    "torch_build_lock_is_flock",
    "use_count",
]

#: Whether a torch.func transform (grad, vmap, jacrev, ...) is running, ``functorch_active()``: a
#: builtin, called straight from the layer's forward (no Python frame of ours).
functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)

# The key under which torch's backward (``torch.autograd.graph._engine_run_backward``) stashes
# its contextvars in the thread's state, and the functions that reach it (None where missing).
_BACKWARD_CONTEXT = "context"
_TLS = tuple(
    getattr(torch._C, name, None)
    for name in ("_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls", "_stash_obj_in_tls")
)
_HAS_TLS = all(function is not None for function in _TLS)
#: Whether torch's backward stashes a Python object (its contextvars) in the thread's state.
backward_stashes_context = _HAS_TLS
_HAS_USE_COUNT = hasattr(torch.Tensor, "_use_count")


def use_count(tensor: torch.Tensor) -> int | None:
    """The C++ references to ``tensor``'s implementation; ``None`` where torch cannot say."""
    return tensor._use_count() if _HAS_USE_COUNT else None


def take_backward_context() -> Any:
    """Take the ``contextvars.Context`` torch's backward stashed in this thread's state out of
    it, and return it (``None`` if none, or on a release whose backward stashes none)."""
    if not _HAS_TLS:
        return None
    is_key, get, remove, _stash = _TLS
    if not is_key(_BACKWARD_CONTEXT):
        return None
    context = get(_BACKWARD_CONTEXT)
    remove(_BACKWARD_CONTEXT)
    return context


def put_back_backward_context(context: Any) -> None:
    """Undo :func:`take_backward_context`."""
    if context is not None:
        _TLS[3](_BACKWARD_CONTEXT, context)


def store_connection(store: Any) -> Any:
    """A connection to ``store`` of its own (``store.clone()``), or ``store`` itself where torch
    cannot clone one."""
    clone = getattr(store, "clone", None)
    return store if clone is None else clone()


def torch_build_lock_is_flock() -> bool:
    """Whether torch's JIT builder holds its build directory's ``lock`` file with an flock (a
    leftover file is harmless) rather than by the file's existence (a leftover one is stale)."""
    from torch.utils import cpp_extension

    return getattr(cpp_extension, "FileLock", None) is not None
