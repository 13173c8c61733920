// rows_cpu.cpp — the CPU row kernels: spread (dispatch), reduce (combine),
// dots (wgrad) and gather-by-map (pad / unpad). Float math is float32; a row
// without a scale is moved with memcpy, bit for bit.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <cstdlib>

// The sums' token loop has a hand-written AVX2 form on x86-64 with GCC or
// Clang, picked at run time (CPUID; PADMOE_CPU_NO_AVX2=1 forces the portable
// loops, so both can be tested on one machine).
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define PADMOE_AVX2_SUMS 1
#include <immintrin.h>
#endif

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
  for (int64_t i = 0; i < n; ++i) d[i] = T::st(T::ld(s[i]) * w);
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
void reduce_token_generic(char* out, const char* const* rows, const float* weights, int n, int64_t begin,
                          int64_t end, int64_t tile, float* acc) {
  const int64_t es = static_cast<int64_t>(sizeof(typename T::S));
  for (int64_t c0 = begin; c0 < end; c0 += tile) {
    const int64_t len = std::min(tile, end - c0);
    std::fill(acc, acc + len, 0.0f);
    for (int q = 0; q < n; ++q) accumulate_row<T>(acc, rows[q] + c0 * es, len, weights[q]);
    store_row<T>(out + c0 * es, acc, len);
  }
}

#if defined(PADMOE_AVX2_SUMS)
bool use_avx2_sums() {
  static const bool use = [] {
    const char* off = std::getenv("PADMOE_CPU_NO_AVX2");
    if (off != nullptr && off[0] != '\0' && off[0] != '0') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return use;
}

// 16 bf16 at p -> two vectors of 8 floats (exact: the bits shifted up).
__attribute__((target("avx2"))) inline void load_bf16x16(const char* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
}

// BF16::st on 8 lanes: round to nearest even, NaN -> (bits >> 16) | 0x40. Results in the low 16 bits.
__attribute__((target("avx2"))) inline __m256i round_bf16x8(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

// Two vectors of 8 rounded lanes -> 16 bf16 at p.
__attribute__((target("avx2"))) inline void store_bf16x16(char* p, __m256 lo, __m256 hi) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16x8(lo), round_bf16x8(hi)), 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}

// 64 columns at a time, the 64 float32 sums held in 8 registers while the n
// rows stream by; the rest of the row by the portable form.
__attribute__((target("avx2"))) void reduce_token_bf16_avx2(char* out, const char* const* rows, const float* weights,
                                                            int n, int64_t cols, int64_t tile, float* acc) {
  constexpr int64_t kBlock = 64;
  // The rows sit at random places, and the hardware prefetchers start each
  // row (and each 4 KiB page of it) cold: ask for the first kPrefetch bytes of
  // every row at once, then stay kPrefetch bytes ahead (measured: 512 B best of
  // 256-2048, about 20% less time than no prefetch; bench/results/cpu-sums-2026-12-01.md).
  constexpr int64_t kPrefetch = 512;
  for (int q = 0; q < n; ++q) {
    for (int64_t b = 0; b < kPrefetch && b < cols * 2; b += 64) _mm_prefetch(rows[q] + b, _MM_HINT_T0);
  }
  int64_t c = 0;
  for (; c + kBlock <= cols; c += kBlock) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int q = 0; q < n; ++q) {
      const char* r = rows[q] + c * 2;
      if (c * 2 + kPrefetch < cols * 2) {  // two lines, kPrefetch bytes ahead in the row
        _mm_prefetch(r + kPrefetch, _MM_HINT_T0);
        _mm_prefetch(r + kPrefetch + 64, _MM_HINT_T0);
      }
      const __m256 w = _mm256_set1_ps(weights[q]);
      __m256 a, b;
      load_bf16x16(r, a, b);
      s0 = _mm256_add_ps(s0, _mm256_mul_ps(w, a));
      s1 = _mm256_add_ps(s1, _mm256_mul_ps(w, b));
      load_bf16x16(r + 32, a, b);
      s2 = _mm256_add_ps(s2, _mm256_mul_ps(w, a));
      s3 = _mm256_add_ps(s3, _mm256_mul_ps(w, b));
      load_bf16x16(r + 64, a, b);
      s4 = _mm256_add_ps(s4, _mm256_mul_ps(w, a));
      s5 = _mm256_add_ps(s5, _mm256_mul_ps(w, b));
      load_bf16x16(r + 96, a, b);
      s6 = _mm256_add_ps(s6, _mm256_mul_ps(w, a));
      s7 = _mm256_add_ps(s7, _mm256_mul_ps(w, b));
    }
    char* o = out + c * 2;
    store_bf16x16(o, s0, s1);
    store_bf16x16(o + 32, s2, s3);
    store_bf16x16(o + 64, s4, s5);
    store_bf16x16(o + 96, s6, s7);
  }
  if (c < cols) reduce_token_generic<BF16>(out, rows, weights, n, c, cols, tile, acc);
}
#endif

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
template <typename T>
void scale_row_to(char* dst, const char* src, int64_t n, float w, Store mode) {
  if (mode == Store::kCached) {
    scale_row<T>(dst, src, n, w);
    return;
  }
  constexpr int64_t kChunkBytes = 4096;
  alignas(64) char tile[kChunkBytes];
  const int64_t es = static_cast<int64_t>(sizeof(typename T::S));
  const int64_t per = kChunkBytes / es;
  for (int64_t c = 0; c < n; c += per) {
    const int64_t len = std::min(per, n - c);
    scale_row<T>(tile, src + c * es, len, w);
    copy_row(dst + c * es, tile, len * es, mode);
  }
}

