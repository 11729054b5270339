// CPU kernels of the statistics (see syncbn.h for the maths): per-channel Welford statistics of
// the local batch, the fold of per-thread partials, the count-weighted (Chan) merge of per-rank
// statistics, and the reduce exchange's shifted float64 sums. Layout of this file: helpers,
// kernels, dispatch.
//
// Statistics accumulate in acc_t (float for half/bfloat16/float, double for double) and partial
// results from lanes, threads and chunks are merged in double with Chan's formula.
#include "cpu_kernels.h"
#include "merge.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace syncbn {
namespace {

using namespace detail;

// ------------------------------------------------------------------------------------------------
// Helpers
// ------------------------------------------------------------------------------------------------

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

  // The lanes share one count n, so their merge is closed-form (Chan's formula for L equal
  // parts): mean = sum(mean_l) / L, m2 = sum(m2_l) + n * sum((mean_l - mean)^2). One division
  // instead of two per lane in a dependent chain, which on a small channel cost more than the
  // pushes (about 0.3 us per channel at L = 32).
  void merge_into(Welford& out, acc_t shift) const {
    if (n == 0) return;
    double sum = 0;
    for (int l = 0; l < L; ++l) sum += static_cast<double>(mean[l]);
    const double lanes_mean = sum / L;
    double m2_sum = 0, spread = 0;
    for (int l = 0; l < L; ++l) {
      const double d = static_cast<double>(mean[l]) - lanes_mean;
      spread += d * d;
      m2_sum += static_cast<double>(m2[l]);
    }
    const double count = static_cast<double>(n);
    out.merge(count * L, static_cast<double>(shift) + lanes_mean, m2_sum + count * spread);
  }
};

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

// Where the statistics go: [C] outputs in the acc dtype, mean_lo optional (null: not written).
template <typename acc_t>
struct StatsOut {
  acc_t* mean;
  acc_t* m2;
  acc_t* mean_lo;
};

// Folds the Welford partials part[c * c_stride + p * p_stride], p < parts, into per-channel
// (mean, m2) with Chan's merge; the double mean rounded to mean and its remainder to mean_lo.
template <typename acc_t>
void fold_welford_partials(
    const std::vector<Welford>& part, int64_t C, int64_t parts, int64_t c_stride,
    int64_t p_stride, const StatsOut<acc_t>& out) {
  for (int64_t c = 0; c < C; ++c) {
    Welford w;
    for (int64_t p = 0; p < parts; ++p) w.merge(part[c * c_stride + p * p_stride]);
    out.mean[c] = static_cast<acc_t>(w.mean);
    out.m2[c] = static_cast<acc_t>(w.m2);
    if (out.mean_lo) out.mean_lo[c] = static_cast<acc_t>(w.mean - static_cast<double>(out.mean[c]));
  }
}

template <typename scalar_t, typename acc_t>
void welford_stats_channels_first(const scalar_t* x, const Geometry& g, const StatsOut<acc_t>& out) {
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
  fold_welford_partials(partial, g.C, P, P, 1, out);
}

template <typename scalar_t, typename acc_t>
void welford_stats_channels_last(const scalar_t* x, const Geometry& g, const StatsOut<acc_t>& out) {
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
  fold_welford_partials(partial, C, chunks, 1, C, out);
}

// Lanes of the float64 sums: 16 doubles, four AVX2 registers per sum.
constexpr int kSumLanes = 16;

// S1[c] = sum(x - K[c]) and S2[c] = sum((x - K[c])^2) over channel c, in double (K null: 0).
// Lanes, then the row splits in a fixed order: the same bits whatever the thread schedule.
template <typename scalar_t>
void shifted_sums_channels_first(
    const scalar_t* x, const Geometry& g, const double* shift, double* s1, double* s2) {
  constexpr int L = kSumLanes;
  const int64_t P = row_splits(g);
  std::vector<double> part1(g.C * P), part2(g.C * P);
  at::parallel_for(0, g.C * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task / P, p = task % P;
      const int64_t n0 = g.N * p / P, n1 = g.N * (p + 1) / P;
      const double k = shift ? shift[c] : 0.0;
      double a1[L] = {}, a2[L] = {};
      double t1 = 0, t2 = 0;
      visit_channel_groups<L, 1, scalar_t>(
          {x}, g, c, n0, n1,
          [&](const std::array<const scalar_t*, 1>& q, int64_t groups) {
            for (int64_t gi = 0; gi < groups; ++gi) {
              const scalar_t* __restrict v = q[0] + gi * L;
#pragma GCC ivdep
              for (int l = 0; l < L; ++l) {
                const double d = static_cast<double>(to_acc<at::opmath_type<scalar_t>>(v[l])) - k;
                a1[l] += d;
                a2[l] += d * d;
              }
            }
          },
          [&](const std::array<const scalar_t*, 1>& q, int count) {
            for (int i = 0; i < count; ++i) {
              const double d = static_cast<double>(q[0][i]) - k;
              t1 += d;
              t2 += d * d;
            }
          });
      for (int l = 0; l < L; ++l) t1 += a1[l], t2 += a2[l];
      part1[task] = t1;
      part2[task] = t2;
    }
  });
  for (int64_t c = 0; c < g.C; ++c) {
    double t1 = 0, t2 = 0;
    for (int64_t p = 0; p < P; ++p) t1 += part1[c * P + p], t2 += part2[c * P + p];
    s1[c] = t1;
    s2[c] = t2;
  }
}

