// row_loops_cpu.hpp — the CPU row kernels' per-row loops: element traits, the scaled moves, the
// sums and dots of one token (portable, target_clones, and the AVX2 forms picked at run time), the
// stores (cached or streaming). Included by rows_cpu.cpp alone (the op launchers); float math is
// float32; a row without a scale is moved with memcpy, bit for bit.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <cstdlib>
#include <optional>

// The bf16 kernels (the sums, the scaled moves, the dots, and the fused sums
// + dots) have hand-written AVX2 forms on x86-64 with GCC or Clang, picked at
// run time (CPUID; KernelOverrides::cpu_avx2 = false forces the portable loops, so
// both can be tested on one machine). Each gives the bits of the code it replaced on
// this path (GCC 12's builds of the target_clones loops, and the first AVX2
// sums), NaN payloads included: see the pinned operand orders below. (Where
// two NaNs meet, the AVX2 sums and the portable sums can pick different
// payloads, as before.)
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define PADMOE_AVX2_SUMS 1
#include <immintrin.h>
#endif

#include "core/kernel_overrides.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/thread_pool.hpp"
#include "padmoe/index_math.hpp"
#include "padmoe/numeric.hpp"

// The per-row loops are compiled twice on x86-64 Linux with GCC (AVX2 and
// baseline), picked at load time. Both clones compute the same bits: no
// reassociation (no -ffast-math) and no contraction (ISO C++ mode), and the
// dot product's lanes are explicit.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define PADMOE_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define PADMOE_CPU_CLONES
#endif

