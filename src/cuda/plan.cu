// plan.cu — make_plan on the GPU: a stable counting sort by expert, no host
// synchronization.
//
// Fused (the default for E <= 512 and more than one chunk): one launch of 512-thread blocks; block b
// owns a contiguous run of 2048-assignment chunks. It ranks its assignments by
// warp matching (four per thread a chunk), publishes its per-expert counts,
// and, when the grid has more than one block, waits at a grid barrier (a
// cooperative launch, so every block is resident); then every block reads
// the [blocks, E] counts (L2), scans the expert totals (one block scan of
// packed real / padded counts) and places its assignments from registers
// (one chunk a block) or from the ranks it left in the workspace (more). With
// one chunk (PADMOE_CUDA_PLAN_SMALL=0, or set_plan_kernel(N > 0)) there is no
// barrier and nothing goes through global memory between the phases.
//
// Small (one chunk: A <= 2048, E <= 512, the decode sizes): one launch of 32 blocks, each placing
// half of one warp's 128 assignments; counts by shared-memory integer atomics, ranks from ballots
// (plan_small_kernel below). PADMOE_CUDA_PLAN_SMALL=0 sends these sizes to the fused kernel.
//
// Split (E > 512, or PADMOE_CUDA_PLAN=split): two launches,
//   1. count: each block takes a chunk of kChunk assignment ids and writes
//             every assignment's rank among its expert inside the chunk and
//             the chunk's per-expert counts. Up to kMatchMaxExperts experts a
//             warp ranks 32 ids at a time with __match_any_sync against
//             per-warp counters in shared memory; above that the chunk is
//             sorted with cub::BlockRadixSort (stable).
//   2. place: every block reads the [chunks, E] counts (L2-resident), forms
//             the expert totals, the block-wide scans (bins, padded bins) and
//             its own chunk's offsets, then places its assignments: indices,
//             bin_ids, dest_rows, row_sources. Block 0 writes the count
//             vectors; the blocks share the -1 fill of row_sources (padding
//             rows and rows at or past P), each entry written once.
// Stability: chunks are in assignment order and ranks inside a chunk follow
// assignment order.
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

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

// Places assignment a of expert `key` at rank `rank` among its expert (rank < 0: dropped):
// indices / bin_ids at its sorted position, dest_rows, row_sources and row_experts at its padded
// row; positions past the kept total (only when ids were dropped) get indices = bin_ids = -1.
// Every position and row is below 2^31 (the plan's arrays are int32).
__device__ __forceinline__ void plan_place_one(int a, int key, int rank, const int* s_pos, const int* s_row,
                                               int real_total, int32_t* indices, int32_t* bin_ids,
                                               int32_t* dest_rows, int32_t* row_sources, int32_t* row_experts) {
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

__global__ void __launch_bounds__(kPlaceThreads)
    plan_place_kernel(IndexRef ids, index::ExpertRemap remap, int64_t assignments, int chunks, int num_experts, int alignment,
                      const int32_t* chunk_counts, const int32_t* local_rank, int64_t row_capacity,
                      int32_t* tokens_per_expert, int32_t* bins, int32_t* padded_tokens, int32_t* padded_bins,
                      int32_t* indices, int32_t* bin_ids, int32_t* dest_rows, int32_t* row_sources,
                      int32_t padding_source, int32_t* row_experts, int32_t* block_experts, int64_t blocks,
                      int32_t* padded_total_out) {
  pdl_begin();
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
      block_experts[b] = index::block_expert_past_end(padding_source);
    }
  }
}


// --- fused: one launch -----------------------------------------------------------
constexpr int kFusedThreads = 512;
constexpr int kFusedWarps = kFusedThreads / 32;
constexpr int kFusedItems = kChunk / kFusedThreads;        // assignments a thread ranks per chunk
constexpr int kFusedPerWarp = kChunk / kFusedWarps;        // a warp's contiguous slice of a chunk
constexpr int kFusedMaxExperts = kFusedThreads;            // one expert per thread in the scan
static_assert(kFusedItems * 32 == kFusedPerWarp, "fused plan: a warp's slice is kFusedItems rounds of 32");

