// Host-side helpers of the fused steps' entry points, CPU and CUDA alike (declared in common.h):
// the exchanges' rows, vectors and sums, the running buffers, the merge's outputs and infos, the
// group-count check. Compiled by the host compiler only (common.cpp holds the primitives' layouts,
// argument checks and operands).
#include "common.h"

#include <ATen/ops/sum.h>

namespace syncbn {
namespace detail {

int64_t check_rows(const at::Tensor& rows, const at::Tensor& input) {
  const int64_t width = row_width(input.size(1));
  SYNCBN_CHECK(
      rows.dim() == 1 && rows.is_contiguous() && rows.numel() >= width &&
          rows.numel() % width == 0,
      "syncbn: `rows` must be the gathered 1-D buffer of W rows of ", width,
      " values (4 + 3 * C), got shape ", rows.sizes());
  SYNCBN_CHECK(
      rows.scalar_type() == acc_dtype_of(input.scalar_type()) && rows.device() == input.device(),
      "syncbn: `rows` must be ", acc_dtype_of(input.scalar_type()), " on ", input.device(),
      ", got ", rows.scalar_type(), " on ", rows.device());
  return rows.numel() / width;
}

void check_calls(const at::Tensor& calls, const at::Tensor& input) {
  SYNCBN_CHECK(
      calls.numel() == 1 && calls.scalar_type() == at::kLong && calls.device() == input.device(),
      "syncbn: `calls` must be a one-element int64 counter on ", input.device(), ", got ",
      calls.scalar_type(), " of shape ", calls.sizes(), " on ", calls.device());
}

void check_running(
    const c10::optional<at::Tensor>& running_mean, const c10::optional<at::Tensor>& running_var,
    const c10::optional<at::Tensor>& num_batches_tracked,
    const c10::optional<at::Tensor>& nonfinite, const at::Tensor& input) {
  const bool has_mean = running_mean.has_value() && running_mean->defined();
  const bool has_var = running_var.has_value() && running_var->defined();
  SYNCBN_CHECK(
      has_mean == has_var, "syncbn: `running_mean` and `running_var` must be given together");
  if (has_mean) {
    check_channel_vector(*running_mean, "running_mean", input, false);
    check_channel_vector(*running_var, "running_var", input, false);
    SYNCBN_CHECK(
        running_mean->is_contiguous() && running_var->is_contiguous() &&
            running_mean->scalar_type() == running_var->scalar_type(),
        "syncbn: `running_mean` and `running_var` must be contiguous and of one dtype");
  }
  for (const auto* counter : {&num_batches_tracked, &nonfinite}) {
    if (!counter->has_value() || !(*counter)->defined()) continue;
    SYNCBN_CHECK(
        (*counter)->numel() == 1 && (*counter)->scalar_type() == at::kLong &&
            (*counter)->device() == input.device(),
        "syncbn: `num_batches_tracked` and `nonfinite` must be one-element int64 counters on ",
        input.device());
  }
}

MergeOutputs prepare_merge(const MergeArgs& args, c10::DeviceType device) {
  const at::Tensor& input = args.input;
  check_input(input, device);
  const RunningBuffers& r = args.running;
  check_running(r.mean, r.var, r.num_batches_tracked, r.nonfinite, input);
  SYNCBN_CHECK(args.settings.eps > 0, "syncbn: `eps` must be > 0, got ", args.settings.eps);
  const int64_t C = input.size(1);
  const auto opts = input.options().dtype(acc_dtype_of(input.scalar_type()));
  return {
      new_empty({C}, opts),           new_empty({C}, opts), new_empty({C}, opts),
      new_empty({C}, opts),           new_empty({kInfoFields}, opts),
      new_empty({kInfoFields}, opts)};
}

at::Tensor summed_reduce_vector(
    const at::Tensor& total, const at::Tensor& sent, int64_t world_size, const at::Tensor& input) {
  const int64_t width = kReduceHeader + 2 * input.size(1);
  for (const auto* v : {&total, &sent}) {
    const int64_t n = v->numel();
    const bool sized = v == &sent ? n == width : n >= width && n % width == 0;
    SYNCBN_CHECK(
        v->dim() == 1 && v->is_contiguous() && sized && v->scalar_type() == at::kDouble &&
            v->device() == input.device(),
        "syncbn: `total` and `sent` must be the reduce exchange's 1-D float64 vectors of ", width,
        " values (15 + 2 * C; `total` may hold R such vectors, gathered) on ", input.device(),
        ", got ", v->scalar_type(), " of shape ", v->sizes(), " on ", v->device());
  }
  SYNCBN_CHECK(world_size >= 1, "syncbn: `world_size` must be >= 1, got ", world_size);
  // Gathered vectors (CPU groups, see collectives.sum_over_group): the same sum on every rank.
  return total.numel() == width ? total : total.view({-1, width}).sum(0);
}

at::Tensor shift_float64(const c10::optional<at::Tensor>& shift, const at::Tensor& input) {
  if (!shift.has_value() || !shift->defined()) return at::Tensor();
  check_channel_vector(*shift, "shift", input, /*require_acc_dtype=*/false);
  return shift->to(at::kDouble).contiguous();
}

int64_t check_sums(const at::Tensor& sums, const at::Tensor& info, const at::Tensor& input) {
  const int64_t C = input.size(1), width = kGradHeader + 2 * C;
  const auto acc = acc_dtype_of(input.scalar_type());
  SYNCBN_CHECK(
      sums.dim() == 1 && sums.is_contiguous() && sums.numel() >= width &&
          sums.numel() % width == 0 && sums.scalar_type() == acc &&
          sums.device() == input.device(),
      "syncbn: `sums` must be R rows of [header[", kGradHeader, "], sum_dy[C], sum_dy_xmu[C]] ",
      "(1-D, ", acc, ", on ", input.device(), "), got ", sums.scalar_type(), " of shape ",
      sums.sizes());
  SYNCBN_CHECK(
      info.numel() == kInfoFields && info.scalar_type() == acc && info.device() == input.device(),
      "syncbn: `info` must be the merge's ", kInfoFields, "-value info tensor");
  return sums.numel() / width;
}

at::Tensor group_sums(const at::Tensor& sums, const at::Tensor& info, const at::Tensor& input) {
  const int64_t R = check_sums(sums, info, input), C = input.size(1);
  // Rows summed in rank order: the same bits on every rank of the group.
  return R == 1 ? sums : sums.view({R, kGradHeader + 2 * C}).sum(0);
}

at::Tensor required_info(const c10::optional<at::Tensor>& info) {
  SYNCBN_CHECK(
      info.has_value() && info->defined(),
      "syncbn: grad_input: `info` (the merge's grad_info) is required");
  return *info;
}

at::Tensor checked_grad_info(const c10::optional<at::Tensor>& info, const at::Tensor& input) {
  if (!info.has_value() || !info->defined()) return at::Tensor();
  SYNCBN_CHECK(
      info->dim() == 1 && info->numel() == kInfoFields && info->is_contiguous() &&
          info->scalar_type() == acc_dtype_of(input.scalar_type()) &&
          info->device() == input.device(),
      "syncbn: `info` must be the merge's ", kInfoFields, "-value grad_info tensor (",
      acc_dtype_of(input.scalar_type()), ", on ", input.device(), "), got ", info->scalar_type(),
      " of shape ", info->sizes());
  return *info;
}

void check_group_count(double total, const at::Tensor& input, int64_t world_size) {
  SYNCBN_CHECK_VALUE(
      total != 1, "Expected more than 1 value per channel when training, got input size ",
      "torch.Size(", input.sizes(), ") (1 value per channel in the whole sync group of ",
      world_size, " rank(s))");
}

double summed_ranks(int64_t rows, int64_t world_size) {
  SYNCBN_CHECK(world_size >= 1, "syncbn: `world_size` must be >= 1, got ", world_size);
  return static_cast<double>(rows > 1 ? rows : world_size);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> with_packed_param_grads(
    const at::Tensor& sums, const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const at::Tensor& input) {
  const int64_t C = input.size(1);
  auto grads = with_param_grads(
      sums.narrow(0, kGradHeader, C), sums.narrow(0, kGradHeader + C, C), invstd, weight, input,
      true, true);
  return {sums, std::get<2>(grads), std::get<3>(grads)};
}

}  // namespace detail
}  // namespace syncbn
