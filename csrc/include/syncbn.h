// Declarations of the synchronized-BatchNorm primitives.
//
// Declarations only: the .cpp files include this without nvcc, and a build without CUDA compiles
// only the CPU sources. Every primitive and fused step has a `_cpu` twin and (when built with CUDA)
// a `_cuda` twin with one signature, declared once below as a function type; `bindings.cpp` (the
// primitives) and `ops.cpp` (the fused steps) dispatch on the input's device.
//
// Conventions shared by all primitives:
//   * input is (N, C, *) with N >= 0 and C >= 1, in channels-first (contiguous) or channels-last
//     (dense with stride(1) == 1) layout; other strides are made contiguous by the caller.
//   * "acc" dtype: float32 for float16/bfloat16/float32 inputs, float64 for float64 inputs.
//     All statistics are computed and returned in the acc dtype.
//   * outputs of elementwise primitives have the input's dtype and the input's exact strides.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Optional.h>

#include <tuple>

#include "activation.h"

namespace syncbn {

// Per-channel Welford statistics of the local batch.
// Returns (mean[C], m2[C]) with m2 = sum over the channel of (x - mean)^2. A channel with no
// elements (N == 0 or an empty spatial size) gets mean = 0 and m2 = 0.
using LocalStatsFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& input);

// Count-weighted (Chan et al.) merge of per-rank statistics.
// counts[W], means[W, C], m2s[W, C] (acc dtype). With n = sum(counts):
//   mean   = sum_w counts[w] * means[w] / n
//   m2     = sum_w m2s[w] + sum_w counts[w] * (means[w] - mean)^2
//   invstd = 1 / sqrt(m2 / n + eps)                 (biased variance: used to normalize)
//   var    = m2 / (n - 1) if unbiased else m2 / n   (the running-variance update)
// Ranks with counts[w] == 0 contribute nothing. Denominators are clamped to >= 1, so an
// all-empty group yields mean 0, var 0, invstd 1/sqrt(eps) instead of NaN.
using MergeStatsFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& counts, const at::Tensor& means, const at::Tensor& m2s, double eps,
    bool unbiased);

// y = (x - mean[c]) * invstd[c] * weight[c] + bias[c]  (weight/bias optional: 1 and 0).
using NormalizeFn = at::Tensor(
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias);

// Local backward reductions over the batch:
//   sum_dy[c]      = sum dy
//   sum_dy_xmu[c]  = sum dy * (x - mean[c])
//   grad_weight[c] = sum_dy_xmu[c] * invstd[c]   (if weight_grad, in the weight's dtype)
//   grad_bias[c]   = sum_dy[c]                   (if bias_grad, in the weight's dtype)
// sum_dy and sum_dy_xmu are always returned (acc dtype); skipped grads are undefined tensors.
using BackwardReduceFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, bool weight_grad,
    bool bias_grad);

// Input gradient from the group-wide sums (sum_dy, sum_dy_xmu all-reduced over the group) and the
// group-wide element count per channel `count` (one element, acc dtype):
//   dx = (dy - sum_dy/count - (x - mean) * invstd^2 * sum_dy_xmu/count) * invstd * weight
using BackwardElemtFn = at::Tensor(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
    const at::Tensor& sum_dy_xmu, const at::Tensor& count);