size_t fused_smem_bytes(int num_experts) { return static_cast<size_t>(kFusedWarps + 3) * num_experts * sizeof(int); }

// The fills of a fused or small plan launch, over the whole grid: expert e's padding rows and
// blocks by block e mod grid, a warp an expert (s_pstart[e]: e's first padded row, s_count[e]: its
// count); rows and blocks at or past P strided over the grid (32-bit unsigned counters: every
// index is below 2^31, and index + stride cannot wrap).
__device__ __forceinline__ void plan_fills(const int* s_pstart, const int* s_count, int E, int alignment,
                                           int padded_total, int64_t row_capacity, int64_t blocks,
                                           int32_t* row_sources, int32_t padding_source, int32_t* row_experts,
                                           int32_t* block_experts) {
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
      block_experts[b] = index::block_expert_past_end(padding_source);
    }
  }
}

// Block 0 writes the plan's count vectors for expert e (real and padded count, their inclusive
// sums) and P; every block keeps the real and padded totals in s_totals (fused and small kernels).
template <typename Total>
__device__ __forceinline__ void plan_store_counts(int e, int E, int count, int padded, int real_excl,
                                                  int padded_excl, unsigned long long total, Total* s_totals,
                                                  int32_t* tokens_per_expert, int32_t* bins, int32_t* padded_tokens,
                                                  int32_t* padded_bins, int32_t* padded_total_out) {
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

// kBallot: the warp's equal keys found by one ballot a key bit (ALU work at full rate) instead
// of __match_any_sync, whose latency grows with the distinct keys in the warp (about 30 of 32 at
// E = 256); plan_ballot() chooses.
template <bool kBallot>
__global__ void __launch_bounds__(kFusedThreads, 2)  // two blocks an SM (64 registers), as the residency assumes
    plan_fused_kernel(IndexRef ids, index::ExpertRemap remap, int64_t assignments, int chunks, int chunks_per_block,
                      int replica_shift, int num_experts, int alignment, int32_t* block_counts, int32_t* local_rank,
                      int64_t row_capacity, int32_t* tokens_per_expert, int32_t* bins, int32_t* padded_tokens,
                      int32_t* padded_bins, int32_t* indices, int32_t* bin_ids, int32_t* dest_rows,
                      int32_t* row_sources, int32_t padding_source, int32_t* row_experts, int32_t* block_experts,
                      int64_t blocks, int32_t* padded_total_out, int packed_counts) {
  pdl_begin();
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

  // 1. rank every assignment of the block's chunks among its expert (assignment order)
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
          block_counts[static_cast<int64_t>(cb) * EP + q] = static_cast<int32_t>(static_cast<unsigned>(s_run[2 * q]) | (hi << 16));
        }
      } else {
        for (int e = threadIdx.x; e < E; e += kFusedThreads) block_counts[static_cast<int64_t>(cb) * E + e] = s_run[e];
      }
    }
    cooperative_groups::this_grid().sync();
  }
  const int e = threadIdx.x;
  int count = 0, before = 0;
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
static_assert(kFusedItems == 4, "small plan: round_shift splits a warp's 4 rounds");
constexpr int kSmallKeyBits = 10;  // keys 0..E with E <= 512 (E: an invalid id)
static_assert(kFusedMaxExperts < (1 << kSmallKeyBits), "small plan: the key bits hold E");

size_t small_smem_bytes(int num_experts) { return static_cast<size_t>(4) * num_experts * sizeof(int); }

