// CPU kernel of normalize (see syncbn.h): y = act(((x - mean) - mean_lo) * invstd * weight + bias
// + residual), computed in the acc dtype and rounded once to the input's dtype (mean_lo: the low
// part of a split mean, else 0; residual: the fused residual add, else 0). Layout of this file:
// kernel, dispatch.
#include "cpu_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace syncbn {
namespace {

using namespace detail;

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

// The residual's value at element i (kResidual false: none, r is null and never read).
template <bool kResidual, typename acc_t, typename scalar_t>
inline acc_t residual_at(const scalar_t* __restrict r, int64_t i) {
  if constexpr (kResidual) {
    return to_acc<acc_t>(r[i]);
  } else {
    return acc_t(0);
  }
}

template <bool kResidual, typename scalar_t, typename acc_t, typename Act>
void normalize_kernel(
    const scalar_t* x, const scalar_t* res, scalar_t* y, const Geometry& g, const Affine<acc_t>& a,
    const Act& act) {
  if (g.layout == Layout::kChannelsFirst) {
    const int64_t S = g.S;
    at::parallel_for(0, g.N * g.C, std::max<int64_t>(1, kElemGrain / S), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int64_t c = r % g.C;
        const acc_t m = a.mean[c], lo = a.mean_lo[c], sc = a.scale[c], sh = a.shift[c];
        const scalar_t* __restrict xr = x + r * S;
        const scalar_t* __restrict rr = kResidual ? res + r * S : nullptr;
        scalar_t* __restrict yr = y + r * S;
        for (int64_t s = 0; s < S; ++s) {
          const acc_t z = ((to_acc<acc_t>(xr[s]) - m) - lo) * sc + sh;
          yr[s] = from_acc<scalar_t>(act.forward(z + residual_at<kResidual, acc_t>(rr, s)));
        }
      }
    });
  } else {
    const int64_t C = g.C;
    const acc_t* __restrict mp = a.mean.data();
    const acc_t* __restrict lp = a.mean_lo.data();
    const acc_t* __restrict scp = a.scale.data();
    const acc_t* __restrict shp = a.shift.data();
    at::parallel_for(0, g.N * g.S, std::max<int64_t>(1, kElemGrain / C), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* __restrict xr = x + r * C;
        const scalar_t* __restrict rr = kResidual ? res + r * C : nullptr;
        scalar_t* __restrict yr = y + r * C;
#pragma GCC ivdep
        for (int64_t c = 0; c < C; ++c) {
          const acc_t xm = (to_acc<acc_t>(xr[c]) - mp[c]) - lp[c];
          const acc_t z = xm * scp[c] + shp[c] + residual_at<kResidual, acc_t>(rr, c);
          yr[c] = from_acc<scalar_t>(act.forward(z));
        }
      }
    });
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Dispatch: dtype, activation, residual
// ------------------------------------------------------------------------------------------------

namespace detail {

at::Tensor normalize_act_cpu(
    const at::Tensor& input_, const at::Tensor& mean_, const at::Tensor& mean_lo_,
    const at::Tensor& invstd_, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const Activation& act, const at::Tensor& residual) {
  if (is_reduced_precision(input_)) {  // the float32 kernel (cpu_kernels.h)
    return normalize_act_cpu(
               as_float(input_), mean_, mean_lo_, invstd_, as_float(weight), as_float(bias), act,
               as_float(residual))
        .to(input_.scalar_type());
  }
  const ElemtOperands o =
      elemt_operands(input_, at::Tensor(), mean_, mean_lo_, invstd_, weight, bias);
  if (o.input.numel() == 0) return o.output;
  const Geometry g = geometry_of(o.input);
  AT_DISPATCH_FLOATING_TYPES(o.input.scalar_type(), "normalize_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto coeff = normalize_coefficients<acc_t>(
        o.mean.const_data_ptr<acc_t>(), data_or_null<acc_t>(o.mean_lo),
        o.invstd.const_data_ptr<acc_t>(),
        data_or_null<acc_t>(o.weight), data_or_null<acc_t>(o.bias), g.C);
    const at::Tensor r = residual.defined() ? with_strides_of(residual, o.input) : residual;
    const scalar_t* x = o.input.const_data_ptr<scalar_t>();
    scalar_t* y = o.output.mutable_data_ptr<scalar_t>();
    with_cpu_activation<acc_t>(act, [&](const auto& a) {
      if (r.defined()) {
        normalize_kernel<true, scalar_t, acc_t>(x, r.const_data_ptr<scalar_t>(), y, g, coeff, a);
      } else {
        normalize_kernel<false, scalar_t, acc_t>(x, nullptr, y, g, coeff, a);
      }
    });
  });
  return o.output;
}

}  // namespace detail
}  // namespace syncbn
