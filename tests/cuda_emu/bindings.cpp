// Python bindings of the emulation extension: the CUDA entry points of csrc/*.cu (five primitives,
// six fused steps) on CPU tensors, the call-order flag ring with the CUDA flag store, the
// emulator's controls, and its self-test kernels. Every entry
// point runs with heap poisoning on, so an output element a kernel never writes reads as NaN.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "simt_control.h"
#include "syncbn.h"

namespace simt_selftest {
at::Tensor run(
    const std::string& name, const at::Tensor& x, const std::vector<int64_t>& grid,
    const std::vector<int64_t>& block, int64_t shared_bytes, int64_t arg, int64_t out_numel);
}

namespace order_ring_probe {  // order_ring_probe.cpp
void reset(int64_t capacity);
bool push(const at::Tensor& flags, int64_t index, int64_t layer_tag, int64_t device);
int64_t poll();
int64_t drain();
std::vector<int64_t> queued_tags();
bool capturing(int64_t device);
bool has_store_for_queueing(int64_t device);
}  // namespace order_ring_probe

namespace {

struct PoisonScope {
  PoisonScope() { simt::poison_allocations(true); }
  ~PoisonScope() { simt::poison_allocations(false); }
  PoisonScope(const PoisonScope&) = delete;
  PoisonScope& operator=(const PoisonScope&) = delete;
};

std::tuple<at::Tensor, at::Tensor> local_stats(const at::Tensor& input) {
  const PoisonScope poison;
  return syncbn::local_stats_cuda(input);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_stats(
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s, double eps,
    bool unbiased) {
  const PoisonScope poison;
  return syncbn::merge_stats_cuda(counts, means, m2s, eps, unbiased);
}

at::Tensor normalize(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias) {
  const PoisonScope poison;
  return syncbn::normalize_cuda(input, mean, invstd, weight, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_reduce(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, bool weight_grad,
    bool bias_grad) {
  const PoisonScope poison;
  return syncbn::backward_reduce_cuda(
      grad_out, input, mean, invstd, weight, weight_grad, bias_grad);
}

at::Tensor backward_elemt(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
    const at::Tensor& sum_dy_xmu, const at::Tensor& count) {
  const PoisonScope poison;
  return syncbn::backward_elemt_cuda(
      grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count);
}

at::Tensor stats_row(const at::Tensor& input, int64_t layer_tag, const at::Tensor& calls) {
  const PoisonScope poison;
  return syncbn::stats_row_cuda(input, layer_tag, calls);
}

syncbn::MergedOutputs merge_normalize(
    const at::Tensor& input, const at::Tensor& rows, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& running_mean,
    const c10::optional<at::Tensor>& running_var,
    const c10::optional<at::Tensor>& num_batches_tracked,
    const c10::optional<at::Tensor>& nonfinite, c10::optional<double> momentum, double eps,
    bool unbiased, int64_t act, double act_param, bool equal_rank_weights,
    const c10::optional<at::Tensor>& residual) {
  const PoisonScope poison;
  return syncbn::merge_normalize_cuda(
      {input, weight, bias, {running_mean, running_var, num_batches_tracked, nonfinite},
       {momentum, eps, unbiased, equal_rank_weights, act, act_param}, residual},
      rows);
}

at::Tensor renormalize(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& mean_lo,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, int64_t act, double act_param,
    const c10::optional<at::Tensor>& residual) {
  const PoisonScope poison;
  syncbn::MergeArgs args{input, weight, bias, {}, {}, residual};
  args.settings.act = act;
  args.settings.act_param = act_param;
  return syncbn::renormalize_cuda(args, mean, mean_lo, invstd);
}

at::Tensor reduce_sums(
    const at::Tensor& input, const c10::optional<at::Tensor>& shift, int64_t layer_tag,
    const at::Tensor& calls, bool equal_rank_weights) {
  const PoisonScope poison;
  return syncbn::reduce_sums_cuda(input, shift, layer_tag, calls, equal_rank_weights);
}

syncbn::MergedOutputs reduce_merge_normalize(
    const at::Tensor& input, const at::Tensor& total, const at::Tensor& sent,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& running_mean, const c10::optional<at::Tensor>& running_var,
    const c10::optional<at::Tensor>& num_batches_tracked,
    const c10::optional<at::Tensor>& nonfinite, c10::optional<double> momentum, double eps,
    bool unbiased, bool equal_rank_weights, int64_t world_size, int64_t act, double act_param,
    const c10::optional<at::Tensor>& residual) {
  const PoisonScope poison;
  return syncbn::reduce_merge_normalize_cuda(
      {input, weight, bias, {running_mean, running_var, num_batches_tracked, nonfinite},
       {momentum, eps, unbiased, equal_rank_weights, act, act_param}, residual},
      total, sent, world_size);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_sums(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, int64_t act, double act_param,
    const c10::optional<at::Tensor>& mean_lo, const c10::optional<at::Tensor>& info) {
  const PoisonScope poison;
  return syncbn::grad_sums_cuda({grad_out, input, mean, invstd, weight, bias, act, act_param, mean_lo, info});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> grad_sums_residual(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const at::Tensor& residual, int64_t act,
    double act_param, const c10::optional<at::Tensor>& mean_lo,
    const c10::optional<at::Tensor>& info) {
  const PoisonScope poison;
  return syncbn::grad_sums_residual_cuda(
      {grad_out, input, mean, invstd, weight, bias, act, act_param, mean_lo, info}, residual);
}

std::tuple<at::Tensor, at::Tensor> grad_input(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sums,
    const at::Tensor& info, const c10::optional<at::Tensor>& bias, int64_t act, double act_param,
    const c10::optional<at::Tensor>& mean_lo, int64_t world_size) {
  const PoisonScope poison;
  return syncbn::grad_input_cuda(
      {grad_out, input, mean, invstd, weight, bias, act, act_param, mean_lo, info}, sums,
      world_size);
}

void set_schedule(const std::string& order, uint64_t seed) {
  simt::Order o;
  if (order == "forward") {
    o = simt::Order::kForward;
  } else if (order == "reverse") {
    o = simt::Order::kReverse;
  } else if (order == "random") {
    o = simt::Order::kRandom;
  } else {
    TORCH_CHECK(false, "set_schedule: `order` must be 'forward', 'reverse' or 'random', got '",
                order, "'");
  }
  simt::set_schedule(o, seed);
}

py::list take_launches() {
  py::list out;
  for (const auto& r : simt::take_launches()) {
    py::dict d;
    d["kernel"] = r.kernel;
    d["site"] = r.site;
    d["function"] = r.function;
    d["grid"] = py::make_tuple(r.grid_x, r.grid_y, r.grid_z);
    d["block"] = py::make_tuple(r.block_x, r.block_y, r.block_z);
    d["shared_bytes"] = r.shared_bytes;
    out.append(d);
  }
  return out;
}

py::dict take_stats() {
  const simt::Stats s = simt::take_stats();
  py::dict d;
  d["launches"] = s.launches;
  d["blocks"] = s.blocks;
  d["threads"] = s.threads;
  d["switches"] = s.switches;
  d["warp_ops"] = s.warp_ops;
  d["barriers"] = s.barriers;
  return d;
}

at::Tensor poisoned_empty(int64_t numel) {
  const PoisonScope poison;
  return at::empty({numel}, at::kFloat);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "csrc/*.cu kernels on CPU tensors under SIMT emulation (tests only)";
#if defined(__SANITIZE_ADDRESS__)
  m.attr("asan") = true;
#else
  m.attr("asan") = false;
#endif
  m.def("local_stats", &local_stats, py::arg("input"));
  m.def("merge_stats", &merge_stats, py::arg("counts"), py::arg("means"), py::arg("m2s"),
        py::arg("eps"), py::arg("unbiased"));
  m.def("normalize", &normalize, py::arg("input"), py::arg("mean"), py::arg("invstd"),
        py::arg("weight"), py::arg("bias"));
  m.def("backward_reduce", &backward_reduce, py::arg("grad_out"), py::arg("input"),
        py::arg("mean"), py::arg("invstd"), py::arg("weight"), py::arg("weight_grad"),
        py::arg("bias_grad"));
  m.def("backward_elemt", &backward_elemt, py::arg("grad_out"), py::arg("input"),
        py::arg("mean"), py::arg("invstd"), py::arg("weight"), py::arg("sum_dy"),
        py::arg("sum_dy_xmu"), py::arg("count"));
  // The fused steps (csrc/entry_cuda.cu), same arguments as the syncbn:: operators.
  m.def("stats_row", &stats_row, py::arg("input"), py::arg("layer_tag"), py::arg("calls"));
  m.def("merge_normalize", &merge_normalize, py::arg("input"), py::arg("rows"),
        py::arg("weight"), py::arg("bias"), py::arg("running_mean"), py::arg("running_var"),
        py::arg("num_batches_tracked"), py::arg("nonfinite"), py::arg("momentum"),
        py::arg("eps"), py::arg("unbiased"), py::arg("act") = 0, py::arg("act_param") = 0.0,
        py::arg("equal_rank_weights") = false, py::arg("residual") = py::none());
  m.def("renormalize", &renormalize, py::arg("input"), py::arg("mean"), py::arg("mean_lo"),
        py::arg("invstd"), py::arg("weight"), py::arg("bias"), py::arg("act") = 0,
        py::arg("act_param") = 0.0, py::arg("residual") = py::none());
  m.def("reduce_sums", &reduce_sums, py::arg("input"), py::arg("shift"), py::arg("layer_tag"),
        py::arg("calls"), py::arg("equal_rank_weights"));
  m.def("reduce_merge_normalize", &reduce_merge_normalize, py::arg("input"), py::arg("total"),
        py::arg("sent"), py::arg("weight"), py::arg("bias"), py::arg("running_mean"),
        py::arg("running_var"), py::arg("num_batches_tracked"), py::arg("nonfinite"),
        py::arg("momentum"), py::arg("eps"), py::arg("unbiased"), py::arg("equal_rank_weights"),
        py::arg("world_size"), py::arg("act") = 0, py::arg("act_param") = 0.0,
        py::arg("residual") = py::none());
  m.def("grad_sums", &grad_sums, py::arg("grad_out"), py::arg("input"), py::arg("mean"),
        py::arg("invstd"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("act") = 0,
        py::arg("act_param") = 0.0, py::arg("mean_lo") = py::none(),
        py::arg("info") = py::none());
  m.def("grad_sums_residual", &grad_sums_residual, py::arg("grad_out"), py::arg("input"),
        py::arg("mean"), py::arg("invstd"), py::arg("weight"), py::arg("bias"),
        py::arg("residual"), py::arg("act") = 0, py::arg("act_param") = 0.0,
        py::arg("mean_lo") = py::none(), py::arg("info") = py::none());
  m.def("grad_input", &grad_input, py::arg("grad_out"), py::arg("input"), py::arg("mean"),
        py::arg("invstd"), py::arg("weight"), py::arg("sums"), py::arg("info"),
        py::arg("bias") = py::none(), py::arg("act") = 0, py::arg("act_param") = 0.0,
        py::arg("mean_lo") = py::none(), py::arg("world_size") = 1);
  m.def("set_schedule", &set_schedule, "Thread and block order: forward, reverse or random",
        py::arg("order"), py::arg("seed") = 0);
  m.def("take_diagnostics", &simt::take_diagnostics, "Diagnostics since the last call");
  m.def("take_launches", &take_launches, "Launches since the last call");
  m.def("take_stats", &take_stats, "Counters since the last call");
  m.def("poisoned_empty", &poisoned_empty, "at::empty under the entry points' heap poisoning",
        py::arg("numel"));
  // The C++ path's call-order ring with the CUDA flag store (order_ring_probe.cpp): layer tags
  // stand for the queued flags; poll and drain return the failed flag's tag, else -1.
  m.def("order_ring_reset", &order_ring_probe::reset, py::arg("capacity"));
  m.def("order_ring_push", &order_ring_probe::push, py::arg("flags"), py::arg("index"),
        py::arg("layer_tag"), py::arg("device") = 0);
  m.def("order_ring_poll", &order_ring_probe::poll);
  m.def("order_ring_drain", &order_ring_probe::drain);
  m.def("order_ring_queued", &order_ring_probe::queued_tags);
  m.def("order_ring_capturing", &order_ring_probe::capturing, py::arg("device") = 0);
  m.def("order_ring_store_for_queueing", &order_ring_probe::has_store_for_queueing,
        py::arg("device"));
  m.def("hold_device", &simt::hold_device, py::arg("held"));
  m.def("release_device", &simt::release_device);
  m.def("set_capturing", &simt::set_capturing, py::arg("capturing"));
  m.def("take_stream_devices", &simt::take_stream_devices);
  m.def("selftest", &simt_selftest::run, "Run one of the emulator's self-test kernels",
        py::arg("name"), py::arg("x"), py::arg("grid"), py::arg("block"),
        py::arg("shared_bytes"), py::arg("arg"), py::arg("out_numel"));
}
