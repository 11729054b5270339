// Drives the C++ path's queue of call-order flags (csrc/layer/order_ring.cpp) with the CUDA flag
// store (csrc/cuda/order_flags_cuda.cu) under the emulation, whose events stay "not ready" while
// the emulated device is held (simt_control.h): the slots, their wrap-around, the poll order, a
// full ring, the stream each copy is queued on, and what a capture leaves alone. The emulation's bindings expose these as
// `order_ring_*` (tests/test_cuda_emu_order_ring.py).
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "flag_store.h"
#include "order_ring.h"

namespace order_ring_probe {
namespace {

std::unique_ptr<syncbn::layer::OrderRing>& ring() {
  static std::unique_ptr<syncbn::layer::OrderRing> r;
  return r;
}

syncbn::layer::OrderRing& current() {
  if (!ring()) ring() = std::make_unique<syncbn::layer::OrderRing>();
  return *ring();
}

int64_t tag_of(const c10::optional<syncbn::layer::FlagReport>& failed) {
  return failed.has_value() ? failed->layer_tag : -1;
}

}  // namespace

void reset(int64_t capacity) { ring() = std::make_unique<syncbn::layer::OrderRing>(capacity); }

bool push(const at::Tensor& flags, int64_t index, int64_t layer_tag, int64_t device) {
  syncbn::layer::FlagReport report;
  report.layer_tag = layer_tag;
  auto& store = syncbn::cuda_flag_store(static_cast<c10::DeviceIndex>(device));
  return current().push(store, flags, index, report);
}

int64_t poll() { return tag_of(current().poll()); }
int64_t drain() { return tag_of(current().drain()); }

std::vector<int64_t> queued_tags() {
  std::vector<int64_t> tags;
  for (const auto& entry : current().queued()) tags.push_back(entry.second);
  return tags;
}

bool capturing(int64_t device) {
  return syncbn::cuda_flag_store(static_cast<c10::DeviceIndex>(device)).capturing();
}

bool has_store_for_queueing(int64_t device) {
  const c10::Device where(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
  return syncbn::store_unless_capturing(where) != nullptr;
}

}  // namespace order_ring_probe