__global__ void __launch_bounds__(kFusedThreads)
    plan_small_kernel(IndexRef ids, index::ExpertRemap remap, int assignments, int num_experts, int alignment,
                      int round_shift, int64_t row_capacity, int32_t* tokens_per_expert, int32_t* bins, int32_t* padded_tokens,
                      int32_t* padded_bins, int32_t* indices, int32_t* bin_ids, int32_t* dest_rows,
                      int32_t* row_sources, int32_t padding_source, int32_t* row_experts, int32_t* block_experts,
                      int64_t blocks, int32_t* padded_total_out) {
  pdl_begin();
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

// Per device: whether cooperative launches work, and how many fused blocks fit at once
// (for the smem of E rounded up to a power of two), found once.
constexpr int kMaxDevices = 64;
constexpr int kSmemBuckets = 5;  // E <= 32, 64, ..., 512
struct FusedLimits {
  std::atomic<int> resident[kSmemBuckets];  // 0: not asked yet; -1: no cooperative launch
  std::atomic<int> sms{0};
  std::once_flag attr_once;
};
FusedLimits g_fused[kMaxDevices];

int fused_bucket(int num_experts) {
  int b = 0;
  while (b + 1 < kSmemBuckets && (32 << b) < num_experts) ++b;
  return b;
}

// Blocks of the fused kernel resident at once on the current device (0: use the split path);
// *sms: its multiprocessors.
int fused_resident_blocks(int num_experts, int* sms_out) {
  int dev = 0;
  PADMOE_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return 0;
  FusedLimits& f = g_fused[dev];
  std::call_once(f.attr_once, [] {
    for (auto kernel : {plan_fused_kernel<true>, plan_fused_kernel<false>}) {
      PADMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(fused_smem_bytes(kFusedMaxExperts))));
    }
  });
  const int bucket = fused_bucket(num_experts);
  int n = f.resident[bucket].load(std::memory_order_relaxed);
  if (n == 0) {
    int coop = 0, sms = 0, per_sm = 0;
    PADMOE_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
    PADMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    PADMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, plan_fused_kernel<true>, kFusedThreads,
                                                                    fused_smem_bytes(32 << bucket)));
    n = coop != 0 && per_sm > 0 ? per_sm * sms : -1;
    f.sms.store(sms, std::memory_order_relaxed);
    f.resident[bucket].store(n, std::memory_order_relaxed);
  }
  *sms_out = f.sms.load(std::memory_order_relaxed);
  return n > 0 ? n : 0;
}

// PADMOE_CUDA_PLAN: "split" forces the two-launch path; "fused:N" caps the fused grid at N blocks
// (several chunks a block); read once. set_plan_kernel overrides it (tests, benchmarks).
std::atomic<int> g_plan_mode{-2};  // -2: not read; -1: split; 0: fused; N > 0: fused, at most N blocks

// PADMOE_CUDA_PLAN_REPLICAS=N: blocks ranking each chunk (a power of two up to 16; default 0,
// chosen from the multiprocessor count); read once.
int plan_replicas() {
  static const int r = [] {
    const char* v = std::getenv("PADMOE_CUDA_PLAN_REPLICAS");
    int n = v != nullptr ? std::atoi(v) : 0;
    int p = 0;
    if (n > 0) {
      p = 1;
      while (p * 2 <= n && p * 2 <= kFusedWarps) p *= 2;
    }
    return p;
  }();
  return r;
}

// How the fused kernel finds equal keys in a warp: a ballot a key bit for E >= 64, where a warp
// holds many distinct experts, __match_any_sync below (measured on the H200, graph us, ballot
// against match: E = 256 decode 6.2 / 7.0, deepseek-v3 10.8 / 11.8, qwen3 (E = 128) 9.8 / 10.7;
// E = 32 of 256 (make_plan(ep), most ids another rank's: few distinct keys) decode 5.8 / 5.2;
// E = 8 equal). PADMOE_CUDA_PLAN_MATCH=hw / ballot forces one; read once.
std::atomic<int> g_plan_match{-2};  // -2: not set by set_plan_match
bool plan_ballot(int num_experts) {
  static const int env = [] {
    const char* v = std::getenv("PADMOE_CUDA_PLAN_MATCH");
    if (v == nullptr) return -1;
    const std::string m(v);
    return m == "hw" ? 0 : (m == "ballot" ? 1 : -1);
  }();
  const int set = g_plan_match.load(std::memory_order_relaxed);
  const int forced = set != -2 ? set : env;
  return forced >= 0 ? forced == 1 : num_experts >= 64;
}

