// Host-side helpers shared by the CPU and CUDA entry points: layout handling, argument checks and
// the kernels' operands (the fused steps' own helpers: step_helpers.cpp). Compiled by the host
// compiler only; the .cu files call these through syncbn.h.
#include "common.h"

// ATen's per-operator headers rather than ATen/ATen.h (every operator): a faster first build.
#include <ATen/ops/empty.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty_like.h>

#include <cmath>

namespace syncbn {
namespace detail {

// The accumulation dtype of an input dtype (shared_constants.h's table: ACC_DTYPES in Python),
// float32 for any other; and whether the kernels take the dtype (a row of the table).
#define SYNCBN_ACC_OF(input, acc) if (t == at::ScalarType::input) return at::ScalarType::acc;
at::ScalarType acc_dtype_of(at::ScalarType t) {
  SYNCBN_FOR_EACH_ACC_DTYPE(SYNCBN_ACC_OF)
  return at::kFloat;
}
#undef SYNCBN_ACC_OF
#define SYNCBN_IS_INPUT(input, acc) || t == at::ScalarType::input
static bool is_input_dtype(at::ScalarType t) {
  return false SYNCBN_FOR_EACH_ACC_DTYPE(SYNCBN_IS_INPUT);
}
#undef SYNCBN_IS_INPUT

bool is_channels_last_dense(const at::Tensor& t) { return t.movedim(1, -1).is_contiguous(); }

Geometry geometry_of(const at::Tensor& x) {
  Geometry g{x.size(0), x.size(1), 1, Layout::kChannelsLast};
  for (int64_t d = 2; d < x.dim(); ++d) g.S *= x.size(d);
  if (g.S != 1 && x.is_contiguous()) g.layout = Layout::kChannelsFirst;
  return g;
}

at::Tensor dense_input(const at::Tensor& x) {
  if (x.is_contiguous() || is_channels_last_dense(x)) return x;
  return x.contiguous();
}

at::Tensor new_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (options.device().is_cpu()) return at::detail::empty_cpu(sizes, options);
  return at::empty(sizes, options);
}

at::Tensor new_empty_like(const at::Tensor& like) {
  if (like.is_cpu()) return at::detail::empty_strided_cpu(like.sizes(), like.strides(), like.options());
  return at::empty_like(like);
}

at::Tensor with_strides_of(const at::Tensor& t, const at::Tensor& like) {
  if (t.strides() == like.strides()) return t;
  return new_empty_like(like).copy_(t);
}

void check_input(const at::Tensor& input, c10::DeviceType device) {
  SYNCBN_CHECK(input.defined(), "syncbn: `input` is undefined");
  SYNCBN_CHECK(
      input.dim() >= 2, "syncbn: `input` must have shape (N, C, *) with at least 2 dims, got ",
      input.dim(), "-D input of shape ", input.sizes());
  const auto t = input.scalar_type();
  SYNCBN_CHECK(
      is_input_dtype(t), "syncbn: `input` must be " SYNCBN_INPUT_DTYPES_TEXT ", got ", t);
  SYNCBN_CHECK(input.size(1) >= 1, "syncbn: `input` must have at least one channel (dim 1)");
  SYNCBN_CHECK(
      input.device().type() == device, "syncbn: `input` must be a ", c10::DeviceTypeName(device),
      " tensor for these kernels, got one on ", input.device());
}

void check_channel_vector(
    const at::Tensor& v, const char* name, const at::Tensor& input, bool require_acc_dtype) {
  SYNCBN_CHECK(v.defined(), "syncbn: `", name, "` is undefined");
  SYNCBN_CHECK(
      v.dim() == 1 && v.numel() == input.size(1), "syncbn: `", name, "` must have shape [",
      input.size(1), "] (one value per channel of `input`), got ", v.sizes());
  SYNCBN_CHECK(
      v.device() == input.device(), "syncbn: `", name, "` is on ", v.device(), " but `input` is on ",
      input.device());
  if (require_acc_dtype) {
    const auto acc = acc_dtype_of(input.scalar_type());
    SYNCBN_CHECK(
        v.scalar_type() == acc, "syncbn: `", name, "` must be ", acc, " for ",
        input.scalar_type(), " input, got ", v.scalar_type());
  } else {
    SYNCBN_CHECK(
        at::isFloatingType(v.scalar_type()), "syncbn: `", name, "` must be floating point, got ",
        v.scalar_type());
  }
}

void check_grad_out(const at::Tensor& grad_out, const at::Tensor& input) {
  SYNCBN_CHECK(grad_out.defined(), "syncbn: `grad_out` is undefined");
  SYNCBN_CHECK(
      grad_out.sizes() == input.sizes(), "syncbn: `grad_out` has shape ", grad_out.sizes(),
      " but `input` has shape ", input.sizes());
  SYNCBN_CHECK(
      grad_out.scalar_type() == input.scalar_type(), "syncbn: `grad_out` dtype ",
      grad_out.scalar_type(), " differs from `input` dtype ", input.scalar_type());
  SYNCBN_CHECK(grad_out.device() == input.device(), "syncbn: `grad_out` and `input` devices differ");
}

void check_count(const at::Tensor& count, const at::Tensor& input) {
  SYNCBN_CHECK(
      count.numel() == 1 && count.device() == input.device(),
      "syncbn: `count` must be a one-element tensor on the input's device, got shape ",
      count.sizes(), " on ", count.device());
}

void check_merge_inputs(
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s, double eps,
    c10::DeviceType device) {
  SYNCBN_CHECK(counts.dim() == 1, "syncbn: `counts` must be 1-D [world], got ", counts.sizes());
  const int64_t W = counts.size(0);
  SYNCBN_CHECK(
      means.dim() == 2 && means.size(0) == W, "syncbn: `means` must have shape [", W,
      ", C] to match `counts`, got ", means.sizes());
  SYNCBN_CHECK(
      m2s.sizes() == means.sizes(), "syncbn: `m2s` must have the shape of `means` ",
      means.sizes(), ", got ", m2s.sizes());
  const auto acc = means.scalar_type();
  SYNCBN_CHECK(
      acc == at::kFloat || acc == at::kDouble, "syncbn: `means` must be float32 or float64, got ",
      acc);
  SYNCBN_CHECK(
      counts.scalar_type() == acc && m2s.scalar_type() == acc,
      "syncbn: `counts`, `means` and `m2s` must share one dtype");
  SYNCBN_CHECK(
      counts.device().type() == device && means.device() == counts.device() &&
          m2s.device() == counts.device(),
      "syncbn: `counts`, `means` and `m2s` must be ", c10::DeviceTypeName(device),
      " tensors on one device for these kernels");
  SYNCBN_CHECK(eps > 0, "syncbn: `eps` must be > 0, got ", eps);
}

void check_normalize_args(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    c10::DeviceType device) {
  check_input(input, device);
  check_channel_vector(mean, "mean", input, true);
  check_channel_vector(invstd, "invstd", input, true);
}

void check_backward_args(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, c10::DeviceType device) {
  check_input(input, device);
  check_grad_out(grad_out, input);
  check_channel_vector(mean, "mean", input, true);
  check_channel_vector(invstd, "invstd", input, true);
}

void check_backward_elemt_args(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
    const at::Tensor& count, c10::DeviceType device) {
  check_backward_args(grad_out, input, mean, invstd, device);
  check_channel_vector(sum_dy, "sum_dy", input, true);
  check_channel_vector(sum_dy_xmu, "sum_dy_xmu", input, true);
  check_count(count, input);
}

MergeStatsArgs merge_stats_args(
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s) {
  const int64_t W = counts.size(0), C = means.size(1);
  const auto opts = means.options();
  return {
      W, C, counts.contiguous(), means.contiguous(), m2s.contiguous(), new_empty({C}, opts),
      new_empty({C}, opts), new_empty({C}, opts)};
}

ElemtOperands elemt_operands(
    const at::Tensor& input_, const at::Tensor& grad_out, const at::Tensor& mean,
    const at::Tensor& mean_lo, const at::Tensor& invstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias) {
  const at::Tensor input = dense_input(input_);
  // Braced initializers run in order: the weight is checked before the bias.
  return {
      input, grad_out.defined() ? with_strides_of(grad_out, input) : at::Tensor(),
      mean.contiguous(), mean_lo.defined() ? mean_lo.contiguous() : at::Tensor(),
      invstd.contiguous(), optional_acc(weight, "weight", input),
      optional_acc(bias, "bias", input), new_empty_like(input)};
}

at::Tensor checked_residual(const c10::optional<at::Tensor>& residual, const at::Tensor& input) {
  if (!residual.has_value() || !residual->defined()) return at::Tensor();
  const at::Tensor& r = *residual;
  SYNCBN_CHECK(
      r.sizes() == input.sizes(), "syncbn: `residual` must have the input's shape ",
      input.sizes(), " (it is added to the normalized input), got ", r.sizes());
  SYNCBN_CHECK(
      r.scalar_type() == input.scalar_type(), "syncbn: `residual` must have the input's dtype ",
      input.scalar_type(), ", got ", r.scalar_type());
  SYNCBN_CHECK(
      r.device() == input.device(), "syncbn: `residual` must be on the input's device ",
      input.device(), ", got ", r.device());
  return r;
}

at::Tensor checked_mean_lo(const c10::optional<at::Tensor>& mean_lo, const at::Tensor& input) {
  if (!mean_lo.has_value() || !mean_lo->defined()) return at::Tensor();
  check_channel_vector(*mean_lo, "mean_lo", input, /*require_acc_dtype=*/true);
  return *mean_lo;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> with_param_grads(
    const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const at::Tensor& input, bool weight_grad,
    bool bias_grad) {
  const bool has_weight = weight.has_value() && weight->defined();
  if (has_weight) check_channel_vector(*weight, "weight", input, false);
  const auto param_dtype = has_weight ? weight->scalar_type() : sum_dy.scalar_type();
  at::Tensor grad_weight, grad_bias;
  if (weight_grad) grad_weight = sum_dy_xmu.mul(invstd).to(param_dtype);
  // A copy even in the same dtype: the fused grad_sums returns it beside the buffer sum_dy lives in.
  if (bias_grad) grad_bias = sum_dy.to(param_dtype, /*non_blocking=*/false, /*copy=*/true);
  return {sum_dy, sum_dy_xmu, grad_weight, grad_bias};
}

at::Tensor optional_acc(
    const c10::optional<at::Tensor>& v, const char* name, const at::Tensor& input) {
  if (!v.has_value() || !v->defined()) return at::Tensor();
  check_channel_vector(*v, name, input, /*require_acc_dtype=*/false);
  // Checked first: to() is a dispatcher call even when it has nothing to do.
  if (v->scalar_type() == acc_dtype_of(input.scalar_type()) && v->is_contiguous()) return *v;
  return v->to(acc_dtype_of(input.scalar_type())).contiguous();
}

Activation checked_activation(int64_t act, double act_param) {
  SYNCBN_CHECK(
      act >= 0 && act < kActKinds, "syncbn: `act` must be an activation code in [0, ", kActKinds,
      ") (syncbn_lightning.activation.ACTIVATIONS), got ", act);
  SYNCBN_CHECK(
      std::isfinite(act_param), "syncbn: `act_param` must be finite (the negative slope of ",
      "leaky_relu), got ", act_param);
  return {act, act_param};
}

ActAffine act_affine(
    int64_t act, double act_param, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    const at::Tensor& input) {
  ActAffine out{checked_activation(act, act_param), {}, {}, {}};
  if (out.act.identity()) return out;
  out.invstd = invstd.contiguous();
  out.weight = optional_acc(weight, "weight", input);
  out.bias = optional_acc(bias, "bias", input);
  return out;
}

}  // namespace detail
}  // namespace syncbn
