// CPU kernels of the synchronized-BatchNorm primitives (see syncbn.h for the maths).
//
// Layout of this file: helpers, kernels, host entry points.
//
// Two memory layouts are handled natively, with the inner loop always over the contiguous
// dimension so that the compiler vectorizes it:
//   * channels-first (NCHW contiguous): channel c is N rows of S contiguous values, rows strided
//     by C * S. Inner loops run over S in fixed-width "lanes" of L values; values that straddle a
//     row boundary are staged into a small buffer so that every full group of L takes the vector
//     path, whatever S is (7x7 maps included).
//   * channels-last (NHWC / NDHWC dense, and (N, C) matrices): N * S rows of C contiguous values;
//     inner loops run over C with per-channel accumulator arrays.
// Statistics accumulate in acc_t (float for half/bfloat16/float, double for double) and partial
// results from lanes, threads and chunks are merged in double with Chan's formula.
#include "syncbn.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace syncbn {
namespace {

using namespace detail;

// ------------------------------------------------------------------------------------------------
// Helpers
// ------------------------------------------------------------------------------------------------

// Lanes per vector group: 32 floats = four AVX2 registers in flight, enough independent chains to
// hide FMA latency; 16 doubles is the same number of bytes.
template <typename acc_t>
constexpr int kLanes = sizeof(acc_t) == 4 ? 32 : 16;
// Elements per parallel task for elementwise kernels (amortizes the OpenMP fork).
constexpr int64_t kElemGrain = 32768;
// Rows of channels-last input accumulated in acc_t before flushing into double accumulators.
constexpr int64_t kFlushRows = 256;
// Lane groups accumulated in acc_t before flushing into double accumulators.
constexpr int64_t kFlushGroups = 128;

// Conversions between storage and accumulation types. bfloat16 is spelled out as branch-free bit
// operations (round to nearest even, NaN kept quiet) that the vectorizer handles directly; c10's
// conversion has a NaN branch. (Not measured in isolation: it went in with other changes.)
template <typename acc_t, typename scalar_t>
inline acc_t to_acc(scalar_t v) {
  return static_cast<acc_t>(v);
}

template <>
inline float to_acc<float, c10::BFloat16>(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename scalar_t, typename acc_t>
inline scalar_t from_acc(acc_t v) {
  return static_cast<scalar_t>(v);
}

template <>
inline c10::BFloat16 from_acc<c10::BFloat16, float>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t out = v != v ? 0x7FC0u : rounded;
  return c10::BFloat16(static_cast<uint16_t>(out), c10::BFloat16::from_bits());
}

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// Count, mean and sum of squared deviations, merged with Chan's pairwise formula.
struct Welford {
  double n = 0, mean = 0, m2 = 0;

  void push(double x) {
    n += 1;
    const double d = x - mean;
    mean += d / n;
    m2 += d * (x - mean);
  }

  void merge(double nb, double mean_b, double m2_b) {
    if (nb == 0) return;
    if (n == 0) {
      n = nb, mean = mean_b, m2 = m2_b;
      return;
    }
    const double nt = n + nb;
    const double d = mean_b - mean;
    mean += d * (nb / nt);
    m2 += m2_b + d * d * (n * nb / nt);
    n = nt;
  }

  void merge(const Welford& o) { merge(o.n, o.mean, o.m2); }
};

// L independent Welford accumulators sharing one count (each lane sees one value per group), on
// values shifted by a per-channel constant so that fp32 keeps its precision for large means.
template <typename acc_t, int L>
struct WelfordLanes {
  acc_t mean[L] = {};
  acc_t m2[L] = {};
  int64_t n = 0;

