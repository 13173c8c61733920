// index_plan.cu — a plan from an index map of unbounded ids on the GPU: the assignments
// stable-sorted by their id read as uint32 (so -1 sorts last), no host synchronization.
//
// Block (A <= kIndexPlanBlockSort, the decode sizes): one launch. Block 0 loads the ids, reduces
// their largest key so the radix sort passes over only the bits in use (ids below 256 and no
// negative one: two passes of four bits instead of eight), sorts (key, assignment) pairs with
// cub::BlockRadixSort (stable) into a striped arrangement and writes each sorted position's
// entries, consecutive positions by consecutive threads; the other blocks fill row_sources past
// A with -1.
//
// Device (more): three launches: the assignment ids (and the -1 fill of row_sources past A);
// cub::DeviceRadixSort::SortPairs over all 32 key bits (the largest key is known only on the
// device); the placement of each sorted position.
//
// Every entry has one writer; a radix sort is stable and its result does not depend on the
// schedule, so the outputs are the same bits run to run.
#include <cub/block/block_load.cuh>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "cuda/common.cuh"

namespace padmoe {
namespace cuda {
namespace {

constexpr int kSortThreads = 512;
constexpr int kSortItems = static_cast<int>(kIndexPlanBlockSort / kSortThreads);  // 8
constexpr int kFillThreads = 256;
constexpr int kFillItems = 8;          // -1 entries a fill thread writes
constexpr int kMaxFillBlocks = 1024;
static_assert(kSortThreads * kSortItems == kIndexPlanBlockSort, "one block sorts kIndexPlanBlockSort keys");

struct Outputs {
  int64_t assignments = 0;
  int64_t rows = 0;
  int64_t kept = 0;
  int32_t* counts = nullptr;
  int32_t* dest_rows = nullptr;
  int32_t* row_sources = nullptr;
  int64_t sources_len = 0;
  int32_t* indices = nullptr;
  int32_t* bin_ids = nullptr;
};

// The entries of sorted position j, holding assignment a.
__device__ __forceinline__ void place(const Outputs& o, int64_t j, int32_t a) {
  const bool keep = j < o.kept;
  o.dest_rows[a] = keep ? static_cast<int32_t>(j) : -1;
  if (o.indices != nullptr) {
    o.indices[j] = keep ? a : -1;
    o.bin_ids[j] = keep ? 0 : -1;
  }
  if (j < o.sources_len) o.row_sources[j] = keep ? a : -1;
}

__device__ __forceinline__ void write_counts(const Outputs& o) {
  o.counts[0] = o.counts[1] = static_cast<int32_t>(o.kept);
  o.counts[2] = o.counts[3] = static_cast<int32_t>(o.rows);
}

// row_sources[A + i] = -1 for i in [0, sources_len - A): block b of `blocks` (from `first`) a stride.
__device__ __forceinline__ void fill_tail(const Outputs& o, int64_t block, int64_t blocks) {
  for (int64_t r = o.assignments + block * blockDim.x + threadIdx.x; r < o.sources_len; r += blocks * blockDim.x) {
    o.row_sources[r] = -1;
  }
}

__global__ void __launch_bounds__(kSortThreads)
    index_block_sort_kernel(const uint32_t* __restrict__ keys_in, Outputs o) {
  pdl_begin();
  if (blockIdx.x > 0) {
    fill_tail(o, blockIdx.x - 1, gridDim.x - 1);
    return;
  }
  using Sort = cub::BlockRadixSort<uint32_t, kSortThreads, kSortItems, int32_t>;
  using Reduce = cub::BlockReduce<uint32_t, kSortThreads>;
  __shared__ union {
    typename Sort::TempStorage sort;
    typename Reduce::TempStorage reduce;
  } storage;
  __shared__ int s_bits;
  const int a_count = static_cast<int>(o.assignments);
  uint32_t keys[kSortItems];
  int32_t vals[kSortItems];
  uint32_t largest = 0;
#pragma unroll
  for (int i = 0; i < kSortItems; ++i) {
    const int a = threadIdx.x * kSortItems + i;  // blocked: thread t holds a run of assignments
    // past A: the largest key, after every real one (equal keys keep their order: the sort is stable)
    keys[i] = a < a_count ? keys_in[a] : 0xffffffffu;
    vals[i] = a;
    if (a < a_count && keys[i] > largest) largest = keys[i];
  }
  largest = Reduce(storage.reduce).Reduce(largest, [](uint32_t x, uint32_t y) { return x > y ? x : y; });
  if (threadIdx.x == 0) s_bits = largest == 0 ? 1 : 32 - __clz(largest);
  __syncthreads();
  const int bits = s_bits;
  // keys past A are 0xffffffff, above every real key in the low `bits` bits only when those bits are
  // all set; clamp them to the largest key in range so they still sort last (stable: after A's keys)
  const uint32_t top = bits >= 32 ? 0xffffffffu : (1u << bits) - 1u;
#pragma unroll
  for (int i = 0; i < kSortItems; ++i) {
    if (vals[i] >= a_count) keys[i] = top;
  }
  Sort(storage.sort).SortBlockedToStriped(keys, vals, 0, bits);
#pragma unroll
  for (int i = 0; i < kSortItems; ++i) {
    const int j = i * kSortThreads + threadIdx.x;  // striped: consecutive positions, consecutive threads
    if (j < a_count) place(o, j, vals[i]);
  }
  if (threadIdx.x == 0) write_counts(o);
}

__global__ void __launch_bounds__(kFillThreads) index_iota_kernel(int32_t* __restrict__ ids_out, Outputs o) {
  pdl_begin();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t a = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; a < o.assignments; a += stride) {
    ids_out[a] = static_cast<int32_t>(a);
  }
  fill_tail(o, blockIdx.x, gridDim.x);
}

__global__ void __launch_bounds__(kFillThreads) index_place_kernel(const int32_t* __restrict__ sorted, Outputs o) {
  pdl_begin();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < o.assignments; j += stride) {
    place(o, j, sorted[j]);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) write_counts(o);
}

constexpr size_t kAlign = 256;
size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

size_t sort_temp_bytes(int64_t assignments) {
  size_t bytes = 0;
  PADMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(assignments)));
  return bytes;
}


}  // namespace

