// SIMT emulation: compile CUDA kernels as host C++ and run them on the CPU, one cooperative fiber
// per CUDA thread, one block at a time (see tests/cuda_emu/README section in the project README).
//
// What this header provides to a `.cu` file compiled as C++:
//   * the execution-space qualifiers (__global__, __device__, __host__, __forceinline__,
//     __launch_bounds__), which mean nothing on the host;
//   * threadIdx / blockIdx / blockDim / gridDim / warpSize, read from the running fiber;
//   * __syncthreads (and its _count/_and/_or forms), __syncwarp, __shfl_sync / _up / _down / _xor,
//     __ballot_sync / __any_sync / __all_sync, __activemask, atomics, a few math intrinsics;
//   * the launch operator that the build's rewrite of `k<<<grid, block, smem, stream>>>(args)`
//     targets: `k | ::simt::launch_config(grid, block, smem, stream)(args)`;
//   * `::simt::shared_var<T>(site)`, the target of the rewrite of `__shared__ T name[...]`: one
//     copy per block, NaN-poisoned (bytes 0xFF) before the block starts.
// Every warp/block collective checks the rules CUDA leaves undefined (see simt.cpp) and records a
// diagnostic instead of guessing; a launch with diagnostics fails its launch check.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <utility>

// ------------------------------------------------------------------------------------------------
// CUDA vector types used for indices and launch configurations
// ------------------------------------------------------------------------------------------------
struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}  // NOLINT: implicit, as in CUDA
};

using cudaStream_t = struct CUstream_st*;

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNotReady = 600,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorLaunchFailure = 719,
};

// ------------------------------------------------------------------------------------------------
// Qualifiers
// ------------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __constant__ static
// `__shared__` declarations are rewritten at build time (tests/cuda_emu/build.py); one that the
// rewrite did not recognise fails to compile here, naming itself.
#define __shared__ static_assert(false, "simt: a __shared__ declaration the build did not rewrite");

namespace simt {

using Site = std::source_location;

// The emulated thread's coordinates; valid only inside a kernel.
struct ThreadCoords {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
const ThreadCoords& coords();

// ---- collectives (implemented in simt.cpp) -----------------------------------------------------
enum class WarpOp : int { kSyncwarp, kShflIdx, kShflUp, kShflDown, kShflXor, kBallot };
// Executes warp collective `op` for the calling lane: waits until every lane named in `mask`
// arrived at the same op, then returns the 64-bit payload this lane reads (shuffles: the source
// lane's `value`; ballot: the vote bits; syncwarp: 0).
uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width, Site site);
// Block barrier; returns the number of threads that passed a non-zero `predicate`.
int block_barrier(int predicate, const char* what, Site site);
unsigned active_mask();

// ---- shared memory ----------------------------------------------------------------------------
// Returns the current block's storage for the shared variable identified by `tag` (one address
// per rewritten declaration and template instantiation), allocated on first use in the block.
void* shared_alloc(const void* tag, size_t bytes, size_t align, Site site);
void* dynamic_shared(size_t align, Site site);

template <typename T, typename Key>
T& shared_var(Key, Site site = Site::current()) {
  static const char tag = 0;
  return *static_cast<T*>(shared_alloc(&tag, sizeof(T), alignof(T), site));
}
template <typename T, size_t Align, typename Key>
T& shared_var_aligned(Key, Site site = Site::current()) {
  static const char tag = 0;
  return *static_cast<T*>(shared_alloc(&tag, sizeof(T), Align, site));
}
template <typename T>
T* extern_shared(Site site = Site::current()) {
  return static_cast<T*>(dynamic_shared(alignof(T), site));
}

// ---- launches -----------------------------------------------------------------------------------
struct LaunchConfig;
void launch(const LaunchConfig& config, const char* kernel, const std::function<void()>& thread_body);

template <typename... A>
struct PendingLaunch;

struct LaunchConfig {
  dim3 grid, block;
  size_t shared_bytes;
  cudaStream_t stream;
  Site site;
  template <typename... A>
  PendingLaunch<std::decay_t<A>...> operator()(A&&... args) const {
    return {*this, std::tuple<std::decay_t<A>...>(std::forward<A>(args)...)};
  }
};

template <typename... A>
struct PendingLaunch {
  LaunchConfig config;
  std::tuple<A...> args;
};

inline LaunchConfig launch_config(
    dim3 grid, dim3 block, size_t shared_bytes = 0, cudaStream_t stream = nullptr,
    Site site = Site::current()) {
  return {grid, block, shared_bytes, stream, site};
}

// `kernel | kernel_name("kernel") | launch_config(...)(args...)`: every thread calls `kernel` with
// its own copy of the arguments converted to the parameter types, as CUDA copies them from
// parameter memory.
struct KernelName {
  const char* name;
};
inline KernelName kernel_name(const char* name) { return {name}; }

template <typename... P>
struct NamedKernel {
  void (*kernel)(P...);
  const char* name;
};

template <typename... P>
NamedKernel<P...> operator|(void (*kernel)(P...), KernelName name) {
  return {kernel, name.name};
}

template <typename... P, typename... A>
void operator|(NamedKernel<P...> named, PendingLaunch<A...>&& pending) {
  static_assert(sizeof...(P) == sizeof...(A), "simt: kernel launched with the wrong arity");
  const std::tuple<std::decay_t<P>...> params(
      std::apply([](auto&... a) { return std::tuple<std::decay_t<P>...>(a...); }, pending.args));
  launch(pending.config, named.name,
         [&] { std::apply([&](auto... p) { named.kernel(p...); }, params); });
}

int sm_count();

// ---- helpers for the templated builtins -------------------------------------------------------
template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>,
                "simt: warp shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}
template <typename T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

}  // namespace simt

