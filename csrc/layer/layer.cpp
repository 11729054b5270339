// `syncbn::sync_batch_norm`: a synchronized layer call as one operator (see layer.h), with its
// autograd node in C++.
//
//   forward   stats_row -> all_gather -> merge_normalize            (gather exchange)
//             reduce_sums -> sum over the group -> reduce_merge_normalize  (reduce exchange)
//             or, a checkpoint's recompute: renormalize from what its forward kept (no collective)
//   backward  grad_sums[_residual] -> sum over the group -> grad_input
//
// The same steps, kernels and collectives as the Python Function (functional/function.py), called
// from C++: no Python frame per layer call in either direction. One orchestration for every
// device: only the step kernels (StepKernels, the _cpu or _cuda twins) differ, and where the
// call-order flags are read: CPU kernels raise a mismatch at once, CUDA calls queue their flags in
// C++ (queue_order_flag, order_flags.cpp), read before later calls' collectives
// (check_before_collective). The whole call runs on the input's device (a device guard). Which
// layers take this path on CUDA is the Python plan's choice (functional/layer_call.py, as
// ops/dispatch.py answers: on a recorded pass of benchmarks/gpu_check.sh native, or opted in).
#include "layer.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/mul.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "common.h"
#include "layer_node.h"

namespace syncbn::layer {
namespace {

// What the forward returns and keeps for the backward.
struct Forward {
  at::Tensor output, mean, mean_lo, invstd, var, info, grad_info;
  int64_t flight_call = -1;
};

int64_t forward_call(const Settings& s) {
  if (!s.group.has_value()) return -1;
  ensure_flight_ring();
  return flight::next_call(s.layer_tag);
}

constexpr StepKernels kCpuSteps{
    &stats_row_cpu,      &merge_normalize_cpu,    &reduce_sums_cpu,
    &reduce_merge_normalize_cpu, &grad_sums_cpu, &grad_sums_residual_cpu,
    &grad_input_cpu};
#ifdef WITH_CUDA
constexpr StepKernels kCudaSteps{
    &stats_row_cuda,      &merge_normalize_cuda,    &reduce_sums_cuda,
    &reduce_merge_normalize_cuda, &grad_sums_cuda, &grad_sums_residual_cuda,
    &grad_input_cuda};
#endif

// The input, when a call on it must check the group's count on the host (fewer than two values
// per channel here: the group may hold only one), else undefined.
at::Tensor tiny(const at::Tensor& input) {
  return input.numel() < 2 * input.size(1) ? input : at::Tensor();
}

MergeArgs merge_args(
    const at::Tensor& input, const OptTensor& weight, const OptTensor& bias, const State& st,
    const OptTensor& residual, const Settings& s) {
  const RunningBuffers running{
      st.running_mean, st.running_var, st.num_batches_tracked, st.nonfinite};
  return {input, weight, bias, running, s.merge, residual};
}

// normalize="step" (functional/accumulate.py): the layer's earlier calls in the optimizer step,
// merged (`prior`, a row [count, samples, 0, 0, mean[C], mean_lo[C], m2[C]]), are one more part
// of the group's statistics: a row beside the gathered ones, with this call's tags (the merge
// weighs it by its count as it weighs a rank, and its tags pass the call-order check)...
at::Tensor gathered_with_prior(
    const at::Tensor& rows, const at::Tensor& row, const at::Tensor& prior) {
  const int64_t gathered = rows.numel();
  at::Tensor all = at::cat({rows, prior.to(row.scalar_type())});
  all.narrow(0, gathered + 2, 2).copy_(row.narrow(0, 2, 2));
  return all;
}

// ... or, for the reduce exchange, their sums shifted by the K this call's sums were (`shift`,
// the running mean), added to the first rank's part of `total`: no tags (0 keeps the ranks'
// check), no rank counted.
at::Tensor summed_with_prior(
    const at::Tensor& total, const at::Tensor& sent, const at::Tensor& prior,
    const OptTensor& shift) {
  const int64_t C = (prior.numel() - 4) / 3;
  const at::Tensor stats = prior.narrow(0, 4, 3 * C).to(at::kDouble);
  const at::Tensor n = prior.narrow(0, 0, 1).to(at::kDouble);
  at::Tensor offset = stats.narrow(0, 0, C) + stats.narrow(0, C, C);
  if (shift.has_value() && shift->defined()) offset = offset - shift->to(at::kDouble);
  const at::Tensor s1 = n * offset;
  const at::Tensor s2 = stats.narrow(0, 2 * C, C) + s1 * offset;
  const at::Tensor header =
      at::cat({prior.narrow(0, 0, 2).to(at::kDouble), sent.new_zeros({kReduceHeader - 2})});
  const int64_t own = sent.numel();
  return at::cat(
      {total.narrow(0, 0, own) + at::cat({header, s1, s2}),
       total.narrow(0, own, total.numel() - own)});
}

// What the next call of the step takes as `prior` (written into it): this call's merge, as a
// row of the same layout, M2 back from the variance by its divisor (count - 1 when unbiased, or
// count; at least 1).
void write_prior(const at::Tensor& prior, const MergedOutputs& merged, bool unbiased) {
  const at::Tensor &mean = std::get<1>(merged), &mean_lo = std::get<2>(merged);
  const at::Tensor &var = std::get<4>(merged), &info = std::get<5>(merged);
  const int64_t C = mean.numel();
  prior.narrow(0, 0, 2).copy_(info.narrow(0, 0, 2));  // count, samples (the tags stay 0)
  prior.narrow(0, 4, C).copy_(mean);
  prior.narrow(0, 4 + C, C).copy_(mean_lo);
  // The divisor, max(count - 1, 1) when unbiased (as max(count, 2) - 1), else max(count, 1).
  at::Tensor divisor = info.narrow(0, 0, 1).clamp_min(unbiased ? 2 : 1);
  if (unbiased) divisor.sub_(1);
  at::Tensor m2 = prior.narrow(0, 4 + 2 * C, C);
  at::mul_out(m2, var, divisor);
}

Forward forward_steps(
    const StepKernels& k, const at::Tensor& input, const OptTensor& weight, const OptTensor& bias,
    const State& st, const OptTensor& residual, const OptTensor& prior, const Settings& s) {
  const bool stepwise = prior.has_value() && prior->defined();
  Forward f;
  check_before_collective(s);
  f.flight_call = forward_call(s);
  const Note note{flight::kForward, s.layer_tag, f.flight_call};
  MergedOutputs merged;
  // What a call-order mismatch is reported from: the gathered rows, or the vector sent and the
  // summed one (the reduce exchange); `width`: one rank's share.
  Mismatch kind = Mismatch::kGatheredRows;
  at::Tensor data, aux;
  int64_t width = 0;
  try {
    if (!s.reduce) {
      const at::Tensor row = k.stats_row(input, s.layer_tag, st.calls);
      const at::Tensor rows = all_gather(row, s, note);
      std::tie(kind, data, width) = std::make_tuple(Mismatch::kGatheredRows, rows, row.numel());
      const at::Tensor all = stepwise ? gathered_with_prior(rows, row, *prior) : rows;
      merged = k.merge_normalize(merge_args(input, weight, bias, st, residual, s), all);
    } else {
      const at::Tensor sent = k.reduce_sums(
          input, st.running_mean, s.layer_tag, st.calls, s.merge.equal_rank_weights);
      const at::Tensor total = sum_over_group(sent, s, note, Summed::kIntoCopy);
      std::tie(kind, data, aux, width) =
          std::make_tuple(Mismatch::kReduceSums, sent, total, sent.numel());
      const at::Tensor all =
          stepwise ? summed_with_prior(total, sent, *prior, st.running_mean) : total;
      merged = k.reduce_merge_normalize(
          merge_args(input, weight, bias, st, residual, s), all, sent, s.world_size);
    }
  } catch (const c10::Error& error) {
    if (data.defined() && is_call_order_error(error)) {
      // The immediate check (CPU): every rank of the group fails at this call; the reduce
      // exchange's report gathers the ranks' own tags from `sent`.
      call_order_failed(kind, data, at::Tensor(), width, s);
    }
    throw;
  }
  if (stepwise) write_prior(*prior, merged, s.merge.unbiased);
  std::tie(f.output, f.mean, f.mean_lo, f.invstd, f.var, f.info, f.grad_info) = merged;
  if (s.queue_order_flags) {
    queue_order_flag(f.info, 2, kind, data, aux, width, s, tiny(input));
  }
  return f;
}

const auto& renormalize_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("syncbn::renormalize", "")
          .typed<at::Tensor(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const OptTensor&, const OptTensor&, int64_t, double, const OptTensor&)>();
  return op;
}

// A checkpoint's recompute: the output again from what the call's forward kept (`kept`, laid out
// as kKeptPerChannel says; `kept_call`, its flight-recorder call number), with the forward's
// statistics: no collective, nothing updated or counted (renormalize: the merges' normalize).
ForwardOutputs recompute(
    const at::Tensor& input, const OptTensor& weight, const OptTensor& bias,
    const OptTensor& residual, const at::Tensor& kept, int64_t kept_call, int64_t act,
    double act_param) {
  const int64_t C = input.size(1);
  SYNCBN_CHECK(
      kept.dim() == 1 && kept.numel() == kKeptPerChannel * C + 2 * kInfoFields,
      "syncbn: sync_batch_norm: `kept` must be what the forward kept for ", C, " channels");
  // Copies: an operator's outputs alias neither its inputs nor each other (O(C) values).
  const auto part = [&](int64_t start, int64_t size) { return kept.narrow(0, start, size).clone(); };
  const at::Tensor mean = part(0, C), mean_lo = part(C, C), invstd = part(2 * C, C);
  const at::Tensor var = part(3 * C, C), info = part(kKeptPerChannel * C, kInfoFields);
  const at::Tensor grad_info = part(kKeptPerChannel * C + kInfoFields, kInfoFields);
  const at::Tensor output =
      renormalize_op().call(input, mean, mean_lo, invstd, weight, bias, act, act_param, residual);
  return {output, mean, var, info, mean_lo, invstd, grad_info, kept_call};
}

// What a checkpointed forward keeps for its recompute (`kept`'s layout, kKeptPerChannel).
at::Tensor pack_kept(const ForwardOutputs& out) {
  return at::cat(
      {std::get<1>(out), std::get<4>(out), std::get<5>(out), std::get<2>(out), std::get<3>(out),
       std::get<6>(out)});
}

// `syncbn::sync_batch_norm_forward` on one device's tensors: the forward's steps, or a
// checkpoint's recompute (no autograd).
template <const StepKernels& K>
ForwardOutputs forward_kernel(SYNCBN_LAYER_ARGS) {
  // The input's device for the whole call, hand-off included: a kernel, a collective or a queued
  // flag's copy on another current device would use that device's stream.
  const c10::DeviceGuard guard(input.device());
  check_layer_input(input, num_features, weight, running_mean);  // the call's one input check
  if (kept.has_value()) {
    return recompute(input, weight, bias, residual, *kept, kept_call, act, act_param);
  }
  const State state{running_mean, running_var, num_batches_tracked, nonfinite, calls};
  const Settings s = forward_settings(SYNCBN_LAYER_PASS);
  Forward f = forward_steps(K, input, weight, bias, state, residual, prior, s);
  return {f.output, f.mean, f.var, f.info, f.mean_lo, f.invstd, f.grad_info, f.flight_call};
}

// `syncbn::sync_batch_norm_backward` on one device's tensors: the local sums, their collective
// (only when the input needs a gradient) and the input gradient; (grad_input, grad_weight,
// grad_bias, grad_residual), undefined where not computed (no weight, no residual, no input
// gradient).
template <const StepKernels& K>
Outputs backward_kernel(
    const at::Tensor& dy, const at::Tensor& input, const OptTensor& weight, const OptTensor& bias,
    const OptTensor& residual_, const at::Tensor& mean, const at::Tensor& mean_lo,
    const at::Tensor& invstd, const at::Tensor& grad_info,
    const c10::optional<c10::string_view>& group, int64_t world_size, int64_t layer_tag,
    bool queue_order_flags, int64_t act, double act_param, int64_t flight_call,
    bool input_grad) {
  const c10::DeviceGuard guard(input.device());  // as in forward_kernel
  const Settings s =
      group_settings(group, world_size, layer_tag, act, act_param, queue_order_flags);
  const at::Tensor residual = residual_.value_or(at::Tensor());
  at::Tensor sums, grad_weight, grad_bias, grad;  // grad: dy * act'(z + residual)
  GradArgs args{dy, input, mean, invstd, weight, bias, act, act_param, mean_lo, grad_info};
  if (residual.defined()) {
    std::tie(sums, grad_weight, grad_bias, grad) = K.grad_sums_residual(args, residual);
  } else {
    std::tie(sums, grad_weight, grad_bias) = K.grad_sums(args);
  }
  at::Tensor grad_input;
  if (input_grad) {
    const Note note{flight::kBackward, layer_tag, flight_call};
    check_before_collective(s);
    const at::Tensor summed = sum_over_group(sums, s, note, Summed::kInPlace);
    at::Tensor order_ok;
    try {
      if (residual.defined()) {  // g for dy, its activation already applied
        args.grad_out = grad;
        args.act = 0;
      }
      std::tie(grad_input, order_ok) = K.grad_input(args, summed, world_size);
    } catch (const c10::Error& error) {
      if (is_call_order_error(error)) {
        call_order_failed(Mismatch::kBackwardSums, summed, grad_info, sums.numel(), s);
      }
      throw;
    }
    if (s.queue_order_flags) {
      queue_order_flag(
          order_ok, 0, Mismatch::kBackwardSums, summed, grad_info, sums.numel(), s, {});
    }
  }
  const bool affine = weight.has_value() && weight->defined();
  return {grad_input, affine ? grad_weight : at::Tensor(), affine ? grad_bias : at::Tensor(), grad};
}

// The layer call's outputs: output, mean, var, info, what a checkpointed forward keeps (`keep`;
// undefined otherwise) and the call's flight-recorder number (which its recompute takes back).
using CallOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t>;

CallOutputs call_outputs(const ForwardOutputs& out, bool keep) {
  return {std::get<0>(out), std::get<1>(out), std::get<2>(out), std::get<3>(out),
          keep ? pack_kept(out) : at::Tensor(), std::get<7>(out)};
}

// `syncbn::sync_batch_norm` with autograd: the layer's node around the forward operator.
CallOutputs sync_batch_norm_autograd(SYNCBN_LAYER_ARGS) {
  // The input is checked once, by the forward operator's kernel.
  return call_outputs(forward_with_node(SYNCBN_LAYER_PASS), keep);
}

// `syncbn::sync_batch_norm` below autograd (inference mode): the forward operator alone.
CallOutputs sync_batch_norm_below_autograd(SYNCBN_LAYER_ARGS) {
  return call_outputs(forward_op().call(SYNCBN_LAYER_PASS), keep);
}

}  // namespace
}  // namespace syncbn::layer

