// index_plan_cpu.cpp — a plan from an index map of unbounded ids on the CPU: the assignments
// stable-sorted by their id read as uint32 (std::stable_sort of the assignment ids, one thread:
// the sort is the whole cost and its order does not depend on a worker count), then one pass
// writing each sorted position's entries.
#include <algorithm>
#include <numeric>
#include <vector>

#include "cpu/cpu_backend.hpp"

namespace padmoe {
namespace cpu {

void index_plan(const int32_t* ids, int64_t assignments, int64_t rows, int32_t* counts, int32_t* dest_rows,
                int32_t* row_sources, int64_t sources_len, int32_t* indices, int32_t* bin_ids, int /*threads*/) {
  std::vector<int32_t> order(static_cast<size_t>(assignments));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [ids](int32_t a, int32_t b) {
    return static_cast<uint32_t>(ids[a]) < static_cast<uint32_t>(ids[b]);
  });
  const int64_t kept = std::min(assignments, rows);
  for (int64_t j = 0; j < assignments; ++j) {
    const int32_t a = order[static_cast<size_t>(j)];
    const bool keep = j < kept;
    dest_rows[a] = keep ? static_cast<int32_t>(j) : -1;
    if (indices != nullptr) {
      indices[j] = keep ? a : -1;
      bin_ids[j] = keep ? 0 : -1;
    }
    if (j < sources_len) row_sources[j] = keep ? a : -1;
  }
  if (sources_len > assignments) std::fill(row_sources + assignments, row_sources + sources_len, -1);
  counts[0] = counts[1] = static_cast<int32_t>(kept);
  counts[2] = counts[3] = static_cast<int32_t>(rows);
}

}  // namespace cpu
}  // namespace padmoe
