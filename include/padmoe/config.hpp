// padmoe/config.hpp — build-wide macros shared by host and device code.
//
// PADMOE_HD marks the index math that the CPU backend and the CUDA kernels
// both call: `__host__ __device__` when compiled by nvcc, plain `inline`
// otherwise. Nothing here includes a CUDA header.
#pragma once

#if defined(__CUDACC__)
#define PADMOE_HD __host__ __device__ __forceinline__
#else
#define PADMOE_HD inline
#endif

#define PADMOE_VERSION_MAJOR 0
#define PADMOE_VERSION_MINOR 1
#define PADMOE_VERSION_PATCH 0
