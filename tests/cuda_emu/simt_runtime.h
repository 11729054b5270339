// SIMT emulation runtime: internal state shared by simt_fiber.cpp (fibers, switching),
// simt_sync.cpp (warp collectives, barriers, shared memory) and simt_launch.cpp (launches, the
// scheduler, controls); kernels never include this.
//
// A launch runs on the CPU one block at a time, each CUDA thread a cooperative fiber on its own
// stack. A fiber runs until it reaches a warp collective or a block barrier (or ends); the
// scheduler then resumes the next runnable fiber in the configured order (forward, reverse or
// seeded random thread order, and the same order over blocks), so a missing
// barrier or a read of a value another thread has not written yet shows up as a different result
// under another order, or as the 0xFF (NaN) poison of fresh shared memory.
//
// Diagnostics (each aborts the launch, which then fails its launch check):
//   * a warp collective whose mask omits the caller, names a lane that exited or does not exist,
//     or whose lanes disagree on the op, mask, width or call site ("called divergently");
//   * a shuffle that reads a lane outside its mask (CUDA: undefined value);
//   * a block barrier reached at different call sites, or completed while some thread of the
//     block exited without reaching it;
//   * deadlock: no thread can run and some have not finished (each waiter named);
//   * launch configurations CUDA rejects (threads per block, grid limits, shared memory).
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <random>
#include <string>
#include <vector>

#include "simt.h"
#include "simt_control.h"

#if defined(__SANITIZE_ADDRESS__)
#define SIMT_ASAN 1
#else
#define SIMT_ASAN 0
#endif

namespace simt::detail {

constexpr int kWarp = 32;
constexpr int kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockZ = 64;
constexpr unsigned kMaxGridYZ = 65535;
constexpr unsigned kMaxGridX = 0x7fffffffu;
constexpr size_t kSharedLimit = 48 * 1024;  // static + dynamic, without the opt-in attribute
constexpr size_t kArenaBytes = 2 * kSharedLimit;
constexpr size_t kDynamicOffset = kSharedLimit;
constexpr size_t kStackBytes = (SIMT_ASAN ? 1024 : 256) * 1024;
constexpr unsigned char kPoison = 0xFF;  // NaN in every floating type, -1 in integers

enum class State { kIdle, kRunnable, kWaiting, kDone, kBroken };

struct Fiber {
  jmp_buf ctx{};  // where the fiber resumes
  jmp_buf top{};  // its loop head: restarting discards an aborted kernel's frames
  ucontext_t start{};
  void* stack = nullptr;
  ThreadCoords coords{};
  int tid = 0;
  State state = State::kIdle;
  uint64_t result = 0;
  const char* waiting_on = "";
  Site wait_site;
  void* fake_stack = nullptr;  // ASan bookkeeping
};

struct WarpSlot {  // the collective a warp's lanes are gathering for
  unsigned live = 0;  // lanes that exist in the block and have not exited
  bool open = false;
  WarpOp op = WarpOp::kSyncwarp;
  unsigned mask = 0, arrived = 0;
  int width = kWarp;
  Site site;
  uint64_t value[kWarp] = {};
  int src[kWarp] = {};
};

struct BarrierSlot {
  bool open = false;
  const char* what = "";
  Site site;
  int arrived = 0, count = 0;
};

void thread_exited(Fiber* f);

struct Runtime {
  // fibers and switching
  std::vector<Fiber*> pool;  // owned; fibers live as long as their thread's runtime
  Fiber* current = nullptr;
  Fiber* starting = nullptr;
  jmp_buf scheduler{};
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_size = 0;
  void* scheduler_fake_stack = nullptr;
  // the launch and block being run
  const std::function<void()>* body = nullptr;
  const char* kernel = "";
  const LaunchConfig* config = nullptr;
  int threads = 0, exited = 0;
  std::vector<WarpSlot> warps;
  BarrierSlot barrier;
  bool aborted = false;
  // shared memory of the current block
  alignas(64) unsigned char arena[kArenaBytes];
  size_t static_used = 0, dirty_static = kArenaBytes, dirty_dynamic = 0;
  std::vector<std::pair<const void*, size_t>> allocations;
  // schedule, results
  Order order = Order::kForward;
  std::mt19937_64 rng{0};
  cudaError_t last_error = cudaSuccess;
  std::string last_message;
  std::vector<std::string> diagnostics;
  std::vector<LaunchRecord> launches;
  std::vector<int> sweep;
  Stats stats;
};

// The calling OS thread's runtime (created on first use, kept for the thread's life).
Runtime& rt();
[[noreturn]] void fatal(const char* what);

// Formatting for diagnostics.
std::string where(const Site& s);
std::string hex(unsigned v);
const char* op_name(WarpOp op);
std::string ranges(const std::vector<int>& ids);
std::vector<int> lanes_of(unsigned mask);
// "block (x,y,z) of KERNEL launched at FILE:LINE [host function]" for the launch being run.
std::string block_name(const Runtime& r, uint3 block_idx);

// Fibers (simt_fiber.cpp).
Fiber* fiber(int i);                          // fiber i of the pool, created on first use
void run_fiber(Fiber* f, jmp_buf* target);    // from the scheduler: run f until it yields
void block_until_woken(Fiber* f, const char* what, Site site);
unsigned live_lanes(int w);  // lanes of warp w that exist and have not exited
// Records a diagnostic and ends the launch: the calling fiber never continues its kernel.
[[noreturn]] void abort_launch(const std::string& message);

// Called by a fiber whose thread returned from the kernel (simt_sync.cpp).
void thread_exited(Fiber* f);

}  // namespace simt::detail