// PADMOE_CUDA_PLAN_SMALL: 0 sends one chunk (A <= 2048) to the fused kernel instead of the small
// one; 16, 32 or 64 the small kernel's blocks (a warp's rounds over 1, 2 or 4 blocks). Measured on
// the H200 at decode (graph us): 16 / 32 / 64 blocks 5.1 / 4.9 / 5.0, so 32 by default; read
// once. Returns the round shift, or -1 for the fused kernel.
std::atomic<int> g_plan_small{-2};  // -2: not set by set_plan_small
int small_shift_of(int blocks) { return blocks == 0 ? -1 : (blocks >= 64 ? 2 : (blocks >= 32 ? 1 : 0)); }
int plan_small_shift() {
  const int set = g_plan_small.load(std::memory_order_relaxed);
  if (set != -2) return set;
  static const int shift = [] {
    const char* v = std::getenv("PADMOE_CUDA_PLAN_SMALL");
    return v == nullptr ? 1 : small_shift_of(std::atoi(v));
  }();
  return shift;
}

// The fused plan's per-block counts as 16-bit pairs (a block's counts below 2^16: at most 31
// chunks a block): -1 the default (on where they fit, for E >= 64), 0 off. PADMOE_CUDA_PLAN_PACKED=0
// (read once) or set_plan_packed (tests). Measured on the H200 (2026-12-03, graph us, packed
// against not): deepseek-v3 10.7-10.8 / 11.1-11.3, qwen3-30b-a3b (E = 128) 9.6 / 10.0,
// mixtral-8x7b (E = 8) 7.3 / 7.1, hence E >= 64 (nothing between 8 and 128 measured).
std::atomic<int> g_plan_packed{-2};  // -2: not set by set_plan_packed
bool plan_packed(int chunks_per_block, int num_experts) {
  static const int env = [] {
    const char* v = std::getenv("PADMOE_CUDA_PLAN_PACKED");
    return v != nullptr && std::atoi(v) == 0 ? 0 : -1;
  }();
  const int set = g_plan_packed.load(std::memory_order_relaxed);
  const int mode = set != -2 ? set : env;
  if (mode == 0 || static_cast<int64_t>(chunks_per_block) * kChunk > 0xffff) return false;
  return set == 1 || num_experts >= 64;
}

int plan_mode() {
  int m = g_plan_mode.load(std::memory_order_relaxed);
  if (m != -2) return m;
  m = 0;
  if (const char* v = std::getenv("PADMOE_CUDA_PLAN")) {
    const std::string s(v);
    if (s == "split") m = -1;
    else if (s.rfind("fused:", 0) == 0) m = std::max(1, std::atoi(s.c_str() + 6));
  }
  g_plan_mode.store(m, std::memory_order_relaxed);
  return m;
}

// Fixed capacity: block e < E takes expert e's sorted assignments of the full
// plan (alignment 1, every kept id) and keeps C of them, in order: the first
// C, or (by_probs) the C largest probs, found by an 8-bit radix select of the
// C-th largest key, ties to the lower assignment id. Every block also shares
// the grid-wide fills (dropped assignments of other experts, positions past
// the kept total, rows and blocks past P = E * C).
constexpr int kCapThreads = 1024;  // one block per expert: the whole block walks its segment