  // `groups` consecutive groups of L values starting at p. The accumulators are copied into
  // locals for the loop so that they live in registers rather than round-tripping through memory
  // (store-forwarding latency and 4K-aliasing stalls against the input stream).
  template <typename scalar_t>
  inline void push(const scalar_t* __restrict p, int64_t groups, acc_t shift) {
    acc_t lm[L], lv[L];
    for (int l = 0; l < L; ++l) lm[l] = mean[l], lv[l] = m2[l];
    for (int64_t g = 0; g < groups; ++g, p += L) {
      const acc_t r = acc_t(1) / static_cast<acc_t>(++n);
#pragma GCC unroll 32
      for (int l = 0; l < L; ++l) {
        const acc_t y = to_acc<acc_t>(p[l]) - shift;
        const acc_t d = y - lm[l];
        lm[l] += d * r;
        lv[l] += d * (y - lm[l]);
      }
    }
    for (int l = 0; l < L; ++l) mean[l] = lm[l], m2[l] = lv[l];
  }

  void merge_into(Welford& out, acc_t shift) const {
    for (int l = 0; l < L; ++l) {
      out.merge(static_cast<double>(n), static_cast<double>(shift) + mean[l], m2[l]);
    }
  }
};

// Feeds the values of channel c, rows [n0, n1), of K channels-first tensors with the same
// geometry to `groups(ptrs, count)`: `count` consecutive groups of exactly L values each (a group
// that straddles two rows is staged and passed alone), then the fewer-than-L leftovers to
// `tail(ptrs, count)`.
template <int L, int K, typename scalar_t, typename Group, typename Tail>
void visit_channel_groups(
    const std::array<const scalar_t*, K>& base, const Geometry& g, int64_t c, int64_t n0,
    int64_t n1, Group&& group, Tail&& tail) {
  scalar_t stage[K][L];
  std::array<const scalar_t*, K> staged;
  for (int j = 0; j < K; ++j) staged[j] = stage[j];
  std::array<const scalar_t*, K> ptrs;
  int k = 0;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t off = (n * g.C + c) * g.S;
    int64_t i = 0;
    if (k > 0) {
      for (; k < L && i < g.S; ++k, ++i) {
        for (int j = 0; j < K; ++j) stage[j][k] = base[j][off + i];
      }
      if (k == L) {
        group(staged, 1);
        k = 0;
      }
    }
    if (const int64_t full = (g.S - i) / L; full > 0) {
      for (int j = 0; j < K; ++j) ptrs[j] = base[j] + off + i;
      group(ptrs, full);
      i += full * L;
    }
    for (; i < g.S; ++i, ++k) {
      for (int j = 0; j < K; ++j) stage[j][k] = base[j][off + i];
    }
  }
  tail(staged, k);
}

// Splits channels-first work into C * P tasks (channel, row range) so that small C still uses
// every thread; returns P.
int64_t row_splits(const Geometry& g) {
  const int64_t threads = at::get_num_threads();
  if (g.C >= threads || g.N <= 1) return 1;
  return std::min<int64_t>(g.N, (threads + g.C - 1) / g.C);
}

// Row chunks for channels-last reductions: one per thread, at least 16 rows each.
int64_t row_chunks(int64_t rows) {
  const int64_t threads = at::get_num_threads();
  return std::max<int64_t>(1, std::min<int64_t>(threads, rows / 16));
}

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

// Folds partial results part[c * c_stride + p * p_stride], p < parts, into per-channel outputs:
// Chan-merged Welford partials into (mean, m2), and summed partial sums into (sum_dy, sum_dy_xmu).
template <typename acc_t>
void fold_welford_partials(
    const std::vector<Welford>& part, int64_t C, int64_t parts, int64_t c_stride,
    int64_t p_stride, acc_t* mean_out, acc_t* m2_out) {
  for (int64_t c = 0; c < C; ++c) {
    Welford w;
    for (int64_t p = 0; p < parts; ++p) w.merge(part[c * c_stride + p * p_stride]);
    mean_out[c] = static_cast<acc_t>(w.mean);
    m2_out[c] = static_cast<acc_t>(w.m2);
  }
}

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

