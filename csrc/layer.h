// The synchronized layer as one C++ call per direction (layer.cpp): the forward's statistics,
// its collective and the merge/normalize in one operator, `syncbn::sync_batch_norm`, whose
// autograd node is C++ too (its backward: the gradient sums, their collective, the input
// gradient). Collectives go through the c10d ProcessGroup of the layer's group, from C++
// (layer_comm.cpp); failures and call-order mismatches are handed to Python's error reporting
// (the only Python that can run during a call, and only when it fails).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <string>

#include "flight.h"
#include "syncbn.h"

namespace syncbn::layer {

// How a layer call synchronizes: fixed per layer when the Python layer makes its plan
// (nn/sync_plan.py), passed per call.
struct Settings {
  c10::optional<std::string> group;  // the process group's name; none: nothing to communicate
  int64_t world_size = 1;            // ranks in the group
  int64_t layer_tag = 0;             // the call-order tag
  bool reduce = false;               // the reduce exchange (else gather)
  MergeSettings merge;               // momentum, eps, the variance's, the fused activation
};

// The layer's tensors a call updates in place (all on the input's device).
struct State {
  c10::optional<at::Tensor> running_mean, running_var, num_batches_tracked, nonfinite;
  at::Tensor calls;  // the layer's call counter (the call tag), one int64
};

// What the flight recorder notes of a collective.
struct Note {
  flight::Direction direction;
  int64_t layer_tag;
  int64_t call;
};

// Every rank's 1-D `tensor` concatenated in rank order (`tensor` itself without a group).
at::Tensor all_gather(const at::Tensor& tensor, const Settings& settings, const Note& note);
// The backward's (and the reduce exchange's) sums of every rank: all-gathered in CPU groups of up
// to kGatherSumMaxRanks ranks (rows summed in rank order by the caller), else all-reduced (into
// `tensor` itself when `in_place`).
at::Tensor sum_over_group(
    const at::Tensor& tensor, const Settings& settings, const Note& note, bool in_place);
constexpr int64_t kGatherSumMaxRanks = 8;  // GATHER_SUM_MAX_RANKS in Python

// The layer's input checks (nn/checks.py's check_input, the same messages and exception types):
// the input against the layer's channels and its first tensor (the weight, else the running mean).
void check_layer_input(
    const at::Tensor& input, int64_t num_features, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& running_mean);

// What a call-order mismatch was found in (syncbn_lightning/functional/native.py names them).
enum class Mismatch : int64_t { kGatheredRows = 0, kReduceSums = 1, kBackwardSums = 2 };
// Whether `error` is the kernels' call-order error (and not the reduce exchange's differing
// running means, which names its own fix).
bool is_call_order_error(const c10::Error& error);
// Raises the CallOrderError naming every rank's layer, through Python (an error path every rank
// of the group takes at the same call; it may gather the ranks' tags); rethrows `original` if
// that does not raise.
[[noreturn]] void call_order_failed(
    Mismatch kind, const at::Tensor& data, const at::Tensor& aux, int64_t width,
    const Settings& settings, const c10::Error& original);
// Makes sure the flight recorder's ring is attached (Python makes it on the first call of a job).
void ensure_flight_ring();

}  // namespace syncbn::layer
