// CUDA kernels of the synchronized-BatchNorm primitives (see syncbn.h for the maths).
//
// Layout of this file: device helpers, kernels, host launchers, entry points.
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
// Elementwise kernels (normalize, backward_elemt) read and write 16-byte vectors where the layout
// and alignment allow it (same channel along the vector for channels-first, consecutive channels
// for channels-last), with 32-bit indexing unless the tensor needs 64 bits.
//
// Nothing here reads device memory on the host or synchronizes: the merge of gathered per-rank
// statistics handles zero-count ranks inside the kernel, and backward_elemt reads the group count
// from device memory, so a layer can be captured in a CUDA graph. Every launch uses the current
// stream and is followed by a launch check.
//
// Includes are kept to c10/cuda and ATen core on purpose: ATen/cuda/CUDAContext.h pulls in the
// cuBLAS/cuSPARSE/cuSOLVER headers, which a CPU-only torch and a bare nvcc install may not have;
// this way the file also compiles (tests/test_cuda_build.py) on machines without a GPU.
#include "syncbn.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "merge.cuh"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>

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

// Chan's merge of (nb, mean_b, m2_b) into (n, mean, m2); either side may be empty (n = 0).
template <typename T>
__device__ __forceinline__ void welford_combine(T* a, const T* b) {
  const T n = a[0] + b[0];
  if (n == T(0)) return;
  const T d = b[1] - a[1];
  const T f = b[0] / n;
  a[1] += d * f;
  a[2] += b[2] + d * d * a[0] * f;
  a[0] = n;
}

template <typename scalar_t, int VEC>
struct alignas(sizeof(scalar_t) * VEC) Vec {
  scalar_t v[VEC];
};

template <int VEC, typename scalar_t>
__device__ __forceinline__ Vec<scalar_t, VEC> load_vec(const scalar_t* p, int64_t i) {
  return *reinterpret_cast<const Vec<scalar_t, VEC>*>(p + i);
}

bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Per-channel Welford state: fields (count, mean, m2), of the values minus a per-channel shift (the
// channel's first value), so that float32 keeps its precision when |mean| >> std. All blocks of a
// channel use the same shift, so partials merge as they are and the shift is added at the end.
// An Op's per-channel constants are its Channel: a reduction kernel holds one per channel it
// walks; vector loads read VEC consecutive channels (channels-last) at once.
template <typename scalar_t, typename acc_t>
struct WelfordOp {
  static constexpr int kFields = 3;
  using scalar_type = scalar_t;
  using Item = acc_t;
  using Channel = acc_t;  // the shift
  const scalar_t* __restrict__ x;
  int64_t shift_stride;  // the first value of channel c is x[c * shift_stride]

  __device__ Channel channel(int64_t c) const { return to_acc<acc_t>(x[c * shift_stride]); }
  bool aligned(size_t bytes) const { return aligned_to(x, bytes); }
  __device__ __forceinline__ Item load(int64_t i, Channel shift) const {
    return to_acc<acc_t>(x[i]) - shift;
  }
  template <int VEC>
  __device__ __forceinline__ void load_vec(int64_t i, const Channel* shift, Item* v) const {
    const Vec<scalar_t, VEC> raw = syncbn::load_vec<VEC>(x, i);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = to_acc<acc_t>(raw.v[e]) - shift[e];
  }
  __device__ __forceinline__ void push(acc_t* s, Item v, Channel) const {
    s[0] += acc_t(1);
    const acc_t d = v - s[1];
    s[1] += d / s[0];
    s[2] += d * (v - s[1]);
  }
  // The first `count` of N items of one channel, in order.
  template <int N>
  __device__ __forceinline__ void push_run(acc_t* s, const Item* v, int count, Channel ch) const {
#pragma unroll
    for (int u = 0; u < N; ++u) {
      if (u < count) push(s, v[u], ch);
    }
  }
  // VEC channels that have seen the same rows share their count: one division per row.
  template <int VEC>
  __device__ __forceinline__ void push_vec(
      acc_t (*s)[kFields], const Item* v, const Channel*) const {
    const acc_t n = s[0][0] + acc_t(1);
    const acc_t inv = acc_t(1) / n;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const acc_t d = v[e] - s[e][1];
      s[e][0] = n;
      s[e][1] += d * inv;
      s[e][2] += d * (v[e] - s[e][1]);
    }
  }
  template <typename T>
  __device__ __forceinline__ static void combine(T* a, const T* b) {
    welford_combine(a, b);
  }
  // (mean, m2) of the unshifted values.
  template <typename T>
  __device__ __forceinline__ void outputs(
      const T* s, Channel shift, acc_t& out0, acc_t& out1) const {
    out0 = static_cast<acc_t>(static_cast<T>(shift) + s[1]);
    out1 = static_cast<acc_t>(s[2]);
  }
};

