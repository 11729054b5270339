// The C++ path's autograd node and what the layer operator needs to make it (layer.cpp): the
// operator's argument list, the settings made from it, the forward and backward operators as the
// dispatcher calls them, and the node (with_node makes it around the forward), whose backward is
// the layer's (the gradient sums, their collective, the input gradient). A checkpoint's recompute
// makes the same node, saving the same tensors, from what its forward kept.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <mutex>
#include <string>
#include <tuple>

#include "layer.h"
#include "check.h"
#include "torch_compat.h"

namespace syncbn::layer {
namespace {

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
  SYNCBN_CHECK(world_size >= 1, "syncbn: sync_batch_norm: `world_size` must be >= 1");
  Settings s;
  if (group.has_value()) s.group = std::string(*group);
  s.world_size = world_size;
  s.layer_tag = layer_tag;
  s.queue_order_flags = queue_order_flags;
  s.merge.act = act;
  s.merge.act_param = act_param;
  return s;
}

// The arguments of `sync_batch_norm` and `sync_batch_norm_forward`, listed once: NEXT(C++ type,
// name, schema type) each, the first through FIRST. The call's tensors, its fused activation and
// what kind of call it is (`kept`, `kept_call`: a checkpoint's recompute from what its forward
// kept; `keep`: a checkpointed forward, which returns that), the step's earlier statistics
// (`prior`: inside step_statistics(normalize="step"), merged into this call's and overwritten with
// the result; none otherwise), then (from `group` on) the layer's settings, which Python builds by
// name once per plan and passes in the schema's order, read from the schema
// (functional/layer_call.py); forward_settings gathers them into one Settings. The kernels' parameter
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
  NEXT(const OptTensor&, kept, "Tensor?")                         \
  NEXT(int64_t, kept_call, "int")                                 \
  NEXT(bool, keep, "bool")                                        \
  NEXT(const OptTensor&, prior, "Tensor(f!)?")                    \
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

// The layer's autograd node, made as torch's own operators make theirs: the saved tensors are
// members, the four edges (input, weight, bias, residual) fixed, the one differentiable output the
// layer's output. torch::autograd::Function's node did the same through generic machinery (a
// context with a string-keyed map, output wrapping that looks for views and dirty tensors, a lock
// and a demangled type name per backward), which cost 14 us of host time per forward and
// backward on the CPU, a fifth of a small layer's step (benchmarks/RESULTS.md, "Host cost of one
// layer: the C++ path's own autograd node").
struct SyncBatchNormBackward final : torch::autograd::Node {
  // The forward's input, parameters and residual (undefined where not given), then its statistics.
  torch::autograd::SavedVariable input, weight, bias, residual, mean, mean_lo, invstd, grad_info;
  Settings settings;        // the call's (its group, size, tag and activation)
  int64_t flight_call = -1; // the forward's flight-recorder call number

  std::string name() const override { return "syncbn::SyncBatchNormBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* v : {&input, &weight, &bias, &residual, &mean, &mean_lo, &invstd, &grad_info}) {
      v->reset_data();
    }
  }

  variable_list apply(variable_list&& grad_outputs) override {
    std::lock_guard<std::mutex> lock(mutex_);
    variable_list grads(4);  // one per edge
    const at::Tensor& dy = grad_outputs[0];
    if (!dy.defined()) return grads;  // nothing flows back through the output
    const at::Tensor x = input.unpack(), w = weight.unpack(), b = bias.unpack();
    const at::Tensor r = residual.unpack();
    const Settings& s = settings;
    const c10::optional<c10::string_view> group =
        s.group ? c10::optional<c10::string_view>(*s.group) : c10::nullopt;
    auto [grad_input, grad_weight, grad_bias, grad_residual] = backward_op().call(
        dy, x, optional(w), optional(b), optional(r), mean.unpack(), mean_lo.unpack(),
        invstd.unpack(), grad_info.unpack(), group, s.world_size, s.layer_tag,
        s.queue_order_flags, s.merge.act, s.merge.act_param, flight_call,
        should_compute_output(0));
    if (should_compute_output(0)) grads[0] = grad_input;
    if (w.defined() && should_compute_output(1)) grads[1] = grad_weight;
    if (b.defined() && should_compute_output(2)) grads[2] = grad_bias;
    if (r.defined() && should_compute_output(3)) grads[3] = grad_residual;
    if (at::GradMode::is_enabled()) grads = refuse_double_backward(std::move(grads));
    return grads;
  }
};

// A layer call under autograd: `run()` (the forward operator, or the recompute's output) below
// autograd; when grad mode is on and an input requires a gradient, the node, with the call's
// output as its output and what its backward needs saved. The statistics are not differentiable
// (they have no history). Forward-mode AD is refused, as torch::autograd::Function refuses it.
template <class Run>
ForwardOutputs with_node(
    const at::Tensor& input, const OptTensor& weight, const OptTensor& bias,
    const OptTensor& residual, Settings settings, Run&& run) {
  using torch::autograd::isFwGradDefined;
  SYNCBN_CHECK(
      !(isFwGradDefined(input) || isFwGradDefined(weight) || isFwGradDefined(bias) ||
        isFwGradDefined(residual)),
      "syncbn: SyncBatchNorm has no forward-mode derivative (torch.autograd.forward_ad): "
      "compute the gradient with backward(), or use torch.nn.BatchNorm2d for a jvp");
  const bool record = torch::autograd::compute_requires_grad(input, weight, bias, residual);
  ForwardOutputs out;
  {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::AutoGradMode grad_off(false);  // as torch::autograd::Function ran its forward
    out = run();
  }
  if (!record) return out;
  auto node = compat::make_node<SyncBatchNormBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias, residual));
  torch::autograd::set_history(std::get<0>(out), node);
  using torch::autograd::SavedVariable;
  node->input = SavedVariable(input, false);
  node->weight = SavedVariable(weight, false);
  node->bias = SavedVariable(bias, false);
  node->residual = SavedVariable(residual, false);
  node->mean = SavedVariable(std::get<1>(out), false);
  node->mean_lo = SavedVariable(std::get<4>(out), false);
  node->invstd = SavedVariable(std::get<5>(out), false);
  node->grad_info = SavedVariable(std::get<6>(out), false);
  node->settings = std::move(settings);
  node->flight_call = std::get<7>(out);
  return out;
}

// The forward operator under the layer's node: `sync_batch_norm` with autograd.
ForwardOutputs forward_with_node(SYNCBN_LAYER_ARGS) {
  return with_node(input, weight, bias, residual, forward_settings(SYNCBN_LAYER_PASS), [&] {
    return forward_op().call(SYNCBN_LAYER_PASS);
  });
}

}  // namespace
}  // namespace syncbn::layer
