// plan_cpu.cpp — make_plan on the CPU: a stable counting sort by expert.
//
// 1. Each worker histograms its contiguous range of assignment ids.
// 2. The exclusive offsets of (expert, worker) pairs in that order make the
//    sort stable: worker w's assignments of expert e follow every earlier
//    worker's, and each worker visits its range in ascending order.
// 3. Each worker scatters its range into indices / bin_ids / dest_rows /
//    row_sources; padding rows and rows at or past P get -1 (padding_source)
//    from the same pass, and the optional layouts (row_experts, block_experts,
//    padded_total) are written beside them.
#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/thread_pool.hpp"
#include "padmoe/index_math.hpp"

namespace padmoe {
namespace cpu {

namespace {

// Worker w's share of the entries no kept assignment fills: sorted positions [kept, A) get -1,
// row_sources / row_experts at or past P the padding source / -1, blocks at or past P / m -1.
void fill_plan_tails(int w, int workers, int64_t kept, int64_t a_count, int32_t* indices, int32_t* bin_ids,
                     int64_t padded_total, int64_t row_capacity, int32_t* row_sources, int32_t padding_source,
                     int32_t* row_experts, int32_t* block_experts, int64_t blocks, int alignment) {
  const index::Range pr = index::work_range(w, workers, a_count - kept);
  for (int64_t i = kept + pr.begin; i < kept + pr.end; ++i) {
    indices[i] = -1;
    bin_ids[i] = -1;
  }
  const index::Range tail = index::work_range(w, workers, row_capacity - padded_total);
  for (int64_t p = padded_total + tail.begin; p < padded_total + tail.end; ++p) {
    row_sources[p] = padding_source;
    if (row_experts != nullptr) row_experts[p] = -1;
  }
  if (block_experts != nullptr) {
    const int64_t first = padded_total / alignment;
    const index::Range bt = index::work_range(w, workers, blocks - first);
    for (int64_t b = first + bt.begin; b < first + bt.end; ++b) block_experts[b] = -1;
  }
}

}  // namespace

void make_plan(const void* top_experts, bool wide, int64_t num_tokens, int top_k, int num_experts, int alignment,
               const PlanView& out, const PlanLayouts& layouts, int32_t padding_source, const index::ExpertRemap& remap,
               int threads) {
  const int64_t a_count = num_tokens * top_k;
  const int64_t experts = num_experts;
  auto expert_of = [&](int64_t a) -> int64_t {  // the plan's expert, or -1: dropped
    return remap.local(wide ? static_cast<const int64_t*>(top_experts)[a]
                            : static_cast<const int32_t*>(top_experts)[a]);
  };
  const int workers =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(resolve_threads(threads), a_count / 16384)));

  // 1. Per-worker histograms.
  std::vector<int64_t> counts(static_cast<size_t>(workers * experts), 0);
  parallel_run(workers, [&](int w) {
    int64_t* mine = counts.data() + w * experts;
    const index::Range r = index::work_range(w, workers, a_count);
    for (int64_t a = r.begin; a < r.end; ++a) {
      const int64_t e = expert_of(a);
      if (e >= 0) ++mine[e];
    }
  });

