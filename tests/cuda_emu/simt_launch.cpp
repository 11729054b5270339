// SIMT emulation: kernel launches, the block scheduler and the host-side controls
// (simt_control.h).
#include <malloc.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <sstream>

#include "simt_runtime.h"

namespace simt {
namespace detail {
namespace {

// Fills `ids` with the order of this sweep over n threads (a fresh shuffle per sweep if random).
void sweep_order(Runtime& r, int n, std::vector<int>& ids) {
  if (static_cast<int>(ids.size()) != n || r.order == Order::kRandom) {
    ids.resize(n);
    std::iota(ids.begin(), ids.end(), 0);
    if (r.order == Order::kReverse) std::reverse(ids.begin(), ids.end());
    if (r.order == Order::kRandom) std::shuffle(ids.begin(), ids.end(), r.rng);
  }
}

std::string deadlock_report(Runtime& r) {
  std::map<std::string, std::vector<int>> waiting;
  for (int t = 0; t < r.threads; ++t) {
    const Fiber* f = r.pool[t];
    if (f->state == State::kWaiting) {
      waiting[std::string(f->waiting_on) + " at " + where(f->wait_site)].push_back(t);
    }
  }
  std::string out = "deadlock: no thread can continue;";
  for (const auto& [what, ids] : waiting) out += " threads " + ranges(ids) + " wait in " + what + ";";
  return out;
}

// Runs one block to completion; false when it was aborted by a diagnostic.
bool run_block(Runtime& r, uint3 block_idx) {
  const dim3 bd = r.config->block;
  std::memset(r.arena, kPoison, r.dirty_static);
  std::memset(r.arena + kDynamicOffset, kPoison, std::max(r.dirty_dynamic, r.config->shared_bytes));
  r.dirty_dynamic = r.config->shared_bytes;
  r.static_used = 0;
  r.allocations.clear();
  r.exited = 0;
  r.barrier = BarrierSlot{};
  r.warps.assign((r.threads + kWarp - 1) / kWarp, WarpSlot{});
  for (int t = 0; t < r.threads; ++t) r.warps[t / kWarp].live |= 1u << (t % kWarp);
  for (int t = 0; t < r.threads; ++t) {
    Fiber* f = r.pool[t];
    f->tid = t;
    f->coords = {{t % bd.x, t / bd.x % bd.y, t / (bd.x * bd.y)}, block_idx, bd, r.config->grid};
    f->state = State::kRunnable;
  }
  int done = 0;
  std::vector<int>& ids = r.sweep;
  ids.clear();
  while (done < r.threads && !r.aborted) {
    bool progressed = false;
    sweep_order(r, r.threads, ids);
    for (int t : ids) {
      Fiber* f = r.pool[t];
      if (f->state != State::kRunnable) continue;
      progressed = true;
      ++r.stats.switches;
      run_fiber(f, &f->ctx);
      if (f->state == State::kIdle) {  // finished its thread and went back to the pool
        f->state = State::kDone;
        ++done;
      }
      if (r.aborted) break;
    }
    if (!progressed && !r.aborted) {
      r.diagnostics.push_back(deadlock_report(r) + " — in " + block_name(r, block_idx));
      r.aborted = true;
    }
  }
  r.dirty_static = std::max(r.static_used, size_t(64));
  if (!r.aborted) return true;
  for (int t = 0; t < r.threads; ++t) {  // discard the frames of every unfinished thread
    Fiber* f = r.pool[t];
    if (f->state != State::kDone && f->state != State::kIdle) run_fiber(f, &f->top);
  }
  return false;
}

std::string config_error(const LaunchConfig& c) {
  const dim3 b = c.block, g = c.grid;
  const uint64_t threads = uint64_t(b.x) * b.y * b.z;
  std::ostringstream out;
  if (b.x == 0 || b.y == 0 || b.z == 0 || g.x == 0 || g.y == 0 || g.z == 0) {
    out << "a grid or block dimension is 0";
  } else if (threads > kMaxThreadsPerBlock || b.z > kMaxBlockZ) {
    out << "block (" << b.x << "," << b.y << "," << b.z << ") has " << threads
        << " threads; at most 1024 per block, blockDim.z <= 64";
  } else if (g.x > kMaxGridX || g.y > kMaxGridYZ || g.z > kMaxGridYZ) {
    out << "grid (" << g.x << "," << g.y << "," << g.z
        << ") exceeds gridDim.x <= 2^31-1, gridDim.y/z <= 65535";
  } else if (c.shared_bytes > kSharedLimit) {
    out << c.shared_bytes << " bytes of dynamic shared memory exceed the 48 KiB per block";
  }
  return out.str();
}

}  // namespace
}  // namespace detail

using namespace detail;

void launch(const LaunchConfig& config, const char* kernel, const std::function<void()>& thread_body) {
  Runtime& r = rt();
  if (r.body != nullptr) fatal("a kernel launched a kernel (dynamic parallelism is not emulated)");
  const dim3 g = config.grid, b = config.block;
  r.launches.push_back({kernel, where(config.site), config.site.function_name(), g.x, g.y, g.z,
                        b.x, b.y, b.z, config.shared_bytes});
  const std::string bad = config_error(config);
  if (!bad.empty()) {
    r.last_error = cudaErrorInvalidConfiguration;
    r.last_message = "invalid launch configuration at " + where(config.site) + ": " + bad;
    return;
  }
  r.threads = static_cast<int>(b.x * b.y * b.z);
  fiber(r.threads - 1);  // grow the pool
  r.body = &thread_body;
  r.kernel = kernel;
  r.config = &config;
  r.aborted = false;
  ++r.stats.launches;
  const uint64_t nblocks = uint64_t(g.x) * g.y * g.z;
  std::vector<uint64_t> order(nblocks);
  std::iota(order.begin(), order.end(), uint64_t(0));
  if (r.order == Order::kReverse) std::reverse(order.begin(), order.end());
  if (r.order == Order::kRandom) std::shuffle(order.begin(), order.end(), r.rng);
  const size_t before = r.diagnostics.size();
  for (uint64_t i : order) {
    const uint3 bi{static_cast<unsigned>(i % g.x), static_cast<unsigned>(i / g.x % g.y),
                   static_cast<unsigned>(i / (uint64_t(g.x) * g.y))};
    ++r.stats.blocks;
    r.stats.threads += r.threads;
    if (!run_block(r, bi)) break;
  }
  r.body = nullptr;
  r.config = nullptr;
  if (r.diagnostics.size() > before) {
    r.last_error = cudaErrorLaunchFailure;
    r.last_message = r.diagnostics.back();
  }
}

// ---- control (simt_control.h) ----------------------------------------------------------------------

void set_schedule(Order order, uint64_t seed) {
  Runtime& r = rt();
  r.order = order;
  r.rng.seed(seed);
}

cudaError_t take_last_error(std::string* message) {
  Runtime& r = rt();
  const cudaError_t e = r.last_error;
  if (message != nullptr) *message = r.last_message;
  r.last_error = cudaSuccess;
  r.last_message.clear();
  return e;
}

cudaError_t peek_last_error() { return rt().last_error; }

std::vector<std::string> take_diagnostics() {
  std::vector<std::string> out;
  out.swap(rt().diagnostics);
  return out;
}

std::vector<LaunchRecord> take_launches() {
  std::vector<LaunchRecord> out;
  out.swap(rt().launches);
  return out;
}

Stats take_stats() {
  Stats out = rt().stats;
  rt().stats = Stats{};
  return out;
}

int sm_count() {
  static const int value = [] {
    const char* env = std::getenv("SYNCBN_EMU_SM_COUNT");
    const int v = env ? std::atoi(env) : 0;
    return v > 0 ? v : 132;  // an H100 SXM: the GPU the kernels are tuned for
  }();
  return value;
}

void poison_allocations(bool on) {
  // glibc fills every new allocation with the complement of the low byte: 0x100 -> 0xFF bytes.
  mallopt(M_PERTURB, on ? 0x100 : 0);
}

}  // namespace simt

