// The five primitives as `syncbn::` operators, each dispatching on the input's device to the
// `_cpu` or `_cuda` twin declared in syncbn.h. Builds without CUDA (no WITH_CUDA) reject CUDA
// tensors with a message; the Python backend never sends them here in that case.
//
// Registered with the dispatcher (torch/library.h), not bound with pybind11: the extension is then
// a plain shared library that torch.ops.load_library loads, and no file includes torch/python.h,
// which took 15 of the 44 s of compiler time of the first build (the longest file by far; pybind11
// and torch's Python type casters). Python calls them as torch.ops.syncbn.<name> (ops/build.py
// gathers them, with `with_cuda`, in the object load_extension() returns).
//
// Each is registered as one kernel for every dispatch key (m.def with the function), as the pybind
// functions were: tensors on any device reach the argument checks (a meta tensor gets "must be a
// CPU tensor"), and autograd does not record them (their outputs have no grad_fn).
#include <torch/library.h>

#include "syncbn.h"
#include "check.h"

namespace syncbn {
namespace {

#ifdef WITH_CUDA
// Returns from the enclosing entry point with the CUDA twin for CUDA tensors.
#define SYNCBN_CUDA_BRANCH(tensor, call) \
  if ((tensor).is_cuda()) return call
#else
#define SYNCBN_CUDA_BRANCH(tensor, call) reject_cuda(tensor)

void reject_cuda(const at::Tensor& t) {
  SYNCBN_CHECK(
      !t.is_cuda(),
      "syncbn: this build of the extension has no CUDA kernels; use SYNCBN_IMPL=ref for CUDA "
      "tensors");
}
#endif

std::tuple<at::Tensor, at::Tensor> local_stats(const at::Tensor& input) {
  SYNCBN_CUDA_BRANCH(input, local_stats_cuda(input));
  return local_stats_cpu(input);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_stats(
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s, double eps,
    bool unbiased) {
  SYNCBN_CUDA_BRANCH(means, merge_stats_cuda(counts, means, m2s, eps, unbiased));
  return merge_stats_cpu(counts, means, m2s, eps, unbiased);
}

at::Tensor normalize(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias) {
  SYNCBN_CUDA_BRANCH(input, normalize_cuda(input, mean, invstd, weight, bias));
  return normalize_cpu(input, mean, invstd, weight, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_reduce(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, bool weight_grad,
    bool bias_grad) {
  SYNCBN_CUDA_BRANCH(input, backward_reduce_cuda(grad_out, input, mean, invstd, weight, weight_grad, bias_grad));
  return backward_reduce_cpu(grad_out, input, mean, invstd, weight, weight_grad, bias_grad);
}

at::Tensor backward_elemt(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
    const at::Tensor& sum_dy_xmu, const at::Tensor& count) {
  SYNCBN_CUDA_BRANCH(input, backward_elemt_cuda(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count));
  return backward_elemt_cpu(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count);
}

}  // namespace
}  // namespace syncbn

TORCH_LIBRARY_FRAGMENT(syncbn, m) {
  // Per-channel (mean, m2) of the local batch.
  m.def("local_stats(Tensor input) -> (Tensor, Tensor)", &syncbn::local_stats);
  // Count-weighted merge of per-rank stats -> (mean, invstd, running var).
  m.def(
      "merge_stats(Tensor counts, Tensor means, Tensor m2s, float eps, bool unbiased) "
      "-> (Tensor, Tensor, Tensor)",
      &syncbn::merge_stats);
  // (x - mean) * invstd * weight + bias.
  m.def(
      "normalize(Tensor input, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias) "
      "-> Tensor",
      &syncbn::normalize);
  // Local (sum_dy, sum_dy_xmu, grad_weight, grad_bias); skipped grads are None.
  m.def(
      "backward_reduce(Tensor grad_out, Tensor input, Tensor mean, Tensor invstd, Tensor? weight, "
      "bool weight_grad, bool bias_grad) -> (Tensor, Tensor, Tensor, Tensor)",
      &syncbn::backward_reduce);
  // Input gradient from group-wide sums.
  m.def(
      "backward_elemt(Tensor grad_out, Tensor input, Tensor mean, Tensor invstd, Tensor? weight, "
      "Tensor sum_dy, Tensor sum_dy_xmu, Tensor count) -> Tensor",
      &syncbn::backward_elemt);
}
