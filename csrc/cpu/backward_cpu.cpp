// CPU kernels of the backward (see syncbn.h for the maths): the local reductions (sum_dy,
// sum_dy_xmu) and the elementwise input gradient, each with an optional fused activation (dy *
// act'(z) in place of dy) and the mean optionally split (xmu = (x - mean) - mean_lo). Layout of
// this file: helpers, kernels, dispatch.
#include "cpu_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

namespace syncbn {
namespace {

using namespace detail;

// ------------------------------------------------------------------------------------------------
// Helpers
// ------------------------------------------------------------------------------------------------

// The activation's z coefficients for the backward kernels (empty without an activation).
template <typename acc_t>
Affine<acc_t> z_affine(const ActAffine& act, const acc_t* mean, int64_t C) {
  if (act.act.identity()) return {};
  return normalize_coefficients<acc_t>(
      mean, nullptr, act.invstd.const_data_ptr<acc_t>(), data_or_null<acc_t>(act.weight),
      data_or_null<acc_t>(act.bias), C);
}

// The low parts of a split mean (zeros when the mean is not split: subtracting 0 changes no
// value).
template <typename acc_t>
std::vector<acc_t> mean_lo_of(const at::Tensor& mean_lo, int64_t C) {
  std::vector<acc_t> lo(C, acc_t(0));
  if (mean_lo.defined()) std::copy_n(mean_lo.const_data_ptr<acc_t>(), C, lo.begin());
  return lo;
}

// The z coefficients of channel c (zeros without an activation: the vectors are empty then).
template <typename Act, typename acc_t>
inline std::pair<acc_t, acc_t> z_coefficients(const Affine<acc_t>& z, int64_t c) {
  if constexpr (Act::kIdentity) {
    return {acc_t(0), acc_t(0)};
  } else {
    return {z.scale[c], z.shift[c]};
  }
}

// Per-channel coefficients of dx = (dy - mean_dy - (x - mean) * k) * iw, with mean_dy and k from
// the group-wide sums and count. (x - mean) stays explicit: folding it into an offset would cancel
// catastrophically for large means.
template <typename acc_t>
struct BackwardCoefficients {
  std::vector<acc_t> mean, mean_lo, iw, mean_dy, k;
};

template <typename acc_t>
BackwardCoefficients<acc_t> backward_coefficients(
    const acc_t* mean, std::vector<acc_t> mean_lo, const acc_t* invstd, const acc_t* weight,
    const acc_t* sum_dy, const acc_t* sum_dy_xmu, double count, int64_t C) {
  BackwardCoefficients<acc_t> b{
      std::vector<acc_t>(mean, mean + C), std::move(mean_lo), std::vector<acc_t>(C),
      std::vector<acc_t>(C), std::vector<acc_t>(C)};
  const double inv_n = 1.0 / std::max(count, 1.0);
  for (int64_t c = 0; c < C; ++c) {
    const double is = invstd[c];
    b.iw[c] = static_cast<acc_t>(is * (weight ? static_cast<double>(weight[c]) : 1.0));
    b.mean_dy[c] = static_cast<acc_t>(sum_dy[c] * inv_n);
    b.k[c] = static_cast<acc_t>(sum_dy_xmu[c] * inv_n * is * is);
  }
  return b;
}

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

// Folds the partial sums part_dy / part_dyx[c * c_stride + p * p_stride], p < parts, into
// per-channel (sum_dy, sum_dy_xmu).
template <typename acc_t>
void fold_sum_partials(
    const std::vector<double>& part_dy, const std::vector<double>& part_dyx, int64_t C,
    int64_t parts, int64_t c_stride, int64_t p_stride, acc_t* sum_dy, acc_t* sum_dy_xmu) {
  for (int64_t c = 0; c < C; ++c) {
    double s_dy = 0, s_dyx = 0;
    for (int64_t p = 0; p < parts; ++p) {
      s_dy += part_dy[c * c_stride + p * p_stride];
      s_dyx += part_dyx[c * c_stride + p * p_stride];
    }
    sum_dy[c] = static_cast<acc_t>(s_dy);
    sum_dy_xmu[c] = static_cast<acc_t>(s_dyx);
  }
}

// With an activation, `z` holds its per-channel coefficients (see act_input_grad).
template <typename scalar_t, typename acc_t, typename Act>
void backward_reduce_channels_first(
    const scalar_t* dy, const scalar_t* x, const acc_t* mean, const acc_t* mean_lo,
    const Geometry& g, acc_t* sum_dy, acc_t* sum_dy_xmu, const Affine<acc_t>& z, const Act& act) {
  constexpr int L = kLanes<acc_t>;
  const int64_t P = row_splits(g);
  std::vector<double> part_dy(g.C * P), part_dyx(g.C * P);
  at::parallel_for(0, g.C * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task / P, p = task % P;
      const int64_t n0 = g.N * p / P, n1 = g.N * (p + 1) / P;
      const acc_t m = mean[c], lo = mean_lo[c];
      const auto [sc, sh] = z_coefficients<Act>(z, c);
      acc_t a_dy[L] = {}, a_dyx[L] = {};
      double t_dy = 0, t_dyx = 0;
      int64_t pending = 0;
      // Sums have no long dependency chain, so per-group updates of the lane arrays keep up
      // (copying them into registers per run was measured 8x slower here); they are flushed
      // into double every kFlushGroups groups.
      auto flush = [&]() {
        for (int l = 0; l < L; ++l) {
          t_dy += a_dy[l];
          t_dyx += a_dyx[l];
          a_dy[l] = a_dyx[l] = 0;
        }
        pending = 0;
      };
      visit_channel_groups<L, 2, scalar_t>(
          {dy, x}, g, c, n0, n1,
          [&](const std::array<const scalar_t*, 2>& q, int64_t groups) {
            for (int64_t gi = 0; gi < groups; ++gi) {
              const scalar_t* __restrict d = q[0] + gi * L;
              const scalar_t* __restrict v = q[1] + gi * L;
#pragma GCC ivdep
              for (int l = 0; l < L; ++l) {
                const acc_t xm = (to_acc<acc_t>(v[l]) - m) - lo;
                const acc_t dv = act_input_grad(act, to_acc<acc_t>(d[l]), xm, sc, sh);
                a_dy[l] += dv;
                a_dyx[l] += dv * xm;
              }
              if (++pending == kFlushGroups) flush();
            }
          },
          [&](const std::array<const scalar_t*, 2>& q, int count) {
            for (int i = 0; i < count; ++i) {
              const acc_t xm = (to_acc<acc_t>(q[1][i]) - m) - lo;
              const double dv = act_input_grad(act, static_cast<double>(q[0][i]), double(xm), double(sc), double(sh));
              t_dy += dv;
              t_dyx += dv * ((static_cast<double>(q[1][i]) - m) - lo);
            }
          });
      flush();
      part_dy[task] = t_dy;
      part_dyx[task] = t_dyx;
    }
  });
  fold_sum_partials(part_dy, part_dyx, g.C, P, P, 1, sum_dy, sum_dy_xmu);
}