namespace padmoe {
namespace cpu {
namespace {

// --- element traits: load to float / store from float --------------------
struct F32 {
  using S = float;
  static float ld(S v) { return v; }
  static S st(float f) { return f; }
};
struct BF16 {
  using S = uint16_t;
  static float ld(S v) { return numeric::bits_float(static_cast<uint32_t>(v) << 16); }
  // Branch-free round-to-nearest-even; same bits as numeric::float_to_bf16.
  static S st(float f) {
    const uint32_t u = numeric::float_bits(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet = (u >> 16) | 0x40u;
    return static_cast<S>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
  }
};
struct F16 {
  using S = uint16_t;
  static float ld(S v) { return numeric::half_to_float(v); }
  static S st(float f) { return numeric::float_to_half(f); }
};

template <typename T>
PADMOE_CPU_CLONES void scale_row(char* dst, const char* src, int64_t n, float w) {
  auto* d = reinterpret_cast<typename T::S*>(dst);
  const auto* s = reinterpret_cast<const typename T::S*>(src);
  for (int64_t i = 0; i < n; ++i) d[i] = T::st(T::ld(s[i]) * w + 0.0f);  // + 0: a zero product is +0.0
}

template <typename T>
PADMOE_CPU_CLONES void accumulate_row(float* acc, const char* src, int64_t n, float w) {
  const auto* s = reinterpret_cast<const typename T::S*>(src);
  for (int64_t i = 0; i < n; ++i) acc[i] += w * T::ld(s[i]);
}

template <typename T>
PADMOE_CPU_CLONES void store_row(char* dst, const float* acc, int64_t n) {
  auto* d = reinterpret_cast<typename T::S*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = T::st(acc[i]);
}

// Dot products in float32 with 16 interleaved lanes (element i feeds lane
// i % 16) reduced by a fixed tree: vectorizable, and the same bits on every
// run and thread count. dot_rows computes up to kMaxDotRows products against
// one shared row `b` in a single pass over its columns, chunk by chunk, so
// the K rows of a token stream side by side; each product's lanes still
// accumulate in ascending column order.
constexpr int kLanes = 16;
constexpr int kMaxDotRows = 16;
constexpr int64_t kDotChunk = 256;  // columns per pass over the rows

template <typename T>
PADMOE_CPU_CLONES void dot_chunk(float* lanes, const char* a_bytes, const char* b_bytes, int64_t begin, int64_t end) {
  const auto* a = reinterpret_cast<const typename T::S*>(a_bytes);
  const auto* b = reinterpret_cast<const typename T::S*>(b_bytes);
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += T::ld(a[i + j]) * T::ld(b[i + j]);
  }
  for (; i < end; ++i) lanes[i % kLanes] += T::ld(a[i]) * T::ld(b[i]);
}

// dot_chunk called through its load-time dispatch, never inlined: the AVX2
// kernels below finish their rows' last columns with it, and inlined into an
// AVX2 function GCC would compile it anew, with other operand orders (which
// decide the payload where two NaNs meet) than the dot_rows loops use.
template <typename T>
__attribute__((noinline)) void dot_chunk_call(float* lanes, const char* a, const char* b, int64_t begin, int64_t end) {
  dot_chunk<T>(lanes, a, b, begin, end);
}

inline float reduce_lanes(float* lanes) {
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
}

// out[k] = <a[k], b> for k < n (n <= kMaxDotRows), b of `cols` elements.
template <typename T>
void dot_rows(const char* const* a, int n, const char* b, int64_t cols, float* out) {
  float lanes[kMaxDotRows][kLanes] = {};
  for (int64_t c = 0; c < cols; c += kDotChunk) {
    const int64_t end = std::min(cols, c + kDotChunk);
    for (int k = 0; k < n; ++k) dot_chunk<T>(lanes[k], a[k], b, c, end);
  }
  for (int k = 0; k < n; ++k) out[k] = reduce_lanes(lanes[k]);
}

// --- the sums of one token: out = sum_q w[q] * rows[q] -------------------
// Per element: acc = 0.0f, then acc = acc + w[q] * x[q] for q ascending (in
// float32), then one cast: the same operations on every path.

// Portable form over columns [begin, end) in tiles of `tile` columns.
template <typename T>
void reduce_token_generic(char* out, const char* const* rows, const float* weights, int n, int64_t begin, int64_t end,
                          int64_t tile, float* acc) {
  const int64_t es = static_cast<int64_t>(sizeof(typename T::S));
  for (int64_t c0 = begin; c0 < end; c0 += tile) {
    const int64_t len = std::min(tile, end - c0);
    std::fill(acc, acc + len, 0.0f);
    for (int q = 0; q < n; ++q) accumulate_row<T>(acc, rows[q] + c0 * es, len, weights[q]);
    store_row<T>(out + c0 * es, acc, len);
  }
}

// The rows sit at random places, and the hardware prefetchers start each row
// (and each 4 KiB page of it) cold: the AVX2 loops ask for the first
// kPrefetch bytes of every row of a token at once, then stay kPrefetch bytes
// ahead (measured: 512 B best of 256-2048, about 20% less time than no
// prefetch).
constexpr int64_t kPrefetch = 512;

#if defined(PADMOE_AVX2_SUMS)
// AVX2 where the CPU has it; KernelOverrides::cpu_avx2 false (tests, `padmoe bench --variant
// avx2=off`) the portable loops.
bool use_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  const std::optional<bool>& forced = detail::kernel_overrides().cpu_avx2;
  return has && forced.value_or(true);
}


__attribute__((target("avx2"))) inline void prefetch_row_starts(const char* const* rows, int n, int64_t bytes) {
  for (int q = 0; q < n; ++q) {
    for (int64_t b = 0; b < kPrefetch && b < bytes; b += 64) _mm_prefetch(rows[q] + b, _MM_HINT_T0);
  }
}

// The two lines kPrefetch bytes ahead of byte `at` of a row of `bytes` bytes
// (the 64-column blocks' step: 128 bytes of bf16 per block).
__attribute__((target("avx2"), always_inline)) inline void prefetch_ahead(const char* row, int64_t at, int64_t bytes) {
  if (at + kPrefetch < bytes) {
    _mm_prefetch(row + at + kPrefetch, _MM_HINT_T0);
    _mm_prefetch(row + at + kPrefetch + 64, _MM_HINT_T0);
  }
}

// a + b and a * b with `a` as the instruction's first source. Where both
// operands of a lane are NaN, x86 returns the first source's payload, so the
// order is part of the result's bits; the compiler may swap the operands of
// _mm256_add_ps / _mm256_mul_ps (they are commutative), so these pin the order
// the loops had before: acc + w * x, lane + b * a (the dot loops as GCC
// vectorized them), w * x.
__attribute__((target("avx2"))) inline __m256 add_ps_first(__m256 a, __m256 b) {
  __m256 r;
  __asm__("vaddps %2, %1, %0" : "=x"(r) : "x"(a), "xm"(b));
  return r;
}
__attribute__((target("avx2"))) inline __m256 mul_ps_first(__m256 a, __m256 b) {
  __m256 r;
  __asm__("vmulps %2, %1, %0" : "=x"(r) : "x"(a), "xm"(b));
  return r;
}
// w * a + 0: a weighted row's elements, a zero product stored as +0.0 (docs/spec.md, weighted rows).
__attribute__((target("avx2"))) inline __m256 weigh_ps(__m256 w, __m256 a) {
  return _mm256_add_ps(mul_ps_first(w, a), _mm256_setzero_ps());
}

// The bf16 vectors keep each 32-bit lane's two elements where they are: of the
// 16 bf16 at p, `even` holds elements 0, 2, ..., 14 as float32 (the low halves
// shifted up) and `odd` elements 1, 3, ..., 15 (the high halves, masked).
// Exact, and no shuffles (the cvtepu16 / packus / permute form they replace
// kept the shuffle port busy).
__attribute__((target("avx2"))) inline void load_bf16_eo(const char* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// BF16::st before its final shift: the bf16 is the high 16 bits of
// u + 0x7fff + ((u >> 16) & 1) (round to nearest even), or of u | 0x400000 for
// a NaN (BF16::st's (u >> 16) | 0x40).
__attribute__((target("avx2"))) inline __m256i round_bf16_high(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
}

__attribute__((target("avx2"))) inline __m256i quiet_nans(__m256 f, __m256i rounded) {
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);  // BF16::st's (u & 0x7fffffff) > 0x7f800000
  const __m256i quiet = _mm256_or_si256(_mm256_castps_si256(f), _mm256_set1_epi32(0x400000));
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan));
}

