// Where the C++ path's call-order flags wait to be read: a flag written by the device is copied
// into a numbered slot of host memory behind the work queued before it, and the slot's readiness
// is asked without a host sync. One store per device (the CPU's, each CUDA device's); the queue of
// queued flags (csrc/layer/order_ring.h) gives out the slots.
//
// Declarations only: the CUDA store is defined in csrc/cuda/order_flags_cuda.cu, so this header
// never needs nvcc.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

#include "shared_constants.h"

namespace syncbn {

// A device's slots of copied flags (kOrderFlagSlots of them).
class FlagStore {
 public:
  virtual ~FlagStore() = default;
  // Whether the device's current stream is capturing a CUDA graph: a captured call's flag holds
  // nothing yet (each replay rewrites it), and asking an event while capturing ends the capture.
  virtual bool capturing() const = 0;
  // Copies `flags[index]` (a 1-D tensor of the accumulation dtype) into `slot`, behind the work
  // queued so far on the device's current stream, and marks the slot ready-to-be behind it.
  virtual void copy(const at::Tensor& flags, int64_t index, int64_t slot) = 0;
  // Whether `slot`'s copy has landed (no host sync).
  virtual bool landed(int64_t slot) = 0;
  // Waits until `slot`'s copy has landed (a host sync on a device).
  virtual void wait(int64_t slot) = 0;
  // Whether the landed copy in `slot` says the ranks' tags agreed (nonzero).
  virtual bool in_order(int64_t slot) const = 0;
};

// Whether the `scalar_type` value at `bytes` is nonzero (float32 or float64 flags).
bool flag_value_nonzero(const unsigned char* bytes, at::ScalarType scalar_type);

// The CPU's store: the copy is made at once, and has landed when made.
FlagStore& host_flag_store();

// Whether CUDA device `device`'s current stream is capturing a CUDA graph, asked without making
// the device's store (defined only in builds with CUDA).
bool cuda_capturing(c10::DeviceIndex device);

// The store a flag on `device` is queued in, or nullptr while `device` is capturing a CUDA graph:
// a captured call's flag holds nothing yet (each replay rewrites it), and making a store then
// would allocate pinned memory, which a capture forbids. Asked before the store is touched.
FlagStore* store_unless_capturing(const at::Device& device);

// CUDA device `device`'s store: pinned host slots written by cudaMemcpyAsync on the device's
// current stream, one event per slot recorded after the copy and asked with cudaEventQuery.
// Made on first use, kept for the process (defined only in builds with CUDA).
FlagStore& cuda_flag_store(c10::DeviceIndex device);

}  // namespace syncbn
