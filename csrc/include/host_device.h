// SYNCBN_HOST_DEVICE marks the functions that the CPU and the CUDA kernels share (activation.h,
// merge.h): host and device code under nvcc, plain inline functions for the host compiler.
#pragma once

#ifdef __CUDACC__
#define SYNCBN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SYNCBN_HOST_DEVICE inline
#endif
