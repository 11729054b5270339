// Control of the SIMT emulation from the host side (bindings and tests), not used by kernels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "simt.h"

namespace simt {

// Order in which runnable threads of a block, and the blocks of a launch, are resumed.
enum class Order { kForward, kReverse, kRandom };
void set_schedule(Order order, uint64_t seed);

struct LaunchRecord {
  std::string kernel;    // the kernel's name as written at the launch
  std::string site;      // file:line of the launch
  std::string function;  // the host function that launched
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z;
  size_t shared_bytes;
};

struct Stats {
  uint64_t launches = 0, blocks = 0, threads = 0, switches = 0, warp_ops = 0, barriers = 0;
};

// The pending launch error (cudaSuccess if none) and its message; clears it.
cudaError_t take_last_error(std::string* message);
cudaError_t peek_last_error();
// Everything recorded since the last call, then cleared.
std::vector<std::string> take_diagnostics();
std::vector<LaunchRecord> take_launches();
Stats take_stats();
// Fill new heap allocations with 0xFF bytes (NaN) while on: outputs a kernel forgets to write
// read as NaN, never as a lucky zero.
void poison_allocations(bool on);

// The emulated device's progress, as CUDA events see it (cuda_runtime.h's stand-ins): work runs
// at once, but while the device is held an event recorded since reads "not ready"
// (cudaErrorNotReady) until release_device(), or until the host waits for it
// (cudaEventSynchronize), as on a GPU that has not got there yet.
void hold_device(bool held);
void release_device();
// Whether cudaStreamIsCapturing reports a capture in progress (default false).
void set_capturing(bool capturing);
// The device indices c10::cuda::getCurrentCUDAStream was asked for since the last call (-1: the
// current device), then cleared.
std::vector<int> take_stream_devices();

}  // namespace simt
