// The flight recorder's state and writer in C++ (see flight.h), and the `syncbn::flight_*`
// operators through which Python attaches its ring and records into it (registered below).
//
// The ring's layout is shared_constants.h's (generated from syncbn_lightning/_shared.py, which
// Python's recorder and reader use too): a kHeaderSize-byte header (the record count `written`,
// int64, at byte kWrittenOffset) and `capacity` records of kRecordSize bytes, little-endian: the
// sequence number in the group, the time (seconds since the epoch), bytes sent, the layer's call
// number, its tag, the op, the direction, two bytes of padding and the group's name (kGroupBytes,
// zero padded). The count is written after the record, so a reader (or a kill) between the two
// sees the previous count.
#include "flight.h"
#include "check.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace syncbn::flight {
namespace {

// The C++ side keeps no tensor of the ring: a torch.frombuffer view's deleter releases a Python
// object and needs the GIL, so a view dropped here (a re-attach, a detach, the exit) could wait for
// the GIL while holding `mutex`, which a thread holding the GIL may wait for (two ranks hung in
// their first step on torch 2.8). Python keeps the memory alive while it is attached
// (distributed/flight/writer.py, until its recorder closes).
struct Ring {
  uint8_t* base = nullptr;  // the Python recorder's memory
  int64_t capacity = 0;
  int64_t written = 0;
  std::unordered_map<std::string, int64_t> group_seq;
  std::unordered_map<int64_t, int64_t> calls;
};

std::mutex mutex;
Ring ring;  // detached while base is null

template <typename T>
void put(uint8_t* at, T value) {
  std::memcpy(at, &value, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
}

}  // namespace

void attach(
    const at::Tensor& buffer, int64_t capacity, int64_t written,
    const std::vector<std::string>& groups, const std::vector<int64_t>& seqs,
    const std::vector<int64_t>& tags, const std::vector<int64_t>& calls) {
  SYNCBN_CHECK(
      buffer.device().is_cpu() && buffer.scalar_type() == at::kByte && buffer.is_contiguous(),
      "syncbn: flight_attach: `buffer` must be a contiguous uint8 CPU tensor");
  SYNCBN_CHECK(capacity >= 1, "syncbn: flight_attach: `capacity` must be >= 1");
  SYNCBN_CHECK(
      buffer.numel() >= kHeaderSize + capacity * kRecordSize,
      "syncbn: flight_attach: `buffer` is smaller than the ring of `capacity` records");
  SYNCBN_CHECK(
      groups.size() == seqs.size() && tags.size() == calls.size(),
      "syncbn: flight_attach: `groups`/`seqs` and `tags`/`calls` must have equal lengths");
  std::lock_guard<std::mutex> lock(mutex);
  ring = Ring{};
  ring.base = buffer.mutable_data_ptr<uint8_t>();
  ring.capacity = capacity;
  ring.written = written;
  for (size_t i = 0; i < groups.size(); ++i) ring.group_seq[groups[i]] = seqs[i];
  for (size_t i = 0; i < tags.size(); ++i) ring.calls[tags[i]] = calls[i];
}

void detach() {
  std::lock_guard<std::mutex> lock(mutex);
  ring = Ring{};
}

bool attached() {
  std::lock_guard<std::mutex> lock(mutex);
  return ring.base != nullptr;
}

int64_t next_call(int64_t layer_tag) {
  std::lock_guard<std::mutex> lock(mutex);
  return ring.calls[layer_tag]++;
}

int64_t current_call(int64_t layer_tag) {
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = ring.calls.find(layer_tag);
  return found == ring.calls.end() ? 0 : std::max<int64_t>(found->second - 1, 0);
}

void record(
    const std::string& group, Op op, Direction direction, int64_t nbytes, int64_t layer_tag,
    int64_t call) {
  if (call < 0) return;
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::lock_guard<std::mutex> lock(mutex);
  if (ring.base == nullptr) return;
  const int64_t seq = ring.group_seq[group]++;
  uint8_t* at = ring.base + kHeaderSize + (ring.written % ring.capacity) * kRecordSize;
  put<int64_t>(at + kSeqAt, seq);
  put<double>(at + kTimeAt, now);
  put<int64_t>(at + kNbytesAt, nbytes);
  put<int64_t>(at + kCallAt, call);
  put<int32_t>(at + kLayerTagAt, static_cast<int32_t>(layer_tag));
  at[kOpAt] = op;
  at[kDirectionAt] = direction;
  std::memset(at + kDirectionAt + 1, 0, kGroupAt - kDirectionAt - 1);  // the padding
  std::memset(at + kGroupAt, 0, kGroupBytes);
  const size_t name_bytes = std::min(group.size(), static_cast<size_t>(kGroupBytes));
  std::memcpy(at + kGroupAt, group.data(), name_bytes);
  ++ring.written;
  put<int64_t>(ring.base + kWrittenOffset, ring.written);
}

}  // namespace syncbn::flight

// The flight recorder's operators (flight.h): Python attaches its ring, and, once attached,
// records through the same state (distributed/flight/writer.py). One kernel for every key.
TORCH_LIBRARY_FRAGMENT(syncbn, m) {
  m.def(
      "flight_attach(Tensor buffer, int capacity, int written, str[] groups, int[] seqs, "
      "int[] tags, int[] calls) -> ()",
      [](const at::Tensor& buffer, int64_t capacity, int64_t written,
         const std::vector<std::string>& groups, const std::vector<int64_t>& seqs,
         const std::vector<int64_t>& tags, const std::vector<int64_t>& calls) {
        syncbn::flight::attach(buffer, capacity, written, groups, seqs, tags, calls);
      });
  m.def("flight_detach() -> ()", &syncbn::flight::detach);
  m.def(
      "flight_record(str group, int op, int direction, int nbytes, int layer_tag, int call) -> ()",
      [](const std::string& group, int64_t op, int64_t direction, int64_t nbytes,
         int64_t layer_tag, int64_t call) {
        syncbn::flight::record(
            group, static_cast<syncbn::flight::Op>(op),
            static_cast<syncbn::flight::Direction>(direction), nbytes, layer_tag, call);
      });
  m.def("flight_next_call(int layer_tag) -> int", &syncbn::flight::next_call);
  m.def("flight_current_call(int layer_tag) -> int", &syncbn::flight::current_call);
}