template <typename scalar_t, typename acc_t, typename Act>
void backward_reduce_channels_last(
    const scalar_t* dy, const scalar_t* x, const acc_t* mean, const acc_t* mean_lo,
    const Geometry& g, acc_t* sum_dy, acc_t* sum_dy_xmu, const Affine<acc_t>& z, const Act& act) {
  const int64_t rows = g.N * g.S, C = g.C;
  const int64_t chunks = row_chunks(rows);
  std::vector<double> part_dy(chunks * C, 0.0), part_dyx(chunks * C, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> a_dy(C), a_dyx(C);
    acc_t* __restrict pdy = a_dy.data();
    acc_t* __restrict pdyx = a_dyx.data();
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t r0 = rows * chunk / chunks, r1 = rows * (chunk + 1) / chunks;
      double* t_dy = part_dy.data() + chunk * C;
      double* t_dyx = part_dyx.data() + chunk * C;
      for (int64_t f0 = r0; f0 < r1; f0 += kFlushRows) {
        std::fill(a_dy.begin(), a_dy.end(), acc_t(0));
        std::fill(a_dyx.begin(), a_dyx.end(), acc_t(0));
        const int64_t f1 = std::min(r1, f0 + kFlushRows);
        for (int64_t r = f0; r < f1; ++r) {
          const scalar_t* __restrict d = dy + r * C;
          const scalar_t* __restrict v = x + r * C;
#pragma GCC ivdep
          for (int64_t c = 0; c < C; ++c) {
            const acc_t xm = (to_acc<acc_t>(v[c]) - mean[c]) - mean_lo[c];
            const auto [sc, sh] = z_coefficients<Act>(z, c);
            const acc_t dv = act_input_grad(act, to_acc<acc_t>(d[c]), xm, sc, sh);
            pdy[c] += dv;
            pdyx[c] += dv * xm;
          }
        }
        for (int64_t c = 0; c < C; ++c) {
          t_dy[c] += pdy[c];
          t_dyx[c] += pdyx[c];
        }
      }
    }
  });
  fold_sum_partials(part_dy, part_dyx, C, chunks, 1, C, sum_dy, sum_dy_xmu);
}

