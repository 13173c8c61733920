// rows.cu — the CUDA row kernels: spread (dispatch / gather / grad of
// combine), reduce (combine / scatter), dots (wgrad), gather by map
// (pad / unpad), and the maps behind them.
//
// A block owns one token (or one output row): every output row is written by
// exactly one block, once; padding rows are zeroed by extra blocks of the same
// launch. Rows move in 16-byte vectors when both sides allow it (row bytes,
// row stride and base pointer multiples of 16), element by element otherwise.
// A block caches up to kRegUnits vectors per thread of its source row in
// registers and writes them to the K destinations from there: each source row
// is read once. Ops with dot products mostly run a warp an assignment (or an
// output row) instead, with no block barrier (see warp_spread_dots and the
// kernels' comments). Sums run in float32 in ascending k; dot products reduce in
// a fixed tree. No float atomics: results are bitwise reproducible.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <type_traits>

#include "cuda/common.cuh"

namespace padmoe {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRegUnits = 4;  // register-cached units per thread and chunk
constexpr int kChunkUnits = kThreads * kRegUnits;

// One unit of a row: 16 bytes (kVec) or one element.
template <typename T, bool kVec>
struct Unit {
  using S = typename T::S;
  static constexpr int N = kVec ? 16 / static_cast<int>(sizeof(S)) : 1;
  using Raw = typename std::conditional<kVec, uint4, S>::type;

  __device__ static Raw load(const char* row, int64_t u) { return reinterpret_cast<const Raw*>(row)[u]; }
  __device__ static void store(char* row, int64_t u, const Raw& v) { reinterpret_cast<Raw*>(row)[u] = v; }
  __device__ static Raw zero() {
    Raw r;
    memset(&r, 0, sizeof(Raw));
    return r;
  }
  __device__ static void to_float(const Raw& v, float* f) {
    const S* s = reinterpret_cast<const S*>(&v);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = T::ld(s[i]);
  }
  __device__ static Raw from_float(const float* f) {
    Raw r;
    S* s = reinterpret_cast<S*>(&r);
#pragma unroll
    for (int i = 0; i < N; ++i) s[i] = T::st(f[i]);
    return r;
  }
  __device__ static Raw scale(const Raw& v, float w) {
    float f[N];
    to_float(v, f);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] *= w;
    return from_float(f);
  }
  __device__ static float dot(const Raw& a, const Raw& b) {
    float fa[N], fb[N];
    to_float(a, fa);
    to_float(b, fb);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) s += fa[i] * fb[i];
    return s;
  }
};

template <typename U>
__device__ int64_t units_of(const RowsArg& r) {
  return r.cols / U::N;  // kVec: cols * s / 16 (row bytes are a multiple of 16)
}

// Deterministic block sum: fixed shuffle tree per warp, warps summed in order.
__device__ float block_sum(float v, float* s_warp) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // s_warp may still be read from a previous call
  if (lane == 0) s_warp[warp] = v;
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kThreads / 32; ++i) total += s_warp[i];
  }
  return total;  // valid in thread 0
}

// --- spread ---------------------------------------------------------------------
constexpr int kGroupK = 64;      // assignments of a token staged in shared memory at a time
constexpr int kZeroRows = 32;    // rows per zero block (fewer at small T: zero_rows_per_block)

// The search form of DestArg (rows null): s_out[q] = the destination row of assignment a0 + q, for
// q < n, or -1 (absent, or outside the `rows` rows given). The block stages bins and padded_bins
// (E <= kSearchExperts) and reads every entry of indices and bin_ids, kSearchItems a thread in
// flight (A <= kSearchAssignments: at most two rounds); an entry names its assignment once in a
// valid sorted form, and entries out of range (bad unchecked input) are skipped. Every thread of
// the block calls it, the same n; it ends with a barrier.
constexpr int kSearchAssignments = 4096;
constexpr int kSearchExperts = 256;
constexpr int kSearchItems = 8;
template <typename Out>
__device__ void search_dest_rows(const DestArg& d, int64_t a0, int n, int64_t rows, Out* s_out) {
  __shared__ int32_t s_bins[kSearchExperts], s_pbins[kSearchExperts];
  const int E = d.num_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    s_bins[e] = static_cast<int32_t>(load_index(d.bins, e));
    s_pbins[e] = static_cast<int32_t>(load_index(d.padded_bins, e));
  }
  for (int q = threadIdx.x; q < n; q += blockDim.x) s_out[q] = -1;
  // 32-bit positions and values (A <= kSearchAssignments): a value is kept as its low word, and a
  // wide entry outside int32 reads as out of range
  const int A = static_cast<int>(d.assignments), lo = static_cast<int>(a0);
  for (int base = 0; base < A; base += static_cast<int>(blockDim.x) * kSearchItems) {
    int a[kSearchItems], e[kSearchItems];
#pragma unroll
    for (int j = 0; j < kSearchItems; ++j) {  // loads first
      const int i = base + j * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
      a[j] = i < A ? load_index32(d.indices, i) : -1;
      e[j] = i < A ? load_index32(d.bin_ids, i) : -1;
    }
    __syncthreads();  // s_bins staged, s_out cleared
#pragma unroll
    for (int j = 0; j < kSearchItems; ++j) {
      const int i = base + j * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
      if (a[j] < lo || a[j] - lo >= n || e[j] < 0 || e[j] >= E) continue;
      const int r = i - (e[j] == 0 ? 0 : s_bins[e[j] - 1]) + (e[j] == 0 ? 0 : s_pbins[e[j] - 1]);
      s_out[a[j] - lo] = r < 0 || r >= rows ? -1 : static_cast<Out>(r);
    }
  }
  __syncthreads();
}

// Stages assignments [k0, k0 + nk) of token t: their destination rows (-1 when
// dropped, or outside the `rows` rows given: only with unchecked bad input) and
// weights, and clears each warp's dot partials. All threads call it.
// kSearch: the rows by search_dest_rows over *search (the sorted form), else dest[a].
template <int kWarpRows, bool kSearch = false>
__device__ void stage_group(int64_t t, int k0, int nk, int top_k, const int32_t* __restrict__ dest,
                            const DestArg* search, const ScaleArg& w, int64_t rows, bool want_dots, int64_t* s_dest,
                            float* s_w, float (*s_part)[kWarpRows]) {
  __syncthreads();  // the previous group is done with the staging arrays
  if constexpr (kSearch) search_dest_rows(*search, index::assignment_id(t, k0, top_k), nk, rows, s_dest);
  for (int q = threadIdx.x; q < nk; q += kThreads) {
    const int64_t a = index::assignment_id(t, k0 + q, top_k);
    if constexpr (!kSearch) {
      const int64_t r = dest[a];
      s_dest[q] = (r < 0 || r >= rows) ? -1 : r;
    }
    s_w[q] = load_scale(w, a);
  }
  for (int q = threadIdx.x % 32; want_dots && q < nk; q += 32) s_part[threadIdx.x / 32][q] = 0.0f;
  __syncthreads();
}

// dots[a] = the warps' partials summed in order (0 for dropped assignments).
template <int kWarpRows>
__device__ void finish_dots(int64_t t, int k0, int nk, int top_k, const int64_t* s_dest,
                            const float (*s_part)[kWarpRows], const FloatOutArg& dots) {
  __syncthreads();
  for (int q = threadIdx.x; q < nk; q += kThreads) {
    float sum = 0.0f;
    for (int v = 0; v < kThreads / 32; ++v) sum += s_part[v][q];
    store_float(dots, index::assignment_id(t, k0 + q, top_k), s_dest[q] < 0 ? 0.0f : sum);
  }
}

// v[b][j] = unit c + j * kThreads + threadIdx.x (below `units`) of row s_dest[q0 + b] of `rows`,
// for b < kBatch with q0 + b < nk and a row >= 0: a batch of rows' loads issued together.
template <typename U, int kBatch, int kUnits>
__device__ __forceinline__ void load_row_batch(const RowsArg& rows, const int64_t* s_dest, int q0, int nk, int64_t c,
                                               int64_t units, typename U::Raw (&v)[kBatch][kUnits]) {
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    const int64_t r = q0 + b < nk ? s_dest[q0 + b] : -1;
    const char* src = row_ptr(rows, r < 0 ? 0 : r);
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      const int64_t u = c + j * kThreads + threadIdx.x;
      if (r >= 0 && u < units) v[b][j] = U::load(src, u);
    }
  }
}

