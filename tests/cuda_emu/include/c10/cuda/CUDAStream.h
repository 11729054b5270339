// Stand-in for c10/cuda/CUDAStream.h under the SIMT emulation: one stream, launches run at once.
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime.h>

namespace c10::cuda {

class CUDAStream {
 public:
  cudaStream_t stream() const { return nullptr; }
  operator cudaStream_t() const { return nullptr; }  // NOLINT: implicit, as in c10
};

// Notes the device asked for (simt::take_stream_devices), then answers the one stream.
CUDAStream getCurrentCUDAStream(c10::DeviceIndex device = -1);
inline CUDAStream getDefaultCUDAStream(c10::DeviceIndex = -1) { return {}; }

}  // namespace c10::cuda