// ------------------------------------------------------------------------------------------------
// Built-in variables and functions
// ------------------------------------------------------------------------------------------------
#define threadIdx (::simt::coords().thread_idx)
#define blockIdx (::simt::coords().block_idx)
#define blockDim (::simt::coords().block_dim)
#define gridDim (::simt::coords().grid_dim)
constexpr int warpSize = 32;

inline void __syncthreads(simt::Site site = simt::Site::current()) {
  simt::block_barrier(0, "__syncthreads", site);
}
inline int __syncthreads_count(int p, simt::Site site = simt::Site::current()) {
  return simt::block_barrier(p != 0, "__syncthreads_count", site);
}
inline int __syncthreads_and(int p, simt::Site site = simt::Site::current()) {
  return simt::block_barrier(p != 0, "__syncthreads_and", site) ==
         static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
}
inline int __syncthreads_or(int p, simt::Site site = simt::Site::current()) {
  return simt::block_barrier(p != 0, "__syncthreads_or", site) > 0;
}
inline void __syncwarp(unsigned mask = 0xffffffffu, simt::Site site = simt::Site::current()) {
  simt::warp_collective(simt::WarpOp::kSyncwarp, mask, 0, 0, warpSize, site);
}
template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
              simt::Site site = simt::Site::current()) {
  return simt::from_bits<T>(simt::warp_collective(
      simt::WarpOp::kShflIdx, mask, simt::to_bits(var), src_lane, width, site));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                 simt::Site site = simt::Site::current()) {
  return simt::from_bits<T>(simt::warp_collective(
      simt::WarpOp::kShflUp, mask, simt::to_bits(var), static_cast<int>(delta), width, site));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                   simt::Site site = simt::Site::current()) {
  return simt::from_bits<T>(simt::warp_collective(
      simt::WarpOp::kShflDown, mask, simt::to_bits(var), static_cast<int>(delta), width, site));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                  simt::Site site = simt::Site::current()) {
  return simt::from_bits<T>(simt::warp_collective(
      simt::WarpOp::kShflXor, mask, simt::to_bits(var), lane_mask, width, site));
}
inline unsigned __ballot_sync(unsigned mask, int predicate,
                              simt::Site site = simt::Site::current()) {
  return static_cast<unsigned>(simt::warp_collective(
      simt::WarpOp::kBallot, mask, predicate != 0, 0, warpSize, site));
}
inline int __any_sync(unsigned mask, int predicate, simt::Site site = simt::Site::current()) {
  return __ballot_sync(mask, predicate, site) != 0;
}
inline int __all_sync(unsigned mask, int predicate, simt::Site site = simt::Site::current()) {
  return __ballot_sync(mask, predicate, site) == mask;
}
inline unsigned __activemask() { return simt::active_mask(); }
inline void __threadfence() {}
inline void __threadfence_block() {}

// Atomics: fibers never interleave inside one call, so a plain read-modify-write is atomic.
namespace simt {
template <typename T, typename F>
T read_modify_write(T* address, F update) {
  const T old = *address;
  *address = update(old);
  return old;
}
}  // namespace simt
template <typename T>
T atomicAdd(T* a, T v) { return simt::read_modify_write(a, [v](T old) { return old + v; }); }
template <typename T>
T atomicSub(T* a, T v) { return simt::read_modify_write(a, [v](T old) { return old - v; }); }
template <typename T>
T atomicMax(T* a, T v) { return simt::read_modify_write(a, [v](T old) { return old < v ? v : old; }); }
template <typename T>
T atomicMin(T* a, T v) { return simt::read_modify_write(a, [v](T old) { return v < old ? v : old; }); }
template <typename T>
T atomicExch(T* a, T v) { return simt::read_modify_write(a, [v](T) { return v; }); }
template <typename T>
T atomicCAS(T* a, T compare, T v) {
  return simt::read_modify_write(a, [=](T old) { return old == compare ? v : old; });
}
inline unsigned atomicInc(unsigned* a, unsigned limit) {
  return simt::read_modify_write(a, [limit](unsigned old) { return old >= limit ? 0u : old + 1u; });
}

template <typename T>
T __ldg(const T* p) {
  return *p;
}
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