template <typename scalar_t, typename acc_t>
void welford_stats_channels_first(
    const scalar_t* x, const Geometry& g, acc_t* mean_out, acc_t* m2_out) {
  constexpr int L = kLanes<acc_t>;
  const int64_t P = row_splits(g);
  std::vector<Welford> partial(g.C * P);
  at::parallel_for(0, g.C * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task / P, p = task % P;
      const int64_t n0 = g.N * p / P, n1 = g.N * (p + 1) / P;
      const acc_t shift = to_acc<acc_t>(x[c * g.S]);
      WelfordLanes<acc_t, L> lanes;
      Welford& out = partial[task];
      visit_channel_groups<L, 1, scalar_t>(
          {x}, g, c, n0, n1,
          [&](const std::array<const scalar_t*, 1>& q, int64_t groups) {
            lanes.push(q[0], groups, shift);
          },
          [&](const std::array<const scalar_t*, 1>& q, int count) {
            for (int i = 0; i < count; ++i) out.push(static_cast<double>(q[0][i]));
          });
      lanes.merge_into(out, shift);
    }
  });
  fold_welford_partials(partial, g.C, P, P, 1, mean_out, m2_out);
}

template <typename scalar_t, typename acc_t>
void welford_stats_channels_last(
    const scalar_t* x, const Geometry& g, acc_t* mean_out, acc_t* m2_out) {
  const int64_t rows = g.N * g.S, C = g.C;
  const int64_t chunks = row_chunks(rows);
  std::vector<acc_t> shift(C);
  for (int64_t c = 0; c < C; ++c) shift[c] = to_acc<acc_t>(x[c]);
  std::vector<Welford> partial(chunks * C);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> mean(C), m2(C);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t r0 = rows * chunk / chunks, r1 = rows * (chunk + 1) / chunks;
      std::fill(mean.begin(), mean.end(), acc_t(0));
      std::fill(m2.begin(), m2.end(), acc_t(0));
      acc_t* __restrict mp = mean.data();
      acc_t* __restrict vp = m2.data();
      const acc_t* __restrict sp = shift.data();
      int64_t n = 0;
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* __restrict row = x + r * C;
        const acc_t inv = acc_t(1) / static_cast<acc_t>(++n);
#pragma GCC ivdep
        for (int64_t c = 0; c < C; ++c) {
          const acc_t y = to_acc<acc_t>(row[c]) - sp[c];
          const acc_t d = y - mp[c];
          mp[c] += d * inv;
          vp[c] += d * (y - mp[c]);
        }
      }
      for (int64_t c = 0; c < C; ++c) {
        partial[chunk * C + c].merge(
            static_cast<double>(n), static_cast<double>(sp[c]) + mp[c], vp[c]);
      }
    }
  });
  fold_welford_partials(partial, C, chunks, 1, C, mean_out, m2_out);
}

// Counts are read at counts[w * count_stride], rank w's means and m2s at [w * row_stride + c]: the
// same code merges separate [W] / [W, C] tensors and the packed rows of the gathered buffer.
template <typename acc_t>
void chan_merge(
    const acc_t* counts, int64_t count_stride, const acc_t* means, const acc_t* m2s,
    int64_t row_stride, int64_t W, int64_t C, double eps, bool unbiased, acc_t* mean_out,
    acc_t* invstd_out, acc_t* var_out) {
  at::parallel_for(0, C, 256, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      // Two passes over the W ranks in double: the weighted mean first, then the deviations
      // of the rank means from it, which stay accurate when the mean is far from zero.
      double n = 0, sum = 0;
      for (int64_t w = 0; w < W; ++w) {
        const double nw = counts[w * count_stride];
        n += nw;
        sum += nw * static_cast<double>(means[w * row_stride + c]);
      }
      const double mean = sum / std::max(n, 1.0);
      double m2 = 0;
      for (int64_t w = 0; w < W; ++w) {
        const double nw = counts[w * count_stride];
        if (nw == 0) continue;
        const double d = static_cast<double>(means[w * row_stride + c]) - mean;
        m2 += static_cast<double>(m2s[w * row_stride + c]) + nw * d * d;
      }
      mean_out[c] = static_cast<acc_t>(mean);
      invstd_out[c] = static_cast<acc_t>(1.0 / std::sqrt(m2 / std::max(n, 1.0) + eps));
      var_out[c] = static_cast<acc_t>(m2 / std::max(unbiased ? n - 1 : n, 1.0));
    }
  });
}

