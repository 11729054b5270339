// `syncbn::sync_batch_norm`: a synchronized layer call as one operator (see layer.h), with its
// autograd node in C++.
//
//   forward   stats_row -> all_gather -> merge_normalize            (gather exchange)
//             reduce_sums -> sum over the group -> reduce_merge_normalize  (reduce exchange)
//   backward  grad_sums[_residual] -> sum over the group -> grad_input
//
// The same steps, kernels and collectives as the Python Function (functional/function.py), called
// from C++: no Python frame per layer call in either direction. One orchestration for every
// device: only the step kernels (StepKernels, the _cpu or _cuda twins) differ, and where the
// call-order flags are read: CPU kernels raise a mismatch at once, CUDA calls queue their flags in
// C++ (queue_order_flag, order_flags.cpp), read before later calls' collectives
// (check_before_collective). The whole call runs on the input's device (a device guard). Which
// layers take this path on CUDA is the Python plan's choice (nn/sync_plan.py: opt-in until
// benchmarks/gpu_check.sh native passes).
#include "layer.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/library.h>

#include "common.h"

namespace syncbn::layer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = c10::optional<at::Tensor>;

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

Forward forward_steps(
    const StepKernels& k, const at::Tensor& input, const OptTensor& weight, const OptTensor& bias,
    const State& st, const OptTensor& residual, const Settings& s) {
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
      merged = k.merge_normalize(merge_args(input, weight, bias, st, residual, s), rows);
    } else {
      const at::Tensor sent = k.reduce_sums(
          input, st.running_mean, s.layer_tag, st.calls, s.merge.equal_rank_weights);
      const at::Tensor total = sum_over_group(sent, s, note, Summed::kIntoCopy);
      std::tie(kind, data, aux, width) =
          std::make_tuple(Mismatch::kReduceSums, sent, total, sent.numel());
      merged = k.reduce_merge_normalize(
          merge_args(input, weight, bias, st, residual, s), total, sent, s.world_size);
    }
  } catch (const c10::Error& error) {
    if (data.defined() && is_call_order_error(error)) {
      // The immediate check (CPU): every rank of the group fails at this call; the reduce
      // exchange's report gathers the ranks' own tags from `sent`.
      call_order_failed(kind, data, at::Tensor(), width, s);
    }
    throw;
  }
  std::tie(f.output, f.mean, f.mean_lo, f.invstd, f.var, f.info, f.grad_info) = merged;
  if (s.queue_order_flags) {
    queue_order_flag(f.info, 2, kind, data, aux, width, s, tiny(input));
  }
  return f;
}

OptTensor optional(const at::Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }

// Outputs of a backward run with create_graph=True: differentiating them again raises, as the
// Python Function's once_differentiable does, instead of silently giving zero.
variable_list refuse_double_backward(variable_list grads) {
  bool any = false;
  for (at::Tensor& g : grads) {
    if (g.defined()) {
      g = g.detach().requires_grad_(true);
      any = true;
    }
  }
  if (!any) return grads;
  auto error = std::make_shared<torch::autograd::DelayedError>(
      "trying to differentiate twice a function that was marked with @once_differentiable "
      "(SyncBatchNorm's backward)",
      static_cast<int>(grads.size()));
  return error->apply(std::move(grads));
}

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// The forward operator's outputs: output, mean, var, info (the public four), then mean_lo, invstd,
// grad_info for the backward, and the forward's flight-recorder call number.
using ForwardOutputs = std::tuple<
    at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t>;

// The settings every call of a layer shares (the group, its size, the layer's tag), with the
// activation of this call; the forward's own fields are set by forward_settings.
Settings group_settings(
    const c10::optional<c10::string_view>& group, int64_t world_size, int64_t layer_tag,
    int64_t act, double act_param, bool queue_order_flags) {
  TORCH_CHECK(world_size >= 1, "syncbn: sync_batch_norm: `world_size` must be >= 1");
  Settings s;
  if (group.has_value()) s.group = std::string(*group);
  s.world_size = world_size;
  s.layer_tag = layer_tag;
  s.queue_order_flags = queue_order_flags;
  s.merge.act = act;
  s.merge.act_param = act_param;
  return s;
}

