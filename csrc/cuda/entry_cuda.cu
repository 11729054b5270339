// Entry points of the CUDA twins (see syncbn.h): the five primitives and the four fused steps, with
// the fused steps' own kernels (the row header, the merge + running-stat update), around the
// kernels of stats_cuda.cu, normalize_cuda.cu and backward_cuda.cu. Per layer call:
// forward = header + reduction (+ fold) | collective | merge-update + normalize; backward =
// reduction (+ fold) | collective | elementwise. Nothing reads device memory on the host, so a
// layer call can be captured in a CUDA graph; the call-order flag stays on the device (info[2]).
//
// Layout of this file: the fused steps' kernels, the primitives, the fused steps.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "cuda_running.cuh"
#include "merge.h"

#include <cstdint>

namespace syncbn {
namespace {

using namespace detail;

constexpr int kHeaderThreads = 256;
// One block merges every channel, so that the finiteness of the whole batch (a reduction over
// channels) is known before any running statistic is updated, without a second launch. Every
// kernel declares its block size (__launch_bounds__): the float64 merge needs ~78 registers a
// thread unbounded, and 1024 x 78 exceeds the 64K registers of a block, so the launch failed
// ("too many resources requested") on an H200 until the bound made ptxas fit it.
constexpr int kMergeThreads = 1024;

// Writes [count, samples, layer_tag, call_tag] and advances the call counter; zeroes the
// statistics (mean, mean_lo, m2) when the input is empty (no reduction ran).
template <typename acc_t>
__global__ void __launch_bounds__(kHeaderThreads) row_header_kernel(
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
  for (int64_t i = threadIdx.x; i < 3 * C; i += blockDim.x) row[kRowHeader + i] = acc_t(0);
}

// Channel c's statistics of the gathered rows, in double (merge.h), and from them invstd and the
// running-stat var.
template <typename acc_t>
struct GatherStats {
  const acc_t* rows;
  int64_t width, W, C;
  double total, ranks, eps;
  bool equal_rank_weights, unbiased;