// A channel's mean and, for a fused activation, the coefficients of z = (x - mean) * scale + shift.
template <typename acc_t>
struct ZChannel {
  acc_t mean, scale, shift;
};

// Per-channel backward sums: fields (sum dy, sum dy * (x - mean)); with a fused activation, dy *
// act'(z) in place of dy (activation.h), z recomputed from x.
template <typename scalar_t, typename acc_t, typename Act = IdentityAct>
struct GradSumOp {
  static constexpr int kFields = 2;
  using scalar_type = scalar_t;
  struct Item {
    acc_t dy, x;
  };
  using Channel = ZChannel<acc_t>;
  const scalar_t* __restrict__ dy;
  const scalar_t* __restrict__ x;
  const acc_t* __restrict__ mean;
  // Read only with an activation (weight and bias may be null: 1 and 0).
  const acc_t* __restrict__ invstd = nullptr;
  const acc_t* __restrict__ weight = nullptr;
  const acc_t* __restrict__ bias = nullptr;
  Act act = {};

  __device__ Channel channel(int64_t c) const {
    if constexpr (Act::kIdentity) {
      return {mean[c], acc_t(0), acc_t(0)};
    } else {
      return {mean[c], invstd[c] * (weight ? weight[c] : acc_t(1)), bias ? bias[c] : acc_t(0)};
    }
  }
  bool aligned(size_t bytes) const { return aligned_to(dy, bytes) && aligned_to(x, bytes); }
  __device__ __forceinline__ Item load(int64_t i, Channel) const {
    return {to_acc<acc_t>(dy[i]), to_acc<acc_t>(x[i])};
  }
  template <int VEC>
  __device__ __forceinline__ void load_vec(int64_t i, const Channel*, Item* v) const {
    const Vec<scalar_t, VEC> rdy = syncbn::load_vec<VEC>(dy, i);
    const Vec<scalar_t, VEC> rx = syncbn::load_vec<VEC>(x, i);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = {to_acc<acc_t>(rdy.v[e]), to_acc<acc_t>(rx.v[e])};
  }
  // dy * act'(z) (dy without an activation) for N items, the activation's branch taken once.
  template <int N>
  __device__ __forceinline__ void input_grads(
      const Item* v, const Channel* ch, int ch_step, acc_t* dz, acc_t* xm) const {
    acc_t g[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const Channel& c = ch[i * ch_step];
      xm[i] = v[i].x - c.mean;
      g[i] = xm[i] * c.scale + c.shift;
    }
    if constexpr (!Act::kIdentity) act.template grad_n<N>(g);
#pragma unroll
    for (int i = 0; i < N; ++i) dz[i] = Act::kIdentity ? v[i].dy : v[i].dy * g[i];
  }
  __device__ __forceinline__ void push(acc_t* s, Item v, const Channel& ch) const {
    push_run<1>(s, &v, 1, ch);
  }
  // The first `count` of N items of one channel.
  template <int N>
  __device__ __forceinline__ void push_run(
      acc_t* s, const Item* v, int count, const Channel& ch) const {
    acc_t dz[N], xm[N];
    input_grads<N>(v, &ch, 0, dz, xm);
#pragma unroll
    for (int u = 0; u < N; ++u) {
      if (u < count) {
        s[0] += dz[u];
        s[1] += dz[u] * xm[u];
      }
    }
  }
  template <int VEC>
  __device__ __forceinline__ void push_vec(
      acc_t (*s)[kFields], const Item* v, const Channel* ch) const {
    acc_t dz[VEC], xm[VEC];
    input_grads<VEC>(v, ch, 1, dz, xm);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      s[e][0] += dz[e];
      s[e][1] += dz[e] * xm[e];
    }
  }
  template <typename T>
  __device__ __forceinline__ static void combine(T* a, const T* b) {
    a[0] += b[0];
    a[1] += b[1];
  }
  // (sum dy, sum dy * (x - mean)).
  template <typename T>
  __device__ __forceinline__ void outputs(const T* s, Channel, acc_t& out0, acc_t& out1) const {
    out0 = static_cast<acc_t>(s[0]);
    out1 = static_cast<acc_t>(s[1]);
  }
};

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
    acc_t* __restrict__ partial, acc_t* __restrict__ out0, acc_t* __restrict__ out1) {
  if (gridDim.y == 1) {
    op.outputs(s, ch, out0[c], out1[c]);
    return;
  }
  acc_t* p = partial + (static_cast<int64_t>(blockIdx.y) * C + c) * Op::kFields;
#pragma unroll
  for (int f = 0; f < Op::kFields; ++f) p[f] = s[f];
}