__device__ __forceinline__ uint32_t order_key(float f) {  // larger float, larger key (IEEE totalOrder)
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kCapThreads)
    plan_capacity_kernel(const int32_t* f_indices, const int32_t* f_counts, const int32_t* f_dest, int64_t assignments,
                         int num_experts, ScaleArg probs, int64_t cap, bool by_probs, int alignment,
                         int64_t row_capacity, int32_t* tokens_per_expert, int32_t* bins, int32_t* padded_tokens,
                         int32_t* padded_bins, int32_t* indices, int32_t* bin_ids, int32_t* dest_rows,
                         int32_t* row_sources, int32_t padding_source, int32_t* row_experts, int32_t* block_experts,
                         int64_t blocks, int32_t* padded_total_out, int32_t* dropped) {
  pdl_begin();
  using Scan = cub::BlockScan<int, kCapThreads>;
  using Reduce = cub::BlockReduce<long long, kCapThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } storage;
  __shared__ int s_hist[256];
  __shared__ long long s_sums[4];  // full start, kept start, kept total, dropped total
  __shared__ uint32_t s_select[2];  // digit found, still needed
  const int e = blockIdx.x;
  // Starts of this expert's segments (full and kept) and the kept / dropped totals.
  long long f_before = 0, k_before = 0, k_all = 0, d_all = 0;
  for (int x = threadIdx.x; x < num_experts; x += kCapThreads) {
    const long long n = f_counts[x], kept = n < cap ? n : cap;
    if (x < e) {
      f_before += n;
      k_before += kept;
    }
    k_all += kept;
    d_all += n - kept;
  }
  long long sums[4] = {f_before, k_before, k_all, d_all};
  for (int q = 0; q < 4; ++q) {
    const long long v = Reduce(storage.reduce).Sum(sums[q]);
    if (threadIdx.x == 0) s_sums[q] = v;
    __syncthreads();
  }
  const int64_t full_start = s_sums[0], kept_start = s_sums[1], kept_total = s_sums[2];
  const int64_t padded_total = static_cast<int64_t>(num_experts) * cap;

  if (e < num_experts) {
    const int32_t* seg = f_indices + full_start;
    const int64_t n = f_counts[e];
    const int64_t kept = n < cap ? n : cap;
    if (threadIdx.x == 0) {
      tokens_per_expert[e] = static_cast<int32_t>(kept);
      bins[e] = static_cast<int32_t>(kept_start + kept);
      padded_tokens[e] = static_cast<int32_t>(cap);
      padded_bins[e] = static_cast<int32_t>((e + 1) * cap);
    }
    const bool select = by_probs && n > cap;
    uint32_t threshold = 0, equal_kept = 0;
    if (select) {
      uint32_t prefix = 0, mask = 0, need = static_cast<uint32_t>(cap);
      for (int shift = 24; shift >= 0 && need > 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += kCapThreads) s_hist[d] = 0;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < n; i += kCapThreads) {
          const uint32_t k = order_key(load_scale(probs, seg[i]));
          if ((k & mask) == prefix) atomicAdd(&s_hist[(k >> shift) & 255u], 1);  // integer counts: exact
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          uint32_t above = 0;
          int d = 255;
          for (; d > 0; --d) {
            if (above + static_cast<uint32_t>(s_hist[d]) >= need) break;
            above += static_cast<uint32_t>(s_hist[d]);
          }
          s_select[0] = static_cast<uint32_t>(d);
          s_select[1] = need - above;
        }
        __syncthreads();
        prefix |= s_select[0] << shift;
        mask |= 255u << shift;
        need = s_select[1];
        __syncthreads();
      }
      threshold = prefix;
      equal_kept = need;  // cap == 0: need 0 from the start, nothing kept
      if (cap == 0) threshold = 0xffffffffu;
    }
    // Keep pass in assignment order: rank among the kept by two block scans a round.
    int64_t kept_run = 0, equal_run = 0;
    for (int64_t base = 0; base < n; base += kCapThreads) {
      const int64_t i = base + threadIdx.x;
      const bool in = i < n;
      const int32_t a = in ? seg[i] : -1;
      bool keep = in && i < cap;
      if (select) {
        const uint32_t k = in ? order_key(load_scale(probs, a)) : 0;
        const int eq = in && k == threshold && cap > 0;
        int eq_excl = 0, eq_total = 0;
        Scan(storage.scan).ExclusiveSum(eq, eq_excl, eq_total);
        __syncthreads();
        keep = in && cap > 0 && (k > threshold || (eq && equal_run + eq_excl < static_cast<int64_t>(equal_kept)));
        equal_run += eq_total;
      }
      int r_excl = 0, r_total = 0;
      Scan(storage.scan).ExclusiveSum(keep ? 1 : 0, r_excl, r_total);
      __syncthreads();
      if (in) {
        if (keep) {
          const int64_t r = kept_run + r_excl;
          const int64_t pos = kept_start + r, row = e * cap + r;
          indices[pos] = a;
          bin_ids[pos] = e;
          dest_rows[a] = static_cast<int32_t>(row);
          row_sources[row] = a;
          if (row_experts != nullptr) row_experts[row] = e;
        } else {
          dest_rows[a] = -1;
        }
      }
      kept_run += r_total;
    }
    for (int64_t row = e * cap + kept + threadIdx.x; row < (e + 1) * cap; row += kCapThreads) {
      row_sources[row] = padding_source;
      if (row_experts != nullptr) row_experts[row] = -1;
    }
    if (block_experts != nullptr) {  // segments are whole blocks: alignment divides C
      for (int64_t b = e * cap / alignment + threadIdx.x; b < (e + 1) * cap / alignment; b += kCapThreads) {
        block_experts[b] = e;
      }
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (padded_total_out != nullptr) *padded_total_out = static_cast<int32_t>(padded_total);
    if (dropped != nullptr) *dropped = static_cast<int32_t>(s_sums[3]);
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCapThreads;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kCapThreads + threadIdx.x;
  for (int64_t a = start; a < assignments; a += stride) {
    if (f_dest[a] < 0) dest_rows[a] = -1;  // dropped before the capacity (not a local expert's)
    if (a >= kept_total) {
      indices[a] = -1;
      bin_ids[a] = -1;
    }
  }
  for (int64_t r = padded_total + start; r < row_capacity; r += stride) {
    row_sources[r] = padding_source;
    if (row_experts != nullptr) row_experts[r] = -1;
  }
  if (block_experts != nullptr) {
    for (int64_t b = padded_total / alignment + start; b < blocks; b += stride) {
      block_experts[b] = index::block_expert_past_end(padding_source);
    }
  }
}

}  // namespace

