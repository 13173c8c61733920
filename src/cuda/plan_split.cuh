// plan_split.cuh — make_plan in two launches (E above the fused kernel's 512, or a device without
// cooperative launches): count (each block ranks a chunk's assignments among their expert, by warp
// matching up to kMatchMaxExperts experts, else a stable block radix sort) then place (every block
// scans the [chunks, E] counts and places its chunk). Included by plan.cu.
#pragma once

#include "cuda/plan_common.cuh"

namespace padmoe {
namespace cuda {
namespace {

__global__ void __launch_bounds__(kCountThreads)
    plan_count_kernel(IndexRef ids, index::ExpertRemap remap, int64_t assignments, int num_experts, int bits,
                      int32_t* chunk_counts, int32_t* local_rank) {
  pdl_begin();
  using Sort = cub::BlockRadixSort<int, kCountThreads, kItems, int>;
  __shared__ typename Sort::TempStorage sort_storage;
  __shared__ int s_keys[kChunk];
  extern __shared__ int s_counts[];  // [E]

  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  int keys[kItems];
  int vals[kItems];
  for (int j = 0; j < kItems; ++j) {
    const int64_t a = base + threadIdx.x * kItems + j;
    int key = num_experts;  // sentinel: past the end, or a dropped id
    if (a < assignments) {
      const int64_t e = remap.local(load_index(ids, a));
      if (e >= 0) key = static_cast<int>(e);
      else local_rank[a] = -1;  // dropped
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
      if (s_keys[mid] < key) lo = mid + 1;
      else hi = mid;
    }
    const int rank = pos - lo;
    local_rank[base + vals[j]] = rank;
    if (pos == kChunk - 1 || s_keys[pos + 1] != key) s_counts[key] = rank + 1;
  }
  __syncthreads();
  int32_t* out = chunk_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += kCountThreads) out[e] = s_counts[e];
}

// Count by warp matching: warp w ranks assignments [base + 256w, base + 256w + 256)
// 32 at a time in assignment order against its own counters s_wc[w][E];
// the counters then become each warp's offset among the chunk.
__global__ void __launch_bounds__(kCountThreads)
    plan_count_match_kernel(IndexRef ids, index::ExpertRemap remap, int64_t assignments, int num_experts,
                            int32_t* chunk_counts, int32_t* local_rank) {
  pdl_begin();
  constexpr int kWarps = kCountThreads / 32;
  constexpr int kPerWarp = kChunk / kWarps;
  constexpr int kIters = kPerWarp / 32;
  extern __shared__ int s_wc[];  // [kWarps][E]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk + warp * kPerWarp;
  int keys[kIters];
#pragma unroll
  for (int j = 0; j < kIters; ++j) {  // all loads first
    const int64_t a = base + j * 32 + lane;
    keys[j] = a < assignments ? static_cast<int>(remap.local(load_index(ids, a))) : num_experts;
  }
  for (int i = threadIdx.x; i < kWarps * num_experts; i += kCountThreads) s_wc[i] = 0;
  __syncthreads();
  int* my = s_wc + warp * num_experts;
  const unsigned lower = (1u << lane) - 1u;
  int rank[kIters];
#pragma unroll
  for (int j = 0; j < kIters; ++j) {
    int key = keys[j];
    const int64_t a = base + j * 32 + lane;
    if (key < 0 || key >= num_experts) {  // dropped or past the end
      if (a < assignments) local_rank[a] = -1;
      key = num_experts;
    }
    keys[j] = key;
    const unsigned same = __match_any_sync(0xffffffffu, key);
    const int leader = __ffs(same) - 1;
    int count = 0;
    if (lane == leader && key < num_experts) count = my[key];
    count = __shfl_sync(0xffffffffu, count, leader);
    rank[j] = count + __popc(same & lower);
    if (lane == leader && key < num_experts) my[key] = count + __popc(same);
    __syncwarp();
  }
  __syncthreads();
  int32_t* out = chunk_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += kCountThreads) {
    int run = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int c = s_wc[w * num_experts + e];
      s_wc[w * num_experts + e] = run;
      run += c;
    }
    out[e] = run;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kIters; ++j) {
    const int64_t a = base + j * 32 + lane;
    if (keys[j] < num_experts) local_rank[a] = my[keys[j]] + rank[j];
  }
}
__global__ void __launch_bounds__(kPlaceThreads)
    plan_place_kernel(IndexRef ids, index::ExpertRemap remap, int64_t assignments, int chunks, int num_experts,
                      int alignment, const int32_t* chunk_counts, const int32_t* local_rank, int64_t row_capacity,
                      backend::PlanArrays out, int32_t padding_source) {
  pdl_begin();
  // the plan's arrays under their own names
  int32_t* const tokens_per_expert = out.tokens_per_expert;
  int32_t* const bins = out.bins;
  int32_t* const padded_tokens = out.padded_tokens;
  int32_t* const padded_bins = out.padded_bins;
  int32_t* const indices = out.indices;
  int32_t* const bin_ids = out.bin_ids;
  int32_t* const dest_rows = out.dest_rows;
  int32_t* const row_sources = out.row_sources;
  int32_t* const row_experts = out.row_experts;
  int32_t* const block_experts = out.block_experts;
  const int64_t blocks = out.blocks;
  int32_t* const padded_total_out = out.padded_total;
  using Scan = cub::BlockScan<int, kPlaceThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int s_totals[2];  // real and padded totals
  extern __shared__ int s_plan[];
  int* s_count = s_plan;                        // [E] expert totals
  int* s_pos = s_plan + num_experts;            // [E] sorted position of this chunk's first of e
  int* s_row = s_plan + 2 * num_experts;        // [E] padded row of this chunk's first of e
  const int chunk = blockIdx.x;
  const int per = (num_experts + kPlaceThreads - 1) / kPlaceThreads;
  const int e0 = min(num_experts, static_cast<int>(threadIdx.x) * per);
  const int e1 = min(num_experts, e0 + per);

  int my_real = 0, my_padded = 0;
  for (int e = e0; e < e1; ++e) {
    int total = 0, before = 0;
    for (int c0 = 0; c0 < chunks; c0 += kPlaceBatch) {
      int n[kPlaceBatch];
#pragma unroll
      for (int q = 0; q < kPlaceBatch; ++q) {
        n[q] = c0 + q < chunks ? chunk_counts[static_cast<int64_t>(c0 + q) * num_experts + e] : 0;
      }
#pragma unroll
      for (int q = 0; q < kPlaceBatch; ++q) {
        total += n[q];
        if (c0 + q < chunk) before += n[q];
      }
    }
    s_count[e] = total;
    s_pos[e] = before;
    my_real += total;
    my_padded += static_cast<int>(index::round_up(total, alignment));
  }
  int real_excl = 0, padded_excl = 0;
  Scan(scan_storage).ExclusiveSum(my_real, real_excl);
  __syncthreads();
  Scan(scan_storage).ExclusiveSum(my_padded, padded_excl);
  for (int e = e0; e < e1; ++e) {
    const int count = s_count[e];
    const int padded = static_cast<int>(index::round_up(count, alignment));
    const int before = s_pos[e];
    s_pos[e] = real_excl + before;
    s_row[e] = padded_excl + before;
    // Padding rows of e: written by one block (e mod grid), one thread.
    if (e % gridDim.x == blockIdx.x) {
      const int64_t end = padded_excl + padded < row_capacity ? padded_excl + padded : row_capacity;
      for (int64_t r = padded_excl + count; r < end; ++r) {
        row_sources[r] = padding_source;
        if (row_experts != nullptr) row_experts[r] = -1;
      }
      if (block_experts != nullptr) {  // expert segments are whole blocks of `alignment` rows
        for (int64_t b = padded_excl / alignment; b < (padded_excl + padded) / alignment && b < blocks; ++b) {
          block_experts[b] = e;
        }
      }
    }
    real_excl += count;
    padded_excl += padded;
    if (blockIdx.x == 0) {
      tokens_per_expert[e] = count;
      bins[e] = real_excl;
      padded_tokens[e] = padded;
      padded_bins[e] = padded_excl;
    }
  }
  if (threadIdx.x == kPlaceThreads - 1) {
    s_totals[0] = real_excl;
    s_totals[1] = padded_excl;
    if (blockIdx.x == 0 && padded_total_out != nullptr) *padded_total_out = padded_excl;
  }
  __syncthreads();
  const int64_t real_total = s_totals[0];
  const int64_t padded_total = s_totals[1];
  if (chunk < chunks) {
    constexpr int kItems = kChunk / kPlaceThreads;
    const int64_t base = static_cast<int64_t>(chunk) * kChunk;
    int ranks[kItems], experts[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {  // every load first, then the stores
      const int64_t i = base + j * kPlaceThreads + threadIdx.x;
      ranks[j] = i < assignments ? local_rank[i] : -1;
      experts[j] = i < assignments ? static_cast<int>(remap.local(load_index(ids, i))) : 0;
    }
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = base + j * kPlaceThreads + threadIdx.x;
      if (i >= assignments) break;
      plan_place_one(static_cast<int>(i), experts[j], ranks[j], s_pos, s_row, static_cast<int>(real_total), indices,
                     bin_ids, dest_rows, row_sources, row_experts);
    }
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kPlaceThreads;
  for (int64_t r = padded_total + static_cast<int64_t>(blockIdx.x) * kPlaceThreads + threadIdx.x; r < row_capacity;
       r += stride) {
    row_sources[r] = padding_source;
    if (row_experts != nullptr) row_experts[r] = -1;
  }
  if (block_experts != nullptr) {
    for (int64_t b = padded_total / alignment + static_cast<int64_t>(blockIdx.x) * kPlaceThreads + threadIdx.x;
         b < blocks; b += stride) {
      block_experts[b] = -1;
    }
  }
}
}  // namespace
}  // namespace cuda
}  // namespace padmoe
