// Stand-in for c10/cuda/CUDAGuard.h under the SIMT emulation: one device, nothing to switch.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Optional.h>

namespace c10::cuda {

struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
  explicit CUDAGuard(c10::DeviceIndex) {}
};

struct OptionalCUDAGuard {
  OptionalCUDAGuard() = default;
  explicit OptionalCUDAGuard(c10::optional<c10::Device>) {}
};

}  // namespace c10::cuda
