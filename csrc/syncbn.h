// Declarations of the synchronized-BatchNorm primitives.
//
// Declarations only: the .cpp files include this without nvcc, and a build without CUDA compiles
// only the CPU sources. Every primitive and fused step has a `_cpu` twin and (when built with CUDA)
// a `_cuda` twin with one signature, declared once below as a function type; `bindings.cpp` (the
// primitives) and `ops.cpp` (the fused steps) dispatch on the input's device.
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

#include "activation.h"

namespace syncbn {

// Per-channel Welford statistics of the local batch.
// Returns (mean[C], m2[C]) with m2 = sum over the channel of (x - mean)^2. A channel with no
// elements (N == 0 or an empty spatial size) gets mean = 0 and m2 = 0.
using LocalStatsFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& input);

// Count-weighted (Chan et al.) merge of per-rank statistics.
// counts[W], means[W, C], m2s[W, C] (acc dtype). With n = sum(counts):
//   mean   = sum_w counts[w] * means[w] / n
//   m2     = sum_w m2s[w] + sum_w counts[w] * (means[w] - mean)^2
//   invstd = 1 / sqrt(m2 / n + eps)                 (biased variance: used to normalize)
//   var    = m2 / (n - 1) if unbiased else m2 / n   (the running-variance update)
// Ranks with counts[w] == 0 contribute nothing. Denominators are clamped to >= 1, so an
// all-empty group yields mean 0, var 0, invstd 1/sqrt(eps) instead of NaN.
using MergeStatsFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s, double eps,
    bool unbiased);

// y = (x - mean[c]) * invstd[c] * weight[c] + bias[c]  (weight/bias optional: 1 and 0).
using NormalizeFn = at::Tensor(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias);

// Local backward reductions over the batch:
//   sum_dy[c]      = sum dy
//   sum_dy_xmu[c]  = sum dy * (x - mean[c])
//   grad_weight[c] = sum_dy_xmu[c] * invstd[c]   (if weight_grad, in the weight's dtype)
//   grad_bias[c]   = sum_dy[c]                   (if bias_grad, in the weight's dtype)
// sum_dy and sum_dy_xmu are always returned (acc dtype); skipped grads are undefined tensors.
using BackwardReduceFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, bool weight_grad,
    bool bias_grad);

// Input gradient from the group-wide sums (sum_dy, sum_dy_xmu all-reduced over the group) and the
// group-wide element count per channel `count` (one element, acc dtype):
//   dx = (dy - sum_dy/count - (x - mean) * invstd^2 * sum_dy_xmu/count) * invstd * weight
using BackwardElemtFn = at::Tensor(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
    const at::Tensor& sum_dy_xmu, const at::Tensor& count);

// ------------------------------------------------------------------------------------------------
// Fused steps of one synchronized layer call, registered as the `syncbn::` operators (ops.cpp).
// Each is one dispatcher call; the collectives between them are torch's.
//
// Row layout of the forward collective, per rank, in the acc dtype:
//   [count, samples, layer_tag, call_tag, mean[C], m2[C]]         (kRowHeader + 2 * C values)
// count = values per channel (N * S), samples = N, and the two tags identify the layer and its
// call for the call-order check. The gathered buffer is W such rows back to back.
// ------------------------------------------------------------------------------------------------

// The rank's row: local Welford statistics plus the header. `calls` (int64, one element, on the
// input's device) is the layer's call counter: its value is written as the call tag (mod 2^24) and
// it is incremented in place.
using StatsRowFn = at::Tensor(const at::Tensor& input, int64_t layer_tag, const at::Tensor& calls);

// Merge the W gathered rows, update the running statistics, normalize.
//   * call order: every row must carry row 0's tags. CPU: a mismatch throws an error starting
//     with "syncbn call order:" and listing each row's tags. CUDA: info[2] = 0 (checked later).
//   * a group whose total count is 1 throws torch's "Expected more than 1 value per channel"
//     (CPU only: on CUDA it would need a host sync).
//   * running stats (all optional, updated in place, any floating dtype): unless the merged mean
//     or var has a NaN/inf, or the group is empty, running = lerp(running, batch, momentum or
//     1 / num_batches_tracked) with the unbiased (or biased) var; num_batches_tracked += finite;
//     nonfinite (int64 counter) += !finite.
//   * `act`, `act_param`: the activation applied to the normalized output (activation.h; 0 is
//     none), computed in the acc dtype before the single rounding to the input's dtype.
// Returns (output, mean, invstd, var, info) with info = [count, samples, order_ok, finite] (acc
// dtype, group-wide count and samples).
using MergeNormalizeFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& input, const at::Tensor& rows, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& running_mean,
    const c10::optional<at::Tensor>& running_var,
    const c10::optional<at::Tensor>& num_batches_tracked,
    const c10::optional<at::Tensor>& nonfinite, c10::optional<double> momentum, double eps,
    bool unbiased, int64_t act, double act_param);

