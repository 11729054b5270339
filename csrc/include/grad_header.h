// The backward's call-order header, host and device code (entry_cpu.cpp, entry_cuda.cu,
// backward_cuda.cu): the layer and call tags of a call, sent back in front of its backward sums.
// See syncbn.h for the layout of the sums.
#pragma once

#include <cstdint>

#include "host_device.h"
#include "shared_constants.h"

namespace syncbn {

// kGradHeader values in front of the backward's sums (shared_constants.h): four 6-bit chunks of
// the layer tag, then four of the call tag (most significant first), every chunk followed by its
// square. In float32 the sums of P ranks' squares (at most 63^2 = 3969 each) stay exact up to
// P = 4096.
constexpr int kGradChunkBits = 6;

// Writes the header of the call tagged (layer, call), integers below 2^24 held in floats.
template <typename T>
SYNCBN_HOST_DEVICE void write_grad_header(double layer, double call, T* header) {
  const int64_t tags[2] = {static_cast<int64_t>(layer), static_cast<int64_t>(call)};
  int k = 0;
  for (int t = 0; t < 2; ++t) {
    for (int i = 3; i >= 0; --i) {
      const double c = static_cast<double>((tags[t] >> (kGradChunkBits * i)) & 63);
      header[k++] = static_cast<T>(c);
      header[k++] = static_cast<T>(c * c);
    }
  }
}

// Whether `total`, the header summed over `ranks` ranks, is `ranks` times this call's own: true
// iff every rank sent the call (layer, call) (a chunk's sum and the sum of its squares are P c and
// P c^2 together only when all P ranks sent c).
template <typename T>
SYNCBN_HOST_DEVICE bool grad_header_matches(const T* total, double layer, double call, double ranks) {
  T own[kGradHeader];
  write_grad_header(layer, call, own);
  bool same = true;
  for (int k = 0; k < kGradHeader; ++k) {
    same = same && static_cast<double>(total[k]) == static_cast<double>(own[k]) * ranks;
  }
  return same;
}

}  // namespace syncbn