  // 2. Counts, cumulative sums and per-(worker, expert) write offsets.
  int32_t* tokens_per_expert = out.tokens_per_expert.data_as<int32_t>();
  int32_t* bins = out.bins.data_as<int32_t>();
  int32_t* padded_tokens = out.padded_tokens_per_expert.data_as<int32_t>();
  int32_t* padded_bins = out.padded_bins.data_as<int32_t>();
  std::vector<int64_t> offsets(counts.size());
  int64_t real_total = 0, padded_total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    int64_t count = 0;
    for (int w = 0; w < workers; ++w) {
      offsets[w * experts + e] = real_total + count;
      count += counts[w * experts + e];
    }
    const int64_t padded = index::round_up(count, alignment);
    real_total += count;
    padded_total += padded;
    tokens_per_expert[e] = static_cast<int32_t>(count);
    bins[e] = static_cast<int32_t>(real_total);
    padded_tokens[e] = static_cast<int32_t>(padded);
    padded_bins[e] = static_cast<int32_t>(padded_total);
  }

  // 3. Scatter, padding and tail rows.
  int32_t* indices = out.indices.data_as<int32_t>();
  int32_t* bin_ids = out.bin_ids.data_as<int32_t>();
  int32_t* dest_rows = out.dest_rows.data_as<int32_t>();
  int32_t* row_sources = out.row_sources.data_as<int32_t>();
  const int64_t row_capacity = out.row_sources.shape[0];
  int32_t* row_experts = layouts.row_experts.data_as<int32_t>();      // optional
  int32_t* block_experts = layouts.block_experts.data_as<int32_t>();  // optional
  const int64_t blocks = layouts.block_experts.numel();
  if (layouts.padded_total.data != nullptr)
    layouts.padded_total.data_as<int32_t>()[0] = static_cast<int32_t>(padded_total);
  parallel_run(workers, [&](int w) {
    int64_t* next = offsets.data() + w * experts;
    const index::Range r = index::work_range(w, workers, a_count);
    for (int64_t a = r.begin; a < r.end; ++a) {
      const int64_t e = expert_of(a);
      if (e < 0) {
        dest_rows[a] = -1;
        continue;
      }
      const int64_t pos = next[e]++;
      const int64_t row = index::padded_row(pos, index::segment_start(bins, e), index::segment_start(padded_bins, e));
      indices[pos] = static_cast<int32_t>(a);
      bin_ids[pos] = static_cast<int32_t>(e);
      dest_rows[a] = static_cast<int32_t>(row);
      row_sources[row] = static_cast<int32_t>(a);
      if (row_experts != nullptr) row_experts[row] = static_cast<int32_t>(e);
    }
    const index::Range er = index::work_range(w, workers, experts);
    for (int64_t e = er.begin; e < er.end; ++e) {
      for (int64_t p = index::segment_start(padded_bins, e) + tokens_per_expert[e]; p < padded_bins[e]; ++p) {
        row_sources[p] = padding_source;
        if (row_experts != nullptr) row_experts[p] = -1;
      }
      if (block_experts != nullptr) {  // expert segments are whole blocks of `alignment` rows
        for (int64_t b = index::segment_start(padded_bins, e) / alignment; b < padded_bins[e] / alignment; ++b) {
          block_experts[b] = static_cast<int32_t>(e);
        }
      }
    }
    fill_plan_tails(w, workers, real_total, a_count, indices, bin_ids, padded_total, row_capacity, row_sources,
                    padding_source, row_experts, block_experts, blocks, alignment);
  });
}