// The rounded even / odd lanes -> 16 bf16 in memory order: the even results
// shifted down into the low halves, the odd ones kept in the high halves.
__attribute__((target("avx2"))) inline __m256i merge_bf16_eo(__m256i even_high, __m256i odd_high) {
  return _mm256_blend_epi16(_mm256_srli_epi32(even_high, 16), odd_high, 0xaa);
}

// The even / odd float32 lanes of 16 elements -> their 16 bf16 (BF16::st each),
// in memory order. NaNs are rare: one test per 16 lanes, the select only then.
__attribute__((target("avx2"))) inline __m256i pack_bf16_eo(__m256 even, __m256 odd) {
  __m256i re = round_bf16_high(even);
  __m256i ro = round_bf16_high(odd);
  const __m256 nan = _mm256_or_ps(_mm256_cmp_ps(even, even, _CMP_UNORD_Q), _mm256_cmp_ps(odd, odd, _CMP_UNORD_Q));
  if (!_mm256_testz_ps(nan, nan)) {
    re = quiet_nans(even, re);
    ro = quiet_nans(odd, ro);
  }
  return merge_bf16_eo(re, ro);
}

// True when none of the n bf16 at p is an Inf or a NaN (exponent bits all ones).
__attribute__((target("avx2"))) bool bf16_finite_avx2(const char* p, int64_t n) {
  const __m256i e = _mm256_set1_epi16(0x7f80);
  __m256i any = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {  // 64 bytes: a line, and one kPrefetch bytes ahead
    if ((i + 32) * 2 + kPrefetch <= n * 2) _mm_prefetch(p + i * 2 + kPrefetch, _MM_HINT_T0);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * 2));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * 2 + 32));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi16(_mm256_and_si256(v0, e), e));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi16(_mm256_and_si256(v1, e), e));
  }
  for (; i + 16 <= n; i += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * 2));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi16(_mm256_and_si256(v, e), e));
  }
  if (!_mm256_testz_si256(any, any)) return false;
  const auto* s = reinterpret_cast<const uint16_t*>(p);
  for (; i < n; ++i) {
    if ((s[i] & 0x7f80u) == 0x7f80u) return false;
  }
  return true;
}

template <bool kStream>
__attribute__((target("avx2"))) inline void store_bf16x16(char* p, __m256i v) {
  if (kStream) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}

