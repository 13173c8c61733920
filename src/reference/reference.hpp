// reference.hpp — padmoe's reference implementation: plain single-threaded
// loops written straight from docs/spec.md, independent of the backends (it does
// not include the index-math header or call any backend code). Used only by
// the tests and by `padmoe check`.
//
// Conventions: row data are row-major float vectors (every float32, float16,
// bfloat16 and float8 value is exact in float). Moves return float (a product
// x*w is formed in double and rounded once to float, docs/spec.md §11's float32
// arithmetic); sums are accumulated and returned in double (float64), so a
// backend result is compared to them within a stated tolerance. Index
// vectors are int64.
#pragma once

#include <cstdint>
#include <vector>

namespace padmoe {
namespace ref {

struct Plan {
  int64_t num_tokens = 0;  // T
  int top_k = 1;           // K
  int num_experts = 0;     // E
  int alignment = 1;       // m
  std::vector<int64_t> indices, bin_ids;                            // [A]
  std::vector<int64_t> tokens_per_expert, bins;                     // [E]
  std::vector<int64_t> padded_tokens_per_expert, padded_bins;       // [E]
  std::vector<int64_t> dest_rows;                                   // [A]
  std::vector<int64_t> row_sources;                                 // [capacity]; -1 padding and past P
  int64_t padded_rows = 0;                                          // P
  int64_t capacity = 0;                                             // A + E*(m-1)
};

// top_experts: [T*K] row-major expert ids, all in [0, E).
Plan make_plan(const std::vector<int64_t>& top_experts, int64_t num_tokens, int top_k, int num_experts, int alignment);

// make_plan with the routing options of ops.hpp's PlanOptions, from docs/spec.md
// §4's words: ids are global (in [0, global_experts)); local id =
// expert_map[id] when the map is given, else id - first_expert inside the
// local range; other ids are dropped (an invalid id only with drop_invalid,
// else the reference throws). capacity >= 0: each expert keeps its first C
// assignments (by_probs: the C largest probs, ties to the lower id, then in id
// order), segments are exactly C rows. Dropped assignments: dest_rows -1,
// sorted positions past the kept count hold -1. `dropped` counts the
// assignments the capacity dropped.
struct RoutingOptions {
  int global_experts = 0;  // 0: num_experts
  int first_expert = 0;
  std::vector<int64_t> expert_map;  // empty: the range
  bool drop_invalid = false;
  int64_t expert_capacity = -1;
  bool by_probs = false;
  std::vector<float> probs;  // [A], by_probs only
};
struct RoutedPlan {
  Plan plan;
  int64_t dropped = 0;
};
RoutedPlan make_plan(const std::vector<int64_t>& top_experts, int64_t num_tokens, int top_k, int num_experts,
                     int alignment, const RoutingOptions& options);

// docs/spec.md §6, padded_gather: returns [P*H]; padding rows zero. weights (if not
// null) has A entries, indexed by assignment id.
std::vector<float> padded_gather(const std::vector<float>& x, int64_t hidden, const Plan& plan,
                                 const std::vector<float>* weights);

// docs/spec.md §6, padded_scatter: returns [T*H], sum over k in double.
std::vector<double> padded_scatter(const std::vector<float>& y, int64_t hidden, const Plan& plan,
                                   const std::vector<float>* weights);

// docs/spec.md §6, padded_scatter_wgrad: returns [A], wgrad[a] = <y[dest_rows[a]], grad[a/K]> in double.
std::vector<double> padded_scatter_wgrad(const std::vector<float>& y, const std::vector<float>& grad, int64_t hidden,
                                         const Plan& plan);

// docs/spec.md §7, pad_to_alignment on h[N*H] with counts[E].
struct PadResult {
  std::vector<float> padded;                // [P*H]
  std::vector<int64_t> permutation_map;     // [P]
  std::vector<int64_t> inclusive_offsets;   // [E]
  int64_t padded_rows = 0;                  // P
};
PadResult pad_to_alignment(const std::vector<float>& h, int64_t hidden, const std::vector<int64_t>& tokens_per_expert,
                           int alignment);

// docs/spec.md §7, unpad_from_alignment: returns [N*H]; probs (if not null) has N entries.
std::vector<float> unpad_from_alignment(const std::vector<float>& padded, int64_t hidden,
                                        const std::vector<int64_t>& permutation_map, int64_t original_size,
                                        const std::vector<float>* probs);

// ops.hpp section 5, sort_chunks on received[N*H] with split_sizes[C] (chunk
// c = r*E + e, E = C / num_ranks): output positions j hold chunk
// sorted_index[j] (given) or (j % R)*E + j / R (expert-major); each group of R
// consecutive positions padded to a multiple of alignment. The inverse is
// unpad_from_alignment over the returned map.
PadResult sort_chunks(const std::vector<float>& received, int64_t hidden, const std::vector<int64_t>& split_sizes,
                      int num_ranks, int alignment, const std::vector<int64_t>* sorted_index);

// Backward of unpad: grad_padded [P*H] (float, a move times probs) and
// grad_probs [N] (double; zeros for rows no entry names).
struct UnpadGrads {
  std::vector<float> grad_padded;
  std::vector<double> grad_probs;
};
UnpadGrads unpad_from_alignment_backward(const std::vector<float>& grad_out, const std::vector<float>& padded,
                                         int64_t hidden, const std::vector<int64_t>& permutation_map,
                                         const std::vector<float>* probs);

// The layouts other kernels consume, written from their own definitions:
// DeepGEMM's contiguous grouped layout (each expert's rows padded to a
// multiple of m, one int per row: its expert, -1 on padding rows and past P)
// and vLLM's moe_align_block_size contract (sorted_token_ids: per expert in
// ascending id order, padded to a multiple of block_size with the sentinel A;
// expert_ids per block, -1 past P; num_tokens_post_padded = P; buffer sizes
// A + min(A, E)*(block-1), rounded up to block with pad_sorted_ids).
std::vector<int64_t> row_experts(const std::vector<int64_t>& top_experts, int num_experts, int alignment, int64_t rows);
// vLLM's expert_ids for a buffer of `rows` rows: ceil(rows / m) entries, the expert of each block of
// m rows (every expert's run is padded to whole blocks), -1 for blocks at or past P.
std::vector<int64_t> block_experts(const std::vector<int64_t>& top_experts, int num_experts, int alignment,
                                   int64_t rows);
struct AlignedBlocks {
  std::vector<int64_t> sorted_token_ids, expert_ids;
  int64_t num_tokens_post_padded = 0;
};
// expert_ids: -1 for the blocks past P (vLLM's kernel); ids outside [0, E) skipped. expert_map
// (vLLM's ignore_invalid_experts): assignments counted under expert_map[e], none where it is -1.
AlignedBlocks moe_align_block_size(const std::vector<int64_t>& top_experts, int block_size, int num_experts,
                                   bool pad_sorted_ids, const std::vector<int64_t>* expert_map = nullptr);
// vLLM's batched_moe_align_block_size: expert e's rows e * max_tokens + j (j < counts[e]) back to
// back, each run padded to whole blocks of block_size; the sentinel E * max_tokens elsewhere in the
// ceil(max_tokens / block_size) * block_size * E entries, block id -1 for the blocks past the runs.
AlignedBlocks batched_moe_align_block_size(const std::vector<int64_t>& counts, int64_t max_tokens, int block_size);
// mask_plan_out from its definition: the routed pairs (t, e) of map [T, E] sorted by (e, t), each
// expert's run padded to the alignment, destinations at or past `rows` dropped; counts [4E] (or
// [4] with one_bin), dest_rows [T*E], row_sources [sources_len], indices / bin_ids [T*E] and TE's
// row_id_map [T, 2E + 1] spelled out per token.
struct MaskPlan {
  std::vector<int64_t> counts, dest_rows, row_sources, indices, bin_ids, row_id_map;
};
MaskPlan mask_plan(const std::vector<uint8_t>& map, int64_t tokens, int64_t experts, int alignment, int64_t rows,
                   bool one_bin, int64_t sources_len);
// index_plan_out from its definition: assignment a's sorted position is the number of assignments
// with a smaller id read as uint32, plus those before a with the same id (each distinct id's first
// position from the counts of the smaller ones, then its assignments in order); positions at or past
// `rows` dropped; counts {kept, kept, rows, rows}, dest_rows [A], row_sources [sources_len],
// indices / bin_ids [A].
struct IndexPlan {
  std::vector<int64_t> counts, dest_rows, row_sources, indices, bin_ids;
};
IndexPlan index_plan(const std::vector<int32_t>& ids, int64_t rows, int64_t sources_len);

// Scales moved with the rows (ops.hpp section 4), on raw bytes: scale row r
// of the output (row_bytes bytes) is source row sources[r] of `src`, or the
// bytes of a scale 1 (`one`, one row's worth) where sources[r] < 0.
std::vector<uint8_t> move_scale_rows(const std::vector<uint8_t>& src, int64_t row_bytes,
                                     const std::vector<int64_t>& sources, const std::vector<uint8_t>& one);
// One scale row of `cols` entries that decodes to 1: float32 1.0f, or the E8M0 byte 127.
std::vector<uint8_t> scale_one_row(bool e8m0, int64_t cols);
// The source row of each of the P padded rows of dispatch / padded_gather:
// the token of the assignment stored there, -1 for padding rows.
std::vector<int64_t> spread_sources(const Plan& plan);
// The source row of each of the N output rows of unpad: the p with
// permutation_map[p] == n, -1 for rows no entry names.
std::vector<int64_t> unpad_sources(const std::vector<int64_t>& permutation_map, int64_t original_size);

// The quantizers of dispatch_quantized (ops.hpp section 4; docs/design.md,
// "Fused quantizing dispatch"), written from the OCP MX v1.0 and DeepSeek-V3
// definitions as plain float32 loops (no bit tricks: std::frexp for
// floor(log2), a search of the fp8 code table for the rounding).
enum class QuantLayout { kPerRow, kBlock128, kMxE8M0 };
// fp8 code of v: round to nearest, ties to even, |v| >= max -> +-max; NaN -> 0x7f.
uint8_t fp8_saturate(float v, bool e5m2);
// The value of an fp8 code (the inverse; NaN for the NaN codes).
float fp8_value(uint8_t code, bool e5m2);
struct QuantRows {
  std::vector<uint8_t> rows;    // [rows * H] fp8 codes
  std::vector<uint8_t> scales;  // [rows * cols] scale entries as raw bytes (float32 or E8M0)
  int64_t cols = 0;             // scale entries per row
  int64_t row_bytes = 0;        // bytes of one scale row
};
// x: [rows * H] values (exact in float; the caller's 16-bit or float32 rows).
QuantRows quantize_rows(const std::vector<float>& x, int64_t rows, int64_t hidden, QuantLayout layout, bool e5m2);
// dispatch_quantized: the quantized token rows moved to the P padded rows
// (padding rows: zero codes and a scale row that decodes to 1).
QuantRows dispatch_quantized(const std::vector<float>& x, int64_t hidden, const Plan& plan, QuantLayout layout,
                             bool e5m2);

}  // namespace ref
}  // namespace padmoe