// y = act((x - mean) * invstd * weight + bias).
template <typename acc_t, typename Act = IdentityAct>
struct NormalizeOp {
  static constexpr int kInputs = 1;
  struct Coeff {
    acc_t mean, scale, shift;
  };
  const acc_t* __restrict__ mean;
  const acc_t* __restrict__ invstd;
  const acc_t* __restrict__ weight;  // may be null
  const acc_t* __restrict__ bias;    // may be null
  Act act = {};

  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ Coeff coeff(int64_t c) const {
    return {mean[c], invstd[c] * (weight ? weight[c] : acc_t(1)), bias ? bias[c] : acc_t(0)};
  }
  // out[e] = op of element e of every input (in[t][e]), with the coefficients coeff_of(e).
  template <int VEC, typename CoeffOf>
  __device__ __forceinline__ void apply_vec(
      CoeffOf coeff_of, const acc_t (*in)[VEC], acc_t* out) const {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const Coeff k = coeff_of(e);
      out[e] = (in[0][e] - k.mean) * k.scale + k.shift;
    }
    act.template forward_n<VEC>(out);
  }
};

// dx = (dy - mean_dy - (x - mean) * k) * iw with mean_dy = sum_dy / n, k = sum_dy_xmu / n *
// invstd^2 and iw = invstd * weight, where n is the group count read from device memory.
// (x - mean) stays explicit: folding it into an offset cancels catastrophically for large means.
// With a fused activation dy * act'(z) stands for dy, z = (x - mean) * iw + bias as in the forward.
template <typename acc_t, typename Act = IdentityAct>
struct BackwardElemtOp {
  static constexpr int kInputs = 2;  // dy, x
  struct Coeff {
    acc_t mean, iw, mean_dy, k, shift;
  };
  const acc_t* __restrict__ mean;
  const acc_t* __restrict__ invstd;
  const acc_t* __restrict__ weight;  // may be null
  const acc_t* __restrict__ sum_dy;
  const acc_t* __restrict__ sum_dy_xmu;
  const acc_t* __restrict__ count;  // one element
  const acc_t* __restrict__ bias = nullptr;  // read only with an activation (may be null: 0)
  Act act = {};
  acc_t inv_n = acc_t(0);           // 1 / count, set by begin()

