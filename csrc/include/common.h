// Host-side declarations shared by the entry points (entry_*.cpp/.cu, reduce_*.cpp/.cu) and the
// kernel files: the helpers of common.cpp (layouts, argument checks, operands) and of
// step_helpers.cpp (the fused steps' rows, sums, buffers and infos), and the kernels' "into"
// functions that write given outputs. Declarations only, like syncbn.h (which declares the
// primitives and the fused steps themselves).
#pragma once

#include "check.h"
#include "grad_header.h"
#include "shared_constants.h"
#include "syncbn.h"

namespace syncbn {

// ------------------------------------------------------------------------------------------------
// Host-side helpers shared by the _cpu and _cuda entry points (defined in common.cpp and
// step_helpers.cpp, no nvcc).
// ------------------------------------------------------------------------------------------------
namespace detail {

enum class Layout { kChannelsFirst, kChannelsLast };

struct Geometry {
  int64_t N;  // batch
  int64_t C;  // channels
  int64_t S;  // elements per (n, c): product of the spatial sizes
  Layout layout;
};

// at::empty and at::empty_like (of a dense tensor: its sizes and strides) without the dispatcher
// for CPU tensors: a layer call allocates about a dozen small tensors, at ~0.5 us of host time
// each through the dispatcher (at::empty on other devices).
at::Tensor new_empty(at::IntArrayRef sizes, const at::TensorOptions& options);
at::Tensor new_empty_like(const at::Tensor& like);
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

// Argument checks: each failure is a SYNCBN_CHECK (check.h) naming the argument and what was
// expected.
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
// `mean_lo` (the low part of a split mean, see above) contiguous, or undefined when absent.
struct ElemtOperands {
  at::Tensor input, grad_out, mean, mean_lo, invstd, weight, bias, output;
};
ElemtOperands elemt_operands(
    const at::Tensor& input, const at::Tensor& grad_out, const at::Tensor& mean,
    const at::Tensor& mean_lo, const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias);
// An optional `residual` (the fused residual add) checked against `input`: the same shape, dtype
// and device (the kernels take it with the dense input's strides); undefined when absent.
at::Tensor checked_residual(const c10::optional<at::Tensor>& residual, const at::Tensor& input);
// An optional `mean_lo` checked like a mean (acc dtype, one value per channel); undefined when
// absent.
at::Tensor checked_mean_lo(const c10::optional<at::Tensor>& mean_lo, const at::Tensor& input);
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

// The layouts' sizes (kRowHeader, kReduceHeader, kInfoFields), kTagLimit and the messages
// (kShiftMismatch) are shared_constants.h's, generated from syncbn_lightning/_shared.py.
// A gathered row's width for C channels.
inline int64_t row_width(int64_t C) { return kRowHeader + 3 * C; }
// The reduce exchange's 12-bit tag chunks.
constexpr int64_t kChunkBits = 12;
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
// The merges' checks (input, running statistics, eps) and their statistics outputs, allocated in
// the input's acc dtype on its device: the same for every merge twin.
struct MergeOutputs {
  at::Tensor mean, mean_lo, invstd, var, info, grad_info;
};
MergeOutputs prepare_merge(const MergeArgs& args, c10::DeviceType device);
// The reduce exchange's `total` and `sent` (1-D float64, contiguous, on the input's device; `sent`
// kReduceHeader + 2C values, `total` the summed vector or R >= 1 ranks' vectors gathered) and
// `world_size` >= 1. Returns `total` summed: itself, or its rows added in rank order.
at::Tensor summed_reduce_vector(
    const at::Tensor& total, const at::Tensor& sent, int64_t world_size, const at::Tensor& input);
// reduce_sums' optional shift as float64 [C] contiguous (checked; undefined when absent).
at::Tensor shift_float64(const c10::optional<at::Tensor>& shift, const at::Tensor& input);
// sums: [R * (kGradHeader + 2C)] in the acc dtype; info: kInfoFields values of the acc dtype.
// Returns R.
int64_t check_sums(const at::Tensor& sums, const at::Tensor& info, const at::Tensor& input);
// The group's [header, sum_dy, sum_dy_xmu] from R checked rows of sums (summed in row order when
// R > 1).
at::Tensor group_sums(const at::Tensor& sums, const at::Tensor& info, const at::Tensor& input);
// `info` of grad_input: required (grad_input reads its count and tags).
at::Tensor required_info(const c10::optional<at::Tensor>& info);
// `info` of grad_sums: undefined, or kInfoFields values of the acc dtype on the input's device.
at::Tensor checked_grad_info(const c10::optional<at::Tensor>& info, const at::Tensor& input);
// torch's error for a training batch of one value per channel, where the batch is the whole sync
// group's: raised (a c10::ValueError, as Python's ValueError) when `total` values per channel over
// `world_size` ranks is 1; `input` is this rank's.
void check_group_count(double total, const at::Tensor& input, int64_t world_size);
// The ranks whose sums `sums` holds for grad_input's check: its R rows when gathered (R > 1), else
// `world_size` (one all-reduced row; >= 1).
double summed_ranks(int64_t rows, int64_t world_size);
// grad_sums' result from the packed local sums [header, sum_dy, sum_dy_xmu]: (sums, grad_weight,
// grad_bias), see with_param_grads.
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
// The CPU kernels writing into given [C] outputs (dense input, acc-dtype outputs; `mean_lo`
// optional: the low part of the split local mean, see the row layout).
void local_stats_into_cpu(
    const at::Tensor& input, Channels mean, Channels m2, const Channels* mean_lo = nullptr);
void merge_stats_into_cpu(const MergeStatsArgs& args, double eps, bool unbiased);
// reduce_sums' S1 and S2 (float64; K = shift64, a float64 [C] tensor or undefined for 0).
void shifted_sums_into_cpu(
    const at::Tensor& input, const at::Tensor& shift64, double* s1, double* s2);
// xmu = (x - mean) - mean_lo (mean_lo may be undefined: 0).
void backward_sums_into_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& mean_lo, Channels sum_dy, Channels sum_dy_xmu, const ActAffine& act = {});
// normalize after its checks, with the residual added and the activation applied before the
// rounding (the fused forward's output, act(z + residual)): normalize_act_cpu, and
// normalize_act_cuda with CUDA. `mean_lo` may be undefined (0); `residual` undefined (none) or
// checked_residual's.
using NormalizeActFn = at::Tensor(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& mean_lo,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const Activation& act, const at::Tensor& residual);
NormalizeActFn normalize_act_cpu;
// grad_sums_residual's first pass on the CPU: g = dy * act'(z + residual), z recomputed from
// `input` (xmu = (x - mean) - mean_lo, mean_lo may be undefined), rounded to the input's dtype
// (as the unfused activation's backward rounds it), in the input's layout. Without an activation:
// dy itself, copied.
at::Tensor act_grad_residual_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& residual,
    const at::Tensor& mean, const at::Tensor& mean_lo, const ActAffine& act);
