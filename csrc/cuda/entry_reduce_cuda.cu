// Entry points of the reduce exchange's CUDA twins (see syncbn.h), with their kernels:
// reduce_sums = the shifted float64 sums (stats_cuda.cu's reduction) + a header kernel (the tag
// chunks, the running mean's fingerprint, the call counter); reduce_merge_normalize = one block
// that checks the summed vector, merges every channel and updates the running statistics + the
// normalize kernel. The arithmetic shared with the CPU twins is reduce.h's. Nothing reads device
// memory on the host: a layer call can be captured in a CUDA graph.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "cuda_running.cuh"
#include "merge.h"
#include "reduce.h"

#include <cstdint>

namespace syncbn {
namespace {

constexpr int kHeaderThreads = 256;
// One block merges every channel (see entry_cuda.cu's merge).
constexpr int kMergeThreads = 1024;

// Writes the vector's header (reduce.h) and advances the call counter: the block sums the
// fingerprint's terms over the channels of `shift` (null: 0), in a fixed order. Zeroes the sums
// when the input is empty (no reduction ran).
__global__ void __launch_bounds__(kHeaderThreads) reduce_header_kernel(
    double* out, const double* __restrict__ shift, int64_t C, int64_t count, int64_t samples,
    int64_t layer_tag, int64_t* calls, bool empty) {
  __shared__ int64_t terms[kHeaderThreads];
  int64_t mine = 0;
  if (shift != nullptr) {
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) mine += shift_term(shift[c], c);
  }
  terms[threadIdx.x] = mine;
  __syncthreads();
  for (int half = kHeaderThreads / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half) terms[threadIdx.x] += terms[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int64_t call = *calls;
    write_reduce_header(out, count, samples, layer_tag, call, terms[0]);
    *calls = call + 1;
  }
  if (!empty) return;
  for (int64_t i = threadIdx.x; i < 2 * C; i += blockDim.x) out[kReduceHeader + i] = 0.0;
}

// Channel c's statistics of the summed vector (reduce.h), K from `shift` (null: 0).
struct ReduceStats {
  const double* total;
  const double* shift;
  int64_t C;
  double eps;
  bool equal_rank_weights, unbiased;

  __device__ ReducedChannel operator()(int64_t c) const {
    return reduce_channel(
        total, C, c, shift ? shift[c] : 0.0, equal_rank_weights, eps, unbiased);
  }
};

// Checks the summed vector against this rank's (info[2] = 0 on a mismatch: the host checks it
// later), merges every channel, writes the outputs and updates the running statistics.
template <typename acc_t, typename run_t>
__global__ void __launch_bounds__(kMergeThreads) reduce_merge_kernel(
    const double* __restrict__ total, const double* __restrict__ sent, int64_t world_size,
    ReduceStats stats, MergedPointers<acc_t> out, run_t* running_mean, run_t* running_var,
    RunningState state) {
  const ReduceChecks checks = reduce_checks(total, sent, world_size);
  const int64_t tracked = state.tracked ? *state.tracked : 0;
  bool bad = false;
  for (int64_t c = threadIdx.x; c < stats.C; c += blockDim.x) {
    const ReducedChannel m = stats(c);
    store_split(c, m.mean, m.invstd, m.var, out.mean, out.mean_lo, out.invstd, out.var);
    bad = bad || !is_finite_value(m.mean) || !is_finite_value(m.var);
  }
  const bool finite = !__syncthreads_or(bad);
  if (threadIdx.x == 0) {
    const double grad_count = stats.equal_rank_weights ? total[2] * sent[0] : total[0];
    double layer = 0, call = 0;
    reduce_tags(sent, &layer, &call);
    store_info(
        out.info, out.grad_info, total[0], grad_count, total[1],
        checks.order_ok && checks.shift_ok, finite, layer, call);
  }
  update_running_block(stats, stats.C, total[0], finite, tracked, running_mean, running_var, state);
}

}  // namespace

at::Tensor reduce_sums_cuda(
    const at::Tensor& input_, const c10::optional<at::Tensor>& shift, int64_t layer_tag,
    const at::Tensor& calls, bool equal_rank_weights) {
  check_input(input_, c10::DeviceType::CUDA);
  check_calls(calls, input_);
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = dense_input(input_);
  const at::Tensor k = shift_float64(shift, input);
  const int64_t C = input.size(1), count = input.numel() / C;
  at::Tensor out = at::empty({kReduceHeader + 2 * C}, input.options().dtype(at::kDouble));
  const bool empty = count == 0;
  if (!empty) {
    at::Tensor s1 = out.narrow(0, kReduceHeader, C), s2 = out.narrow(0, kReduceHeader + C, C);
    shifted_sums_into_cuda(input, k, equal_rank_weights ? 1.0 / count : 1.0, s1, s2);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.get_device()).stream();
  reduce_header_kernel<<<1, kHeaderThreads, 0, stream>>>(
      out.mutable_data_ptr<double>(), k.defined() ? k.const_data_ptr<double>() : nullptr, C,
      count, input.size(0), layer_tag, calls.mutable_data_ptr<int64_t>(), empty);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

MergedOutputs reduce_merge_normalize_cuda(
    const MergeArgs& args, const at::Tensor& total, const at::Tensor& sent, int64_t world_size) {
  const at::Tensor& input = args.input;
  const c10::optional<at::Tensor>&running_mean = args.running.mean,
                                  &running_var = args.running.var;
  const Activation activation = checked_activation(args.settings.act, args.settings.act_param);  // before updates
  const at::Tensor res = checked_residual(args.residual, input);
  MergeOutputs out = prepare_merge(args, c10::DeviceType::CUDA);
  const at::Tensor summed = summed_reduce_vector(total, sent, world_size, input);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor k = shift_float64(running_mean, input);
  const ReduceStats stats{
      summed.const_data_ptr<double>(), k.defined() ? k.const_data_ptr<double>() : nullptr,
      input.size(1), args.settings.eps, args.settings.equal_rank_weights, args.settings.unbiased};
  const RunningState state =
      running_state(args.running.num_batches_tracked, args.running.nonfinite, args.settings.momentum);
  const bool has_running = running_mean.has_value() && running_mean->defined();
  const auto acc = acc_dtype_of(input.scalar_type());
  const auto run_type = has_running ? running_mean->scalar_type() : acc;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.get_device()).stream();
  AT_DISPATCH_FLOATING_TYPES(acc, "reduce_merge_normalize_cuda", [&] {
    using acc_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, run_type, "reduce_update_cuda", [&] {
      reduce_merge_kernel<acc_t, scalar_t><<<1, kMergeThreads, 0, stream>>>(
          summed.const_data_ptr<double>(), sent.const_data_ptr<double>(), world_size, stats,
          merged_pointers<acc_t>(out), mutable_or_null<scalar_t>(running_mean),
          mutable_or_null<scalar_t>(running_var), state);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  at::Tensor output = normalize_act_cuda(
      input, out.mean, out.mean_lo, out.invstd, args.weight, args.bias, activation, res);
  return {output, out.mean, out.mean_lo, out.invstd, out.var, out.info, out.grad_info};
}

}  // namespace syncbn