// The arguments of `sync_batch_norm` and `sync_batch_norm_forward` (the schema below): the
// layer's tensors, then its settings, which Python builds by name once per plan and passes in
// this order (nn/sync_plan.py); forward_settings gathers them into one Settings. A macro, not a
// struct: the dispatcher's unboxed kernels take the schema's arguments one by one, and both
// operators and the autograd kernel must list them alike.
#define SYNCBN_LAYER_ARGS                                                                     \
  const at::Tensor &input, const OptTensor &weight, const OptTensor &bias,                    \
      const OptTensor &running_mean, const OptTensor &running_var,                            \
      const OptTensor &num_batches_tracked, const OptTensor &nonfinite,                       \
      const at::Tensor &calls, const OptTensor &residual, int64_t act, double act_param,      \
      const c10::optional<c10::string_view>&group, int64_t world_size, int64_t layer_tag,     \
      bool reduce, c10::optional<double> momentum, double eps, bool unbiased,                 \
      bool equal_rank_weights, bool queue_order_flags, int64_t num_features
#define SYNCBN_LAYER_PASS                                                                   \
  input, weight, bias, running_mean, running_var, num_batches_tracked, nonfinite, calls,    \
      residual, act, act_param, group, world_size, layer_tag, reduce, momentum, eps,        \
      unbiased, equal_rank_weights, queue_order_flags, num_features

Settings forward_settings(SYNCBN_LAYER_ARGS) {
  Settings s = group_settings(group, world_size, layer_tag, act, act_param, queue_order_flags);
  s.reduce = reduce;
  s.merge.momentum = momentum;
  s.merge.eps = eps;
  s.merge.unbiased = unbiased;
  s.merge.equal_rank_weights = equal_rank_weights;
  return s;
}

// `syncbn::sync_batch_norm_forward` on one device's tensors: the forward's steps (no autograd).
template <const StepKernels& K>
ForwardOutputs forward_kernel(SYNCBN_LAYER_ARGS) {
  // The input's device for the whole call, hand-off included: a kernel, a collective or a queued
  // flag's copy on another current device would use that device's stream.
  const c10::DeviceGuard guard(input.device());
  check_layer_input(input, num_features, weight, running_mean);  // the call's one input check
  const State state{running_mean, running_var, num_batches_tracked, nonfinite, calls};
  const Settings s = forward_settings(SYNCBN_LAYER_PASS);
  Forward f = forward_steps(K, input, weight, bias, state, residual, s);
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

// The two operators above, called through the dispatcher (dispatch modes, fake tensors and the
// profiler see them), below autograd.
const auto& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("syncbn::sync_batch_norm_forward", "")
                             .typed<ForwardOutputs(SYNCBN_LAYER_ARGS)>();
  return op;
}

const auto& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("syncbn::sync_batch_norm_backward", "")
          .typed<Outputs(
              const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
              const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const c10::optional<c10::string_view>&, int64_t, int64_t,
              bool, int64_t, double, int64_t, bool)>();
  return op;
}

// What the backward needs besides the saved tensors (one capsule: the node's saved_data is a map
// keyed by strings, and each entry costs host time): the call's settings, its flight number.
struct SavedCall : torch::CustomClassHolder {
  Settings settings;
  int64_t flight_call = -1;
};

