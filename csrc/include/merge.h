// Count-weighted (Chan) merge of one channel's per-rank statistics, host and device code. The CUDA
// kernel of the merge primitive merges a channel with merge_channel; the CPU merge (stats_cpu.cpp)
// shares its second pass, merged_m2. (The CPU's first pass sums every rank's count * mean, as the
// reference does; merge_channel skips ranks with count 0, whose rows may hold anything on the
// GPU.) The fused merge of gathered rows (CPU and CUDA) merges with merge_row_channel: rank means
// split into two numbers, and equal rank weights.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace syncbn {

struct MergedChannel {
  double n, mean, m2;

  // mean, invstd = 1 / sqrt(m2 / n + eps) and the running-stat var (m2 / (n - 1) or m2 / n);
  // denominators clamped to >= 1, so an all-empty group gives mean 0, var 0, invstd 1/sqrt(eps).
  template <typename acc_t>
  SYNCBN_HOST_DEVICE void store(
      int64_t c, double eps, bool unbiased, acc_t* mean_out, acc_t* invstd_out,
      acc_t* var_out) const {
    mean_out[c] = static_cast<acc_t>(mean);
    invstd_out[c] = static_cast<acc_t>(1.0 / sqrt(m2 / fmax(n, 1.0) + eps));
    var_out[c] = static_cast<acc_t>(m2 / fmax(unbiased ? n - 1 : n, 1.0));
  }
};

// Whether v is neither NaN nor +-inf (v - v is 0 exactly then; NaN otherwise), without relying on
// which isfinite overloads the device and host math headers declare.
SYNCBN_HOST_DEVICE bool is_finite_value(double v) { return v - v == 0.0; }

// The second pass of a channel's merge: the sum over the ranks with a nonzero count of m2s[w] +
// counts[w] * (means[w] - mean)^2, in double. The deviations of the rank means from the merged
// mean stay accurate when the mean is far from zero. Strides as in merge_channel.
template <typename acc_t>
SYNCBN_HOST_DEVICE double merged_m2(
    const acc_t* counts, int64_t count_stride, const acc_t* means, const acc_t* m2s,
    int64_t row_stride, int64_t W, int64_t c, double mean) {
  double m2 = 0;
  for (int64_t w = 0; w < W; ++w) {
    const double nw = counts[w * count_stride];
    if (nw == 0) continue;
    const double d = static_cast<double>(means[w * row_stride + c]) - mean;
    m2 += static_cast<double>(m2s[w * row_stride + c]) + nw * d * d;
  }
  return m2;
}

// Channel c of W ranks: rank w's count at counts[w * count_stride], its mean and m2 at
// means[w * row_stride + c] and m2s[w * row_stride + c]. In double; ranks with count 0 are skipped
// (their rows may hold anything). Two passes: the weighted mean first, then merged_m2.
template <typename acc_t>
SYNCBN_HOST_DEVICE MergedChannel merge_channel(
    const acc_t* counts, int64_t count_stride, const acc_t* means, const acc_t* m2s,
    int64_t row_stride, int64_t W, int64_t c) {
  double n = 0, sum = 0;
  for (int64_t w = 0; w < W; ++w) {
    const double nw = counts[w * count_stride];
    if (nw == 0) continue;
    n += nw;
    sum += nw * static_cast<double>(means[w * row_stride + c]);
  }
  const double mean = sum / fmax(n, 1.0);
  return {n, mean, merged_m2(counts, count_stride, means, m2s, row_stride, W, c, mean)};
}

// Channel c of the W gathered rows [count, samples, tag, tag, mean[C], mean_lo[C], m2[C]] (row
// stride `width`), in double: rank w's mean is mean[c] + mean_lo[c]. Ranks with count 0 are
// skipped. `total` is the group's count (the sum of the rows' counts); with `equal_rank_weights`
// each of the `ranks` non-empty ranks weighs total / ranks, its m2 scaled to that count (mmcv's
// stats_mode="default": mean = the mean of the rank means, var = the mean of var_r + (mean_r -
// mean)^2), else each weighs its count.
template <typename acc_t>
SYNCBN_HOST_DEVICE MergedChannel merge_row_channel(
    const acc_t* rows, int64_t width, int64_t W, int64_t C, int64_t c, double total, double ranks,
    bool equal_rank_weights) {
  const double share = total / fmax(ranks, 1.0);
  double sum = 0;
  for (int64_t w = 0; w < W; ++w) {
    const acc_t* row = rows + w * width;
    const double nw = row[0];
    if (nw == 0) continue;
    const double mean_w = static_cast<double>(row[4 + c]) + static_cast<double>(row[4 + C + c]);
    sum += (equal_rank_weights ? share : nw) * mean_w;
  }
  const double mean = sum / fmax(total, 1.0);
  double m2 = 0;
  for (int64_t w = 0; w < W; ++w) {
    const acc_t* row = rows + w * width;
    const double nw = row[0];
    if (nw == 0) continue;
    const double weight = equal_rank_weights ? share : nw;
    const double d = static_cast<double>(row[4 + c]) + static_cast<double>(row[4 + C + c]) - mean;
    m2 += static_cast<double>(row[4 + 2 * C + c]) * (weight / nw) + weight * d * d;
  }
  return {total, mean, m2};
}

}  // namespace syncbn
