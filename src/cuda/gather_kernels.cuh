// gather_kernels.cuh — row_dots a warp an assignment, and gather by map (pad / unpad, sort_chunks'
// rows), with or without dots. Included by rows.cu.
#pragma once

#include "cuda/row_io.cuh"

namespace padmoe {
namespace cuda {
namespace {

constexpr int kWarpUnits = 8;  // the gather's warp dots: 16-byte units a lane in flight

// row_dots a warp an assignment (top-2 and above top_k 8): each lane sums its units in ascending
// order, then a fixed shuffle tree. Deterministic; the order differs from reduce_token_kernel's
// (a block a token), so the bits may differ between the two.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    row_dots_warp_kernel(RowsArg y, RowsArg g, int top_k, const int32_t* __restrict__ dest, int64_t assignments,
                         FloatOutArg out) {
  pdl_begin();
  using U = Unit<T, kVec>;
  const int64_t a = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (a >= assignments) return;
  const int64_t r = plan_rows(dest).dest_row(a);
  const int64_t units = units_of<U>(g);
  float partial = 0.0f;
  if (r >= 0 && r < y.rows) {
    const char* yrow = row_ptr(y, r);
    const char* grow = row_ptr(g, a / top_k);
    int64_t u = lane;
    for (; u + 96 < units; u += 128) {  // four pairs of loads in flight
      typename U::Raw ya[4], ga[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        ya[i] = U::load(yrow, u + 32 * i);
        ga[i] = U::load(grow, u + 32 * i);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) partial += U::dot(ya[i], ga[i]);
    }
    for (; u < units; u += 32) partial += U::dot(U::load(yrow, u), U::load(grow, u));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, off);
  if (lane == 0) store_float(out, a, r < 0 ? 0.0f : partial);
}

// --- gather by map ------------------------------------------------------------------
// A block owns rows_per_block consecutive output rows (several when rows are
// short, so that each thread keeps up to kRegUnits loads in flight); the map
// entries are staged first, then the rows move flattened over (row, unit).
constexpr int kMaxMapRows = 8;

// kScales: the rows' scale rows move with them, by the same block.
template <typename T, bool kVec, bool kScales>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(RowsArg src, IndexRef map, ScaleArg s, bool scale_by_source, RowsArg out, const int32_t* row_limit,
                  int rows_per_block, bool skip_unmapped, ScaleRowsArg sc) {
  pdl_begin(l2_share(src));  // src.l2_blocks > 0: the first blocks ask L2 for all of src
  using U = Unit<T, kVec>;
  __shared__ int64_t s_from[kMaxMapRows];
  __shared__ float s_scale[kMaxMapRows];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  int64_t limit = out.rows;
  if (row_limit != nullptr && *row_limit < limit) limit = *row_limit;
  if (r0 >= limit) return;
  const int nrows = limit - r0 < rows_per_block ? static_cast<int>(limit - r0) : rows_per_block;
  if (threadIdx.x < nrows) {
    const int64_t r = r0 + threadIdx.x;
    const int64_t from = load_index(map, r);
    s_from[threadIdx.x] = from;
    s_scale[threadIdx.x] = from < 0 ? 0.0f : load_scale(s, scale_by_source ? from : r);
  }
  __syncthreads();
  if (kScales) {  // the block's scale rows, flattened over (row, entry)
    for (int64_t i = threadIdx.x; i < nrows * sc.cols; i += kThreads) {
      const int row = static_cast<int>(i / sc.cols);
      const int64_t from = s_from[row];
      if (from >= 0 || !skip_unmapped) move_scale_entry(sc, r0 + row, from, i % sc.cols);
    }
  }
  const int units = static_cast<int>(units_of<U>(out));
  const int n = nrows * units;
  for (int base = 0; base < n; base += kChunkUnits) {
    typename U::Raw v[kRegUnits];
#pragma unroll
    for (int j = 0; j < kRegUnits; ++j) {
      const int i = base + j * kThreads + static_cast<int>(threadIdx.x);
      if (i < n) {
        const int row = i / units;
        const int64_t from = s_from[row];
        v[j] = from < 0 ? U::zero() : U::load(row_ptr(src, from), i - row * units);
      }
    }
#pragma unroll
    for (int j = 0; j < kRegUnits; ++j) {
      const int i = base + j * kThreads + static_cast<int>(threadIdx.x);
      if (i < n) {
        const int row = i / units;
        const bool plain = s.data == nullptr || s_from[row] < 0;
        if (skip_unmapped && s_from[row] < 0) continue;
        U::store(row_ptr(out, r0 + row), i - row * units, plain ? v[j] : U::scale(v[j], s_scale[row]));
      }
    }
  }
}

// Gather with dots, a warp an output row (unpad's backward with grad_probs): row r takes
// src[from] * s[from] (from = map[r]; zero for from < 0 or past src's rows) and
// dots[from] = <dots_with[r], src[from]> from the same read of src[from] (so src is read
// once, and no inverse map is built). Rows no map entry names keep the zero that
// fill_dots_kernel wrote first. Deterministic: each dot is one warp's (ascending units a
// lane, then a fixed shuffle tree).
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) gather_dots_warp_kernel(RowsArg src, IndexRef map, ScaleArg s, RowsArg out,
                                                                    int64_t rows, RowsArg dots_with, FloatOutArg dots) {
  pdl_begin();
  using U = Unit<T, kVec>;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  int64_t from = load_index(map, r);
  if (from >= src.rows) from = -1;  // only with unchecked bad input
  const int64_t units = units_of<U>(out);
  char* dst = row_ptr(out, r);
  if (from < 0) {
    for (int64_t u = lane; u < units; u += 32) U::store(dst, u, U::zero());
    return;
  }
  const char* x = row_ptr(src, from);
  const char* with = row_ptr(dots_with, r);
  const float sk = load_scale(s, from);
  float partial = 0.0f;
  for (int64_t c = 0; c < units; c += 32 * kWarpUnits) {
    typename U::Raw xv[kWarpUnits], dv[kWarpUnits];
#pragma unroll
    for (int j = 0; j < kWarpUnits; ++j) {
      const int64_t u = c + j * 32 + lane;
      if (u < units) {
        xv[j] = U::load(x, u);
        dv[j] = U::load(with, u);
      }
    }
#pragma unroll
    for (int j = 0; j < kWarpUnits; ++j) {
      const int64_t u = c + j * 32 + lane;
      if (u < units) {
        U::store(dst, u, s.data == nullptr ? xv[j] : U::scale(xv[j], sk));
        partial += U::dot(dv[j], xv[j]);
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, off);
  if (lane == 0) store_float(dots, from, partial);
}

__global__ void fill_dots_kernel(FloatOutArg dots, int64_t n) {
  pdl_begin();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    store_float(dots, i, 0.0f);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace padmoe
