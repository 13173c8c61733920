// plan.cu — make_plan on the GPU: a stable counting sort by expert in three
// launches, no host synchronization.
//
//   1. count:   each block sorts its chunk of kChunk assignment ids by expert
//               (cub::BlockRadixSort, stable), writes every assignment's rank
//               among its expert inside the chunk and the chunk's per-expert
//               counts.
//   2. scan:    one block turns the [chunks, E] counts into the plan's counts,
//               bins, padded counts, padded bins and each (chunk, expert)'s
//               first sorted position.
//   3. scatter: position = chunk offset + rank; writes indices, bin_ids,
//               dest_rows, row_sources, and -1 into every padding row and row
//               at or past P of row_sources (each entry written once).
// Stability: chunks are in assignment order and the block sort is stable.
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"

namespace padmoe {
namespace cuda {
namespace {

constexpr int kCountThreads = 256;
constexpr int kItems = 8;
constexpr int kChunk = kCountThreads * kItems;  // assignments per chunk
static_assert(kChunk == kPlanChunk, "plan_workspace_bytes assumes kPlanChunk");
constexpr int kScanThreads = 1024;

int key_bits(int num_experts) {
  int bits = 1;
  while ((1 << bits) <= num_experts) ++bits;  // room for the sentinel E
  return bits;
}

__global__ void __launch_bounds__(kCountThreads)
    plan_count_kernel(IndexRef ids, int64_t assignments, int num_experts, int bits, int32_t* chunk_counts,
                      int32_t* local_rank) {
  using Sort = cub::BlockRadixSort<int, kCountThreads, kItems, int>;
  __shared__ typename Sort::TempStorage sort_storage;
  __shared__ int s_keys[kChunk];
  extern __shared__ int s_counts[];  // [E]

  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  int keys[kItems];
  int vals[kItems];
  for (int j = 0; j < kItems; ++j) {
    const int64_t a = base + threadIdx.x * kItems + j;
    int key = num_experts;  // sentinel: past the end, or an id outside [0, E)
    if (a < assignments) {
      const int64_t e = load_index(ids, a);
      if (e >= 0 && e < num_experts) key = static_cast<int>(e);
      else local_rank[a] = -1;  // dropped (possible only unchecked)
    }
    keys[j] = key;
    vals[j] = static_cast<int>(a < assignments ? a - base : -1);
  }
  for (int e = threadIdx.x; e < num_experts; e += kCountThreads) s_counts[e] = 0;
  Sort(sort_storage).Sort(keys, vals, 0, bits);
  for (int j = 0; j < kItems; ++j) s_keys[threadIdx.x * kItems + j] = keys[j];
  __syncthreads();

  for (int j = 0; j < kItems; ++j) {
    const int pos = threadIdx.x * kItems + j;
    const int key = keys[j];
    if (key >= num_experts) continue;
    int lo = 0, hi = pos;  // first position holding `key`
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (s_keys[mid] < key) lo = mid + 1; else hi = mid;
    }
    const int rank = pos - lo;
    local_rank[base + vals[j]] = rank;
    if (pos == kChunk - 1 || s_keys[pos + 1] != key) s_counts[key] = rank + 1;
  }
  __syncthreads();
  int32_t* out = chunk_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += kCountThreads) out[e] = s_counts[e];
}

__global__ void __launch_bounds__(kScanThreads)
    plan_scan_kernel(int32_t* chunk_counts, int chunks, int num_experts, int alignment, int32_t* tokens_per_expert,
                     int32_t* bins, int32_t* padded_tokens, int32_t* padded_bins) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int per = (num_experts + kScanThreads - 1) / kScanThreads;
  const int e0 = min(num_experts, static_cast<int>(threadIdx.x) * per);
  const int e1 = min(num_experts, e0 + per);

  // Per expert: the total over chunks (loads only, so they pipeline).
  int my_real = 0, my_padded = 0;
  for (int e = e0; e < e1; ++e) {
    int total = 0;
#pragma unroll 8
    for (int c = 0; c < chunks; ++c) total += chunk_counts[static_cast<int64_t>(c) * num_experts + e];
    tokens_per_expert[e] = total;
    const int padded = static_cast<int>(index::round_up(total, alignment));
    padded_tokens[e] = padded;
    my_real += total;
    my_padded += padded;
  }
  int real_excl = 0, padded_excl = 0;
  Scan(scan_storage).ExclusiveSum(my_real, real_excl);
  __syncthreads();
  Scan(scan_storage).ExclusiveSum(my_padded, padded_excl);
  // Chunk counts become each (chunk, expert)'s first sorted position.
  constexpr int kBlock = 8;
  for (int e = e0; e < e1; ++e) {
    int run = real_excl;
    real_excl += tokens_per_expert[e];
    padded_excl += padded_tokens[e];
    bins[e] = real_excl;
    padded_bins[e] = padded_excl;
    for (int c0 = 0; c0 < chunks; c0 += kBlock) {
      int n[kBlock];
#pragma unroll
      for (int q = 0; q < kBlock; ++q) {
        n[q] = c0 + q < chunks ? chunk_counts[static_cast<int64_t>(c0 + q) * num_experts + e] : 0;
      }
#pragma unroll
      for (int q = 0; q < kBlock; ++q) {
        if (c0 + q < chunks) chunk_counts[static_cast<int64_t>(c0 + q) * num_experts + e] = run;
        run += n[q];
      }
    }
  }
}