// dst = src * w for n bf16 (BF16::st(BF16::ld(s) * w) per element). kStream:
// dst is 32-byte aligned and written with non-temporal stores (the tail of
// n mod 16 elements with ordinary ones). src_finite: src holds no Inf / NaN
// (bf16_finite_avx2); with a finite w no product is then a NaN, and the loop
// drops the NaN tests (a third of its instructions: the loop is bound by
// instructions, not memory, when K copies of an L1-resident row are written).
template <bool kStream>
__attribute__((target("avx2"))) void scale_row_bf16_avx2(char* dst, const char* src, int64_t n, float w,
                                                         bool src_finite) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t i = 0;
  if (src_finite && std::isfinite(w)) {
    for (; i + 16 <= n; i += 16) {
      __m256 e, o;
      load_bf16_eo(src + i * 2, e, o);
      store_bf16x16<kStream>(dst + i * 2,
                             merge_bf16_eo(round_bf16_high(weigh_ps(wv, e)), round_bf16_high(weigh_ps(wv, o))));
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      __m256 e, o;
      load_bf16_eo(src + i * 2, e, o);
      store_bf16x16<kStream>(dst + i * 2, pack_bf16_eo(weigh_ps(wv, e), weigh_ps(wv, o)));
    }
  }
  auto* d = reinterpret_cast<uint16_t*>(dst);
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  for (; i < n; ++i) d[i] = BF16::st(BF16::ld(s[i]) * w + 0.0f);
}

// dot_rows for bf16 over columns [0, cols64) (cols rounded down to 64), by
// the 16-lane rule of dot_chunk (element i into lane i % 16, ascending i):
// 64 columns of b at a time in 8 registers (even / odd halves of each 16),
// the n rows streaming by side by side as in the sums, each row's lanes
// (even lanes, then odd lanes) kept in L1 between blocks. Row q's lanes in
// lane order end in lanes[q]; finish_dots adds the last columns.
__attribute__((target("avx2"))) void dot_rows_bf16_avx2(const char* const* a, int n, const char* b, int64_t cols,
                                                        int64_t cols64, float (*lanes)[kLanes]) {
  alignas(32) float eo[kMaxDotRows][kLanes] = {};
  prefetch_row_starts(a, n, cols * 2);
  prefetch_row_starts(&b, 1, cols * 2);
  for (int64_t c = 0; c < cols64; c += 64) {
    prefetch_ahead(b, c * 2, cols * 2);  // b too may come from memory (wgrad's grad rows)
    __m256 b0, b1, b2, b3, b4, b5, b6, b7;
    load_bf16_eo(b + c * 2, b0, b1);
    load_bf16_eo(b + c * 2 + 32, b2, b3);
    load_bf16_eo(b + c * 2 + 64, b4, b5);
    load_bf16_eo(b + c * 2 + 96, b6, b7);
    for (int q = 0; q < n; ++q) {
      const char* r = a[q] + c * 2;
      prefetch_ahead(a[q], c * 2, cols * 2);
      __m256 se = _mm256_load_ps(eo[q]), so = _mm256_load_ps(eo[q] + 8);
      __m256 ae, ao;
      load_bf16_eo(r, ae, ao);
      se = add_ps_first(se, mul_ps_first(b0, ae));
      so = add_ps_first(so, mul_ps_first(b1, ao));
      load_bf16_eo(r + 32, ae, ao);
      se = add_ps_first(se, mul_ps_first(b2, ae));
      so = add_ps_first(so, mul_ps_first(b3, ao));
      load_bf16_eo(r + 64, ae, ao);
      se = add_ps_first(se, mul_ps_first(b4, ae));
      so = add_ps_first(so, mul_ps_first(b5, ao));
      load_bf16_eo(r + 96, ae, ao);
      se = add_ps_first(se, mul_ps_first(b6, ae));
      so = add_ps_first(so, mul_ps_first(b7, ao));
      _mm256_store_ps(eo[q], se);
      _mm256_store_ps(eo[q] + 8, so);
    }
  }
  for (int q = 0; q < n; ++q) {
    for (int j = 0; j < 8; ++j) {
      lanes[q][2 * j] = eo[q][j];
      lanes[q][2 * j + 1] = eo[q][8 + j];
    }
  }
}