// Local backward sums packed for the collective, [sum_dy[C], sum_dy_xmu[C]] (acc dtype), with the
// local grad_weight = sum_dy_xmu * invstd and grad_bias = sum_dy in the weight's dtype (acc dtype
// without weight). Returns (sums, grad_weight, grad_bias).
// With an activation (`act` != 0) the layer's output was act(z), z = (x - mean) * invstd * weight
// + bias: z is recomputed from `input` (so `bias` is needed) and dy * act'(z) stands for dy in
// every sum, here and in grad_input.
using GradSumsFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, int64_t act, double act_param);

// Input gradient from R >= 1 rows of sums ([R * 2C]: all-reduced, R = 1, or gathered, summed here
// in row order) and the group count info[0] (read on the device).
using GradInputFn = at::Tensor(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sums,
    const at::Tensor& info, const c10::optional<at::Tensor>& bias, int64_t act, double act_param);

// The twins, declared with the function types above (`LocalStatsFn local_stats_cpu;` declares the
// function local_stats_cpu of that type): the CPU kernels always, the CUDA ones with CUDA.
LocalStatsFn local_stats_cpu;
MergeStatsFn merge_stats_cpu;
NormalizeFn normalize_cpu;
BackwardReduceFn backward_reduce_cpu;
BackwardElemtFn backward_elemt_cpu;
StatsRowFn stats_row_cpu;
MergeNormalizeFn merge_normalize_cpu;
GradSumsFn grad_sums_cpu;
GradInputFn grad_input_cpu;
#ifdef WITH_CUDA
LocalStatsFn local_stats_cuda;
MergeStatsFn merge_stats_cuda;
NormalizeFn normalize_cuda;
BackwardReduceFn backward_reduce_cuda;
BackwardElemtFn backward_elemt_cuda;
StatsRowFn stats_row_cuda;
MergeNormalizeFn merge_normalize_cuda;
GradSumsFn grad_sums_cuda;
GradInputFn grad_input_cuda;
#endif

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
// check_backward_args plus the group sums (acc dtype, one value per channel) and the one-element
// count: backward_elemt's arguments.
void check_backward_elemt_args(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
    const at::Tensor& count, c10::DeviceType device);
// merge_stats' operands made contiguous and its [C] outputs, allocated like `means`.
struct MergeStatsArgs {
  int64_t W, C;
  at::Tensor counts, means, m2s;
  at::Tensor mean, invstd, var;
};
MergeStatsArgs merge_stats_args(
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s);
// The operands of an elementwise kernel (normalize, backward_elemt) as the kernels read them:
// the input dense (dense_input), `grad_out` (if defined) with the input's strides, mean and invstd
// contiguous, weight and bias (if given) in the acc dtype, and the output allocated with the
// input's strides.
struct ElemtOperands {
  at::Tensor input, grad_out, mean, invstd, weight, bias, output;
};
ElemtOperands elemt_operands(
    const at::Tensor& input, const at::Tensor& grad_out, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias);
// backward_reduce's result from the reduced sums: grad_weight = sum_dy_xmu * invstd and grad_bias
// = sum_dy in the weight's dtype (the acc dtype without weight), each only when requested.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> with_param_grads(
    const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const at::Tensor& input, bool weight_grad,
    bool bias_grad);
// An optional per-channel parameter converted to the acc dtype; undefined when absent.
at::Tensor optional_acc(
    const c10::optional<at::Tensor>& v, const char* name, const at::Tensor& input);

// A fused activation with what its backward needs to recompute z = (x - mean) * scale + shift:
// invstd, and the weight and bias in the acc dtype (undefined when absent). For the identity the
// tensors stay undefined and the kernels are the plain BatchNorm ones.
struct ActAffine {
  Activation act;
  at::Tensor invstd, weight, bias;
};
// `act`/`act_param` checked (a known kind, a finite param); the tensors converted for the kernels.
ActAffine act_affine(
    int64_t act, double act_param, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    const at::Tensor& input);
// `act`/`act_param` checked as an Activation (the forward needs no tensors).
Activation checked_activation(int64_t act, double act_param);