// ------------------------------------------------------------------------------------------------
// Fused steps of one synchronized layer call, registered as the `syncbn::` operators (ops.cpp).
// Each is one dispatcher call; the collectives between them are torch's. Two exchanges share the
// backward (grad_sums, grad_input):
//   * gather: stats_row -> all_gather -> merge_normalize;
//   * reduce: reduce_sums -> all_reduce (or all_gather) -> reduce_merge_normalize.
// Both merges keep the group mean in float64 and hand it on split into two acc-dtype numbers,
// mean + mean_lo; normalize and the backward use (x - mean) - mean_lo, exact for x near the mean,
// so the deviation keeps the acc dtype's relative precision even when |mean| >> std.
//
// Row layout of the gather exchange, per rank, in the acc dtype:
//   [count, samples, layer_tag, call_tag, mean[C], mean_lo[C], m2[C]]   (kRowHeader + 3 * C)
// count = values per channel (N * S), samples = N, the two tags identify the layer and its call
// for the call-order check, and the local mean is mean + mean_lo (the Welford mean, accumulated
// in double, split). The gathered buffer is W such rows back to back.
//
// Vector of the reduce exchange, per rank, float64 (summed over the group by the all-reduce, or
// all-gathered and summed in rank order by the merge, as the backward's sums in CPU groups):
//   [count, samples, nonempty, 6 x (chunk, chunk^2), S1[C], S2[C]]      (kReduceHeader + 2 * C)
// S1 = w * sum(x - K), S2 = w * sum((x - K)^2) with K the layer's running mean (0 without one)
// and w = 1, or 1 / count with equal rank weights; the chunks are the 12-bit halves of the layer
// tag, the call tag and K's fingerprint, each with its square: every rank checks sum(c) == P c
// and sum(c^2) == P c^2, true on one rank iff every rank sent c.
//
// Both merges return (output, mean, mean_lo, invstd, var, info, grad_info), info = [count,
// samples, order_ok, finite, layer_tag, call_tag] (acc dtype, group-wide; the tags of this call)
// and grad_info the same with the count the input gradient divides by (R * n_r with equal rank
// weights: each of this rank's n_r values weighs 1 / (R n_r), R the non-empty ranks).
//
// Sums of the backward, per rank, in the acc dtype (all-reduced, or all-gathered and summed in
// rank order by grad_input):
//   [header[16], sum_dy[C], sum_dy_xmu[C]]                              (kGradHeader + 2 * C)
// The header is the call's layer and call tags (grad_info[4], grad_info[5]) as 6-bit chunks, each
// followed by its square (grad_header.h): grad_input checks that the summed header is P times its
// own, true on one rank iff every rank sent the same call's sums.
// Common rules of the merges:
//   * call order: CPU throws an error starting with "syncbn call order:"; CUDA writes info[2] = 0
//     (checked later on the host).
//   * a group whose total count is 1 throws torch's "Expected more than 1 value per channel"
//     (CPU only: on CUDA it would need a host sync).
//   * running stats (all optional, updated in place, any floating dtype): unless the merged mean
//     or var has a NaN/inf, or the group is empty, running = lerp(running, batch, momentum or
//     1 / num_batches_tracked) with the unbiased (or biased) var, rounded from float64 to the
//     running dtype; num_batches_tracked += finite; nonfinite (int64 counter) += !finite.
//   * `act`, `act_param`: the activation applied to the normalized output (activation.h; 0 is
//     none), computed in the acc dtype before the single rounding to the input's dtype.
//   * `residual` (optional; the input's shape and dtype): added to the normalized output before
//     the activation, y = act(z + residual) (a ResNet block's tail: BN, add, activation).
// ------------------------------------------------------------------------------------------------

// The rank's row: local Welford statistics plus the header. `calls` (int64, one element, on the
// input's device) is the layer's call counter: its value is written as the call tag (mod 2^24) and
// it is incremented in place.
using StatsRowFn = at::Tensor(const at::Tensor& input, int64_t layer_tag, const at::Tensor& calls);

using MergedOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The layer's running statistics and counters a merge updates in place (each optional; the rules
// above).
struct RunningBuffers {
  c10::optional<at::Tensor> mean, var, num_batches_tracked, nonfinite;
};

// What a merge takes besides what it received: the input, the affine parameters, the running
// buffers, how to merge and update, and the fused tail (one struct, named fields).
// How a merge combines, updates and normalizes (the layer's settings).
struct MergeSettings {
  c10::optional<double> momentum;   // none: the cumulative average
  double eps = 1e-5;
  bool unbiased = true;             // running_var from the unbiased group variance
  bool equal_rank_weights = false;  // stats_mode="default"
  int64_t act = 0;                  // the fused activation (activation.h; 0: none)
  double act_param = 0.0;
};

struct MergeArgs {
  at::Tensor input;
  c10::optional<at::Tensor> weight, bias;
  RunningBuffers running;
  MergeSettings settings;
  c10::optional<at::Tensor> residual;  // added before the activation
};

// Merge the W gathered rows (count-weighted, or equal rank weights), update the running
// statistics, normalize. Call order: every row must carry row 0's tags.
using MergeNormalizeFn = MergedOutputs(const MergeArgs& args, const at::Tensor& rows);

// The rank's float64 vector of the reduce exchange (layout above): one pass over the input
// accumulating in double. `shift` (optional, [C], any floating dtype) is K; `calls` as stats_row.
using ReduceSumsFn = at::Tensor(
    const at::Tensor& input, const c10::optional<at::Tensor>& shift, int64_t layer_tag,
    const at::Tensor& calls, bool equal_rank_weights);

