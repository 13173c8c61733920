// mask_plan_cpu.cpp — a plan from a routing mask [T, E] on the CPU: the column counts, their
// (padded) exclusive sums, then one pass in token order with a running count an expert, so each
// expert's rows follow token order. One thread: the pass is a few operations a map byte.
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "padmoe/index_math.hpp"

namespace padmoe {
namespace cpu {

void mask_plan(const uint8_t* map, int64_t tokens, int64_t experts, int alignment, int64_t rows, bool one_bin,
               int32_t* counts, int32_t* dest_rows, int32_t* row_sources, int64_t sources_len, int32_t* indices,
               int32_t* bin_ids, int32_t* row_id_map) {
  std::vector<int64_t> n(static_cast<size_t>(experts), 0), pstart(n), shift(n), next(n);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < experts; ++e) n[e] += map[t * experts + e] != 0;
  }
  int64_t ustart = 0, padded_start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t padded = index::round_up(n[e], alignment);
    pstart[e] = padded_start;
    shift[e] = padded_start - ustart;
    next[e] = padded_start;
    if (!one_bin) {
      counts[e] = static_cast<int32_t>(n[e]);
      counts[experts + e] = static_cast<int32_t>(ustart + n[e]);
      counts[2 * experts + e] = static_cast<int32_t>(padded);
      counts[3 * experts + e] = static_cast<int32_t>(padded_start + padded);
    }
    ustart += n[e];
    padded_start += padded;
  }
  if (one_bin) {
    const int32_t kept = static_cast<int32_t>(ustart < rows ? ustart : rows);
    counts[0] = kept;
    counts[1] = kept;
    counts[2] = static_cast<int32_t>(rows);
    counts[3] = static_cast<int32_t>(rows);
  }
  for (int64_t r = 0; r < sources_len; ++r) row_sources[r] = -1;
  if (indices != nullptr) {
    for (int64_t i = 0; i < tokens * experts; ++i) indices[i] = bin_ids[i] = -1;
  }
  const int64_t width = 2 * experts + 1;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t a = t * experts + e;
      int64_t d = -1;
      if (map[a] != 0) {
        d = next[e]++;
        if (d >= rows) d = -1;
      }
      dest_rows[a] = static_cast<int32_t>(d);
      if (d >= 0 && d < sources_len) row_sources[d] = static_cast<int32_t>(a);
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
}

}  // namespace cpu
}  // namespace padmoe
