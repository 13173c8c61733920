// common.cuh — device-side helpers shared by the CUDA kernels: error checks,
// index loads, element load/store as float, 16-byte vectors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "core/kernel_overrides.hpp"
#include "core/kernel_policy.hpp"
#include "cuda/cuda_backend.hpp"
#include "padmoe/error.hpp"
#include "padmoe/index_math.hpp"

namespace padmoe {
namespace cuda {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw Error(ErrorKind::kRuntime, std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err));
  }
}
#define PADMOE_CUDA_CHECK(expr) ::padmoe::cuda::check_cuda((expr), #expr)

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Programmatic dependent launch (sm_90 and up). Every padmoe kernel starts with pdl_begin():
// it waits until the kernel before it in the stream has finished and its writes are visible
// (griddepcontrol.wait), then lets the next kernel's blocks be scheduled (launch_dependents).
// launch_kernel() launches with programmatic stream serialization, so the next kernel's launch
// and block placement overlap the tail of this one instead of following it; no memory access
// runs before the wait, so the stream order of every read and write is what it was. Without
// the attribute (older devices, KernelOverrides::pdl false) both instructions are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_begin() {
  pdl_wait();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// An L2 prefetch (cp.async.bulk.prefetch.L2, sm_90; nothing on older devices) of `bytes` (a
// multiple of 16) from the 16-byte-aligned p. It brings no value into the SM, so a kernel may issue
// it before its wait: the L2 is the device's point of coherence, so a line it brings in while the
// kernel ahead is still running is the line that kernel's later writes update, and every load of
// the kernel still follows the wait. What it buys: rows the kernel will read are on their way from
// DRAM while the kernel ahead runs, instead of after it. Measured on the H200
// it pays only behind a long wait: sort_chunks'
// gather behind its one-block layout kernel, decode 24.9 -> 23.4 us in a graph. A prefetch shortly
// before the loads of the same lines costs: dispatch behind make_plan at decode 22.9 -> 23.6 us,
// pad_to_alignment's gather 28.1 -> 28.6 (behind an early-triggered map) and 30.1 (after it).
__device__ __forceinline__ void l2_prefetch(const char* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}
// count rows of `bytes` each, `stride` bytes apart from `first` (thread i: row i, i + blockDim.x, ...).
struct L2Rows {
  const char* first = nullptr;
  int64_t stride = 0;
  int count = 0;
  uint32_t bytes = 0;
};
// pdl_begin() after asking L2 for the rows (no rows: pdl_begin() itself).
__device__ __forceinline__ void pdl_begin(const L2Rows& rows) {
  for (int i = static_cast<int>(threadIdx.x); i < rows.count; i += static_cast<int>(blockDim.x)) {
    l2_prefetch(rows.first + i * rows.stride, rows.bytes);
  }
  pdl_begin();
}

// A kernel that starts with pdl_wait() alone lets the next kernel launch only as its own blocks
// exit (the implicit trigger), so the next kernel's blocks never share an SM with it. For a
// kernel with much shared memory followed by a long row pass: measured on the H200 at
// deepseek-v3, pad_to_alignment (a map kernel with 32 KiB of shared memory, then the gather) took
// 976 us without PDL and 998 us with the early trigger (the gather's blocks, placed beside the
// map's, presumably inherit its shared-memory carveout for the whole pass).

// Whether launch_kernel asks for programmatic stream serialization on the current device: on
// devices of compute capability 9.0 and up unless KernelOverrides::pdl is false (memory.cu).
bool pdl_enabled();

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization when
// pdl_enabled(), as a cooperative launch (every block resident at once, for a grid barrier) when
// `cooperative`; returns the launch's error (a cooperative grid too large for the device:
// cudaErrorCooperativeLaunchTooLarge).
template <typename... Params, typename... Args>
cudaError_t try_launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                              bool cooperative, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned n = 0;
  if (pdl_enabled()) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cooperative) {
    attribute[n].id = cudaLaunchAttributeCooperative;
    attribute[n++].val.cooperative = 1;
  }
  config.attrs = attribute;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// try_launch_kernel, not cooperative; errors name the kernel.
template <typename... Params, typename... Args>
void launch_kernel(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  check_cuda(try_launch_kernel(kernel, grid, block, smem, stream, false, std::forward<Args>(args)...), name);
}

__device__ __forceinline__ int64_t load_index(const IndexRef& r, int64_t i) {
  return r.wide ? static_cast<const int64_t*>(r.data)[i] : static_cast<int64_t>(static_cast<const int32_t*>(r.data)[i]);
}

// Entry i as an int, for arrays whose valid values are small non-negative ints: a wide entry
// outside [0, 2^31) reads as -1 (out of range for every such use).
__device__ __forceinline__ int load_index32(const IndexRef& r, int i) {
  if (!r.wide) return static_cast<const int32_t*>(r.data)[i];
  const int64_t v = static_cast<const int64_t*>(r.data)[i];
  return v >= 0 && v <= 0x7fffffff ? static_cast<int>(v) : -1;
}

