// plan_common.cuh — make_plan's shared pieces: the chunk and block sizes, the placement of one
// assignment, and the count vectors and fills of the one-launch kernels (plan_fused.cuh,
// plan_small.cuh). Included by plan.cu with the kernel families.
#pragma once

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cooperative_groups.h>

#include "cuda/common.cuh"

namespace padmoe {
namespace cuda {
namespace {

constexpr int kCountThreads = 256;
constexpr int kItems = 8;
constexpr int kChunk = kCountThreads * kItems;  // assignments per chunk
static_assert(kChunk == kPlanChunk, "plan_workspace_bytes assumes kPlanChunk");
constexpr int kPlaceThreads = 256;
constexpr int kPlaceBatch = 32;         // chunk counts loaded per batch in the place kernel
constexpr int kMatchMaxExperts = 1024;  // the warp-match count's shared counters: 8 * E ints

int key_bits(int num_experts) {
  int bits = 1;
  while ((1 << bits) <= num_experts) ++bits;  // room for the sentinel E
  return bits;
}


// Places assignment a of expert `key` at rank `rank` among its expert (rank < 0: dropped):
// indices / bin_ids at its sorted position, dest_rows, row_sources and row_experts at its padded
// row; positions past the kept total (only when ids were dropped) get indices = bin_ids = -1.
// Every position and row is below 2^31 (the plan's arrays are int32).
__device__ __forceinline__ void plan_place_one(int a, int key, int rank, const int* s_pos, const int* s_row,
                                               int real_total, int32_t* indices, int32_t* bin_ids, int32_t* dest_rows,
                                               int32_t* row_sources, int32_t* row_experts) {
  if (rank < 0) {
    dest_rows[a] = -1;
  } else {
    const int pos = s_pos[key] + rank;
    const int row = s_row[key] + rank;
    indices[pos] = a;
    bin_ids[pos] = key;
    dest_rows[a] = row;
    row_sources[row] = a;
    if (row_experts != nullptr) row_experts[row] = key;
  }
  if (a >= real_total) {
    indices[a] = -1;
    bin_ids[a] = -1;
  }
}

constexpr int kFusedThreads = 512;
constexpr int kFusedWarps = kFusedThreads / 32;
constexpr int kFusedItems = kChunk / kFusedThreads;        // assignments a thread ranks per chunk
constexpr int kFusedPerWarp = kChunk / kFusedWarps;        // a warp's contiguous slice of a chunk
constexpr int kFusedMaxExperts = kFusedThreads;            // one expert per thread in the scan
static_assert(kFusedItems * 32 == kFusedPerWarp, "fused plan: a warp's slice is kFusedItems rounds of 32");

size_t fused_smem_bytes(int num_experts) { return static_cast<size_t>(kFusedWarps + 3) * num_experts * sizeof(int); }
static_assert(kFusedMaxExperts == policy::kPlanFusedMaxExperts, "policy::plan_path's fused limit");
static_assert(kFusedWarps == policy::kPlanMaxReplicas, "policy::plan_replicas: a warp a replica");

// The fills of a fused or small plan launch, over the whole grid: expert e's padding rows and
// blocks by block e mod grid, a warp an expert (s_pstart[e]: e's first padded row, s_count[e]: its
// count); rows and blocks at or past P strided over the grid (32-bit unsigned counters: every
// index is below 2^31, and index + stride cannot wrap).
__device__ __forceinline__ void plan_fills(const int* s_pstart, const int* s_count, int E, int alignment,
                                           int padded_total, int64_t row_capacity, int64_t blocks, int32_t* row_sources,
                                           int32_t padding_source, int32_t* row_experts, int32_t* block_experts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grid = static_cast<int>(gridDim.x);
  const unsigned capacity = row_capacity < 0x7fffffff ? static_cast<unsigned>(row_capacity) : 0x7fffffffu;
  const unsigned nblocks = blocks < 0x7fffffff ? static_cast<unsigned>(blocks) : 0x7fffffffu;
  const unsigned ualign = static_cast<unsigned>(alignment);
  for (int x = static_cast<int>(blockIdx.x) + grid * warp; x < E; x += grid * kFusedWarps) {
    const unsigned pstart = s_pstart[x], n = s_count[x];
    const unsigned pend = pstart + round_up_32(static_cast<int>(n), alignment);
    const unsigned end = pend < capacity ? pend : capacity;
    for (unsigned r = pstart + n + lane; r < end; r += 32) {
      row_sources[r] = padding_source;
      if (row_experts != nullptr) row_experts[r] = -1;
    }
    if (block_experts != nullptr) {
      const unsigned b_end = min(pend / ualign, nblocks);
      for (unsigned b = pstart / ualign + lane; b < b_end; b += 32) block_experts[b] = x;
    }
  }
  const unsigned stride = static_cast<unsigned>(grid) * kFusedThreads;
  const unsigned start = blockIdx.x * kFusedThreads + threadIdx.x;
  for (unsigned r = static_cast<unsigned>(padded_total) + start; r < capacity; r += stride) {
    row_sources[r] = padding_source;
    if (row_experts != nullptr) row_experts[r] = -1;
  }
  if (block_experts != nullptr) {
    for (unsigned b = static_cast<unsigned>(padded_total) / ualign + start; b < nblocks; b += stride) {
      block_experts[b] = -1;
    }
  }
}

// Block 0 writes the plan's count vectors for expert e (real and padded count, their inclusive
// sums) and P; every block keeps the real and padded totals in s_totals (fused and small kernels).
template <typename Total>
__device__ __forceinline__ void plan_store_counts(int e, int E, int count, int padded, int real_excl, int padded_excl,
                                                  unsigned long long total, Total* s_totals, int32_t* tokens_per_expert,
                                                  int32_t* bins, int32_t* padded_tokens, int32_t* padded_bins,
                                                  int32_t* padded_total_out) {
  if (e < E && blockIdx.x == 0) {
    tokens_per_expert[e] = count;
    bins[e] = real_excl + count;
    padded_tokens[e] = padded;
    padded_bins[e] = padded_excl + padded;
  }
  if (threadIdx.x == 0) {
    s_totals[0] = static_cast<Total>(total & 0xffffffffull);
    s_totals[1] = static_cast<Total>(total >> 32);
    if (blockIdx.x == 0 && padded_total_out != nullptr) *padded_total_out = static_cast<int32_t>(total >> 32);
  }
}
}  // namespace
}  // namespace cuda
}  // namespace padmoe
