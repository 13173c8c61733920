// kernel_policy.hpp — which CUDA kernel runs for each op, as pure functions of the problem's
// sizes and the device's properties. No CUDA header: the CPU test suite checks every choice and
// the boundaries between them (tests/test_kernel_policy.cpp).
//
// Each choice gives the measurement that decided it (NVIDIA H200 unless named; the runs' pages and
// raw logs are in the git history of bench/results/).
// The CUDA dispatch layer (src/cuda/*.cu) asks these functions, then applies a test's or
// `padmoe bench --variant`'s override (src/core/kernel_overrides.hpp) where one is set. Every
// choice moves and sums the same bits; only the dot-product families (ReduceDotsKernel,
// RowDotsKernel) sum in different orders, so a forced family may change a weight gradient's
// last bits.
#pragma once

#include <cstdint>

namespace padmoe {
namespace policy {

// What the choices read of the device.
struct Device {
  int sms = 132;                      // multiprocessors (an H200's when unknown)
  int64_t l2_bytes = int64_t{50} << 20;  // L2 size in bytes (an H200's when unknown)
  bool pdl = true;                    // programmatic dependent launch in use (sm_90 and up)
};

// --- make_plan -------------------------------------------------------------------------------
constexpr int kPlanChunk = 2048;        // assignments a plan block sorts
constexpr int kPlanFusedMaxExperts = 512;  // one expert a thread in the fused kernel's scan
constexpr int kPlanMaxReplicas = 16;    // blocks ranking one chunk (a warp each, 16 warps)

enum class PlanPath {
  kSmall,  // one chunk: 32 blocks, no grid barrier (decode)
  kFused,  // one (cooperative) launch of the count, the scan and the placement
  kSplit,  // two launches, count then place (E above the fused kernel's)
};
// Small for one chunk, fused up to 512 experts, split above. Measured: fused against
// split, and the small kernel's 32 blocks against 16 / 64: 4.9 against 5.1 / 5.0 us
// at decode.
inline PlanPath plan_path(int64_t assignments, int num_experts) {
  if (num_experts < 1 || num_experts > kPlanFusedMaxExperts) return PlanPath::kSplit;
  return assignments <= kPlanChunk ? PlanPath::kSmall : PlanPath::kFused;
}

enum class PlanMatch {
  kMatchAny,  // __match_any_sync: few distinct keys in a warp
  kBallot,    // a ballot a key bit: many distinct keys
};
// Ballot from 64 experts: E = 256 decode 6.2 against 7.0 us, E = 32 of 256 5.8 against 5.2.
inline PlanMatch plan_match(int num_experts) { return num_experts >= 64 ? PlanMatch::kBallot : PlanMatch::kMatchAny; }

enum class PlanCounts {
  kInts,   // one int an expert and block
  kPairs,  // 16-bit pairs: a block's counts below 2^16
};
// Whether pairs fit a block's counts at all.
inline bool plan_pairs_fit(int chunks_per_block) {
  return static_cast<int64_t>(chunks_per_block) * kPlanChunk <= 0xffff;
}
// Pairs where they fit from 64 experts: deepseek-v3 10.7 against 11.1 us, mixtral-8x7b (E = 8)
// 7.3 against 7.1.
inline PlanCounts plan_counts(int chunks_per_block, int num_experts) {
  return plan_pairs_fit(chunks_per_block) && num_experts >= 64 ? PlanCounts::kPairs : PlanCounts::kInts;
}

// Blocks ranking each chunk in the fused kernel (a power of two up to 16), with `distinct`
// chunk-owning blocks: about one block a multiprocessor, at most `resident` blocks in all;
// 1 when a block owns several chunks.
inline int plan_replicas(int distinct, int chunks_per_block, int sms, int resident) {
  int replicas = 1;
  if (chunks_per_block != 1 || distinct <= 0) return replicas;
  const int target = sms > 1 ? sms : 1;
  while (replicas < kPlanMaxReplicas && distinct * replicas * 2 <= target) replicas *= 2;
  while (replicas > 1 && distinct * replicas > resident) replicas /= 2;
  return replicas;
}

// --- row kernels: spread (dispatch, gather), reduce (combine, scatter), dots (wgrad) ----------
constexpr int kRowThreads = 256;      // threads of a row kernel's block
constexpr int kWarpReduceMaxK = 8;    // the token kernels' largest top_k
constexpr int kDestSearchAssignments = 4096;
constexpr int kDestSearchExperts = 256;

// Below about 4 blocks a multiprocessor a block a token leaves part of the GPU idle.
inline int64_t few_tokens_blocks(const Device& d) { return 4 * static_cast<int64_t>(d.sms); }
inline bool few_tokens(int64_t tokens, const Device& d) { return tokens < few_tokens_blocks(d); }

// From one token a multiprocessor to below 2.5, rows of 512 16-byte units (8 KiB) and more: a block
// a token loads two units a lane at a time.
inline bool two_units_window(int64_t tokens, int64_t units, const Device& d) {
  const int64_t sms = d.sms;
  return tokens >= sms && 2 * tokens < 5 * sms && units >= 2 * kRowThreads;
}

// A row split over several blocks (spans of slice_units units) for the plain reduce at small T,
// so that about `target_blocks` blocks run; slices 1 with dots (a dot needs the whole row).
struct Slicing {
  int slices = 1;
  int64_t slice_units = 0;
};
inline Slicing reduce_slicing(int64_t rows, int64_t units, int64_t granule, bool dots, int64_t target_blocks) {
  Slicing s;
  s.slice_units = units;
  if (dots || rows <= 0 || units <= granule || rows >= target_blocks) return s;
  const int64_t want = (target_blocks + rows - 1) / rows;
  const int64_t per = (units + want - 1) / want;
  const int64_t span = (per + granule - 1) / granule * granule;
  s.slices = static_cast<int>((units + span - 1) / span);
  s.slice_units = span;
  return s;
}
// The units a reduce slice is a multiple of: two block-widths for top-2's (2, 2) shape, else one.
inline int64_t reduce_slice_granule(int top_k) { return top_k <= 2 ? 2 * kRowThreads : kRowThreads; }

enum class SpreadKernel {
  kBlock,  // a block a token, the row cached in registers
  kWarp,   // a warp a token, 8 units a lane a round
};
// The spreads without dot products: a warp a token for rows of at most 512 units whose K copies are
// at most 2048 units, at 16 tokens a multiprocessor and more: dispatch(fp8+scales) mixtral-8x7b
// 2.07x -> 1.19x the floor; decode and deepseek-v3 lose, so the block kernel.
inline SpreadKernel spread_kernel(int64_t tokens, int64_t units, int top_k, const Device& d) {
  const bool short_rows = units <= 512 && units * top_k <= 2048;
  return short_rows && tokens >= 16 * static_cast<int64_t>(d.sms) ? SpreadKernel::kWarp : SpreadKernel::kBlock;
}

// The spread with dots (combine_backward with weights, gather_backward's weight gradient): a warp
// an assignment up to top_k 8, a block a token above, where each token stages only its live
// assignments (a mask plan's K = E slots: E = 256 launches T * 256 warps the other way, nearly all
// for dropped slots).
inline bool spread_dots_by_token(int top_k) { return top_k > kWarpReduceMaxK; }

enum class ReduceKernel {
  kBlock,               // a block a token, (1, 4): units a thread, rows loaded together; top-2 (2, 2)
  kBlockWide,           // the same kernel at (1, 8) (top_k > 2)
  kTokenBlock,          // a block a token, every source row's unit loaded before the first add
  kTokenBlockTwoUnits,  // the same, two units a lane at a time
};
// The plain reduce (combine, scatter; the same sums every way). Measured at E = 256, K = 8,
// H = 7168: below one token a multiprocessor the wide block
// shape (combine(w) T = 64: 4.6 against 5.8 us); in the two-units window two units a lane (T = 256:
// 7.7 against 7.8); else the token block (T = 2048: 65.8 against 72.2); above top_k 8 the block
// kernel (wide for few tokens).
inline ReduceKernel plain_reduce_kernel(int64_t tokens, int top_k, int64_t units, const Device& d) {
  if (top_k > kWarpReduceMaxK) return few_tokens(tokens, d) ? ReduceKernel::kBlockWide : ReduceKernel::kBlock;
  if (tokens < d.sms) return top_k > 2 ? ReduceKernel::kBlockWide : ReduceKernel::kBlock;
  if (two_units_window(tokens, units, d)) return ReduceKernel::kTokenBlockTwoUnits;
  return ReduceKernel::kTokenBlock;
}
// A requested plain reduce where it runs: the token kernels up to top_k 8, the wide shape above
// top_k 2; else the block kernel.
inline ReduceKernel plain_reduce_fit(ReduceKernel k, int top_k) {
  if ((k == ReduceKernel::kTokenBlock || k == ReduceKernel::kTokenBlockTwoUnits) && top_k > kWarpReduceMaxK) {
    return ReduceKernel::kBlock;
  }
  if (k == ReduceKernel::kBlockWide && top_k <= 2) return ReduceKernel::kBlock;
  return k;
}

enum class ReduceDotsKernel {
  kBlock,               // a block a token at (1, 4), block-tree dots
  kBlockWide,           // the same at (2, 8): 16 loads in flight a thread
  kTokenWarp,           // a warp a token, lane sums then a shuffle tree
  kTokenBlock,          // a block a token in the warp kernel's form
  kTokenBlockTwoUnits,  // the same, two units a lane at a time (kTokenBlock's bits)
};
// The reduce with dots (gather / dispatch backward with weights): a warp a token (mixtral 1.15 ->
// 1.03x, deepseek-v3 1.13 -> 0.99x against the block kernel), a block a
// token for few tokens (decode 12.2 -> 10.2 us), two units a lane in the two-units window
// (padded_gather_backward(w) 11.1 against 12.4 us); above top_k 8
// the block kernel (wide for few tokens). The families sum the dots in different orders.
inline ReduceDotsKernel reduce_dots_kernel(int64_t tokens, int top_k, int64_t units, const Device& d) {
  if (top_k > kWarpReduceMaxK) return few_tokens(tokens, d) ? ReduceDotsKernel::kBlockWide : ReduceDotsKernel::kBlock;
  if (two_units_window(tokens, units, d)) return ReduceDotsKernel::kTokenBlockTwoUnits;
  return few_tokens(tokens, d) ? ReduceDotsKernel::kTokenBlock : ReduceDotsKernel::kTokenWarp;
}
// A requested reduce with dots where it runs: the token kernels up to top_k 8 (above: the block
// kernel, wide for few tokens).
inline ReduceDotsKernel reduce_dots_fit(ReduceDotsKernel k, int64_t tokens, int top_k, const Device& d) {
  const bool token_kernel = k == ReduceDotsKernel::kTokenWarp || k == ReduceDotsKernel::kTokenBlock ||
                            k == ReduceDotsKernel::kTokenBlockTwoUnits;
  if (token_kernel && top_k > kWarpReduceMaxK) {
    return few_tokens(tokens, d) ? ReduceDotsKernel::kBlockWide : ReduceDotsKernel::kBlock;
  }
  return k;
}

enum class RowDotsKernel {
  kAssignmentWarp,  // a warp an assignment
  kTokenBlock,      // a block a token, every source row's unit loaded together (top_k <= 8)
};
// row_dots (padded_scatter_wgrad): a block a token for 2 < top_k <= 8 (decode 1.42 -> 1.34x the
// floor, deepseek-v3 0.94 -> 0.93x), a warp an assignment for top-2 (mixtral 1.00 against 1.22x)
// and above top_k 8. The two sum in different orders.
inline RowDotsKernel row_dots_kernel(int top_k) {
  return top_k > 2 && top_k <= kWarpReduceMaxK ? RowDotsKernel::kTokenBlock : RowDotsKernel::kAssignmentWarp;
}
inline RowDotsKernel row_dots_fit(RowDotsKernel k, int top_k) {
  return top_k <= kWarpReduceMaxK ? k : RowDotsKernel::kAssignmentWarp;
}

// Whether the row kernels find destinations by a search of the sorted form (MegaBlocks' indices /
// bin_ids / bins / padded_bins) instead of a build_dest_rows launch: A <= 4096, E <= 256,
// top_k <= 8.
inline bool dest_search_fits(int64_t assignments, int num_experts, int top_k) {
  return assignments <= kDestSearchAssignments && num_experts <= kDestSearchExperts && top_k <= kWarpReduceMaxK;
}

// Rows a padding-zero block clears: 32, and at small T about 56 KiB of rows (4 to 32 rows): decode
// dispatch 14 KiB rows 4 / 8 / 2 rows 18.5 / 19.6 / 19.7 us.
constexpr int kZeroRows = 32;
inline int zero_rows_per_block(int64_t tokens, int64_t row_bytes, const Device& d) {
  if (tokens >= few_tokens_blocks(d)) return kZeroRows;
  constexpr int64_t kSmallZeroBytes = 4 * 14336;
  const int64_t rows = row_bytes > 0 ? kSmallZeroBytes / row_bytes : kZeroRows;
  return static_cast<int>(rows < 4 ? 4 : rows > kZeroRows ? kZeroRows : rows);
}

// L2 prefetch of a gather's source rows before the kernel's wait: only where there is a wait to
// overlap (PDL) and the rows stay in L2 until read (at most 60% of it). sort_chunks' gather at
// decode 24.9 -> 23.4 us; a prefetch shortly before the loads costs.
inline bool l2_prefetch(int64_t rows, int64_t row_bytes, const Device& d) {
  return d.pdl && rows * row_bytes <= d.l2_bytes / 10 * 6;
}

// --- mask_plan -------------------------------------------------------------------------------
constexpr int kMaskTile = 32;         // tokens a warp's ballot covers (one bit a token)
constexpr int kMaskThreads = 256;     // threads of the count and place blocks (8 warps)
constexpr int kMaskChunkBlocks = 4;   // chunks a multiprocessor the grid aims at
// The grid the mask launches aim at: 4 blocks a multiprocessor.
inline int64_t mask_target_blocks(const Device& d) {
  return kMaskChunkBlocks * static_cast<int64_t>(d.sms > 0 ? d.sms : 1);
}

// Tiles of 32 tokens a block counts and places: one where that gives at most 4 blocks a
// multiprocessor, else enough to keep the grid there (the per-expert scan then walks fewer
// chunks). The grid is ceil(tiles / tiles_per_chunk) blocks, at least one.
inline int64_t mask_tiles_per_chunk(int64_t tokens, const Device& d) {
  const int64_t tiles = (tokens + kMaskTile - 1) / kMaskTile;
  const int64_t target = mask_target_blocks(d);
  return tiles <= target ? 1 : (tiles + target - 1) / target;
}

// The chunks of mask_tiles_per_chunk's tiles: ceil(tiles / tiles_per_chunk), at least one.
inline int64_t mask_chunks(int64_t tokens, const Device& d) {
  const int64_t tiles = (tokens + kMaskTile - 1) / kMaskTile;
  const int64_t tpc = mask_tiles_per_chunk(tokens, d);
  return tiles > tpc ? (tiles + tpc - 1) / tpc : 1;
}

// Blocks a chunk of one tile is split into (each places kMaskTile / slices of its tokens, a warp a
// token at most): 1, 2 or 4, the most that keeps the grid within 4 blocks a multiprocessor. A
// place block walks its tokens' experts serially, so a grid of few chunks (decode: T = 256 is 8
// tiles) is bound by one warp's instruction stream; the slices divide that stream.
constexpr int kMaskMaxSlices = kMaskTile / (kMaskThreads / 32);
inline int mask_place_slices(int64_t tokens, const Device& d) {
  if (mask_tiles_per_chunk(tokens, d) > 1) return 1;
  const int64_t chunks = mask_chunks(tokens, d), target = mask_target_blocks(d);
  int slices = 1;
  while (slices < kMaskMaxSlices && chunks * slices * 2 <= target) slices *= 2;
  return slices;
}

// Chunks up to which the place blocks sum the chunk counts themselves (each block reads the
// chunks x E counts, a few loads a thread) instead of a scan launch between count and place: a
// launch costs more than a few independent loads; past this the reads grow with the grid.
constexpr int64_t kMaskFusedScanChunks = 16;
inline bool mask_scan_fused(int64_t chunks) { return chunks <= kMaskFusedScanChunks; }

// Where count and place fit one cooperative launch (a grid barrier between them): chunks of one
// tile whose counts the place blocks sum themselves, at most one block a multiprocessor, and shared
// memory of at most 16 KiB (E <= 1024), so that any device holds the grid at once: the decode sizes
// (T <= 512). It saves a launch and a second read of the map: the plan alone at decode (T = 256,
// E = 256) 14.0 us against 16.8 eager and 11.4 against 13.4 in a CUDA graph on an H100 (two runs
// of `padmoe bench --preset decode --ops mask_plan`; `--variant mask-one-launch=off` forces the
// two launches). Where it fits it is the default.
constexpr int kMaskOneLaunchMaxExperts = 1024;
inline bool mask_one_launch_fits(int num_experts, int64_t tiles_per_chunk, int64_t chunks, int slices, int sms) {
  return num_experts >= 1 && num_experts <= kMaskOneLaunchMaxExperts && tiles_per_chunk == 1 &&
         mask_scan_fused(chunks) && chunks * slices <= sms;
}

// 32-bit words of the map a thread loads before it ORs any into the tile's masks: a tile of
// 32 x 256 experts is 8 words a thread, so its loads are in flight together, not one after another.
// The place kernel's lanes load as many routed probs (8 groups of 32 experts) before placing any.
constexpr int kMaskLoads = 8;

// --- sort_chunks -----------------------------------------------------------------------------
constexpr int64_t kChunkFusedMapRows = 16384;  // the layout block also writes the map up to here
constexpr int kChunkRowsMaxChunks = 1024;     // the one launch's chunks
constexpr int kChunkRowThreads = 256;

// The layout kernel writes the row map in the same launch up to 16384 map rows: decode sort_chunks
// 26.6 -> 24.7 us.
inline bool chunk_map_fused(int64_t map_len) { return map_len <= kChunkFusedMapRows; }

// sort_chunks in one launch (layout and rows) for received rows of at most the L2's size: decode
// 23.3 -> 21.8 us; hundreds of MiB lose (1.06-1.10x -> 1.13-1.20x the floor).
inline bool chunk_rows_one_launch(int64_t rows, int64_t row_bytes, const Device& d) {
  return rows * row_bytes <= d.l2_bytes;
}

enum class ChunkRowsForm {
  kFlat,     // rows flattened over (row, word)
  kRowwise,  // one row at a time, rows of at least 256 words
  kOneScan,  // the layout in one block scan, one row a block (no sorted_index, C <= 256)
};
// Row by row for rows of 256 words and more (decode 24.5 -> 24.0 us); the
// one-scan form without sorted_index at most 256 chunks
// (decode 20.6 -> 18.3 us in a graph).
inline bool chunk_one_scan_fits(bool sorted_index, int64_t num_chunks, int64_t words) {
  return !sorted_index && num_chunks <= kChunkRowThreads && words >= kChunkRowThreads;
}
inline bool chunk_rowwise_fits(int64_t words) { return words >= kChunkRowThreads; }
inline ChunkRowsForm chunk_rows_form(bool sorted_index, int64_t num_chunks, int64_t words) {
  if (chunk_one_scan_fits(sorted_index, num_chunks, words)) return ChunkRowsForm::kOneScan;
  return chunk_rowwise_fits(words) ? ChunkRowsForm::kRowwise : ChunkRowsForm::kFlat;
}
// A requested form where it runs: the one-scan form, else row by row, else flattened.
inline ChunkRowsForm chunk_rows_fit(ChunkRowsForm f, bool sorted_index, int64_t num_chunks, int64_t words) {
  if (f == ChunkRowsForm::kOneScan && !chunk_one_scan_fits(sorted_index, num_chunks, words)) {
    f = ChunkRowsForm::kRowwise;
  }
  if (f == ChunkRowsForm::kRowwise && !chunk_rowwise_fits(words)) f = ChunkRowsForm::kFlat;
  return f;
}

// --- quantized dispatch ----------------------------------------------------------------------
constexpr int kQuantStepCols = 2048;  // columns a quantizing block step covers

// Blocks a token row of the quantizing spread (block scales only): every step its block when all
// tokens' steps fit in 8 blocks a multiprocessor (decode: 256 tokens x 4 steps of H = 7168), else 1.
inline int quant_slices(int64_t tokens, int64_t hidden, bool per_row_scales, const Device& d) {
  if (per_row_scales || tokens <= 0) return 1;
  const int64_t steps = (hidden + kQuantStepCols - 1) / kQuantStepCols;
  if (steps <= 1) return 1;
  return tokens * steps <= 8 * static_cast<int64_t>(d.sms) ? static_cast<int>(steps) : 1;
}
// The sliced kernel at 6 blocks a multiprocessor for 1x128 block scales, at 8 for MXFP8: quant-128
// 12.7 against 13.3 us at decode.
enum class QuantScaleKind { kPerRow, kBlock128, kMx };
inline bool quant_loose(QuantScaleKind k) { return k == QuantScaleKind::kBlock128; }
// Rows a padding-zero block of the quantizing spread clears: 4 for block scales where the spreads'
// rule gives fewer than 32 (quant-128 12.6 against 13.6 us with 8).
inline int quant_zero_rows(int64_t tokens, int64_t row_bytes, QuantScaleKind k, const Device& d) {
  return zero_rows_per_block(tokens, row_bytes, d) < kZeroRows && k != QuantScaleKind::kPerRow ? 4 : kZeroRows;
}

}  // namespace policy
}  // namespace padmoe
