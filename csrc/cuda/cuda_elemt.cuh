// The elementwise kernels of the CUDA twins (see cuda_kernels.cuh for the helpers): their kernels
// and launcher, instantiated by normalize_cuda.cu (NormalizeOp) and backward_cuda.cu
// (BackwardElemtOp) with their Op.
//
// Elementwise kernels (normalize, backward_elemt) read and write 16-byte vectors where the layout
// and alignment allow it (same channel along the vector for channels-first, consecutive channels
// for channels-last), with 32-bit indexing unless the tensor needs 64 bits.
//
// An Op reads kInputs tensors and writes one: per-channel coefficients (Coeff, loaded once per
// thread and channel) and the maths of VEC values at once (apply_vec).
#pragma once

#include "cuda_kernels.cuh"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace syncbn {
namespace {

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, int K>
struct ElemtPointers {
  const scalar_t* __restrict__ in[K];
  scalar_t* __restrict__ out;
};

// op applied to the input vectors `in` (one per input, VEC elements each); element e uses the
// coefficients coeff_of(e).
template <typename Op, typename scalar_t, typename acc_t, int VEC, typename CoeffOf>
__device__ __forceinline__ Vec<scalar_t, VEC> compute_vector(
    const Op& op, const Vec<scalar_t, VEC>* in, CoeffOf coeff_of) {
  acc_t a[Op::kInputs][VEC], r[VEC];
#pragma unroll
  for (int t = 0; t < Op::kInputs; ++t) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) a[t][e] = to_acc<acc_t>(in[t].v[e]);
  }
  op.template apply_vec<VEC>(coeff_of, a, r);
  Vec<scalar_t, VEC> out;
#pragma unroll
  for (int e = 0; e < VEC; ++e) out.v[e] = static_cast<scalar_t>(r[e]);
  return out;
}

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

// Applies `op` to vectors of VEC elements that share one channel (channels-first, S % VEC == 0).
// nvec = numel / VEC, s_vec = S / VEC; grid-stride over vectors.
template <typename Op, typename scalar_t, typename acc_t, int VEC, typename index_t>
__global__ void __launch_bounds__(kThreads) elemt_channels_first_kernel(
    Op op, ElemtPointers<scalar_t, Op::kInputs> ptr, index_t nvec, index_t s_vec, index_t C) {
  using V = Vec<scalar_t, VEC>;
  op.begin();
  const index_t stride = static_cast<index_t>(gridDim.x) * blockDim.x;
  for (index_t k = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < nvec;
       k += stride) {
    const typename Op::Coeff coeff = op.coeff((k / s_vec) % C);
    V in[Op::kInputs];
#pragma unroll
    for (int t = 0; t < Op::kInputs; ++t) in[t] = reinterpret_cast<const V*>(ptr.in[t])[k];
    reinterpret_cast<V*>(ptr.out)[k] =
        compute_vector<Op, scalar_t, acc_t, VEC>(op, in, [&](int) { return coeff; });
  }
}

