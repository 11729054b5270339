// SIMT emulation: the device's progress as the host sees it (events, stream capture, which
// device's stream was asked for), for host code of the .cu files such as the call-order flag
// store (csrc/cuda/order_flags_cuda.cu). Kernels run at once; only what events report is held.
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "simt_control.h"

namespace simt {
namespace {

struct Device {
  std::mutex mutex;
  uint64_t recorded = 0, completed = 0;
  bool held = false, capturing = false;
  std::vector<int> stream_devices;
};

Device& device() {
  static Device d;
  return d;
}

}  // namespace

uint64_t record_event() {
  Device& d = device();
  const std::lock_guard<std::mutex> lock(d.mutex);
  ++d.recorded;
  if (!d.held) d.completed = d.recorded;
  return d.recorded;
}

bool event_completed(uint64_t ticket) {
  Device& d = device();
  const std::lock_guard<std::mutex> lock(d.mutex);
  return ticket <= d.completed;
}

void wait_event(uint64_t ticket) {
  Device& d = device();
  const std::lock_guard<std::mutex> lock(d.mutex);
  d.completed = std::max(d.completed, ticket);
}

bool capturing() {
  Device& d = device();
  const std::lock_guard<std::mutex> lock(d.mutex);
  return d.capturing;
}

void hold_device(bool held) {
  Device& d = device();
  const std::lock_guard<std::mutex> lock(d.mutex);
  d.held = held;
  if (!held) d.completed = d.recorded;
}

void release_device() {
  Device& d = device();
  const std::lock_guard<std::mutex> lock(d.mutex);
  d.completed = d.recorded;
}

void set_capturing(bool capturing) {
  Device& d = device();
  const std::lock_guard<std::mutex> lock(d.mutex);
  d.capturing = capturing;
}

std::vector<int> take_stream_devices() {
  Device& d = device();
  const std::lock_guard<std::mutex> lock(d.mutex);
  std::vector<int> out;
  out.swap(d.stream_devices);
  return out;
}

}  // namespace simt

namespace c10::cuda {

CUDAStream getCurrentCUDAStream(c10::DeviceIndex index) {
  simt::Device& d = simt::device();
  const std::lock_guard<std::mutex> lock(d.mutex);
  d.stream_devices.push_back(static_cast<int>(index));
  return {};
}

}  // namespace c10::cuda
