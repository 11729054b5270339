// Entry points of the CPU twins (see syncbn.h): the five primitives, the gather exchange's fused
// steps and the backward's, one call per step of a synchronized layer, writing straight into the
// buffers the collectives use (the reduce exchange's are in entry_reduce_cpu.cpp). Argument
// checks, layouts and outputs are here; the kernels are in stats_cpu.cpp, normalize_cpu.cpp and
// backward_cpu.cpp. Layout of this file: helpers of the fused steps, the primitives, the fused
// steps.
#include "common.h"
#include "merge.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace syncbn {
namespace {

using namespace detail;

// torch.lerp's formula (ATen/native/Lerp.h) in the running dtype's opmath, as the vectorized
// kernel computes it (one fused multiply-add), so the update matches `running.lerp_(batch, w)`.
template <typename T>
T lerp(T start, T end, T weight) {
  const bool small = std::abs(weight) < T(0.5);
  return std::fma(small ? weight : weight - T(1), end - start, small ? start : end);
}

template <typename run_t, typename acc_t>
void lerp_channels(run_t* running, const acc_t* batch, int64_t C, double factor) {
  using op_t = at::opmath_type<run_t>;
  for (int64_t c = 0; c < C; ++c) {
    // The batch statistic is first rounded to the running dtype, as batch.to(running.dtype).
    const op_t target = static_cast<op_t>(static_cast<run_t>(batch[c]));
    running[c] = static_cast<run_t>(
        lerp<op_t>(static_cast<op_t>(running[c]), target, static_cast<op_t>(factor)));
  }
}

// The momentum of this update: the given one, or 1 / num_batches_tracked (cumulative average,
// computed in the running dtype as torch does).
double update_factor(c10::optional<double> momentum, int64_t tracked, at::ScalarType run) {
  if (momentum.has_value()) return *momentum;
  if (run == at::kDouble) return 1.0 / static_cast<double>(tracked);
  return static_cast<double>(1.0f / static_cast<float>(tracked));
}

}  // namespace

namespace detail {

void update_running_cpu(
    const double* mean, const double* var, int64_t C, double total, bool finite,
    const MergeArgs& args) {
  const auto& [running_mean, running_var, num_batches_tracked, nonfinite] = args.running;
  const c10::optional<double> momentum = args.settings.momentum;
  int64_t tracked = 0;
  if (num_batches_tracked.has_value() && num_batches_tracked->defined()) {
    tracked = (*num_batches_tracked->mutable_data_ptr<int64_t>() += finite ? 1 : 0);
  }
  if (nonfinite.has_value() && nonfinite->defined()) {
    *nonfinite->mutable_data_ptr<int64_t>() += finite ? 0 : 1;
  }
  // An empty group has nothing to average in, and NaN/inf would stay in the running stats forever.
  if (!finite || total == 0 || !running_mean.has_value() || !running_mean->defined()) return;
  const double factor = update_factor(momentum, tracked, running_mean->scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, running_mean->scalar_type(), "update_running_cpu", [&] {
    lerp_channels(running_mean->mutable_data_ptr<scalar_t>(), mean, C, factor);
    lerp_channels(running_var->mutable_data_ptr<scalar_t>(), var, C, factor);
  });
}

void store_split_stats_cpu(
    const double* mean, const double* invstd, const double* var, int64_t C, MergeOutputs& out) {
  AT_DISPATCH_FLOATING_TYPES(out.mean.scalar_type(), "store_split_stats_cpu", [&] {
    scalar_t* hi = out.mean.mutable_data_ptr<scalar_t>();
    scalar_t* lo = out.mean_lo.mutable_data_ptr<scalar_t>();
    scalar_t* is = out.invstd.mutable_data_ptr<scalar_t>();
    scalar_t* v = out.var.mutable_data_ptr<scalar_t>();
    for (int64_t c = 0; c < C; ++c) {
      hi[c] = static_cast<scalar_t>(mean[c]);
      lo[c] = static_cast<scalar_t>(mean[c] - static_cast<double>(hi[c]));
      is[c] = static_cast<scalar_t>(invstd[c]);
      v[c] = static_cast<scalar_t>(var[c]);
    }
  });
}

}  // namespace detail

