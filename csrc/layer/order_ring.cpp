// The C++ path's queue of call-order flags (order_ring.h) and the CPU's flag store.
#include "order_ring.h"

#include "check.h"

#include <array>
#include <cstring>
#include <utility>

namespace syncbn {

bool flag_value_nonzero(const unsigned char* bytes, at::ScalarType scalar_type) {
  switch (scalar_type) {
    case at::kFloat: {
      float value;
      std::memcpy(&value, bytes, sizeof value);
      return value != 0.0f;
    }
    case at::kDouble: {
      double value;
      std::memcpy(&value, bytes, sizeof value);
      return value != 0.0;
    }
    default:
      SYNCBN_CHECK(false, "syncbn: a call-order flag must be float32 or float64, got ", scalar_type);
  }
}

namespace {

// The CPU's store: calls on CPU tensors queue their flags only in tests of the device path (the
// CPU kernels raise a mismatch at once); the value is in host memory, copied at once.
class HostFlagStore final : public FlagStore {
 public:
  bool capturing() const override { return false; }

  void copy(const at::Tensor& flags, int64_t index, int64_t slot) override {
    const int64_t bytes = flags.element_size();
    SYNCBN_CHECK(bytes <= 8, "syncbn: a call-order flag must be float32 or float64");
    const auto* source =
        static_cast<const unsigned char*>(flags.data_ptr()) + index * flags.stride(0) * bytes;
    std::memcpy(values_[slot].data(), source, bytes);
    types_[slot] = flags.scalar_type();
  }

  bool landed(int64_t) override { return true; }
  void wait(int64_t) override {}

  bool in_order(int64_t slot) const override {
    return flag_value_nonzero(values_[slot].data(), types_[slot]);
  }

 private:
  std::array<std::array<unsigned char, 8>, kOrderFlagSlots> values_{};
  std::array<at::ScalarType, kOrderFlagSlots> types_{};
};

}  // namespace

FlagStore& host_flag_store() {
  static HostFlagStore store;
  return store;
}

FlagStore* store_unless_capturing(const at::Device& device) {
  if (device.is_cpu()) return &host_flag_store();
#ifdef WITH_CUDA
  if (device.is_cuda()) {
    return cuda_capturing(device.index()) ? nullptr : &cuda_flag_store(device.index());
  }
#endif
  SYNCBN_CHECK(false, "syncbn: call-order flags cannot be queued on ", device);
}

namespace layer {

OrderRing::OrderRing(int64_t capacity) : entries_(static_cast<size_t>(capacity)) {
  SYNCBN_CHECK(
      capacity >= 1 && capacity <= kOrderFlagSlots, "syncbn: an order ring holds 1 to ",
      kOrderFlagSlots, " flags, not ", capacity);
}

bool OrderRing::push(FlagStore& store, const at::Tensor& flags, int64_t index, FlagReport report) {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (size_ == capacity()) return false;
  const int64_t slot = (head_ + size_) % capacity();
  store.copy(flags, index, slot);
  entries_[slot] = Entry{&store, std::move(report)};
  ++size_;
  return true;
}

template <typename Ready>
c10::optional<FlagReport> OrderRing::take(Ready ready) {
  const std::lock_guard<std::mutex> lock(mutex_);
  while (size_ > 0) {
    Entry& entry = entries_[head_];
    // While its device captures a CUDA graph, a store's events are neither asked nor waited for
    // (either would end the capture); its flags are read after the capture.
    if (entry.store->capturing() || !ready(*entry.store, head_)) return c10::nullopt;
    const bool ok = entry.store->in_order(head_);
    FlagReport report = std::move(entry.report);
    entry = Entry{};
    head_ = (head_ + 1) % capacity();
    --size_;
    if (!ok) {
      for (; size_ > 0; --size_, head_ = (head_ + 1) % capacity()) entries_[head_] = Entry{};
      return report;
    }
  }
  return c10::nullopt;
}

c10::optional<FlagReport> OrderRing::poll() {
  return take([](FlagStore& store, int64_t slot) { return store.landed(slot); });
}

c10::optional<FlagReport> OrderRing::drain() {
  return take([](FlagStore& store, int64_t slot) {
    store.wait(slot);
    return true;
  });
}

void OrderRing::clear() {
  const std::lock_guard<std::mutex> lock(mutex_);
  for (; size_ > 0; --size_, head_ = (head_ + 1) % capacity()) entries_[head_] = Entry{};
}

int64_t OrderRing::size() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return size_;
}

std::vector<std::pair<int64_t, int64_t>> OrderRing::queued() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t i = 0; i < size_; ++i) {
    const FlagReport& report = entries_[(head_ + i) % capacity()].report;
    out.emplace_back(report.kind, report.layer_tag);
  }
  return out;
}

OrderRing& order_ring() {
  // Never destroyed: its entries' tensors must not be freed by the exit handlers, after the
  // interpreter finalized (a tensor with a Python object needs the GIL to be freed).
  static auto* ring = new OrderRing();
  return *ring;
}

}  // namespace layer
}  // namespace syncbn
