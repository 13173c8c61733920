// layouts_cpu.cpp — vLLM's batched block layout (batched_moe_align_block_size)
// on the CPU. Each worker owns a contiguous range of blocks
// (index::work_range), finds the expert holding its first block by binary
// search over the padded ends and walks forward, so the output is the same
// for any thread count.
#include "cpu/cpu_backend.hpp"
#include "cpu/thread_pool.hpp"
#include "padmoe/index_math.hpp"

namespace padmoe {
namespace cpu {

void batched_align_blocks(const void* counts, bool wide, const int32_t* ends, int64_t num_experts, int max_tokens,
                          int block_size, int64_t entries, int32_t* sorted_ids, int32_t* block_ids, int threads) {
  const int64_t blocks = entries / block_size;
  const int64_t sentinel = num_experts * max_tokens;
  auto count = [&](int64_t e) {
    return wide ? static_cast<const int64_t*>(counts)[e] : static_cast<int64_t>(static_cast<const int32_t*>(counts)[e]);
  };
  const int workers = workers_for(threads, blocks, int64_t{block_size} * 4);
  parallel_run(workers, [&](int w) {
    const index::Range r = index::work_range(w, workers, blocks);
    if (r.begin >= r.end) return;
    int64_t e = index::find_segment(ends, num_experts, r.begin * block_size);
    for (int64_t b = r.begin; b < r.end; ++b) {
      const int64_t first = b * block_size;
      while (e < num_experts && first >= ends[e]) ++e;
      int32_t* out = sorted_ids + first;
      if (e == num_experts) {  // past the runs
        block_ids[b] = -1;
        for (int j = 0; j < block_size; ++j) out[j] = static_cast<int32_t>(sentinel);
        continue;
      }
      block_ids[b] = static_cast<int32_t>(e);
      const int64_t offset = first - index::segment_start(ends, e);  // the block's first row within e's run
      const int64_t live = count(e) - offset;  // real rows in the block (may pass block_size)
      const int64_t row = e * max_tokens + offset;
      for (int j = 0; j < block_size; ++j) out[j] = static_cast<int32_t>(j < live ? row + j : sentinel);
    }
  });
}

}  // namespace cpu
}  // namespace padmoe
