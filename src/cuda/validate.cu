// validate.cu — checked mode: the data-dependent properties of docs/spec.md §12
// validated on the GPU. Each kernel records the first violation as one
// 64-bit key, (code << 40) | position, by atomicMin (integer atomics only), so
// the report is deterministic: the lowest code, then the lowest position.
// The host reads the key back (one synchronization) and fetches the
// offending values for the message.
#include "cuda/common.cuh"
#include "cuda/plan_view.cuh"

namespace padmoe {
namespace cuda {
namespace {

constexpr int kPosBits = 40;
using Key = unsigned long long;
constexpr Key kNone = ~Key{0};

__device__ __forceinline__ void report(Key* key, int code, int64_t pos) {
  atomicMin(key, (static_cast<Key>(code) << kPosBits) | static_cast<Key>(pos));
}

template <typename F>
__device__ __forceinline__ void grid_loop(int64_t n, F&& f) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    f(i);
  }
}

__global__ void validate_top_experts_kernel(IndexRef ids, int64_t n, int num_experts, Key* key) {
  pdl_begin();
  grid_loop(n, [&](int64_t a) {
    const int64_t e = load_index(ids, a);
    if (e < 0 || e >= num_experts) report(key, kExpertOutOfRange, a);
  });
}

// Ids in [0, global) (when check_ids) and expert_map entries in [-1, num_experts) (when given).
__global__ void validate_routing_ids_kernel(IndexRef ids, int64_t n, int64_t global, bool check_ids, IndexRef map,
                                            int num_experts, Key* key) {
  pdl_begin();
  grid_loop(n > global ? n : global, [&](int64_t i) {
    if (check_ids && i < n) {
      const int64_t e = load_index(ids, i);
      if (e < 0 || e >= global) report(key, kExpertOutOfRange, i);
    }
    if (map.data != nullptr && i < global) {
      const int64_t l = load_index(map, i);
      if (l < -1 || l >= num_experts) report(key, kExpertMapOutOfRange, i);
    }
  });
}

__global__ void validate_bins_kernel(IndexRef bins, IndexRef padded_bins, int num_experts, int64_t assignments,
                                     int64_t output_rows, Key* key) {
  pdl_begin();
  const DevicePlan<IndexRef> plan{bins, padded_bins, num_experts};
  grid_loop(num_experts, [&](int64_t e) {
    const int64_t b = plan.real_end(e), p = plan.padded_end(e);
    const int64_t bp = plan.real_start(e), pp = plan.padded_start(e);
    if (b < bp) report(key, kBinsDecreasing, e);
    if (p < pp) report(key, kPaddedDecreasing, e);
    if (p - pp < b - bp) report(key, kPaddedTooSmall, e);
    if (e == num_experts - 1) {
      if (b != assignments) report(key, kBinsTotal, 0);
      if (output_rows >= 0 && p > output_rows) report(key, kCapacity, 0);
    }
  });
}

__global__ void validate_sorted_kernel(IndexRef indices, IndexRef bin_ids, IndexRef bins, int num_experts,
                                       int64_t assignments, int* seen, Key* key) {
  pdl_begin();
  const DevicePlan<IndexRef> plan{bins, IndexRef{}, num_experts};
  grid_loop(assignments, [&](int64_t i) {
    const int64_t e = load_index(bin_ids, i);
    if (e < 0 || e >= num_experts || i < plan.real_start(e) || i >= plan.real_end(e)) {
      report(key, kBinIdsInconsistent, i);
    }
    const int64_t a = load_index(indices, i);
    if (a < 0 || a >= assignments) {
      report(key, kIndexOutOfRange, i);
    } else if (atomicExch(seen + a, 1) != 0) {
      report(key, kIndexRepeated, a);
    }
  });
}

__global__ void validate_plan_kernel(const int32_t* dest, const int32_t* sources, const int32_t* padded_bins,
                                     int num_experts, int64_t assignments, int64_t sources_len, int64_t output_rows,
                                     Key* key) {
  pdl_begin();
  const DevicePlan<const int32_t*> plan{nullptr, padded_bins, num_experts, dest, sources};
  const int64_t padded = plan.padded_total();
  if (blockIdx.x == 0 && threadIdx.x == 0 &&
      (padded < 0 || padded > sources_len || (output_rows >= 0 && padded > output_rows))) {
    report(key, kCapacity, 0);
  }
  const int64_t limit = padded < sources_len ? padded : sources_len;
  grid_loop(assignments > limit ? assignments : limit, [&](int64_t i) {
    if (i < assignments) {
      const int64_t r = plan.dest_row(i);
      if (r < -1 || r >= limit || (r >= 0 && plan.row_source(r) != i)) report(key, kPlanDestRows, i);
    }
    if (i < limit) {
      const int64_t a = plan.row_source(i);
      if (a < -1 || a >= assignments || (a >= 0 && plan.dest_row(a) != i)) report(key, kPlanRowSources, i);
    }
  });
}

__global__ void validate_counts_kernel(IndexRef counts, int num_experts, int alignment, unsigned long long* sums,
                                       Key* key) {
  pdl_begin();
  grid_loop(num_experts, [&](int64_t e) {
    const int64_t n = load_index(counts, e);
    if (n < 0) {
      report(key, kCountNegative, e);
      return;
    }
    atomicAdd(sums, static_cast<unsigned long long>(n));
    atomicAdd(sums + 1, static_cast<unsigned long long>(index::round_up(n, alignment)));
  });
}

__global__ void validate_count_range_kernel(IndexRef counts, int64_t n, int64_t limit, Key* key) {
  pdl_begin();
  grid_loop(n, [&](int64_t e) {
    const int64_t v = load_index(counts, e);
    if (v < 0 || v > limit) report(key, kCountOutOfRange, e);
  });
}

__global__ void validate_map_kernel(IndexRef map, int64_t map_len, int64_t original_size, int* seen, Key* key) {
  pdl_begin();
  grid_loop(map_len, [&](int64_t p) {
    const int64_t n = load_index(map, p);
    if (n < -1 || n >= original_size) report(key, kMapOutOfRange, p);
    else if (n >= 0 && atomicExch(seen + n, 1) != 0) report(key, kMapRepeated, n);
  });
}

// Workspace layout: [Key key][2 x u64 sums][int seen[entries]].
struct Layout {
  Key* key;
  unsigned long long* sums;
  int* seen;
};
Layout layout(void* workspace) {
  char* base = static_cast<char*>(workspace);
  return Layout{reinterpret_cast<Key*>(base), reinterpret_cast<unsigned long long*>(base + 8),
                reinterpret_cast<int*>(base + 64)};
}

void begin(const Layout& l, int64_t seen_entries, cudaStream_t s) {
  PADMOE_CUDA_CHECK(cudaMemsetAsync(l.key, 0xff, sizeof(Key), s));
  PADMOE_CUDA_CHECK(cudaMemsetAsync(l.sums, 0, 2 * sizeof(unsigned long long), s));
  if (seen_entries > 0) PADMOE_CUDA_CHECK(cudaMemsetAsync(l.seen, 0, static_cast<size_t>(seen_entries) * 4, s));
}

Violation finish(const Layout& l, cudaStream_t s) {
  Key key = kNone;
  PADMOE_CUDA_CHECK(cudaMemcpyAsync(&key, l.key, sizeof(Key), cudaMemcpyDeviceToHost, s));
  PADMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  Violation v;
  if (key == kNone) return v;
  v.code = static_cast<int>(key >> kPosBits);
  v.pos = static_cast<int64_t>(key & ((Key{1} << kPosBits) - 1));
  return v;
}

int64_t read_index(IndexRef r, int64_t i, cudaStream_t s) {
  int64_t v = 0;
  if (r.wide) {
    PADMOE_CUDA_CHECK(cudaMemcpyAsync(&v, static_cast<const int64_t*>(r.data) + i, 8, cudaMemcpyDeviceToHost, s));
  } else {
    int32_t n = 0;
    PADMOE_CUDA_CHECK(cudaMemcpyAsync(&n, static_cast<const int32_t*>(r.data) + i, 4, cudaMemcpyDeviceToHost, s));
    PADMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    return n;
  }
  PADMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}

int blocks_for(int64_t n) { return grid_for(n, 256, 2048); }

}  // namespace

