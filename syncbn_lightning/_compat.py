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
* ``torch.distributed.distributed_c10d._world.group_count`` (all checked releases): how many
  process groups this process made, destroyed ones too (whether the exit drain looks for gloo
  worker threads on a torch that does not name them, ``distributed/exit_drain.py``). Missing:
  only a live default group counts.
* ``torch.distributed.distributed_c10d._get_default_store`` (all checked releases): the default
  group's store (the job's id, the call-order watcher). Missing, or a group made without one:
  ``None``, so no watcher runs and the launcher's address names the job.
* ``torch.utils.cpp_extension._get_cuda_arch_flags`` (all checked releases): the ``-gencode``
  flags of a CUDA build, part of the extension's cache key (``ops/build.py``). Missing: a
  placeholder naming the error takes their place in the key.
* ``torch._C._current_graph_task_id`` (all checked releases): whether autograd's engine is
  running a backward on this thread (a layer's forward there is a checkpoint's recompute).
  Missing: no forward is taken for a recompute, and a recompute exchanges and counts again.
* ``torch._C._autograd._top_saved_tensors_default_hooks`` (2.8.0 on, not 2.4.1) and the layout of
  ``torch.utils.checkpoint`` (its ``CheckpointFunction``'s ``forward(ctx, ...)`` and
  ``backward(ctx, ...)``, the ``frame`` the non-reentrant checkpoint's pack and unpack hooks hold
  in their closures; the same on every checked release): which checkpoint a forward or a
  recompute belongs to (``functional/recompute.py``). Missing (or a layout this does not
  recognize): the forward keeps nothing, and its recompute exchanges again without counting; on
  2.4.1 that is the non-reentrant checkpoint's case.