// Applies `op` to channels-last data: M rows of C / VEC vectors of consecutive channels. Block
// (TX, TY): channel vector blockIdx.x * TX + threadIdx.x, whose coefficients are loaded once into
// registers; rows strided by gridDim.y * TY, kRowsPerThread of them loaded before any is written
// (independent loads in flight amortize the coefficient loads).
template <typename Op, typename scalar_t, typename acc_t, int VEC, typename index_t>
__global__ void __launch_bounds__(
    kThreads, Op::kInputs == 1 ? kNormalizeMinBlocks : kChannelsLastMinBlocks)
    elemt_channels_last_kernel(
    Op op, ElemtPointers<scalar_t, Op::kInputs> ptr, index_t M, index_t c_vec) {
  using V = Vec<scalar_t, VEC>;
  const index_t cv = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (cv >= c_vec) return;
  op.begin();
  typename Op::Coeff coeff[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) coeff[e] = op.coeff(static_cast<int64_t>(cv) * VEC + e);
  const index_t stride = static_cast<index_t>(gridDim.y) * blockDim.y;
  for (index_t row = static_cast<index_t>(blockIdx.y) * blockDim.y + threadIdx.y; row < M;
       row += kRowsPerThread * stride) {
    V in[kRowsPerThread][Op::kInputs];
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      const index_t rr = row + r * stride;
      if (rr >= M) continue;
#pragma unroll
      for (int t = 0; t < Op::kInputs; ++t) in[r][t] = reinterpret_cast<const V*>(ptr.in[t])[rr * c_vec + cv];
    }
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      const index_t rr = row + r * stride;
      if (rr >= M) continue;
      reinterpret_cast<V*>(ptr.out)[rr * c_vec + cv] =
          compute_vector<Op, scalar_t, acc_t, VEC>(op, in[r], [&](int e) { return coeff[e]; });
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Host launchers
// ------------------------------------------------------------------------------------------------

// Most blocks an elementwise launch uses: its grid-stride loops step by at most this many blocks
// times kThreads (channels-first: blocks x kThreads; channels-last: row blocks x TY <= kThreads).
inline int64_t elemt_max_blocks(int device) { return int64_t(sm_count(device)) * kBlocksPerSm * 8; }

template <typename Op, typename scalar_t, typename acc_t, int VEC, typename index_t>
void launch_elemt_with(
    const Op& op, const ElemtPointers<scalar_t, Op::kInputs>& ptr, const Geometry& g, int device,
    cudaStream_t stream) {
  const int64_t numel = g.N * g.C * g.S;
  const int64_t max_blocks = elemt_max_blocks(device);
  if (g.layout == Layout::kChannelsFirst) {
    const int64_t nvec = numel / VEC;
    const auto blocks = static_cast<unsigned>(std::min(ceil_div(nvec, kThreads), max_blocks));
    elemt_channels_first_kernel<Op, scalar_t, acc_t, VEC, index_t><<<blocks, kThreads, 0, stream>>>(
        op, ptr, static_cast<index_t>(nvec), static_cast<index_t>(g.S / VEC),
        static_cast<index_t>(g.C));
  } else {
    const int64_t c_vec = g.C / VEC, rows = g.N * g.S;
    const int tx = next_pow2(c_vec, kWarpSize);
    const int ty = kThreads / tx;
    const int64_t channel_blocks = ceil_div(c_vec, tx);
    const int64_t row_blocks = std::clamp<int64_t>(
        std::min(ceil_div(rows, int64_t(ty) * kRowsPerThread), ceil_div(max_blocks, channel_blocks)),
        1, kMaxGridY);
    const dim3 grid(static_cast<unsigned>(channel_blocks), static_cast<unsigned>(row_blocks));
    elemt_channels_last_kernel<Op, scalar_t, acc_t, VEC, index_t><<<grid, dim3(tx, ty), 0, stream>>>(
        op, ptr, static_cast<index_t>(rows), static_cast<index_t>(c_vec));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Elementwise `op` over `g`: 16-byte vectors when the layout and every pointer allow it, 32-bit
// indices when every index fits.
template <typename Op, typename scalar_t, typename acc_t>
void launch_elemt(
    const Op& op, const ElemtPointers<scalar_t, Op::kInputs>& ptr, const Geometry& g,
    const at::Tensor& like) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  const int device = like.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  bool vectorize = (g.layout == Layout::kChannelsFirst ? g.S : g.C) % kVec == 0 &&
                   aligned_to(ptr.out, sizeof(scalar_t) * kVec);
  for (int t = 0; t < Op::kInputs; ++t) {
    vectorize = vectorize && aligned_to(ptr.in[t], sizeof(scalar_t) * kVec);
  }
  // 32-bit indices only if the grid-stride loops' last step past the end (index + stride) fits
  // too: with numel <= INT32_MAX alone, k += stride wrapped for numel near INT32_MAX. The
  // channels-last kernel steps kRowsPerThread strides at once.
  const int64_t max_stride = elemt_max_blocks(device) * kThreads * kRowsPerThread;
  const bool small = g.N * g.C * g.S + max_stride <= std::numeric_limits<int32_t>::max();
  if (vectorize && small) {
    launch_elemt_with<Op, scalar_t, acc_t, kVec, int32_t>(op, ptr, g, device, stream);
  } else if (vectorize) {
    launch_elemt_with<Op, scalar_t, acc_t, kVec, int64_t>(op, ptr, g, device, stream);
  } else if (small) {
    launch_elemt_with<Op, scalar_t, acc_t, 1, int32_t>(op, ptr, g, device, stream);
  } else {
    launch_elemt_with<Op, scalar_t, acc_t, 1, int64_t>(op, ptr, g, device, stream);
  }
}

}  // namespace
}  // namespace syncbn