Violation validate_top_experts(IndexRef ids, int64_t assignments, int num_experts, void* workspace, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const Layout l = layout(workspace);
  begin(l, 0, s);
  if (assignments > 0)
    launch_kernel("validate_top_experts_kernel", validate_top_experts_kernel, blocks_for(assignments), 256, 0, s, ids,
                  assignments, num_experts, l.key);
  Violation v = finish(l, s);
  if (v.code == kExpertOutOfRange) v.v1 = read_index(ids, v.pos, s);
  return v;
}

Violation validate_sorted_routing(IndexRef indices, IndexRef bin_ids, IndexRef bins, IndexRef padded_bins,
                                  int64_t assignments, int num_experts, int64_t output_rows, void* workspace,
                                  void* stream) {
  const cudaStream_t s = as_stream(stream);
  const Layout l = layout(workspace);
  begin(l, assignments, s);
  if (num_experts > 0) {
    launch_kernel("validate_bins_kernel", validate_bins_kernel, blocks_for(num_experts), 256, 0, s, bins, padded_bins,
                  num_experts, assignments, output_rows, l.key);
  }
  if (assignments > 0 && num_experts > 0) {
    launch_kernel("validate_sorted_kernel", validate_sorted_kernel, blocks_for(assignments), 256, 0, s, indices,
                  bin_ids, bins, num_experts, assignments, l.seen, l.key);
  }
  Violation v = finish(l, s);
  const int64_t e = v.pos;
  switch (v.code) {
    case kBinsDecreasing:
      v.v1 = read_index(bins, e, s);
      v.v2 = read_index(bins, e - 1, s);
      break;
    case kPaddedDecreasing:
      v.v1 = read_index(padded_bins, e, s);
      v.v2 = read_index(padded_bins, e - 1, s);
      break;
    case kPaddedTooSmall:
      v.v1 = read_index(padded_bins, e, s) - (e == 0 ? 0 : read_index(padded_bins, e - 1, s));
      v.v2 = read_index(bins, e, s) - (e == 0 ? 0 : read_index(bins, e - 1, s));
      break;
    case kBinsTotal: v.v1 = read_index(bins, num_experts - 1, s); break;
    case kCapacity:
      v.v1 = read_index(padded_bins, num_experts - 1, s);
      v.v2 = output_rows;
      break;
    case kBinIdsInconsistent: v.v1 = read_index(bin_ids, v.pos, s); break;
    case kIndexOutOfRange: v.v1 = read_index(indices, v.pos, s); break;
    default: break;
  }
  return v;
}

