// Kernels that test the SIMT emulation itself (tests/test_cuda_emu_simt.py): correct uses of each
// emulated feature, whose results the tests know, and one kernel per bug class the emulation must
// report. Written as ordinary CUDA; the build rewrites it like csrc/*.cu, so the rewrite is tested
// too. Not part of the library.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

// ---- correct kernels -----------------------------------------------------------------------------

// out[block] = sum of the block's x, by a shared-memory tree; `sync` = 0 drops every barrier.
__global__ void block_sum(const double* x, double* out, int sync) {
  __shared__ double buf[1024];
  const int t = threadIdx.x;
  buf[t] = x[blockIdx.x * blockDim.x + t];
  if (sync) __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) buf[t] += buf[t + s];
    if (sync) __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = buf[0];
}

// The same sum in dynamic shared memory (extern __shared__, sized by the launch).
__global__ void dynamic_shared_sum(const double* x, double* out) {
  extern __shared__ double dyn[];
  const int t = threadIdx.x;
  dyn[t] = x[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) dyn[t] += dyn[t + s];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = dyn[0];
}

// Eight results per thread: shfl idx/up/down/xor, ballot, any, all, __syncthreads_count.
__global__ void warp_intrinsics(const double* x, double* out, int width) {
  const int t = threadIdx.x;
  const double v = x[t];
  double* o = out + t * 8;
  o[0] = __shfl_sync(0xffffffffu, v, 3, width);
  o[1] = __shfl_up_sync(0xffffffffu, v, 1, width);
  o[2] = __shfl_down_sync(0xffffffffu, v, 2, width);
  o[3] = __shfl_xor_sync(0xffffffffu, v, 1, width);
  o[4] = static_cast<double>(__ballot_sync(0xffffffffu, v > 0));
  o[5] = __any_sync(0xffffffffu, v > 2);
  o[6] = __all_sync(0xffffffffu, v > -100);
  o[7] = __syncthreads_count(v > 0);
}

// Six values per thread of a 3-D grid of 3-D blocks: threadIdx.xyz, blockIdx.xyz.
__global__ void coordinates(double* out) {
  const int64_t block = blockIdx.x + gridDim.x * (blockIdx.y + int64_t(gridDim.y) * blockIdx.z);
  const int64_t t = threadIdx.x + blockDim.x * (threadIdx.y + int64_t(blockDim.y) * threadIdx.z);
  double* o = out + (block * blockDim.x * blockDim.y * blockDim.z + t) * 6;
  o[0] = threadIdx.x, o[1] = threadIdx.y, o[2] = threadIdx.z;
  o[3] = blockIdx.x, o[4] = blockIdx.y, o[5] = blockIdx.z;
}

// out[0] = number of threads in the grid, out[1] = the largest threadIdx.x.
__global__ void atomics(double* out) {
  atomicAdd(&out[0], 1.0);
  atomicMax(&out[1], static_cast<double>(threadIdx.x));
}

// Reads shared memory nothing wrote: the emulation's poison (NaN).
__global__ void read_unwritten_shared(double* out) {
  __shared__ double never_written[64];
  out[threadIdx.x] = never_written[threadIdx.x];
}

__global__ void noop(double*) {}

// ---- one bug per kernel --------------------------------------------------------------------------

// Lanes 16-31 return, then a full-mask shuffle names them.
__global__ void shuffle_after_early_exit(double* out) {
  const int lane = threadIdx.x % 32;
  if (lane >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, double(lane), 1);
}

// Half the warp shuffles down, the other half xor: the lanes disagree on the collective.
__global__ void divergent_shuffle(double* out) {
  const int lane = threadIdx.x % 32;
  double v = lane;
  if (lane < 16) {
    v = __shfl_down_sync(0xffffffffu, v, 1);
  } else {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  }
  out[threadIdx.x] = v;
}

// Every lane passes mask 0x2, which names only lane 1.
__global__ void mask_without_caller(double* out) {
  out[threadIdx.x] = __shfl_sync(0x2u, 1.0, 1);
}

// Lanes 0-15 shuffle down by 1 with width 32: lane 15 reads lane 16, outside the mask.
__global__ void read_outside_mask(double* out) {
  const int lane = threadIdx.x % 32;
  if (lane < 16) out[threadIdx.x] = __shfl_down_sync(0x0000ffffu, double(lane), 1);
}