template <typename scalar_t, typename acc_t, typename Act>
void backward_elemt_kernel(
    const scalar_t* dy, const scalar_t* x, scalar_t* dx, const Geometry& g,
    const BackwardCoefficients<acc_t>& b, const Affine<acc_t>& z, const Act& act) {
  if (g.layout == Layout::kChannelsFirst) {
    const int64_t S = g.S;
    at::parallel_for(0, g.N * g.C, std::max<int64_t>(1, kElemGrain / S), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t c = r % g.C;
        const acc_t m = b.mean[c], lo = b.mean_lo[c], iw = b.iw[c], mdy = b.mean_dy[c], k = b.k[c];
        const auto [sc, sh] = z_coefficients<Act>(z, c);
        const scalar_t* __restrict d = dy + r * S;
        const scalar_t* __restrict v = x + r * S;
        scalar_t* __restrict o = dx + r * S;
        for (int64_t s = 0; s < S; ++s) {
          const acc_t xm = (to_acc<acc_t>(v[s]) - m) - lo;
          const acc_t dz = act_input_grad(act, to_acc<acc_t>(d[s]), xm, sc, sh);
          o[s] = from_acc<scalar_t>((dz - mdy - xm * k) * iw);
        }
      }
    });
  } else {
    const int64_t C = g.C;
    const acc_t* __restrict mp = b.mean.data();
    const acc_t* __restrict lp = b.mean_lo.data();
    const acc_t* __restrict iwp = b.iw.data();
    const acc_t* __restrict mdyp = b.mean_dy.data();
    const acc_t* __restrict kp = b.k.data();
    at::parallel_for(0, g.N * g.S, std::max<int64_t>(1, kElemGrain / C), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const scalar_t* __restrict d = dy + r * C;
        const scalar_t* __restrict v = x + r * C;
        scalar_t* __restrict o = dx + r * C;
#pragma GCC ivdep
        for (int64_t c = 0; c < C; ++c) {
          const acc_t xm = (to_acc<acc_t>(v[c]) - mp[c]) - lp[c];
          const auto [sc, sh] = z_coefficients<Act>(z, c);
          const acc_t dz = act_input_grad(act, to_acc<acc_t>(d[c]), xm, sc, sh);
          o[c] = from_acc<scalar_t>((dz - mdyp[c] - xm * kp[c]) * iwp[c]);
        }
      }
    });
  }
}

// g = dy * act'(z + r), rounded to scalar_t: the first pass of grad_sums_residual. `a` holds the
// forward's coefficients (z = ((x - mean) - mean_lo) * scale + shift, as normalize_kernel); the
// loops are normalize_kernel's, restrict-qualified rows, so that they vectorize.
template <typename scalar_t, typename acc_t, typename Act>
void act_grad_residual_kernel(
    const scalar_t* dy, const scalar_t* x, const scalar_t* res, scalar_t* out, const Geometry& g,
    const Affine<acc_t>& a, const Act& act) {
  if (g.layout == Layout::kChannelsFirst) {
    const int64_t S = g.S;
    at::parallel_for(0, g.N * g.C, std::max<int64_t>(1, kElemGrain / S), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int64_t c = r % g.C;
        const acc_t m = a.mean[c], lo = a.mean_lo[c], sc = a.scale[c], sh = a.shift[c];
        const scalar_t* __restrict d = dy + r * S;
        const scalar_t* __restrict v = x + r * S;
        const scalar_t* __restrict q = res + r * S;
        scalar_t* __restrict o = out + r * S;
        for (int64_t s = 0; s < S; ++s) {
          const acc_t z = ((to_acc<acc_t>(v[s]) - m) - lo) * sc + sh + to_acc<acc_t>(q[s]);
          o[s] = from_acc<scalar_t>(times_grad(act, to_acc<acc_t>(d[s]), z));
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
        const scalar_t* __restrict d = dy + r * C;
        const scalar_t* __restrict v = x + r * C;
        const scalar_t* __restrict q = res + r * C;
        scalar_t* __restrict o = out + r * C;
#pragma GCC ivdep
        for (int64_t c = 0; c < C; ++c) {
          const acc_t z = ((to_acc<acc_t>(v[c]) - mp[c]) - lp[c]) * scp[c] + shp[c] +
                          to_acc<acc_t>(q[c]);
          o[c] = from_acc<scalar_t>(times_grad(act, to_acc<acc_t>(d[c]), z));
        }
      }
    });
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Dispatch: dtype, layout, activation
// ------------------------------------------------------------------------------------------------

namespace detail {

void backward_sums_into_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& mean_lo, Channels sum_dy, Channels sum_dy_xmu, const ActAffine& act) {
  if (is_reduced_precision(input)) {  // the float32 kernel (cpu_kernels.h)
    return backward_sums_into_cpu(
        as_float(grad_out), as_float(input), mean, mean_lo, sum_dy, sum_dy_xmu, act);
  }
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "backward_reduce_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    acc_t* dy_sum = sum_dy.data<acc_t>();
    acc_t* dy_xmu_sum = sum_dy_xmu.data<acc_t>();
    if (input.numel() == 0) {
      std::fill_n(dy_sum, g.C, acc_t(0));
      std::fill_n(dy_xmu_sum, g.C, acc_t(0));
      return;
    }
    const scalar_t* dy = grad_out.const_data_ptr<scalar_t>();
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    const acc_t* m = mean.const_data_ptr<acc_t>();
    const std::vector<acc_t> lo = mean_lo_of<acc_t>(mean_lo, g.C);
    const Affine<acc_t> z = z_affine<acc_t>(act, m, g.C);
    with_cpu_activation<acc_t>(act.act, [&](const auto& a) {
      if (g.layout == Layout::kChannelsFirst) {
        backward_reduce_channels_first<scalar_t, acc_t>(
            dy, x, m, lo.data(), g, dy_sum, dy_xmu_sum, z, a);
      } else {
        backward_reduce_channels_last<scalar_t, acc_t>(
            dy, x, m, lo.data(), g, dy_sum, dy_xmu_sum, z, a);
      }
    });
  });
}

