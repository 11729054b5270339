// The flight recorder's writer in C++ (syncbn_lightning/distributed/flight/writer.py owns the
// ring and its file; this writes into the same memory). The synchronized layer's C++ path
// (layer.cpp) records its collectives here, without Python; the Python path records through the
// same state (the `syncbn::flight_*` operators, flight.cpp) once the ring is attached, so both
// keep one sequence number per process group and one call number per layer tag.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

// What a record says a collective was (the enums Op and Direction) and the ring's layout.
#include "shared_constants.h"

namespace syncbn::flight {

// Attaches the Python recorder's ring (`buffer`, uint8: its memory, which Python keeps alive
// until detach; no reference to the tensor is kept) and its state: records written, each group's
// next sequence number, each layer tag's next call number.
void attach(
    const at::Tensor& buffer, int64_t capacity, int64_t written,
    const std::vector<std::string>& groups, const std::vector<int64_t>& seqs,
    const std::vector<int64_t>& tags, const std::vector<int64_t>& calls);
// Drops the ring and the state (the recorder closes: a new job, or a test).
void detach();
// Whether a ring is attached.
bool attached();
// The call number of this call of the layer tagged `layer_tag` (0, 1, ...), counted.
int64_t next_call(int64_t layer_tag);
// The number of the layer's current call (its last next_call), for the error path's gather.
int64_t current_call(int64_t layer_tag);
// Appends one record (nothing without a ring, or for call < 0).
void record(
    const std::string& group, Op op, Direction direction, int64_t nbytes, int64_t layer_tag,
    int64_t call);

}  // namespace syncbn::flight
