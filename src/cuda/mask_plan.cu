// mask_plan.cu — a plan from a routing mask [T, E] (TransformerEngine's mask map) on the GPU, in
// one, two or three launches over tiles of 32 tokens. A block reads a tile's 32 x E bytes
// coalesced and ORs each set byte into a per-expert 32-bit mask of the tile's tokens in shared
// memory (OR commutes: the masks do not depend on the order of the atomics); then:
//   1. count: per chunk of tiles, each expert's routed tokens (the masks' popcounts); the blocks
//      also fill row_sources (and indices, bin_ids) with -1 and the moved probs with 0;
//   2. scan:  per expert (a warp each), the exclusive sum of its chunk counts, and its count;
//      for a grid of few chunks (policy::mask_scan_fused) no launch: each place block sums the
//      chunk counts it needs itself;
//   3. place: per chunk, every block scans the (padded) counts over the experts itself, then for
//      each tile a warp a token writes the token's dest_rows, row_sources (and the probs moved
//      with them, and their nonzero flags), sorted positions and TE's row_id_map row (experts
//      descending, compacted with a ballot). A chunk of one tile may be split over 2 or 4 blocks
//      (slices), each placing its share of the tile's tokens.
// The count kernel runs on the same grid: slice 0 of a chunk counts, every block fills.
// One launch (where policy::mask_one_launch_fits, the decode sizes): the count and place phases in
// one cooperative launch with a grid barrier between them; each block keeps its tile's masks from
// the count phase for the placement.
// dest_rows and row_id_map rows are written by consecutive lanes; the result does not depend on
// the schedule.
#include <cooperative_groups.h>

#include <cub/block/block_scan.cuh>

#include "core/kernel_policy.hpp"
#include "cuda/common.cuh"

namespace padmoe {
namespace cuda {
namespace {

constexpr int kTile = policy::kMaskTile;
constexpr int kThreads = policy::kMaskThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kProbLoads = policy::kMaskLoads;  // a place lane's prob loads in flight together

// s_mask[e] = the tokens of the tile at t0 routed to e, bit tl for token t0 + tl. A word a slot
// where `words` (E a multiple of 4 and the map 4-byte aligned: a word is 4 experts of one token),
// else a byte a slot; each thread loads kMaskLoads slots before it ORs any, so that its loads are
// in flight together. Starts and ends with a barrier.
__device__ void tile_masks(const uint8_t* __restrict__ map, int64_t t0, int64_t tokens, int experts, bool words,
                           uint32_t* s_mask) {
  constexpr int kLoads = policy::kMaskLoads;
  for (int e = threadIdx.x; e < experts; e += kThreads) s_mask[e] = 0u;
  __syncthreads();
  const int64_t n = tokens - t0 < kTile ? tokens - t0 : kTile;
  const uint8_t* base = map + t0 * experts;
  const int64_t bytes = n * experts;
  if (words) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(base);
    const int64_t count = bytes / 4;
    for (int64_t i0 = threadIdx.x; i0 < count; i0 += kLoads * kThreads) {
      uint32_t v[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t i = i0 + static_cast<int64_t>(u) * kThreads;
        v[u] = i < count ? __ldg(w + i) : 0u;
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        if (v[u] == 0u) continue;
        const int64_t b = 4 * (i0 + static_cast<int64_t>(u) * kThreads);
        const int tl = static_cast<int>(b / experts), e = static_cast<int>(b % experts);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if ((v[u] >> (8 * j)) & 0xffu) atomicOr(&s_mask[e + j], 1u << tl);
        }
      }
    }
  } else {
    for (int64_t i0 = threadIdx.x; i0 < bytes; i0 += kLoads * kThreads) {
      uint8_t v[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t i = i0 + static_cast<int64_t>(u) * kThreads;
        v[u] = i < bytes ? __ldg(base + i) : uint8_t{0};
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t i = i0 + static_cast<int64_t>(u) * kThreads;
        if (v[u] != 0) atomicOr(&s_mask[i % experts], 1u << (i / experts));
      }
    }
  }
  __syncthreads();
}

// The raw bits of assignment a's prob (backend::MovedProbs), and row d of the moved probs.
__device__ __forceinline__ uint32_t prob_bits(const backend::MovedProbs& p, int64_t a) {
  return p.bytes == 4 ? static_cast<const uint32_t*>(p.probs)[a] : static_cast<const uint16_t*>(p.probs)[a];
}
__device__ __forceinline__ void store_prob(const backend::MovedProbs& p, int64_t d, uint32_t bits) {
  if (p.bytes == 4) static_cast<uint32_t*>(p.moved)[d] = bits;
  else static_cast<uint16_t*>(p.moved)[d] = static_cast<uint16_t>(bits);
}
__device__ __forceinline__ void zero_prob(const backend::MovedProbs& p, int64_t d) {
  if (p.bytes == 4) static_cast<uint32_t*>(p.moved)[d] = 0u;
  else static_cast<uint16_t*>(p.moved)[d] = 0u;
}

// The fills before any placement, shared over the grid: row_sources -1 and the moved probs 0 (rows
// no token reaches keep them), indices and bin_ids -1 (where set).
__device__ void fill_unplaced(int32_t* __restrict__ row_sources, int64_t sources_len, int32_t* __restrict__ indices,
                              int32_t* __restrict__ bin_ids, int64_t assignments, const backend::MovedProbs& probs) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t r = start; r < sources_len; r += stride) row_sources[r] = -1;
  if (probs.probs != nullptr) {
    for (int64_t r = start; r < sources_len; r += stride) zero_prob(probs, r);
  }
  if (indices == nullptr) return;
  for (int64_t i = start; i < assignments; i += stride) indices[i] = bin_ids[i] = -1;
}

