// Entry points of the reduce exchange's CPU twins (see syncbn.h): reduce_sums (this rank's float64
// vector: one pass over the input, stats_cpu.cpp's shifted sums, plus the header) and
// reduce_merge_normalize (the checks, the merge of the summed vector, the running statistics and
// the output). The arithmetic they share with the CUDA twins is reduce.h's.
#include "common.h"
#include "reduce.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace syncbn {

using namespace detail;

at::Tensor reduce_sums_cpu(
    const at::Tensor& input_, const c10::optional<at::Tensor>& shift, int64_t layer_tag,
    const at::Tensor& calls, bool equal_rank_weights) {
  check_input(input_, c10::DeviceType::CPU);
  check_calls(calls, input_);
  const at::Tensor input = dense_input(input_);
  const at::Tensor k = shift_float64(shift, input);
  const int64_t C = input.size(1), count = input.numel() / C;
  at::Tensor out = new_empty({kReduceHeader + 2 * C}, input.options().dtype(at::kDouble));
  double* v = out.mutable_data_ptr<double>();
  shifted_sums_into_cpu(input, k, v + kReduceHeader, v + kReduceHeader + C);
  if (equal_rank_weights && count > 0) {
    for (int64_t i = kReduceHeader; i < kReduceHeader + 2 * C; ++i) v[i] /= count;
  }
  int64_t fingerprint = 0;
  if (k.defined()) {
    const double* kp = k.const_data_ptr<double>();
    for (int64_t c = 0; c < C; ++c) fingerprint += shift_term(kp[c], c);
  }
  int64_t& call = *calls.mutable_data_ptr<int64_t>();
  write_reduce_header(v, count, input.size(0), layer_tag, call, fingerprint);
  ++call;
  return out;
}

MergedOutputs reduce_merge_normalize_cpu(
    const MergeArgs& args, const at::Tensor& total, const at::Tensor& sent, int64_t world_size) {
  const at::Tensor& input = args.input;
  const Activation activation = checked_activation(args.settings.act, args.settings.act_param);  // before updates
  const at::Tensor res = checked_residual(args.residual, input);
  MergeOutputs out = prepare_merge(args, c10::DeviceType::CPU);
  const at::Tensor summed = summed_reduce_vector(total, sent, world_size, input);
  const double* t = summed.const_data_ptr<double>();
  const double* own = sent.const_data_ptr<double>();
  const ReduceChecks checks = reduce_checks(t, own, world_size);
  if (!checks.order_ok) {
    double layer = 0, call = 0;
    reduce_tags(own, &layer, &call);
    SYNCBN_CHECK(
        false, SYNCBN_CALL_ORDER_MARK " the ranks' layer or call tags differ (this rank: layer ",
        "tag ", static_cast<int64_t>(layer), " call #", static_cast<int64_t>(call) + 1, ")");
  }
  SYNCBN_CHECK(checks.shift_ok, kShiftMismatch);
  check_group_count(t[0], input, world_size);
  const int64_t C = input.size(1);
  const at::Tensor k = shift_float64(args.running.mean, input);
  const double* kp = k.defined() ? k.const_data_ptr<double>() : nullptr;
  std::vector<double> mean(C), invstd(C), var(C);
  bool finite = true;
  for (int64_t c = 0; c < C; ++c) {
    const ReducedChannel r =
        reduce_channel(t, C, c, kp ? kp[c] : 0.0, args.settings.equal_rank_weights, args.settings.eps, args.settings.unbiased);
    mean[c] = r.mean, invstd[c] = r.invstd, var[c] = r.var;
    finite = finite && std::isfinite(r.mean) && std::isfinite(r.var);
  }
  store_split_stats_cpu(mean.data(), invstd.data(), var.data(), C, out);
  update_running_cpu(mean.data(), var.data(), C, t[0], finite, args);
  const double grad_count = args.settings.equal_rank_weights ? t[2] * own[0] : t[0];
  double layer = 0, call = 0;
  reduce_tags(own, &layer, &call);
  AT_DISPATCH_FLOATING_TYPES(out.info.scalar_type(), "reduce_merge_normalize_cpu", [&] {
    write_info<scalar_t>(out, t[0], grad_count, t[1], true, finite, layer, call);
  });
  at::Tensor output = normalize_act_cpu(
      input, out.mean, out.mean_lo, out.invstd, args.weight, args.bias, activation, res);
  return {output, out.mean, out.mean_lo, out.invstd, out.var, out.info, out.grad_info};
}

}  // namespace syncbn
