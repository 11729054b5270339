// The C++ path's autograd node and what its operators share (layer.cpp: a layer call;
// recompute.cpp: the calls of an activation checkpoint): the layer operator's argument list, the
// settings made from it, the forward and backward operators as the dispatcher calls them, and the
// node, whose forward runs a given function and whose backward is the layer's (the gradient sums,
// their collective, the input gradient). Every operator that makes this node saves the same
// tensors in the same order, which a checkpoint's recompute relies on.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include <functional>
#include <string>
#include <tuple>

#include "layer.h"
#include "torch_compat.h"

namespace syncbn::layer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = c10::optional<at::Tensor>;

OptTensor optional(const at::Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }

using compat::refuse_double_backward;

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

// The arguments of `sync_batch_norm`, `sync_batch_norm_forward` and `sync_batch_norm_kept`,
// listed once: NEXT(C++ type, name, schema type) each, the first through FIRST. The call's
// tensors and its fused activation, then (from `group` on) the layer's settings, which Python
// builds by name once per plan and passes in the schema's order, read from the schema
// (nn/sync_plan.py); forward_settings gathers them into one Settings. The kernels' parameter
// lists (SYNCBN_LAYER_ARGS), the calls that pass them on (SYNCBN_LAYER_PASS) and the schema
// (SYNCBN_LAYER_SCHEMA_ARGS) are made from this one list, so they cannot disagree. Macros, not a
// struct: the dispatcher's unboxed kernels take the schema's arguments one by one.
#define SYNCBN_LAYER_ARGUMENTS(FIRST, NEXT)                       \
  FIRST(const at::Tensor&, input, "Tensor")                       \
  NEXT(const OptTensor&, weight, "Tensor?")                       \
  NEXT(const OptTensor&, bias, "Tensor?")                         \
  NEXT(const OptTensor&, running_mean, "Tensor(a!)?")             \
  NEXT(const OptTensor&, running_var, "Tensor(b!)?")              \
  NEXT(const OptTensor&, num_batches_tracked, "Tensor(c!)?")      \
  NEXT(const OptTensor&, nonfinite, "Tensor(d!)?")                \
  NEXT(const at::Tensor&, calls, "Tensor(e!)")                    \
  NEXT(const OptTensor&, residual, "Tensor?")                     \
  NEXT(int64_t, act, "int")                                       \
  NEXT(double, act_param, "float")                                \
  NEXT(const c10::optional<c10::string_view>&, group, "str?")     \
  NEXT(int64_t, world_size, "int")                                \
  NEXT(int64_t, layer_tag, "int")                                 \
  NEXT(bool, reduce, "bool")                                      \
  NEXT(c10::optional<double>, momentum, "float?")                 \
  NEXT(double, eps, "float")                                      \
  NEXT(bool, unbiased, "bool")                                    \
  NEXT(bool, equal_rank_weights, "bool")                          \
  NEXT(bool, queue_order_flags, "bool")                           \
  NEXT(int64_t, num_features, "int")

#define SYNCBN_ARG_DECL_FIRST(type, name, schema) type name
#define SYNCBN_ARG_DECL_NEXT(type, name, schema) , type name
#define SYNCBN_ARG_NAME_FIRST(type, name, schema) name
#define SYNCBN_ARG_NAME_NEXT(type, name, schema) , name
#define SYNCBN_ARG_SCHEMA_FIRST(type, name, schema) schema " " #name
#define SYNCBN_ARG_SCHEMA_NEXT(type, name, schema) ", " schema " " #name

#define SYNCBN_LAYER_ARGS SYNCBN_LAYER_ARGUMENTS(SYNCBN_ARG_DECL_FIRST, SYNCBN_ARG_DECL_NEXT)
#define SYNCBN_LAYER_PASS SYNCBN_LAYER_ARGUMENTS(SYNCBN_ARG_NAME_FIRST, SYNCBN_ARG_NAME_NEXT)
#define SYNCBN_LAYER_SCHEMA_ARGS \
  SYNCBN_LAYER_ARGUMENTS(SYNCBN_ARG_SCHEMA_FIRST, SYNCBN_ARG_SCHEMA_NEXT)

Settings forward_settings(SYNCBN_LAYER_ARGS) {
  Settings s = group_settings(group, world_size, layer_tag, act, act_param, queue_order_flags);
  s.reduce = reduce;
  s.merge.momentum = momentum;
  s.merge.eps = eps;
  s.merge.unbiased = unbiased;
  s.merge.equal_rank_weights = equal_rank_weights;
  return s;
}

// The forward and backward operators (layer.cpp), called through the dispatcher (dispatch modes,
// fake tensors and the profiler see them), below autograd.
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

}  // namespace
}  // namespace syncbn::layer
