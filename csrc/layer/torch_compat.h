// torch's private C++ APIs the layer uses, in one place (the Python ones are in
// syncbn_lightning/_compat.py; docs/torch-versions.md lists both). Each was compiled and run on
// torch 2.4.1, 2.8.0, 2.13.0 and 2.14.1 (benchmarks/torch_matrix.py).
//
// * at::impl::ThreadLocalPythonObjects: the thread's stashed Python objects, set aside while a
//   collective is issued (PythonObjectsSetAside). A torch without the header sets nothing aside;
//   the exit drain (distributed/exit_drain.py) still lets gloo's workers go before the interpreter
//   finalizes.
// * c10d::resolve_process_group, ProcessGroup::_allgather_base and allreduce: the layer's
//   collectives, through the group DDP's reducer uses.
// * torch::autograd::DelayedError: the node's refusal of a second derivative
//   (refuse_double_backward), as Python's once_differentiable refuses it.
#pragma once

#if __has_include(<ATen/ThreadLocalPythonObjects.h>)
#include <ATen/ThreadLocalPythonObjects.h>
#define SYNCBN_SETS_PYTHON_OBJECTS_ASIDE 1
#else
#define SYNCBN_SETS_PYTHON_OBJECTS_ASIDE 0
#endif
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <string>

namespace syncbn::compat {

// The process group torch registered under `name` (ProcessGroup::group_name()).
inline c10::intrusive_ptr<c10d::ProcessGroup> process_group(const std::string& name) {
  return c10d::resolve_process_group(name);
}

// While one lives, the thread's stashed Python objects are set aside. gloo's work keeps a copy of
// the issuing thread's state, and torch's backward stashes a Python object there
// (contextvars.Context, `_engine_run_backward`). A gloo worker thread drops its last reference to
// a finished work after the waiting caller has moved on; if that is after the interpreter began
// to finalize, the object's decref cannot take the GIL, CPython ends the thread, and the unwind
// through the work's noexcept destructor calls std::terminate: a SIGABRT at exit
// (docs/reliability.md). Without Python objects, that drop needs no GIL.
class PythonObjectsSetAside {
 public:
#if SYNCBN_SETS_PYTHON_OBJECTS_ASIDE
  PythonObjectsSetAside() : saved_(at::impl::ThreadLocalPythonObjects::get_state()) {
    at::impl::ThreadLocalPythonObjects::set_state({});
  }
  ~PythonObjectsSetAside() { at::impl::ThreadLocalPythonObjects::set_state(std::move(saved_)); }
#else
  PythonObjectsSetAside() = default;
#endif
  PythonObjectsSetAside(const PythonObjectsSetAside&) = delete;
  PythonObjectsSetAside& operator=(const PythonObjectsSetAside&) = delete;

#if SYNCBN_SETS_PYTHON_OBJECTS_ASIDE
 private:
  at::impl::ThreadLocalPythonObjects saved_;
#endif
};

// Outputs of a backward run with create_graph=True: differentiating them again raises, as the
// Python Function's once_differentiable does, instead of silently giving zero.
inline torch::autograd::variable_list refuse_double_backward(torch::autograd::variable_list grads) {
  bool any = false;
  for (at::Tensor& g : grads) {
    if (g.defined()) {
      g = g.detach().requires_grad_(true);
      any = true;
    }
  }
  if (!any) return grads;
  auto error = std::make_shared<torch::autograd::DelayedError>(
      "trying to differentiate twice a function that was marked with @once_differentiable "
      "(SyncBatchNorm's backward)",
      static_cast<int>(grads.size()));
  return error->apply(std::move(grads));
}

}  // namespace syncbn::compat
