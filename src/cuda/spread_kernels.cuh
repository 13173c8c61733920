// spread_kernels.cuh — spread: x[t] to its K destination rows y[dest[t*K+k]] (dispatch, gather,
// the grad of combine), padding rows zeroed by extra blocks of the same launch. Three kernels: a
// block a token (the row cached in registers), a warp a token (short rows), and with dot products
// a warp an assignment. Included by rows.cu.
#pragma once

#include "cuda/row_io.cuh"

namespace padmoe {
namespace cuda {
namespace {

// A block a token: the token's row is read once, a chunk of kRegUnits units a thread at a time, and
// stored from registers to its K destinations (scaled by w).
// kScales: the token's scale row is copied to its K destinations by the same block: thread i loads
// entry i with its first data loads and stores it once the destinations are staged (decode
// dispatch(fp8+scales) 12.9 -> 12.4 us in a graph against a load then a store each after the
// staging).
// kSearch: the destinations by a search of dest's sorted form (dest.rows null), else dest.rows.
template <typename T, bool kVec, bool kScales, bool kSearch = false>
__global__ void __launch_bounds__(kThreads, 1)
    spread_kernel(RowsArg x, int top_k, DestArg dest, ScaleArg w, RowsArg y, PaddingRef pad, bool zero_padding,
                  bool zero_past_end, ScaleRowsArg sc, int zero_rows) {
  pdl_begin();
  using U = Unit<T, kVec>;
  const int64_t tokens = x.rows;
  if (blockIdx.x >= tokens) {
    zero_padding_rows<U, kScales>(y, pad, zero_padding, zero_past_end,
                                  (static_cast<int64_t>(blockIdx.x) - tokens) * zero_rows, zero_rows, sc);
    return;
  }
  __shared__ int64_t s_dest[kGroupK];
  __shared__ float s_w[kGroupK];
  __shared__ int s_k[kSearch ? 1 : kGroupK];
  const int64_t t = blockIdx.x;
  const int64_t units = units_of<U>(y);
  const char* src = row_ptr(x, t);
  typename U::Raw reg[kRegUnits];
  load_chunk_units<U>(src, 0, units, reg);  // issued before the destinations are staged: the two loads overlap
  const bool own_scale = kScales && threadIdx.x < sc.cols;
  const uint32_t my_scale = own_scale ? load_scale_entry(sc, t, threadIdx.x) : 0u;
  int k0 = 0;
  bool first = true;
  do {  // the direct form stages only live assignments (one group for up to 64 of them, whatever top_k)
    int nk;
    if constexpr (kSearch) {
      nk = top_k - k0 < kGroupK ? top_k - k0 : kGroupK;
      stage_group<kGroupK, kSearch>(t, k0, nk, top_k, dest.rows, &dest, w, y.rows, false, s_dest, s_w, nullptr);
      k0 += nk;
    } else {
      nk = stage_live<kGroupK>(t, &k0, top_k, dest.rows, w, y.rows, false, FloatOutArg{}, s_dest, s_w, s_k, nullptr);
    }
    if (kScales) {  // entry i by thread i (entries past kThreads: a load each)
      if (own_scale) {
        for (int q = 0; q < nk; ++q) {
          const int64_t r = s_dest[q];
          if (r >= 0) store_scale_entry(sc, r, threadIdx.x, my_scale);
        }
      }
      for (int64_t i = kThreads + threadIdx.x; i < sc.cols; i += kThreads) {
        const uint32_t v = load_scale_entry(sc, t, i);
        for (int q = 0; q < nk; ++q) {
          const int64_t r = s_dest[q];
          if (r >= 0) store_scale_entry(sc, r, i, v);
        }
      }
    }
    for (int64_t c = 0; c < units; c += kChunkUnits) {
      if (c > 0 || !first) load_chunk_units<U>(src, c, units, reg);
      for (int q = 0; q < nk; ++q) {
        const int64_t r = s_dest[q];
        if (r < 0) continue;
        char* out = row_ptr(y, r);
        const float wk = s_w[q];
#pragma unroll
        for (int j = 0; j < kRegUnits; ++j) {
          const int64_t u = c + j * kThreads + threadIdx.x;
          if (u < units) U::store(out, u, w.data == nullptr ? reg[j] : U::scale(reg[j], wk));
        }
      }
    }
    first = false;
  } while (k0 < top_k);
}

// Spread with dots, a warp an assignment: warp a moves x[a/K] to y[dest[a]] (scaled by w) and sums
// <dots_with[dest[a]], x[a/K]> from the same read, kSpreadDotsUnits loads of each row in flight a
// lane, three blocks an SM (71 registers), no block barrier; a block's warps are consecutive
// assignments, mostly of one token, so x's row is read from L1 after the first. Each lane sums its
// units in ascending order, then a fixed shuffle tree: deterministic. Measured against two blocks
// with 8 loads and four with 4: qwen3-30b-a3b combine_backward(w) 1.19 -> 1.12x the floor,
// deepseek-v3 1.05 -> 1.06x. Zero blocks as above.
constexpr int kSpreadDotsUnits = 4;
constexpr int kSpreadDotsBlocks = 3;
// Row src moved to out (times wk when `scaled`) by kLanes lanes, kUnits 16-byte units a lane and
// round, every load of a round before its first store; with kDots, also the lane's share of
// <with, src> (its units in ascending order). The warp spread with dots uses it.
template <typename U, int kUnits, int kLanes, bool kDots>
__device__ __forceinline__ float move_row_dot(const char* src, const char* with, char* out, bool scaled, float wk,
                                              int64_t units, int lane) {
  float partial = 0.0f;
  for (int64_t c = 0; c < units; c += kLanes * kUnits) {
    typename U::Raw xv[kUnits], dv[kUnits];
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      const int64_t u = c + j * kLanes + lane;
      if (u < units) {
        xv[j] = U::load(src, u);
        if (kDots) dv[j] = U::load(with, u);
      }
    }
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      const int64_t u = c + j * kLanes + lane;
      if (u < units) {
        U::store(out, u, scaled ? U::scale(xv[j], wk) : xv[j]);
        if (kDots) partial += U::dot(dv[j], xv[j]);
      }
    }
  }
  return partial;
}

template <typename T, bool kVec, bool kSearch = false>
__global__ void __launch_bounds__(kThreads, kSpreadDotsBlocks)
    spread_dots_warp_kernel(RowsArg x, int top_k, DestArg dest, ScaleArg w, RowsArg y, PaddingRef pad,
                            bool zero_padding, bool zero_past_end, RowsArg dots_with, FloatOutArg dots,
                            int64_t assignment_blocks, int zero_rows) {
  pdl_begin();
  using U = Unit<T, kVec>;
  constexpr int kUnits = kSpreadDotsUnits;
  if (blockIdx.x >= assignment_blocks) {
    zero_padding_rows<U, false>(y, pad, zero_padding, zero_past_end,
                                (static_cast<int64_t>(blockIdx.x) - assignment_blocks) * zero_rows, zero_rows,
                                ScaleRowsArg{});
    return;
  }
  const int64_t a0 = static_cast<int64_t>(blockIdx.x) * (kThreads / 32);
  const int64_t a = a0 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  __shared__ int32_t s_found[kSearch ? kThreads / 32 : 1];
  const int64_t A = x.rows * top_k;
  if constexpr (kSearch) {  // the block's assignments, by a search of the sorted form
    if (a < A) {  // x's first round into L1 during the search (a prefetch: no registers held across it)
      const char* src = row_ptr(x, a / top_k);
#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        const int64_t u = j * 32 + lane;
        if (u < units_of<U>(y)) asm volatile("prefetch.global.L1 [%0];" ::"l"(src + u * sizeof(typename U::Raw)));
      }
    }
    search_dest_rows(dest, a0, static_cast<int>(A - a0 < kThreads / 32 ? A - a0 : kThreads / 32), y.rows, s_found);
  }
  if (a >= A) return;
  int64_t r = kSearch ? s_found[threadIdx.x / 32] : plan_rows(dest.rows).dest_row(a);
  if (r >= y.rows) r = -1;  // only with unchecked bad input: as the block kernel, dropped
  float partial = 0.0f;
  if (r >= 0) {
    partial = move_row_dot<U, kUnits, 32, true>(row_ptr(x, a / top_k), row_ptr(dots_with, r), row_ptr(y, r),
                                                w.data != nullptr, load_scale(w, a), units_of<U>(y), lane);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, off);
  if (lane == 0) store_float(dots, a, r < 0 ? 0.0f : partial);
}