void set_plan_match(int mode) { g_plan_match.store(mode < -1 || mode > 1 ? -1 : mode, std::memory_order_relaxed); }

void set_plan_small(int blocks) {
  g_plan_small.store(blocks < 0 ? -2 : small_shift_of(blocks), std::memory_order_relaxed);
}

void set_plan_packed(int mode) { g_plan_packed.store(mode == 0 || mode == 1 ? mode : -2, std::memory_order_relaxed); }

void set_plan_kernel(int mode) { g_plan_mode.store(mode < -1 ? -1 : mode, std::memory_order_relaxed); }

void make_plan(IndexRef top_experts, int64_t assignments, int top_k, int num_experts, int alignment,
               const PlanView& out, const PlanLayouts& layouts, int32_t padding_source,
               const index::ExpertRemap& remap, int64_t row_capacity, void* workspace, void* stream) {
  (void)top_k;
  const cudaStream_t s = as_stream(stream);
  const int chunks = static_cast<int>(index::ceil_div(assignments, kChunk));
  int32_t* chunk_counts = static_cast<int32_t*>(workspace);
  int32_t* local_rank = chunk_counts + static_cast<int64_t>(chunks) * num_experts;
  const int mode = plan_mode();
  const int small_shift = plan_small_shift();
  if (mode == 0 && chunks <= 1 && num_experts >= 1 && num_experts <= kFusedMaxExperts && small_shift >= 0) {
    launch_kernel("plan_small_kernel", plan_small_kernel, kSmallBlocks << small_shift, kFusedThreads,
        small_smem_bytes(num_experts), s, top_experts, remap, static_cast<int>(assignments), num_experts, alignment,
        small_shift, row_capacity,
        out.tokens_per_expert.data_as<int32_t>(), out.bins.data_as<int32_t>(),
        out.padded_tokens_per_expert.data_as<int32_t>(), out.padded_bins.data_as<int32_t>(),
        out.indices.data_as<int32_t>(), out.bin_ids.data_as<int32_t>(), out.dest_rows.data_as<int32_t>(),
        out.row_sources.data_as<int32_t>(), padding_source, layouts.row_experts.data_as<int32_t>(),
        layouts.block_experts.data_as<int32_t>(), layouts.block_experts.numel(),
        layouts.padded_total.data_as<int32_t>());
    return;
  }
  int sms = 0;
  const int resident = mode >= 0 && num_experts >= 1 && num_experts <= kFusedMaxExperts
                           ? fused_resident_blocks(num_experts, &sms) : 0;
  if (resident > 0) {
    const int limit = mode > 0 ? std::min(mode, resident) : resident;
    const int per_block = chunks > limit ? static_cast<int>(index::ceil_div(chunks, limit)) : 1;
    const int distinct = chunks > 0 ? static_cast<int>(index::ceil_div(chunks, per_block)) : 1;
    // replicas: a power of two up to 16 so that about one block per multiprocessor runs
    int replicas = 1;
    const int want = plan_replicas();
    if (per_block == 1 && chunks > 0) {
      if (want > 0) {
        replicas = want;
      } else {
        while (replicas < kFusedWarps && distinct * replicas * 2 <= std::max(sms, 1)) replicas *= 2;
      }
      while (replicas > 1 && distinct * replicas > resident) replicas /= 2;
    }
    const int grid = distinct * replicas;
    int shift = 0;
    while ((1 << shift) < replicas) ++shift;
    const size_t smem = fused_smem_bytes(num_experts);
    // block counts [grid, E] then the ranks [A]: inside plan_workspace_bytes (grid <= chunks)
    int32_t* block_counts = chunk_counts;
    int32_t* tokens = out.tokens_per_expert.data_as<int32_t>();
    int32_t* bins = out.bins.data_as<int32_t>();
    int32_t* ptokens = out.padded_tokens_per_expert.data_as<int32_t>();
    int32_t* pbins = out.padded_bins.data_as<int32_t>();
    int32_t* indices = out.indices.data_as<int32_t>();
    int32_t* bin_ids = out.bin_ids.data_as<int32_t>();
    int32_t* dest = out.dest_rows.data_as<int32_t>();
    int32_t* rows = out.row_sources.data_as<int32_t>();
    int32_t* row_experts = layouts.row_experts.data_as<int32_t>();
    int32_t* block_experts = layouts.block_experts.data_as<int32_t>();
    int64_t blocks = layouts.block_experts.numel();
    int32_t* total = layouts.padded_total.data_as<int32_t>();
    IndexRef ids = top_experts;
    index::ExpertRemap rm = remap;
    int64_t a_count = assignments;
    int n_chunks = chunks, n_experts = num_experts, align = alignment;
    int32_t pad_src = padding_source;
    int64_t capacity = row_capacity;
    int packed = plan_packed(per_block, num_experts) ? 1 : 0;
    auto* fused = plan_ballot(num_experts) ? plan_fused_kernel<true> : plan_fused_kernel<false>;
    if (distinct == 1) {  // no grid barrier: an ordinary launch
      launch_kernel("plan_fused_kernel", fused, grid, kFusedThreads, smem, s, ids, rm, a_count, n_chunks,
          per_block, shift, n_experts, align, block_counts, local_rank, capacity, tokens, bins, ptokens, pbins,
          indices, bin_ids, dest, rows, pad_src, row_experts, block_experts, blocks, total, packed);
    } else {
      int pb = per_block, reps = shift;
      void* args[] = {&ids,     &rm,        &a_count, &n_chunks, &pb,     &reps,    &n_experts,     &align,
                      &block_counts, &local_rank, &capacity, &tokens, &bins,   &ptokens,  &pbins,
                      &indices, &bin_ids,   &dest,    &rows,     &pad_src, &row_experts, &block_experts,
                      &blocks,  &total,      &packed};
      const cudaError_t err = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(fused),
                                                          dim3(grid), dim3(kFusedThreads), args, smem, s);
      if (err == cudaErrorCooperativeLaunchTooLarge) {
        // fewer multiprocessors than the device reports (MPS limits, green contexts): the split
        // launches from now on, for this device
        cudaGetLastError();
        int dev = 0;
        if (cudaGetDevice(&dev) == cudaSuccess && dev >= 0 && dev < kMaxDevices) {
          for (auto& r : g_fused[dev].resident) r.store(-1, std::memory_order_relaxed);
        }
      } else {
        PADMOE_CUDA_CHECK(err);
        return;
      }
    }
    if (distinct == 1) return;
  }
  if (chunks > 0) {
    if (num_experts <= kMatchMaxExperts) {
      const size_t smem = static_cast<size_t>(kCountThreads / 32) * num_experts * sizeof(int);
      launch_kernel("plan_count_match_kernel", plan_count_match_kernel, chunks, kCountThreads, smem, s, top_experts,
          remap, assignments, num_experts, chunk_counts, local_rank);
    } else {
      const size_t smem = static_cast<size_t>(num_experts) * sizeof(int);
      if (smem > 48 * 1024) {
        PADMOE_CUDA_CHECK(cudaFuncSetAttribute(plan_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem)));
      }
      launch_kernel("plan_count_kernel", plan_count_kernel, chunks, kCountThreads, smem, s, top_experts, remap,
          assignments, num_experts, key_bits(num_experts), chunk_counts, local_rank);
    }
  }
  const size_t smem = static_cast<size_t>(3) * num_experts * sizeof(int);
  if (smem > 32 * 1024) {  // with the kernel's static shared memory the total may pass 48 KiB
    PADMOE_CUDA_CHECK(cudaFuncSetAttribute(plan_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
  }
  launch_kernel("plan_place_kernel", plan_place_kernel, chunks > 0 ? chunks : 1, kPlaceThreads, smem, s, top_experts,
      remap, assignments, chunks, num_experts, alignment, chunk_counts, local_rank, row_capacity,
      out.tokens_per_expert.data_as<int32_t>(), out.bins.data_as<int32_t>(),
      out.padded_tokens_per_expert.data_as<int32_t>(), out.padded_bins.data_as<int32_t>(),
      out.indices.data_as<int32_t>(), out.bin_ids.data_as<int32_t>(), out.dest_rows.data_as<int32_t>(),
      out.row_sources.data_as<int32_t>(), padding_source, layouts.row_experts.data_as<int32_t>(),
      layouts.block_experts.data_as<int32_t>(), layouts.block_experts.numel(), layouts.padded_total.data_as<int32_t>());
}

void apply_capacity(const PlanView& full, int64_t assignments, int num_experts, ScaleArg probs, int64_t capacity,
                    bool by_probs, int alignment, const PlanView& out, const PlanLayouts& layouts,
                    int32_t padding_source, int64_t row_capacity, int32_t* dropped, void* stream) {
  const int grid = num_experts > 0 ? num_experts : 1;
  launch_kernel("plan_capacity_kernel", plan_capacity_kernel, grid, kCapThreads, 0, as_stream(stream),
      full.indices.data_as<const int32_t>(), full.tokens_per_expert.data_as<const int32_t>(),
      full.dest_rows.data_as<const int32_t>(), assignments, num_experts, probs, capacity, by_probs, alignment,
      row_capacity, out.tokens_per_expert.data_as<int32_t>(), out.bins.data_as<int32_t>(),
      out.padded_tokens_per_expert.data_as<int32_t>(), out.padded_bins.data_as<int32_t>(),
      out.indices.data_as<int32_t>(), out.bin_ids.data_as<int32_t>(), out.dest_rows.data_as<int32_t>(),
      out.row_sources.data_as<int32_t>(), padding_source, layouts.row_experts.data_as<int32_t>(),
      layouts.block_experts.data_as<int32_t>(), layouts.block_experts.numel(), layouts.padded_total.data_as<int32_t>(),
      dropped);
}

}  // namespace cuda
}  // namespace padmoe
