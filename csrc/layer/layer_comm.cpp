// The C++ path's collectives (through the c10d ProcessGroup of the layer's group, the same calls
// DDP's reducer makes) and its hand-offs to Python on failure (see layer.h).
#include "layer.h"

#include "common.h"
#include "order_ring.h"
#include "torch_compat.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <atomic>
#include <exception>
#include <vector>

namespace syncbn::layer {
namespace {

// CPU groups of up to this many ranks all-gather their sums (kGatherSumMaxRanks); the test switch
// syncbn::set_gather_sum_max_ranks (distributed/collectives.py, gather_sums_up_to) lowers it, so
// that CPU groups run the all-reduce branch CUDA groups take.
std::atomic<int64_t> gather_sum_max_ranks{kGatherSumMaxRanks};

using compat::process_group;
using compat::PythonObjectsSetAside;

// The collective `issue` starts (the work it returns holds no Python object), then waited on.
template <typename Issue>
void issue_and_wait(Issue issue) {
  c10::intrusive_ptr<c10d::Work> work;
  {
    PythonObjectsSetAside aside;
    work = issue();
  }
  work->wait();
}

// The hand-off operator `name` (its kernel is Python's, functional/native.py), found once per
// call site: `static const auto op = python_op(...)`.
c10::OperatorHandle python_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Calls a hand-off operator with `stack` (a Python exception raised there arrives as thrown).
void call_python(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  op.callBoxed(&stack);
}

c10::IValue group_value(const c10::optional<std::string>& group) {
  return group.has_value() ? c10::IValue(*group) : c10::IValue();
}

// Logs what the flight recorder knows about a failed collective (Python's report, once per
// process), then lets the caller rethrow the failure as it was. A failure of the report itself
// must not hide the collective's.
void report_failure(const at::Tensor& sent, const char* op, const std::exception& error) {
  try {
    std::string what = error.what();
    what = what.substr(0, what.find('\n'));
    static const auto handoff = python_op("syncbn::collective_failed");
    call_python(handoff, {sent, std::string(op), what.substr(0, 200)});
  } catch (...) {
  }
}

// Another rank's published call-order mismatch (distributed/call_order/watcher.py) is why a
// collective failed: the rank that found it aborted its member of the group, or left. Its
// CallOrderError then replaces the backend's error (Python asks the job's store: an error path
// only).
void raise_if_published_for(const Settings& s) {
  static const auto handoff = python_op("syncbn::raise_if_published_for");
  call_python(handoff, {group_value(s.group)});
}

flight::Op op_code(bool gather) { return gather ? flight::kAllGather : flight::kAllReduce; }

void record(const at::Tensor& tensor, const Settings& s, const Note& note, bool gather) {
  flight::record(
      *s.group, op_code(gather), note.direction, tensor.numel() * tensor.element_size(),
      note.layer_tag, note.call);
}

}  // namespace

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"  // _allgather_base: torch 2.11 too

at::Tensor all_gather(const at::Tensor& tensor, const Settings& s, const Note& note) {
  if (!s.group.has_value()) return tensor;
  auto group = process_group(*s.group);
  at::Tensor input = tensor;
  at::Tensor gathered = detail::new_empty({s.world_size * tensor.numel()}, tensor.options());
  record(tensor, s, note, true);
  try {
    issue_and_wait([&] { return group->_allgather_base(gathered, input); });
  } catch (const std::exception& error) {
    report_failure(tensor, "all_gather", error);
    raise_if_published_for(s);
    throw;
  }
  return gathered;
}

#pragma GCC diagnostic pop

at::Tensor sum_over_group(
    const at::Tensor& tensor, const Settings& s, const Note& note, Summed where) {
  if (!s.group.has_value()) return tensor;
  if (tensor.is_cpu() && s.world_size <= gather_sum_max_ranks.load(std::memory_order_relaxed)) {
    return all_gather(tensor, s, note);
  }
  auto group = process_group(*s.group);
  std::vector<at::Tensor> summed{where == Summed::kInPlace ? tensor : tensor.clone()};
  record(tensor, s, note, false);
  try {
    issue_and_wait([&] { return group->allreduce(summed); });
  } catch (const std::exception& error) {
    report_failure(tensor, "all_reduce", error);
    raise_if_published_for(s);
    throw;
  }
  return summed[0];
}

bool is_call_order_error(const c10::Error& error) {
  const std::string& text = error.msg();
  return text.find(kCallOrderMark) != std::string::npos &&
         text.find(kShiftMark) == std::string::npos;
}

void call_order_failed(
    Mismatch kind, const at::Tensor& data, const at::Tensor& aux, int64_t width,
    const Settings& s) {
  static const auto handoff = python_op("syncbn::call_order_failed");
  call_python(
      handoff, {static_cast<int64_t>(kind), data, aux.defined() ? aux : data, width,
                group_value(s.group), s.world_size, s.layer_tag});
}

void queued_order_failed(const FlagReport& r) {
  static const auto handoff = python_op("syncbn::queued_order_failed");
  call_python(
      handoff, {r.kind, r.data, r.aux.defined() ? r.aux : r.data, r.width, group_value(r.group),
                r.world_size, r.layer_tag});
}

void raise_if_published() {
  static const auto handoff = python_op("syncbn::raise_if_published");
  call_python(handoff, {});
}

void ensure_flight_ring() {
  if (!flight::attached()) {
    static const auto handoff = python_op("syncbn::flight_open");
    call_python(handoff, {detail::new_empty({0}, at::TensorOptions())});
  }
}

namespace {

int64_t set_gather_sum_max_ranks(int64_t ranks) {
  return gather_sum_max_ranks.exchange(ranks, std::memory_order_relaxed);
}

}  // namespace

}  // namespace syncbn::layer

// The hand-offs' operators: their kernels are Python's (functional/native.py).
TORCH_LIBRARY_FRAGMENT(syncbn, m) {
  m.def(
      "call_order_failed(int kind, Tensor data, Tensor aux, int width, str? group, "
      "int world_size, int layer_tag) -> ()");
  m.def(
      "queued_order_failed(int kind, Tensor data, Tensor aux, int width, str? group, "
      "int world_size, int layer_tag) -> ()");
  m.def("raise_if_published() -> ()");
  m.def("raise_if_published_for(str? group) -> ()");
  m.def("collective_failed(Tensor sent, str op, str reason) -> ()");
  m.def("flight_open(Tensor like) -> ()");
  // The test switch of sum_over_group's rule: returns the previous limit.
  m.def("set_gather_sum_max_ranks(int ranks) -> int", &syncbn::layer::set_gather_sum_max_ranks);
}