// The group statistics from `total` (every rank's vector summed; `sent` is this rank's), in
// double: mean = K + S1 / D, biased var = S2 / D - (S1 / D)^2 (D = the count, or the non-empty
// ranks with equal rank weights; K = the running mean), running var * n / (n - 1) when unbiased.
// The checks: the tag chunks (call order) and K's fingerprint (every rank shifted by the same
// running mean; CPU throws the message of kShiftMismatch) of `total` are `world_size` times
// `sent`'s.
using ReduceMergeNormalizeFn = MergedOutputs(
    const MergeArgs& args, const at::Tensor& total, const at::Tensor& sent, int64_t world_size);

// The output of a merge again, from the statistics it returned (mean, mean_lo, invstd; acc dtype,
// [C]): an activation checkpoint's recompute of a layer call. The same normalize as the merges',
// so the output is bitwise theirs for the same input; `args.running` is ignored (nothing is
// updated, nothing is counted).
using RenormalizeFn = at::Tensor(
    const MergeArgs& args, const at::Tensor& mean, const at::Tensor& mean_lo,
    const at::Tensor& invstd);

// What the backward steps take (one struct, named fields). xmu = (x - mean) - mean_lo (mean_lo
// optional: 0). With an activation (`act` != 0) the layer's output was act(z), z = xmu * invstd *
// weight + bias: z is recomputed from `input` (so `bias` is needed) and dy * act'(z) stands for
// dy in every sum, here and in grad_input. `info`: the merge's grad_info, whose tags head the
// sums (grad_sums: optional, zeros without; grad_input: required, and its count info[0]).
struct GradArgs {
  at::Tensor grad_out, input, mean, invstd;
  c10::optional<at::Tensor> weight, bias;
  int64_t act = 0;
  double act_param = 0.0;
  c10::optional<at::Tensor> mean_lo, info;
};

// Local backward sums packed for the collective, [header, sum_dy[C], sum_dy_xmu[C]] (acc dtype;
// the header of the tags in `info`), with the local grad_weight = sum_dy_xmu * invstd and
// grad_bias = sum_dy in the weight's dtype (acc dtype without weight). Returns (sums,
// grad_weight, grad_bias).
using GradSumsFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const GradArgs& args);

// grad_sums of a layer whose forward added `residual` before its activation, y = act(z + r):
// g = dy * act'(z + r) (z recomputed from `input`; dy itself without an activation) rounded to
// the input's dtype stands for dy in the sums. Returns (sums, grad_weight, grad_bias, g): g is
// the residual's gradient and the dy that grad_input takes next, with act = 0.
using GradSumsResidualFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const GradArgs& args, const at::Tensor& residual);

// Input gradient from R >= 1 rows of sums ([R * (kGradHeader + 2C)]: all-reduced, R = 1, or
// gathered, summed here in row order) and the count info[0] (read on the device), and the
// call-order check of the backward: the summed header against P times the header of info's tags
// (P = R for gathered rows, world_size for one all-reduced row). Returns (grad_input,
// order_ok[1]); CPU throws an error starting with "syncbn call order:" instead of returning
// order_ok = 0.
using GradInputFn = std::tuple<at::Tensor, at::Tensor>(
    const GradArgs& args, const at::Tensor& sums, int64_t world_size);

// The twins, declared with the function types above (`LocalStatsFn local_stats_cpu;` declares the
// function local_stats_cpu of that type): the CPU kernels always, the CUDA ones with CUDA.
LocalStatsFn local_stats_cpu;
MergeStatsFn merge_stats_cpu;
NormalizeFn normalize_cpu;
BackwardReduceFn backward_reduce_cpu;
BackwardElemtFn backward_elemt_cpu;
StatsRowFn stats_row_cpu;
MergeNormalizeFn merge_normalize_cpu;
ReduceSumsFn reduce_sums_cpu;
ReduceMergeNormalizeFn reduce_merge_normalize_cpu;
RenormalizeFn renormalize_cpu;
GradSumsFn grad_sums_cpu;
GradSumsResidualFn grad_sums_residual_cpu;
GradInputFn grad_input_cpu;
#ifdef WITH_CUDA
LocalStatsFn local_stats_cuda;
MergeStatsFn merge_stats_cuda;
NormalizeFn normalize_cuda;
BackwardReduceFn backward_reduce_cuda;
BackwardElemtFn backward_elemt_cuda;
StatsRowFn stats_row_cuda;
MergeNormalizeFn merge_normalize_cuda;
ReduceSumsFn reduce_sums_cuda;
ReduceMergeNormalizeFn reduce_merge_normalize_cuda;
RenormalizeFn renormalize_cuda;
GradSumsFn grad_sums_cuda;
GradSumsResidualFn grad_sums_residual_cuda;
GradInputFn grad_input_cuda;
#endif

}  // namespace syncbn