// Thread 5 returns before a barrier the others wait at.
__global__ void barrier_skipped(double* out) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

// Two warps wait at two different barriers.
__global__ void divergent_barrier(double* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

// Thread 32 waits for lane 1 of its warp in a shuffle while that lane waits at a barrier.
__global__ void deadlock(double* out) {
  if (threadIdx.x == 32) {
    out[threadIdx.x] = __shfl_sync(0x3u, 1.0, 1);
  } else {
    __syncthreads();
  }
}

// 52,000 bytes of static shared memory: more than a block may use.
__global__ void static_shared_too_large(double* out) {
  __shared__ float big[13000];
  big[threadIdx.x] = 1.0f;
  out[threadIdx.x] = big[threadIdx.x];
}

// Writes one element past the end of `out` (out_numel = number of threads): for the ASan build.
__global__ void write_past_the_end(double* out) {
  out[threadIdx.x + 1] = 1;
}

dim3 to_dim3(const std::vector<int64_t>& v) {
  TORCH_CHECK(v.size() == 3, "selftest: a grid or block needs 3 sizes");
  return dim3(static_cast<unsigned>(v[0]), static_cast<unsigned>(v[1]), static_cast<unsigned>(v[2]));
}

}  // namespace

namespace simt_selftest {

// Runs self-test kernel `name` on `x` (float64) with the given launch configuration; `arg` is the
// kernel's int argument where it has one. Returns `out` (float64, zero-filled before the launch).
at::Tensor run(
    const std::string& name, const at::Tensor& x, const std::vector<int64_t>& grid,
    const std::vector<int64_t>& block, int64_t shared_bytes, int64_t arg, int64_t out_numel) {
  TORCH_CHECK(x.scalar_type() == at::kDouble && x.is_contiguous(), "selftest: x must be float64");
  at::Tensor out = at::zeros({out_numel}, x.options());
  const double* in = x.const_data_ptr<double>();
  double* o = out.mutable_data_ptr<double>();
  const dim3 g = to_dim3(grid), b = to_dim3(block);
  const size_t smem = static_cast<size_t>(shared_bytes);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int a = static_cast<int>(arg);
  if (name == "block_sum") {
    block_sum<<<g, b, smem, stream>>>(in, o, a);
  } else if (name == "dynamic_shared_sum") {
    dynamic_shared_sum<<<g, b, smem, stream>>>(in, o);
  } else if (name == "warp_intrinsics") {
    warp_intrinsics<<<g, b, smem, stream>>>(in, o, a);
  } else if (name == "coordinates") {
    coordinates<<<g, b, smem, stream>>>(o);
  } else if (name == "atomics") {
    atomics<<<g, b, smem, stream>>>(o);
  } else if (name == "read_unwritten_shared") {
    read_unwritten_shared<<<g, b, smem, stream>>>(o);
  } else if (name == "noop") {
    noop<<<g, b, smem, stream>>>(o);
  } else if (name == "shuffle_after_early_exit") {
    shuffle_after_early_exit<<<g, b, smem, stream>>>(o);
  } else if (name == "divergent_shuffle") {
    divergent_shuffle<<<g, b, smem, stream>>>(o);
  } else if (name == "mask_without_caller") {
    mask_without_caller<<<g, b, smem, stream>>>(o);
  } else if (name == "read_outside_mask") {
    read_outside_mask<<<g, b, smem, stream>>>(o);
  } else if (name == "barrier_skipped") {
    barrier_skipped<<<g, b, smem, stream>>>(o);
  } else if (name == "divergent_barrier") {
    divergent_barrier<<<g, b, smem, stream>>>(o);
  } else if (name == "deadlock") {
    deadlock<<<g, b, smem, stream>>>(o);
  } else if (name == "write_past_the_end") {
    write_past_the_end<<<g, b, smem, stream>>>(o);
  } else if (name == "static_shared_too_large") {
    static_shared_too_large<<<g, b, smem, stream>>>(o);
  } else {
    TORCH_CHECK(false, "selftest: no kernel named ", name);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace simt_selftest