// Values in front of the statistics in a gathered row, and a row's width for C channels.
constexpr int64_t kRowHeader = 4;
inline int64_t row_width(int64_t C) { return kRowHeader + 2 * C; }
// Tags travel as floats of the acc dtype: exact below 2^24 (TAG_LIMIT in Python).
constexpr int64_t kTagLimit = int64_t(1) << 24;
// Fields of a merge's `info` output.
constexpr int64_t kInfoFields = 4;
// Rows of `rows` (1-D, contiguous, the acc dtype of `input`, on its device, a multiple of the row
// width long).
int64_t check_rows(const at::Tensor& rows, const at::Tensor& input);
// `calls`: one int64 element on the input's device.
void check_calls(const at::Tensor& calls, const at::Tensor& input);
// Optional running statistics: [C] floating tensors / one-element int64 counters on the device.
void check_running(
    const c10::optional<at::Tensor>& running_mean, const c10::optional<at::Tensor>& running_var,
    const c10::optional<at::Tensor>& num_batches_tracked,
    const c10::optional<at::Tensor>& nonfinite, const at::Tensor& input);
// merge_normalize's checks (input, rows, running statistics, eps) and its outputs, allocated in
// the rows' dtype on their device: the same for the CPU and CUDA twins.
struct MergeOutputs {
  int64_t W;  // gathered rows
  at::Tensor mean, invstd, var, info;
};
MergeOutputs prepare_merge(
    const at::Tensor& input, const at::Tensor& rows, const c10::optional<at::Tensor>& running_mean,
    const c10::optional<at::Tensor>& running_var,
    const c10::optional<at::Tensor>& num_batches_tracked,
    const c10::optional<at::Tensor>& nonfinite, double eps, c10::DeviceType device);
// sums: [R * 2C] in the acc dtype; info: kInfoFields values of the acc dtype. Returns R.
int64_t check_sums(const at::Tensor& sums, const at::Tensor& info, const at::Tensor& input);
// The group's [sum_dy, sum_dy_xmu] from R checked rows of sums (summed in row order when R > 1).
at::Tensor group_sums(const at::Tensor& sums, const at::Tensor& info, const at::Tensor& input);
// grad_sums' result from the packed local sums: (sums, grad_weight, grad_bias), see
// with_param_grads.
std::tuple<at::Tensor, at::Tensor, at::Tensor> with_packed_param_grads(
    const at::Tensor& sums, const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const at::Tensor& input);
// C acc-dtype values of a contiguous CPU `buffer`, starting `offset` values in: a channel slice
// addressed without narrow(), whose dispatcher call costs about a microsecond of host time (the
// whole layer step on a small tensor is a few tens).
struct Channels {
  const at::Tensor& buffer;
  int64_t offset = 0;
  template <typename T>
  T* data() const {
    return buffer.mutable_data_ptr<T>() + offset;
  }
};
// The CPU kernels writing into given [C] outputs (dense input, acc-dtype outputs).
void local_stats_into_cpu(const at::Tensor& input, Channels mean, Channels m2);
void merge_stats_into_cpu(const MergeStatsArgs& args, double eps, bool unbiased);
void merge_rows_cpu(
    const at::Tensor& rows, int64_t W, int64_t C, double eps, bool unbiased, at::Tensor& mean,
    at::Tensor& invstd, at::Tensor& var);
void backward_sums_into_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean, Channels sum_dy,
    Channels sum_dy_xmu, const ActAffine& act = {});
// normalize after its checks, with the activation applied before the rounding (the fused
// forward's output): normalize_act_cpu, and normalize_act_cuda with CUDA.
using NormalizeActFn = at::Tensor(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    const Activation& act);
NormalizeActFn normalize_act_cpu;
// backward_elemt_cpu after its checks, with the group sums as channel slices and the group count
// as a number (dy * act'(z) in place of dy for an activation).
at::Tensor backward_elemt_checked_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, Channels sum_dy,
    Channels sum_dy_xmu, double count, const ActAffine& act = {});

}  // namespace detail

#ifdef WITH_CUDA
namespace detail {
// The CUDA reductions writing into given [C] outputs (dense, non-empty input; acc-dtype outputs),
// and merge_stats' merge (any C).
void local_stats_into_cuda(const at::Tensor& input, at::Tensor& mean, at::Tensor& m2);
void merge_stats_into_cuda(const MergeStatsArgs& args, double eps, bool unbiased);
void backward_sums_into_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    at::Tensor& sum_dy, at::Tensor& sum_dy_xmu, const ActAffine& act = {});
// normalize_act_cpu's twin.
NormalizeActFn normalize_act_cuda;
// backward_elemt_cuda with an activation (dy * act'(z) in place of dy).
at::Tensor backward_elemt_act_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
    const at::Tensor& sum_dy_xmu, const at::Tensor& count, const ActAffine& act);
}  // namespace detail
#endif

}  // namespace syncbn
