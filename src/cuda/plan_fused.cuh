// plan_fused.cuh — make_plan in one launch of 512-thread blocks (E <= 512, more than one chunk): the
// phases 1. rank, 2. expert totals (fused_expert_counts: publish the block's counts, a grid barrier
// under a cooperative launch when there are several blocks, sum the columns), 3. scan and place,
// 4. fills (plan_fills). Included by plan.cu.
#pragma once

#include "cuda/plan_common.cuh"

namespace padmoe {
namespace cuda {
namespace {

// Phase 2 of the fused plan: thread e's expert totals over the grid's blocks (count) and over the
// blocks before this one (before). With more than one block of distinct chunks, replica 0 of each
// publishes its counts to block_counts ([G, E] ints, or [G, ceil(E / 2)] 16-bit pairs when
// packed_counts), then the grid waits at its barrier (a cooperative launch) and every block sums
// the columns from L2; with one, s_run holds them. s_wc is scratch. Every thread calls it.
__device__ __forceinline__ void fused_expert_counts(int E, int cb, int replica, int replica_shift, int packed_counts,
                                                    int32_t* block_counts, const int* s_run, int* s_wc, int& count,
                                                    int& before) {
  const int G = static_cast<int>(gridDim.x) >> replica_shift;  // blocks of distinct chunks
  // packed_counts (a block's counts below 2^16): experts 2p and 2p + 1 in one int, low and high
  // half ([G, ceil(E / 2)]): half the bytes every block reads after the barrier (128 blocks read
  // the whole matrix) and half the loads a thread
  const int EP = (E + 1) / 2;
  if (G > 1) {
    if (replica == 0) {
      if (packed_counts) {
        for (int q = threadIdx.x; q < EP; q += kFusedThreads) {
          const unsigned hi = 2 * q + 1 < E ? static_cast<unsigned>(s_run[2 * q + 1]) : 0u;
          block_counts[static_cast<int64_t>(cb) * EP + q] =
              static_cast<int32_t>(static_cast<unsigned>(s_run[2 * q]) | (hi << 16));
        }
      } else {
        for (int e = threadIdx.x; e < E; e += kFusedThreads) block_counts[static_cast<int64_t>(cb) * E + e] = s_run[e];
      }
    }
    cooperative_groups::this_grid().sync();
  }
  const int e = threadIdx.x;
  if (G == 1) {
    if (e < E) count = s_run[e];
  } else if (packed_counts) {
    // pair q's counts over the blocks [lo, hi): `parts` threads a pair (up to 4), each a share of
    // the blocks, 16 loads in flight; the parts' sums meet in s_wc ([parts][2][E]: count, before)
    const int parts = min(4, kFusedThreads / EP);
    const int part = static_cast<int>(threadIdx.x) / EP, q = static_cast<int>(threadIdx.x) - part * EP;
    if (part < parts) {
      const int lo = G * part / parts, hi = G * (part + 1) / parts;
      int c0 = 0, c1 = 0, b0s = 0, b1s = 0;
      constexpr int kBatch = 16;
      for (int b0 = lo; b0 < hi; b0 += kBatch) {
        unsigned n[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          n[k] = b0 + k < hi ? static_cast<unsigned>(__ldcg(block_counts + static_cast<int64_t>(b0 + k) * EP + q)) : 0u;
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int lo16 = static_cast<int>(n[k] & 0xffffu), hi16 = static_cast<int>(n[k] >> 16);
          c0 += lo16;
          c1 += hi16;
          if (b0 + k < cb) {
            b0s += lo16;
            b1s += hi16;
          }
        }
      }
      s_wc[(part * 2) * E + 2 * q] = c0;
      s_wc[(part * 2 + 1) * E + 2 * q] = b0s;
      if (2 * q + 1 < E) {
        s_wc[(part * 2) * E + 2 * q + 1] = c1;
        s_wc[(part * 2 + 1) * E + 2 * q + 1] = b1s;
      }
    }
    __syncthreads();
    if (e < E) {
      for (int p = 0; p < parts; ++p) {
        count += s_wc[(p * 2) * E + e];
        before += s_wc[(p * 2 + 1) * E + e];
      }
    }
  } else {
    // expert x's counts over the blocks [lo, hi): with E <= 256 two threads an expert, each
    // reading half the blocks (half the dependent rounds of loads), summed through s_wc
    constexpr int kHalf = kFusedThreads / 2;
    const bool two = E <= kHalf;
    const int x = two && e >= kHalf ? e - kHalf : e;
    const int lo = two && e >= kHalf ? G / 2 : 0, hi = two && e < kHalf ? G / 2 : G;
    if (x < E) {
      constexpr int kBatch = 16;  // loads in flight a thread (32: no faster, measured)
      for (int b0 = lo; b0 < hi; b0 += kBatch) {
        int n[kBatch];
#pragma unroll
        for (int q = 0; q < kBatch; ++q) {
          n[q] = b0 + q < hi ? __ldcg(block_counts + static_cast<int64_t>(b0 + q) * E + x) : 0;
        }
#pragma unroll
        for (int q = 0; q < kBatch; ++q) {
          count += n[q];
          if (b0 + q < cb) before += n[q];
        }
      }
    }
    if (two) {
      if (e >= kHalf && x < E) {
        s_wc[x] = count;
        s_wc[E + x] = before;
      }
      __syncthreads();
      if (e < E) {
        count += s_wc[e];
        before += s_wc[E + e];
      } else {
        count = before = 0;  // not an expert of the scan
      }
    }
  }
}

// kBallot: the warp's equal keys found by one ballot a key bit (ALU work at full rate) instead
// of __match_any_sync, whose latency grows with the distinct keys in the warp (about 30 of 32 at
// E = 256); plan_ballot() chooses.
template <bool kBallot>
__global__ void __launch_bounds__(kFusedThreads, 2)  // two blocks an SM (64 registers), as the residency assumes
    plan_fused_kernel(IndexRef ids, index::ExpertRemap remap, int64_t assignments, int chunks, int chunks_per_block,
                      int replica_shift, int num_experts, int alignment, int32_t* block_counts, int32_t* local_rank,
                      int64_t row_capacity, backend::PlanArrays out, int32_t padding_source, int packed_counts) {
  pdl_begin();
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
  using Scan = cub::BlockScan<unsigned long long, kFusedThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ long long s_totals[2];  // real and padded totals
  __shared__ int s_sorted[kChunk], s_sorted_key[kChunk];  // the block's kept assignments in sorted order
  extern __shared__ __align__(16) int s_fused[];
  const int E = num_experts;
  int* s_wc = s_fused;                       // [warps][E] per-warp counts, then offsets; later [2][E] fills
  int* s_run = s_fused + kFusedWarps * E;    // [E] this block's running count per expert
  int* s_pos = s_run + E;                    // [E] sorted position of the block's first of e
  int* s_row = s_pos + E;                    // [E] padded row of the block's first of e
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned lower = (1u << lane) - 1u;
  // `replicas` blocks rank the same chunks (cheap: the ids come from L2) and each places the
  // assignments of its share of the warps: the scattered 4-byte stores of the placement are
  // what a block spends its time on, so more blocks finish sooner (replicas > 1 only with one
  // chunk a block: the ranks stay in registers).
  // Positions, rows and counts fit in 32 bits (the plan's arrays are int32); replicas is a power
  // of two (shifts and masks, no divisions).
  const int replicas = 1 << replica_shift, replica_mask = replicas - 1;
  const int cb = static_cast<int>(blockIdx.x) >> replica_shift, replica = static_cast<int>(blockIdx.x) & replica_mask;
  const int c_begin = cb * chunks_per_block;
  const int c_end = min(chunks, c_begin + chunks_per_block);
  const bool in_registers = chunks_per_block == 1;  // else the ranks go through local_rank
  int keys[kFusedItems], ranks[kFusedItems];
#pragma unroll
  for (int j = 0; j < kFusedItems; ++j) keys[j] = ranks[j] = -1;

  // 1. rank every assignment of the block's chunks among its expert (assignment order); written
  //    inline: as a device function of its own the ballot form spilled 8 bytes at 64 registers
  for (int e = threadIdx.x; e < E; e += kFusedThreads) s_run[e] = 0;
  for (int c = c_begin; c < c_end; ++c) {
    const int64_t base = static_cast<int64_t>(c) * kChunk + warp * kFusedPerWarp;
    int k[kFusedItems];
#pragma unroll
    for (int j = 0; j < kFusedItems; ++j) {  // loads first
      const int64_t a = base + j * 32 + lane;
      k[j] = a < assignments ? static_cast<int>(remap.local(load_index(ids, a))) : -1;
    }
    {  // kFusedWarps * E ints: a multiple of 4, in 16-byte stores
      int4* wc4 = reinterpret_cast<int4*>(s_wc);
      for (int i = threadIdx.x; i < kFusedWarps * E / 4; i += kFusedThreads) wc4[i] = make_int4(0, 0, 0, 0);
    }
    // the warp's lanes with an equal key (invalid ids: key E), first for every item (independent
    // of the counters: their latencies overlap)
    unsigned same[kFusedItems];
#pragma unroll
    for (int j = 0; j < kFusedItems; ++j) {
      if (!(k[j] >= 0 && k[j] < E)) k[j] = -1;
      same[j] = 0xffffffffu;
    }
    if constexpr (kBallot) {
      const int bits = 32 - __clz(E);  // keys 0..E
      for (int b = 0; b < bits; ++b) {
#pragma unroll
        for (int j = 0; j < kFusedItems; ++j) {
          const unsigned bit = (static_cast<unsigned>(k[j] >= 0 ? k[j] : E) >> b) & 1u;
          const unsigned v = __ballot_sync(0xffffffffu, bit);
          same[j] &= bit ? v : ~v;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kFusedItems; ++j) same[j] = __match_any_sync(0xffffffffu, k[j] >= 0 ? k[j] : E);
    }
    __syncthreads();
    int* my = s_wc + warp * E;
    int r[kFusedItems];
#pragma unroll
    for (int j = 0; j < kFusedItems; ++j) {
      const bool valid = k[j] >= 0;
      const int leader = __ffs(same[j]) - 1;
      int count = 0;
      if (lane == leader && valid) count = my[k[j]];
      count = __shfl_sync(0xffffffffu, count, leader);
      r[j] = count + __popc(same[j] & lower);
      if (lane == leader && valid) my[k[j]] = count + __popc(same[j]);
      __syncwarp();
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += kFusedThreads) {  // warp offsets on top of the block's run
      int n[kFusedWarps];
#pragma unroll
      for (int w = 0; w < kFusedWarps; ++w) n[w] = s_wc[w * E + e];  // loads first, then the stores
      int run = s_run[e];
#pragma unroll
      for (int w = 0; w < kFusedWarps; ++w) {
        s_wc[w * E + e] = run;
        run += n[w];
      }
      s_run[e] = run;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kFusedItems; ++j) {
      const int64_t a = base + j * 32 + lane;
      const int rank = k[j] >= 0 ? my[k[j]] + r[j] : -1;
      if (in_registers) {
        keys[j] = k[j];
        ranks[j] = rank;
      } else if (a < assignments) {
        local_rank[a] = rank;
      }
    }
    __syncthreads();  // s_wc is cleared for the next chunk
  }

  // 2. expert totals and this block's offsets
  int count = 0, before = 0;
  fused_expert_counts(E, cb, replica, replica_shift, packed_counts, block_counts, s_run, s_wc, count, before);
  const int e = threadIdx.x;
  const int padded = round_up_32(count, alignment);
  // real counts in the low word, padded in the high word: totals stay below 2^31, no carry
  const unsigned long long packed = (static_cast<unsigned long long>(padded) << 32) | static_cast<unsigned>(count);
  unsigned long long excl = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(packed, excl, total);
  const int real_excl = static_cast<int>(excl & 0xffffffffull), padded_excl = static_cast<int>(excl >> 32);
  int* s_pstart = s_wc;      // [E] padded start of e
  int* s_count = s_wc + E;   // [E] count of e
  if (e < E) {
    s_pos[e] = real_excl + before;
    s_row[e] = padded_excl + before;
    s_pstart[e] = padded_excl;
    s_count[e] = count;
  }
  plan_store_counts(e, E, count, padded, real_excl, padded_excl, total, s_totals, tokens_per_expert, bins,
                    padded_tokens, padded_bins, padded_total_out);
  __syncthreads();
  const int real_total = static_cast<int>(s_totals[0]);
  const int padded_total = static_cast<int>(s_totals[1]);

  // 3. place the block's assignments. From registers (one chunk a block), with at most two
  //    replicas (each placing 1024 or more): dest_rows in assignment order by the replica owning
  //    the warp, then the block's kept assignments put in sorted order (expert, rank) in shared
  //    memory and written in that order, a share per replica, so that consecutive threads write
  //    consecutive entries of an expert's segment of indices / bin_ids / row_sources (a few
  //    32-byte sectors a warp store instead of 32; measured at T=16384, K=8, E=256: 16.2 -> 13.6
  //    µs in a graph). With more replicas (few assignments each: decode) the extra scan and sort
  //    cost more than they save (7.9 -> 8.5 µs), and each warp's own items are placed directly.
  if (in_registers && replicas > 2) {
    if (c_begin < c_end && (warp & replica_mask) == replica) {
      const int base = c_begin * kChunk + warp * kFusedPerWarp;
#pragma unroll
      for (int j = 0; j < kFusedItems; ++j) {
        const int a = base + j * 32 + lane;
        if (a >= assignments) break;
        plan_place_one(a, keys[j], ranks[j], s_pos, s_row, real_total, indices, bin_ids, dest_rows, row_sources,
                       row_experts);
      }
    }
  } else if (in_registers) {
    const int chunk_base = c_begin * kChunk;
    const int base = chunk_base + warp * kFusedPerWarp;
    if (c_begin < c_end && (warp & replica_mask) == replica) {
#pragma unroll
      for (int j = 0; j < kFusedItems; ++j) {
        const int a = base + j * 32 + lane;
        if (a >= assignments) break;
        dest_rows[a] = ranks[j] < 0 ? -1 : static_cast<int32_t>(s_row[keys[j]] + ranks[j]);
        if (a >= real_total) {  // only when ids were dropped
          indices[a] = -1;
          bin_ids[a] = -1;
        }
      }
    }
    int* s_off = s_wc + 2 * E;  // [E] block-local start of e among the block's kept assignments
    const unsigned long long mine = e < E ? static_cast<unsigned long long>(s_run[e]) : 0ull;
    unsigned long long off = 0, kept = 0;
    Scan(scan_storage).ExclusiveSum(mine, off, kept);
    if (e < E) s_off[e] = static_cast<int>(off);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kFusedItems; ++j) {
      if (ranks[j] < 0) continue;
      const int slot = s_off[keys[j]] + ranks[j];
      s_sorted[slot] = static_cast<int>(base + j * 32 + lane - chunk_base);
      s_sorted_key[slot] = keys[j];
    }
    __syncthreads();
    const int n = static_cast<int>(kept);
    const int lo = (n * replica) >> replica_shift, hi = (n * (replica + 1)) >> replica_shift;
    for (int q = lo + static_cast<int>(threadIdx.x); q < hi; q += kFusedThreads) {
      const int key = s_sorted_key[q];
      const int rank = q - s_off[key];
      const int a = chunk_base + s_sorted[q];
      const int pos = s_pos[key] + rank;
      const int row = s_row[key] + rank;
      indices[pos] = static_cast<int32_t>(a);
      bin_ids[pos] = key;
      row_sources[row] = static_cast<int32_t>(a);
      if (row_experts != nullptr) row_experts[row] = key;
    }
  } else {
    for (int c = c_begin; c < c_end; ++c) {
      const int64_t base = static_cast<int64_t>(c) * kChunk + warp * kFusedPerWarp;
#pragma unroll
      for (int j = 0; j < kFusedItems; ++j) {
        const int64_t a = base + j * 32 + lane;
        if (a >= assignments) break;
        const int rank = local_rank[a];
        const int key = rank >= 0 ? static_cast<int>(remap.local(load_index(ids, a))) : -1;
        plan_place_one(static_cast<int>(a), key, rank, s_pos, s_row, real_total, indices, bin_ids, dest_rows,
                       row_sources, row_experts);
      }
    }
  }
  // 4. fills, over the whole grid
  plan_fills(s_pstart, s_count, E, alignment, padded_total, row_capacity, blocks, row_sources, padding_source,
             row_experts, block_experts);
}
}  // namespace
}  // namespace cuda
}  // namespace padmoe
