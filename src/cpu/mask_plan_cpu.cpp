// mask_plan_cpu.cpp — a plan from a routing mask [T, E] on the CPU. Each worker owns a contiguous
// range of tokens (docs/spec.md §15): it counts its tokens' pairs per expert (and fills its share
// of the -1 entries), the per-expert starts of every worker follow from those counts in worker
// order, then each worker places its tokens with a running row an expert. Each expert's rows
// therefore follow token order, and every entry has one writer, whatever the worker count.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/thread_pool.hpp"
#include "padmoe/index_math.hpp"

namespace padmoe {
namespace cpu {
namespace {

// Map bytes a worker takes at least: below that a second thread costs more than it saves.
constexpr int64_t kBytesPerWorker = 1 << 16;

void fill(int32_t* p, int64_t n, int worker, int workers) {
  const index::Range r = index::work_range(worker, workers, n);
  std::fill(p + r.begin, p + r.end, -1);
}

}  // namespace

void mask_plan(const uint8_t* map, int64_t tokens, int64_t experts, int alignment, int64_t rows, bool one_bin,
               int32_t* counts, int32_t* dest_rows, int32_t* row_sources, int64_t sources_len, int32_t* indices,
               int32_t* bin_ids, int32_t* row_id_map, const backend::MovedProbs& probs, int threads) {
  const auto* probs_in = static_cast<const unsigned char*>(probs.probs);
  auto* moved = static_cast<unsigned char*>(probs.moved);
  const size_t bytes = static_cast<size_t>(probs.bytes);
  const int64_t pairs = tokens * experts;
  const int workers = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(resolve_threads(threads), std::min(tokens, pairs / kBytesPerWorker))));
  // next[w * E + e]: worker w's count of expert e, then (after the scan) its first row of e
  std::vector<int64_t> next(static_cast<size_t>(workers * experts), 0);
  std::vector<int64_t> shift(static_cast<size_t>(experts), 0);
  parallel_run(workers, [&](int w) {
    const index::Range r = index::work_range(w, workers, tokens);
    int64_t* n = next.data() + w * experts;
    for (int64_t t = r.begin; t < r.end; ++t) {
      const uint8_t* row = map + t * experts;
      for (int64_t e = 0; e < experts; ++e) n[e] += row[e] != 0;
    }
    fill(row_sources, sources_len, w, workers);
    if (probs_in != nullptr) {
      const index::Range z = index::work_range(w, workers, sources_len);
      std::fill(moved + z.begin * bytes, moved + z.end * bytes, static_cast<unsigned char>(0));
    }
    if (indices != nullptr) {
      fill(indices, pairs, w, workers);
      fill(bin_ids, pairs, w, workers);
    }
  });
  int64_t ustart = 0, padded_start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    int64_t n = 0;
    for (int w = 0; w < workers; ++w) {  // the workers' starts inside the expert's rows
      const int64_t c = next[static_cast<size_t>(w * experts + e)];
      next[static_cast<size_t>(w * experts + e)] = padded_start + n;
      n += c;
    }
    const int64_t padded = index::round_up(n, alignment);
    shift[e] = padded_start - ustart;
    if (!one_bin) {
      counts[e] = static_cast<int32_t>(n);
      counts[experts + e] = static_cast<int32_t>(ustart + n);
      counts[2 * experts + e] = static_cast<int32_t>(padded);
      counts[3 * experts + e] = static_cast<int32_t>(padded_start + padded);
    }
    ustart += n;
    padded_start += padded;
  }
  if (one_bin) {
    const int32_t kept = static_cast<int32_t>(ustart < rows ? ustart : rows);
    counts[0] = kept;
    counts[1] = kept;
    counts[2] = static_cast<int32_t>(rows);
    counts[3] = static_cast<int32_t>(rows);
  }
  const int64_t width = 2 * experts + 1;
  parallel_run(workers, [&](int w) {
    const index::Range r = index::work_range(w, workers, tokens);
    int64_t* next_row = next.data() + w * experts;
    for (int64_t t = r.begin; t < r.end; ++t) {
      for (int64_t e = 0; e < experts; ++e) {
        const int64_t a = t * experts + e;
        int64_t d = -1;
        if (map[a] != 0) {
          d = next_row[e]++;
          if (d >= rows) d = -1;
        }
        dest_rows[a] = static_cast<int32_t>(d);
        if (d >= 0 && d < sources_len) {
          row_sources[d] = static_cast<int32_t>(a);
          if (probs_in != nullptr) std::memcpy(moved + d * bytes, probs_in + a * bytes, bytes);
        }
        if (probs.nonzero != nullptr) {
          probs.nonzero[a] = d >= 0 && backend::prob_nonzero(probs_in + a * bytes, probs.bytes) ? 1.0f : 0.0f;
        }
        if (d >= 0 && indices != nullptr) {  // the sorted position: the unpadded row
          indices[d - shift[e]] = static_cast<int32_t>(a);
          bin_ids[d - shift[e]] = static_cast<int32_t>(e);
        }
      }
      if (row_id_map == nullptr) continue;
      int32_t* out = row_id_map + t * width;
      int64_t kept = 0;
      for (int64_t e = experts - 1; e >= 0; --e) {  // descending experts: TE's row_id_map order
        const int64_t d = dest_rows[t * experts + e];
        if (d < 0) continue;
        out[kept] = static_cast<int32_t>(d - shift[e]);
        out[experts + kept] = static_cast<int32_t>(e);
        ++kept;
      }
      for (int64_t p = kept; p < experts; ++p) out[p] = out[experts + p] = -1;
      out[2 * experts] = static_cast<int32_t>(kept);
    }
  });
}

}  // namespace cpu
}  // namespace padmoe
