// Entry points of the CUDA twins (see syncbn.h): the five primitives and the four fused steps, with
// the fused steps' own kernels (the row header, the merge + running-stat update), around the
// kernels of stats_cuda.cu, normalize_cuda.cu and backward_cuda.cu. Per layer call:
// forward = header + reduction (+ fold) | collective | merge-update + normalize; backward =
// reduction (+ fold) | collective | elementwise. Nothing reads device memory on the host, so a
// layer call can be captured in a CUDA graph; the call-order flag stays on the device (info[2]).
//
// Layout of this file: the fused steps' kernels, the primitives, the fused steps.
#include "syncbn.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "merge.h"

#include <cstdint>

namespace syncbn {
namespace {

using namespace detail;

constexpr int kHeaderThreads = 256;
// One block merges every channel, so that the finiteness of the whole batch (a reduction over
// channels) is known before any running statistic is updated, without a second launch.
constexpr int kMergeThreads = 1024;

// Writes [count, samples, layer_tag, call_tag] and advances the call counter; zeroes the
// statistics when the input is empty (no reduction ran).
template <typename acc_t>
__global__ void row_header_kernel(
    acc_t* row, int64_t C, int64_t count, int64_t samples, int64_t layer_tag, int64_t* calls,
    bool empty) {
  if (threadIdx.x == 0) {
    const int64_t call = *calls;
    row[0] = static_cast<acc_t>(count);
    row[1] = static_cast<acc_t>(samples);
    row[2] = static_cast<acc_t>(layer_tag % kTagLimit);
    row[3] = static_cast<acc_t>(call % kTagLimit);
    *calls = call + 1;
  }
  if (!empty) return;
  for (int64_t i = threadIdx.x; i < 2 * C; i += blockDim.x) row[kRowHeader + i] = acc_t(0);
}

// torch.lerp's formula (ATen/native/Lerp.h) with one fused multiply-add.
template <typename T>
__device__ __forceinline__ T lerp_fma(T start, T end, T weight) {
  const bool small = fabs(weight) < T(0.5);
  return fma(small ? weight : weight - T(1), end - start, small ? start : end);
}

struct RunningState {
  int64_t* tracked;    // num_batches_tracked or null
  int64_t* nonfinite;  // skipped-update counter or null
  double momentum;
  bool cumulative;     // momentum None: 1 / num_batches_tracked
};

// Merges the W gathered rows (one block, channels strided by blockDim.x), writes mean / invstd /
// var and info = [count, samples, order_ok, finite], then updates the running statistics unless a
// merged value is NaN/inf or the group is empty. Every thread reads the counters before the block
// barrier and only thread 0 writes them after it.
template <typename acc_t, typename run_t>
__global__ void merge_update_kernel(
    const acc_t* __restrict__ rows, int64_t W, int64_t C, double eps, bool unbiased,
    acc_t* __restrict__ mean, acc_t* __restrict__ invstd, acc_t* __restrict__ var,
    acc_t* __restrict__ info, run_t* running_mean, run_t* running_var, RunningState state) {
  const int64_t width = kRowHeader + 2 * C;
  double total = 0, samples = 0;
  bool same_order = true;
  for (int64_t w = 0; w < W; ++w) {
    total += rows[w * width];
    samples += rows[w * width + 1];
    same_order = same_order && rows[w * width + 2] == rows[2] && rows[w * width + 3] == rows[3];
  }
  const int64_t tracked = state.tracked ? *state.tracked : 0;
  bool bad = false;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const MergedChannel m =
        merge_channel(rows, width, rows + kRowHeader, rows + kRowHeader + C, width, W, c);
    m.store(c, eps, unbiased, mean, invstd, var);
    bad = bad || !is_finite_value(mean[c]) || !is_finite_value(var[c]);
  }
  const bool finite = !__syncthreads_or(bad);
  if (threadIdx.x == 0) {
    info[0] = static_cast<acc_t>(total);
    info[1] = static_cast<acc_t>(samples);
    info[2] = same_order ? acc_t(1) : acc_t(0);
    info[3] = finite ? acc_t(1) : acc_t(0);
    if (state.tracked) *state.tracked = tracked + (finite ? 1 : 0);
    if (state.nonfinite) *state.nonfinite += finite ? 0 : 1;
  }
  if (!finite || total == 0 || running_mean == nullptr) return;
  using op_t = at::opmath_type<run_t>;
  const op_t factor = state.cumulative
                          ? op_t(1) / static_cast<op_t>(static_cast<run_t>(tracked + 1))
                          : static_cast<op_t>(state.momentum);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    running_mean[c] = static_cast<run_t>(lerp_fma<op_t>(
        static_cast<op_t>(running_mean[c]), static_cast<op_t>(static_cast<run_t>(mean[c])),
        factor));
    running_var[c] = static_cast<run_t>(lerp_fma<op_t>(
        static_cast<op_t>(running_var[c]), static_cast<op_t>(static_cast<run_t>(var[c])), factor));
  }
}

