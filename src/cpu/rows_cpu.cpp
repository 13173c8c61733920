// rows_cpu.cpp — the CPU row kernels: spread (dispatch), reduce (combine),
// dots (wgrad) and gather-by-map (pad / unpad), over the thread pool; the per-row loops are in
// row_loops_cpu.hpp. Float math is float32; a row without a scale is moved with memcpy, bit for
// bit.
#include "cpu/row_loops_cpu.hpp"

namespace padmoe {
namespace cpu {}  // namespace cpu

namespace backend {

// The shared argument types' host members (core/backend_types.hpp).
float Scale::at(int64_t i) const { return data == nullptr ? 1.0f : numeric::load_as_float(data, dtype, i); }

void FloatOut::store(int64_t i, float v) const { numeric::store_from_float(data, dtype, i, v); }

void ScaleRows::copy(int64_t to, int64_t from) const {
  const int64_t bytes = cols * elem;
  if (bytes > 0)
    std::memcpy(static_cast<char*>(dst) + to * bytes, static_cast<const char*>(src) + from * bytes,
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

}  // namespace backend

namespace cpu {

int workers_for(int threads, int64_t items, int64_t bytes_per_item) {
  constexpr int64_t kMinBytesPerWorker = 256 * 1024;
  const int64_t total = items * std::max<int64_t>(1, bytes_per_item);
  const int64_t by_size = std::max<int64_t>(1, total / kMinBytesPerWorker);
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>({int64_t{resolve_threads(threads)}, by_size, std::max<int64_t>(1, items)})));
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
    dot_rows_any<T>(rows, n, b, cols, vals);
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
    if (end > begin)
      copy_row(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, end - begin, mode);
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
        // bf16 with AVX2: x[t] tested for Inf / NaN once for its K scaled copies.
        int finite = -1;
#if defined(PADMOE_AVX2_SUMS)
        if (std::is_same<T, BF16>::value && w.present() && use_avx2()) finite = bf16_finite_avx2(src, x.cols);
#endif
        for (int k = 0; k < top_k; ++k) {
          const int64_t a = index::assignment_id(t, k, top_k);
          const int64_t r = dest[a];
          if (r < 0) continue;
          if (w.present()) scale_row_to<T>(y.row(r), src, x.cols, w.at(a), mode, finite);
          else copy_row(y.row(r), src, row_bytes, mode);
          if (scales != nullptr) scales->copy(r, t);  // the row's scales, by the same worker
        }
        if (dots_with != nullptr) {
#if defined(PADMOE_AVX2_SUMS)
          if (std::is_same<T, BF16>::value && use_avx2() && t + 1 < tr.end) {
            prefetch_token_rows(*dots_with, dest, t + 1, top_k);
          }
#endif
          token_dots<T>(*dots_with, dest, t, top_k, src, x.cols, dots);
        }
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
                 int threads, const RowsRef* dots_with, FloatOut dots) {
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
      const bool avx2 = use_avx2();
      const bool fused = std::is_same<T, BF16>::value && avx2 && dots_with != nullptr;
      // the fused kernel's buffers
      std::vector<float> lanes(fused ? static_cast<size_t>(top_k) * kLanes : 0);
      std::vector<float> dot_lanes(fused ? static_cast<size_t>(top_k) * kLanes : 0);
      std::vector<float> vals(fused ? static_cast<size_t>(top_k) : 0);
      std::vector<int64_t> ids(fused ? static_cast<size_t>(top_k) : 0);
#endif
      const index::Range tr = index::work_range(wid, workers, tokens);
      for (int64_t t = tr.begin; t < tr.end; ++t) {
#if defined(PADMOE_AVX2_SUMS)
        if (avx2 && t + 1 < tr.end) prefetch_token_rows(y, dest, t + 1, top_k);
#endif
        int n = 0;  // this token's live assignments, ascending k
        for (int k = 0; k < top_k; ++k) {
          const int64_t a = index::assignment_id(t, k, top_k);
          if (dest[a] < 0) continue;
          rows[n] = y.row(dest[a]);
          weights[n++] = w.at(a);
        }
        // Small column tiles keep the K source rows streaming side by side.
#if defined(PADMOE_AVX2_SUMS)
        if (fused) {  // the sums and the dots in one pass over the K rows
          int q = 0;
          for (int k = 0; k < top_k; ++k) {
            const int64_t a = index::assignment_id(t, k, top_k);
            if (dest[a] < 0) dots.store(a, 0.0f);
            else ids[q++] = a;
          }
          auto* dl = reinterpret_cast<float (*)[kLanes]>(dot_lanes.data());
          reduce_dots_token_bf16_avx2(out.row(t), rows.data(), weights.data(), n, hidden, tile, acc.data(),
                                      dots_with->row(t), lanes.data(), dot_lanes.data());
          finish_dots(dl, n, rows.data(), dots_with->row(t), hidden & ~int64_t{63}, hidden, vals.data());
          for (q = 0; q < n; ++q) dots.store(ids[q], vals[q]);
          continue;
        }
        if (std::is_same<T, BF16>::value && avx2) {
          reduce_token_bf16_avx2(out.row(t), rows.data(), weights.data(), n, hidden, tile, acc.data());
        } else
#endif
        {
          reduce_token_generic<T>(out.row(t), rows.data(), weights.data(), n, 0, hidden, tile, acc.data());
        }
        // The weight gradients of the same token while its K rows are still in cache.
        if (dots_with != nullptr) token_dots<T>(y, dest, t, top_k, dots_with->row(t), hidden, dots);
      }
    });
  });
}

