// The running-statistics update of the CUDA merges (entry_cuda.cu, entry_reduce_cuda.cu), run by
// the one block that merged every channel: torch.lerp's formula with the batch statistic rounded
// from double to the running dtype, momentum or the cumulative average 1 / num_batches_tracked,
// and the counters. See syncbn.h for the rules.
#pragma once

#include "cuda_kernels.cuh"

#include <ATen/OpMathType.h>

namespace syncbn {
namespace {

// torch.lerp's formula (ATen/native/Lerp.h) with one fused multiply-add.
template <typename T>
__device__ __forceinline__ T lerp_fma(T start, T end, T weight) {
  const bool small = fabs(weight) < T(0.5);
  return fma(small ? weight : weight - T(1), end - start, small ? start : end);
}

struct RunningState {
  int64_t* tracked;    // num_batches_tracked or null
  int64_t* nonfinite;  // skipped-update counter or null
  double momentum;
  bool cumulative;     // momentum None: 1 / num_batches_tracked
};

// Thread 0 advances the counters; every thread then updates its channels (c = threadIdx.x, strided
// by blockDim.x) unless the statistics are not finite or the group is empty. `stats(c)` gives
// channel c's double statistics again (.mean, .var; recomputed rather than stored: a merge is
// cheap). `tracked` is the counter's value before this call, read by every thread before the
// block's barrier.
template <typename run_t, typename Stats>
__device__ void update_running_block(
    const Stats& stats, int64_t C, double total, bool finite, int64_t tracked, run_t* running_mean,
    run_t* running_var, const RunningState& state) {
  if (threadIdx.x == 0) {
    if (state.tracked) *state.tracked = tracked + (finite ? 1 : 0);
    if (state.nonfinite) *state.nonfinite += finite ? 0 : 1;
  }
  if (!finite || total == 0 || running_mean == nullptr) return;
  using op_t = at::opmath_type<run_t>;
  const op_t factor = state.cumulative
                          ? op_t(1) / static_cast<op_t>(static_cast<run_t>(tracked + 1))
                          : static_cast<op_t>(state.momentum);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const auto m = stats(c);
    running_mean[c] = static_cast<run_t>(lerp_fma<op_t>(
        static_cast<op_t>(running_mean[c]), static_cast<op_t>(static_cast<run_t>(m.mean)),
        factor));
    running_var[c] = static_cast<run_t>(lerp_fma<op_t>(
        static_cast<op_t>(running_var[c]), static_cast<op_t>(static_cast<run_t>(m.var)), factor));
  }
}

// The merges' [C] outputs from channel c's double statistics: mean split into (mean, mean_lo).
template <typename acc_t>
__device__ __forceinline__ void store_split(
    int64_t c, double mean, double invstd, double var, acc_t* mean_out, acc_t* lo_out,
    acc_t* invstd_out, acc_t* var_out) {
  const acc_t hi = static_cast<acc_t>(mean);
  mean_out[c] = hi;
  lo_out[c] = static_cast<acc_t>(mean - static_cast<double>(hi));
  invstd_out[c] = static_cast<acc_t>(invstd);
  var_out[c] = static_cast<acc_t>(var);
}

// info = [count, samples, order_ok, finite, layer_tag, call_tag] and grad_info (the same with
// grad_count).
template <typename acc_t>
__device__ __forceinline__ void store_info(
    acc_t* info, acc_t* grad_info, double count, double grad_count, double samples, bool ok,
    bool finite, double layer_tag, double call_tag) {
  acc_t* fields[2] = {info, grad_info};
  for (int i = 0; i < 2; ++i) {
    fields[i][0] = static_cast<acc_t>(i == 0 ? count : grad_count);
    fields[i][1] = static_cast<acc_t>(samples);
    fields[i][2] = ok ? acc_t(1) : acc_t(0);
    fields[i][3] = finite ? acc_t(1) : acc_t(0);
    fields[i][4] = static_cast<acc_t>(layer_tag);
    fields[i][5] = static_cast<acc_t>(call_tag);
  }
}

// The [C] and info outputs of a merge (MergeOutputs), as the merge kernels write them.
template <typename acc_t>
struct MergedPointers {
  acc_t *mean, *mean_lo, *invstd, *var, *info, *grad_info;
};

template <typename acc_t>
MergedPointers<acc_t> merged_pointers(MergeOutputs& out) {
  return {
      out.mean.mutable_data_ptr<acc_t>(),   out.mean_lo.mutable_data_ptr<acc_t>(),
      out.invstd.mutable_data_ptr<acc_t>(), out.var.mutable_data_ptr<acc_t>(),
      out.info.mutable_data_ptr<acc_t>(),   out.grad_info.mutable_data_ptr<acc_t>()};
}

template <typename T>
T* mutable_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->mutable_data_ptr<T>() : nullptr;
}

// The running state of a merge's optional counters and momentum.
inline RunningState running_state(
    const c10::optional<at::Tensor>& num_batches_tracked,
    const c10::optional<at::Tensor>& nonfinite, c10::optional<double> momentum) {
  return {
      mutable_or_null<int64_t>(num_batches_tracked), mutable_or_null<int64_t>(nonfinite),
      momentum.value_or(0.0), !momentum.has_value()};
}

}  // namespace
}  // namespace syncbn
