// The reduce exchange's arithmetic, host and device code (entry_reduce_cpu.cpp, reduce_cuda.cu):
// the vector's header (the 12-bit tag chunks and the running mean's fingerprint), the checks of
// the summed vector, and the merge of one channel. See syncbn.h for the vector's layout.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace syncbn {

// The fingerprint's key of one float64 shift value: its bits folded to [0, 65521).
SYNCBN_HOST_DEVICE int64_t shift_key(double k) {
  uint64_t bits;
  memcpy(&bits, &k, sizeof(bits));
  const uint64_t lo = bits & 0xFFFFFFFFull, hi = bits >> 32;
  return static_cast<int64_t>((lo * 31 + hi) % 65521);
}

// Channel c's term of the fingerprint sum_c key_c * (c % 65521 + 1) (then mod 2^24).
SYNCBN_HOST_DEVICE int64_t shift_term(double k, int64_t c) {
  return shift_key(k) * (c % 65521 + 1);
}

// Writes [count, samples, nonempty, then (chunk, chunk^2) for the high and low 12 bits of the
// layer tag, the call tag and the fingerprint] into out[0..15).
SYNCBN_HOST_DEVICE void write_reduce_header(
    double* out, int64_t count, int64_t samples, int64_t layer_tag, int64_t call,
    int64_t fingerprint) {
  constexpr int64_t kTags = int64_t(1) << 24, kBase = int64_t(1) << 12;
  out[0] = static_cast<double>(count);
  out[1] = static_cast<double>(samples);
  out[2] = count > 0 ? 1.0 : 0.0;
  const int64_t values[3] = {layer_tag % kTags, call % kTags, fingerprint % kTags};
  for (int i = 0; i < 3; ++i) {
    const double parts[2] = {
        static_cast<double>(values[i] / kBase), static_cast<double>(values[i] % kBase)};
    for (int j = 0; j < 2; ++j) {
      out[3 + 4 * i + 2 * j] = parts[j];
      out[4 + 4 * i + 2 * j] = parts[j] * parts[j];
    }
  }
}

// Whether every rank sent this rank's tag chunks (`order_ok`, fields 3..10) and fingerprint
// (`shift_ok`, fields 11..14): sum(c) == P c and sum(c^2) == P c^2 for each.
struct ReduceChecks {
  bool order_ok, shift_ok;
};

SYNCBN_HOST_DEVICE ReduceChecks reduce_checks(
    const double* total, const double* sent, int64_t world_size) {
  ReduceChecks r{true, true};
  for (int i = 3; i < 15; ++i) {
    const bool same = total[i] == sent[i] * static_cast<double>(world_size);
    if (i < 11) {
      r.order_ok = r.order_ok && same;
    } else {
      r.shift_ok = r.shift_ok && same;
    }
  }
  return r;
}

// This rank's layer and call tags, rebuilt from their chunks in `sent`.
SYNCBN_HOST_DEVICE void reduce_tags(const double* sent, double* layer, double* call) {
  *layer = sent[3] * 4096.0 + sent[5];
  *call = sent[7] * 4096.0 + sent[9];
}

// Channel c of the summed vector (C channels): mean = K + S1 / D, biased var = S2 / D - (S1 /
// D)^2 clamped at 0, running var * n / (n - 1) when unbiased; D = the group's count, or its
// non-empty ranks with equal rank weights; an empty group gives mean 0, var 0.
struct ReducedChannel {
  double mean, invstd, var;
};

SYNCBN_HOST_DEVICE ReducedChannel reduce_channel(
    const double* total, int64_t C, int64_t c, double shift, bool equal_rank_weights, double eps,
    bool unbiased) {
  const double n = total[0];
  const double divisor = fmax(equal_rank_weights ? total[2] : n, 1.0);
  const double d = total[15 + c] / divisor;
  const double biased = fmax(total[15 + C + c] / divisor - d * d, 0.0);
  return {
      n > 0 ? shift + d : 0.0, 1.0 / sqrt(biased + eps),
      unbiased ? biased * (n / fmax(n - 1, 1.0)) : biased};
}

}  // namespace syncbn