  // Once per thread, before coeff(): one read of the group count and one division, instead of
  // an FP64 division and three FP64 multiplies per element (1/32-1/64 rate on many GPUs).
  __device__ __forceinline__ void begin() {
    const acc_t n = count[0];
    inv_n = acc_t(1) / (n > acc_t(1) ? n : acc_t(1));
  }
  __device__ __forceinline__ Coeff coeff(int64_t c) const {
    const acc_t is = invstd[c];
    const acc_t iw = weight ? is * weight[c] : is;
    const acc_t shift = !Act::kIdentity && bias ? bias[c] : acc_t(0);
    return {mean[c], iw, sum_dy[c] * inv_n, sum_dy_xmu[c] * inv_n * is * is, shift};
  }
  template <int VEC, typename CoeffOf>
  __device__ __forceinline__ void apply_vec(
      CoeffOf coeff_of, const acc_t (*in)[VEC], acc_t* out) const {
    acc_t xm[VEC], g[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const Coeff k = coeff_of(e);
      xm[e] = in[1][e] - k.mean;
      g[e] = xm[e] * k.iw + k.shift;
    }
    if constexpr (!Act::kIdentity) act.template grad_n<VEC>(g);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const Coeff k = coeff_of(e);
      const acc_t dz = Act::kIdentity ? in[0][e] : in[0][e] * g[e];
      out[e] = (dz - k.mean_dy - xm[e] * k.k) * k.iw;
    }
  }
};

template <typename scalar_t, int K>
struct ElemtPointers {
  const scalar_t* __restrict__ in[K];
  scalar_t* __restrict__ out;
};

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

// Channels-first reduction. Block (1, 256) on channel blockIdx.x, split blockIdx.y of gridDim.y:
// elements [j0, j1) of the channel's N * S, element j at ((j / S) * C + c) * S + j % S.
template <typename Op, typename acc_t>
__global__ void reduce_channels_first_kernel(
    Op op, int64_t N, int64_t C, int64_t S, acc_t* __restrict__ partial, acc_t* __restrict__ out0,
    acc_t* __restrict__ out1) {
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
  if (threadIdx.y == 0) store_fold(op, s[0], ch, c, C, partial, out0, out1);
}

// Channels-last reduction over M rows of C contiguous channels, VEC consecutive channels per thread
// (one 16-byte load per row when VEC > 1). Block (TX, TY): channels [cv * VEC, cv * VEC + VEC) with
// cv = blockIdx.x * TX + threadIdx.x, rows [r0, r1) of split blockIdx.y strided by TY.
template <typename Op, int VEC, typename acc_t>
__global__ void __launch_bounds__(kThreads, kChannelsLastMinBlocks) reduce_channels_last_kernel(
    Op op, int64_t M, int64_t C, acc_t* __restrict__ partial, acc_t* __restrict__ out0,
    acc_t* __restrict__ out1) {
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
    for (int e = 0; e < VEC; ++e) store_fold(op, s[e], ch[e], c0 + e, C, partial, out0, out1);
  }
}

// Folds partial[p, c, :] over p = 0..splits-1 in double. Block (32, kFoldGroups): thread (tx, ty)
// folds splits ty, ty + kFoldGroups, ... of channel blockIdx.x * 32 + tx (a warp reads 32
// consecutive channels of one split: coalesced), then the groups fold in shared memory along a
// fixed tree (deterministic: the result does not depend on which thread runs first).
template <typename Op, typename acc_t>
__global__ void __launch_bounds__(kWarpSize * kFoldGroups) fold_partials_kernel(
    Op op, const acc_t* __restrict__ partial, int64_t splits, int64_t C, acc_t* __restrict__ out0,
    acc_t* __restrict__ out1) {
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
  if (threadIdx.y == 0 && c < C) op.outputs(s, op.channel(c), out0[c], out1[c]);
}