// --- scale rows (the `_scaled` ops) -------------------------------------------
// Scale rows are short (ceil(H/32) bytes or ceil(H/128) floats): the block
// that writes a data row copies its scale row too, flattened over the block's
// threads; zeroed rows get the bits of a scale 1.

// dst scale rows [r0, r1) = 1, by all threads of the block.
__device__ void fill_scale_one(const ScaleRowsArg& sc, int64_t r0, int64_t r1) {
  const int64_t n = (r1 - r0) * sc.cols;
  if (sc.elem == 4) {
    uint32_t* d = static_cast<uint32_t*>(sc.dst) + r0 * sc.cols;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) d[i] = sc.one;
  } else {
    uint8_t* d = static_cast<uint8_t*>(sc.dst) + r0 * sc.cols;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) d[i] = static_cast<uint8_t>(sc.one);
  }
}

// Entry i of src scale row `from`, and entry i of dst scale row `to` set to v (the spread's
// preloaded scale entries).
__device__ __forceinline__ uint32_t load_scale_entry(const ScaleRowsArg& sc, int64_t from, int64_t i) {
  return sc.elem == 4 ? static_cast<const uint32_t*>(sc.src)[from * sc.cols + i]
                      : static_cast<uint32_t>(static_cast<const uint8_t*>(sc.src)[from * sc.cols + i]);
}
__device__ __forceinline__ void store_scale_entry(const ScaleRowsArg& sc, int64_t to, int64_t i, uint32_t v) {
  if (sc.elem == 4) static_cast<uint32_t*>(sc.dst)[to * sc.cols + i] = v;
  else static_cast<uint8_t*>(sc.dst)[to * sc.cols + i] = static_cast<uint8_t>(v);
}

// dst scale row `to` = src scale row `from` (from < 0: 1), entry i of the row.
__device__ __forceinline__ void move_scale_entry(const ScaleRowsArg& sc, int64_t to, int64_t from, int64_t i) {
  if (sc.elem == 4) {
    static_cast<uint32_t*>(sc.dst)[to * sc.cols + i] =
        from < 0 ? sc.one : static_cast<const uint32_t*>(sc.src)[from * sc.cols + i];
  } else {
    static_cast<uint8_t*>(sc.dst)[to * sc.cols + i] =
        from < 0 ? static_cast<uint8_t>(sc.one) : static_cast<const uint8_t*>(sc.src)[from * sc.cols + i];
  }
}

// Zero block: rows [first, first + rows) of y that are padding (below P)
// or, when zero_past_end, at or past P. Up to kZeroStageExperts experts the
// block first stages bins and padded_bins in shared memory (one round of
// loads: the search and the walk below would otherwise be a chain of
// dependent global loads, which dominated decode-sized spreads); then one
// search per block, and the experts whose padded segments meet the range are
// walked in order. kScales: their scale rows are set to 1 by the same block.
constexpr int kZeroStageExperts = 1024;

template <typename U, bool kScales>
__device__ void zero_padding_rows(const RowsArg& y, const PaddingRef& pad, bool zero_padding, bool zero_past_end,
                                  int64_t first, int rows, const ScaleRowsArg& sc) {
  __shared__ int32_t s_bins[kZeroStageExperts], s_pbins[kZeroStageExperts];  // plan values < 2^31
  const int E = pad.num_experts;
  const bool staged = E <= kZeroStageExperts;
  if (staged) {
    for (int e = threadIdx.x; e < E; e += kThreads) {
      s_bins[e] = static_cast<int32_t>(load_index(pad.bins, e));
      s_pbins[e] = static_cast<int32_t>(load_index(pad.padded_bins, e));
    }
    __syncthreads();
  }
  auto bins = [&](int64_t e) -> int64_t { return staged ? s_bins[e] : load_index(pad.bins, e); };
  auto pbins = [&](int64_t e) -> int64_t { return staged ? s_pbins[e] : load_index(pad.padded_bins, e); };
  const int64_t last = first + rows < y.rows ? first + rows : y.rows;
  const int64_t units = units_of<U>(y);
  const int64_t padded = E > 0 ? pbins(E - 1) : 0;
  auto zero_range = [&](int64_t r0, int64_t r1) {  // all threads, flattened over (row, unit)
    // (row, unit) stepped by kThreads units without a division a store (a 64-bit division and
    // modulo a store were the largest stall of decode's dispatch under ncu)
    int64_t row = units > 0 ? r0 + threadIdx.x / units : r1, u = units > 0 ? threadIdx.x % units : 0;
    while (row < r1) {
      U::store(row_ptr(y, row), u, U::zero());
      u += kThreads;
      while (u >= units) {
        u -= units;
        ++row;
      }
    }
    if (kScales) fill_scale_one(sc, r0, r1);
  };
  if (zero_past_end && last > padded) zero_range(first > padded ? first : padded, last);
  if (!zero_padding) return;
  const int64_t end = last < padded ? last : padded;
  if (first >= end) return;
  int64_t lo = 0, hi = E;  // first expert whose padded segment ends past `first`
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (pbins(mid) > first) hi = mid; else lo = mid + 1;
  }
  for (int64_t e = lo; e < E; ++e) {
    const int64_t pstart = e == 0 ? 0 : pbins(e - 1);
    if (pstart >= end) break;
    const int64_t count = bins(e) - (e == 0 ? 0 : bins(e - 1));
    const int64_t z0 = pstart + count > first ? pstart + count : first;
    const int64_t pend = pbins(e);
    const int64_t z1 = pend < end ? pend : end;
    if (z0 < z1) zero_range(z0, z1);
  }
}

// reg[j] = unit c + j * kThreads + threadIdx.x of row `src` (those below `units`): a thread's
// kRegUnits loads of one chunk, issued together.
template <typename U>
__device__ __forceinline__ void load_chunk_units(const char* src, int64_t c, int64_t units,
                                                 typename U::Raw (&reg)[kRegUnits]) {
#pragma unroll
  for (int j = 0; j < kRegUnits; ++j) {
    const int64_t u = c + j * kThreads + threadIdx.x;
    if (u < units) reg[j] = U::load(src, u);
  }
}