// Scatter (thread per assignment), then -1 into padding rows (a warp per
// expert) and rows at or past P (thread per row).
__global__ void plan_scatter_kernel(IndexRef ids, int64_t assignments, int num_experts, const int32_t* chunk_offsets,
                                    const int32_t* local_rank, const int32_t* tokens_per_expert, const int32_t* bins,
                                    const int32_t* padded_bins, int64_t row_capacity, int32_t* indices,
                                    int32_t* bin_ids, int32_t* dest_rows, int32_t* row_sources) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t real_total = num_experts > 0 ? bins[num_experts - 1] : 0;
  const int64_t padded = num_experts > 0 ? padded_bins[num_experts - 1] : 0;
  for (int64_t i = tid; i < assignments; i += stride) {
    const int rank = local_rank[i];
    if (rank < 0) {
      dest_rows[i] = -1;
    } else {
      const int e = static_cast<int>(load_index(ids, i));
      const int64_t pos = chunk_offsets[(i / kChunk) * num_experts + e] + rank;
      const int64_t row = index::padded_row(pos, index::segment_start(bins, e), index::segment_start(padded_bins, e));
      indices[pos] = static_cast<int32_t>(i);
      bin_ids[pos] = e;
      dest_rows[i] = static_cast<int32_t>(row);
      row_sources[row] = static_cast<int32_t>(i);
    }
    if (i >= real_total) {  // only when ids were dropped (unchecked)
      indices[i] = -1;
      bin_ids[i] = -1;
    }
  }
  const int64_t lane = tid % 32;
  for (int64_t e = tid / 32; e < num_experts; e += stride / 32) {
    const int64_t end = padded_bins[e] < row_capacity ? padded_bins[e] : row_capacity;
    for (int64_t r = index::segment_start(padded_bins, e) + tokens_per_expert[e] + lane; r < end; r += 32) {
      row_sources[r] = -1;
    }
  }
  for (int64_t r = padded + tid; r < row_capacity; r += stride) row_sources[r] = -1;
}

}  // namespace

void make_plan(IndexRef top_experts, int64_t assignments, int top_k, int num_experts, int alignment,
               const PlanView& out, int64_t row_capacity, void* workspace, void* stream) {
  (void)top_k;
  const cudaStream_t s = as_stream(stream);
  const int chunks = static_cast<int>(index::ceil_div(assignments, kChunk));
  int32_t* chunk_counts = static_cast<int32_t*>(workspace);
  int32_t* local_rank = chunk_counts + static_cast<int64_t>(chunks) * num_experts;
  if (chunks > 0) {
    const size_t smem = static_cast<size_t>(num_experts) * sizeof(int);
    if (smem > 48 * 1024) {
      PADMOE_CUDA_CHECK(cudaFuncSetAttribute(plan_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem)));
    }
    plan_count_kernel<<<chunks, kCountThreads, smem, s>>>(top_experts, assignments, num_experts,
                                                         key_bits(num_experts), chunk_counts, local_rank);
    PADMOE_CUDA_LAUNCH_CHECK("plan_count_kernel");
  }
  plan_scan_kernel<<<1, kScanThreads, 0, s>>>(chunk_counts, chunks, num_experts, alignment,
                                              out.tokens_per_expert.data_as<int32_t>(), out.bins.data_as<int32_t>(),
                                              out.padded_tokens_per_expert.data_as<int32_t>(),
                                              out.padded_bins.data_as<int32_t>());
  PADMOE_CUDA_LAUNCH_CHECK("plan_scan_kernel");
  const int64_t work = assignments > row_capacity ? assignments : row_capacity;
  if (work > 0) {
    plan_scatter_kernel<<<grid_for(work, 256, 1024), 256, 0, s>>>(
        top_experts, assignments, num_experts, chunk_counts, local_rank, out.tokens_per_expert.data_as<int32_t>(),
        out.bins.data_as<int32_t>(),
        out.padded_bins.data_as<int32_t>(), row_capacity, out.indices.data_as<int32_t>(),
        out.bin_ids.data_as<int32_t>(), out.dest_rows.data_as<int32_t>(), out.row_sources.data_as<int32_t>());
    PADMOE_CUDA_LAUNCH_CHECK("plan_scatter_kernel");
  }
}

}  // namespace cuda
}  // namespace padmoe
