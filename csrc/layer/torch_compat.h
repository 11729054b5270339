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
// * torch::autograd::Node, SavedVariable, collect_next_edges, set_history: the layer's node made
//   as torch's own operators make theirs. Nodes are held by std::shared_ptr up to torch 2.12 and
//   by c10::intrusive_ptr after (make_node reads which from Edge::function).
#pragma once

#if __has_include(<ATen/ThreadLocalPythonObjects.h>)
#include <ATen/ThreadLocalPythonObjects.h>
#define SYNCBN_SETS_PYTHON_OBJECTS_ASIDE 1
#else
#define SYNCBN_SETS_PYTHON_OBJECTS_ASIDE 0
#endif
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <string>
#include <type_traits>

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

// How torch holds an autograd node: std::shared_ptr<Node> or c10::intrusive_ptr<Node>.
using NodePtr = decltype(torch::autograd::Edge::function);

// A new node of type N, held as torch holds nodes (up to 2.12 with torch's deleter, which frees a
// long chain of nodes without recursing once per node).
template <class N>
auto make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<N>(new N(), [](N* node) { deleteNode(node); });  // (found by ADL)
  } else {
    return c10::make_intrusive<N>();
  }
}

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
