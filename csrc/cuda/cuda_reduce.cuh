// The two-stage per-channel reduction of the CUDA kernels (see cuda_kernels.cuh for the helpers):
// its device helpers, kernels and launcher, instantiated by stats_cuda.cu (Welford statistics) and
// backward_cuda.cu (backward sums) with their Op.
//
// Reductions (local_stats, backward_reduce) split every channel across many blocks: torch's NCHW
// kernels give a channel one block, which leaves most SMs idle when C is small (a detection neck's
// 2 x 256 x 200 x 336 map has 256 blocks for 132 SMs x 2048 threads). A block folds its slice into
// one partial per channel (per-thread state, then warp shuffles, then shared memory), the partials
// go to a [splits, C, fields] workspace, and a second kernel folds them in a fixed order in double.
// With one split per channel the first kernel writes the result directly (one launch).
//   * channels-first: block = 256 threads on ONE channel; a split is a contiguous range of that
//     channel's N * S elements, walked without a division per element.
//   * channels-last: block = TX channels x TY rows (TX = min(32, C) rounded up to a power of two),
//     so a warp reads whole rows of contiguous channels; the TY rows are folded by shuffles among
//     the lanes holding the same channel, then across warps.
//
// An Op (WelfordOp, ShiftedSumOp, GradSumOp) says what is reduced: kFields per-channel
// accumulators, its per-channel constants (Channel), how items are loaded and pushed, how two
// states combine and what the outputs are (up to three [C] outputs, Outputs).
#pragma once

#include "cuda_kernels.cuh"

#include <algorithm>
#include <cstdint>

namespace syncbn {
namespace {

// The [C] outputs of a reduction; an Op writes the ones it has (out2 may be null).
template <typename acc_t>
struct Outputs {
  acc_t* __restrict__ out0;
  acc_t* __restrict__ out1;
  acc_t* __restrict__ out2;
};

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------

// Folds the states of lanes lane, lane + stride, lane + 2 * stride, ... of each warp into the lanes
// below `stride` (stride a power of two <= 32; 32 folds nothing).
template <typename Op, typename acc_t>
__device__ __forceinline__ void warp_fold(acc_t* s, int stride) {
  for (int offset = kWarpSize / 2; offset >= stride; offset >>= 1) {
    acc_t other[Op::kFields];
#pragma unroll
    for (int f = 0; f < Op::kFields; ++f) other[f] = __shfl_down_sync(kFullMask, s[f], offset);
    Op::combine(s, other);
  }
}

// Folds the states of a (TX, TY) block over TY, VEC channels per thread; thread (tx, 0) returns the
// folds of column tx. Every thread of the block must call it (shuffles and a barrier inside).
template <typename Op, int VEC, typename acc_t>
__device__ __forceinline__ void block_fold(acc_t (*s)[Op::kFields]) {
  constexpr int F = Op::kFields;
  __shared__ acc_t shared[kWarps * kWarpSize * F * VEC];
  const int tx_count = blockDim.x;  // a power of two <= 32
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int lane = tid % kWarpSize, warp = tid / kWarpSize;
#pragma unroll
  for (int e = 0; e < VEC; ++e) warp_fold<Op>(s[e], tx_count);
  if (lane < tx_count) {
    acc_t* mine = &shared[(warp * tx_count + lane) * F * VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
#pragma unroll
      for (int f = 0; f < F; ++f) mine[e * F + f] = s[e][f];
    }
  }
  __syncthreads();
  if (tid < tx_count) {
    for (int w = 1; w < kWarps; ++w) {
      const acc_t* other = &shared[(w * tx_count + tid) * F * VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) Op::combine(s[e], other + e * F);
    }
  }
}

// Writes a block's fold of channel c: straight to the outputs with one split, else to the partials
// workspace.
template <typename Op, typename acc_t>
__device__ __forceinline__ void store_fold(
    const Op& op, const acc_t* s, typename Op::Channel ch, int64_t c, int64_t C,
    acc_t* __restrict__ partial, const Outputs<acc_t>& out) {
  if (gridDim.y == 1) {
    op.outputs(s, ch, c, out);
    return;
  }
  acc_t* p = partial + (static_cast<int64_t>(blockIdx.y) * C + c) * Op::kFields;
#pragma unroll
  for (int f = 0; f < Op::kFields; ++f) p[f] = s[f];
}

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

// Channels-first reduction. Block (1, 256) on channel blockIdx.x, split blockIdx.y of gridDim.y:
// elements [j0, j1) of the channel's N * S, element j at ((j / S) * C + c) * S + j % S.
template <typename Op, typename acc_t>
__global__ void __launch_bounds__(kThreads) reduce_channels_first_kernel(
    Op op, int64_t N, int64_t C, int64_t S, acc_t* __restrict__ partial, Outputs<acc_t> out) {
  const int64_t c = blockIdx.x;
  const int64_t per_channel = N * S;
  const int64_t j0 = per_channel * blockIdx.y / gridDim.y;
  const int64_t j1 = per_channel * (blockIdx.y + 1) / gridDim.y;
  const typename Op::Channel ch = op.channel(c);
  acc_t s[1][Op::kFields] = {};
  // (n, i) of element j advance by kThreads per step as (q, r), with one carry: no division.
  const int64_t q = kThreads / S, r = kThreads % S;
  int64_t j = j0 + threadIdx.y;
  int64_t n = j / S, i = j - n * S;
  while (j < j1) {
    typename Op::Item v[kUnroll] = {};
    int loaded = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j < j1) {
        v[u] = op.load((n * C + c) * S + i, ch);
        ++loaded;
        j += kThreads;
        n += q;
        i += r;
        if (i >= S) {
          i -= S;
          ++n;
        }
      }
    }
    op.template push_run<kUnroll>(s[0], v, loaded, ch);
  }
  block_fold<Op, 1>(s);
  if (threadIdx.y == 0) store_fold(op, s[0], ch, c, C, partial, out);
}