// Shared memory: the masks and the counts, two arrays of E entries.
__global__ void __launch_bounds__(kThreads)
    mask_count_kernel(const uint8_t* __restrict__ map, int64_t tokens, int experts, bool words, int64_t tiles_per_chunk,
                      int slices, int32_t* __restrict__ chunk_counts, int32_t* __restrict__ row_sources,
                      int64_t sources_len, int32_t* __restrict__ indices, int32_t* __restrict__ bin_ids,
                      int64_t assignments, backend::MovedProbs probs) {
  pdl_begin();
  extern __shared__ int32_t s_mem[];
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(s_mem);
  int32_t* s_count = s_mem + experts;
  if (static_cast<int>(blockIdx.x) % slices == 0) {  // uniform across the block
    const int64_t chunk = blockIdx.x / slices;
    const int64_t first = chunk * tiles_per_chunk * kTile;
    for (int e = threadIdx.x; e < experts; e += kThreads) s_count[e] = 0;
    for (int64_t tile = 0; tile < tiles_per_chunk; ++tile) {
      const int64_t t0 = first + tile * kTile;
      if (t0 >= tokens) break;  // uniform across the block
      tile_masks(map, t0, tokens, experts, words, s_mask);
      for (int e = threadIdx.x; e < experts; e += kThreads) s_count[e] += __popc(s_mask[e]);  // e's own thread
    }
    for (int e = threadIdx.x; e < experts; e += kThreads) chunk_counts[chunk * experts + e] = s_count[e];
  }
  fill_unplaced(row_sources, sources_len, indices, bin_ids, assignments, probs);
}

// chunk_counts[c * E + e] becomes the exclusive sum over chunks c' < c; n[e] the total.
__global__ void __launch_bounds__(kThreads)
    mask_scan_kernel(int32_t* __restrict__ chunk_counts, int64_t chunks, int experts, int32_t* __restrict__ n) {
  pdl_begin();
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int e = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / 32;
  if (e >= experts) return;
  int run = 0;
  for (int64_t base = 0; base < chunks; base += 32) {
    const int64_t c = base + lane;
    const int v = c < chunks ? chunk_counts[c * experts + e] : 0;
    int x = v;
    for (int d = 1; d < 32; d *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, x, d);
      if (lane >= d) x += y;
    }
    if (c < chunks) chunk_counts[c * experts + e] = run + x - v;
    run += __shfl_sync(0xffffffffu, x, 31);
  }
  if (lane == 0) n[e] = run;
}

