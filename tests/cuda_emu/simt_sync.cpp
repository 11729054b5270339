// SIMT emulation: warp collectives, block barriers and shared memory, with the diagnostics for
// what CUDA leaves undefined (see simt_runtime.h).
#include <cstring>
#include <string>

#include "simt_runtime.h"

namespace simt {
namespace detail {

void thread_exited(Fiber* f) {
  Runtime& r = rt();
  ++r.exited;
  const int w = f->tid / kWarp, lane = f->tid % kWarp;
  WarpSlot& slot = r.warps[w];
  slot.live &= ~(1u << lane);
  if (slot.open && (slot.mask >> lane & 1u) && !(slot.arrived >> lane & 1u)) {
    abort_launch("thread " + std::to_string(f->tid) + " exited while lanes " +
                 ranges(lanes_of(slot.arrived)) + " of its warp wait in " + op_name(slot.op) +
                 " at " + where(slot.site) + " with mask " + hex(slot.mask) +
                 ": the mask names lane " + std::to_string(lane) + ", which exited");
  }
  if (r.barrier.open) {
    abort_launch("thread " + std::to_string(f->tid) + " exited without reaching " +
                 r.barrier.what + " at " + where(r.barrier.site) + ", where " +
                 std::to_string(r.barrier.arrived) + " threads wait");
  }
}

}  // namespace detail

using namespace detail;

const ThreadCoords& coords() {
  Runtime& r = rt();
  if (r.current == nullptr) fatal("threadIdx/blockIdx/blockDim/gridDim read outside a kernel");
  return r.current->coords;
}

unsigned active_mask() { return live_lanes(rt().current->tid / kWarp); }

namespace {

std::string collective_name(WarpOp op, unsigned mask, Site site, int tid) {
  return std::string(op_name(op)) + " at " + where(site) + " (thread " + std::to_string(tid) +
         ", mask " + hex(mask) + ")";
}

bool same_site(const Site& a, const Site& b) {
  return a.line() == b.line() && std::strcmp(a.file_name(), b.file_name()) == 0;
}

// The lane whose value `lane` reads in shuffle `op` (itself for non-shuffles and out-of-range).
int source_lane(WarpOp op, int lane, int arg, int width) {
  const int base = lane / width * width, in_segment = lane % width;
  switch (op) {
    case WarpOp::kShflIdx: return base + ((arg % width) + width) % width;
    case WarpOp::kShflUp: return in_segment >= arg ? lane - arg : lane;
    case WarpOp::kShflDown: return in_segment + arg < width ? lane + arg : lane;
    case WarpOp::kShflXor: {
      const int other = lane ^ arg;
      return other >= 0 && other < kWarp && other / width <= lane / width ? other : lane;
    }
    default: return lane;
  }
}

}  // namespace

uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width, Site site) {
  Runtime& r = rt();
  Fiber* f = r.current;
  if (f == nullptr) fatal("a warp intrinsic was called outside a kernel");
  const int w = f->tid / kWarp, lane = f->tid % kWarp;
  WarpSlot& slot = r.warps[w];
  if (!(mask >> lane & 1u)) {
    abort_launch(collective_name(op, mask, site, f->tid) +
                 ": the mask does not include the calling lane");
  }
  if (width <= 0 || width > kWarp || (width & (width - 1)) != 0) {
    abort_launch(collective_name(op, mask, site, f->tid) + ": width " + std::to_string(width) +
                 " is not a power of two <= 32");
  }
  if ((mask & ~slot.live) != 0) {
    abort_launch(collective_name(op, mask, site, f->tid) + ": the mask names lane(s) " +
                 ranges(lanes_of(mask & ~slot.live)) +
                 ", which exited or do not exist in this block");
  }
  if (!slot.open) {
    slot.open = true;
    slot.op = op;
    slot.mask = mask;
    slot.width = width;
    slot.site = site;
    slot.arrived = 0;
  } else if (slot.op != op || slot.mask != mask || slot.width != width ||
             !same_site(slot.site, site)) {
    abort_launch(collective_name(op, mask, site, f->tid) + ": called divergently — lanes " +
                 ranges(lanes_of(slot.arrived)) + " of the warp wait in " + op_name(slot.op) +
                 " at " + where(slot.site) + " with mask " + hex(slot.mask) + " and width " +
                 std::to_string(slot.width));
  }
  const int src = source_lane(op, lane, arg, width);
  if (!(mask >> src & 1u)) {
    abort_launch(collective_name(op, mask, site, f->tid) + ": lane " + std::to_string(lane) +
                 " reads lane " + std::to_string(src) +
                 ", which is not in the mask (undefined value)");
  }
  slot.value[lane] = value;
  slot.src[lane] = src;
  slot.arrived |= 1u << lane;
  ++r.stats.warp_ops;
  if (slot.arrived != slot.mask) {
    block_until_woken(f, op_name(op), site);
    return f->result;
  }
  // The last lane to arrive completes the collective for all.
  uint64_t votes = 0;
  for (unsigned m = mask; m != 0; m &= m - 1) {
    const int l = __builtin_ctz(m);
    votes |= (slot.value[l] != 0 ? 1ull : 0ull) << l;
  }
  Fiber* const* lanes = &r.pool[w * kWarp];
  for (unsigned m = mask; m != 0; m &= m - 1) {
    const int l = __builtin_ctz(m);
    Fiber* other = lanes[l];
    other->result = op == WarpOp::kBallot     ? votes
                    : op == WarpOp::kSyncwarp ? 0
                                              : slot.value[slot.src[l]];
    if (other != f) other->state = State::kRunnable;
  }
  slot.open = false;
  return f->result;
}

