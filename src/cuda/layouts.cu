// layouts.cu — vLLM's batched block layout (batched_moe_align_block_size) on
// the GPU. The padded inclusive ends of the counts are multiples of
// block_size, so entry i belongs to the expert whose run holds i (a binary
// search over the ends) and every block lies inside one run or past them all.
// Consecutive threads write consecutive entries (coalesced stores), and a
// warp's searches read the same few shared-memory words (broadcasts).
#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"

namespace padmoe {
namespace cuda {
namespace {

constexpr int kAlignThreads = 256;
// The one-launch form keeps the ends and the counts of every expert in shared memory: two int32
// arrays of this many entries, 32 KiB. Above it a one-block scan writes them to the workspace.
constexpr int kAlignScanExperts = 4096;
constexpr int kOffsetsThreads = 1024;
// Every block of the one-launch form scans all the counts itself, so the grid is capped (threads
// loop over the rest): 1024 blocks fill an H100 / H200 several times over.
constexpr int kAlignMaxBlocks = 1024;

// Count e read as clamped into [0, max_tokens]: unchecked bad counts still give a layout inside
// the outputs (the sums stay within entries, which fits int32).
__device__ __forceinline__ int clamped_count(const IndexRef& counts, int64_t e, int max_tokens) {
  const int64_t n = load_index(counts, e);
  return static_cast<int>(n < 0 ? 0 : (n > max_tokens ? max_tokens : n));
}

// One thread block: cnt[e] = the clamped count, ends[e] = the padded inclusive end of expert e.
// Each thread takes a contiguous range of experts, so one exclusive scan of the range sums does.
template <int THREADS>
__device__ void scan_counts(const IndexRef& counts, int num_experts, int max_tokens, int block_size, int32_t* ends,
                            int32_t* cnt, typename cub::BlockScan<int, THREADS>::TempStorage& storage) {
  const int per = (num_experts + THREADS - 1) / THREADS;
  const int e0 = min(num_experts, static_cast<int>(threadIdx.x) * per);
  const int e1 = min(num_experts, e0 + per);
  int mine = 0;
  for (int e = e0; e < e1; ++e) {
    const int n = clamped_count(counts, e, max_tokens);
    cnt[e] = n;
    mine += static_cast<int>(index::round_up(n, block_size));
  }
  int run = 0;
  cub::BlockScan<int, THREADS>(storage).ExclusiveSum(mine, run);
  for (int e = e0; e < e1; ++e) {
    run += static_cast<int>(index::round_up(cnt[e], block_size));
    ends[e] = run;
  }
}

// sorted_ids, block_ids and *post (block 0) from the scanned ends and clamped counts.
__device__ void write_layout(const int32_t* ends, const int32_t* cnt, int num_experts, int max_tokens, int block_size,
                             int64_t entries, int32_t* sorted_ids, int32_t* block_ids, int32_t* post) {
  const int64_t total = ends[num_experts - 1];
  const int64_t sentinel = static_cast<int64_t>(num_experts) * max_tokens;  // <= entries
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) *post = static_cast<int32_t>(total);
  for (int64_t i = first; i < entries; i += stride) {
    int64_t v = sentinel;
    if (i < total) {
      const int64_t e = index::find_segment(ends, num_experts, i);
      const int64_t local = i - index::segment_start(ends, e);
      if (local < cnt[e]) v = e * max_tokens + local;
    }
    sorted_ids[i] = static_cast<int32_t>(v);
  }
  const int64_t blocks = entries / block_size;
  for (int64_t b = first; b < blocks; b += stride) {
    const int64_t start = b * block_size;
    block_ids[b] = start < total ? static_cast<int32_t>(index::find_segment(ends, num_experts, start)) : -1;
  }
}

// E <= kAlignScanExperts, one launch: every block scans the counts into shared memory.
__global__ void __launch_bounds__(kAlignThreads)
    batched_align_scan_kernel(IndexRef counts, int num_experts, int max_tokens, int block_size, int64_t entries,
                              int32_t* sorted_ids, int32_t* block_ids, int32_t* post) {
  pdl_begin();
  __shared__ typename cub::BlockScan<int, kAlignThreads>::TempStorage storage;
  __shared__ int32_t s_ends[kAlignScanExperts];
  __shared__ int32_t s_cnt[kAlignScanExperts];
  scan_counts<kAlignThreads>(counts, num_experts, max_tokens, block_size, s_ends, s_cnt, storage);
  __syncthreads();
  write_layout(s_ends, s_cnt, num_experts, max_tokens, block_size, entries, sorted_ids, block_ids, post);
}

// E > kAlignScanExperts: one block scans the counts into the workspace ...
__global__ void __launch_bounds__(kOffsetsThreads)
    batched_offsets_kernel(IndexRef counts, int num_experts, int max_tokens, int block_size, int32_t* ends,
                           int32_t* cnt) {
  pdl_begin();
  __shared__ typename cub::BlockScan<int, kOffsetsThreads>::TempStorage storage;
  scan_counts<kOffsetsThreads>(counts, num_experts, max_tokens, block_size, ends, cnt, storage);
}

// ... and the layout kernel reads them from there.
__global__ void batched_layout_kernel(const int32_t* ends, const int32_t* cnt, int num_experts, int max_tokens,
                                      int block_size, int64_t entries, int32_t* sorted_ids, int32_t* block_ids,
                                      int32_t* post) {
  pdl_begin();
  write_layout(ends, cnt, num_experts, max_tokens, block_size, entries, sorted_ids, block_ids, post);
}

}  // namespace

size_t batched_align_workspace_bytes(int64_t num_experts) {
  return num_experts > kAlignScanExperts ? 2 * sizeof(int32_t) * static_cast<size_t>(num_experts) : 0;
}

void batched_align_blocks(IndexRef counts, int64_t num_experts, int max_tokens, int block_size, int64_t entries,
                          int32_t* sorted_ids, int32_t* block_ids, int32_t* post, void* workspace, void* stream) {
  const cudaStream_t s = as_stream(stream);
  if (entries == 0) {  // no experts or max_tokens == 0: the padded total is 0
    PADMOE_CUDA_CHECK(cudaMemsetAsync(post, 0, sizeof(int32_t), s));
    return;
  }
  const int experts = static_cast<int>(num_experts);  // <= entries < 2^31
  const int grid = grid_for(entries, kAlignThreads, kAlignMaxBlocks);
  if (experts <= kAlignScanExperts) {
    launch_kernel("batched_align_scan_kernel", batched_align_scan_kernel, grid, kAlignThreads, 0, s, counts, experts,
                  max_tokens, block_size, entries, sorted_ids, block_ids, post);
    return;
  }
  int32_t* ends = static_cast<int32_t*>(workspace);
  int32_t* cnt = ends + experts;
  launch_kernel("batched_offsets_kernel", batched_offsets_kernel, 1, kOffsetsThreads, 0, s, counts, experts, max_tokens,
                block_size, ends, cnt);
  launch_kernel("batched_layout_kernel", batched_layout_kernel, grid_for(entries, kAlignThreads, 4096), kAlignThreads,
                0, s, static_cast<const int32_t*>(ends), static_cast<const int32_t*>(cnt), experts, max_tokens,
                block_size, entries, sorted_ids, block_ids, post);
}

}  // namespace cuda
}  // namespace padmoe
