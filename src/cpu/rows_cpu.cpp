// rows_cpu.cpp — the CPU row kernels: spread (dispatch), reduce (combine),
// dots (wgrad) and gather-by-map (pad / unpad). Float math is float32; a row
// without a scale is moved with memcpy, bit for bit.
#include <algorithm>
#include <cstring>

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

// Dot product in float32 with 16 interleaved lanes (element i feeds lane
// i % 16) reduced by a fixed tree: vectorizable, and the same bits on every
// run and thread count.
constexpr int kLanes = 16;
template <typename T>
PADMOE_CPU_CLONES float dot_row(const char* a_bytes, const char* b_bytes, int64_t n) {
  const auto* a = reinterpret_cast<const typename T::S*>(a_bytes);
  const auto* b = reinterpret_cast<const typename T::S*>(b_bytes);
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += T::ld(a[i + j]) * T::ld(b[i + j]);
  }
  for (int j = 0; i < n; ++i, ++j) lanes[j] += T::ld(a[i]) * T::ld(b[i]);
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
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

void zero_row(char* dst, int64_t bytes) { std::memset(dst, 0, static_cast<size_t>(bytes)); }

}  // namespace

float Scale::at(int64_t i) const {
  return data == nullptr ? 1.0f : numeric::load_as_float(data, dtype, i);
}

void FloatOut::store(int64_t i, float v) const { numeric::store_from_float(data, dtype, i, v); }

int workers_for(int threads, int64_t items, int64_t bytes_per_item) {
  constexpr int64_t kMinBytesPerWorker = 256 * 1024;
  const int64_t total = items * std::max<int64_t>(1, bytes_per_item);
  const int64_t by_size = std::max<int64_t>(1, total / kMinBytesPerWorker);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({int64_t{resolve_threads(threads)}, by_size, std::max<int64_t>(1, items)})));
}

void spread_rows(const RowsRef& x, int top_k, const int32_t* dest, Scale w, const RowsRef& y,
                 const int32_t* row_sources, int64_t padded_rows, const RowsRef* dots_with, FloatOut dots,
                 int threads) {
  const int64_t tokens = x.rows;
  const int64_t row_bytes = y.row_bytes();
  const int workers = workers_for(threads, tokens * top_k + padded_rows, row_bytes);
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
          if (r < 0) {
            if (dots_with != nullptr) dots.store(a, 0.0f);
            continue;
          }
          if (w.present()) scale_row<T>(y.row(r), src, x.cols, w.at(a));
          else std::memcpy(y.row(r), src, static_cast<size_t>(row_bytes));
          if (dots_with != nullptr) dots.store(a, dot_row<T>(dots_with->row(r), src, x.cols));
        }
      }
      // Padding rows: this worker's share of [0, P).
      const index::Range pr = index::work_range(wid, workers, padded_rows);
      for (int64_t r = pr.begin; r < pr.end; ++r) {
        if (row_sources[r] < 0) zero_row(y.row(r), row_bytes);
      }
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
      const int64_t es = static_cast<int64_t>(element_size(y.dtype));
      const index::Range tr = index::work_range(wid, workers, tokens);
      for (int64_t t = tr.begin; t < tr.end; ++t) {
        for (int64_t c = 0; c < index::num_column_tiles(hidden, tile); ++c) {
          const index::Range cols = index::column_tile(c, tile, hidden);
          std::fill(acc.begin(), acc.begin() + cols.size(), 0.0f);
          for (int k = 0; k < top_k; ++k) {
            const int64_t a = index::assignment_id(t, k, top_k);
            const int64_t r = dest[a];
            if (r < 0) continue;
            accumulate_row<T>(acc.data(), y.row(r) + cols.begin * es, cols.size(), w.at(a));
          }
          store_row<T>(out.row(t) + cols.begin * es, acc.data(), cols.size());
        }
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
      for (int64_t t = tr.begin; t < tr.end; ++t) {
        for (int k = 0; k < top_k; ++k) {
          const int64_t a = index::assignment_id(t, k, top_k);
          const int64_t r = dest[a];
          out.store(a, r < 0 ? 0.0f : dot_row<T>(y.row(r), g.row(t), g.cols));
        }
      }
    });
  });
}

void gather_rows(const RowsRef& src, const int32_t* map, Scale s, bool scale_by_source, const RowsRef& out,
                 int64_t rows, int threads) {
  const int64_t row_bytes = out.row_bytes();
  const int workers = workers_for(threads, rows, 2 * row_bytes);
  auto run = [&](auto traits) {
    using T = decltype(traits);
    parallel_run(workers, [&](int wid) {
      const index::Range rr = index::work_range(wid, workers, rows);
      for (int64_t r = rr.begin; r < rr.end; ++r) {
        const int64_t from = map[r];
        if (from < 0) zero_row(out.row(r), row_bytes);
        else if (!s.present()) std::memcpy(out.row(r), src.row(from), static_cast<size_t>(row_bytes));
        else scale_row<T>(out.row(r), src.row(from), out.cols, s.at(scale_by_source ? from : r));
      }
    });
  };
  if (s.present()) with_traits(src.dtype, run);
  else run(F32{});  // moves only: the traits are unused
}

}  // namespace cpu
}  // namespace padmoe