// Per-channel affine coefficients: y = (x - mean) * scale + shift.
template <typename acc_t>
struct Affine {
  std::vector<acc_t> mean, scale, shift;
};

template <typename acc_t>
Affine<acc_t> normalize_coefficients(
    const acc_t* mean, const acc_t* invstd, const acc_t* weight, const acc_t* bias, int64_t C) {
  Affine<acc_t> a{std::vector<acc_t>(mean, mean + C), std::vector<acc_t>(C), std::vector<acc_t>(C)};
  for (int64_t c = 0; c < C; ++c) {
    a.scale[c] = invstd[c] * (weight ? weight[c] : acc_t(1));
    a.shift[c] = bias ? bias[c] : acc_t(0);
  }
  return a;
}

// The activation's z coefficients for the backward kernels (empty without an activation).
template <typename acc_t>
Affine<acc_t> z_affine(const ActAffine& act, const acc_t* mean, int64_t C) {
  if (act.act.identity()) return {};
  return normalize_coefficients<acc_t>(
      mean, act.invstd.const_data_ptr<acc_t>(), data_or_null<acc_t>(act.weight),
      data_or_null<acc_t>(act.bias), C);
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
  std::vector<acc_t> mean, iw, mean_dy, k;
};

template <typename acc_t>
BackwardCoefficients<acc_t> backward_coefficients(
    const acc_t* mean, const acc_t* invstd, const acc_t* weight, const acc_t* sum_dy,
    const acc_t* sum_dy_xmu, double count, int64_t C) {
  BackwardCoefficients<acc_t> b{
      std::vector<acc_t>(mean, mean + C), std::vector<acc_t>(C), std::vector<acc_t>(C),
      std::vector<acc_t>(C)};
  const double inv_n = 1.0 / std::max(count, 1.0);
  for (int64_t c = 0; c < C; ++c) {
    const double is = invstd[c];
    b.iw[c] = static_cast<acc_t>(is * (weight ? static_cast<double>(weight[c]) : 1.0));
    b.mean_dy[c] = static_cast<acc_t>(sum_dy[c] * inv_n);
    b.k[c] = static_cast<acc_t>(sum_dy_xmu[c] * inv_n * is * is);
  }
  return b;
}

template <typename scalar_t, typename acc_t, typename Act>
void normalize_kernel(
    const scalar_t* x, scalar_t* y, const Geometry& g, const Affine<acc_t>& a, const Act& act) {
  if (g.layout == Layout::kChannelsFirst) {
    const int64_t S = g.S;
    at::parallel_for(0, g.N * g.C, std::max<int64_t>(1, kElemGrain / S), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int64_t c = r % g.C;
        const acc_t m = a.mean[c], sc = a.scale[c], sh = a.shift[c];
        const scalar_t* __restrict xr = x + r * S;
        scalar_t* __restrict yr = y + r * S;
        for (int64_t s = 0; s < S; ++s) {
          yr[s] = from_acc<scalar_t>(act.forward((to_acc<acc_t>(xr[s]) - m) * sc + sh));
        }
      }
    });
  } else {
    const int64_t C = g.C;
    const acc_t* __restrict mp = a.mean.data();
    const acc_t* __restrict scp = a.scale.data();
    const acc_t* __restrict shp = a.shift.data();
    at::parallel_for(0, g.N * g.S, std::max<int64_t>(1, kElemGrain / C), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* __restrict xr = x + r * C;
        scalar_t* __restrict yr = y + r * C;
#pragma GCC ivdep
        for (int64_t c = 0; c < C; ++c) {
          yr[c] = from_acc<scalar_t>(act.forward((to_acc<acc_t>(xr[c]) - mp[c]) * scp[c] + shp[c]));
        }
      }
    });
  }
}

