// Helpers shared by the CUDA kernels (stats_cuda.cu, normalize_cuda.cu, backward_cuda.cu and the
// kernel templates of cuda_reduce.cuh and cuda_elemt.cuh): launch constants, device helpers
// (conversions, 16-byte vectors) and the host helpers of the launchers. See syncbn.h for the maths.
//
// No CUDA twin reads device memory on the host or synchronizes: the merge of gathered per-rank
// statistics handles zero-count ranks inside the kernel, and backward_elemt reads the group count
// from device memory, so a layer can be captured in a CUDA graph. Every launch uses the current
// stream and is followed by a launch check.
//
// Includes are kept to c10/cuda and ATen core on purpose: ATen/cuda/CUDAContext.h pulls in the
// cuBLAS/cuSPARSE/cuSOLVER headers, which a CPU-only torch and a bare nvcc install may not have;
// this way the .cu files also compile (tests/test_cuda_build.py) on machines without a GPU.
//
// Like the kernels, everything here has internal linkage (an unnamed namespace): each .cu file
// instantiates the kernels it launches, so the .cu files compile on their own and in parallel.
#pragma once

#include "common.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace syncbn {
namespace {

using namespace detail;

// ------------------------------------------------------------------------------------------------
// Launch constants and device helpers
// ------------------------------------------------------------------------------------------------

constexpr int kThreads = 256;  // threads per block, every kernel but the fold (kFoldGroups)
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
// Blocks per SM the reductions aim for: 4 x 256 threads keep enough loads in flight to saturate
// HBM while leaving room for a concurrent kernel (NCCL's) on the same SM.
constexpr int kBlocksPerSm = 4;
// A reduction splits a channel only while every thread keeps at least this many elements.
constexpr int64_t kMinPerThread = 16;
// At most this many elements of one channel per block, so that the per-block count stays exact in
// float32 (2^24) with room to spare.
constexpr int64_t kMaxPerBlock = int64_t(1) << 22;
// Loads issued before their values are folded in: independent loads in flight per thread.
// Blocks per SM the channels-last kernels are compiled for (register caps: 128 for 2, 85 for 3).
// With 16-byte vectors of 8 half-precision values a thread holds 8 channels' constants and several
// rows of loads, and with a fused activation (every kind's code in one kernel) ptxas wanted 161-168
// registers for the backward kernels and 94 for normalize: one block per SM, and the bf16 layer
// with silu ran 2.5x slower than without it (H100). Normalize, with one input, keeps 3 blocks.
constexpr int kChannelsLastMinBlocks = 2;
constexpr int kNormalizeMinBlocks = 3;
constexpr int kUnroll = 4;
// Rows of one channel vector a thread of the channels-last elementwise kernel handles per step.
constexpr int kRowsPerThread = 4;
// Groups of splits the fold of partials walks in parallel per channel (a block of 32 x this).
constexpr int kFoldGroups = 32;
constexpr int kMaxGridY = 65535;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename acc_t, typename scalar_t>
__device__ __forceinline__ acc_t to_acc(scalar_t v) {
  return static_cast<acc_t>(v);
}

template <typename scalar_t, int VEC>
struct alignas(sizeof(scalar_t) * VEC) Vec {
  scalar_t v[VEC];
};

template <int VEC, typename scalar_t>
__device__ __forceinline__ Vec<scalar_t, VEC> load_vec(const scalar_t* p, int64_t i) {
  return *reinterpret_cast<const Vec<scalar_t, VEC>*>(p + i);
}

inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// ------------------------------------------------------------------------------------------------
// Host helpers of the launchers
// ------------------------------------------------------------------------------------------------

constexpr int kMaxDevices = 64;

// Multiprocessor count of `device`, queried once (an attribute query, safe during graph capture).
inline int sm_count(int device) {
  static std::atomic<int> cache[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) device = 0;
  int value = cache[device].load(std::memory_order_relaxed);
  if (value == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device));
    cache[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int next_pow2(int64_t v, int cap) {
  int p = 1;
  while (p < v && p < cap) p <<= 1;
  return p;
}

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

}  // namespace
}  // namespace syncbn
