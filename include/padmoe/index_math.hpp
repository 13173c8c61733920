// padmoe/index_math.hpp — the one place the routing index math is written.
//
// Every function is branch-light, allocation-free and callable from both the
// CPU backend and CUDA kernels (PADMOE_HD). All offsets are 64-bit: row * H
// overflows 32 bits at real sizes (T*K = 131072 rows of H = 7168 is 9.4e8
// elements; a few such buffers pass 2^31 bytes).
//
// Terms (see docs/spec.md §1): T tokens, K top_k, E experts, A = T*K assignments,
// assignment id a = t*K + k, m the alignment, P = padded_bins[E-1].
//
//   real_start(e)   = e == 0 ? 0 : bins[e-1]
//   padded_start(e) = e == 0 ? 0 : padded_bins[e-1]
//   sorted position i of expert e lands in padded row
//       padded_start(e) + (i - real_start(e))
//   its token is indices[i] / K
#pragma once

#include <cstdint>

#include "padmoe/config.hpp"

namespace padmoe {
namespace index {

// ceil(a / b) for a >= 0, b >= 1.
PADMOE_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Smallest multiple of m that is >= x (x >= 0, m >= 1); 0 stays 0.
PADMOE_HD int64_t round_up(int64_t x, int64_t m) { return ceil_div(x, m) * m; }

// Host-side bound on the padded row count P: every expert wastes at most
// m - 1 rows. Lets a caller size outputs without reading P from the device.
PADMOE_HD int64_t padded_rows_bound(int64_t assignments, int64_t num_experts, int64_t alignment) {
  return assignments + num_experts * (alignment - 1);
}
// Deprecated name of padded_rows_bound (removed in the next release).
[[deprecated("use padded_rows_bound")]] PADMOE_HD int64_t capacity_bound(int64_t assignments, int64_t num_experts,
                                                                         int64_t alignment) {
  return padded_rows_bound(assignments, num_experts, alignment);
}

// Start of segment e given the inclusive cumulative sums `cumsum[0..E)`.
template <typename I>
PADMOE_HD int64_t segment_start(const I* cumsum, int64_t e) {
  return e == 0 ? int64_t{0} : static_cast<int64_t>(cumsum[e - 1]);
}

// Padded row of sorted position i, which belongs to an expert whose real
// segment starts at real_start and padded segment at padded_start.
PADMOE_HD int64_t padded_row(int64_t i, int64_t real_start, int64_t padded_start) {
  return padded_start + (i - real_start);
}

// Padded row of sorted position i of expert e, from the two cumsum arrays.
template <typename I>
PADMOE_HD int64_t padded_row_of(const I* bins, const I* padded_bins, int64_t e, int64_t i) {
  return padded_row(i, segment_start(bins, e), segment_start(padded_bins, e));
}

PADMOE_HD int64_t token_of(int64_t assignment, int64_t top_k) { return assignment / top_k; }
PADMOE_HD int64_t assignment_id(int64_t token, int64_t k, int64_t top_k) { return token * top_k + k; }

// The segment that holds position pos: the first e with cumsum[e] > pos
// (upper bound over inclusive cumulative sums, so empty segments are
// skipped). Returns n when pos >= cumsum[n-1].
template <typename I>
PADMOE_HD int64_t find_segment(const I* cumsum, int64_t n, int64_t pos) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (static_cast<int64_t>(cumsum[mid]) > pos) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// Global expert id -> the plan's local expert, or -1 (dropped): docs/spec.md
// §4's expert parallelism. Ids outside [0, global) are dropped (the API layer
// rejects them first unless the caller asked to drop them). With a map:
// local = map[e] (an entry outside [0, local_experts) drops); without one the
// local range: local = e - first inside [first, first + local_experts).
// Default-constructed with global = local_experts = E: the identity on [0, E).
struct ExpertRemap {
  const void* map = nullptr;  // [global] int32 or int64, or null
  bool map_wide = false;
  int64_t global = 0;
  int64_t first = 0;
  int64_t local_experts = 0;
  PADMOE_HD int64_t local(int64_t e) const {  // unsigned compares: one for each range test
    if (static_cast<uint64_t>(e) >= static_cast<uint64_t>(global)) return -1;
    const int64_t l = map == nullptr ? e - first
                      : map_wide     ? static_cast<const int64_t*>(map)[e]
                                     : static_cast<int64_t>(static_cast<const int32_t*>(map)[e]);
    return static_cast<uint64_t>(l) < static_cast<uint64_t>(local_experts) ? l : -1;
  }
};

// A half-open range [begin, end).
struct Range {
  int64_t begin;
  int64_t end;
  PADMOE_HD int64_t size() const { return end > begin ? end - begin : 0; }
};

// docs/spec.md §15 work partition: program pid of `programs` owns the
// contiguous range [pid*B, min((pid+1)*B, total)), B = ceil(total/programs).
// Trailing programs may own an empty range.
PADMOE_HD Range work_range(int64_t pid, int64_t programs, int64_t total) {
  const int64_t b = ceil_div(total, programs);
  int64_t begin = pid * b;
  int64_t end = begin + b;
  if (begin > total) begin = total;
  if (end > total) end = total;
  return Range{begin, end};
}

// Column tiles of width block_x over a row of h elements; the last may be
// shorter (the tail tile).
PADMOE_HD int64_t num_column_tiles(int64_t h, int64_t block_x) { return ceil_div(h, block_x); }
PADMOE_HD Range column_tile(int64_t tile, int64_t block_x, int64_t h) {
  const int64_t begin = tile * block_x;
  const int64_t end = begin + block_x < h ? begin + block_x : h;
  return Range{begin, end};
}

}  // namespace index
}  // namespace padmoe
