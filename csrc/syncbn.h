// Declarations of the synchronized-BatchNorm primitives.
//
// Declarations only: the .cpp files include this without nvcc, and a build without CUDA compiles
// only the CPU sources. Every primitive has a `_cpu` twin and (when built with CUDA) a `_cuda` twin
// with an identical signature; `bindings.cpp` dispatches on the input's device.
//
// Conventions shared by all primitives:
//   * input is (N, C, *) with N >= 0 and C >= 1, in channels-first (contiguous) or channels-last
//     (dense with stride(1) == 1) layout; other strides are made contiguous by the caller.
//   * "acc" dtype: float32 for float16/bfloat16/float32 inputs, float64 for float64 inputs.
//     All statistics are computed and returned in the acc dtype.
//   * outputs of elementwise primitives have the input's dtype and the input's exact strides.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace syncbn {

// Per-channel Welford statistics of the local batch.
// Returns (mean[C], m2[C]) with m2 = sum over the channel of (x - mean)^2. A channel with no
// elements (N == 0 or an empty spatial size) gets mean = 0 and m2 = 0.
std::tuple<at::Tensor, at::Tensor> local_stats_cpu(const at::Tensor& input);

// Count-weighted (Chan et al.) merge of per-rank statistics.
// counts[W], means[W, C], m2s[W, C] (acc dtype). With n = sum(counts):
//   mean   = sum_w counts[w] * means[w] / n
//   m2     = sum_w m2s[w] + sum_w counts[w] * (means[w] - mean)^2
//   invstd = 1 / sqrt(m2 / n + eps)                 (biased variance: used to normalize)
//   var    = m2 / (n - 1) if unbiased else m2 / n   (the running-variance update)
// Ranks with counts[w] == 0 contribute nothing. Denominators are clamped to >= 1, so an
// all-empty group yields mean 0, var 0, invstd 1/sqrt(eps) instead of NaN.
std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_stats_cpu(
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s, double eps,
    bool unbiased);

// y = (x - mean[c]) * invstd[c] * weight[c] + bias[c]  (weight/bias optional: 1 and 0).
at::Tensor normalize_cpu(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias);

// Local backward reductions over the batch:
//   sum_dy[c]      = sum dy
//   sum_dy_xmu[c]  = sum dy * (x - mean[c])
//   grad_weight[c] = sum_dy_xmu[c] * invstd[c]   (if weight_grad, in the weight's dtype)
//   grad_bias[c]   = sum_dy[c]                   (if bias_grad, in the weight's dtype)
// sum_dy and sum_dy_xmu are always returned (acc dtype); skipped grads are undefined tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_reduce_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, bool weight_grad,
    bool bias_grad);

// Input gradient from the group-wide sums (sum_dy, sum_dy_xmu all-reduced over the group) and the
// group-wide element count per channel `count` (one element, acc dtype):
//   dx = (dy - sum_dy/count - (x - mean) * invstd^2 * sum_dy_xmu/count) * invstd * weight
at::Tensor backward_elemt_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
    const at::Tensor& sum_dy_xmu, const at::Tensor& count);

// ------------------------------------------------------------------------------------------------
// Host-side helpers shared by the _cpu and _cuda entry points (defined in common.cpp, no nvcc).
// ------------------------------------------------------------------------------------------------
namespace detail {

enum class Layout { kChannelsFirst, kChannelsLast };

struct Geometry {
  int64_t N;  // batch
  int64_t C;  // channels
  int64_t S;  // elements per (n, c): product of the spatial sizes
  Layout layout;
};

// float64 for float64 storage, else float32.
at::ScalarType acc_dtype_of(at::ScalarType t);
// Whether `t` is dense with the channel dim innermost (NHWC, NDHWC; (N, C) matrices included).
bool is_channels_last_dense(const at::Tensor& t);
// The layout to index `x` with. Channels-first and channels-last index identically when S == 1;
// channels-last is preferred then because it runs over C in the inner loop.
Geometry geometry_of(const at::Tensor& x);
// `x` itself in one of the two supported layouts, a contiguous copy for any other strides.
at::Tensor dense_input(const at::Tensor& x);
// `t` with exactly the strides of `like` (a copy only when they differ).
at::Tensor with_strides_of(const at::Tensor& t, const at::Tensor& like);

// Argument checks: each failure is a TORCH_CHECK naming the argument and what was expected.
// `device` is the device type the calling twin serves (kCPU for _cpu, kCUDA for _cuda).
void check_input(const at::Tensor& input, c10::DeviceType device);
void check_channel_vector(
    const at::Tensor& v, const char* name, const at::Tensor& input, bool require_acc_dtype);
void check_grad_out(const at::Tensor& grad_out, const at::Tensor& input);
void check_count(const at::Tensor& count, const at::Tensor& input);
// counts[W], means[W, C], m2s[W, C] of one floating dtype on `device`; eps > 0.
void check_merge_inputs(
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s, double eps,
    c10::DeviceType device);
// check_input plus `mean`/`invstd` (acc dtype, one value per channel): normalize's arguments.
void check_normalize_args(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    c10::DeviceType device);
// check_normalize_args plus `grad_out` (the input's shape, dtype and device).
void check_backward_args(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, c10::DeviceType device);
// backward_reduce's result from the reduced sums: grad_weight = sum_dy_xmu * invstd and grad_bias
// = sum_dy in the weight's dtype (the acc dtype without weight), each only when requested.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> with_param_grads(
    const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const at::Tensor& input, bool weight_grad,
    bool bias_grad);
// An optional per-channel parameter converted to the acc dtype; undefined when absent.
at::Tensor optional_acc(
    const c10::optional<at::Tensor>& v, const char* name, const at::Tensor& input);

}  // namespace detail

#ifdef WITH_CUDA
std::tuple<at::Tensor, at::Tensor> local_stats_cuda(const at::Tensor& input);
std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_stats_cuda(
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s, double eps,
    bool unbiased);
at::Tensor normalize_cuda(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_reduce_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, bool weight_grad,
    bool bias_grad);
at::Tensor backward_elemt_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
    const at::Tensor& sum_dy_xmu, const at::Tensor& count);
#endif

}  // namespace syncbn
