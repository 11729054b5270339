// Helpers shared by the CPU kernels (stats_cpu.cpp, normalize_cpu.cpp, backward_cpu.cpp): launch
// constants, storage <-> accumulation conversions, the channels-first group visitor, the splits of
// the work over threads, and per-channel affine coefficients. See syncbn.h for the maths.
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
//
// Like the kernels, everything here has internal linkage (an unnamed namespace): each kernel file
// instantiates the templates it runs.
#pragma once

#include "common.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
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

// float16 and bfloat16 inputs are computed by the float32 kernels, on float32 copies: the kernels
// read every value into acc_t (float32 for these too) and round only what they store, which the
// copy back rounds alike, so the results are the same, and each kernel is compiled for two dtypes
// instead of four (the first build's time; CPU half-precision training is rare).
inline bool is_reduced_precision(const at::Tensor& t) {
  return t.defined() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16);
}

inline at::Tensor as_float(const at::Tensor& t) {
  return is_reduced_precision(t) ? t.to(at::kFloat) : t;
}

inline c10::optional<at::Tensor> as_float(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? c10::optional<at::Tensor>(as_float(*t)) : t;
}

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
inline int64_t row_splits(const Geometry& g) {
  const int64_t threads = at::get_num_threads();
  if (g.C >= threads || g.N <= 1) return 1;
  return std::min<int64_t>(g.N, (threads + g.C - 1) / g.C);
}

// Row chunks for channels-last reductions: one per thread, at least 16 rows each.
inline int64_t row_chunks(int64_t rows) {
  const int64_t threads = at::get_num_threads();
  return std::max<int64_t>(1, std::min<int64_t>(threads, rows / 16));
}

// Per-channel affine coefficients: y = ((x - mean) - mean_lo) * scale + shift (mean_lo 0 when the
// mean is not split; subtracting 0 changes no value).
template <typename acc_t>
struct Affine {
  std::vector<acc_t> mean, mean_lo, scale, shift;
};

template <typename acc_t>
Affine<acc_t> normalize_coefficients(
    const acc_t* mean, const acc_t* mean_lo, const acc_t* invstd, const acc_t* weight,
    const acc_t* bias, int64_t C) {
  Affine<acc_t> a{
      std::vector<acc_t>(mean, mean + C), std::vector<acc_t>(C, acc_t(0)), std::vector<acc_t>(C),
      std::vector<acc_t>(C)};
  if (mean_lo) std::copy(mean_lo, mean_lo + C, a.mean_lo.begin());
  for (int64_t c = 0; c < C; ++c) {
    a.scale[c] = invstd[c] * (weight ? weight[c] : acc_t(1));
    a.shift[c] = bias ? bias[c] : acc_t(0);
  }
  return a;
}

}  // namespace
}  // namespace syncbn
