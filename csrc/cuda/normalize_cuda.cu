// CUDA kernel of normalize (see syncbn.h): y = act(((x - mean) - mean_lo) * invstd * weight +
// bias [+ residual]), computed in the acc dtype and rounded once to the input's dtype, through the elementwise kernels of
// cuda_elemt.cuh. Layout of this file: the kernels' Op, dispatch.
#include "cuda_elemt.cuh"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>

#include <type_traits>

namespace syncbn {
namespace {

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------

// y = act(((x - mean) - mean_lo) * invstd * weight + bias), computed as (x - mean) * scale +
// (bias - mean_lo * scale): the low part of a split mean joins the per-channel shift, so a thread
// holds no more coefficients than without it (the channels-last kernels are register-bound).
// kInputs 2: the second input is the residual, added before the activation.
template <typename acc_t, typename Act = IdentityAct, int K = 1>
struct NormalizeOp {
  static constexpr int kInputs = K;
  struct Coeff {
    acc_t mean, scale, shift;
  };
  const acc_t* __restrict__ mean;
  const acc_t* __restrict__ mean_lo;  // may be null: 0
  const acc_t* __restrict__ invstd;
  const acc_t* __restrict__ weight;  // may be null
  const acc_t* __restrict__ bias;    // may be null
  Act act = {};

  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ Coeff coeff(int64_t c) const {
    const acc_t scale = invstd[c] * (weight ? weight[c] : acc_t(1));
    const acc_t shift = bias ? bias[c] : acc_t(0);
    return {mean[c], scale, mean_lo ? shift - mean_lo[c] * scale : shift};
  }
  // out[e] = op of element e of every input (in[t][e]), with the coefficients coeff_of(e).
  template <int VEC, typename CoeffOf>
  __device__ __forceinline__ void apply_vec(
      CoeffOf coeff_of, const acc_t (*in)[VEC], acc_t* out) const {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const Coeff k = coeff_of(e);
      out[e] = (in[0][e] - k.mean) * k.scale + k.shift;
      if constexpr (K == 2) out[e] += in[1][e];
    }
    act.template forward_n<VEC>(out);
  }
};

}  // namespace

// ------------------------------------------------------------------------------------------------
// Dispatch: dtype, activation, residual
// ------------------------------------------------------------------------------------------------

namespace detail {

at::Tensor normalize_act_cuda(
    const at::Tensor& input_, const at::Tensor& mean_, const at::Tensor& mean_lo_,
    const at::Tensor& invstd_, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const Activation& act, const at::Tensor& residual) {
  const c10::cuda::CUDAGuard guard(input_.device());
  const ElemtOperands o =
      elemt_operands(input_, at::Tensor(), mean_, mean_lo_, invstd_, weight, bias);
  if (o.input.numel() == 0) return o.output;
  const Geometry g = geometry_of(o.input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, o.input.scalar_type(), "normalize_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor r = residual.defined() ? with_strides_of(residual, o.input) : residual;
    const scalar_t* x = o.input.const_data_ptr<scalar_t>();
    scalar_t* y = o.output.mutable_data_ptr<scalar_t>();
    with_activation<acc_t>(act, [&](const auto& a) {
      using Act = std::decay_t<decltype(a)>;
      auto launch = [&](auto op, const auto& ptr) {
        launch_elemt<decltype(op), scalar_t, acc_t>(op, ptr, g, o.input);
      };
      const acc_t* mean = o.mean.const_data_ptr<acc_t>();
      const acc_t* mean_lo = data_or_null<acc_t>(o.mean_lo);
      const acc_t* invstd = o.invstd.const_data_ptr<acc_t>();
      const acc_t* weight = data_or_null<acc_t>(o.weight);
      const acc_t* bias = data_or_null<acc_t>(o.bias);
      if (r.defined()) {
        launch(
            NormalizeOp<acc_t, Act, 2>{mean, mean_lo, invstd, weight, bias, a},
            ElemtPointers<scalar_t, 2>{{x, r.const_data_ptr<scalar_t>()}, y});
      } else {
        launch(
            NormalizeOp<acc_t, Act, 1>{mean, mean_lo, invstd, weight, bias, a},
            ElemtPointers<scalar_t, 1>{{x}, y});
      }
    });
  });
  return o.output;
}

}  // namespace detail
}  // namespace syncbn