// 64 columns at a time, the 64 float32 sums held in 8 registers while the n
// rows stream by; the rest of the row by the portable form.
__attribute__((target("avx2"))) void reduce_token_bf16_avx2(char* out, const char* const* rows, const float* weights,
                                                            int n, int64_t cols, int64_t tile, float* acc) {
  constexpr int64_t kBlock = 64;
  prefetch_row_starts(rows, n, cols * 2);
  int64_t c = 0;
  for (; c + kBlock <= cols; c += kBlock) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int q = 0; q < n; ++q) {
      const char* r = rows[q] + c * 2;
      prefetch_ahead(rows[q], c * 2, cols * 2);
      const __m256 w = _mm256_set1_ps(weights[q]);
      __m256 a, b;  // s(2j) holds the even columns of 16, s(2j+1) the odd ones
      load_bf16_eo(r, a, b);
      s0 = add_ps_first(s0, mul_ps_first(w, a));
      s1 = add_ps_first(s1, mul_ps_first(w, b));
      load_bf16_eo(r + 32, a, b);
      s2 = add_ps_first(s2, mul_ps_first(w, a));
      s3 = add_ps_first(s3, mul_ps_first(w, b));
      load_bf16_eo(r + 64, a, b);
      s4 = add_ps_first(s4, mul_ps_first(w, a));
      s5 = add_ps_first(s5, mul_ps_first(w, b));
      load_bf16_eo(r + 96, a, b);
      s6 = add_ps_first(s6, mul_ps_first(w, a));
      s7 = add_ps_first(s7, mul_ps_first(w, b));
    }
    __m256i* o = reinterpret_cast<__m256i*>(out + c * 2);
    _mm256_storeu_si256(o, pack_bf16_eo(s0, s1));
    _mm256_storeu_si256(o + 1, pack_bf16_eo(s2, s3));
    _mm256_storeu_si256(o + 2, pack_bf16_eo(s4, s5));
    _mm256_storeu_si256(o + 3, pack_bf16_eo(s6, s7));
  }
  if (c < cols) reduce_token_generic<BF16>(out, rows, weights, n, c, cols, tile, acc);
}

// reduce_token_bf16_avx2 plus the n dot products of the same rows with x (the
// backward of gather / dispatch: grad_x and grad_weights) in one pass over
// the rows. Each 64-column block of x is converted to float32 once for the n
// rows (into xb, L1); the dots' lanes (by dot_chunk's rule:
// even lanes then odd lanes of row q at lanes + 16 q) stay in L1 between the
// 64-column blocks, as the 64 sums need 8 of the 16 registers. The last
// cols mod 64 columns of the sums go by the portable form; dots + 16 q gets
// row q's lanes over the first cols64 columns (finish_dots adds the rest).
__attribute__((target("avx2"))) void reduce_dots_token_bf16_avx2(char* out, const char* const* rows,
                                                                 const float* weights, int n, int64_t cols,
                                                                 int64_t tile, float* acc, const char* x, float* lanes,
                                                                 float* dots) {
  constexpr int64_t kBlock = 64;
  const int64_t cols64 = cols & ~(kBlock - 1);
  prefetch_row_starts(rows, n, cols * 2);
  prefetch_row_starts(&x, 1, cols * 2);
  for (int q = 0; q < n; ++q) std::fill(lanes + q * kLanes, lanes + (q + 1) * kLanes, 0.0f);
  alignas(32) float xb[kBlock];
  for (int64_t c = 0; c < cols64; c += kBlock) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    // This block of x as float32 (even / odd halves of each 16), for the n dots.
    prefetch_ahead(x, c * 2, cols * 2);
    for (int i = 0; i < kBlock; i += 16) {
      __m256 e, o;
      load_bf16_eo(x + (c + i) * 2, e, o);
      _mm256_store_ps(xb + i, e);
      _mm256_store_ps(xb + i + 8, o);
    }
    for (int q = 0; q < n; ++q) {
      const char* r = rows[q] + c * 2;
      prefetch_ahead(rows[q], c * 2, cols * 2);
      const __m256 w = _mm256_set1_ps(weights[q]);
      float* lq = lanes + q * kLanes;
      __m256 de = _mm256_loadu_ps(lq), dd = _mm256_loadu_ps(lq + 8);
      __m256 a, b;
      load_bf16_eo(r, a, b);
      s0 = add_ps_first(s0, mul_ps_first(w, a));
      s1 = add_ps_first(s1, mul_ps_first(w, b));
      de = add_ps_first(de, mul_ps_first(_mm256_load_ps(xb), a));
      dd = add_ps_first(dd, mul_ps_first(_mm256_load_ps(xb + 8), b));
      load_bf16_eo(r + 32, a, b);
      s2 = add_ps_first(s2, mul_ps_first(w, a));
      s3 = add_ps_first(s3, mul_ps_first(w, b));
      de = add_ps_first(de, mul_ps_first(_mm256_load_ps(xb + 16), a));
      dd = add_ps_first(dd, mul_ps_first(_mm256_load_ps(xb + 24), b));
      load_bf16_eo(r + 64, a, b);
      s4 = add_ps_first(s4, mul_ps_first(w, a));
      s5 = add_ps_first(s5, mul_ps_first(w, b));
      de = add_ps_first(de, mul_ps_first(_mm256_load_ps(xb + 32), a));
      dd = add_ps_first(dd, mul_ps_first(_mm256_load_ps(xb + 40), b));
      load_bf16_eo(r + 96, a, b);
      s6 = add_ps_first(s6, mul_ps_first(w, a));
      s7 = add_ps_first(s7, mul_ps_first(w, b));
      de = add_ps_first(de, mul_ps_first(_mm256_load_ps(xb + 48), a));
      dd = add_ps_first(dd, mul_ps_first(_mm256_load_ps(xb + 56), b));
      _mm256_storeu_ps(lq, de);
      _mm256_storeu_ps(lq + 8, dd);
    }
    __m256i* o = reinterpret_cast<__m256i*>(out + c * 2);
    _mm256_storeu_si256(o, pack_bf16_eo(s0, s1));
    _mm256_storeu_si256(o + 1, pack_bf16_eo(s2, s3));
    _mm256_storeu_si256(o + 2, pack_bf16_eo(s4, s5));
    _mm256_storeu_si256(o + 3, pack_bf16_eo(s6, s7));
  }
  if (cols64 < cols) reduce_token_generic<BF16>(out, rows, weights, n, cols64, cols, tile, acc);
  for (int q = 0; q < n; ++q) {  // even / odd -> lane order, for finish_dots
    float* l = dots + q * kLanes;
    for (int j = 0; j < 8; ++j) {
      l[2 * j] = lanes[q * kLanes + j];
      l[2 * j + 1] = lanes[q * kLanes + 8 + j];
    }
  }
}
#endif