template <typename scalar_t>
void shifted_sums_channels_last(
    const scalar_t* x, const Geometry& g, const double* shift, double* s1, double* s2) {
  const int64_t rows = g.N * g.S, C = g.C;
  const int64_t chunks = row_chunks(rows);
  std::vector<double> part1(chunks * C, 0.0), part2(chunks * C, 0.0), k(C, 0.0);
  if (shift) std::copy(shift, shift + C, k.begin());
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t r0 = rows * chunk / chunks, r1 = rows * (chunk + 1) / chunks;
      double* __restrict p1 = part1.data() + chunk * C;
      double* __restrict p2 = part2.data() + chunk * C;
      const double* __restrict kp = k.data();
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* __restrict row = x + r * C;
#pragma GCC ivdep
        for (int64_t c = 0; c < C; ++c) {
          const double d = static_cast<double>(to_acc<at::opmath_type<scalar_t>>(row[c])) - kp[c];
          p1[c] += d;
          p2[c] += d * d;
        }
      }
    }
  });
  for (int64_t c = 0; c < C; ++c) {
    double t1 = 0, t2 = 0;
    for (int64_t p = 0; p < chunks; ++p) t1 += part1[p * C + c], t2 += part2[p * C + c];
    s1[c] = t1;
    s2[c] = t2;
  }
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
      // of the rank means from it (merged_m2), which stay accurate when the mean is far from zero.
      double n = 0, sum = 0;
      for (int64_t w = 0; w < W; ++w) {
        const double nw = counts[w * count_stride];
        n += nw;
        sum += nw * static_cast<double>(means[w * row_stride + c]);
      }
      const double mean = sum / std::max(n, 1.0);
      const double m2 = merged_m2(counts, count_stride, means, m2s, row_stride, W, c, mean);
      mean_out[c] = static_cast<acc_t>(mean);
      invstd_out[c] = static_cast<acc_t>(1.0 / std::sqrt(m2 / std::max(n, 1.0) + eps));
      var_out[c] = static_cast<acc_t>(m2 / std::max(unbiased ? n - 1 : n, 1.0));
    }
  });
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Dispatch: dtype, layout
// ------------------------------------------------------------------------------------------------

namespace detail {

void local_stats_into_cpu(
    const at::Tensor& input, Channels mean, Channels m2, const Channels* mean_lo) {
  if (is_reduced_precision(input)) {  // the float32 kernel (cpu_kernels.h)
    return local_stats_into_cpu(as_float(input), mean, m2, mean_lo);
  }
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "local_stats_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const StatsOut<acc_t> out{
        mean.data<acc_t>(), m2.data<acc_t>(), mean_lo ? mean_lo->data<acc_t>() : nullptr};
    if (g.N * g.S == 0) {
      std::fill_n(out.mean, g.C, acc_t(0));
      std::fill_n(out.m2, g.C, acc_t(0));
      if (out.mean_lo) std::fill_n(out.mean_lo, g.C, acc_t(0));
      return;
    }
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    if (g.layout == Layout::kChannelsFirst) {
      welford_stats_channels_first<scalar_t, acc_t>(x, g, out);
    } else {
      welford_stats_channels_last<scalar_t, acc_t>(x, g, out);
    }
  });
}

void shifted_sums_into_cpu(
    const at::Tensor& input, const at::Tensor& shift64, double* s1, double* s2) {
  if (is_reduced_precision(input)) {  // the float32 kernel (cpu_kernels.h)
    return shifted_sums_into_cpu(as_float(input), shift64, s1, s2);
  }
  const Geometry g = geometry_of(input);
  if (g.N * g.S == 0) {
    std::fill_n(s1, g.C, 0.0);
    std::fill_n(s2, g.C, 0.0);
    return;
  }
  const double* k = shift64.defined() ? shift64.const_data_ptr<double>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "reduce_sums_cpu", [&] {
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    if (g.layout == Layout::kChannelsFirst) {
      shifted_sums_channels_first<scalar_t>(x, g, k, s1, s2);
    } else {
      shifted_sums_channels_last<scalar_t>(x, g, k, s1, s2);
    }
  });
}

void merge_stats_into_cpu(const MergeStatsArgs& args, double eps, bool unbiased) {
  AT_DISPATCH_FLOATING_TYPES(args.means.scalar_type(), "merge_stats_cpu", [&] {
    chan_merge<scalar_t>(
        args.counts.const_data_ptr<scalar_t>(), 1, args.means.const_data_ptr<scalar_t>(),
        args.m2s.const_data_ptr<scalar_t>(), args.C, args.W, args.C, eps, unbiased,
        args.mean.mutable_data_ptr<scalar_t>(), args.invstd.mutable_data_ptr<scalar_t>(),
        args.var.mutable_data_ptr<scalar_t>());
  });
}

}  // namespace detail
}  // namespace syncbn