TORCH_LIBRARY_FRAGMENT(syncbn, m) {
  // The layer call: (output, mean, var, info) as the Python Function returns them, what a
  // checkpointed forward keeps (`keep`; None otherwise) and its flight-recorder number. `group`
  // is the process group's name (None: no collective); `kept` makes the call a recompute; the
  // rest are the fused steps'.
  m.def(
      "sync_batch_norm(" SYNCBN_LAYER_SCHEMA_ARGS
      ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, int)");
  // Its two steps, below autograd: the forward (the four, then mean_lo, invstd, grad_info and
  // the flight recorder's call number) and the backward.
  m.def(
      "sync_batch_norm_forward(" SYNCBN_LAYER_SCHEMA_ARGS
      ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int)");
  m.def(
      "sync_batch_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor? bias, "
      "Tensor? residual, Tensor mean, Tensor mean_lo, Tensor invstd, Tensor grad_info, "
      "str? group, int world_size, int layer_tag, bool queue_order_flags, int act, "
      "float act_param, int flight_call, bool input_grad) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(syncbn, Autograd, m) {
  m.impl("sync_batch_norm", &syncbn::layer::sync_batch_norm_autograd);
  m.impl("sync_batch_norm_forward", torch::CppFunction::makeFallthrough());
  m.impl("sync_batch_norm_backward", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(syncbn, ADInplaceOrView, m) {
  m.impl("sync_batch_norm", torch::CppFunction::makeFallthrough());
  m.impl("sync_batch_norm_forward", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(syncbn, CPU, m) {
  using namespace syncbn::layer;
  m.impl("sync_batch_norm", &sync_batch_norm_below_autograd);
  m.impl("sync_batch_norm_forward", &forward_kernel<kCpuSteps>);
  m.impl("sync_batch_norm_backward", &backward_kernel<kCpuSteps>);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(syncbn, CUDA, m) {
  using namespace syncbn::layer;
  m.impl("sync_batch_norm", &sync_batch_norm_below_autograd);
  m.impl("sync_batch_norm_forward", &forward_kernel<kCudaSteps>);
  m.impl("sync_batch_norm_backward", &backward_kernel<kCudaSteps>);
}
#endif