struct PlaceArgs {
  const uint8_t* map;
  int64_t tokens;
  int experts;
  bool words;
  int alignment;
  int64_t rows;
  bool one_bin;
  int64_t tiles_per_chunk;
  int slices;  // blocks a chunk is split into (tiles_per_chunk 1 when above 1)
  int64_t chunks;
  bool fused_scan;  // chunk_offsets holds the raw chunk counts (no scan launch), n unused
  const int32_t* n;
  const int32_t* chunk_offsets;
  int32_t* counts;
  int32_t* dest_rows;
  int32_t* row_sources;
  int64_t sources_len;
  int32_t* indices;  // null: indices and bin_ids not written
  int32_t* bin_ids;
  int32_t* row_id_map;  // null: not written
  backend::MovedProbs probs;  // probs null: none moved
};

// The placement of block (chunk, slice). s_mem: four int arrays of E entries (running base, tile
// base, token mask, padding shift). With masks_ready (one tile a chunk), the token mask array holds
// the chunk's tile already. The chunk counts are read through L2 (__ldcg): in the one-launch form
// the same grid wrote them.
__device__ void place_chunk(const PlaceArgs& a, int32_t* s_mem, bool masks_ready) {
  __shared__ typename cub::BlockScan<int, kThreads>::TempStorage storage;
  __shared__ int s_total;
  const int E = a.experts;
  int32_t* s_base = s_mem;
  int32_t* s_tile = s_mem + E;
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(s_mem + 2 * E);
  int32_t* s_shift = s_mem + 3 * E;
  const int64_t chunk = blockIdx.x / a.slices;
  const int slice = static_cast<int>(blockIdx.x) % a.slices;

  // Each thread a contiguous range of experts; two exclusive scans give the unpadded and the
  // padded starts (the padded total is below 2^31: checked by the caller).
  const int per = (E + kThreads - 1) / kThreads;
  const int e0 = min(E, static_cast<int>(threadIdx.x) * per), e1 = min(E, e0 + per);
  // s_base[e] holds e's routed tokens in the chunks before this one, s_shift[e] its count, until
  // the loop after the scans (the same thread) turns them into row starts.
  int mine = 0, mine_padded = 0;
  for (int e = e0; e < e1; ++e) {
    int count = 0, before = 0;
    if (a.fused_scan) {
#pragma unroll 8
      for (int64_t c = 0; c < a.chunks; ++c) {
        const int v = __ldcg(a.chunk_offsets + c * E + e);
        before += c < chunk ? v : 0;
        count += v;
      }
    } else {
      count = a.n[e];
      before = a.chunk_offsets[chunk * E + e];
    }
    s_base[e] = before;
    s_shift[e] = count;
    mine += count;
    mine_padded += round_up_32(count, a.alignment);
  }
  int ustart = 0, pstart = 0, total = 0;
  cub::BlockScan<int, kThreads>(storage).ExclusiveSum(mine, ustart, total);
  __syncthreads();
  cub::BlockScan<int, kThreads>(storage).ExclusiveSum(mine_padded, pstart);
  if (threadIdx.x == 0) s_total = total;
  for (int e = e0; e < e1; ++e) {
    const int count = s_shift[e], padded = round_up_32(count, a.alignment);
    s_base[e] += pstart;
    s_shift[e] = pstart - ustart;
    if (chunk == 0 && slice == 0 && !a.one_bin) {
      a.counts[e] = count;
      a.counts[E + e] = ustart + count;
      a.counts[2 * E + e] = padded;
      a.counts[3 * E + e] = pstart + padded;
    }
    ustart += count;
    pstart += padded;
  }
  __syncthreads();
  if (chunk == 0 && slice == 0 && a.one_bin && threadIdx.x == 0) {
    const int kept = static_cast<int>(s_total < a.rows ? s_total : a.rows);
    a.counts[0] = kept;
    a.counts[1] = kept;
    a.counts[2] = static_cast<int32_t>(a.rows);
    a.counts[3] = static_cast<int32_t>(a.rows);
  }

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t width = 2 * static_cast<int64_t>(E) + 1;
  const int64_t first = chunk * a.tiles_per_chunk * kTile;
  for (int64_t tile = 0; tile < a.tiles_per_chunk; ++tile) {
    const int64_t t0 = first + tile * kTile;
    if (t0 >= a.tokens) break;  // uniform across the block
    if (!masks_ready) tile_masks(a.map, t0, a.tokens, E, a.words, s_mask);
    for (int e = threadIdx.x; e < E; e += kThreads) {  // e's own thread, as in the scan above
      s_tile[e] = s_base[e];
      s_base[e] += __popc(s_mask[e]);
    }
    __syncthreads();
    const int share = kTile / a.slices;  // this block's tokens of the tile: [slice * share, + share)
    for (int tl = slice * share + warp; tl < (slice + 1) * share; tl += kWarps) {
      const int64_t t = t0 + tl;
      if (t >= a.tokens) break;  // uniform across the warp
      const uint32_t below = (1u << tl) - 1u;
      int kept = 0;
      for (int g0 = 0; g0 < E; g0 += 32 * kProbLoads) {
        // the lane's routed probs of the next kProbLoads groups, loaded before any is used
        uint32_t bits[kProbLoads];
#pragma unroll
        for (int u = 0; u < kProbLoads; ++u) {
          const int e = E - 1 - (g0 + 32 * u + lane);
          const bool routed = e >= 0 && ((s_mask[e] >> tl) & 1u);
          bits[u] = a.probs.probs != nullptr && routed ? prob_bits(a.probs, t * E + e) : 0u;
        }
#pragma unroll
        for (int u = 0; u < kProbLoads; ++u) {
          const int g = g0 + 32 * u;
          if (g >= E) break;  // uniform across the warp
          const int e = E - 1 - (g + lane);  // descending experts: TE's row_id_map order
          int d = -1;
          if (e >= 0) {
            const uint32_t m = s_mask[e];
            if ((m >> tl) & 1u) {
              const int64_t r = s_tile[e] + __popc(m & below);
              if (r < a.rows) d = static_cast<int>(r);
            }
            a.dest_rows[t * E + e] = d;
            if (d >= 0 && d < a.sources_len) {
              a.row_sources[d] = static_cast<int32_t>(t * E + e);
              if (a.probs.probs != nullptr) store_prob(a.probs, d, bits[u]);
            }
            if (a.probs.nonzero != nullptr) {
              const bool live = d >= 0 && backend::prob_bits_nonzero(bits[u], a.probs.bytes);
              a.probs.nonzero[t * E + e] = live ? 1.0f : 0.0f;
            }
            if (d >= 0 && a.indices != nullptr) {  // the sorted position: the unpadded row
              a.indices[d - s_shift[e]] = static_cast<int32_t>(t * E + e);
              a.bin_ids[d - s_shift[e]] = e;
            }
          }
          if (a.row_id_map != nullptr) {
            const uint32_t live = __ballot_sync(0xffffffffu, d >= 0);
            if (d >= 0) {
              const int pos = kept + __popc(live & ((1u << lane) - 1u));
              a.row_id_map[t * width + pos] = d - s_shift[e];
              a.row_id_map[t * width + E + pos] = e;
            }
            kept += __popc(live);
          }
        }
      }
      if (a.row_id_map != nullptr) {
        for (int p = kept + lane; p < E; p += 32) {
          a.row_id_map[t * width + p] = -1;
          a.row_id_map[t * width + E + p] = -1;
        }
        if (lane == 0) a.row_id_map[t * width + 2 * E] = kept;
      }
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads) mask_place_kernel(PlaceArgs a) {
  pdl_begin();
  extern __shared__ int32_t s_mem[];
  place_chunk(a, s_mem, false);
}

// Count and place in one cooperative launch, for chunks of one tile summed by the place blocks
// themselves (policy::mask_one_launch_fits): every block builds its tile's masks once, slice 0
// publishes the chunk's counts, the grid fills, waits at its barrier and places from the masks it
// kept. One launch and one read of the map fewer than count + place.
__global__ void __launch_bounds__(kThreads) mask_one_launch_kernel(PlaceArgs a, int32_t* chunk_counts) {
  pdl_begin();
  extern __shared__ int32_t s_mem[];
  const int E = a.experts;
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(s_mem + 2 * E);  // place_chunk's token masks
  const int64_t chunk = blockIdx.x / a.slices;
  tile_masks(a.map, chunk * kTile, a.tokens, E, a.words, s_mask);
  if (static_cast<int>(blockIdx.x) % a.slices == 0) {
    for (int e = threadIdx.x; e < E; e += kThreads) chunk_counts[chunk * E + e] = __popc(s_mask[e]);
  }
  fill_unplaced(a.row_sources, a.sources_len, a.indices, a.bin_ids, a.tokens * E, a.probs);
  cooperative_groups::this_grid().sync();
  place_chunk(a, s_mem, true);
}

// The place kernel's dynamic shared memory: four int arrays of E entries.
size_t mask_plan_shared_bytes(int64_t num_experts) { return 4 * sizeof(int32_t) * static_cast<size_t>(num_experts); }

}  // namespace

size_t mask_plan_workspace_bytes(int64_t tokens, int64_t num_experts) {
  const int64_t chunks = policy::mask_chunks(tokens, device_policy());
  return sizeof(int32_t) * static_cast<size_t>((chunks + 1) * num_experts);
}

void mask_plan(const uint8_t* map, int64_t tokens, int num_experts, int alignment, int64_t rows, bool one_bin,
               int32_t* counts, int32_t* dest_rows, int32_t* row_sources, int64_t sources_len, int32_t* indices,
               int32_t* bin_ids, int32_t* row_id_map, const backend::MovedProbs& probs, void* workspace, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const int64_t tpc = policy::mask_tiles_per_chunk(tokens, device_policy());
  const int64_t chunks = policy::mask_chunks(tokens, device_policy());
  const int slices = policy::mask_place_slices(tokens, device_policy());
  const auto grid = static_cast<unsigned>(chunks * slices);
  int32_t* chunk_counts = static_cast<int32_t*>(workspace);
  int32_t* n = chunk_counts + chunks * num_experts;
  const bool words = num_experts % 4 == 0 && reinterpret_cast<uintptr_t>(map) % 4 == 0;
  const size_t smem = mask_plan_shared_bytes(num_experts);  // the count kernel takes half
  if (smem > 48 * 1024) {
    PADMOE_CUDA_CHECK(
        cudaFuncSetAttribute(mask_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  if (smem / 2 > 48 * 1024) {
    PADMOE_CUDA_CHECK(cudaFuncSetAttribute(mask_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem / 2)));
  }
  const bool fused_scan = policy::mask_scan_fused(chunks);
  PlaceArgs a{};
  a.map = map;
  a.tokens = tokens;
  a.experts = num_experts;
  a.words = words;
  a.alignment = alignment;
  a.rows = rows;
  a.one_bin = one_bin;
  a.tiles_per_chunk = tpc;
  a.slices = slices;
  a.chunks = chunks;
  a.fused_scan = fused_scan;
  a.n = n;
  a.chunk_offsets = chunk_counts;
  a.counts = counts;
  a.dest_rows = dest_rows;
  a.row_sources = row_sources;
  a.sources_len = sources_len;
  a.indices = indices;
  a.bin_ids = bin_ids;
  a.row_id_map = row_id_map;
  a.probs = probs;
  const bool one_launch = overrides().mask_one_launch.value_or(true) &&
                          policy::mask_one_launch_fits(num_experts, tpc, chunks, slices, sm_count());
  if (one_launch && cooperative_launch_supported()) {
    // The grid is at most one block a multiprocessor (mask_one_launch_fits; its shared memory is
    // at most 16 KiB), so a device that takes cooperative launches holds it whole.
    // Cooperative, and programmatically serialized like every padmoe launch: the kernel's
    // pdl_begin() waits for the kernel before it, so its launch overlaps that kernel's tail (the
    // plan alone at decode in a CUDA graph 9.7 us with the overlap, 10.2 without, on an H100)
    const cudaError_t err = try_launch_kernel(mask_one_launch_kernel, grid, kThreads, smem, s, true, a, chunk_counts);
    if (err != cudaErrorCooperativeLaunchTooLarge) {
      PADMOE_CUDA_CHECK(err);
      return;
    }
    // fewer multiprocessors than the device reports: two launches on this device from now on
    cudaGetLastError();
    cooperative_launch_refused();
  }
  launch_kernel("mask_count_kernel", mask_count_kernel, grid, kThreads, smem / 2, s, map, tokens, num_experts, words,
                tpc, slices, chunk_counts, row_sources, sources_len, indices, bin_ids, tokens * num_experts, probs);
  if (num_experts > 0 && !fused_scan) {
    launch_kernel("mask_scan_kernel", mask_scan_kernel, static_cast<unsigned>((num_experts + kWarps - 1) / kWarps),
                  kThreads, 0, s, chunk_counts, chunks, num_experts, n);
  }
  launch_kernel("mask_place_kernel", mask_place_kernel, grid, kThreads, smem, s, a);
}

}  // namespace cuda
}  // namespace padmoe