// (__builtin_prefetch: GCC and Clang on every target; a no-op where there is none.)
inline void prefetch_bytes(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// The first kPrefetch bytes of the rows of token t's live assignments: the
// token loops ask for the next token's rows while this one runs, so that each
// token's K rows start warm.
inline void prefetch_token_rows(const RowsRef& y, const int32_t* dest, int64_t t, int top_k) {
  const int64_t bytes = std::min(kPrefetch, y.row_bytes());
  for (int k = 0; k < top_k; ++k) {
    const int64_t r = dest[index::assignment_id(t, k, top_k)];
    if (r < 0) continue;
    prefetch_bytes(y.row(r), bytes);
  }
}

// The row kernels' entry points: the AVX2 bf16 forms where they run, else
// the portable loops (the same bits either way).
// src_finite (bf16 with AVX2): 1 when src holds no Inf / NaN, 0 when it may,
// -1 when not known (then tested here).
template <typename T>
void scale_row_any(char* dst, const char* src, int64_t n, float w, int src_finite = -1) {
#if defined(PADMOE_AVX2_SUMS)
  if (std::is_same<T, BF16>::value && use_avx2()) {
    scale_row_bf16_avx2<false>(dst, src, n, w, src_finite < 0 ? bf16_finite_avx2(src, n) : src_finite != 0);
    return;
  }
#endif
  (void)src_finite;  // the AVX2 bf16 form's hint
  scale_row<T>(dst, src, n, w);
}

#if defined(PADMOE_AVX2_SUMS)
// reduce_lanes with each add's first operand pinned (the first operand's
// payload wins where two NaNs meet; a plain + may be compiled either way):
// the order GCC 12 compiled dot_rows' tree to, lanes[j + width] + lanes[j] for
// the widths 8 and 4 (vectorized), lanes[j] + lanes[j + width] for 2 and 1.
inline float reduce_lanes_pinned(float* lanes) {
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) {
      float a = width >= 4 ? lanes[j + width] : lanes[j];
      const float b = width >= 4 ? lanes[j] : lanes[j + width];
      __asm__("addss %1, %0" : "+x"(a) : "xm"(b));
      lanes[j] = a;
    }
  }
  return lanes[0];
}