namespace {

// Throws when the rows' (layer, call) tags differ: the ranks called their layers in different
// orders. Python turns the message into CallOrderError with the layers' names.
template <typename acc_t>
void check_call_order(const acc_t* rows, int64_t W, int64_t width) {
  bool same = true;
  for (int64_t w = 1; w < W; ++w) {
    same = same && rows[w * width + 2] == rows[2] && rows[w * width + 3] == rows[3];
  }
  if (same) return;
  std::string text;
  for (int64_t w = 0; w < W; ++w) {
    text += check::message(
        w ? "; " : "", "row ", w, ": layer tag ", static_cast<int64_t>(rows[w * width + 2]),
        " call #", static_cast<int64_t>(rows[w * width + 3]) + 1);
  }
  SYNCBN_CHECK(
      false, SYNCBN_CALL_ORDER_MARK " SyncBatchNorm layers were called in a different order on ",
      "the ranks of one sync group (", text, "). Every rank must run every SyncBatchNorm ",
      "layer of the group in the same order and the same number of times per training forward.");
}

// The local parameter gradients from the packed sums [header, sum_dy, sum_dy_xmu] (acc dtype):
// grad_weight = sum_dy_xmu * invstd and grad_bias = sum_dy, in the weight's dtype (the acc dtype
// without weight). Both are new tensors (grad_sums returns them beside `sums`). A loop instead of
// mul + to: the same roundings, without three dispatcher calls of host time.
std::tuple<at::Tensor, at::Tensor> param_grads(
    const at::Tensor& sums, const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const at::Tensor& input) {
  const bool has_weight = weight.has_value() && weight->defined();
  if (has_weight) check_channel_vector(*weight, "weight", input, false);
  const int64_t C = input.size(1);
  const auto opts = sums.options().dtype(has_weight ? weight->scalar_type() : sums.scalar_type());
  at::Tensor grad_weight = new_empty({C}, opts), grad_bias = new_empty({C}, opts);
  AT_DISPATCH_FLOATING_TYPES(sums.scalar_type(), "param_grads_cpu", [&] {
    using acc_t = scalar_t;
    const acc_t* sum_dy = sums.const_data_ptr<acc_t>() + kGradHeader;
    const acc_t* sum_dy_xmu = sum_dy + C;
    const acc_t* inv = invstd.const_data_ptr<acc_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, opts.dtype().toScalarType(), "param_grads_cpu", [&] {
      scalar_t* gw = grad_weight.mutable_data_ptr<scalar_t>();
      scalar_t* gb = grad_bias.mutable_data_ptr<scalar_t>();
      for (int64_t c = 0; c < C; ++c) {
        gw[c] = static_cast<scalar_t>(sum_dy_xmu[c] * inv[c]);
        gb[c] = static_cast<scalar_t>(sum_dy[c]);
      }
    });
  });
  return {grad_weight, grad_bias};
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// The primitives
// ------------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> local_stats_cpu(const at::Tensor& input_) {
  check_input(input_, c10::DeviceType::CPU);
  const at::Tensor input = dense_input(input_);
  const auto opts = input.options().dtype(acc_dtype_of(input.scalar_type()));
  at::Tensor mean = new_empty({input.size(1)}, opts);
  at::Tensor m2 = new_empty({input.size(1)}, opts);
  local_stats_into_cpu(input, {mean}, {m2});
  return {mean, m2};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_stats_cpu(
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s, double eps,
    bool unbiased) {
  check_merge_inputs(counts, means, m2s, eps, c10::DeviceType::CPU);
  const MergeStatsArgs args = merge_stats_args(counts, means, m2s);
  merge_stats_into_cpu(args, eps, unbiased);
  return {args.mean, args.invstd, args.var};
}

at::Tensor normalize_cpu(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias) {
  check_normalize_args(input, mean, invstd, c10::DeviceType::CPU);
  return normalize_act_cpu(input, mean, at::Tensor(), invstd, weight, bias, Activation{}, {});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_reduce_cpu(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& mean_,
    const at::Tensor& invstd_, const c10::optional<at::Tensor>& weight, bool weight_grad,
    bool bias_grad) {
  check_backward_args(grad_out_, input_, mean_, invstd_, c10::DeviceType::CPU);
  const at::Tensor input = dense_input(input_);
  const at::Tensor grad_out = with_strides_of(grad_out_, input);
  const at::Tensor mean = mean_.contiguous(), invstd = invstd_.contiguous();
  at::Tensor sum_dy = new_empty({input.size(1)}, mean.options());
  at::Tensor sum_dy_xmu = new_empty({input.size(1)}, mean.options());
  backward_sums_into_cpu(grad_out, input, mean, at::Tensor(), {sum_dy}, {sum_dy_xmu});
  return with_param_grads(sum_dy, sum_dy_xmu, invstd, weight, input, weight_grad, bias_grad);
}

at::Tensor backward_elemt_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
    const at::Tensor& sum_dy_xmu, const at::Tensor& count) {
  check_backward_elemt_args(
      grad_out, input, mean, invstd, sum_dy, sum_dy_xmu, count, c10::DeviceType::CPU);
  return backward_elemt_checked_cpu(
      grad_out, input, mean, at::Tensor(), invstd, weight, {sum_dy.contiguous()},
      {sum_dy_xmu.contiguous()}, count.item<double>());
}

// ------------------------------------------------------------------------------------------------
// The fused steps
// ------------------------------------------------------------------------------------------------

at::Tensor stats_row_cpu(const at::Tensor& input_, int64_t layer_tag, const at::Tensor& calls) {
  check_input(input_, c10::DeviceType::CPU);
  check_calls(calls, input_);
  const at::Tensor input = dense_input(input_);
  const int64_t C = input.size(1);
  at::Tensor row = new_empty({row_width(C)}, input.options().dtype(acc_dtype_of(input.scalar_type())));
  const Channels mean_lo{row, kRowHeader + C};
  local_stats_into_cpu(input, {row, kRowHeader}, {row, kRowHeader + 2 * C}, &mean_lo);
  int64_t& call = *calls.mutable_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(row.scalar_type(), "stats_row_cpu", [&] {
    scalar_t* head = row.mutable_data_ptr<scalar_t>();
    head[0] = static_cast<scalar_t>(input.numel() / C);
    head[1] = static_cast<scalar_t>(input.size(0));
    head[2] = static_cast<scalar_t>(layer_tag % kTagLimit);
    head[3] = static_cast<scalar_t>(call % kTagLimit);
  });
  ++call;
  return row;
}

MergedOutputs merge_normalize_cpu(const MergeArgs& args, const at::Tensor& rows) {
  const at::Tensor& input = args.input;
  const double eps = args.settings.eps;
  const bool unbiased = args.settings.unbiased, equal_rank_weights = args.settings.equal_rank_weights;
  const Activation activation = checked_activation(args.settings.act, args.settings.act_param);  // before updates
  const at::Tensor res = checked_residual(args.residual, input);
  MergeOutputs out = prepare_merge(args, c10::DeviceType::CPU);
  const int64_t W = check_rows(rows, input);
  const int64_t C = input.size(1), width = row_width(C);
  std::vector<double> mean(C), invstd(C), var(C);
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "merge_normalize_cpu", [&] {
    const scalar_t* r = rows.const_data_ptr<scalar_t>();
    check_call_order(r, W, width);
    double total = 0, samples = 0, ranks = 0;
    for (int64_t w = 0; w < W; ++w) {
      total += r[w * width];
      samples += r[w * width + 1];
      ranks += r[w * width] > 0 ? 1 : 0;
    }
    check_group_count(total, input, W);
    bool finite = true;
    for (int64_t c = 0; c < C; ++c) {
      const MergedChannel m = merge_row_channel(r, width, W, C, c, total, ranks, equal_rank_weights);
      mean[c] = m.mean;
      invstd[c] = 1.0 / std::sqrt(m.m2 / std::max(total, 1.0) + eps);
      var[c] = m.m2 / std::max(unbiased ? total - 1 : total, 1.0);
      finite = finite && std::isfinite(mean[c]) && std::isfinite(var[c]);
    }
    store_split_stats_cpu(mean.data(), invstd.data(), var.data(), C, out);
    update_running_cpu(mean.data(), var.data(), C, total, finite, args);
    const double local = static_cast<double>(input.numel() / C);
    const double grad_count = equal_rank_weights ? ranks * local : total;
    write_info<scalar_t>(out, total, grad_count, samples, true, finite, r[2], r[3]);
  });
  at::Tensor output = normalize_act_cpu(
      input, out.mean, out.mean_lo, out.invstd, args.weight, args.bias, activation, res);
  return {output, out.mean, out.mean_lo, out.invstd, out.var, out.info, out.grad_info};
}