template <typename T>
T* mutable_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->mutable_data_ptr<T>() : nullptr;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// The primitives
// ------------------------------------------------------------------------------------------------

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
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s, double eps,
    bool unbiased) {
  check_merge_inputs(counts, means, m2s, eps, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(means.device());
  const MergeStatsArgs args = merge_stats_args(counts, means, m2s);
  merge_stats_into_cuda(args, eps, unbiased);
  return {args.mean, args.invstd, args.var};
}

at::Tensor normalize_cuda(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias) {
  check_normalize_args(input, mean, invstd, c10::DeviceType::CUDA);
  return normalize_act_cuda(input, mean, invstd, weight, bias, Activation{});
}

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
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
    const at::Tensor& sum_dy_xmu, const at::Tensor& count) {
  check_backward_elemt_args(
      grad_out, input, mean, invstd, sum_dy, sum_dy_xmu, count, c10::DeviceType::CUDA);
  return backward_elemt_act_cuda(
      grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count, ActAffine{});
}

// ------------------------------------------------------------------------------------------------
// The fused steps
// ------------------------------------------------------------------------------------------------

at::Tensor stats_row_cuda(const at::Tensor& input_, int64_t layer_tag, const at::Tensor& calls) {
  check_input(input_, c10::DeviceType::CUDA);
  check_calls(calls, input_);
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = dense_input(input_);
  const int64_t C = input.size(1);
  at::Tensor row = at::empty({row_width(C)}, input.options().dtype(acc_dtype_of(input.scalar_type())));
  const bool empty = input.numel() == 0;
  if (!empty) {
    at::Tensor mean = row.narrow(0, kRowHeader, C), m2 = row.narrow(0, kRowHeader + C, C);
    local_stats_into_cuda(input, mean, m2);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.get_device()).stream();
  AT_DISPATCH_FLOATING_TYPES(row.scalar_type(), "stats_row_cuda", [&] {
    row_header_kernel<scalar_t><<<1, kHeaderThreads, 0, stream>>>(
        row.mutable_data_ptr<scalar_t>(), C, input.numel() / C, input.size(0), layer_tag,
        calls.mutable_data_ptr<int64_t>(), empty);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return row;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_normalize_cuda(
    const at::Tensor& input, const at::Tensor& rows, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& running_mean,
    const c10::optional<at::Tensor>& running_var,
    const c10::optional<at::Tensor>& num_batches_tracked,
    const c10::optional<at::Tensor>& nonfinite, c10::optional<double> momentum, double eps,
    bool unbiased, int64_t act, double act_param) {
  const Activation activation = checked_activation(act, act_param);  // before any update
  MergeOutputs merged = prepare_merge(
      input, rows, running_mean, running_var, num_batches_tracked, nonfinite, eps,
      c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t W = merged.W;
  at::Tensor &mean = merged.mean, &invstd = merged.invstd, &var = merged.var, &info = merged.info;
  const int64_t C = input.size(1);
  const RunningState state{
      mutable_or_null<int64_t>(num_batches_tracked), mutable_or_null<int64_t>(nonfinite),
      momentum.value_or(0.0), !momentum.has_value()};
  const bool has_running = running_mean.has_value() && running_mean->defined();
  const auto run_type = has_running ? running_mean->scalar_type() : rows.scalar_type();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.get_device()).stream();
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "merge_normalize_cuda", [&] {
    using acc_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, run_type, "merge_update_cuda", [&] {
      merge_update_kernel<acc_t, scalar_t><<<1, kMergeThreads, 0, stream>>>(
          rows.const_data_ptr<acc_t>(), W, C, eps, unbiased, mean.mutable_data_ptr<acc_t>(),
          invstd.mutable_data_ptr<acc_t>(), var.mutable_data_ptr<acc_t>(),
          info.mutable_data_ptr<acc_t>(), mutable_or_null<scalar_t>(running_mean),
          mutable_or_null<scalar_t>(running_var), state);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  at::Tensor output = normalize_act_cuda(input, mean, invstd, weight, bias, activation);
  return {output, mean, invstd, var, info};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_sums_cuda(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& mean_,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, int64_t act, double act_param) {
  check_backward_args(grad_out_, input_, mean_, invstd, c10::DeviceType::CUDA);
  const ActAffine activation = act_affine(act, act_param, invstd, weight, bias, input_);
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = dense_input(input_);
  const at::Tensor grad_out = with_strides_of(grad_out_, input);
  const at::Tensor mean = mean_.contiguous();
  const int64_t C = input.size(1);
  at::Tensor sums = input.numel() == 0 ? at::zeros({2 * C}, mean.options())
                                       : at::empty({2 * C}, mean.options());
  at::Tensor sum_dy = sums.narrow(0, 0, C), sum_dy_xmu = sums.narrow(0, C, C);
  if (input.numel() > 0) {
    backward_sums_into_cuda(grad_out, input, mean, sum_dy, sum_dy_xmu, activation);
  }
  return with_packed_param_grads(sums, invstd, weight, input);
}

at::Tensor grad_input_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sums,
    const at::Tensor& info, const c10::optional<at::Tensor>& bias, int64_t act, double act_param) {
  check_input(input, c10::DeviceType::CUDA);
  const int64_t C = input.size(1);
  const at::Tensor total = group_sums(sums, info, input);
  const at::Tensor sum_dy = total.narrow(0, 0, C), sum_dy_xmu = total.narrow(0, C, C);
  const at::Tensor count = info.narrow(0, 0, 1);
  if (act == 0) {  // the primitive, with its argument checks
    return backward_elemt_cuda(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count);
  }
  check_backward_args(grad_out, input, mean, invstd, c10::DeviceType::CUDA);
  return backward_elemt_act_cuda(
      grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count,
      act_affine(act, act_param, invstd, weight, bias, input));
}

}  // namespace syncbn
