// Stand-in for the CUDA runtime header under the SIMT emulation: the types and the few runtime
// calls the project's kernels use, answered for an emulated H100 (SYNCBN_EMU_SM_COUNT overrides
// the multiprocessor count). Found before any real CUDA header (-I precedes torch's -isystem).
#pragma once

#include <cstring>

#include "simt_control.h"

enum cudaDeviceAttr : int {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
};

enum cudaMemcpyKind : int { cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4 };

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