namespace {

// Orderable key of a float: larger float, larger key (IEEE totalOrder: -NaN < -inf < -0 < +0 < +inf < +NaN).
uint32_t order_key(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace

void apply_capacity(const PlanView& full, int64_t assignments, int num_experts, Scale probs, int64_t capacity,
                    bool by_probs, int alignment, const PlanView& out, const PlanLayouts& layouts,
                    int32_t padding_source, int32_t* dropped, int threads) {
  const int64_t a_count = assignments;
  const int64_t experts = num_experts;
  const int64_t cap = capacity;
  const int32_t* f_indices = full.indices.data_as<const int32_t>();
  const int32_t* f_counts = full.tokens_per_expert.data_as<const int32_t>();
  const int32_t* f_dest = full.dest_rows.data_as<const int32_t>();
  int32_t* tokens_per_expert = out.tokens_per_expert.data_as<int32_t>();
  int32_t* bins = out.bins.data_as<int32_t>();
  int32_t* padded_tokens = out.padded_tokens_per_expert.data_as<int32_t>();
  int32_t* padded_bins = out.padded_bins.data_as<int32_t>();
  int32_t* indices = out.indices.data_as<int32_t>();
  int32_t* bin_ids = out.bin_ids.data_as<int32_t>();
  int32_t* dest_rows = out.dest_rows.data_as<int32_t>();
  int32_t* row_sources = out.row_sources.data_as<int32_t>();
  int32_t* row_experts = layouts.row_experts.data_as<int32_t>();      // optional
  int32_t* block_experts = layouts.block_experts.data_as<int32_t>();  // optional
  const int64_t row_capacity = out.row_sources.shape[0];
  const int64_t blocks = layouts.block_experts.numel();

  std::vector<int64_t> full_start(static_cast<size_t>(experts)), kept_start(static_cast<size_t>(experts));
  // by_probs: each expert's keys and their selection copy in its own slice of [A] (no allocation
  // inside the workers, whose exceptions the pool cannot carry)
  std::vector<uint32_t> key_space(by_probs ? static_cast<size_t>(2 * a_count) : 0);
  int64_t full_total = 0, kept_total = 0, drops = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = f_counts[e], kept = std::min(n, cap);
    full_start[e] = full_total;
    kept_start[e] = kept_total;
    full_total += n;
    kept_total += kept;
    drops += n - kept;
    tokens_per_expert[e] = static_cast<int32_t>(kept);
    bins[e] = static_cast<int32_t>(kept_total);
    padded_tokens[e] = static_cast<int32_t>(cap);
    padded_bins[e] = static_cast<int32_t>((e + 1) * cap);
  }
  const int64_t padded_total = experts * cap;
  if (dropped != nullptr) *dropped = static_cast<int32_t>(drops);
  if (layouts.padded_total.data != nullptr)
    layouts.padded_total.data_as<int32_t>()[0] = static_cast<int32_t>(padded_total);

  const int workers = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(resolve_threads(threads), std::max<int64_t>(experts, a_count / 16384))));
  parallel_run(workers, [&](int w) {
    const index::Range er = index::work_range(w, workers, experts);
    for (int64_t e = er.begin; e < er.end; ++e) {
      const int32_t* seg = f_indices + full_start[e];
      const int64_t n = f_counts[e];
      // The key slices exist only under the probs policy (key_space is empty otherwise, and an
      // offset from its null data would be undefined behaviour).
      uint32_t* keys = by_probs ? key_space.data() + full_start[e] : nullptr;
      uint32_t* sorted = by_probs ? keys + a_count : nullptr;
      // Kept: key above the threshold, or equal to it and among the first `equal_kept` equal ones.
      uint32_t threshold = 0;
      int64_t equal_kept = n;
      const bool select = by_probs && n > cap;
      if (select) {
        for (int64_t i = 0; i < n; ++i) keys[i] = order_key(probs.at(seg[i]));
        if (cap == 0) {
          equal_kept = 0;
          threshold = 0xffffffffu;
        } else {
          std::copy(keys, keys + n, sorted);
          std::nth_element(sorted, sorted + (cap - 1), sorted + n, std::greater<uint32_t>());
          threshold = sorted[cap - 1];
          int64_t above = 0;
          for (int64_t i = 0; i < n; ++i) above += keys[i] > threshold;
          equal_kept = cap - above;
        }
      }
      int64_t r = 0, equal_seen = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int32_t a = seg[i];
        bool keep = select ? false : i < cap;
        if (select) {
          if (keys[i] > threshold) keep = true;
          else if (keys[i] == threshold) keep = equal_seen++ < equal_kept;
        }
        if (!keep) {
          dest_rows[a] = -1;
          continue;
        }
        const int64_t pos = kept_start[e] + r, row = e * cap + r;
        indices[pos] = a;
        bin_ids[pos] = static_cast<int32_t>(e);
        dest_rows[a] = static_cast<int32_t>(row);
        row_sources[row] = a;
        if (row_experts != nullptr) row_experts[row] = static_cast<int32_t>(e);
        ++r;
      }
      for (int64_t row = e * cap + r; row < (e + 1) * cap; ++row) {
        row_sources[row] = padding_source;
        if (row_experts != nullptr) row_experts[row] = -1;
      }
      if (block_experts != nullptr) {  // segments are whole blocks: alignment divides C
        for (int64_t b = e * cap / alignment; b < (e + 1) * cap / alignment; ++b)
          block_experts[b] = static_cast<int32_t>(e);
      }
    }
    const index::Range ar = index::work_range(w, workers, a_count);
    for (int64_t a = ar.begin; a < ar.end; ++a) {
      if (f_dest[a] < 0) dest_rows[a] = -1;  // dropped before the capacity (not a local expert's)
    }
    fill_plan_tails(w, workers, kept_total, a_count, indices, bin_ids, padded_total, row_capacity, row_sources,
                    padding_source, row_experts, block_experts, blocks, alignment);
  });
}

}  // namespace cpu
}  // namespace padmoe
