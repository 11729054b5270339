// Python bindings: one entry per primitive, dispatching on the input's device to the `_cpu` or
// `_cuda` twin declared in syncbn.h. Builds without CUDA (no WITH_CUDA) reject CUDA tensors with
// a message; the Python backend never sends them here in that case.
//
// torch/python.h (pybind11 and torch's type casters) rather than torch/extension.h, which adds the
// whole C++ frontend (torch/all.h) unused here: a third of this file's compile time, the longest of
// the extension's first build.
#include <torch/python.h>

#include "syncbn.h"

namespace syncbn {
namespace {

#ifdef WITH_CUDA
constexpr bool kWithCuda = true;
// Returns from the enclosing entry point with the CUDA twin for CUDA tensors.
#define SYNCBN_CUDA_BRANCH(tensor, call) \
  if ((tensor).is_cuda()) return call
#else
constexpr bool kWithCuda = false;
#define SYNCBN_CUDA_BRANCH(tensor, call) reject_cuda(tensor)

void reject_cuda(const at::Tensor& t) {
  TORCH_CHECK(
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "syncbn_lightning kernels: Welford statistics, merge, normalize, backward";
  m.attr("with_cuda") = syncbn::kWithCuda;
  m.def("local_stats", &syncbn::local_stats, "Per-channel (mean, m2) of the local batch",
        py::arg("input"));
  m.def("merge_stats", &syncbn::merge_stats,
        "Count-weighted merge of per-rank stats -> (mean, invstd, running var)", py::arg("counts"),
        py::arg("means"), py::arg("m2s"), py::arg("eps"), py::arg("unbiased"));
  m.def("normalize", &syncbn::normalize, "(x - mean) * invstd * weight + bias", py::arg("input"),
        py::arg("mean"), py::arg("invstd"), py::arg("weight"), py::arg("bias"));
  m.def("backward_reduce", &syncbn::backward_reduce,
        "Local (sum_dy, sum_dy_xmu, grad_weight, grad_bias)", py::arg("grad_out"),
        py::arg("input"), py::arg("mean"), py::arg("invstd"), py::arg("weight"),
        py::arg("weight_grad"), py::arg("bias_grad"));
  m.def("backward_elemt", &syncbn::backward_elemt, "Input gradient from group-wide sums",
        py::arg("grad_out"), py::arg("input"), py::arg("mean"), py::arg("invstd"),
        py::arg("weight"), py::arg("sum_dy"), py::arg("sum_dy_xmu"), py::arg("count"));
}
