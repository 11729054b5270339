// CUDA kernels of the statistics (see syncbn.h for the maths): per-channel Welford statistics of
// the local batch and the reduce exchange's shifted float64 sums, both through the two-stage
// reduction (cuda_reduce.cuh), and the count-weighted (Chan) merge of per-rank statistics
// (merge.h). Layout of this file: device helpers, kernels, dispatch.
#include "cuda_reduce.cuh"
#include "merge.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <cstdint>

namespace syncbn {
namespace {

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------

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
  // (mean, m2) of the unshifted values, and in out2 (if given) the remainder of the mean: the
  // shift and the shifted mean summed in double, less the rounded mean (the split local mean).
  template <typename T>
  __device__ __forceinline__ void outputs(
      const T* s, Channel shift, int64_t c, const Outputs<acc_t>& out) const {
    const acc_t mean = static_cast<acc_t>(static_cast<T>(shift) + s[1]);
    out.out0[c] = mean;
    out.out1[c] = static_cast<acc_t>(s[2]);
    if (out.out2) {
      const double exact = static_cast<double>(shift) + static_cast<double>(s[1]);
      out.out2[c] = static_cast<acc_t>(exact - static_cast<double>(mean));
    }
  }
};

// The reduce exchange's per-channel sums in double: fields (sum (x - K), sum (x - K)^2), K the
// channel's shift (the running mean, else 0), both scaled by `scale` at the end (1, or 1 / count
// with equal rank weights). Instantiated with acc_t = double throughout the reduction.
template <typename scalar_t>
struct ShiftedSumOp {
  static constexpr int kFields = 2;
  using scalar_type = scalar_t;
  using Item = double;
  using Channel = double;  // K
  const scalar_t* __restrict__ x;
  const double* __restrict__ shift;  // may be null
  double scale;

  __device__ Channel channel(int64_t c) const { return shift ? shift[c] : 0.0; }
  bool aligned(size_t bytes) const { return aligned_to(x, bytes); }
  __device__ __forceinline__ static double value(scalar_t v) {
    return static_cast<double>(static_cast<at::opmath_type<scalar_t>>(v));
  }
  __device__ __forceinline__ Item load(int64_t i, Channel k) const { return value(x[i]) - k; }
  template <int VEC>
  __device__ __forceinline__ void load_vec(int64_t i, const Channel* k, Item* v) const {
    const Vec<scalar_t, VEC> raw = syncbn::load_vec<VEC>(x, i);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = value(raw.v[e]) - k[e];
  }
  __device__ __forceinline__ void push(double* s, Item v, Channel) const {
    s[0] += v;
    s[1] += v * v;
  }
  template <int N>
  __device__ __forceinline__ void push_run(double* s, const Item* v, int count, Channel ch) const {
#pragma unroll
    for (int u = 0; u < N; ++u) {
      if (u < count) push(s, v[u], ch);
    }
  }
  template <int VEC>
  __device__ __forceinline__ void push_vec(double (*s)[kFields], const Item* v, const Channel*) const {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      s[e][0] += v[e];
      s[e][1] += v[e] * v[e];
    }
  }
  template <typename T>
  __device__ __forceinline__ static void combine(T* a, const T* b) {
    a[0] += b[0];
    a[1] += b[1];
  }
  template <typename T>
  __device__ __forceinline__ void outputs(
      const T* s, Channel, int64_t c, const Outputs<double>& out) const {
    out.out0[c] = static_cast<double>(s[0]) * scale;
    out.out1[c] = static_cast<double>(s[1]) * scale;
  }
};

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

// Count-weighted merge of W ranks' statistics, one thread per channel (merge.h).
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) chan_merge_kernel(
    const acc_t* __restrict__ counts, const acc_t* __restrict__ means,
    const acc_t* __restrict__ m2s, int64_t W, int64_t C, double eps, bool unbiased,
    acc_t* __restrict__ mean_out, acc_t* __restrict__ invstd_out, acc_t* __restrict__ var_out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const MergedChannel m = merge_channel(counts, 1, means, m2s, C, W, c);
  m.store(c, eps, unbiased, mean_out, invstd_out, var_out);
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Dispatch: dtype, layout
// ------------------------------------------------------------------------------------------------

namespace detail {

void local_stats_into_cuda(
    const at::Tensor& input, at::Tensor& mean, at::Tensor& m2, at::Tensor* mean_lo) {
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "local_stats_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t shift_stride = g.layout == Layout::kChannelsFirst ? g.S : 1;
    const WelfordOp<scalar_t, acc_t> op{input.const_data_ptr<scalar_t>(), shift_stride};
    const Outputs<acc_t> out{
        mean.mutable_data_ptr<acc_t>(), m2.mutable_data_ptr<acc_t>(),
        mean_lo ? mean_lo->mutable_data_ptr<acc_t>() : nullptr};
    launch_reduction(op, g, input, out);
  });
}

void shifted_sums_into_cuda(
    const at::Tensor& input, const at::Tensor& shift64, double scale, at::Tensor& s1,
    at::Tensor& s2) {
  const Geometry g = geometry_of(input);
  const double* k = shift64.defined() ? shift64.const_data_ptr<double>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "reduce_sums_cuda", [&] {
    const ShiftedSumOp<scalar_t> op{input.const_data_ptr<scalar_t>(), k, scale};
    const Outputs<double> out{s1.mutable_data_ptr<double>(), s2.mutable_data_ptr<double>(), nullptr};
    launch_reduction(op, g, input, out);
  });
}

void merge_stats_into_cuda(const MergeStatsArgs& args, double eps, bool unbiased) {
  if (args.C == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(args.means.get_device()).stream();
  const auto blocks = static_cast<unsigned>(ceil_div(args.C, kThreads));
  AT_DISPATCH_FLOATING_TYPES(args.means.scalar_type(), "merge_stats_cuda", [&] {
    chan_merge_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        args.counts.const_data_ptr<scalar_t>(), args.means.const_data_ptr<scalar_t>(),
        args.m2s.const_data_ptr<scalar_t>(), args.W, args.C, eps, unbiased,
        args.mean.mutable_data_ptr<scalar_t>(), args.invstd.mutable_data_ptr<scalar_t>(),
        args.var.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace detail
}  // namespace syncbn
