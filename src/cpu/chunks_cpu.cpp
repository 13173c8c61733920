// chunks_cpu.cpp — sort_chunks' row map on the CPU. Each worker owns a
// contiguous range of padded rows (index::work_range), finds the output
// position holding its first row by binary search and walks forward, so the
// map is the same for any thread count. The rows then move with gather_rows.
#include <algorithm>

#include "cpu/cpu_backend.hpp"
#include "cpu/thread_pool.hpp"
#include "padmoe/index_math.hpp"

namespace padmoe {
namespace cpu {

void chunk_map(const int64_t* row_begin, const int64_t* src_begin, const int64_t* size, int64_t num_chunks,
               int64_t padded_rows, int32_t* map, int64_t map_len, int threads) {
  const int workers = workers_for(threads, map_len, 64);
  parallel_run(workers, [&](int w) {
    const index::Range r = index::work_range(w, workers, map_len);
    if (r.begin >= r.end) return;
    // j: the last position with row_begin[j] <= p (or -1 before the first).
    int64_t j = (std::upper_bound(row_begin, row_begin + num_chunks, r.begin) - row_begin) - 1;
    for (int64_t p = r.begin; p < r.end; ++p) {
      if (p >= padded_rows) {
        map[p] = -1;
        continue;
      }
      while (j + 1 < num_chunks && row_begin[j + 1] <= p) ++j;
      const int64_t local = j < 0 ? -1 : p - row_begin[j];
      map[p] = local >= 0 && local < size[j] ? static_cast<int32_t>(src_begin[j] + local) : -1;
    }
  });
}

}  // namespace cpu
}  // namespace padmoe