// With an activation, `z` holds its per-channel coefficients (see act_input_grad).
template <typename scalar_t, typename acc_t, typename Act>
void backward_reduce_channels_first(
    const scalar_t* dy, const scalar_t* x, const acc_t* mean, const Geometry& g, acc_t* sum_dy,
    acc_t* sum_dy_xmu, const Affine<acc_t>& z, const Act& act) {
  constexpr int L = kLanes<acc_t>;
  const int64_t P = row_splits(g);
  std::vector<double> part_dy(g.C * P), part_dyx(g.C * P);
  at::parallel_for(0, g.C * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task / P, p = task % P;
      const int64_t n0 = g.N * p / P, n1 = g.N * (p + 1) / P;
      const acc_t m = mean[c];
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
                const acc_t xm = to_acc<acc_t>(v[l]) - m;
                const acc_t dv = act_input_grad(act, to_acc<acc_t>(d[l]), xm, sc, sh);
                a_dy[l] += dv;
                a_dyx[l] += dv * xm;
              }
              if (++pending == kFlushGroups) flush();
            }
          },
          [&](const std::array<const scalar_t*, 2>& q, int count) {
            for (int i = 0; i < count; ++i) {
              const acc_t xm = to_acc<acc_t>(q[1][i]) - m;
              const double dv = act_input_grad(act, static_cast<double>(q[0][i]), double(xm), double(sc), double(sh));
              t_dy += dv;
              t_dyx += dv * (static_cast<double>(q[1][i]) - m);
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
    const scalar_t* dy, const scalar_t* x, const acc_t* mean, const Geometry& g, acc_t* sum_dy,
    acc_t* sum_dy_xmu, const Affine<acc_t>& z, const Act& act) {
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
            const acc_t xm = to_acc<acc_t>(v[c]) - mean[c];
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
        const acc_t m = b.mean[c], iw = b.iw[c], mdy = b.mean_dy[c], k = b.k[c];
        const auto [sc, sh] = z_coefficients<Act>(z, c);
        const scalar_t* __restrict d = dy + r * S;
        const scalar_t* __restrict v = x + r * S;
        scalar_t* __restrict o = dx + r * S;
        for (int64_t s = 0; s < S; ++s) {
          const acc_t xm = to_acc<acc_t>(v[s]) - m;
          const acc_t dz = act_input_grad(act, to_acc<acc_t>(d[s]), xm, sc, sh);
          o[s] = from_acc<scalar_t>((dz - mdy - xm * k) * iw);
        }
      }
    });
  } else {
    const int64_t C = g.C;
    const acc_t* __restrict mp = b.mean.data();
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
          const acc_t xm = to_acc<acc_t>(v[c]) - mp[c];
          const auto [sc, sh] = z_coefficients<Act>(z, c);
          const acc_t dz = act_input_grad(act, to_acc<acc_t>(d[c]), xm, sc, sh);
          o[c] = from_acc<scalar_t>((dz - mdyp[c] - xm * kp[c]) * iwp[c]);
        }
      }
    });
  }
}

// ------------------------------------------------------------------------------------------------
// Host entry points: argument checks, layout, dtype dispatch
// ------------------------------------------------------------------------------------------------

}  // namespace

