// reduce_kernels.cuh — reduce: out[t] = sum_k w * y[dest[t*K+k]] (combine, scatter, the grad of
// dispatch), with or without the dot products of a weight gradient, and the dots alone (row_dots).
// Two kernels: a block a token over a chunk of units a thread (reduce_kernel), and a warp or a block
// a token with every source row's unit loaded before the first add (reduce_token_kernel).
// Included by rows.cu.
#pragma once

#include "cuda/row_io.cuh"

namespace padmoe {
namespace cuda {
namespace {

// --- reduce ---------------------------------------------------------------------
// out[t] = sum_k w*y[dest] (ascending k over the live assignments, staged
// compacted, no FMA contraction: the CPU's rounding). When dots are wanted,
// also dots[a] = <y[dest[a]], g[t]> from the same reads of y (the weight
// gradient of a gather / dispatch backward).
// kDots is a template parameter so that plain combine keeps a lean kernel.
template <typename T, bool kVec, bool kDots, int kReduceUnits, int kLoadBatch>
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(RowsArg y, int top_k, const int32_t* __restrict__ dest, ScaleArg w, RowsArg out, RowsArg g,
                  FloatOutArg dots, int slices, int64_t slice_units) {
  pdl_begin();
  using U = Unit<T, kVec>;
  constexpr int kReduceChunk = kThreads * kReduceUnits;
  __shared__ int64_t s_dest[kGroupK];
  __shared__ float s_w[kGroupK];
  __shared__ int s_k[kGroupK];
  __shared__ float s_part[kDots ? kThreads / 32 : 1][kGroupK];
  // Block (t, slice): units [u0, units) of output row t (slices > 1 only without dots).
  const int64_t t = blockIdx.x / slices;
  const int64_t u0 = static_cast<int64_t>(blockIdx.x % slices) * slice_units;
  const int64_t units = u0 + slice_units < units_of<U>(out) ? u0 + slice_units : units_of<U>(out);
  constexpr bool want_dots = kDots;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  char* dst = row_ptr(out, t);
  const char* grow = want_dots ? row_ptr(g, t) : nullptr;
  int k0 = 0;
  bool first = true;
  do {  // at least once: a token with no live assignment gets a zero row
    const int nk = stage_live(t, &k0, top_k, dest, w, y.rows, want_dots, dots, s_dest, s_w, s_k, s_part);
    // More than kGroupK live assignments (rare): later groups add onto the
    // stored row, which rounds the partial sum to the row dtype once per group.
    for (int64_t c = u0; c < units; c += kReduceChunk) {
      float acc[kReduceUnits][U::N];
      typename U::Raw gv[kReduceUnits];
#pragma unroll
      for (int j = 0; j < kReduceUnits; ++j) {
        const int64_t u = c + j * kThreads + threadIdx.x;
        if (!first && u < units) U::to_float(U::load(dst, u), acc[j]);
        else {
#pragma unroll
          for (int i = 0; i < U::N; ++i) acc[j][i] = 0.0f;
        }
        if (want_dots && u < units) gv[j] = U::load(grow, u);
      }
      // kLoadBatch source rows at a time: every load of the batch is issued
      // before the first add, so each thread keeps kLoadBatch * kReduceUnits
      // 16-byte loads in flight (the adds stay in ascending k).
      for (int q0 = 0; q0 < nk; q0 += kLoadBatch) {
        typename U::Raw v[kLoadBatch][kReduceUnits];
        load_row_batch<U>(y, s_dest, q0, nk, c, units, v);
#pragma unroll
        for (int b = 0; b < kLoadBatch; ++b) {
          const int q = q0 + b;
          if (q >= nk) break;
          if (s_dest[q] < 0) continue;
          const float wk = s_w[q];
          float partial = 0.0f;
#pragma unroll
          for (int j = 0; j < kReduceUnits; ++j) {
            const int64_t u = c + j * kThreads + threadIdx.x;
            if (u < units) {
              float f[U::N];
              U::to_float(v[b][j], f);
              // No contraction into an FMA: the same rounding as the CPU
              // backend (acc + w*y, each rounded), so combine is bitwise equal.
#pragma unroll
              for (int i = 0; i < U::N; ++i) acc[j][i] = __fadd_rn(acc[j][i], __fmul_rn(wk, f[i]));
              if (want_dots) partial += U::dot(v[b][j], gv[j]);
            }
          }
          if (want_dots) {
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, off);
            if (lane == 0) s_part[warp][q] += partial;  // chunks in order: deterministic
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kReduceUnits; ++j) {
        const int64_t u = c + j * kThreads + threadIdx.x;
        if (u < units) U::store(dst, u, U::from_float(acc[j]));
      }
    }
    if (want_dots) finish_live_dots(t, nk, top_k, s_k, s_part, dots);
    first = false;
  } while (k0 < top_k);
}

// Reduce with dots, a warp a token (kSplit 1) or a block a token (kSplit 8: few tokens), for
// top_k <= kMaxK: the token's lanes own units part, part + 32 * kSplit, ... of out[t] and, for
// each unit, load the unit of all top_k source rows and of g[t] before the first add (top_k + 1
// loads in flight a lane and unit, kUnits units at a time), with no shared memory (kSplit 1) or
// one barrier at the end (kSplit 8). The row sums are the block kernel's bit for bit (acc + w*y
// in ascending k, one rounding to the row dtype); each dot sums a lane's units in ascending
// order, then a fixed shuffle tree (and the warps in order): deterministic, not the block
// kernel's order. kDots false: the plain reduce in the same form (no g, no dots; the sums are
// the same bits). kOut false: the dots alone (row_dots, wgrad, a block a token: `out` gives only
// the rows and their width; nothing is written to it).
template <typename T, bool kVec, int kMaxK, int kUnits, int kSplit, bool kDots = true, bool kOut = true,
          bool kSearch = false>
__global__ void __launch_bounds__(kThreads)
    reduce_token_kernel(RowsArg y, int top_k, DestArg dest, ScaleArg w, RowsArg out, RowsArg g, FloatOutArg dots) {
  pdl_begin();
  static_assert(kSplit == 1 || kSplit == kThreads / 32, "a token's lanes: one warp or the whole block");
  using U = Unit<T, kVec>;
  constexpr int kLanes = 32 * kSplit;
  __shared__ float s_part[kSplit][kMaxK];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = kSplit == 1 ? static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + warp : blockIdx.x;
  const int part = kSplit == 1 ? lane : static_cast<int>(threadIdx.x);
  constexpr int kBlockTokens = kSplit == 1 ? kThreads / 32 : 1;
  __shared__ int32_t s_found[kSearch ? kBlockTokens * kMaxK : 1];  // the search's rows, the block's tokens in order
  if constexpr (kSearch) {  // top_k <= kMaxK here (the host's rule)
    const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kBlockTokens;
    const int64_t tokens = out.rows - t0 < kBlockTokens ? out.rows - t0 : kBlockTokens;
    search_dest_rows(dest, t0 * top_k, static_cast<int>(tokens * top_k), y.rows, s_found);
  }
  if (t >= out.rows) return;  // kSplit 8: uniform in the block
  int my_row = -1;  // lane q < top_k: assignment q's source row (-1 dropped, or outside y)
  float my_w = 0.0f;
  if (lane < top_k) {
    const int64_t a = index::assignment_id(t, lane, top_k);
    const int64_t r = kSearch ? s_found[(kSplit == 1 ? warp : 0) * top_k + lane] : plan_rows(dest.rows).dest_row(a);
    my_row = (r < 0 || r >= y.rows) ? -1 : static_cast<int>(r);
    my_w = load_scale(w, a);
  }
  int row[kMaxK];
  float wk[kMaxK], partial[kMaxK];
#pragma unroll
  for (int q = 0; q < kMaxK; ++q) {
    row[q] = __shfl_sync(0xffffffffu, my_row, q);
    wk[q] = __shfl_sync(0xffffffffu, my_w, q);
    partial[q] = 0.0f;
  }
  const int64_t units = units_of<U>(out);
  char* dst = row_ptr(out, t);
  const char* grow = kDots ? row_ptr(g, t) : nullptr;
  for (int64_t c = 0; c < units; c += kLanes * kUnits) {
    typename U::Raw v[kMaxK][kUnits], gv[kUnits];
#pragma unroll
    for (int q = 0; q < kMaxK; ++q) {
      const char* src = row_ptr(y, row[q] < 0 ? 0 : row[q]);
#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        const int64_t u = c + j * kLanes + part;
        if (q < top_k && row[q] >= 0 && u < units) v[q][j] = U::load(src, u);
      }
    }
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      const int64_t u = c + j * kLanes + part;
      if (kDots && u < units) gv[j] = U::load(grow, u);
    }
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      const int64_t u = c + j * kLanes + part;
      if (u >= units) continue;
      float acc[U::N];
#pragma unroll
      for (int i = 0; i < U::N; ++i) acc[i] = 0.0f;
#pragma unroll
      for (int q = 0; q < kMaxK; ++q) {
        if (q >= top_k || row[q] < 0) continue;
        if constexpr (kOut) {
          float f[U::N];
          U::to_float(v[q][j], f);
#pragma unroll
          for (int i = 0; i < U::N; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(wk[q], f[i]));
        }
        if constexpr (kDots) partial[q] += U::dot(v[q][j], gv[j]);
      }
      if constexpr (kOut) U::store(dst, u, U::from_float(acc));
    }
  }
  if constexpr (kDots) {  // the dots: lane sums, then the warps (kSplit 8) in order
#pragma unroll
    for (int q = 0; q < kMaxK; ++q) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) partial[q] += __shfl_xor_sync(0xffffffffu, partial[q], off);
    }
    if (kSplit == 1) {
      if (lane == 0) {
#pragma unroll
        for (int q = 0; q < kMaxK; ++q) {
          if (q < top_k) store_float(dots, index::assignment_id(t, q, top_k), row[q] < 0 ? 0.0f : partial[q]);
        }
      }
      return;
    }
    if (lane == 0) {
#pragma unroll
      for (int q = 0; q < kMaxK; ++q) s_part[warp % kSplit][q] = partial[q];
    }
    __syncthreads();
    if (threadIdx.x < static_cast<unsigned>(top_k)) {
      const int q = static_cast<int>(threadIdx.x);
      float sum = 0.0f;
      for (int v = 0; v < kSplit; ++v) sum += s_part[v][q];
      store_float(dots, index::assignment_id(t, q, top_k), my_row < 0 ? 0.0f : sum);
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace padmoe
