// Stand-in for c10/cuda/CUDAException.h under the SIMT emulation: the launch check raises the
// emulator's pending error (an invalid configuration or a kernel diagnostic) as a c10::Error.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <string>

#define C10_CUDA_CHECK(EXPR)                                                               \
  do {                                                                                     \
    const cudaError_t simt_err_ = (EXPR);                                                  \
    TORCH_CHECK(simt_err_ == cudaSuccess, "CUDA error (simt emulation): ",                 \
                cudaGetErrorString(simt_err_), " from ", #EXPR);                           \
  } while (0)

#define C10_CUDA_KERNEL_LAUNCH_CHECK()                                                     \
  do {                                                                                     \
    std::string simt_msg_;                                                                 \
    const cudaError_t simt_err_ = ::simt::take_last_error(&simt_msg_);                     \
    TORCH_CHECK(simt_err_ == cudaSuccess, "CUDA kernel failed (simt emulation): ",         \
                cudaGetErrorString(simt_err_), ": ", simt_msg_);                           \
  } while (0)
