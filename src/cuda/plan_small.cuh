// plan_small.cuh — make_plan for one chunk (A <= 2048, E <= 512: decode sizes) in one launch of 32
// blocks without a grid barrier. Included by plan.cu.
#pragma once

#include "cuda/plan_common.cuh"

namespace padmoe {
namespace cuda {
namespace {

// --- small: one chunk (A <= 2048, E <= 512): kSmallBlocks << round_shift blocks, one launch ----
// Block b places assignments of warp w = b >> round_shift (its slice [128w, 128w + 128), all of it
// or a share of its four rounds). Every block counts all the ids into shared memory with integer
// atomics (exact counts, whatever the order) and, in a second histogram, the ids of the warps
// before warp w; warp w ranks its own 128 assignments among equal keys from ballots (one a key bit
// and round: each lane can then form the lanes of any round holding its key). An assignment's rank
// is the count of its key before warp w plus its rank inside the warp: the ranks of the stable
// sort, without the fused kernel's [warps][E] counts, their clear and their column scan, and a
// smaller kernel (ncu showed the fused one's instruction fetch stalling at decode).
constexpr int kSmallBlocks = kFusedWarps;  // at round_shift 0
// round_shift 1: 32 blocks, each placing half of one warp's 128 assignments (decode 4.9 us against
// 5.1 with 16 blocks and 5.0 with 64).
constexpr int kSmallShift = 1;
static_assert(kFusedItems == 4, "small plan: round_shift splits a warp's 4 rounds");
constexpr int kSmallKeyBits = 10;  // keys 0..E with E <= 512 (E: an invalid id)
static_assert(kFusedMaxExperts < (1 << kSmallKeyBits), "small plan: the key bits hold E");

size_t small_smem_bytes(int num_experts) { return static_cast<size_t>(4) * num_experts * sizeof(int); }

__global__ void __launch_bounds__(kFusedThreads)
    plan_small_kernel(IndexRef ids, index::ExpertRemap remap, int assignments, int num_experts, int alignment,
                      int round_shift, int64_t row_capacity, backend::PlanArrays out, int32_t padding_source) {
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
  using Scan = cub::BlockScan<unsigned long long, kFusedThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int s_totals[2];  // real and padded totals
  extern __shared__ __align__(16) int s_small[];
  const int E = num_experts;
  int* s_all = s_small;        // [E] count of e
  int* s_before = s_all + E;   // [E] count of e in the warps before the block's own
  int* s_pos = s_before + E;   // [E] sorted position of e's first assignment
  int* s_row = s_pos + E;      // [E] padded row of e's first assignment
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // the warp whose assignments this block places: all of its rounds, or (round_shift > 0) the
  // rounds j with j >> (2 - round_shift) == sub, the block's share among the 2^round_shift blocks
  // of that warp
  const int own = static_cast<int>(blockIdx.x) >> round_shift;
  const int sub = static_cast<int>(blockIdx.x) & ((1 << round_shift) - 1);
  const int base = warp * kFusedPerWarp;
  int k[kFusedItems];
#pragma unroll
  for (int j = 0; j < kFusedItems; ++j) {  // loads first
    const int a = base + j * 32 + lane;
    k[j] = a < assignments ? static_cast<int>(remap.local(load_index(ids, a))) : -1;
  }
  for (int e = threadIdx.x; e < E; e += kFusedThreads) {
    s_all[e] = 0;
    s_before[e] = 0;
  }
#pragma unroll
  for (int j = 0; j < kFusedItems; ++j) {
    if (!(k[j] >= 0 && k[j] < E)) k[j] = -1;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kFusedItems; ++j) {
    if (k[j] >= 0) {
      atomicAdd(&s_all[k[j]], 1);
      if (warp < own) atomicAdd(&s_before[k[j]], 1);
    }
  }
  int rel[kFusedItems];  // rank among the warp's own assignments of the same key
  if (warp == own) {
    const unsigned lower = (1u << lane) - 1u;
    unsigned key[kFusedItems];
#pragma unroll
    for (int j = 0; j < kFusedItems; ++j) {
      key[j] = static_cast<unsigned>(k[j] >= 0 ? k[j] : E);
      rel[j] = 0;
    }
#pragma unroll
    for (int q = 0; q < kFusedItems; ++q) {  // round q's ballots, then its lanes holding each later key
      unsigned v[kSmallKeyBits];
#pragma unroll
      for (int b = 0; b < kSmallKeyBits; ++b) v[b] = __ballot_sync(0xffffffffu, (key[q] >> b) & 1u);
#pragma unroll
      for (int j = q; j < kFusedItems; ++j) {
        unsigned m = 0xffffffffu;
#pragma unroll
        for (int b = 0; b < kSmallKeyBits; ++b) m &= ((key[j] >> b) & 1u) ? v[b] : ~v[b];
        rel[j] += __popc(q < j ? m : m & lower);
      }
    }
  }
  __syncthreads();
  const int e = threadIdx.x;
  const int count = e < E ? s_all[e] : 0;
  const int padded = round_up_32(count, alignment);
  // real counts in the low word, padded in the high word: totals stay below 2^31, no carry
  const unsigned long long packed = (static_cast<unsigned long long>(padded) << 32) | static_cast<unsigned>(count);
  unsigned long long excl = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(packed, excl, total);
  const int real_excl = static_cast<int>(excl & 0xffffffffull), padded_excl = static_cast<int>(excl >> 32);
  if (e < E) {
    s_pos[e] = real_excl;
    s_row[e] = padded_excl;
  }
  plan_store_counts(e, E, count, padded, real_excl, padded_excl, total, s_totals, tokens_per_expert, bins,
                    padded_tokens, padded_bins, padded_total_out);
  if (warp == own) {
#pragma unroll
    for (int j = 0; j < kFusedItems; ++j) rel[j] += k[j] >= 0 ? s_before[k[j]] : 0;
  }
  __syncthreads();
  const int real_total = s_totals[0], padded_total = s_totals[1];
  if (warp == own) {
#pragma unroll
    for (int j = 0; j < kFusedItems; ++j) {
      const int a = base + j * 32 + lane;
      if (a >= assignments) break;
      if ((j >> (2 - round_shift)) != sub) continue;
      plan_place_one(a, k[j], k[j] < 0 ? -1 : rel[j], s_pos, s_row, real_total, indices, bin_ids, dest_rows,
                     row_sources, row_experts);
    }
  }
  plan_fills(s_row, s_all, E, alignment, padded_total, row_capacity, blocks, row_sources, padding_source, row_experts,
             block_experts);
}
}  // namespace
}  // namespace cuda
}  // namespace padmoe
