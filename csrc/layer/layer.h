// The synchronized layer as one C++ call per direction (layer.cpp): the forward's statistics,
// its collective and the merge/normalize in one operator, `syncbn::sync_batch_norm`, whose
// autograd node is C++ too (its backward: the gradient sums, their collective, the input
// gradient). Collectives go through the c10d ProcessGroup of the layer's group, from C++
// (layer_comm.cpp). Call-order flags that would cost a host sync to read (CUDA) wait in a C++
// queue (order_flags.cpp, order_ring.h). Python runs during a call only through the hand-off
// operators whose kernels are Python's (functional/native.py): at a job's first collective (the
// flight recorder), when a collective fails, when a call-order check fails (at once, or a queued
// flag that reads 0), and when another rank published a mismatch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <string>

#include "flight.h"
#include "shared_constants.h"
#include "syncbn.h"

namespace syncbn::layer {

// How a layer call synchronizes: fixed per layer when the Python layer makes its plan
// (functional/layer_call.py), passed per call.
struct Settings {
  c10::optional<std::string> group;  // the process group's name; none: nothing to communicate
  int64_t world_size = 1;            // ranks in the group
  int64_t layer_tag = 0;             // the call-order tag
  bool reduce = false;               // the reduce exchange (else gather)
  // Leave the call-order flags for later (queue_order_flag): on devices where reading them
  // would cost a host sync per call (CUDA); on CPU only for tests of that path (the CPU kernels
  // still raise a mismatch at once).
  bool queue_order_flags = false;
  MergeSettings merge;               // momentum, eps, the variance's, the fused activation
};

// The fused steps of one device (syncbn.h's _cpu or _cuda twins): the orchestration in
// layer.cpp is the same for every device, only these differ.
struct StepKernels {
  StatsRowFn* stats_row;
  MergeNormalizeFn* merge_normalize;
  ReduceSumsFn* reduce_sums;
  ReduceMergeNormalizeFn* reduce_merge_normalize;
  GradSumsFn* grad_sums;
  GradSumsResidualFn* grad_sums_residual;
  GradInputFn* grad_input;
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

// Whether a collective's result is written into the tensor sent (the backward's sums, which
// nothing reads after) or into a new one (the reduce exchange's vector, which the merge compares).
enum class Summed : bool { kIntoCopy = false, kInPlace = true };

// Every rank's 1-D `tensor` concatenated in rank order (`tensor` itself without a group).
at::Tensor all_gather(const at::Tensor& tensor, const Settings& settings, const Note& note);
// The backward's (and the reduce exchange's) sums of every rank: all-gathered in CPU groups of up
// to kGatherSumMaxRanks ranks (shared_constants.h; rows summed in rank order by the caller), else
// all-reduced (into `tensor` itself when `in_place`).
at::Tensor sum_over_group(
    const at::Tensor& tensor, const Settings& settings, const Note& note, Summed where);

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
// of the group takes at the same call; it may gather the ranks' tags). Called in the handler of
// the kernel's error; returns only if Python did not raise, and then the caller rethrows the
// kernel's error (`throw;`, its own type kept).
void call_order_failed(
    Mismatch kind, const at::Tensor& data, const at::Tensor& aux, int64_t width,
    const Settings& settings);
// Before a collective of a call whose flags are queued (Settings::queue_order_flags): reads the
// queued flags the device has written (an event query each, no host sync) and raises the
// CallOrderError of the first that reads 0; then raises the mismatch another rank published
// (distributed/call_order/watcher.py), rather than joining a collective the group has given
// up. Python runs only on those errors.
void check_before_collective(const Settings& settings);
// Queues a call's call-order flag `flags[index]` (nonzero: in order) in the process's order ring
// (order_ring.h): copied to host memory behind the call's kernels, read by later calls' checks
// (check_before_collective) or by Python's check_call_order; nothing is queued while a CUDA graph
// is captured. `data`, `aux` and `width` are what the report of a mismatch reads (as for
// call_order_failed, without a collective). `tiny_input`: the input, when it has fewer than two
// values per channel (the group's count is then read on the host, as the Python path does).
void queue_order_flag(
    const at::Tensor& flags, int64_t index, Mismatch kind, const at::Tensor& data,
    const at::Tensor& aux, int64_t width, const Settings& settings,
    const at::Tensor& tiny_input);
// What order_flags.cpp hands to Python (layer_comm.cpp holds every hand-off): the report of a
// queued flag that read 0 (raises the CallOrderError naming the layers, after telling the group's
// other ranks; returns only if Python finds nothing to raise), and the check for a mismatch
// another rank published (raises its CallOrderError, or returns when there is none for this job).
struct FlagReport;  // order_ring.h
void queued_order_failed(const FlagReport& report);
void raise_if_published();
// Makes sure the flight recorder's ring is attached (Python makes it on the first call of a job).
void ensure_flight_ring();

}  // namespace syncbn::layer
