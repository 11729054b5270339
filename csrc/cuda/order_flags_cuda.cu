// The CUDA devices' stores of call-order flags (flag_store.h): host code only, no kernel. A call
// on the C++ path leaves its flag on the device; reading it at once would cost a host sync per
// call, so it is copied into a slot of pinned host memory on the device's current stream, behind
// the kernels that wrote it, and an event recorded after the copy says when the slot may be read.
// Slots, events and the pinned memory are made once per device and reused for the process, so a
// queued flag costs one cudaMemcpyAsync and one cudaEventRecord.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <array>
#include <memory>
#include <mutex>

#include "flag_store.h"
#include "check.h"

namespace syncbn {
namespace {

// Bytes per slot: room for the widest flag (float64).
constexpr int64_t kSlotBytes = 8;
// Stores for devices 0..kMaxDevices-1 (c10's own limit on devices per process is lower).
constexpr int kMaxDevices = 64;

class CudaFlagStore final : public FlagStore {
 public:
  explicit CudaFlagStore(c10::DeviceIndex device) : device_(device) {
    const c10::cuda::CUDAGuard guard(device_);
    void* host = nullptr;
    // Portable: the slots are written by copies on this device's streams, whatever context is
    // current; never freed (the store lives as long as the process, past the CUDA runtime's own
    // teardown at exit).
    C10_CUDA_CHECK(cudaHostAlloc(&host, kOrderFlagSlots * kSlotBytes, cudaHostAllocPortable));
    host_ = static_cast<unsigned char*>(host);
    events_.fill(nullptr);
  }

  bool capturing() const override { return cuda_capturing(device_); }

  void copy(const at::Tensor& flags, int64_t index, int64_t slot) override {
    const c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_);
    const int64_t bytes = flags.element_size();
    const auto* source =
        static_cast<const unsigned char*>(flags.data_ptr()) + index * flags.stride(0) * bytes;
    types_[slot] = flags.scalar_type();
    C10_CUDA_CHECK(cudaMemcpyAsync(
        host_ + slot * kSlotBytes, source, bytes, cudaMemcpyDeviceToHost, stream));
    if (events_[slot] == nullptr) {
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&events_[slot], cudaEventDisableTiming));
    }
    C10_CUDA_CHECK(cudaEventRecord(events_[slot], stream));
  }

  bool landed(int64_t slot) override {
    const c10::cuda::CUDAGuard guard(device_);
    const cudaError_t state = cudaEventQuery(events_[slot]);
    if (state == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: the copy is still queued
      return false;
    }
    C10_CUDA_CHECK(state);
    return true;
  }

  void wait(int64_t slot) override {
    const c10::cuda::CUDAGuard guard(device_);
    C10_CUDA_CHECK(cudaEventSynchronize(events_[slot]));
  }

  bool in_order(int64_t slot) const override {
    return flag_value_nonzero(host_ + slot * kSlotBytes, types_[slot]);
  }

 private:
  c10::DeviceIndex device_;
  unsigned char* host_ = nullptr;
  std::array<cudaEvent_t, kOrderFlagSlots> events_;
  std::array<at::ScalarType, kOrderFlagSlots> types_{};
};

}  // namespace

bool cuda_capturing(c10::DeviceIndex device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device), &status));
  return status != cudaStreamCaptureStatusNone;
}

FlagStore& cuda_flag_store(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::array<std::unique_ptr<CudaFlagStore>, kMaxDevices> stores;
  SYNCBN_CHECK(
      device >= 0 && device < kMaxDevices, "syncbn: no call-order flag store for CUDA device ",
      static_cast<int>(device));
  const std::lock_guard<std::mutex> lock(mutex);
  auto& store = stores[device];
  if (!store) store = std::make_unique<CudaFlagStore>(device);
  return *store;
}

}  // namespace syncbn