// Channels-last reduction over M rows of C contiguous channels, VEC consecutive channels per thread
// (one 16-byte load per row when VEC > 1). Block (TX, TY): channels [cv * VEC, cv * VEC + VEC) with
// cv = blockIdx.x * TX + threadIdx.x, rows [r0, r1) of split blockIdx.y strided by TY.
template <typename Op, int VEC, typename acc_t>
__global__ void __launch_bounds__(kThreads, kChannelsLastMinBlocks) reduce_channels_last_kernel(
    Op op, int64_t M, int64_t C, acc_t* __restrict__ partial, Outputs<acc_t> out) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  const int64_t r0 = M * blockIdx.y / gridDim.y, r1 = M * (blockIdx.y + 1) / gridDim.y;
  acc_t s[VEC][Op::kFields] = {};
  typename Op::Channel ch[VEC];
  if (c0 < C) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) ch[e] = op.channel(c0 + e);
    for (int64_t row = r0 + threadIdx.y; row < r1; row += kUnroll * blockDim.y) {
      typename Op::Item v[kUnroll][VEC];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t ru = row + u * blockDim.y;
        if (ru >= r1) continue;
        if constexpr (VEC == 1) {
          v[u][0] = op.load(ru * C + c0, ch[0]);
        } else {
          op.template load_vec<VEC>(ru * C + c0, ch, v[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (row + u * blockDim.y < r1) op.template push_vec<VEC>(s, v[u], ch);
      }
    }
  }
  block_fold<Op, VEC>(s);  // every thread, including those past C
  if (threadIdx.y == 0 && c0 < C) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) store_fold(op, s[e], ch[e], c0 + e, C, partial, out);
  }
}