// Element traits: storage type, load as float, store from float (round to nearest even).
struct F32 {
  using S = float;
  __device__ static float ld(S v) { return v; }
  __device__ static S st(float f) { return f; }
};
struct F16 {
  using S = __half;
  __device__ static float ld(S v) { return __half2float(v); }
  __device__ static S st(float f) { return __float2half_rn(f); }
};
struct BF16 {
  using S = __nv_bfloat16;
  __device__ static float ld(S v) { return __bfloat162float(v); }
  __device__ static S st(float f) { return __float2bfloat16_rn(f); }
};

// Scale value i (1 when absent), float32 or a row dtype.
__device__ __forceinline__ float load_scale(const ScaleArg& s, int64_t i) {
  if (s.data == nullptr) return 1.0f;
  switch (s.dtype) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(s.data)[i]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(s.data)[i]);
    default: return static_cast<const float*>(s.data)[i];
  }
}
__device__ __forceinline__ void store_float(const FloatOutArg& o, int64_t i, float v) {
  switch (o.dtype) {
    case DType::kFloat16: static_cast<__half*>(o.data)[i] = __float2half_rn(v); break;
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(o.data)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(o.data)[i] = v; break;
  }
}

// Calls f(Traits{}) for a float32/16/bf16 dtype (host side, picks the kernel).
template <typename F>
void with_traits(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16: f(F16{}); break;
    case DType::kBFloat16: f(BF16{}); break;
    default: f(F32{}); break;
  }
}

// 16-byte vectors of row elements.
struct alignas(16) Vec16 {
  uint4 raw;
};
template <typename T>
struct VecTraits {
  static constexpr int kElems = 16 / sizeof(typename T::S);
};

// Whether every row of `r` can be moved in 16-byte vectors.
inline bool rows_vectorizable(const RowsArg& r) {
  const int64_t row_bytes = r.cols * static_cast<int64_t>(element_size(r.dtype));
  return (reinterpret_cast<uintptr_t>(r.data) % 16 == 0) && (row_bytes % 16 == 0) && (r.stride_bytes % 16 == 0);
}

__device__ __forceinline__ char* row_ptr(const RowsArg& r, int64_t row) {
  return static_cast<char*>(r.data) + row * r.stride_bytes;
}

// The L2 prefetches of RowsArg::l2_bytes / l2_blocks (none when l2_bytes is 0): block b <
// l2_blocks asks for rows b, b + l2_blocks, ... (all the rows over the grid's first blocks).
__device__ __forceinline__ L2Rows l2_share(const RowsArg& r) {
  const int64_t b = blockIdx.x;
  if (r.l2_bytes == 0 || r.l2_blocks <= 0 || b >= r.l2_blocks || b >= r.rows) return L2Rows{};
  const int64_t n = (r.rows - b + r.l2_blocks - 1) / r.l2_blocks;
  return L2Rows{row_ptr(r, b), r.stride_bytes * r.l2_blocks, static_cast<int>(n), r.l2_bytes};
}

// The multiprocessors (132, an H200's, if unknown) and the L2's bytes (50 MiB if unknown) of the
// current device, asked once a device. Host code (memory.cu).
int sm_count();
int64_t l2_cache_bytes();
// Whether the current device takes cooperative launches (asked once a device), until a launch there
// is refused as too large (fewer multiprocessors than it reports: MPS limits, green contexts) and
// cooperative_launch_refused() turns them off for that device. Host code (memory.cu).
bool cooperative_launch_supported();
void cooperative_launch_refused();
// What the kernel policy reads of the current device (sm_count, l2_cache_bytes, pdl_enabled), from
// one look-up of its attributes. Host code (memory.cu).
policy::Device device_policy();
// The overrides set by tests and `padmoe bench --variant` (all unset by default).
inline const detail::KernelOverrides& overrides() { return detail::kernel_overrides(); }

// r with l2_bytes / l2_blocks set where policy::l2_prefetch (or KernelOverrides::l2_prefetch)
// allows it (vec: 16-byte rows; blocks: RowsArg::l2_blocks), else cleared. Host code (dispatch.cu).
RowsArg with_l2_prefetch(const RowsArg& r, bool vec, int blocks);

// x rounded up to a multiple of m (x >= 0, m >= 1) in 32 bits: a mask when m is a power of two.
__device__ __forceinline__ int round_up_32(int x, int m) {
  return (m & (m - 1)) == 0 ? (x + m - 1) & -m : (x + m - 1) / m * m;
}

inline int grid_for(int64_t work, int per_block, int max_blocks = 65535 * 32) {
  int64_t g = (work + per_block - 1) / per_block;
  if (g < 1) g = 1;
  if (g > max_blocks) g = max_blocks;
  return static_cast<int>(g);
}

}  // namespace cuda
}  // namespace padmoe
