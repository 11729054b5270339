// The C++ path's layer calls inside an activation checkpoint (syncbn_lightning/nn/recompute.py):
//
//   syncbn::sync_batch_norm_kept   the forward of a checkpointed segment: syncbn::sync_batch_norm,
//                                  also returning what a recompute of the call needs (mean_lo,
//                                  invstd, grad_info, the flight recorder's call number)
//   syncbn::sync_batch_norm_again  the recompute of that call: the output again from those
//                                  statistics (syncbn::renormalize), no collective, nothing
//                                  updated or counted; the same autograd node, saving the same
//                                  tensors, so the checkpoint's backward runs the layer's backward
//                                  (its one collective) with the forward's statistics.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "layer_node.h"

namespace syncbn::layer {
namespace {

// `syncbn::sync_batch_norm_kept` with autograd: the layer's node around the forward operator, with
// the forward's every output.
ForwardOutputs kept_autograd(SYNCBN_LAYER_ARGS) {
  return forward_with_node(SYNCBN_LAYER_PASS);
}

// Below autograd (inference mode): the forward operator.
ForwardOutputs kept_below_autograd(SYNCBN_LAYER_ARGS) {
  return forward_op().call(SYNCBN_LAYER_PASS);
}

#define SYNCBN_AGAIN_ARGS                                                                    \
  const at::Tensor &input, const OptTensor &weight, const OptTensor &bias,                   \
      const OptTensor &residual, const at::Tensor &mean, const at::Tensor &mean_lo,          \
      const at::Tensor &invstd, const at::Tensor &var, const at::Tensor &info,               \
      const at::Tensor &grad_info, int64_t flight_call, int64_t act, double act_param,       \
      const c10::optional<c10::string_view>&group, int64_t world_size, int64_t layer_tag,    \
      bool queue_order_flags, int64_t num_features

const auto& renormalize_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("syncbn::renormalize", "")
          .typed<at::Tensor(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const OptTensor&, const OptTensor&, int64_t, double, const OptTensor&)>();
  return op;
}

// The recompute's output: the layer's input check, then the normalize of the kept statistics.
at::Tensor again_output(SYNCBN_AGAIN_ARGS) {
  const c10::DeviceGuard guard(input.device());
  check_layer_input(input, num_features, weight, c10::nullopt);
  return renormalize_op().call(input, mean, mean_lo, invstd, weight, bias, act, act_param, residual);
}

// `syncbn::sync_batch_norm_again` with autograd: the layer's node, whose forward is the
// recompute's output and whose saved tensors and settings are the kept call's (the statistics
// are the caller's already: only the output is returned).
at::Tensor again_autograd(SYNCBN_AGAIN_ARGS) {
  Settings settings =
      group_settings(group, world_size, layer_tag, act, act_param, queue_order_flags);
  return std::get<0>(with_node(input, weight, bias, residual, std::move(settings), [&] {
    at::Tensor output = again_output(
        input, weight, bias, residual, mean, mean_lo, invstd, var, info, grad_info, flight_call,
        act, act_param, group, world_size, layer_tag, queue_order_flags, num_features);
    return ForwardOutputs{output, mean, var, info, mean_lo, invstd, grad_info, flight_call};
  }));
}

at::Tensor again_below_autograd(SYNCBN_AGAIN_ARGS) {
  return again_output(
      input, weight, bias, residual, mean, mean_lo, invstd, var, info, grad_info, flight_call, act,
      act_param, group, world_size, layer_tag, queue_order_flags, num_features);
}

}  // namespace
}  // namespace syncbn::layer

TORCH_LIBRARY_FRAGMENT(syncbn, m) {
  // sync_batch_norm's arguments; its four outputs, then mean_lo, invstd, grad_info and the flight
  // recorder's call number (what sync_batch_norm_again takes back).
  m.def(
      "sync_batch_norm_kept(" SYNCBN_LAYER_SCHEMA_ARGS
      ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int)");
  m.def(
      "sync_batch_norm_again(Tensor input, Tensor? weight, Tensor? bias, Tensor? residual, "
      "Tensor mean, Tensor mean_lo, Tensor invstd, Tensor var, Tensor info, Tensor grad_info, "
      "int flight_call, int act, float act_param, str? group, int world_size, int layer_tag, "
      "bool queue_order_flags, int num_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(syncbn, Autograd, m) {
  m.impl("sync_batch_norm_kept", &syncbn::layer::kept_autograd);
  m.impl("sync_batch_norm_again", &syncbn::layer::again_autograd);
}

TORCH_LIBRARY_IMPL(syncbn, ADInplaceOrView, m) {
  m.impl("sync_batch_norm_kept", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(syncbn, CPU, m) {
  m.impl("sync_batch_norm_kept", &syncbn::layer::kept_below_autograd);
  m.impl("sync_batch_norm_again", &syncbn::layer::again_below_autograd);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(syncbn, CUDA, m) {
  m.impl("sync_batch_norm_kept", &syncbn::layer::kept_below_autograd);
  m.impl("sync_batch_norm_again", &syncbn::layer::again_below_autograd);
}
#endif