// Count-weighted merge of W ranks' statistics, one thread per channel (merge.cuh).
template <typename acc_t>
__global__ void chan_merge_kernel(
    const acc_t* __restrict__ counts, const acc_t* __restrict__ means,
    const acc_t* __restrict__ m2s, int64_t W, int64_t C, double eps, bool unbiased,
    acc_t* __restrict__ mean_out, acc_t* __restrict__ invstd_out, acc_t* __restrict__ var_out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const MergedChannel m = merge_channel(counts, 1, means, m2s, C, W, c);
  m.store(c, eps, unbiased, mean_out, invstd_out, var_out);
}

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

// Applies `op` to vectors of VEC elements that share one channel (channels-first, S % VEC == 0).
// nvec = numel / VEC, s_vec = S / VEC; grid-stride over vectors.
template <typename Op, typename scalar_t, typename acc_t, int VEC, typename index_t>
__global__ void elemt_channels_first_kernel(
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

constexpr int kMaxDevices = 64;

// Multiprocessor count of `device`, queried once (an attribute query, safe during graph capture).
int sm_count(int device) {
  static std::atomic<int> cache[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) device = 0;
  int value = cache[device].load(std::memory_order_relaxed);
  if (value == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device));
    cache[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int next_pow2(int64_t v, int cap) {
  int p = 1;
  while (p < v && p < cap) p <<= 1;
  return p;
}

// Splits of one channel's `work` elements for `blocks_per_split` blocks per split: enough blocks
// to fill the GPU, at least kMinPerThread elements per thread, at most kMaxPerBlock per block.
int64_t reduction_splits(int64_t work, int64_t blocks_per_split, int threads, int device) {
  const int64_t target = ceil_div(int64_t(sm_count(device)) * kBlocksPerSm, blocks_per_split);
  const int64_t by_work = std::max<int64_t>(1, work / (int64_t(threads) * kMinPerThread));
  int64_t splits = std::min(target, by_work);
  splits = std::max(splits, ceil_div(work, kMaxPerBlock));
  return std::clamp<int64_t>(splits, 1, kMaxGridY);
}

// Runs the two-stage reduction `op` over `g`, writing the [C] outputs out0 and out1. Channels-last
// reads 16-byte vectors of consecutive channels when C and the pointers allow it.
template <typename Op, typename acc_t>
void launch_reduction(
    const Op& op, const Geometry& g, const at::Tensor& like, acc_t* out0, acc_t* out1) {
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
        <<<grid, block, 0, stream>>>(op, g.N, g.C, g.S, partial_ptr, out0, out1);
  } else if (vec > 1) {
    reduce_channels_last_kernel<Op, kVec, acc_t>
        <<<grid, block, 0, stream>>>(op, g.N * g.S, g.C, partial_ptr, out0, out1);
  } else {
    reduce_channels_last_kernel<Op, 1, acc_t>
        <<<grid, block, 0, stream>>>(op, g.N * g.S, g.C, partial_ptr, out0, out1);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) {
    const dim3 fold_block(kWarpSize, kFoldGroups);
    fold_partials_kernel<Op, acc_t><<<static_cast<unsigned>(ceil_div(g.C, kWarpSize)), fold_block, 0, stream>>>(
        op, partial_ptr, splits, g.C, out0, out1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Most blocks an elementwise launch uses: its grid-stride loops step by at most this many blocks
// times kThreads (channels-first: blocks x kThreads; channels-last: row blocks x TY <= kThreads).
int64_t elemt_max_blocks(int device) { return int64_t(sm_count(device)) * kBlocksPerSm * 8; }

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

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Entry points: argument checks, layout, dtype dispatch
// ------------------------------------------------------------------------------------------------

namespace detail {

void local_stats_into_cuda(const at::Tensor& input, at::Tensor& mean, at::Tensor& m2) {
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "local_stats_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t shift_stride = g.layout == Layout::kChannelsFirst ? g.S : 1;
    const WelfordOp<scalar_t, acc_t> op{input.const_data_ptr<scalar_t>(), shift_stride};
    launch_reduction(op, g, input, mean.mutable_data_ptr<acc_t>(), m2.mutable_data_ptr<acc_t>());
  });
}

void backward_sums_into_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    at::Tensor& sum_dy, at::Tensor& sum_dy_xmu, const ActAffine& act) {
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "backward_reduce_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_activation<acc_t>(act.act, [&](const auto& a) {
      const GradSumOp<scalar_t, acc_t, std::decay_t<decltype(a)>> op{
          grad_out.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
          mean.const_data_ptr<acc_t>(), data_or_null<acc_t>(act.invstd),
          data_or_null<acc_t>(act.weight), data_or_null<acc_t>(act.bias), a};
      launch_reduction(
          op, g, input, sum_dy.mutable_data_ptr<acc_t>(), sum_dy_xmu.mutable_data_ptr<acc_t>());
    });
  });
}

}  // namespace detail