// Spread with dots, a block a token, for top_k above policy::kWarpReduceMaxK (a mask plan's K = E
// slots, a few of them live): the token's live assignments staged compacted (stage_live, which
// writes a dropped assignment's dot 0), then a warp an assignment moves x[t] and sums its dot with
// move_row_dot and the shuffle tree of the warp kernel: the same bits, without a warp launched for
// each dropped slot. Zero blocks as above.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    spread_dots_token_kernel(RowsArg x, int top_k, const int32_t* __restrict__ dest, ScaleArg w, RowsArg y,
                             PaddingRef pad, bool zero_padding, bool zero_past_end, RowsArg dots_with, FloatOutArg dots,
                             int zero_rows) {
  pdl_begin();
  using U = Unit<T, kVec>;
  const int64_t tokens = x.rows;
  if (blockIdx.x >= tokens) {
    zero_padding_rows<U, false>(y, pad, zero_padding, zero_past_end,
                                (static_cast<int64_t>(blockIdx.x) - tokens) * zero_rows, zero_rows, ScaleRowsArg{});
    return;
  }
  __shared__ int64_t s_dest[kGroupK];
  __shared__ float s_w[kGroupK];
  __shared__ int s_k[kGroupK];
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const char* src = row_ptr(x, t);
  int k0 = 0;
  do {
    const int nk = stage_live<kGroupK>(t, &k0, top_k, dest, w, y.rows, true, dots, s_dest, s_w, s_k, nullptr);
    for (int q = warp; q < nk; q += kThreads / 32) {
      const int64_t r = s_dest[q];
      float partial = move_row_dot<U, kSpreadDotsUnits, 32, true>(src, row_ptr(dots_with, r), row_ptr(y, r),
                                                                  w.data != nullptr, s_w[q], units_of<U>(y), lane);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, off);
      if (lane == 0) store_float(dots, index::assignment_id(t, s_k[q], top_k), partial);
    }
  } while (k0 < top_k);
}