  struct Stats {
    double mean, invstd, var;
  };
  __device__ Stats operator()(int64_t c) const {
    const MergedChannel m =
        merge_row_channel(rows, width, W, C, c, total, ranks, equal_rank_weights);
    return {
        m.mean, 1.0 / sqrt(m.m2 / fmax(total, 1.0) + eps),
        m.m2 / fmax(unbiased ? total - 1 : total, 1.0)};
  }
};

// Merges the W gathered rows (one block, channels strided by blockDim.x), writes mean / mean_lo /
// invstd / var, info and grad_info, then updates the running statistics unless a merged value is
// NaN/inf or the group is empty (cuda_running.cuh).
// How merge_update_kernel merges W rows of C channels (named fields, not positional booleans).
struct MergeRule {
  int64_t W, C;
  double eps;
  bool unbiased;            // running_var from the unbiased variance
  bool equal_rank_weights;  // stats_mode="default"
  double local_count;       // this rank's values per channel
};

template <typename acc_t, typename run_t>
__global__ void __launch_bounds__(kMergeThreads) merge_update_kernel(
    const acc_t* __restrict__ rows, MergeRule rule, MergedPointers<acc_t> out,
    run_t* running_mean, run_t* running_var, RunningState state) {
  const int64_t W = rule.W, C = rule.C;
  const double eps = rule.eps, local_count = rule.local_count;
  const bool unbiased = rule.unbiased, equal_rank_weights = rule.equal_rank_weights;
  const int64_t width = kRowHeader + 3 * C;  // row_width(C), a host function
  double total = 0, samples = 0, ranks = 0;
  bool same_order = true;
  for (int64_t w = 0; w < W; ++w) {
    total += rows[w * width];
    samples += rows[w * width + 1];
    ranks += rows[w * width] > 0 ? 1 : 0;
    same_order = same_order && rows[w * width + 2] == rows[2] && rows[w * width + 3] == rows[3];
  }
  const GatherStats<acc_t> stats{rows, width, W, C, total, ranks, eps, equal_rank_weights, unbiased};
  const int64_t tracked = state.tracked ? *state.tracked : 0;
  bool bad = false;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const auto m = stats(c);
    store_split(c, m.mean, m.invstd, m.var, out.mean, out.mean_lo, out.invstd, out.var);
    bad = bad || !is_finite_value(m.mean) || !is_finite_value(m.var);
  }
  const bool finite = !__syncthreads_or(bad);
  if (threadIdx.x == 0) {
    const double grad_count = equal_rank_weights ? ranks * local_count : total;
    store_info(
        out.info, out.grad_info, total, grad_count, samples, same_order, finite,
        static_cast<double>(rows[2]), static_cast<double>(rows[3]));
  }
  update_running_block(stats, C, total, finite, tracked, running_mean, running_var, state);
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
  return normalize_act_cuda(input, mean, at::Tensor(), invstd, weight, bias, Activation{}, {});
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
    backward_sums_into_cuda({grad_out, input, mean, at::Tensor(), sum_dy, sum_dy_xmu});
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
      grad_out, input, mean, at::Tensor(), invstd, weight, sum_dy, sum_dy_xmu, count, ActAffine{});
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
    at::Tensor mean = row.narrow(0, kRowHeader, C), mean_lo = row.narrow(0, kRowHeader + C, C);
    at::Tensor m2 = row.narrow(0, kRowHeader + 2 * C, C);
    local_stats_into_cuda(input, mean, m2, &mean_lo);
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

MergedOutputs merge_normalize_cuda(const MergeArgs& args, const at::Tensor& rows) {
  const at::Tensor& input = args.input;
  const c10::optional<at::Tensor>& running_mean = args.running.mean;
  const Activation activation = checked_activation(args.settings.act, args.settings.act_param);
  const at::Tensor res = checked_residual(args.residual, input);  // before any update
  MergeOutputs out = prepare_merge(args, c10::DeviceType::CUDA);
  const int64_t W = check_rows(rows, input);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t C = input.size(1);
  const MergeRule rule{
      W, C, args.settings.eps, args.settings.unbiased, args.settings.equal_rank_weights,
      static_cast<double>(input.numel() / C)};
  const RunningState state =
      running_state(args.running.num_batches_tracked, args.running.nonfinite, args.settings.momentum);
  const bool has_running = running_mean.has_value() && running_mean->defined();
  const auto run_type = has_running ? running_mean->scalar_type() : rows.scalar_type();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.get_device()).stream();
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "merge_normalize_cuda", [&] {
    using acc_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, run_type, "merge_update_cuda", [&] {
      merge_update_kernel<acc_t, scalar_t><<<1, kMergeThreads, 0, stream>>>(
          rows.const_data_ptr<acc_t>(), rule, merged_pointers<acc_t>(out),
          mutable_or_null<scalar_t>(running_mean), mutable_or_null<scalar_t>(args.running.var),
          state);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  at::Tensor output = normalize_act_cuda(
      input, out.mean, out.mean_lo, out.invstd, args.weight, args.bias, activation, res);
  return {output, out.mean, out.mean_lo, out.invstd, out.var, out.info, out.grad_info};
}

at::Tensor renormalize_cuda(
    const MergeArgs& args, const at::Tensor& mean, const at::Tensor& mean_lo,
    const at::Tensor& invstd) {
  const at::Tensor& input = args.input;
  const Activation activation = checked_activation(args.settings.act, args.settings.act_param);
  const at::Tensor res = checked_residual(args.residual, input);
  check_normalize_args(input, mean, invstd, c10::DeviceType::CUDA);
  const at::Tensor lo = checked_mean_lo(mean_lo, input);
  const c10::cuda::CUDAGuard guard(input.device());
  return normalize_act_cuda(input, mean, lo, invstd, args.weight, args.bias, activation, res);
}

namespace {

// grad_sums_cuda, and with `residual` (checked, or undefined) grad_sums_residual_cuda's four
// outputs (the fourth, g, undefined without a residual).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> grad_sums_with(
    const GradArgs& args, const at::Tensor& residual) {
  const at::Tensor &grad_out_ = args.grad_out, &input_ = args.input, &mean_ = args.mean,
                   &invstd = args.invstd;
  check_backward_args(grad_out_, input_, mean_, invstd, c10::DeviceType::CUDA);
  const at::Tensor lo = checked_mean_lo(args.mean_lo, input_);
  const at::Tensor info = checked_grad_info(args.info, input_);
  const ActAffine activation =
      act_affine(args.act, args.act_param, invstd, args.weight, args.bias, input_);
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = dense_input(input_);
  const at::Tensor grad_out = with_strides_of(grad_out_, input);
  const at::Tensor mean = mean_.contiguous();
  const int64_t C = input.size(1);
  at::Tensor sums = input.numel() == 0 ? at::zeros({kGradHeader + 2 * C}, mean.options())
                                       : at::empty({kGradHeader + 2 * C}, mean.options());
  at::Tensor header = sums.narrow(0, 0, kGradHeader);
  at::Tensor sum_dy = sums.narrow(0, kGradHeader, C);
  at::Tensor sum_dy_xmu = sums.narrow(0, kGradHeader + C, C);
  at::Tensor grad = residual.defined() ? at::empty_like(input) : at::Tensor();
  if (input.numel() > 0) {
    const at::Tensor lo_dense = lo.defined() ? lo.contiguous() : lo;
    SumsInto into{grad_out, input, mean, lo_dense, sum_dy, sum_dy_xmu};
    into.act = activation;
    into.info = info;
    into.header = &header;
    if (residual.defined()) {
      into.residual = with_strides_of(residual, input);
      into.grad = &grad;
    }
    backward_sums_into_cuda(into);
  } else if (info.defined()) {
    grad_header_cuda({info, &header});
  }
  auto [packed, grad_weight, grad_bias] =
      with_packed_param_grads(sums, invstd, args.weight, input);
  return {packed, grad_weight, grad_bias, grad};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_sums_cuda(const GradArgs& args) {
  auto [sums, grad_weight, grad_bias, unused] = grad_sums_with(args, at::Tensor());
  return {sums, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> grad_sums_residual_cuda(
    const GradArgs& args, const at::Tensor& residual) {
  SYNCBN_CHECK(residual.defined(), "syncbn: grad_sums_residual: `residual` is undefined");
  return grad_sums_with(args, checked_residual(residual, args.input));
}

std::tuple<at::Tensor, at::Tensor> grad_input_cuda(
    const GradArgs& args, const at::Tensor& sums, int64_t world_size) {
  const at::Tensor &grad_out = args.grad_out, &input = args.input, &mean = args.mean,
                   &invstd = args.invstd;
  const at::Tensor info = required_info(args.info);
  check_input(input, c10::DeviceType::CUDA);
  check_backward_args(grad_out, input, mean, invstd, c10::DeviceType::CUDA);
  const int64_t C = input.size(1);
  const double ranks = summed_ranks(check_sums(sums, info, input), world_size);
  const at::Tensor total = group_sums(sums, info, input);
  const at::Tensor sum_dy = total.narrow(0, kGradHeader, C);
  const at::Tensor sum_dy_xmu = total.narrow(0, kGradHeader + C, C);
  const at::Tensor count = info.narrow(0, 0, 1);
  const at::Tensor lo = checked_mean_lo(args.mean_lo, input);
  at::Tensor order_ok = at::empty({1}, info.options());
  const at::Tensor tags = info.contiguous();
  const GradHeader check{tags, nullptr, &total, ranks, &order_ok};
  at::Tensor grad = backward_elemt_act_cuda(
      grad_out, input, mean, lo, invstd, args.weight, sum_dy, sum_dy_xmu, count,
      act_affine(args.act, args.act_param, invstd, args.weight, args.bias, input), &check);
  return {grad, order_ok};
}

}  // namespace syncbn
