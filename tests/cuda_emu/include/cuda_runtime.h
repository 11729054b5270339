// Stand-in for the CUDA runtime header under the SIMT emulation: the types and the few runtime
// calls the project's kernels use, answered for an emulated H100 (SYNCBN_EMU_SM_COUNT overrides
// the multiprocessor count). Found before any real CUDA header (-I precedes torch's -isystem).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "simt_control.h"

enum cudaDeviceAttr : int {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
};

enum cudaMemcpyKind : int {
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int /*device*/) {
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; return cudaSuccess;
    case cudaDevAttrWarpSize: *value = 32; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = ::simt::sm_count(); return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

inline cudaError_t cudaGetLastError() { return ::simt::take_last_error(nullptr); }
inline cudaError_t cudaPeekAtLastError() { return ::simt::peek_last_error(); }
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
  }
  return "unknown error";
}
// Launches run to completion before they return: there is nothing to wait for.
inline cudaError_t cudaDeviceSynchronize() { return ::simt::peek_last_error(); }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return ::simt::peek_last_error(); }
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t = nullptr) {
  std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind,
                                   cudaStream_t = nullptr) {
  std::memmove(d, s, n);
  return cudaSuccess;
}

namespace simt {
bool capturing();
}  // namespace simt

// Pinned host memory: plain heap memory (never freed by the callers either). Refused while the
// emulated device captures a graph, as CUDA refuses it (the capture would be invalidated).
constexpr unsigned int cudaHostAllocDefault = 0, cudaHostAllocPortable = 1;
inline cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int /*flags*/) {
  if (::simt::capturing()) return cudaErrorStreamCaptureUnsupported;
  *p = std::malloc(n);
  return *p != nullptr ? cudaSuccess : cudaErrorInvalidValue;
}

// Events: each record takes the next ticket of the emulated device; the device has completed
// every ticket unless ::simt::hold_device held it (simt_control.h).
struct CUevent_st {
  uint64_t ticket = 0;
};
using cudaEvent_t = CUevent_st*;
constexpr unsigned int cudaEventDefault = 0, cudaEventDisableTiming = 2;
namespace simt {
uint64_t record_event();               // the new event's ticket
bool event_completed(uint64_t ticket);  // whether the emulated device got there
void wait_event(uint64_t ticket);       // the host waits: the device gets there
bool capturing();
}  // namespace simt
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int /*flags*/) {
  *e = new CUevent_st();
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr) {
  e->ticket = ::simt::record_event();
  return cudaSuccess;
}
// Asking or waiting for an event is refused during a capture, as CUDA refuses it.
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (::simt::capturing()) return cudaErrorStreamCaptureUnsupported;
  return ::simt::event_completed(e->ticket) ? cudaSuccess : cudaErrorNotReady;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (::simt::capturing()) return cudaErrorStreamCaptureUnsupported;
  ::simt::wait_event(e->ticket);
  return cudaSuccess;
}

enum cudaStreamCaptureStatus : int {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
};
inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* status) {
  *status = ::simt::capturing() ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