Violation validate_routing_ids(IndexRef ids, int64_t assignments, int64_t global, bool check_ids, IndexRef map,
                               int num_experts, void* workspace, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const Layout l = layout(workspace);
  begin(l, 0, s);
  const int64_t work = map.data != nullptr && global > assignments ? global : assignments;
  if (work > 0) {
    launch_kernel("validate_routing_ids_kernel", validate_routing_ids_kernel, blocks_for(work), 256, 0, s, ids,
                  assignments, global, check_ids, map, num_experts, l.key);
  }
  Violation v = finish(l, s);
  if (v.code == kExpertOutOfRange) v.v1 = read_index(ids, v.pos, s);
  if (v.code == kExpertMapOutOfRange) v.v1 = read_index(map, v.pos, s);
  return v;
}

Violation validate_plan(const PlanView& plan, int64_t output_rows, void* workspace, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const Layout l = layout(workspace);
  begin(l, 0, s);
  const int64_t assignments = plan.num_tokens * plan.top_k;
  const int64_t sources_len = plan.row_sources.shape[0];
  const int64_t work = assignments > sources_len ? assignments : sources_len;
  launch_kernel("validate_plan_kernel", validate_plan_kernel, blocks_for(work), 256, 0, s,
                plan.dest_rows.data_as<const int32_t>(), plan.row_sources.data_as<const int32_t>(),
                plan.padded_bins.data_as<const int32_t>(), plan.num_experts, assignments, sources_len, output_rows,
                l.key);
  Violation v = finish(l, s);
  const IndexRef pb{plan.padded_bins.data, false};
  switch (v.code) {
    case kCapacity:
      v.v1 = plan.num_experts > 0 ? read_index(pb, plan.num_experts - 1, s) : 0;
      v.v2 = output_rows >= 0 && output_rows < sources_len ? output_rows : sources_len;
      break;
    case kPlanDestRows: v.v1 = read_index(IndexRef{plan.dest_rows.data, false}, v.pos, s); break;
    case kPlanRowSources: v.v1 = read_index(IndexRef{plan.row_sources.data, false}, v.pos, s); break;
    default: break;
  }
  return v;
}

Violation validate_counts(IndexRef counts, int num_experts, int alignment, int64_t rows, int64_t output_rows,
                          void* workspace, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const Layout l = layout(workspace);
  begin(l, 0, s);
  if (num_experts > 0)
    launch_kernel("validate_counts_kernel", validate_counts_kernel, blocks_for(num_experts), 256, 0, s, counts,
                  num_experts, alignment, l.sums, l.key);
  Violation v = finish(l, s);
  if (v.code == kCountNegative) {
    v.v1 = read_index(counts, v.pos, s);
    return v;
  }
  unsigned long long sums[2] = {0, 0};
  PADMOE_CUDA_CHECK(cudaMemcpyAsync(sums, l.sums, sizeof(sums), cudaMemcpyDeviceToHost, s));
  PADMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  if (static_cast<int64_t>(sums[0]) > rows) return Violation{kCountTotal, 0, static_cast<int64_t>(sums[0]), rows};
  if (output_rows >= 0 && static_cast<int64_t>(sums[1]) > output_rows) {
    return Violation{kCapacity, 0, static_cast<int64_t>(sums[1]), output_rows};
  }
  return v;
}

Violation validate_map(IndexRef map, int64_t map_len, int64_t original_size, void* workspace, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const Layout l = layout(workspace);
  begin(l, original_size, s);
  if (map_len > 0)
    launch_kernel("validate_map_kernel", validate_map_kernel, blocks_for(map_len), 256, 0, s, map, map_len,
                  original_size, l.seen, l.key);
  Violation v = finish(l, s);
  if (v.code == kMapOutOfRange) v.v1 = read_index(map, v.pos, s);
  if (v.code == kMapRepeated) v.v1 = v.pos;
  return v;
}

Violation validate_count_range(IndexRef counts, int64_t num_experts, int64_t limit, void* workspace, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const Layout l = layout(workspace);
  begin(l, 0, s);
  if (num_experts > 0) {
    launch_kernel("validate_count_range_kernel", validate_count_range_kernel, blocks_for(num_experts), 256, 0, s,
                  counts, num_experts, limit, l.key);
  }
  Violation v = finish(l, s);
  if (v.code == kCountOutOfRange) v.v1 = read_index(counts, v.pos, s);
  return v;
}

}  // namespace cuda
}  // namespace padmoe
