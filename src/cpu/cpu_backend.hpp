// cpu_backend.hpp — the CPU kernels. Raw pointers and sizes only; every
// argument was checked by the API layer before these run.
//
// Each kernel partitions its output over workers in contiguous ranges
// (index::work_range), writes every output row exactly once (padding rows
// are zeroed by the same pass that writes the real rows) and computes each
// output element in a fixed order, so results are bitwise identical for any
// thread count.
#pragma once

#include <cstdint>

#include "core/backend_types.hpp"
#include "padmoe/index_math.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"

namespace padmoe {
namespace cpu {

// The argument types shared with the CUDA backend (core/backend_types.hpp).
using backend::FloatOut;
using backend::RowsRef;
using backend::Scale;
using backend::ScaleRows;

// make_plan on validated top_experts ([A] int32 or int64 ids), mapped to the
// plan's experts by `remap` (an id it maps to -1 is dropped: dest_rows -1, no
// sorted position; positions past the kept count get indices = bin_ids = -1).
// Fills every field of `out` (int32), row_sources up to its full length
// (padding_source on padding rows and past P), and the given layouts.
void make_plan(const void* top_experts, bool wide, int64_t num_tokens, int top_k, int num_experts, int alignment,
               const PlanView& out, const PlanLayouts& layouts, int32_t padding_source, const index::ExpertRemap& remap,
               int threads);

// Fixed capacity C: `out` (segments exactly C rows, P = E * C) and the given
// layouts from `full`, a plan of the same routing at alignment 1 (every kept
// assignment). Each expert keeps its first C sorted assignments, or with
// by_probs the C with the largest probs (ties: lower assignment id), in
// assignment order; *dropped (when not null) = the number it dropped.
// The sizes are the checked arguments' (A assignments, E experts): a PlanView's own scalar fields
// are the caller's and are never read here.
void apply_capacity(const PlanView& full, int64_t assignments, int num_experts, Scale probs, int64_t capacity,
                    bool by_probs, int alignment, const PlanView& out, const PlanLayouts& layouts,
                    int32_t padding_source, int32_t* dropped, int threads);

// Token-driven spread (dispatch / padded_gather / grad of combine):
//   y[dest[t*K+k]] = x[t] * w(t*K+k) for every k with dest >= 0;
//   rows r < padded_rows with row_sources[r] < 0 are zeroed.
// When dots_with is given, dots[a] = <dots_with[dest[a]], x[t]> (0 where
// dest < 0) from the same read of x[t] (combine_backward's weight grad).
// When scales are given, each row's scale row moves with it (padding rows
// and zeroed rows past P get scale 1).
void spread_rows(const RowsRef& x, int top_k, const int32_t* dest, Scale w, const RowsRef& y,
                 const int32_t* row_sources, int64_t padded_rows, bool zero_padding, bool zero_past_end,
                 const RowsRef* dots_with, FloatOut dots, int threads, const ScaleRows* scales = nullptr);

// Token-driven weighted reduction (combine / padded_scatter):
//   out[t] = sum_{k ascending} w(t*K+k) * y[dest[t*K+k]]  (float32, dest < 0 skipped).
// When dots_with ([T, H] token rows) is given, dots[a] = <y[dest[a]], dots_with[t]>
// (0 where dest < 0) from the same read of the K rows (the backward of gather /
// dispatch: grad_x and grad_weights in one pass over grad_y).
void reduce_rows(const RowsRef& y, int top_k, const int32_t* dest, Scale w, const RowsRef& out, int block_x,
                 int threads, const RowsRef* dots_with = nullptr, FloatOut dots = {});

// Per-assignment dot products (padded_scatter_wgrad, unpad's grad_probs):
//   out[a] = <y[dest[a]], g[a / K]> (float32; 0 where dest < 0), a in [0, A).
void row_dots(const RowsRef& y, const RowsRef& g, int top_k, const int32_t* dest, int64_t assignments, FloatOut out,
              int threads);

// Optional dot products from gather_rows' read of each source row (unpad's
// grad_probs): out[map[r]] = <with[r], src[map[r]]> for every r with
// map[r] >= 0, and out[n] = 0 for the n < count that no row names
// (inverse[n] < 0; inverse is map's inverse, every entry of map distinct).
struct GatherDots {
  RowsRef with;
  const int32_t* inverse = nullptr;
  int64_t count = 0;
  FloatOut out;
};

// Output-row-driven move (pad, unpad, grad of unpad):
//   out[r] = src[map[r]] * s(scale_index) for map[r] >= 0, else zero;
//   scale_index = map[r] when scale_by_source, else r.
// skip_unmapped: rows with map < 0 are left unwritten instead of zeroed.
// scales: each row's scale row moves with it (zeroed rows get scale 1).
// dots: see GatherDots.
void gather_rows(const RowsRef& src, const int32_t* map, Scale s, bool scale_by_source, const RowsRef& out,
                 int64_t rows, int threads, bool skip_unmapped = false, const ScaleRows* scales = nullptr,
                 const GatherDots* dots = nullptr);

// sort_chunks' row map (chunks_cpu.cpp): output positions j = 0..C-1 with
// first padded row row_begin[j] (nondecreasing), first source row
// src_begin[j] and size[j]. For p < padded_rows, with j the last position
// whose row_begin[j] <= p: map[p] = src_begin[j] + p - row_begin[j] while
// p - row_begin[j] < size[j], else -1 (padding); map[p] = -1 for p >= padded_rows.
void chunk_map(const int64_t* row_begin, const int64_t* src_begin, const int64_t* size, int64_t num_chunks,
               int64_t padded_rows, int32_t* map, int64_t map_len, int threads);

// vLLM's batched layout (batched_moe_align_block_size) from validated counts
// (`counts`: [E] int32, or int64 when wide, each in [0, max_tokens]) and their
// padded inclusive ends (ends[e] = sum over e' <= e of round_up(counts[e'],
// block_size)): sorted_ids[entries] and block_ids[entries / block_size]
// (entries a multiple of block_size, at least ends[E-1]). Each worker owns a
// contiguous range of blocks; a block lies inside one expert's run or past
// them all, because every end is a multiple of block_size.
void batched_align_blocks(const void* counts, bool wide, const int32_t* ends, int64_t num_experts, int max_tokens,
                          int block_size, int64_t entries, int32_t* sorted_ids, int32_t* block_ids, int threads);

// mask_plan (padmoe::mask_plan_out) on sizes already checked: map [T, E] bytes, counts [4E] (or
// [4] with one_bin), dest_rows [T * E], row_sources [sources_len], indices and bin_ids [T * E] (both
// or neither null), row_id_map [T, 2E + 1] or null, the probs moved into [sources_len] (or none).
// Workers own contiguous token ranges.
void mask_plan(const uint8_t* map, int64_t tokens, int64_t experts, int alignment, int64_t rows, bool one_bin,
               int32_t* counts, int32_t* dest_rows, int32_t* row_sources, int64_t sources_len, int32_t* indices,
               int32_t* bin_ids, int32_t* row_id_map, const backend::MovedProbs& probs, int threads);

// index_plan (padmoe::index_plan_out) on sizes already checked: ids [A], counts [4], dest_rows [A],
// row_sources [sources_len], indices and bin_ids [A] (both or neither null).
void index_plan(const int32_t* ids, int64_t assignments, int64_t rows, int32_t* counts, int32_t* dest_rows,
                int32_t* row_sources, int64_t sources_len, int32_t* indices, int32_t* bin_ids, int threads);

// dst = src for `bytes` bytes, split into contiguous per-worker chunks;
// large copies use streaming stores.
void copy_bytes(void* dst, const void* src, int64_t bytes, int threads);

// Worker count for `items` units of `bytes_per_item` (keeps tiny ops on one thread).
int workers_for(int threads, int64_t items, int64_t bytes_per_item);

}  // namespace cpu
}  // namespace padmoe