// Stream when the output is well past the caches.
Store store_mode(int64_t output_bytes) {
  constexpr int64_t kStreamBytes = int64_t{64} << 20;
  return output_bytes >= kStreamBytes ? Store::kStream : Store::kCached;
}

}  // namespace

float Scale::at(int64_t i) const {
  return data == nullptr ? 1.0f : numeric::load_as_float(data, dtype, i);
}

void FloatOut::store(int64_t i, float v) const { numeric::store_from_float(data, dtype, i, v); }

void ScaleRows::copy(int64_t to, int64_t from) const {
  const int64_t bytes = cols * elem;
  if (bytes > 0) std::memcpy(static_cast<char*>(dst) + to * bytes, static_cast<const char*>(src) + from * bytes,
                             static_cast<size_t>(bytes));
}

void ScaleRows::fill_one(int64_t to) const {
  char* row = static_cast<char*>(dst) + to * cols * elem;
  if (elem == 1) {
    if (cols > 0) std::memset(row, static_cast<int>(one), static_cast<size_t>(cols));
    return;
  }
  for (int64_t c = 0; c < cols; ++c) std::memcpy(row + c * 4, &one, 4);
}

int workers_for(int threads, int64_t items, int64_t bytes_per_item) {
  constexpr int64_t kMinBytesPerWorker = 256 * 1024;
  const int64_t total = items * std::max<int64_t>(1, bytes_per_item);
  const int64_t by_size = std::max<int64_t>(1, total / kMinBytesPerWorker);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({int64_t{resolve_threads(threads)}, by_size, std::max<int64_t>(1, items)})));
}

// dots[a] = <with[dest[a]], b> for the K assignments of token t (0 where dest < 0).
template <typename T>
void token_dots(const RowsRef& with, const int32_t* dest, int64_t t, int top_k, const char* b, int64_t cols,
                FloatOut dots) {
  for (int k0 = 0; k0 < top_k; k0 += kMaxDotRows) {
    const int k1 = std::min(top_k, k0 + kMaxDotRows);
    const char* rows[kMaxDotRows];
    int64_t ids[kMaxDotRows];
    float vals[kMaxDotRows];
    int n = 0;
    for (int k = k0; k < k1; ++k) {
      const int64_t a = index::assignment_id(t, k, top_k);
      if (dest[a] < 0) {
        dots.store(a, 0.0f);
        continue;
      }
      rows[n] = with.row(dest[a]);
      ids[n++] = a;
    }
    dot_rows<T>(rows, n, b, cols, vals);
    for (int q = 0; q < n; ++q) dots.store(ids[q], vals[q]);
  }
}

void copy_bytes(void* dst, const void* src, int64_t bytes, int threads) {
  constexpr int64_t kBlock = 4096;  // per-worker chunks start on 4 KiB boundaries of the buffer
  const int64_t blocks = index::ceil_div(bytes, kBlock);
  const int workers = workers_for(threads, blocks, kBlock);
  const Store mode = store_mode(bytes);
  parallel_run(workers, [&](int wid) {
    const index::Range r = index::work_range(wid, workers, blocks);
    const int64_t begin = r.begin * kBlock, end = std::min(bytes, r.end * kBlock);
    if (end > begin) copy_row(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, end - begin, mode);
    store_fence();
  });
}