// out[q] from lanes over columns [0, done): the columns [done, cols) added
// with dot_chunk (its load-time clone, as dot_rows runs it), the lanes reduced.
inline void finish_dots(float (*lanes)[kLanes], int n, const char* const* a, const char* b, int64_t done, int64_t cols,
                        float* out) {
  for (int q = 0; q < n; ++q) {
    if (done < cols) dot_chunk_call<BF16>(lanes[q], a[q], b, done, cols);
    out[q] = reduce_lanes_pinned(lanes[q]);
  }
}
#endif  // PADMOE_AVX2_SUMS

template <typename T>
void dot_rows_any(const char* const* a, int n, const char* b, int64_t cols, float* out) {
#if defined(PADMOE_AVX2_SUMS)
  if (std::is_same<T, BF16>::value && use_avx2()) {
    float lanes[kMaxDotRows][kLanes];
    const int64_t cols64 = cols & ~int64_t{63};
    dot_rows_bf16_avx2(a, n, b, cols, cols64, lanes);
    finish_dots(lanes, n, a, b, cols64, cols, out);
    return;
  }
#endif
  dot_rows<T>(a, n, b, cols, out);
}

// Calls f.template operator()<Traits>() for a float32/16/bf16 dtype.
template <typename F>
void with_traits(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16: f(F16{}); break;
    case DType::kBFloat16: f(BF16{}); break;
    default: f(F32{}); break;
  }
}

// Row stores. Large outputs (Store::kStream) are written with non-temporal
// stores where the destination is 16-byte aligned: they are not read again
// soon, and streaming skips the read-for-ownership of every line.
enum class Store { kCached, kStream };

void copy_row(char* dst, const char* src, int64_t bytes, Store mode) {
  if (bytes <= 0) return;  // an empty row may come with null pointers: memcpy(dst, nullptr, 0) is undefined
#if defined(__SSE2__)
  if (mode == Store::kStream && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    int64_t i = 0;
    for (; i + 64 <= bytes; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    if (i < bytes) std::memcpy(dst + i, src + i, static_cast<size_t>(bytes - i));
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(bytes));
}

void zero_row(char* dst, int64_t bytes, Store mode) {
  if (bytes <= 0) return;  // memset(nullptr, 0, 0) of an empty row is undefined too
#if defined(__SSE2__)
  if (mode == Store::kStream && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    const __m128i z = _mm_setzero_si128();
    int64_t i = 0;
    for (; i + 64 <= bytes; i += 64) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), z);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), z);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), z);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), z);
    }
    if (i < bytes) std::memset(dst + i, 0, static_cast<size_t>(bytes - i));
    return;
  }
#endif
  std::memset(dst, 0, static_cast<size_t>(bytes));
}

// Orders streaming stores before the op returns.
void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// dst = src * w. Streamed outputs are scaled into an L1-resident tile first
// and then streamed out (chunks of 4 KiB keep dst's 16-byte alignment).
// src_finite: as for scale_row_any.
template <typename T>
void scale_row_to(char* dst, const char* src, int64_t n, float w, Store mode, int src_finite = -1) {
  if (mode == Store::kCached) {
    scale_row_any<T>(dst, src, n, w, src_finite);
    return;
  }
#if defined(PADMOE_AVX2_SUMS)
  // bf16 with AVX2 and a 32-byte aligned row: scaled straight into streaming stores.
  if (std::is_same<T, BF16>::value && use_avx2() && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    scale_row_bf16_avx2<true>(dst, src, n, w, src_finite < 0 ? bf16_finite_avx2(src, n) : src_finite != 0);
    return;
  }
#endif
  constexpr int64_t kChunkBytes = 4096;
  alignas(64) char tile[kChunkBytes];
  const int64_t es = static_cast<int64_t>(sizeof(typename T::S));
  const int64_t per = kChunkBytes / es;
  for (int64_t c = 0; c < n; c += per) {
    const int64_t len = std::min(per, n - c);
    scale_row_any<T>(tile, src + c * es, len, w, src_finite);
    copy_row(dst + c * es, tile, len * es, mode);
  }
}

// Stream when the output is well past the caches.
Store store_mode(int64_t output_bytes) {
  constexpr int64_t kStreamBytes = int64_t{64} << 20;
  return output_bytes >= kStreamBytes ? Store::kStream : Store::kCached;
}

}  // namespace
}  // namespace cpu
}  // namespace padmoe