namespace detail {

void local_stats_into_cpu(const at::Tensor& input, Channels mean, Channels m2) {
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "local_stats_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    acc_t* m = mean.data<acc_t>();
    acc_t* q = m2.data<acc_t>();
    if (g.N * g.S == 0) {
      std::fill_n(m, g.C, acc_t(0));
      std::fill_n(q, g.C, acc_t(0));
      return;
    }
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    if (g.layout == Layout::kChannelsFirst) {
      welford_stats_channels_first<scalar_t, acc_t>(x, g, m, q);
    } else {
      welford_stats_channels_last<scalar_t, acc_t>(x, g, m, q);
    }
  });
}

void merge_rows_cpu(
    const at::Tensor& rows, int64_t W, int64_t C, double eps, bool unbiased, at::Tensor& mean,
    at::Tensor& invstd, at::Tensor& var) {
  const int64_t width = row_width(C);
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "merge_rows_cpu", [&] {
    const scalar_t* r = rows.const_data_ptr<scalar_t>();
    chan_merge<scalar_t>(
        r, width, r + kRowHeader, r + kRowHeader + C, width, W, C, eps, unbiased,
        mean.mutable_data_ptr<scalar_t>(), invstd.mutable_data_ptr<scalar_t>(),
        var.mutable_data_ptr<scalar_t>());
  });
}

void backward_sums_into_cpu(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean, Channels sum_dy,
    Channels sum_dy_xmu, const ActAffine& act) {
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "backward_reduce_cpu", [&] {
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
    const Affine<acc_t> z = z_affine<acc_t>(act, m, g.C);
    with_activation<acc_t>(act.act, [&](const auto& a) {
      if (g.layout == Layout::kChannelsFirst) {
        backward_reduce_channels_first<scalar_t, acc_t>(dy, x, m, g, dy_sum, dy_xmu_sum, z, a);
      } else {
        backward_reduce_channels_last<scalar_t, acc_t>(dy, x, m, g, dy_sum, dy_xmu_sum, z, a);
      }
    });
  });
}

at::Tensor backward_elemt_checked_cpu(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& mean_,
    const at::Tensor& invstd_, const c10::optional<at::Tensor>& weight, Channels sum_dy,
    Channels sum_dy_xmu, double count, const ActAffine& act) {
  const at::Tensor input = dense_input(input_);
  const at::Tensor grad_out = with_strides_of(grad_out_, input);
  const at::Tensor mean = mean_.contiguous(), invstd = invstd_.contiguous();
  const at::Tensor w = optional_acc(weight, "weight", input);
  at::Tensor grad_in = at::empty_like(input);
  if (input.numel() == 0) return grad_in;
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "backward_elemt_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto coeff = backward_coefficients<acc_t>(
        mean.const_data_ptr<acc_t>(), invstd.const_data_ptr<acc_t>(), data_or_null<acc_t>(w),
        sum_dy.data<acc_t>(), sum_dy_xmu.data<acc_t>(), count, g.C);
    const Affine<acc_t> z = z_affine<acc_t>(act, mean.const_data_ptr<acc_t>(), g.C);
    with_activation<acc_t>(act.act, [&](const auto& a) {
      backward_elemt_kernel<scalar_t, acc_t>(
          grad_out.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
          grad_in.mutable_data_ptr<scalar_t>(), g, coeff, z, a);
    });
  });
  return grad_in;
}

}  // namespace detail

