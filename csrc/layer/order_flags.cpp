// The C++ path's call-order flags that cannot be read at once (layer.h): queued in the process's
// order ring behind the call's kernels, polled before each later collective, drained by Python's
// check_call_order. No Python runs unless a flag reads 0 or another rank published a mismatch.
#include <torch/library.h>

#include <atomic>
#include <utility>
#include <vector>

#include "common.h"
#include "layer.h"
#include "order_ring.h"

namespace syncbn::layer {
namespace {

// Set while another rank's published mismatch may concern this process (Python's watcher says
// so through syncbn::order_signal): the next collective asks Python, which raises or clears it.
std::atomic<bool> maybe_signalled{false};

// Reports `failed` (a flag read 0) through Python, which raises.
void report(const c10::optional<FlagReport>& failed) {
  if (failed.has_value()) queued_order_failed(*failed);
}

}  // namespace

void check_before_collective(const Settings& s) {
  if (s.queue_order_flags && order_ring().size() > 0) report(order_ring().poll());
  if (maybe_signalled.load(std::memory_order_relaxed)) raise_if_published();
}

void queue_order_flag(
    const at::Tensor& flags, int64_t index, Mismatch kind, const at::Tensor& data,
    const at::Tensor& aux, int64_t width, const Settings& s, const at::Tensor& tiny_input) {
  FlagStore* store = store_unless_capturing(flags.device());
  if (store == nullptr) return;  // a captured flag holds nothing yet; each replay rewrites it
  if (tiny_input.defined()) {
    // The group's count, read on the host (a sync, only for such tiny inputs): one value per
    // channel in the whole group is torch's error, as the Python path raises it.
    detail::check_group_count(flags[0].item<double>(), tiny_input, s.world_size);
  }
  FlagReport entry{
      static_cast<int64_t>(kind), data, aux, width, s.group, s.world_size, s.layer_tag};
  OrderRing& ring = order_ring();
  if (!ring.push(*store, flags, index, entry)) {
    report(ring.drain());  // full: the device runs far behind; read everything (a host sync)
    SYNCBN_CHECK(
        ring.push(*store, flags, index, std::move(entry)),
        "syncbn: the call-order ring is still full after it was drained");
  }
}

namespace {

// The operators Python reaches the ring through (functional/native.py,
// distributed/call_order/): queue a flag, poll, drain, empty, inspect, and the watcher's signal.
void queue_order_flag_op(
    const at::Tensor& flags, int64_t index, int64_t kind, const at::Tensor& data,
    const at::Tensor& aux, int64_t width, const c10::optional<c10::string_view>& group,
    int64_t world_size, int64_t layer_tag, const c10::optional<at::Tensor>& tiny_input) {
  Settings s;
  if (group.has_value()) s.group = std::string(*group);
  s.world_size = world_size;
  s.layer_tag = layer_tag;
  queue_order_flag(
      flags, index, static_cast<Mismatch>(kind), data, aux, width, s,
      tiny_input.value_or(at::Tensor()));
}

void poll_op() { report(order_ring().poll()); }
void drain_op() { report(order_ring().drain()); }
void clear_op() { order_ring().clear(); }
void signal_op(bool signalled) { maybe_signalled.store(signalled, std::memory_order_relaxed); }

std::vector<int64_t> queued_op() {
  std::vector<int64_t> flat;
  for (const auto& [kind, tag] : order_ring().queued()) {
    flat.push_back(kind);
    flat.push_back(tag);
  }
  return flat;
}

}  // namespace
}  // namespace syncbn::layer

TORCH_LIBRARY_FRAGMENT(syncbn, m) {
  using namespace syncbn::layer;
  // What the C++ path does after each call on a device whose flags are queued (the tests drive
  // it on CPU tensors).
  m.def(
      "queue_order_flag(Tensor flags, int index, int kind, Tensor data, Tensor aux, int width, "
      "str? group, int world_size, int layer_tag, Tensor? tiny_input) -> ()");
  // Reads the landed flags (no host sync), every flag (a host sync), or drops them; raising the
  // CallOrderError of the first that reads 0.
  m.def("order_ring_poll() -> ()", &poll_op);
  m.def("order_ring_drain() -> ()", &drain_op);
  m.def("order_ring_clear() -> ()", &clear_op);
  // (kind, layer tag) of every queued flag, oldest first, flattened.
  m.def("order_ring_queued() -> int[]", &queued_op);
  // Whether another rank may have published a mismatch (the watcher's; checked before collectives).
  m.def("order_signal(bool signalled) -> ()", &signal_op);
}

TORCH_LIBRARY_IMPL(syncbn, CompositeExplicitAutograd, m) {
  m.impl("queue_order_flag", &syncbn::layer::queue_order_flag_op);
}