at::Tensor act_grad_residual_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& residual,
    const at::Tensor& mean, const at::Tensor& mean_lo, const ActAffine& act) {
  if (act.act.identity()) return grad_out.clone(at::MemoryFormat::Preserve);
  if (is_reduced_precision(input)) {  // the float32 kernel (cpu_kernels.h)
    return act_grad_residual_cpu(
               as_float(grad_out), as_float(input), as_float(residual), mean, mean_lo, act)
        .to(input.scalar_type());
  }
  at::Tensor out = new_empty_like(input);
  if (input.numel() == 0) return out;
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "act_grad_residual_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const Affine<acc_t> a = normalize_coefficients<acc_t>(
        mean.const_data_ptr<acc_t>(), data_or_null<acc_t>(mean_lo),
        act.invstd.const_data_ptr<acc_t>(), data_or_null<acc_t>(act.weight),
        data_or_null<acc_t>(act.bias), g.C);
    with_cpu_activation<acc_t>(act.act, [&](const auto& f) {
      // Not instantiated for the identity, returned above (a faster first build).
      if constexpr (!std::decay_t<decltype(f)>::kIdentity) {
        act_grad_residual_kernel<scalar_t, acc_t>(
            grad_out.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
            residual.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), g, a, f);
      }
    });
  });
  return out;
}

at::Tensor backward_elemt_checked_cpu(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& mean_,
    const at::Tensor& mean_lo_, const at::Tensor& invstd_,
    const c10::optional<at::Tensor>& weight, Channels sum_dy, Channels sum_dy_xmu, double count,
    const ActAffine& act) {
  if (is_reduced_precision(input_)) {  // the float32 kernel (cpu_kernels.h)
    return backward_elemt_checked_cpu(
               as_float(grad_out_), as_float(input_), mean_, mean_lo_, invstd_, as_float(weight),
               sum_dy, sum_dy_xmu, count, act)
        .to(input_.scalar_type());
  }
  const ElemtOperands o =
      elemt_operands(input_, grad_out_, mean_, mean_lo_, invstd_, weight, c10::nullopt);
  if (o.input.numel() == 0) return o.output;
  const Geometry g = geometry_of(o.input);
  AT_DISPATCH_FLOATING_TYPES(o.input.scalar_type(), "backward_elemt_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto coeff = backward_coefficients<acc_t>(
        o.mean.const_data_ptr<acc_t>(), mean_lo_of<acc_t>(o.mean_lo, g.C),
        o.invstd.const_data_ptr<acc_t>(),
        data_or_null<acc_t>(o.weight), sum_dy.data<acc_t>(), sum_dy_xmu.data<acc_t>(), count, g.C);
    const Affine<acc_t> z = z_affine<acc_t>(act, o.mean.const_data_ptr<acc_t>(), g.C);
    with_cpu_activation<acc_t>(act.act, [&](const auto& a) {
      backward_elemt_kernel<scalar_t, acc_t>(
          o.grad_out.const_data_ptr<scalar_t>(), o.input.const_data_ptr<scalar_t>(),
          o.output.mutable_data_ptr<scalar_t>(), g, coeff, z, a);
    });
  });
  return o.output;
}

}  // namespace detail
}  // namespace syncbn
