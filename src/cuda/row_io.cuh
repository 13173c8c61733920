// row_io.cuh — the row kernels' building blocks: 16-byte units of a row, block collectives, the
// staging of a token's destinations (dest_rows, or a search of the sorted form), scale rows, the
// padding-zero blocks and the dtype dispatch (pick). Device code and the host's kernel pick; one
// translation unit (rows.cu) includes it with the kernel families (spread_kernels.cuh,
// reduce_kernels.cuh, gather_kernels.cuh).
//
// A block owns one token (or one output row): every output row is written by exactly one block,
// once; padding rows are zeroed by extra blocks of the same launch. Rows move in 16-byte vectors
// when both sides allow it (row bytes, row stride and base pointer multiples of 16), element by
// element otherwise. Sums run in float32 in ascending k; dot products reduce in a fixed tree. No
// float atomics: results are bitwise reproducible.
#pragma once

#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/plan_view.cuh"

namespace padmoe {
namespace cuda {
namespace {

constexpr int kThreads = policy::kRowThreads;
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
    for (int i = 0; i < N; ++i) f[i] = f[i] * w + 0.0f;  // + 0: a zero product is +0.0 (spec: weighted rows)
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
constexpr int kZeroRows = policy::kZeroRows;  // rows per zero block (fewer at small T: policy::zero_rows_per_block)

// The search form of DestArg (rows null): s_out[q] = the destination row of assignment a0 + q, for
// q < n, or -1 (absent, or outside the `rows` rows given). The block stages bins and padded_bins
// (E <= kSearchExperts) and reads every entry of indices and bin_ids, kSearchItems a thread in
// flight (A <= kSearchAssignments: at most two rounds); an entry names its assignment once in a
// valid sorted form, and entries out of range (bad unchecked input) are skipped. Every thread of
// the block calls it, the same n; it ends with a barrier.
constexpr int kSearchAssignments = policy::kDestSearchAssignments;
constexpr int kSearchExperts = policy::kDestSearchExperts;
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
  const DevicePlan<const int32_t*> smem{s_bins, s_pbins, E};
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
      const int r = i - smem.real_start(e[j]) + smem.padded_start(e[j]);
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
      const int64_t r = plan_rows(dest).dest_row(a);
      s_dest[q] = (r < 0 || r >= rows) ? -1 : r;
    }
    s_w[q] = load_scale(w, a);
  }
  for (int q = threadIdx.x % 32; want_dots && q < nk; q += 32) s_part[threadIdx.x / 32][q] = 0.0f;
  __syncthreads();
}

// Stages the next live assignments of token t (destination in [0, rows)) in ascending k, from slot
// *k0 on, at most kGroupK of them: s_dest / s_w / s_k (the slot) for q < the count returned, and
// moves *k0 past the last one staged (to top_k when none is left). Dropped slots take no place, so
// a token whose live assignments fit one group (every token up to top_k 64, and a mask plan's
// K = E slots of a few routed experts) is summed in one group and rounded once, as the CPU does;
// with dots, each dropped slot's dot is written 0 here (a slot scanned twice writes it twice).
// Clears each warp's dot partials of the staged entries (s_part null: none kept). All threads call
// it, with one *k0.
template <int kWarpRows>
__device__ int stage_live(int64_t t, int* k0, int top_k, const int32_t* __restrict__ dest, const ScaleArg& w,
                          int64_t rows, bool want_dots, const FloatOutArg& dots, int64_t* s_dest, float* s_w, int* s_k,
                          float (*s_part)[kWarpRows]) {
  __shared__ int s_live[kThreads / 32];
  __shared__ int s_next;
  __syncthreads();  // the previous group is done with the staging arrays
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  int staged = 0, next = top_k;
  for (int k = *k0; k < top_k; k += kThreads) {  // uniform: every thread sees the same counts
    const int slot = k + static_cast<int>(threadIdx.x);
    const int64_t a = index::assignment_id(t, slot, top_k);
    int64_t r = -1;
    float wk = 1.0f;
    if (slot < top_k) {
      // the weight is loaded with the row, dead slot or not (w covers every slot): its latency
      // then overlaps the row's instead of following the liveness test
      r = plan_rows(dest).dest_row(a);
      wk = load_scale(w, a);
      if (r >= rows) r = -1;
    }
    const bool live = r >= 0;
    if (!live && slot < top_k && want_dots) store_float(dots, a, 0.0f);
    const unsigned m = __ballot_sync(0xffffffffu, live);
    if (lane == 0) s_live[warp] = __popc(m);
    __syncthreads();
    int before = 0, total = 0;
    for (int v = 0; v < kThreads / 32; ++v) {
      before += v < warp ? s_live[v] : 0;
      total += s_live[v];
    }
    const int pos = staged + before + __popc(m & ((1u << lane) - 1u));
    if (live && pos < kGroupK) {
      s_dest[pos] = r;
      s_w[pos] = wk;
      s_k[pos] = slot;
      if (pos == kGroupK - 1) s_next = slot + 1;
    }
    __syncthreads();  // s_live read by all, s_next written
    if (staged + total >= kGroupK) {
      next = s_next;
      staged = kGroupK;
      break;
    }
    staged += total;
  }
  for (int q = lane; want_dots && s_part != nullptr && q < staged; q += 32) s_part[warp][q] = 0.0f;
  __syncthreads();
  *k0 = next;
  return staged;
}

// dots[t*K + s_k[q]] = the warps' partials of staged entry q summed in order.
template <int kWarpRows>
__device__ void finish_live_dots(int64_t t, int nk, int top_k, const int* s_k, const float (*s_part)[kWarpRows],
                                 const FloatOutArg& dots) {
  __syncthreads();
  for (int q = threadIdx.x; q < nk; q += kThreads) {
    float sum = 0.0f;
    for (int v = 0; v < kThreads / 32; ++v) sum += s_part[v][q];
    store_float(dots, index::assignment_id(t, s_k[q], top_k), sum);
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
  const DevicePlan<StagedIndex> plan{StagedIndex{s_bins, pad.bins, staged},
                                     StagedIndex{s_pbins, pad.padded_bins, staged}, E};
  const int64_t last = first + rows < y.rows ? first + rows : y.rows;
  const int64_t units = units_of<U>(y);
  const int64_t padded = plan.padded_total();
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
  // from the first expert whose padded segment ends past `first`
  for (int64_t e = plan.padded_segment(first); e < E; ++e) {
    const int64_t pstart = plan.padded_start(e);
    if (pstart >= end) break;
    const int64_t count = plan.count(e);
    const int64_t z0 = pstart + count > first ? pstart + count : first;
    const int64_t pend = plan.padded_end(e);
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

// Element traits for moves of any row dtype (raw bits, no arithmetic).
template <typename Storage>
struct RawBits {
  using S = Storage;
  __device__ static float ld(S) { return 0.0f; }
  __device__ static S st(float) { return S{}; }
};

bool is_move_only(DType dtype) { return is_float8(dtype); }

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
}  // namespace cuda
}  // namespace padmoe