int block_barrier(int predicate, const char* what, Site site) {
  Runtime& r = rt();
  Fiber* f = r.current;
  if (f == nullptr) fatal("__syncthreads was called outside a kernel");
  BarrierSlot& b = r.barrier;
  if (!b.open) {
    b = BarrierSlot{true, what, site, 0, 0};
  } else if (std::strcmp(b.what, what) != 0 || !same_site(b.site, site)) {
    abort_launch(std::string(what) + " at " + where(site) + " (thread " +
                 std::to_string(f->tid) + "): divergent barrier — " +
                 std::to_string(b.arrived) + " threads wait in " + b.what + " at " +
                 where(b.site));
  }
  ++b.arrived;
  b.count += predicate != 0;
  ++r.stats.barriers;
  if (b.arrived < r.threads - r.exited) {
    block_until_woken(f, what, site);
    return static_cast<int>(f->result);
  }
  if (r.exited > 0) {
    std::vector<int> gone;
    for (int t = 0; t < r.threads; ++t) {
      if (r.pool[t]->state == State::kDone) gone.push_back(t);
    }
    abort_launch(std::string(what) + " at " + where(site) + ": threads " + ranges(gone) +
                 " exited without reaching this barrier");
  }
  for (int t = 0; t < r.threads; ++t) {
    Fiber* other = r.pool[t];
    other->result = static_cast<uint64_t>(b.count);
    if (other != f) other->state = State::kRunnable;
  }
  b.open = false;
  return b.count;
}

void* shared_alloc(const void* tag, size_t bytes, size_t align, Site site) {
  Runtime& r = rt();
  if (r.current == nullptr) fatal("a __shared__ variable was used outside a kernel");
  for (const auto& [t, offset] : r.allocations) {
    if (t == tag) return r.arena + offset;
  }
  const size_t a = std::max<size_t>(align, 16);
  const size_t offset = (r.static_used + a - 1) / a * a;
  if (offset + bytes + r.config->shared_bytes > kSharedLimit) {
    abort_launch("__shared__ variable at " + where(site) + " needs " + std::to_string(bytes) +
                 " bytes at offset " + std::to_string(offset) + " with " +
                 std::to_string(r.config->shared_bytes) +
                 " dynamic bytes: more than the 48 KiB of shared memory a block may use");
  }
  r.static_used = offset + bytes;
  r.allocations.emplace_back(tag, offset);
  return r.arena + offset;
}

void* dynamic_shared(size_t align, Site site) {
  (void)align, (void)site;
  return rt().arena + kDynamicOffset;
}

}  // namespace simt