void row_dots(const RowsRef& y, const RowsRef& g, int top_k, const int32_t* dest, int64_t assignments, FloatOut out,
              int threads) {
  const int64_t tokens = assignments / top_k;
  const int workers = workers_for(threads, tokens, (top_k + 1) * g.row_bytes());
  with_traits(y.dtype, [&](auto traits) {
    using T = decltype(traits);
    parallel_run(workers, [&](int wid) {
#if defined(PADMOE_AVX2_SUMS)
      const bool avx2 = std::is_same<T, BF16>::value && use_avx2();
#endif
      const index::Range tr = index::work_range(wid, workers, tokens);
      for (int64_t t = tr.begin; t < tr.end; ++t) {
#if defined(PADMOE_AVX2_SUMS)
        if (avx2 && t + 1 < tr.end) prefetch_token_rows(y, dest, t + 1, top_k);
#endif
        token_dots<T>(y, dest, t, top_k, g.row(t), g.cols, out);
      }
    });
  });
}

void gather_rows(const RowsRef& src, const int32_t* map, Scale s, bool scale_by_source, const RowsRef& out,
                 int64_t rows, int threads, bool skip_unmapped, const ScaleRows* scales, const GatherDots* dots) {
  const int64_t row_bytes = out.row_bytes();
  const int workers = workers_for(threads, rows, 2 * row_bytes);
  const Store mode = store_mode(rows * row_bytes);
  auto run = [&](auto traits) {
    using T = decltype(traits);
    parallel_run(workers, [&](int wid) {
#if defined(PADMOE_AVX2_SUMS)
      const bool warm = std::is_same<T, BF16>::value && use_avx2();
      const int64_t head = std::min(kPrefetch, row_bytes);
#endif
      const index::Range rr = index::work_range(wid, workers, rows);
      for (int64_t r = rr.begin; r < rr.end; ++r) {
        const int64_t from = map[r];
#if defined(PADMOE_AVX2_SUMS)
        if (warm) {  // the next row's source, and this row's dot partner, start warm
          if (r + 1 < rr.end && map[r + 1] >= 0) prefetch_bytes(src.row(map[r + 1]), head);
          if (dots != nullptr && from >= 0) prefetch_bytes(dots->with.row(r), head);
        }
#endif
        if (from < 0) {
          if (!skip_unmapped) zero_row(out.row(r), row_bytes, mode);
        } else if (!s.present()) copy_row(out.row(r), src.row(from), row_bytes, mode);
        else scale_row_to<T>(out.row(r), src.row(from), out.cols, s.at(scale_by_source ? from : r), mode);
        if (scales != nullptr) {  // the row's scales, by the same worker
          if (from >= 0) scales->copy(r, from);
          else if (!skip_unmapped) scales->fill_one(r);
        }
        if (dots != nullptr && from >= 0) {  // the source row was just read: still in cache
          float v = 0.0f;
          const char* a = dots->with.row(r);
          dot_rows_any<T>(&a, 1, src.row(from), src.cols, &v);
          dots->out.store(from, v);
        }
      }
      if (dots != nullptr) {  // this worker's share of the rows no map entry names
        const index::Range nr = index::work_range(wid, workers, dots->count);
        for (int64_t n = nr.begin; n < nr.end; ++n) {
          if (dots->inverse[n] < 0) dots->out.store(n, 0.0f);
        }
      }
      store_fence();
    });
  };
  if (s.present() || dots != nullptr) with_traits(src.dtype, run);
  else run(F32{});  // moves only: the traits are unused
}

}  // namespace cpu
}  // namespace padmoe
