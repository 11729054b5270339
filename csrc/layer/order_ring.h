// The C++ path's queue of call-order flags not yet read (one per process): a call on a device
// whose flags would cost a host sync to read (CUDA) copies its flag into a slot of the device's
// FlagStore (flag_store.h) and queues it here with what a report of a mismatch needs. Later calls
// poll the queue, oldest first, before their collectives: an event query per landed slot, no host
// sync, and no Python unless a flag reads 0. Python's check_call_order drains it (one host sync).
//
// Slots are given out in ring order: the entry at ring position p owns slot p of its store until
// it is taken off, so a slot is never rewritten while its copy may still be read. A full ring is
// drained (waited for) before the next flag is queued.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "flag_store.h"

namespace syncbn::layer {

// What the report of a queued flag that reads 0 needs: syncbn::queued_order_failed's arguments
// (layer.h's Mismatch as `kind`, the data it reads, one rank's width, the group, the layer).
struct FlagReport {
  int64_t kind = 0;
  at::Tensor data, aux;
  int64_t width = 0;
  c10::optional<std::string> group;
  int64_t world_size = 1;
  int64_t layer_tag = 0;
};

class OrderRing {
 public:
  explicit OrderRing(int64_t capacity = kOrderFlagSlots);

  // Queues `flags[index]`, copied by `store` into the next slot. False, queueing nothing, when
  // the ring is full (the caller drains it first).
  bool push(FlagStore& store, const at::Tensor& flags, int64_t index, FlagReport report);
  // Takes off, oldest first, the entries whose copy has landed, up to the first not landed. The
  // report of the first that reads 0 (the ring is then emptied: the ranks have parted, later
  // flags mean nothing), else none. No host sync.
  c10::optional<FlagReport> poll();
  // poll() after waiting for every queued copy (a host sync per entry's device).
  c10::optional<FlagReport> drain();
  // Empties the ring (another check found a mismatch: the queued flags mean nothing).
  void clear();

  int64_t size() const;
  int64_t capacity() const { return static_cast<int64_t>(entries_.size()); }
  // (kind, layer tag) of the queued entries' reports, oldest first (what tests inspect).
  std::vector<std::pair<int64_t, int64_t>> queued() const;

 private:
  struct Entry {
    FlagStore* store = nullptr;
    FlagReport report;
  };
  // Takes entries off while `ready(store, slot)`; see poll().
  template <typename Ready>
  c10::optional<FlagReport> take(Ready ready);

  mutable std::mutex mutex_;  // forward (the caller's thread) and backward (autograd's) both queue
  std::vector<Entry> entries_;
  int64_t head_ = 0, size_ = 0;
};

// The process's ring.
OrderRing& order_ring();

}  // namespace syncbn::layer