at::Tensor renormalize_cpu(
    const MergeArgs& args, const at::Tensor& mean, const at::Tensor& mean_lo,
    const at::Tensor& invstd) {
  const at::Tensor& input = args.input;
  const Activation activation = checked_activation(args.settings.act, args.settings.act_param);
  const at::Tensor res = checked_residual(args.residual, input);
  check_normalize_args(input, mean, invstd, c10::DeviceType::CPU);
  const at::Tensor lo = checked_mean_lo(mean_lo, input);
  return normalize_act_cpu(input, mean, lo, invstd, args.weight, args.bias, activation, res);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_sums_cpu(const GradArgs& args) {
  const at::Tensor &grad_out_ = args.grad_out, &input_ = args.input, &mean = args.mean,
                   &invstd = args.invstd;
  const c10::optional<at::Tensor>&weight = args.weight, &bias = args.bias,
                                  &mean_lo = args.mean_lo, &info_ = args.info;
  const int64_t act = args.act;
  const double act_param = args.act_param;
  check_backward_args(grad_out_, input_, mean, invstd, c10::DeviceType::CPU);
  const at::Tensor lo = checked_mean_lo(mean_lo, input_);
  const at::Tensor info = checked_grad_info(info_, input_);
  const at::Tensor input = dense_input(input_);
  const at::Tensor grad_out = with_strides_of(grad_out_, input);
  const int64_t C = input.size(1);
  at::Tensor sums = new_empty({kGradHeader + 2 * C}, mean.options());
  AT_DISPATCH_FLOATING_TYPES(sums.scalar_type(), "grad_sums_cpu", [&] {
    scalar_t* header = sums.mutable_data_ptr<scalar_t>();
    if (info.defined()) {
      const scalar_t* f = info.const_data_ptr<scalar_t>();
      write_grad_header(static_cast<double>(f[4]), static_cast<double>(f[5]), header);
    } else {
      std::fill_n(header, kGradHeader, scalar_t(0));
    }
  });
  backward_sums_into_cpu(
      grad_out, input, mean.contiguous(), lo.defined() ? lo.contiguous() : lo,
      {sums, kGradHeader}, {sums, kGradHeader + C},
      act_affine(act, act_param, invstd, weight, bias, input));
  auto [grad_weight, grad_bias] = param_grads(sums, invstd.contiguous(), weight, input);
  return {sums, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> grad_sums_residual_cpu(
    const GradArgs& args, const at::Tensor& residual) {
  const at::Tensor &grad_out = args.grad_out, &input_ = args.input, &mean = args.mean,
                   &invstd = args.invstd;
  check_backward_args(grad_out, input_, mean, invstd, c10::DeviceType::CPU);
  SYNCBN_CHECK(residual.defined(), "syncbn: grad_sums_residual: `residual` is undefined");
  const at::Tensor res = checked_residual(residual, input_);
  const at::Tensor lo = checked_mean_lo(args.mean_lo, input_);
  const ActAffine activation =
      act_affine(args.act, args.act_param, invstd, args.weight, args.bias, input_);
  // Two passes on the CPU (g, then the sums of g): the sums' kernels stay as they are.
  const at::Tensor input = dense_input(input_);
  const at::Tensor grad = act_grad_residual_cpu(
      with_strides_of(grad_out, input), input, with_strides_of(res, input), mean.contiguous(),
      lo.defined() ? lo.contiguous() : lo, activation);
  GradArgs of_g = args;  // g for dy, without an activation
  of_g.grad_out = grad;
  of_g.input = input;
  of_g.act = 0;
  of_g.act_param = 0.0;
  auto [sums, grad_weight, grad_bias] = grad_sums_cpu(of_g);
  return {sums, grad_weight, grad_bias, grad};
}

std::tuple<at::Tensor, at::Tensor> grad_input_cpu(
    const GradArgs& args, const at::Tensor& sums, int64_t world_size) {
  const at::Tensor &grad_out = args.grad_out, &input = args.input, &mean = args.mean,
                   &invstd = args.invstd;
  check_backward_args(grad_out, input, mean, invstd, c10::DeviceType::CPU);
  const at::Tensor info = required_info(args.info);
  const at::Tensor lo = checked_mean_lo(args.mean_lo, input);
  const ActAffine activation =
      act_affine(args.act, args.act_param, invstd, args.weight, args.bias, input);
  const int64_t C = input.size(1);
  const int64_t rows = check_sums(sums, info, input);
  const double ranks = summed_ranks(rows, world_size);
  const at::Tensor total = group_sums(sums, info, input);
  at::Tensor order_ok = new_empty({1}, info.options());
  double count = 0;
  AT_DISPATCH_FLOATING_TYPES(info.scalar_type(), "grad_input_cpu", [&] {
    const scalar_t* f = info.const_data_ptr<scalar_t>();
    count = static_cast<double>(f[0]);
    const double layer = static_cast<double>(f[4]), call = static_cast<double>(f[5]);
    SYNCBN_CHECK(
        grad_header_matches(total.const_data_ptr<scalar_t>(), layer, call, ranks),
        SYNCBN_CALL_ORDER_MARK " backward: the ranks' layer or call tags differ (this rank: ",
        "layer tag ", static_cast<int64_t>(layer), " call #", static_cast<int64_t>(call) + 1, ")");
    *order_ok.mutable_data_ptr<scalar_t>() = scalar_t(1);  // a mismatch has thrown
  });
  at::Tensor grad = backward_elemt_checked_cpu(
      grad_out, input, mean, lo, invstd, args.weight, {total, kGradHeader},
      {total, kGradHeader + C}, count, activation);
  return {grad, order_ok};
}

}  // namespace syncbn