size_t index_plan_workspace_bytes(int64_t assignments) {
  if (assignments <= kIndexPlanBlockSort) return 0;
  // sorted keys, assignment ids, sorted assignment ids, then cub's scratch
  return 3 * aligned(sizeof(int32_t) * static_cast<size_t>(assignments)) + sort_temp_bytes(assignments);
}

void index_plan(const int32_t* ids, int64_t assignments, int64_t rows, int32_t* counts, int32_t* dest_rows,
                int32_t* row_sources, int64_t sources_len, int32_t* indices, int32_t* bin_ids, void* workspace,
                size_t workspace_bytes, void* stream) {
  const cudaStream_t s = as_stream(stream);
  Outputs o;
  o.assignments = assignments;
  o.rows = rows;
  o.kept = assignments < rows ? assignments : rows;
  o.counts = counts;
  o.dest_rows = dest_rows;
  o.row_sources = row_sources;
  o.sources_len = sources_len;
  o.indices = indices;
  o.bin_ids = bin_ids;
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(ids);
  const int64_t tail = sources_len > assignments ? sources_len - assignments : 0;
  if (assignments <= kIndexPlanBlockSort) {
    const unsigned fill = tail > 0 ? grid_for(tail, kSortThreads * kFillItems, kMaxFillBlocks) : 0;
    launch_kernel("index_block_sort_kernel", index_block_sort_kernel, 1 + fill, kSortThreads, 0, s, keys, o);
    return;
  }
  const size_t slot = aligned(sizeof(int32_t) * static_cast<size_t>(assignments));
  char* w = static_cast<char*>(workspace);
  uint32_t* keys_out = reinterpret_cast<uint32_t*>(w);
  int32_t* ids_in = reinterpret_cast<int32_t*>(w + slot);
  int32_t* ids_out = reinterpret_cast<int32_t*>(w + 2 * slot);
  size_t temp_bytes = workspace_bytes - 3 * slot;  // cub's share of index_plan_workspace_bytes
  launch_kernel("index_iota_kernel", index_iota_kernel,
                grid_for(assignments > tail ? assignments : tail, kFillThreads * kFillItems, kMaxFillBlocks),
                kFillThreads, 0, s, ids_in, o);
  PADMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(w + 3 * slot, temp_bytes, keys, keys_out, ids_in, ids_out,
                                                    static_cast<int>(assignments), 0, 32, s));
  launch_kernel("index_place_kernel", index_place_kernel,
                grid_for(assignments, kFillThreads * kFillItems, kMaxFillBlocks), kFillThreads, 0, s, ids_out, o);
}

}  // namespace cuda
}  // namespace padmoe