std::tuple<at::Tensor, at::Tensor> local_stats_cuda(const at::Tensor& input_) {
  check_input(input_, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = dense_input(input_);
  const Geometry g = geometry_of(input);
  const auto opts = input.options().dtype(acc_dtype_of(input.scalar_type()));
  if (g.N * g.S == 0) return {at::zeros({g.C}, opts), at::zeros({g.C}, opts)};
  at::Tensor mean = at::empty({g.C}, opts);
  at::Tensor m2 = at::empty({g.C}, opts);
  local_stats_into_cuda(input, mean, m2);
  return {mean, m2};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_stats_cuda(
    const at::Tensor& counts_, const at::Tensor& means_, const at::Tensor& m2s_, double eps,
    bool unbiased) {
  check_merge_inputs(counts_, means_, m2s_, eps, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(means_.device());
  const at::Tensor counts = counts_.contiguous(), means = means_.contiguous(), m2s = m2s_.contiguous();
  const int64_t W = counts.size(0), C = means.size(1);
  at::Tensor mean = at::empty({C}, means.options());
  at::Tensor invstd = at::empty({C}, means.options());
  at::Tensor var = at::empty({C}, means.options());
  if (C == 0) return {mean, invstd, var};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(means.get_device()).stream();
  AT_DISPATCH_FLOATING_TYPES(means.scalar_type(), "merge_stats_cuda", [&] {
    chan_merge_kernel<scalar_t><<<static_cast<unsigned>(ceil_div(C, kThreads)), kThreads, 0, stream>>>(
        counts.const_data_ptr<scalar_t>(), means.const_data_ptr<scalar_t>(),
        m2s.const_data_ptr<scalar_t>(), W, C, eps, unbiased, mean.mutable_data_ptr<scalar_t>(),
        invstd.mutable_data_ptr<scalar_t>(), var.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {mean, invstd, var};
}

at::Tensor normalize_cuda(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias) {
  check_normalize_args(input, mean, invstd, c10::DeviceType::CUDA);
  return normalize_act_cuda(input, mean, invstd, weight, bias, Activation{});
}

namespace detail {

at::Tensor normalize_act_cuda(
    const at::Tensor& input_, const at::Tensor& mean_, const at::Tensor& invstd_,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    const Activation& act) {
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = dense_input(input_);
  const at::Tensor mean = mean_.contiguous(), invstd = invstd_.contiguous();
  const at::Tensor w = optional_acc(weight, "weight", input);
  const at::Tensor b = optional_acc(bias, "bias", input);
  at::Tensor output = at::empty_like(input);
  if (input.numel() == 0) return output;
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "normalize_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const ElemtPointers<scalar_t, 1> ptr{
        {input.const_data_ptr<scalar_t>()}, output.mutable_data_ptr<scalar_t>()};
    with_activation<acc_t>(act, [&](const auto& a) {
      using Op = NormalizeOp<acc_t, std::decay_t<decltype(a)>>;
      const Op op{
          mean.const_data_ptr<acc_t>(), invstd.const_data_ptr<acc_t>(), data_or_null<acc_t>(w),
          data_or_null<acc_t>(b), a};
      launch_elemt<Op, scalar_t, acc_t>(op, ptr, g, input);
    });
  });
  return output;
}

}  // namespace detail

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_reduce_cuda(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& mean_,
    const at::Tensor& invstd_, const c10::optional<at::Tensor>& weight, bool weight_grad,
    bool bias_grad) {
  check_backward_args(grad_out_, input_, mean_, invstd_, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = dense_input(input_);
  const at::Tensor grad_out = with_strides_of(grad_out_, input);
  const at::Tensor mean = mean_.contiguous(), invstd = invstd_.contiguous();
  const Geometry g = geometry_of(input);
  at::Tensor sum_dy, sum_dy_xmu;
  if (input.numel() == 0) {
    sum_dy = at::zeros({g.C}, mean.options());
    sum_dy_xmu = at::zeros({g.C}, mean.options());
  } else {
    sum_dy = at::empty({g.C}, mean.options());
    sum_dy_xmu = at::empty({g.C}, mean.options());
    backward_sums_into_cuda(grad_out, input, mean, sum_dy, sum_dy_xmu);
  }
  return with_param_grads(sum_dy, sum_dy_xmu, invstd, weight, input, weight_grad, bias_grad);
}

at::Tensor backward_elemt_cuda(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& mean_,
    const at::Tensor& invstd_, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy_,
    const at::Tensor& sum_dy_xmu_, const at::Tensor& count_) {
  check_backward_args(grad_out_, input_, mean_, invstd_, c10::DeviceType::CUDA);
  check_channel_vector(sum_dy_, "sum_dy", input_, true);
  check_channel_vector(sum_dy_xmu_, "sum_dy_xmu", input_, true);
  check_count(count_, input_);
  return backward_elemt_act_cuda(
      grad_out_, input_, mean_, invstd_, weight, sum_dy_, sum_dy_xmu_, count_, ActAffine{});
}

namespace detail {

at::Tensor backward_elemt_act_cuda(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& mean_,
    const at::Tensor& invstd_, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy_,
    const at::Tensor& sum_dy_xmu_, const at::Tensor& count_, const ActAffine& act) {
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = dense_input(input_);
  const at::Tensor grad_out = with_strides_of(grad_out_, input);
  const at::Tensor mean = mean_.contiguous(), invstd = invstd_.contiguous();
  const at::Tensor sum_dy = sum_dy_.contiguous(), sum_dy_xmu = sum_dy_xmu_.contiguous();
  const at::Tensor w = optional_acc(weight, "weight", input);
  // The count stays on the device (no .item()): the kernel reads it.
  const at::Tensor count = count_.reshape({1}).to(mean.scalar_type());
  at::Tensor grad_in = at::empty_like(input);
  if (input.numel() == 0) return grad_in;
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "backward_elemt_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const ElemtPointers<scalar_t, 2> ptr{
        {grad_out.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>()},
        grad_in.mutable_data_ptr<scalar_t>()};
    with_activation<acc_t>(act.act, [&](const auto& a) {
      using Op = BackwardElemtOp<acc_t, std::decay_t<decltype(a)>>;
      const Op op{
          mean.const_data_ptr<acc_t>(),   invstd.const_data_ptr<acc_t>(),
          data_or_null<acc_t>(w),         sum_dy.const_data_ptr<acc_t>(),
          sum_dy_xmu.const_data_ptr<acc_t>(), count.const_data_ptr<acc_t>(),
          data_or_null<acc_t>(act.bias), a};
      launch_elemt<Op, scalar_t, acc_t>(op, ptr, g, input);
    });
  });
  return grad_in;
}

}  // namespace detail

}  // namespace syncbn