// Folds partial[p, c, :] over p = 0..splits-1 in double. Block (32, kFoldGroups): thread (tx, ty)
// folds splits ty, ty + kFoldGroups, ... of channel blockIdx.x * 32 + tx (a warp reads 32
// consecutive channels of one split: coalesced), then the groups fold in shared memory along a
// fixed tree (deterministic: the result does not depend on which thread runs first).
template <typename Op, typename acc_t>
__global__ void __launch_bounds__(kWarpSize * kFoldGroups) fold_partials_kernel(
    Op op, const acc_t* __restrict__ partial, int64_t splits, int64_t C, Outputs<acc_t> out) {
  __shared__ double shared[kFoldGroups][kWarpSize][Op::kFields];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarpSize + threadIdx.x;
  double* s = shared[threadIdx.y][threadIdx.x];
#pragma unroll
  for (int f = 0; f < Op::kFields; ++f) s[f] = 0.0;
  // kUnroll partials loaded before they are combined: independent loads in flight per thread.
  for (int64_t p0 = threadIdx.y; c < C && p0 < splits; p0 += kUnroll * kFoldGroups) {
    double b[kUnroll][Op::kFields];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + u * kFoldGroups;
#pragma unroll
      for (int f = 0; f < Op::kFields; ++f) {
        b[u][f] = p < splits ? static_cast<double>(partial[(p * C + c) * Op::kFields + f]) : 0.0;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) Op::combine(s, b[u]);
  }
  __syncthreads();
  for (int half = kFoldGroups / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.y) < half) Op::combine(s, shared[threadIdx.y + half][threadIdx.x]);
    __syncthreads();
  }
  if (threadIdx.y == 0 && c < C) op.outputs(s, op.channel(c), c, out);
}

// ------------------------------------------------------------------------------------------------
// Host launcher
// ------------------------------------------------------------------------------------------------

// Splits of one channel's `work` elements for `blocks_per_split` blocks per split: enough blocks
// to fill the GPU, at least kMinPerThread elements per thread, at most kMaxPerBlock per block.
inline int64_t reduction_splits(int64_t work, int64_t blocks_per_split, int threads, int device) {
  const int64_t target = ceil_div(int64_t(sm_count(device)) * kBlocksPerSm, blocks_per_split);
  const int64_t by_work = std::max<int64_t>(1, work / (int64_t(threads) * kMinPerThread));
  int64_t splits = std::min(target, by_work);
  splits = std::max(splits, ceil_div(work, kMaxPerBlock));
  return std::clamp<int64_t>(splits, 1, kMaxGridY);
}

// Runs the two-stage reduction `op` over `g`, writing the [C] outputs `out`. Channels-last reads
// 16-byte vectors of consecutive channels when C and the pointers allow it.
template <typename Op, typename acc_t>
void launch_reduction(
    const Op& op, const Geometry& g, const at::Tensor& like, const Outputs<acc_t>& out) {
  constexpr int kVec = 16 / sizeof(typename Op::scalar_type);
  const int device = like.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const bool channels_first = g.layout == Layout::kChannelsFirst;
  const int vec = !channels_first && g.C % kVec == 0 && op.aligned(16) ? kVec : 1;
  dim3 block, grid;
  int64_t splits;
  if (channels_first) {
    splits = reduction_splits(g.N * g.S, g.C, kThreads, device);
    block = dim3(1, kThreads);
    grid = dim3(static_cast<unsigned>(g.C), static_cast<unsigned>(splits));
  } else {
    const int tx = next_pow2(g.C / vec, kWarpSize);
    const int64_t channel_blocks = ceil_div(g.C / vec, tx);
    splits = reduction_splits(g.N * g.S, channel_blocks, kThreads / tx, device);
    block = dim3(tx, kThreads / tx);
    grid = dim3(static_cast<unsigned>(channel_blocks), static_cast<unsigned>(splits));
  }
  at::Tensor partial;
  acc_t* partial_ptr = nullptr;
  if (splits > 1) {
    const auto acc = c10::CppTypeToScalarType<acc_t>::value;
    partial = at::empty({splits, g.C, Op::kFields}, like.options().dtype(acc));
    partial_ptr = partial.mutable_data_ptr<acc_t>();
  }
  if (channels_first) {
    reduce_channels_first_kernel<Op, acc_t>
        <<<grid, block, 0, stream>>>(op, g.N, g.C, g.S, partial_ptr, out);
  } else if (vec > 1) {
    reduce_channels_last_kernel<Op, kVec, acc_t>
        <<<grid, block, 0, stream>>>(op, g.N * g.S, g.C, partial_ptr, out);
  } else {
    reduce_channels_last_kernel<Op, 1, acc_t>
        <<<grid, block, 0, stream>>>(op, g.N * g.S, g.C, partial_ptr, out);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) {
    const dim3 fold_block(kWarpSize, kFoldGroups);
    fold_partials_kernel<Op, acc_t><<<static_cast<unsigned>(ceil_div(g.C, kWarpSize)), fold_block, 0, stream>>>(
        op, partial_ptr, splits, g.C, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace
}  // namespace syncbn