// The autograd node: the forward operator's call, and the backward operator's.
class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx, const at::Tensor& input, const OptTensor& weight,
      const OptTensor& bias, const OptTensor& residual, const State& st,
      const SavedCall& call, const std::function<ForwardOutputs()>& run) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->set_materialize_grads(false);
    auto [output, mean, var, info, mean_lo, invstd, grad_info, flight_call] = run();
    ctx->save_for_backward(
        {input, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()),
         residual.value_or(at::Tensor()), mean, mean_lo, invstd, grad_info});
    auto saved = c10::make_intrusive<SavedCall>(call);
    saved->flight_call = flight_call;
    ctx->saved_data["call"] = c10::IValue::make_capsule(std::move(saved));
    ctx->mark_non_differentiable({mean, var, info});
    return {output, mean, var, info};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads(7);  // one per forward argument after ctx
    const at::Tensor& dy = grad_outputs[0];
    if (!dy.defined()) return grads;  // nothing flows back through the output
    const variable_list saved = ctx->get_saved_variables();
    const auto call =
        c10::static_intrusive_pointer_cast<SavedCall>(ctx->saved_data["call"].toCapsule());
    const OptTensor weight = optional(saved[1]), bias = optional(saved[2]);
    const OptTensor residual = optional(saved[3]);
    const Settings& s = call->settings;
    const c10::optional<c10::string_view> group =
        s.group ? c10::optional<c10::string_view>(*s.group) : c10::nullopt;
    auto [grad_input, grad_weight, grad_bias, grad_residual] = backward_op().call(
        dy, saved[0], weight, bias, residual, saved[4], saved[5], saved[6], saved[7], group,
        s.world_size, s.layer_tag, s.queue_order_flags, s.merge.act, s.merge.act_param,
        call->flight_call, ctx->needs_input_grad(0));
    // needs_input_grad counts the tensors given (undefined optionals have no edge).
    const size_t weight_edge = 1, bias_edge = weight_edge + (weight ? 1 : 0);
    grads[0] = grad_input;
    if (weight && ctx->needs_input_grad(weight_edge)) grads[1] = grad_weight;
    if (bias && ctx->needs_input_grad(bias_edge)) grads[2] = grad_bias;
    grads[3] = grad_residual;
    if (at::GradMode::is_enabled()) {
      variable_list refused = refuse_double_backward({grads[0], grads[1], grads[2], grads[3]});
      std::copy(refused.begin(), refused.end(), grads.begin());
    }
    return grads;
  }
};

// `syncbn::sync_batch_norm` with autograd: the node above around the forward operator.
Outputs sync_batch_norm_autograd(SYNCBN_LAYER_ARGS) {
  // The input is checked once, by the forward operator's kernel.
  const State state{running_mean, running_var, num_batches_tracked, nonfinite, calls};
  SavedCall call;
  call.settings = forward_settings(SYNCBN_LAYER_PASS);
  const std::function<ForwardOutputs()> run = [&] {
    return forward_op().call(SYNCBN_LAYER_PASS);
  };
  variable_list out =
      SyncBatchNormFunction::apply(input, weight, bias, residual, state, call, run);
  return {out[0], out[1], out[2], out[3]};
}

// `syncbn::sync_batch_norm` below autograd (inference mode): the forward operator alone.
Outputs sync_batch_norm_below_autograd(SYNCBN_LAYER_ARGS) {
  auto outputs = forward_op().call(SYNCBN_LAYER_PASS);
  return {std::get<0>(outputs), std::get<1>(outputs), std::get<2>(outputs), std::get<3>(outputs)};
}

}  // namespace
}  // namespace syncbn::layer

// The call's tensors and its fused activation, then the layer's settings (from `group` on: the
// names Python's plan gives them, nn/sync_plan.py, which passes them in this order, read from
// this schema).
#define SYNCBN_LAYER_SCHEMA_ARGS                                                              \
  "Tensor input, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, "                    \
  "Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked, Tensor(d!)? nonfinite, "         \
  "Tensor(e!) calls, Tensor? residual, int act, float act_param, str? group, int world_size, " \
  "int layer_tag, bool reduce, float? momentum, float eps, bool unbiased, "                   \
  "bool equal_rank_weights, bool queue_order_flags, int num_features"

TORCH_LIBRARY_FRAGMENT(syncbn, m) {
  // The layer call: (output, mean, var, info) as the Python Function returns them. `group` is
  // the process group's name (None: no collective); the rest are the fused steps' (syncbn.h).
  m.def("sync_batch_norm(" SYNCBN_LAYER_SCHEMA_ARGS ") -> (Tensor, Tensor, Tensor, Tensor)");
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