// Spread without dots, a warp a token (short rows: fp8 rows, the `_scaled` ops): warp t loads
// x[t] in rounds of kSpreadWarpUnits 16-byte units a lane (every load of a round before its first store) and
// stores each round to the token's K destinations (scaled by w), with no shared memory and no
// block barrier, so that an SM holds many rows in flight where the block kernel holds a few
// (rows of 4 KiB: a block of 256 threads moves one unit a thread). kScales: the token's scale
// row is copied to its destinations by the same warp. Zero blocks as the block kernel's.
constexpr int kSpreadWarpUnits = 8;  // 16-byte units a lane and round
template <typename T, bool kVec, bool kScales>
__global__ void __launch_bounds__(kThreads, 4)
    spread_warp_kernel(RowsArg x, int top_k, const int32_t* __restrict__ dest, ScaleArg w, RowsArg y, PaddingRef pad,
                       bool zero_padding, bool zero_past_end, ScaleRowsArg sc, int64_t token_blocks, int zero_rows) {
  pdl_begin();
  using U = Unit<T, kVec>;
  constexpr int kUnits = kSpreadWarpUnits;
  if (blockIdx.x >= token_blocks) {
    zero_padding_rows<U, kScales>(y, pad, zero_padding, zero_past_end,
                                  (static_cast<int64_t>(blockIdx.x) - token_blocks) * zero_rows, zero_rows, sc);
    return;
  }
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= x.rows) return;
  const char* src = row_ptr(x, t);
  const int64_t units = units_of<U>(y);
  const bool scaled = w.data != nullptr;
  for (int k0 = 0; k0 < top_k; k0 += 32) {  // 32 destinations a lane-load at a time
    const int nk = top_k - k0 < 32 ? top_k - k0 : 32;
    int64_t my_r = -1;
    float my_w = 1.0f;
    // entry `lane` of the token's scale row, loaded beside the destinations
    const uint32_t first_scale = kScales && lane < sc.cols ? load_scale_entry(sc, t, lane) : 0u;
    if (lane < nk) {
      const int64_t a = index::assignment_id(t, k0 + lane, top_k);
      my_r = plan_rows(dest).dest_row(a);
      if (my_r >= y.rows) my_r = -1;  // only with unchecked bad input: as the block kernel, dropped
      my_w = load_scale(w, a);
    }
    if (kScales) {  // the scale rows: entry i by lane i mod 32, to every destination (whole-warp rounds)
      for (int64_t i0 = 0; i0 < sc.cols; i0 += 32) {
        const int64_t i = i0 + lane;
        const uint32_t v = i0 == 0 ? first_scale : i < sc.cols ? load_scale_entry(sc, t, i) : 0u;
        for (int q = 0; q < nk; ++q) {
          const int64_t r = __shfl_sync(0xffffffffu, my_r, q);
          if (r >= 0 && i < sc.cols) store_scale_entry(sc, r, i, v);
        }
      }
    }
    for (int64_t c = 0; c < units; c += 32 * kUnits) {
      typename U::Raw v[kUnits];
#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        const int64_t u = c + j * 32 + lane;
        if (u < units) v[j] = U::load(src, u);
      }
      for (int q = 0; q < nk; ++q) {
        const int64_t r = __shfl_sync(0xffffffffu, my_r, q);
        const float wk = __shfl_sync(0xffffffffu, my_w, q);
        if (r < 0) continue;
        char* out = row_ptr(y, r);
#pragma unroll
        for (int j = 0; j < kUnits; ++j) {
          const int64_t u = c + j * 32 + lane;
          if (u < units) U::store(out, u, scaled ? U::scale(v[j], wk) : v[j]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace padmoe