void spread_rows(const RowsRef& x, int top_k, const int32_t* dest, Scale w, const RowsRef& y,
                 const int32_t* row_sources, int64_t padded_rows, bool zero_padding, bool zero_past_end,
                 const RowsRef* dots_with, FloatOut dots, int threads, const ScaleRows* scales) {
  const int64_t tokens = x.rows;
  const int64_t row_bytes = y.row_bytes();
  const int64_t zero_end = zero_past_end && y.rows > padded_rows ? y.rows : padded_rows;
  const int64_t zero_begin = zero_padding ? 0 : padded_rows;  // rows below P left alone when not zero_padding
  const int workers = workers_for(threads, tokens * top_k + zero_end, row_bytes);
  const Store mode = store_mode(zero_end * row_bytes);
  with_traits(x.dtype, [&](auto traits) {
    using T = decltype(traits);
    parallel_run(workers, [&](int wid) {
      // Real rows: this worker's tokens, each read once and written K times.
      const index::Range tr = index::work_range(wid, workers, tokens);
      for (int64_t t = tr.begin; t < tr.end; ++t) {
        const char* src = x.row(t);
        for (int k = 0; k < top_k; ++k) {
          const int64_t a = index::assignment_id(t, k, top_k);
          const int64_t r = dest[a];
          if (r < 0) continue;
          if (w.present()) scale_row_to<T>(y.row(r), src, x.cols, w.at(a), mode);
          else copy_row(y.row(r), src, row_bytes, mode);
          if (scales != nullptr) scales->copy(r, t);  // the row's scales, by the same worker
        }
        if (dots_with != nullptr) token_dots<T>(*dots_with, dest, t, top_k, src, x.cols, dots);
      }
      // Padding rows: this worker's share of [0, P) (and of [P, rows) with zero_past_end).
      const index::Range pr = index::work_range(wid, workers, zero_end - zero_begin);
      for (int64_t r = zero_begin + pr.begin; r < zero_begin + pr.end; ++r) {
        if (r >= padded_rows || row_sources[r] < 0) {
          zero_row(y.row(r), row_bytes, mode);
          if (scales != nullptr) scales->fill_one(r);
        }
      }
      store_fence();
    });
  });
}

void reduce_rows(const RowsRef& y, int top_k, const int32_t* dest, Scale w, const RowsRef& out, int block_x,
                 int threads) {
  const int64_t tokens = out.rows;
  const int64_t hidden = out.cols;
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(block_x, std::max<int64_t>(hidden, 1)));
  const int workers = workers_for(threads, tokens, (top_k + 1) * out.row_bytes());
  with_traits(y.dtype, [&](auto traits) {
    using T = decltype(traits);
    parallel_run(workers, [&](int wid) {
      std::vector<float> acc(static_cast<size_t>(tile));
      std::vector<const char*> rows(static_cast<size_t>(top_k));
      std::vector<float> weights(static_cast<size_t>(top_k));
#if defined(PADMOE_AVX2_SUMS)
      const bool avx2 = use_avx2_sums();
#endif
      const index::Range tr = index::work_range(wid, workers, tokens);
      for (int64_t t = tr.begin; t < tr.end; ++t) {
        int n = 0;  // this token's live assignments, ascending k
        for (int k = 0; k < top_k; ++k) {
          const int64_t a = index::assignment_id(t, k, top_k);
          if (dest[a] < 0) continue;
          rows[n] = y.row(dest[a]);
          weights[n++] = w.at(a);
        }
        // Small column tiles keep the K source rows streaming side by side.
#if defined(PADMOE_AVX2_SUMS)
        if (std::is_same<T, BF16>::value && avx2) {
          reduce_token_bf16_avx2(out.row(t), rows.data(), weights.data(), n, hidden, tile, acc.data());
          continue;
        }
#endif
        reduce_token_generic<T>(out.row(t), rows.data(), weights.data(), n, 0, hidden, tile, acc.data());
      }
    });
  });
}

void row_dots(const RowsRef& y, const RowsRef& g, int top_k, const int32_t* dest, int64_t assignments,
              FloatOut out, int threads) {
  const int64_t tokens = assignments / top_k;
  const int workers = workers_for(threads, tokens, (top_k + 1) * g.row_bytes());
  with_traits(y.dtype, [&](auto traits) {
    using T = decltype(traits);
    parallel_run(workers, [&](int wid) {
      const index::Range tr = index::work_range(wid, workers, tokens);
      for (int64_t t = tr.begin; t < tr.end; ++t) token_dots<T>(y, dest, t, top_k, g.row(t), g.cols, out);
    });
  });
}

void gather_rows(const RowsRef& src, const int32_t* map, Scale s, bool scale_by_source, const RowsRef& out,
                 int64_t rows, int threads, bool skip_unmapped, const ScaleRows* scales) {
  const int64_t row_bytes = out.row_bytes();
  const int workers = workers_for(threads, rows, 2 * row_bytes);
  const Store mode = store_mode(rows * row_bytes);
  auto run = [&](auto traits) {
    using T = decltype(traits);
    parallel_run(workers, [&](int wid) {
      const index::Range rr = index::work_range(wid, workers, rows);
      for (int64_t r = rr.begin; r < rr.end; ++r) {
        const int64_t from = map[r];
        if (from < 0) {
          if (!skip_unmapped) zero_row(out.row(r), row_bytes, mode);
        }
        else if (!s.present()) copy_row(out.row(r), src.row(from), row_bytes, mode);
        else scale_row_to<T>(out.row(r), src.row(from), out.cols, s.at(scale_by_source ? from : r), mode);
        if (scales != nullptr) {  // the row's scales, by the same worker
          if (from >= 0) scales->copy(r, from);
          else if (!skip_unmapped) scales->fill_one(r);
        }
      }
      store_fence();
    });
  };
  if (s.present()) with_traits(src.dtype, run);
  else run(F32{});  // moves only: the traits are unused
}

}  // namespace cpu
}  // namespace padmoe