// kScales: the token's scale row is copied to its K destinations by the same
// block (the plain instantiation has none of it).
// kDots: the dots_with rows are read and dotted (a template parameter, so the plain
// moves keep a lean kernel: the batched dot loads cost registers).
// kScales: thread i loads entry i of the token's scale row with its first data loads and stores
// it to the K destinations once they are staged (measured on the H200, 2026-12-03: decode
// dispatch(fp8+scales) 12.9 -> 12.4 us in a graph against the scale rows moved flattened over
// (assignment, entry) after the staging, a load then a store each; deepseek-v3 unchanged).
// kSearch: the destinations by a search of dest's sorted form (dest.rows null), else dest.rows.
template <typename T, bool kVec, bool kScales, bool kDots, int kDotBatch = 1, bool kSearch = false>
__global__ void __launch_bounds__(kThreads, kDots && kDotBatch == 1 ? 3 : 1)  // dots: 3 blocks an SM (85 registers)
    spread_kernel(RowsArg x, int top_k, DestArg dest, ScaleArg w, RowsArg y, PaddingRef pad,
                  bool zero_padding, bool zero_past_end, RowsArg dots_with, FloatOutArg dots, ScaleRowsArg sc,
                  int slices, int64_t slice_units, int zero_rows) {
  pdl_begin();
  using U = Unit<T, kVec>;
  const int64_t tokens = x.rows;
  const int64_t row_blocks = tokens * slices;
  if (blockIdx.x >= row_blocks) {
    zero_padding_rows<U, kScales>(y, pad, zero_padding, zero_past_end,
                                  (static_cast<int64_t>(blockIdx.x) - row_blocks) * zero_rows, zero_rows, sc);
    return;
  }
  __shared__ int64_t s_dest[kGroupK];
  __shared__ float s_w[kGroupK];
  __shared__ float s_part[kThreads / 32][kGroupK];  // per-warp dot partials
  // Block (t, slice): units [u0, units) of token t's row, slice_units of them (slices > 1 only
  // without dots, at small T: more blocks, each with fewer loads in a row).
  const int64_t t = blockIdx.x / slices;
  const int slice = static_cast<int>(blockIdx.x % slices);
  const int64_t u0 = static_cast<int64_t>(slice) * slice_units;
  const int64_t units = u0 + slice_units < units_of<U>(y) ? u0 + slice_units : units_of<U>(y);
  const char* src = row_ptr(x, t);
  constexpr bool want_dots = kDots;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  typename U::Raw reg[kRegUnits];
  load_chunk_units<U>(src, u0, units, reg);  // issued before the destinations are staged: the two loads overlap
  const bool own_scale = kScales && slice == 0 && threadIdx.x < sc.cols;
  const uint32_t my_scale = own_scale ? load_scale_entry(sc, t, threadIdx.x) : 0u;
  for (int k0 = 0; k0 < top_k; k0 += kGroupK) {
    const int nk = top_k - k0 < kGroupK ? top_k - k0 : kGroupK;
    stage_group<kGroupK, kSearch>(t, k0, nk, top_k, dest.rows, &dest, w, y.rows, want_dots, s_dest, s_w, s_part);
    if (kScales && slice == 0) {  // entry i by thread i (entries past kThreads: a load each)
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
    for (int64_t c = u0; c < units; c += kChunkUnits) {
      if (c > u0 || k0 > 0) load_chunk_units<U>(src, c, units, reg);
      if (kDots) {
        // kDotBatch destinations at a time: their dots_with rows are all loaded before the
        // first store and dot, so a thread keeps kDotBatch * kRegUnits loads in flight
        // instead of one destination's (the dots sum in the same order as one at a time).
        for (int q0 = 0; q0 < nk; q0 += kDotBatch) {
          typename U::Raw v[kDotBatch][kRegUnits];
          load_row_batch<U>(dots_with, s_dest, q0, nk, c, units, v);
#pragma unroll
          for (int b = 0; b < kDotBatch; ++b) {
            const int q = q0 + b;
            if (q >= nk) break;
            const int64_t r = s_dest[q];
            if (r < 0) continue;
            char* out = row_ptr(y, r);
            const float wk = s_w[q];
            float partial = 0.0f;
#pragma unroll
            for (int j = 0; j < kRegUnits; ++j) {
              const int64_t u = c + j * kThreads + threadIdx.x;
              if (u < units) {
                U::store(out, u, w.data == nullptr ? reg[j] : U::scale(reg[j], wk));
                partial += U::dot(v[b][j], reg[j]);
              }
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, off);
            if (lane == 0) s_part[warp][q] += partial;  // chunks in order: deterministic
          }
        }
      } else {
        for (int q = 0; q < nk; ++q) {  // the plain moves
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
    }
    if (want_dots) finish_dots(t, k0, nk, top_k, s_dest, s_part, dots);
  }
}

// Spread with dots, a warp an assignment (short rows, or few tokens): warp a moves x[a/K] to
// y[dest[a]] (scaled by w) and sums <dots_with[dest[a]], x[a/K]> from the same read, with
// kUnits loads of each row in flight a lane (dots_warp_blocks() below) and no block barrier; a
// block's warps are consecutive assignments, mostly of one token, so x's row is read from L1
// after the first. Each lane sums its units in ascending order (whatever kUnits, so the dots'
// bits do not depend on it), then a fixed shuffle tree: deterministic (not the block kernel's
// order, so the dot bits may differ between the two). Zero blocks as above.
constexpr int kWarpUnits = 8;  // the gather's warp dots, and the two-block spread

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

template <typename T, bool kVec, int kMinBlocks, int kUnits, bool kSearch = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    spread_dots_warp_kernel(RowsArg x, int top_k, DestArg dest, ScaleArg w, RowsArg y,
                            PaddingRef pad, bool zero_padding, bool zero_past_end, RowsArg dots_with,
                            FloatOutArg dots, int64_t assignment_blocks, int zero_rows) {
  pdl_begin();
  using U = Unit<T, kVec>;
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
  int64_t r = kSearch ? s_found[threadIdx.x / 32] : dest.rows[a];
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

// Spread without dots, a warp a token (short rows: fp8 rows, the `_scaled` ops): warp t loads
// x[t] in rounds of kUnits 16-byte units a lane (every load of a round before its first store) and
// stores each round to the token's K destinations (scaled by w), with no shared memory and no
// block barrier, so that an SM holds many rows in flight where the block kernel holds a few
// (rows of 4 KiB: a block of 256 threads moves one unit a thread). kScales: the token's scale
// row is copied to its destinations by the same warp. Zero blocks as the block kernel's.
template <typename T, bool kVec, bool kScales, int kUnits>
__global__ void __launch_bounds__(kThreads, 4)
    spread_warp_kernel(RowsArg x, int top_k, const int32_t* __restrict__ dest, ScaleArg w, RowsArg y,
                       PaddingRef pad, bool zero_padding, bool zero_past_end, ScaleRowsArg sc, int64_t token_blocks,
                       int zero_rows) {
  pdl_begin();
  using U = Unit<T, kVec>;
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
      my_r = dest[a];
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

// --- reduce ---------------------------------------------------------------------
// out[t] = sum_k w*y[dest] (ascending k, no FMA contraction: the CPU's
// rounding). When dots are wanted, also dots[a] = <y[dest[a]], g[t]> from the
// same reads of y (the weight gradient of a gather / dispatch backward).
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
  __shared__ float s_part[kDots ? kThreads / 32 : 1][kGroupK];
  // Block (t, slice): units [u0, units) of output row t (slices > 1 only without dots).
  const int64_t t = blockIdx.x / slices;
  const int64_t u0 = static_cast<int64_t>(blockIdx.x % slices) * slice_units;
  const int64_t units = u0 + slice_units < units_of<U>(out) ? u0 + slice_units : units_of<U>(out);
  constexpr bool want_dots = kDots;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  char* dst = row_ptr(out, t);
  const char* grow = want_dots ? row_ptr(g, t) : nullptr;
  for (int k0 = 0; k0 < top_k; k0 += kGroupK) {
    const int nk = top_k - k0 < kGroupK ? top_k - k0 : kGroupK;
    stage_group(t, k0, nk, top_k, dest, nullptr, w, y.rows, want_dots, s_dest, s_w, s_part);
    // More than kGroupK assignments (rare): later groups add onto the stored
    // row, which rounds the partial sum to the row dtype once per group.
    for (int64_t c = u0; c < units; c += kReduceChunk) {
      float acc[kReduceUnits][U::N];
      typename U::Raw gv[kReduceUnits];
#pragma unroll
      for (int j = 0; j < kReduceUnits; ++j) {
        const int64_t u = c + j * kThreads + threadIdx.x;
        if (k0 > 0 && u < units) U::to_float(U::load(dst, u), acc[j]);
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
    if (want_dots) finish_dots(t, k0, nk, top_k, s_dest, s_part, dots);
  }
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
    reduce_dots_warp_kernel(RowsArg y, int top_k, DestArg dest, ScaleArg w, RowsArg out, RowsArg g,
                            FloatOutArg dots) {
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
    const int64_t r = kSearch ? s_found[(kSplit == 1 ? warp : 0) * top_k + lane] : dest.rows[a];
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

// --- dots -----------------------------------------------------------------------
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    dots_kernel(RowsArg y, RowsArg g, int top_k, const int32_t* __restrict__ dest, FloatOutArg out) {
  pdl_begin();
  using U = Unit<T, kVec>;
  __shared__ float s_warp[kThreads / 32];
  const int64_t t = blockIdx.x;
  const int64_t units = units_of<U>(g);
  const char* grow = row_ptr(g, t);
  for (int k = 0; k < top_k; ++k) {
    const int64_t a = index::assignment_id(t, k, top_k);
    const int64_t r = dest[a];
    float partial = 0.0f;
    if (r >= 0 && r < y.rows) {
      const char* yrow = row_ptr(y, r);
      for (int64_t u = threadIdx.x; u < units; u += kThreads) partial += U::dot(U::load(yrow, u), U::load(grow, u));
    }
    const float sum = block_sum(partial, s_warp);
    if (threadIdx.x == 0) store_float(out, a, r < 0 ? 0.0f : sum);
  }
}

// A warp an assignment (row_dots' default: dots_kernel runs K block sums in a row, each
// thread with one or a few loads between them): each lane sums its units in ascending order,
// then a fixed shuffle tree. Deterministic; the order differs from dots_kernel's, so the bits
// may differ between the two.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    dots_warp_kernel(RowsArg y, RowsArg g, int top_k, const int32_t* __restrict__ dest, int64_t assignments,
                     FloatOutArg out) {
  pdl_begin();
  using U = Unit<T, kVec>;
  const int64_t a = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (a >= assignments) return;
  const int64_t r = dest[a];
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
    gather_kernel(RowsArg src, IndexRef map, ScaleArg s, bool scale_by_source, RowsArg out,
                  const int32_t* row_limit, int rows_per_block, bool skip_unmapped, ScaleRowsArg sc) {
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
__global__ void __launch_bounds__(kThreads)
    gather_dots_warp_kernel(RowsArg src, IndexRef map, ScaleArg s, RowsArg out, int64_t rows, RowsArg dots_with,
                            FloatOutArg dots) {
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

// Element traits for moves of any row dtype (raw bits, no arithmetic).
template <typename Storage>
struct RawBits {
  using S = Storage;
  __device__ static float ld(S) { return 0.0f; }
  __device__ static S st(float) { return S{}; }
};

bool is_move_only(DType dtype) { return is_float8(dtype); }

}  // namespace

// Kernel tags: functors carrying the template so dispatch_kernel can pick them.
template <typename T, bool kVec>
struct SpreadTag {
  static constexpr auto fn = spread_kernel<T, kVec, false, false>;
};
template <int kBatch>
struct SpreadDots {
  template <typename T, bool kVec>
  struct Tag {
    static constexpr auto fn = spread_kernel<T, kVec, false, true, kBatch>;
  };
};
template <int kMinBlocks, int kUnits, bool kSearch = false>
struct SpreadDotsWarp {
  template <typename T, bool kVec>
  struct Tag {
    static constexpr auto fn = spread_dots_warp_kernel<T, kVec, kMinBlocks, kUnits, kSearch>;
  };
};
// The search form's spreads (DestArg with rows null): plain, with scale rows, with dots (batch 1).
template <bool kScales, bool kDots>
struct SearchSpread {
  template <typename T, bool kVec>
  struct Tag {
    static constexpr auto fn = spread_kernel<T, kVec, kScales, kDots, 1, true>;
  };
};
template <typename T, bool kVec>
struct GatherDotsWarpTag {
  static constexpr auto fn = gather_dots_warp_kernel<T, kVec>;
};
template <bool kScales, int kUnits>
struct SpreadWarp {
  template <typename T, bool kVec>
  struct Tag {
    static constexpr auto fn = spread_warp_kernel<T, kVec, kScales, kUnits>;
  };
};
template <typename T, bool kVec>
struct ScaledSpreadTag {
  static constexpr auto fn = spread_kernel<T, kVec, true, false>;
};
// Reduce: kUnits 16-byte units per thread and chunk, kBatch source rows
// loaded before the first add. Measured on the H200 (bf16, combine): top-2
// rows of 8 KiB run best at (2, 2) (1.05x the copy floor; (2, 8) 1.61x, the
// extra registers cost occupancy), top-8 at (1, 4) (qwen3 1.02x, deepseek
// 0.99x); see bench/results/cuda-h200-2026-11-30.md.
template <int kUnits, int kBatch, bool kDots>
struct ReduceShape {
  template <typename T, bool kVec>
  struct Tag {
    static constexpr auto fn = reduce_kernel<T, kVec, kDots, kUnits, kBatch>;
  };
};
template <int kMaxK, int kUnits, int kSplit, bool kDots = true, bool kOut = true, bool kSearch = false>
struct ReduceDotsWarp {
  template <typename T, bool kVec>
  struct Tag {
    static constexpr auto fn = reduce_dots_warp_kernel<T, kVec, kMaxK, kUnits, kSplit, kDots, kOut, kSearch>;
  };
};
template <typename T, bool kVec>
struct DotsTag {
  static constexpr auto fn = dots_kernel<T, kVec>;
};
template <typename T, bool kVec>
struct WarpDotsTag {
  static constexpr auto fn = dots_warp_kernel<T, kVec>;
};
template <typename T, bool kVec>
struct GatherTag {
  static constexpr auto fn = gather_kernel<T, kVec, false>;
};
template <typename T, bool kVec>
struct ScaledGatherTag {
  static constexpr auto fn = gather_kernel<T, kVec, true>;
};

namespace {
// float8 rows move as 1-byte raw elements (vectorized as 16-byte units).
template <template <typename, bool> class Tag, typename Launch>
void pick(DType dtype, bool vec, Launch&& launch) {
  if (is_move_only(dtype)) {
    if (vec) launch(Tag<RawBits<uint8_t>, true>{});
    else launch(Tag<RawBits<uint8_t>, false>{});
    return;
  }
  with_traits(dtype, [&](auto traits) {
    using T = decltype(traits);
    if (vec) launch(Tag<T, true>{});
    else launch(Tag<T, false>{});
  });
}
}  // namespace

namespace {
// Row slices at small T: a row's units split over `slices` blocks (spans of slice_units, a
// multiple of `granule`) so that about slice_target_blocks() blocks run (PADMOE_CUDA_SLICE_BLOCKS
// overrides it, 0 turns slicing off; read once). Only for ops without dot products: a dot
// needs the whole row in one block.
struct Slicing {
  int slices = 1;
  int64_t slice_units = 0;
};
std::atomic<int> g_slice_blocks{-1};  // set_slice_blocks: -1 the default
}  // namespace

// The multiprocessors of the current device when first asked (132, an H200's, if unknown).
int sm_count() {
  static const int sms = [] {
    int dev = 0, n = 132;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();
      n = 132;
    }
    return n;
  }();
  return sms;
}

// The L2's bytes on the current device when first asked (50 MiB, an H200's, if unknown).
int64_t l2_cache_bytes() {
  static const int64_t bytes = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrL2CacheSize, dev) != cudaSuccess ||
        n <= 0) {
      cudaGetLastError();
      n = 50 << 20;
    }
    return static_cast<int64_t>(n);
  }();
  return bytes;
}
namespace {
std::atomic<int> g_l2_prefetch{-1};  // set_l2_prefetch; -1: the environment's choice
// About 4 blocks an SM: below it a block a token leaves the GPU part idle.
int few_tokens_blocks() { return 4 * sm_count(); }
int slice_target_blocks() {
  const int forced = g_slice_blocks.load(std::memory_order_relaxed);
  if (forced >= 0) return forced;
  static const int target = [] {
    if (const char* v = std::getenv("PADMOE_CUDA_SLICE_BLOCKS")) return std::max(0, std::atoi(v));
    return few_tokens_blocks();
  }();
  return target;
}
Slicing slicing_for(int64_t rows, int64_t units, int64_t granule, bool dots) {
  Slicing s;
  s.slice_units = units;
  const int64_t target = slice_target_blocks();
  if (dots || rows <= 0 || units <= granule || rows >= target) return s;
  const int64_t want = index::ceil_div(target, rows);
  const int64_t span = index::round_up(index::ceil_div(units, want), granule);
  s.slices = static_cast<int>(index::ceil_div(units, span));
  s.slice_units = span;
  return s;
}
// Destinations of a spread with dots whose dots_with rows load together: 1 (default), 2 or 4
// (PADMOE_CUDA_DOT_BATCH, read once). Measured on the H200: 1 is best at decode and at
// deepseek-v3 (4 costs 155 registers a thread and 20% at deepseek-v3).
int dot_batch() {
  static const int b = [] {
    const char* v = std::getenv("PADMOE_CUDA_DOT_BATCH");
    const int n = v != nullptr ? std::atoi(v) : 1;
    return n == 2 || n == 4 ? n : 1;
  }();
  return b;
}
// The warp spread with dots runs three blocks an SM with 4 loads of each row in flight a lane
// (71 registers). Measured on the H200 (x floor, event-timed, combine_backward(w) /
// padded_scatter_backward(w)), against two blocks with 8 loads (103 registers) and four blocks with
// 4 (64): qwen3-30b-a3b 1.19 / 1.20 -> 1.12 / 1.13 (four: 1.11 / 1.13), mixtral-8x7b 1.05 / 1.06
// -> 1.04 / 1.05, deepseek-v3 1.05 / 1.06 -> 1.06 / 1.06 (four: 1.07 / 1.08).
// PADMOE_CUDA_DOTS_WARP_BLOCKS=2 selects the two-block kernel (measurements); read once.
constexpr int kSpreadDotsWarpUnits = 4;
int dots_warp_blocks() {
  static const int b = [] {
    const char* v = std::getenv("PADMOE_CUDA_DOTS_WARP_BLOCKS");
    return v != nullptr && std::atoi(v) == 2 ? 2 : 3;
  }();
  return b;
}
bool spread_slices() {
  static const bool on = [] {
    const char* v = std::getenv("PADMOE_CUDA_SPREAD_SLICES");
    return v != nullptr && std::atoi(v) == 1;
  }();
  return on;
}
// Which dot-product kernels run: -1 chosen by shape (default), 0 the block kernels (a block a
// token, reduce's (1, 4) shape), and with spreads and row_dots a warp an assignment: 1
// reduce's (2, 8) shape, 2 reduce a warp a token, 3 reduce a block a token in the warp kernel's
// form (the few-token default), 4 the same with two units a lane at a time (the same bits as 3;
// the default near two tokens an SM).
// PADMOE_CUDA_DOTS=0..4 (read once) or set_dot_kernels (tests) force one.
std::atomic<int> g_dot_kernels{-2};  // -2: not set by set_dot_kernels
int dot_kernels() {
  const int forced = g_dot_kernels.load(std::memory_order_relaxed);
  if (forced != -2) return forced;
  static const int env = [] {
    const char* v = std::getenv("PADMOE_CUDA_DOTS");
    const int m = v != nullptr ? std::atoi(v) : -1;
    return v != nullptr && m >= 0 && m <= 4 ? m : -1;
  }();
  return env;
}
// The default choices, measured on the H200 (bench/results/cuda-h200-2026-12-01.md, "dot
// kernels", and -12-02.md): row_dots (wgrad) a warp an assignment always (qwen3 1.46 -> 1.01x
// the floor, decode 14.9 -> 10.1 us in a graph, deepseek-v3 1.00 -> 0.94x); spreads with dots a
// warp an assignment always (mixtral 1.39 -> 1.09x, qwen3 1.68 -> 1.23x, deepseek-v3 1.08 ->
// 1.06x; at decode the three-block warp kernel beats the block kernel, combine_backward(w) 29.6
// -> 27.8 us in a graph, and a block an assignment, 29.2); reduce with dots a warp a token
// (gather_backward(w): mixtral 1.15 -> 1.03x, qwen3 1.23 -> 1.06x, deepseek-v3 1.13 -> 0.99x
// against the block kernel), a block a token in the same form for few tokens (decode
// dispatch_backward(w) 12.2 -> 10.2 us in a graph against the wide shape, which had been
// 18.1 -> 12.0 against the block kernel).
bool few_tokens(int64_t tokens) { return tokens < few_tokens_blocks(); }
constexpr int kWarpReduceK = 8;  // the warp kernels' largest top_k
// The plain reduce's shape: 0 the block kernel at (1, 4) (units a thread, source rows loaded
// together; top-2 has its own shape, (2, 2)); for top_k > 2 also 1 (1, 8), 2 (2, 8), 3 (2, 4);
// for top_k <= 8, 4 a block a token, 6 the same with two units a lane at a time and 5 a warp a
// token in the warp kernel's form (every source row's unit loaded before the first add, no
// shared memory; the same sums, bit for bit). Measured on the H200 (bench/results/
// cuda-h200-2026-12-02-eleventh.md; graph us, E = 256, K = 8, H = 7168 unless named):
// - fewer tokens than SMs (T = 64, 128): 1 is best (combine(w) 4.6 / 5.7 against 5.8 / 6.2 for 4);
// - T = 256 (about two a SM): 6 (combine(w) 7.7, padded_scatter 9.2, plan + dispatch + combine
//   33.3) ahead of 4 (7.8, 9.3, 34.0-34.2) and 1 (8.8-8.9, 10.5, 33.6-33.7);
// - T = 384 up to 16384: 4 (T = 384 combine(w) 12.1 against 15.0 for 1 and 14.6 for 6; T = 2048
//   65.8 against 72.2 for 0; deepseek-v3 488.6 -> 483.3, qwen3-30b-a3b 144.1 -> 141.7,
//   mixtral-8x7b (top-2) 97.8 -> 96.7 against 0); 6 loses where a row has fewer than 512 units
//   (qwen3: 187.4); 5 and 2 / 3 lose everywhere.
// So 1 below one token an SM (top_k > 2), 6 below 2.5 tokens an SM with rows of 512 units and
// more, else 4; top_k > 8: 1 for few tokens, else 0.
// PADMOE_CUDA_REDUCE_SHAPE=0..6 (read once; measurements) or set_reduce_shape (tests) forces one.
std::atomic<int> g_reduce_shape{-2};  // -2: not set by set_reduce_shape
// Where a block a token loads two units a lane (the plain reduce's shape 6, the reduce with
// dots' 4): from one token an SM to below 2.5, rows of 512 units (8 KiB) and more.
bool two_units_window(int64_t tokens, int64_t units) {
  const int64_t sms = sm_count();
  return tokens >= sms && 2 * tokens < 5 * sms && units >= 2 * kThreads;
}
int plain_reduce_shape(int64_t tokens, int top_k, int64_t units) {
  static const int env = [] {
    const char* v = std::getenv("PADMOE_CUDA_REDUCE_SHAPE");
    const int n = v != nullptr ? std::atoi(v) : -1;
    return v != nullptr && n >= 0 && n <= 6 ? n : -1;
  }();
  const int set = g_reduce_shape.load(std::memory_order_relaxed);
  const int forced = set != -2 ? set : env;
  int shape = forced;
  if (shape < 0) {
    const int64_t sms = sm_count();
    if (top_k > kWarpReduceK) shape = few_tokens(tokens) ? 1 : 0;
    else if (tokens < sms) shape = top_k > 2 ? 1 : 0;
    else if (two_units_window(tokens, units)) shape = 6;
    else shape = 4;
  }
  if (shape >= 4 && top_k > kWarpReduceK) shape = 0;
  if (shape >= 1 && shape <= 3 && top_k <= 2) shape = 0;
  return shape;
}
bool warp_row_dots() { return dot_kernels() != 0; }
bool warp_spread_dots() { return dot_kernels() != 0; }
// Reduce with dots: 0 the block kernel, 1 its wide shape, 2 a warp a token, 3 a block a token
// in the warp kernel's form (kSplit 8), 4 the same with two units a lane at a time (2-4 for
// top_k <= 8, else the block kernel or its wide shape). PADMOE_CUDA_DOTS forces the family;
// else PADMOE_CUDA_REDUCE_DOTS=0..4 (read once, measurements) picks the reduce alone; else by
// shape: 4 in the plain reduce's two-units window (about two tokens an SM, 8 KiB rows and more),
// else 3 for few tokens, 2 otherwise. Measured on the H200 at decode (T = 256, H = 7168; graph
// us, bench/results/cuda-h200-2026-12-02-twelfth.md): 4 against 3, padded_gather_backward(w)
// 11.1-11.5 against 12.4, dispatch_backward(w) 9.5-9.7 against 10.1-10.3.
int reduce_dots_kernel(int64_t tokens, int top_k, int64_t units) {
  int pick = dot_kernels();
  if (pick < 0) {
    static const int env = [] {
      const char* v = std::getenv("PADMOE_CUDA_REDUCE_DOTS");
      const int m = v != nullptr ? std::atoi(v) : -1;
      return v != nullptr && m >= 0 && m <= 4 ? m : -1;
    }();
    pick = env >= 0 ? env : two_units_window(tokens, units) ? 4 : few_tokens(tokens) ? 3 : 2;
  }
  if (pick >= 2 && top_k > kWarpReduceK) pick = few_tokens(tokens) ? 1 : 0;
  return pick;
}
}  // namespace

// Rows a zero block clears: kZeroRows; at small T about 56 KiB of rows (4 rows of 14 KiB), from 4
// to kZeroRows rows. Measured on the H200 at decode (2026-12-03, graph us, 4 / 8 / 2 rows a block):
// dispatch (14 KiB bf16 rows) 18.5 / 19.6 / 19.7, dispatch(fp8+scales) (7 KiB rows) 12.5 / 11.1 / 17.0.
int zero_rows_per_block(int64_t tokens, int64_t row_bytes) {  // declared in common.cuh
  static const int forced = [] {
    const char* v = std::getenv("PADMOE_CUDA_ZERO_ROWS");
    return v != nullptr ? std::max(1, std::atoi(v)) : 0;
  }();
  if (forced > 0) return forced;
  if (tokens >= slice_target_blocks()) return kZeroRows;
  constexpr int64_t kSmallZeroBytes = 4 * 14336;
  const int64_t rows = row_bytes > 0 ? kSmallZeroBytes / row_bytes : kZeroRows;
  return static_cast<int>(std::min<int64_t>(kZeroRows, std::max<int64_t>(4, rows)));
}

void set_reduce_shape(int shape) {
  g_reduce_shape.store(shape < -1 || shape > 6 ? -1 : shape, std::memory_order_relaxed);
}

void set_dot_kernels(int mode) { g_dot_kernels.store(mode < -1 || mode > 4 ? -1 : mode, std::memory_order_relaxed); }

void set_slice_blocks(int blocks) { g_slice_blocks.store(blocks < -1 ? -1 : blocks, std::memory_order_relaxed); }

// The spread without dots a warp a token (spread_warp_kernel, kUnits 4 or 8 a lane), or 0: the
// block kernel. PADMOE_CUDA_SPREAD_WARP=0|4|8 (read once) or set_spread_warp (tests) for every such
// spread; unset: 8 for rows of at most 512 units (8 KiB) whose K copies are at most 2048 units and
// at least 16 tokens an SM, else the block kernel. Measured on the H200 (2026-12-03,
// bench/results/cuda-h200-2026-12-03.md): dispatch(fp8+scales) mixtral-8x7b 2.07x -> 1.19x the
// floor, qwen3-30b-a3b 1.98x -> 1.34x, dispatch(w) qwen3 1.21x -> 1.14x, mixtral's bf16 dispatch
// 1.16x -> 1.14x; deepseek-v3 (K = 8 copies of 7 KiB) 1.18x -> 1.20x and decode (256 tokens: 32
// blocks) 1.25x -> 1.89x are why the rule leaves them to the block kernel.
namespace {
std::atomic<int> g_spread_warp{-1};
int spread_warp_units(int64_t tokens, int64_t units, int top_k) {
  int v = g_spread_warp.load(std::memory_order_relaxed);
  if (v < 0) {
    static const int env = [] {
      const char* e = std::getenv("PADMOE_CUDA_SPREAD_WARP");
      if (e == nullptr) return -1;
      const int n = std::atoi(e);
      return n == 4 || n == 8 ? n : 0;
    }();
    v = env;
  }
  if (v >= 0) return v;
  const bool short_rows = units <= 512 && units * top_k <= 2048;
  return short_rows && tokens >= 16 * static_cast<int64_t>(sm_count()) ? 8 : 0;
}
}  // namespace

int l2_prefetch_mode() {
  const int set = g_l2_prefetch.load(std::memory_order_relaxed);
  if (set >= 0) return set;
  static const int env = [] {
    const char* v = std::getenv("PADMOE_CUDA_PREFETCH");
    if (v == nullptr) return 1;
    return std::string(v) == "all" ? 2 : (std::atoi(v) == 0 ? 0 : 1);
  }();
  return env;
}

void set_l2_prefetch(int mode) { g_l2_prefetch.store(mode < 0 || mode > 2 ? -1 : mode, std::memory_order_relaxed); }

RowsArg with_l2_prefetch(const RowsArg& r, bool vec, int blocks) {
  RowsArg out = r;
  out.l2_bytes = 0;
  out.l2_blocks = 0;
  const int mode = l2_prefetch_mode();
  const int64_t row_bytes = r.cols * static_cast<int64_t>(element_size(r.dtype));
  if (mode == 0 || !vec || r.data == nullptr || r.rows <= 0 || row_bytes <= 0 || row_bytes % 16 != 0 ||
      row_bytes > (int64_t{1} << 30)) {
    return out;
  }
  // the default: only where there is a wait to overlap and the rows stay in L2 until read
  if (mode == 1 && (!pdl_enabled() || r.rows * row_bytes > l2_cache_bytes() / 10 * 6)) return out;
  out.l2_bytes = static_cast<uint32_t>(row_bytes);
  out.l2_blocks = blocks;
  return out;
}

namespace {
std::atomic<int> g_dest_search{-2};  // -2: not set by set_dest_search
}  // namespace

void set_dest_search(int mode) { g_dest_search.store(mode == 0 ? 0 : -2, std::memory_order_relaxed); }

bool dest_search_fits(int64_t assignments, int num_experts, int top_k) {
  int mode = g_dest_search.load(std::memory_order_relaxed);
  if (mode == -2) {
    static const int env = [] {
      const char* v = std::getenv("PADMOE_CUDA_DEST_SEARCH");
      return v != nullptr && std::atoi(v) == 0 ? 0 : -1;
    }();
    mode = env;
  }
  return mode != 0 && assignments <= kSearchAssignments && num_experts <= kSearchExperts && top_k <= kWarpReduceK;
}

void set_spread_warp(int units) {
  g_spread_warp.store(units == 0 || units == 4 || units == 8 ? units : -1, std::memory_order_relaxed);
}

void spread_rows(const RowsArg& x, int top_k, const DestArg& dest, ScaleArg w, const RowsArg& y,
                 const PaddingRef& padding, bool zero_padding, bool zero_past_end, const RowsArg* dots_with,
                 FloatOutArg dots, void* stream, const ScaleRowsArg* scales) {
  const int64_t tokens = x.rows;
  // Rows a zero block clears: 32, or about 56 KiB of rows at small T (spreads the padding over more
  // blocks, so that no multiprocessor holds much more than its share of the writes);
  // PADMOE_CUDA_ZERO_ROWS.
  const int zero_rows = zero_rows_per_block(tokens, y.cols * static_cast<int64_t>(element_size(y.dtype)));
  const int64_t zero_blocks = zero_padding || zero_past_end ? index::ceil_div(y.rows, zero_rows) : 0;
  const bool vec = rows_vectorizable(x) && rows_vectorizable(y) && (dots_with == nullptr || rows_vectorizable(*dots_with));
  const int64_t units = vec ? y.cols * static_cast<int64_t>(element_size(y.dtype)) / 16 : y.cols;
  // Spreads do not slice by default: measured on the H200 at decode size (T = 256, 14 KiB rows)
  // slicing made dispatch 2-14% slower (bench/results/cuda-h200-2026-12-01.md); it stays
  // selectable for measurements (PADMOE_CUDA_SPREAD_SLICES=1).
  const bool may_slice = spread_slices() || g_slice_blocks.load(std::memory_order_relaxed) > 0;  // tests force it
  const Slicing sl = slicing_for(tokens, units, kThreads, dots.data != nullptr || !may_slice);
  const int64_t blocks = tokens * sl.slices + zero_blocks;
  const bool scale_cols = scales != nullptr && scales->cols > 0;  // per-row scales move even when H = 0
  if (blocks == 0 || (y.cols == 0 && dots.data == nullptr && !scale_cols)) return;  // H = 0 still writes zero dots
  const RowsArg with = dots_with != nullptr ? *dots_with : RowsArg{};
  const ScaleRowsArg sc = scales != nullptr ? *scales : ScaleRowsArg{};
  auto launch = [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("spread_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream), x, top_k,
        dest, w, y, padding, zero_padding, zero_past_end, with, dots, sc, sl.slices, sl.slice_units, zero_rows);
  };
  if (dest.rows == nullptr) {  // the search form: the block kernel, or with dots the warp kernel
    if (dots.data != nullptr && scales == nullptr) {
      const int64_t assignment_blocks = index::ceil_div(tokens * top_k, kThreads / 32);
      if (assignment_blocks + zero_blocks == 0) return;
      pick<SpreadDotsWarp<3, kSpreadDotsWarpUnits, true>::Tag>(x.dtype, vec, [&](auto tag) {
        using Tag = decltype(tag);
        launch_kernel("spread_dots_warp_kernel", Tag::fn, static_cast<unsigned>(assignment_blocks + zero_blocks),
            kThreads, 0, as_stream(stream), x, top_k, dest, w, y, padding, zero_padding, zero_past_end, with, dots,
            assignment_blocks, zero_rows);
      });
    } else if (scales != nullptr) {
      pick<SearchSpread<true, false>::Tag>(x.dtype, vec, launch);
    } else if (dots.data != nullptr) {
      pick<SearchSpread<false, true>::Tag>(x.dtype, vec, launch);
    } else {
      pick<SearchSpread<false, false>::Tag>(x.dtype, vec, launch);
    }
    return;
  }
  if (dots.data != nullptr && scales == nullptr && warp_spread_dots()) {
    const int64_t assignment_blocks = index::ceil_div(tokens * top_k, kThreads / 32);
    if (assignment_blocks + zero_blocks == 0) return;  // top_k 0 (never through the API)
    auto warp_launch = [&](auto tag) {
      using Tag = decltype(tag);
      launch_kernel("spread_dots_warp_kernel", Tag::fn, static_cast<unsigned>(assignment_blocks + zero_blocks),
          kThreads, 0, as_stream(stream), x, top_k, dest, w, y, padding, zero_padding, zero_past_end, with, dots,
          assignment_blocks, zero_rows);
    };
    if (dots_warp_blocks() == 2) pick<SpreadDotsWarp<1, kWarpUnits>::Tag>(x.dtype, vec, warp_launch);
    else pick<SpreadDotsWarp<3, kSpreadDotsWarpUnits>::Tag>(x.dtype, vec, warp_launch);
    return;
  }
  const int warp_units = dots.data == nullptr ? spread_warp_units(tokens, units, top_k) : 0;
  if (warp_units > 0) {  // a warp a token
    const int64_t token_blocks = index::ceil_div(tokens, kThreads / 32);
    if (token_blocks + zero_blocks == 0) return;
    auto warp_launch = [&](auto tag) {
      using Tag = decltype(tag);
      launch_kernel("spread_warp_kernel", Tag::fn, static_cast<unsigned>(token_blocks + zero_blocks), kThreads, 0,
          as_stream(stream), x, top_k, dest.rows, w, y, padding, zero_padding, zero_past_end, sc, token_blocks,
          zero_rows);
    };
    if (scales != nullptr) {
      if (warp_units == 4) pick<SpreadWarp<true, 4>::Tag>(x.dtype, vec, warp_launch);
      else pick<SpreadWarp<true, 8>::Tag>(x.dtype, vec, warp_launch);
    } else {
      if (warp_units == 4) pick<SpreadWarp<false, 4>::Tag>(x.dtype, vec, warp_launch);
      else pick<SpreadWarp<false, 8>::Tag>(x.dtype, vec, warp_launch);
    }
    return;
  }
  if (scales != nullptr) pick<ScaledSpreadTag>(x.dtype, vec, launch);  // never with dots
  else if (dots.data != nullptr) {
    switch (dot_batch()) {
      case 2: pick<SpreadDots<2>::Tag>(x.dtype, vec, launch); break;
      case 4: pick<SpreadDots<4>::Tag>(x.dtype, vec, launch); break;
      default: pick<SpreadDots<1>::Tag>(x.dtype, vec, launch); break;
    }
  }
  else pick<SpreadTag>(x.dtype, vec, launch);
}

void reduce_rows(const RowsArg& y, int top_k, const DestArg& dest, ScaleArg w, const RowsArg& out,
                 const RowsArg* dots_with, FloatOutArg dots, void* stream) {
  if (out.rows == 0 || (out.cols == 0 && dots.data == nullptr)) return;  // H = 0 still writes zero dots
  const RowsArg g = dots_with != nullptr ? *dots_with : RowsArg{};
  const bool vec = rows_vectorizable(y) && rows_vectorizable(out) && (dots_with == nullptr || rows_vectorizable(g));
  const bool dots_wanted = dots.data != nullptr;
  const int64_t units = vec ? out.cols * static_cast<int64_t>(element_size(out.dtype)) / 16 : out.cols;
  // reduce_dots_warp_kernel, a warp a token or a block a token, with dots or without
  auto warp_reduce = [&](bool warp_a_token, auto with_dots, bool two_units = false) {
    constexpr bool kD = decltype(with_dots)::value;
    const int64_t blocks = warp_a_token ? index::ceil_div(out.rows, kThreads / 32) : out.rows;
    auto warp_launch = [&](auto tag) {
      using Tag = decltype(tag);
      launch_kernel("reduce_dots_warp_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0,
          as_stream(stream), y, top_k, dest, w, out, g, dots);
    };
    // top-2: two units a lane and batch (six loads in flight), top-8: one (nine)
    if (warp_a_token && top_k <= 2) pick<ReduceDotsWarp<2, 2, 1, kD>::template Tag>(y.dtype, vec, warp_launch);
    else if (warp_a_token) pick<ReduceDotsWarp<kWarpReduceK, 1, 1, kD>::template Tag>(y.dtype, vec, warp_launch);
    else if (top_k <= 2) pick<ReduceDotsWarp<2, 2, kThreads / 32, kD>::template Tag>(y.dtype, vec, warp_launch);
    else if (two_units) pick<ReduceDotsWarp<kWarpReduceK, 2, kThreads / 32, kD>::template Tag>(y.dtype, vec, warp_launch);
    else pick<ReduceDotsWarp<kWarpReduceK, 1, kThreads / 32, kD>::template Tag>(y.dtype, vec, warp_launch);
  };
  if (dest.rows == nullptr) {  // the search form (top_k <= 8): a block a token, two units a lane in its window
    const bool two = two_units_window(out.rows, units);
    auto search_launch = [&](auto tag) {
      using Tag = decltype(tag);
      launch_kernel("reduce_dots_warp_kernel", Tag::fn, static_cast<unsigned>(out.rows), kThreads, 0,
          as_stream(stream), y, top_k, dest, w, out, g, dots);
    };
    constexpr int kS = kThreads / 32;
    if (dots_wanted && two) pick<ReduceDotsWarp<kWarpReduceK, 2, kS, true, true, true>::Tag>(y.dtype, vec, search_launch);
    else if (dots_wanted) pick<ReduceDotsWarp<kWarpReduceK, 1, kS, true, true, true>::Tag>(y.dtype, vec, search_launch);
    else if (two) pick<ReduceDotsWarp<kWarpReduceK, 2, kS, false, true, true>::Tag>(y.dtype, vec, search_launch);
    else pick<ReduceDotsWarp<kWarpReduceK, 1, kS, false, true, true>::Tag>(y.dtype, vec, search_launch);
    return;
  }
  const int plain = dots_wanted ? 0 : plain_reduce_shape(out.rows, top_k, units);
  if (plain >= 4) {  // a block (4; 6 with two units a lane) or a warp (5) a token, no dots
    warp_reduce(plain == 5, std::false_type{}, plain == 6);
    return;
  }
  const Slicing sl = slicing_for(out.rows, units, top_k <= 2 || plain >= 2 ? 2 * kThreads : kThreads, dots_wanted);
  auto launch = [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("reduce_kernel", Tag::fn, static_cast<unsigned>(out.rows * sl.slices), kThreads, 0,
        as_stream(stream), y, top_k, dest.rows, w, out, g, dots, sl.slices, sl.slice_units);
  };
  const int dots_kernel = dots_wanted ? reduce_dots_kernel(out.rows, top_k, units) : 0;
  if (dots_kernel >= 2) {
    warp_reduce(dots_kernel == 2, std::true_type{}, dots_kernel == 4);
    return;
  }
  if (top_k <= 2) {
    if (dots_wanted) pick<ReduceShape<2, 2, true>::Tag>(y.dtype, vec, launch);
    else pick<ReduceShape<2, 2, false>::Tag>(y.dtype, vec, launch);
  } else {
    // With dots and few tokens (a block a token, about two blocks an SM) each thread keeps 16
    // loads in flight instead of 4: (2, 8).
    if (dots_kernel == 1) pick<ReduceShape<2, 8, true>::Tag>(y.dtype, vec, launch);
    else if (dots_wanted) pick<ReduceShape<1, 4, true>::Tag>(y.dtype, vec, launch);
    else if (plain == 1) pick<ReduceShape<1, 8, false>::Tag>(y.dtype, vec, launch);
    else if (plain == 2) pick<ReduceShape<2, 8, false>::Tag>(y.dtype, vec, launch);
    else if (plain == 3) pick<ReduceShape<2, 4, false>::Tag>(y.dtype, vec, launch);
    else pick<ReduceShape<1, 4, false>::Tag>(y.dtype, vec, launch);
  }
}

// row_dots' kernel: 0 a warp an assignment (dots_warp_kernel), 1 a block a token in the reduce
// warp kernel's form with the dots alone (every source row's unit and g's loaded before the first
// product, one barrier at the end; top_k <= 8). PADMOE_CUDA_ROW_DOTS=0|1 (read once) or
// set_row_dots (tests); unset: 1 for 2 < top_k <= 8, else 0. Measured on the H200 (2026-12-03,
// padded_scatter_wgrad, graph, x floor, 0 against 1): decode 1.42 / 1.34, qwen3-30b-a3b 1.01 / 0.98,
// deepseek-v3 0.94 / 0.93, mixtral-8x7b (top-2) 1.00 / 1.22; two units a lane at a time lost
// everywhere (decode 1.42, deepseek-v3 0.96) and is gone. set_dot_kernels(0) / PADMOE_CUDA_DOTS=0
// still select the block kernel (dots_kernel) over both.
namespace {
std::atomic<int> g_row_dots{-2};  // -2: not set by set_row_dots
int row_dots_kernel(int top_k) {
  int v = g_row_dots.load(std::memory_order_relaxed);
  if (v == -2) {
    static const int env = [] {
      const char* e = std::getenv("PADMOE_CUDA_ROW_DOTS");
      const int n = e != nullptr ? std::atoi(e) : -1;
      return e != nullptr && (n == 0 || n == 1) ? n : -1;
    }();
    v = env;
  }
  if (v < 0) v = top_k > 2 ? 1 : 0;
  return top_k <= kWarpReduceK ? v : 0;
}
}  // namespace

void set_row_dots(int mode) { g_row_dots.store(mode == 0 || mode == 1 ? mode : -2, std::memory_order_relaxed); }

void row_dots(const RowsArg& y, const RowsArg& g, int top_k, const DestArg& dest, int64_t assignments,
              FloatOutArg out, void* stream) {
  const int64_t tokens = assignments / top_k;
  if (tokens == 0) return;
  const bool vec = rows_vectorizable(y) && rows_vectorizable(g);
  const bool search = dest.rows == nullptr;  // the search form (top_k <= 8): a block a token
  const int token_kernel = search ? 1 : warp_row_dots() ? row_dots_kernel(top_k) : 0;
  if (token_kernel > 0) {  // a block a token: `shape` carries the rows and width, no data
    const RowsArg shape{nullptr, tokens, g.cols, 0, g.dtype};
    auto launch = [&](auto tag) {
      using Tag = decltype(tag);
      launch_kernel("reduce_dots_warp_kernel", Tag::fn, static_cast<unsigned>(tokens), kThreads, 0, as_stream(stream),
          y, top_k, dest, ScaleArg{}, shape, g, out);
    };
    if (search) pick<ReduceDotsWarp<kWarpReduceK, 1, kThreads / 32, true, false, true>::Tag>(y.dtype, vec, launch);
    else pick<ReduceDotsWarp<kWarpReduceK, 1, kThreads / 32, true, false>::Tag>(y.dtype, vec, launch);
    return;
  }
  // A warp an assignment (the default), or a block a token (set_dot_kernels(0), PADMOE_CUDA_DOTS=0).
  if (warp_row_dots()) {
    const int64_t blocks = index::ceil_div(assignments, kThreads / 32);
    pick<WarpDotsTag>(y.dtype, vec, [&](auto tag) {
      using Tag = decltype(tag);
      launch_kernel("dots_warp_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream), y, g,
          top_k, dest.rows, assignments, out);
    });
    return;
  }
  pick<DotsTag>(y.dtype, vec, [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("dots_kernel", Tag::fn, static_cast<unsigned>(tokens), kThreads, 0, as_stream(stream), y, g, top_k,
        dest.rows, out);
  });
}

void gather_rows(const RowsArg& src, IndexRef map, ScaleArg s, bool scale_by_source, const RowsArg& out, int64_t rows,
                 const int32_t* row_limit, void* stream, bool skip_unmapped, const ScaleRowsArg* scales,
                 bool reads_all_rows) {
  const bool scale_cols = scales != nullptr && scales->cols > 0;  // per-row scales move even when H = 0
  if (rows == 0 || (out.cols == 0 && !scale_cols)) return;
  const bool vec = rows_vectorizable(src) && rows_vectorizable(out);
  RowsArg limited = out;
  limited.rows = rows;
  const int64_t units = vec ? out.cols * static_cast<int64_t>(element_size(out.dtype)) / 16 : out.cols;
  int64_t per_block = kChunkUnits / (units > 0 ? units : 1);
  per_block = per_block < 1 ? 1 : (per_block > kMaxMapRows ? kMaxMapRows : per_block);
  const int64_t blocks = index::ceil_div(rows, per_block);
  const ScaleRowsArg sc = scales != nullptr ? *scales : ScaleRowsArg{};
  // every row of src read: the grid's first blocks (at most two an SM, all placed at once) ask L2
  // for all of them before the wait
  const int share = static_cast<int>(std::min<int64_t>(blocks, 2 * static_cast<int64_t>(sm_count())));
  const RowsArg from = reads_all_rows ? with_l2_prefetch(src, vec, share) : src;
  auto launch = [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("gather_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream), from, map, s,
        scale_by_source, limited, row_limit, static_cast<int>(per_block), skip_unmapped, sc);
  };
  if (scales != nullptr) pick<ScaledGatherTag>(out.dtype, vec, launch);
  else pick<GatherTag>(out.dtype, vec, launch);
}

void gather_rows_dots(const RowsArg& src, IndexRef map, ScaleArg s, const RowsArg& out, int64_t rows,
                      const RowsArg& dots_with, FloatOutArg dots, int64_t dots_len, void* stream) {
  if (dots_len > 0) {
    launch_kernel("fill_dots_kernel", fill_dots_kernel, grid_for(dots_len, 256, 4096), 256, 0, as_stream(stream), dots,
        dots_len);
  }
  if (rows == 0) return;
  const bool vec = rows_vectorizable(src) && rows_vectorizable(out) && rows_vectorizable(dots_with);
  const int64_t blocks = index::ceil_div(rows, kThreads / 32);
  pick<GatherDotsWarpTag>(out.dtype, vec, [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("gather_dots_warp_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream),
        src, map, s, out, rows, dots_with, dots);
  });
}

}  // namespace cuda
}  // namespace padmoe