std::tuple<at::Tensor, at::Tensor> local_stats_cpu(const at::Tensor& input_) {
  check_input(input_, c10::DeviceType::CPU);
  const at::Tensor input = dense_input(input_);
  const auto opts = input.options().dtype(acc_dtype_of(input.scalar_type()));
  at::Tensor mean = at::empty({input.size(1)}, opts);
  at::Tensor m2 = at::empty({input.size(1)}, opts);
  local_stats_into_cpu(input, {mean}, {m2});
  return {mean, m2};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_stats_cpu(
    const at::Tensor& counts_, const at::Tensor& means_, const at::Tensor& m2s_, double eps,
    bool unbiased) {
  check_merge_inputs(counts_, means_, m2s_, eps, c10::DeviceType::CPU);
  const int64_t W = counts_.size(0);
  const auto acc = means_.scalar_type();
  const at::Tensor counts = counts_.contiguous(), means = means_.contiguous(), m2s = m2s_.contiguous();
  const int64_t C = means.size(1);
  at::Tensor mean = at::empty({C}, means.options());
  at::Tensor invstd = at::empty({C}, means.options());
  at::Tensor var = at::empty({C}, means.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "merge_stats_cpu", [&] {
    chan_merge<scalar_t>(
        counts.const_data_ptr<scalar_t>(), 1, means.const_data_ptr<scalar_t>(),
        m2s.const_data_ptr<scalar_t>(), C, W, C, eps, unbiased, mean.mutable_data_ptr<scalar_t>(),
        invstd.mutable_data_ptr<scalar_t>(), var.mutable_data_ptr<scalar_t>());
  });
  return {mean, invstd, var};
}

at::Tensor normalize_cpu(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias) {
  check_normalize_args(input, mean, invstd, c10::DeviceType::CPU);
  return normalize_checked_cpu(input, mean, invstd, weight, bias, Activation{});
}

namespace detail {

at::Tensor normalize_checked_cpu(
    const at::Tensor& input_, const at::Tensor& mean_, const at::Tensor& invstd_,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    const Activation& act) {
  const at::Tensor input = dense_input(input_);
  const at::Tensor mean = mean_.contiguous(), invstd = invstd_.contiguous();
  const at::Tensor w = optional_acc(weight, "weight", input);
  const at::Tensor b = optional_acc(bias, "bias", input);
  at::Tensor output = at::empty_like(input);
  if (input.numel() == 0) return output;
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "normalize_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto coeff = normalize_coefficients<acc_t>(
        mean.const_data_ptr<acc_t>(), invstd.const_data_ptr<acc_t>(), data_or_null<acc_t>(w),
        data_or_null<acc_t>(b), g.C);
    with_activation<acc_t>(act, [&](const auto& a) {
      normalize_kernel<scalar_t, acc_t>(
          input.const_data_ptr<scalar_t>(), output.mutable_data_ptr<scalar_t>(), g, coeff, a);
    });
  });
  return output;
}

}  // namespace detail

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_reduce_cpu(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& mean_,
    const at::Tensor& invstd_, const c10::optional<at::Tensor>& weight, bool weight_grad,
    bool bias_grad) {
  check_backward_args(grad_out_, input_, mean_, invstd_, c10::DeviceType::CPU);
  const at::Tensor input = dense_input(input_);
  const at::Tensor grad_out = with_strides_of(grad_out_, input);
  const at::Tensor mean = mean_.contiguous(), invstd = invstd_.contiguous();
  at::Tensor sum_dy = at::empty({input.size(1)}, mean.options());
  at::Tensor sum_dy_xmu = at::empty({input.size(1)}, mean.options());
  backward_sums_into_cpu(grad_out, input, mean, {sum_dy}, {sum_dy_xmu});
  return with_param_grads(sum_dy, sum_dy_xmu, invstd, weight, input, weight_grad, bias_grad);
}

at::Tensor backward_elemt_cpu(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& mean_,
    const at::Tensor& invstd_, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy_,
    const at::Tensor& sum_dy_xmu_, const at::Tensor& count) {
  check_backward_args(grad_out_, input_, mean_, invstd_, c10::DeviceType::CPU);
  check_channel_vector(sum_dy_, "sum_dy", input_, true);
  check_channel_vector(sum_dy_xmu_, "sum_dy_xmu", input_, true);
  check_count(count, input_);
  return backward_elemt_checked_cpu(
      grad_out_, input_, mean_, invstd_, weight, {sum_dy_.contiguous()}, {sum_dy_xmu_.contiguous()},
      count.item<double>());
}

}  // namespace syncbn