// backward_elemt_cpu after its checks, with the group sums as channel slices and the group count
// as a number (dy * act'(z) in place of dy for an activation; mean_lo may be undefined).
at::Tensor backward_elemt_checked_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& mean_lo, const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    Channels sum_dy, Channels sum_dy_xmu, double count, const ActAffine& act = {});
// The running-stat update of the merges (rules above) from the float64 group statistics, and the
// counters; `total` is the group's count.
void update_running_cpu(
    const double* mean, const double* var, int64_t C, double total, bool finite,
    const MergeArgs& args);
// The merges' outputs from the float64 group statistics: mean split into (mean, mean_lo),
// invstd, var in the acc dtype.
void store_split_stats_cpu(
    const double* mean, const double* invstd, const double* var, int64_t C, MergeOutputs& out);
// info = [count, samples, order_ok, finite, layer_tag, call_tag] and grad_info (the same with
// grad_count) of a merge on the CPU, in the outputs' dtype acc_t.
template <typename acc_t>
void write_info(
    MergeOutputs& out, double count, double grad_count, double samples, bool order_ok,
    bool finite, double layer_tag, double call_tag) {
  for (at::Tensor* info : {&out.info, &out.grad_info}) {
    acc_t* f = info->mutable_data_ptr<acc_t>();
    f[0] = static_cast<acc_t>(info == &out.info ? count : grad_count);
    f[1] = static_cast<acc_t>(samples);
    f[2] = order_ok ? acc_t(1) : acc_t(0);
    f[3] = finite ? acc_t(1) : acc_t(0);
    f[4] = static_cast<acc_t>(layer_tag);
    f[5] = static_cast<acc_t>(call_tag);
  }
}

}  // namespace detail

#ifdef WITH_CUDA
namespace detail {
// The CUDA reductions writing into given [C] outputs (dense, non-empty input; acc-dtype outputs;
// mean_lo optional as in local_stats_into_cpu), and merge_stats' merge (any C).
void local_stats_into_cuda(
    const at::Tensor& input, at::Tensor& mean, at::Tensor& m2, at::Tensor* mean_lo = nullptr);
void merge_stats_into_cuda(const MergeStatsArgs& args, double eps, bool unbiased);
// shifted_sums_into_cpu's twin (s1, s2: float64 [C] on the device), both multiplied by `scale`.
void shifted_sums_into_cuda(
    const at::Tensor& input, const at::Tensor& shift64, double scale, at::Tensor& s1,
    at::Tensor& s2);
// With `header`, the reduction also writes the call-order header of `info`'s tags (grad_info;
// undefined: zeros) there (grad_header.h). With `residual` (defined, checked_residual's) and
// `grad` (the input's shape and layout), z + residual stands for z, and the reduction writes
// g = dy * act'(z + residual), rounded to the input's dtype, into `grad` as it loads each element
// and sums that rounded g (grad_sums_residual: one pass).
struct SumsInto {
  const at::Tensor &grad_out, &input, &mean, &mean_lo;
  at::Tensor &sum_dy, &sum_dy_xmu;
  ActAffine act = {};
  at::Tensor info = {};
  at::Tensor* header = nullptr;
  at::Tensor residual = {};
  at::Tensor* grad = nullptr;
};
void backward_sums_into_cuda(const SumsInto& into);
// The backward's call-order header on the device: the tags are info[4..5] (grad_info); `header`
// (may be null) receives the header of the tags; `order_ok` (may be null) whether `total`, the
// summed header, is `ranks` times it.
struct GradHeader {
  const at::Tensor& info;
  at::Tensor* header = nullptr;
  const at::Tensor* total = nullptr;
  double ranks = 0;
  at::Tensor* order_ok = nullptr;
};
// One launch of a single thread doing that (for empty batches, where the reduction and the
// elementwise kernel that do it otherwise are not launched).
void grad_header_cuda(const GradHeader& h);
// normalize_act_cpu's twin.
NormalizeActFn normalize_act_cuda;
// backward_elemt_cuda with a split mean and an activation (dy * act'(z) in place of dy), and with
// `check` the call-order check of GradHeader in the same kernel.
at::Tensor backward_elemt_act_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& mean_lo, const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, const at::Tensor& count,
    const ActAffine& act, const GradHeader* check = nullptr);
}  // namespace detail
#endif

}  // namespace syncbn
