// The `syncbn::` PyTorch operators: one per step of a synchronized layer call (see syncbn.h), with
// CPU and CUDA kernels. Being dispatcher operators, they are traced whole by torch.compile (their
// fake implementations are in syncbn_lightning/ops/fakes.py), captured by CUDA graphs and counted
// by profilers like any aten op. They are not differentiable on their own: the layer's
// derivative, collectives included, is one autograd.Function
// (syncbn_lightning/functional/function.py).
#include <torch/library.h>

#include "syncbn.h"

TORCH_LIBRARY(syncbn, m) {
  // Fake (meta) implementations live in this Python module; torch imports it when it needs them.
  m.set_python_module("syncbn_lightning.ops.fakes");
  m.def("stats_row(Tensor input, int layer_tag, Tensor(a!) calls) -> Tensor");
  m.def(
      "merge_normalize(Tensor input, Tensor rows, Tensor? weight, Tensor? bias, "
      "Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked, "
      "Tensor(d!)? nonfinite, float? momentum, float eps, bool unbiased, int act=0, "
      "float act_param=0., bool equal_rank_weights=False, Tensor? residual=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "reduce_sums(Tensor input, Tensor? shift, int layer_tag, Tensor(a!) calls, "
      "bool equal_rank_weights) -> Tensor");
  m.def(
      "reduce_merge_normalize(Tensor input, Tensor total, Tensor sent, Tensor? weight, "
      "Tensor? bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
      "Tensor(c!)? num_batches_tracked, Tensor(d!)? nonfinite, float? momentum, float eps, "
      "bool unbiased, bool equal_rank_weights, int world_size, int act=0, float act_param=0., "
      "Tensor? residual=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The output of a merge again from its statistics (a checkpoint's recompute; syncbn.h).
  m.def(
      "renormalize(Tensor input, Tensor mean, Tensor mean_lo, Tensor invstd, Tensor? weight, "
      "Tensor? bias, int act=0, float act_param=0., Tensor? residual=None) -> Tensor");
  // `act` (activation.h; 0 = none) and `act_param` are the activation fused after the affine
  // step; its backward recomputes the pre-activation from the input, so it needs the bias.
  // `mean_lo`: the low part of the split group mean (both merges return it).
  // `info` (grad_sums) is the merge's grad_info, whose tags head the sums; grad_input checks them
  // over the `world_size` ranks of an all-reduced row (gathered rows: their number) and returns
  // the check's flag beside the gradient.
  m.def(
      "grad_sums(Tensor grad_out, Tensor input, Tensor mean, Tensor invstd, Tensor? weight, "
      "Tensor? bias=None, int act=0, float act_param=0., Tensor? mean_lo=None, "
      "Tensor? info=None) -> (Tensor, Tensor, Tensor)");
  // `residual`: the tensor the forward added before its activation; grad_sums_residual also
  // returns its gradient g = dy * act'(z + residual), which grad_input then takes as grad_out
  // with act = 0.
  m.def(
      "grad_sums_residual(Tensor grad_out, Tensor input, Tensor mean, Tensor invstd, "
      "Tensor? weight, Tensor? bias, Tensor residual, int act=0, float act_param=0., "
      "Tensor? mean_lo=None, Tensor? info=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "grad_input(Tensor grad_out, Tensor input, Tensor mean, Tensor invstd, Tensor? weight, "
      "Tensor sums, Tensor info, Tensor? bias=None, int act=0, float act_param=0., "
      "Tensor? mean_lo=None, int world_size=1) -> (Tensor, Tensor)");
}

namespace {
// Every operator, and those that mutate an argument (the call counter, the running statistics).
constexpr const char* kOperators[] = {
    "stats_row", "merge_normalize", "reduce_sums", "reduce_merge_normalize", "renormalize",
    "grad_sums", "grad_sums_residual", "grad_input"};
constexpr const char* kMutating[] = {
    "stats_row", "merge_normalize", "reduce_sums", "reduce_merge_normalize"};

using OptTensor = c10::optional<at::Tensor>;

// The operators' positional arguments (their schemas above) as the steps' structs (syncbn.h),
// for the twin `Fn` (CPU or CUDA).
template <syncbn::MergeNormalizeFn* Fn>
syncbn::MergedOutputs merge_normalize(
    const at::Tensor& input, const at::Tensor& rows, const OptTensor& weight,
    const OptTensor& bias, const OptTensor& running_mean, const OptTensor& running_var,
    const OptTensor& num_batches_tracked, const OptTensor& nonfinite,
    c10::optional<double> momentum, double eps, bool unbiased, int64_t act, double act_param,
    bool equal_rank_weights, const OptTensor& residual) {
  return Fn(
      {input, weight, bias, {running_mean, running_var, num_batches_tracked, nonfinite},
       {momentum, eps, unbiased, equal_rank_weights, act, act_param}, residual},
      rows);
}

template <syncbn::ReduceMergeNormalizeFn* Fn>
syncbn::MergedOutputs reduce_merge_normalize(
    const at::Tensor& input, const at::Tensor& total, const at::Tensor& sent,
    const OptTensor& weight, const OptTensor& bias, const OptTensor& running_mean,
    const OptTensor& running_var, const OptTensor& num_batches_tracked,
    const OptTensor& nonfinite, c10::optional<double> momentum, double eps, bool unbiased,
    bool equal_rank_weights, int64_t world_size, int64_t act, double act_param,
    const OptTensor& residual) {
  return Fn(
      {input, weight, bias, {running_mean, running_var, num_batches_tracked, nonfinite},
       {momentum, eps, unbiased, equal_rank_weights, act, act_param}, residual},
      total, sent, world_size);
}

template <syncbn::RenormalizeFn* Fn>
at::Tensor renormalize(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& mean_lo,
    const at::Tensor& invstd, const OptTensor& weight, const OptTensor& bias, int64_t act,
    double act_param, const OptTensor& residual) {
  syncbn::MergeArgs args{input, weight, bias, {}, {}, residual};
  args.settings.act = act;
  args.settings.act_param = act_param;
  return Fn(args, mean, mean_lo, invstd);
}

template <syncbn::GradSumsFn* Fn>
std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_sums(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const OptTensor& weight, const OptTensor& bias, int64_t act,
    double act_param, const OptTensor& mean_lo, const OptTensor& info) {
  return Fn({grad_out, input, mean, invstd, weight, bias, act, act_param, mean_lo, info});
}

template <syncbn::GradSumsResidualFn* Fn>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> grad_sums_residual(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const OptTensor& weight, const OptTensor& bias,
    const at::Tensor& residual, int64_t act, double act_param, const OptTensor& mean_lo,
    const OptTensor& info) {
  return Fn({grad_out, input, mean, invstd, weight, bias, act, act_param, mean_lo, info}, residual);
}

template <syncbn::GradInputFn* Fn>
std::tuple<at::Tensor, at::Tensor> grad_input(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const OptTensor& weight, const at::Tensor& sums,
    const at::Tensor& info, const OptTensor& bias, int64_t act, double act_param,
    const OptTensor& mean_lo, int64_t world_size) {
  return Fn(
      {grad_out, input, mean, invstd, weight, bias, act, act_param, mean_lo, info}, sums,
      world_size);
}
}  // namespace

TORCH_LIBRARY_IMPL(syncbn, CPU, m) {
  m.impl("stats_row", &syncbn::stats_row_cpu);
  m.impl("merge_normalize", &merge_normalize<syncbn::merge_normalize_cpu>);
  m.impl("reduce_sums", &syncbn::reduce_sums_cpu);
  m.impl("reduce_merge_normalize", &reduce_merge_normalize<syncbn::reduce_merge_normalize_cpu>);
  m.impl("renormalize", &renormalize<syncbn::renormalize_cpu>);
  m.impl("grad_sums", &grad_sums<syncbn::grad_sums_cpu>);
  m.impl("grad_sums_residual", &grad_sums_residual<syncbn::grad_sums_residual_cpu>);
  m.impl("grad_input", &grad_input<syncbn::grad_input_cpu>);
}

// Autograd: the steps are not differentiable on their own (the Function above them is), so the
// autograd key falls through: no per-call bookkeeping of the generic "not implemented" fallback,
// which cost each call a few microseconds of host time. ADInplaceOrView likewise: the tensors they
// mutate (call counter, running statistics) are never saved for a backward.
TORCH_LIBRARY_IMPL(syncbn, Autograd, m) {
  for (const char* name : kOperators) {
    m.impl(name, torch::CppFunction::makeFallthrough());
  }
}

TORCH_LIBRARY_IMPL(syncbn, ADInplaceOrView, m) {
  for (const char* name : kMutating) {
    m.impl(name, torch::CppFunction::makeFallthrough());
  }
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(syncbn, CUDA, m) {
  m.impl("stats_row", &syncbn::stats_row_cuda);
  m.impl("merge_normalize", &merge_normalize<syncbn::merge_normalize_cuda>);
  m.impl("reduce_sums", &syncbn::reduce_sums_cuda);
  m.impl("reduce_merge_normalize", &reduce_merge_normalize<syncbn::reduce_merge_normalize_cuda>);
  m.impl("renormalize", &renormalize<syncbn::renormalize_cuda>);
  m.impl("grad_sums", &grad_sums<syncbn::grad_sums_cuda>);
  m.impl("grad_sums_residual", &grad_sums_residual<syncbn::grad_sums_residual_cuda>);
  m.impl("grad_input", &grad_input<syncbn::grad_input_cuda>);
}
#endif