"""

from __future__ import annotations

import functools
import sys
import types
from datetime import timedelta
from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint

from ._torch import release

__all__ = [
    "GLOO_THREADS_NAMED",
    "NON_REENTRANT_KEEPS",
    "backward_stashes_context",
    "checkpoint_forward_segment",
    "checkpoint_recompute_segment",
    "cuda_arch_flags",
    "current_graph_task",
    "default_store",
    "functorch_active",
    "made_process_group",
    "put_back_backward_context",
    "store_connection",
    "top_saved_tensors_hooks",
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


def store_connection(store: Any, timeout: timedelta | None = None) -> Any:
    """A connection to ``store`` of its own (``store.clone()``) whose requests time out after
    ``timeout`` (``None``: the store's), or ``store`` itself, its timeout untouched, where torch
    cannot clone one (2.4: the job's store object is shared)."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    connection = clone()
    if timeout is not None:
        connection.set_timeout(timeout)
    return connection


_RELEASE = release(torch.__version__)[:2]

#: Whether torch names gloo's threads (``pt_gloo_runloop``, ``gloo_tcp_loop``): 2.13.0 and 2.14.1
#: do, 2.4.1 and 2.8.0 do not (the exit drain finds them by elimination there).
GLOO_THREADS_NAMED = _RELEASE >= (2, 13)

#: Whether dynamo traces an autograd Function's ``ctx.needs_input_grad`` right where its input
#: is another Function's output: 2.8.0 and later do; 2.4.1 reads it False there, and a compiled
#: model of two synchronized layers lost the gradient of the first's input (2.5 to 2.7 are not
#: checked: they are treated as 2.4).
TRACED_NEEDS_INPUT_GRAD = _RELEASE >= (2, 8)


def made_process_group() -> bool:
    """Whether this process made a torch.distributed process group (one destroyed since too)."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    world = getattr(dist.distributed_c10d, "_world", None)
    return bool(getattr(world, "group_count", 0)) or dist.is_initialized()


def default_store() -> Any:
    """The default process group's store, or ``None`` (no default group, or one without a
    store, or a torch without the helper)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a default group made without a store, or the helper gone
        return None


def cuda_arch_flags() -> tuple[str, ...]:
    """cpp_extension's ``-gencode`` flags for a CUDA build (``TORCH_CUDA_ARCH_LIST``, else the
    visible GPUs), or one placeholder naming why they are unavailable."""
    from torch.utils import cpp_extension

    try:
        return tuple(cpp_extension._get_cuda_arch_flags())
    except Exception as exc:  # a private helper of torch: it must not break the build
        return (f"<arch flags unavailable: {type(exc).__name__}>",)


def torch_build_lock_is_flock() -> bool:
    """Whether torch's JIT builder holds its build directory's ``lock`` file with an flock (a
    leftover file is harmless) rather than by the file's existence (a leftover one is stale)."""
    from torch.utils import cpp_extension

    return getattr(cpp_extension, "FileLock", None) is not None


#: ``current_graph_task()``: the backward (graph task) autograd's engine runs on this thread, -1
#: outside one (always -1 where torch cannot say). Both stand-ins are C callables, like torch's
#: own: a layer call checks them without a Python frame.
current_graph_task: Any = getattr(torch._C, "_current_graph_task_id", None) or functools.partial(
    int, -1
)
#: ``top_saved_tensors_hooks(False)``: the innermost saved-tensors hooks ``(pack, unpack)``, or
#: ``None`` (always ``None`` where torch cannot say: 2.4).
_TOP_HOOKS: Any = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
top_saved_tensors_hooks: Any = _TOP_HOOKS or functools.partial(dict.get, {})
#: Whether a non-reentrant checkpoint's forward can be found (:func:`checkpoint_forward_segment`):
#: torch has ``_top_saved_tensors_default_hooks`` (not 2.4).
NON_REENTRANT_KEEPS = _TOP_HOOKS is not None


def _hook_codes() -> tuple[Any, Any]:
    """The code objects of the non-reentrant checkpoint's pack and unpack hooks (``None`` where
    the layout is not the one recognized)."""
    try:
        probe = types.SimpleNamespace(unpack_error_cb=None, weak_holders=[], metadata_fn=None)
        hooks = _checkpoint._checkpoint_hook(probe)  # type: ignore[attr-defined]
        pack, unpack = hooks.pack_hook.__code__, hooks.unpack_hook.__code__
    except (AttributeError, TypeError):
        return None, None
    if "frame" not in pack.co_freevars or "frame" not in unpack.co_freevars:
        return None, None
    return pack, unpack


_PACK_CODE, _UNPACK_CODE = _hook_codes()
_CK_FUNCTION: Any = getattr(_checkpoint, "CheckpointFunction", None)
_CK_FORWARD = getattr(getattr(_CK_FUNCTION, "forward", None), "__code__", None)
_CK_BACKWARD = getattr(getattr(_CK_FUNCTION, "backward", None), "__code__", None)
_CK_CALL = getattr(
    getattr(_checkpoint.checkpoint, "__wrapped__", _checkpoint.checkpoint), "__code__", None
)


# The frames that name a checkpoint (code -> the local holding its object), and those that end
# the search: a forward's, and a recompute's.
_FORWARD_FRAMES = {code: "ctx" for code in (_CK_FORWARD,) if code is not None}
_RECOMPUTE_STOPS = tuple(code for code in (_CK_BACKWARD, _UNPACK_CODE) if code is not None)
_RECOMPUTE_FRAMES = {
    code: local
    for code, local in ((_CK_BACKWARD, "ctx"), (_UNPACK_CODE, "frame"))
    if code is not None
}
_FORWARD_STOPS = tuple(code for code in (_CK_FORWARD, _CK_CALL) if code is not None)


def _closure_value(function: Any, name: str) -> Any:
    code = function.__code__
    return function.__closure__[code.co_freevars.index(name)].cell_contents


def _nearest(found: dict[Any, str], stops: tuple[Any, ...]) -> Any:
    """Walk this thread's Python stack outward from the caller's caller: the local ``found``
    names in the first frame whose code is a key of ``found``, or ``None`` where a frame whose
    code is in ``stops`` (or the stack's end) comes first."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code in found:
            return frame.f_locals.get(found[code])
        if code in stops:
            return None
        frame = frame.f_back
    return None


def checkpoint_forward_segment() -> Any:
    """The checkpoint whose (first) forward runs this call: the reentrant checkpoint's autograd
    context, or the non-reentrant checkpoint's frame; ``None`` outside one, or where torch's
    layout is not recognized. Costs two calls into torch outside a checkpoint."""
    if not torch.is_grad_enabled():  # the reentrant checkpoint's forward runs without grad
        return _nearest(_FORWARD_FRAMES, _RECOMPUTE_STOPS)
    if _PACK_CODE is None:
        return None
    hooks = top_saved_tensors_hooks(False)
    if hooks is None:
        return None
    pack = hooks[0]
    if getattr(pack, "__code__", None) is not _PACK_CODE:
        return None  # another saved-tensors hook (a user's, or a recompute's) is the innermost
    return _closure_value(pack, "frame")


def checkpoint_recompute_segment() -> Any:
    """The checkpoint whose recompute runs this call (found by the same object
    :func:`checkpoint_forward_segment` gave its forward), else ``None``: not in a recompute, a
    checkpoint's forward nested in a recompute (that forward's own calls are recomputes of the
    outer one, which kept nothing for them), or a layout not recognized."""
    return _nearest(_RECOMPUTE_FRAMES, _FORWARD_STOPS)
