// reference.hpp — padmoe's reference implementation: plain single-threaded
// loops written straight from SPEC.md, independent of the backends (it does
// not include the index-math header or call any backend code). Used only by
// the tests and by `padmoe check`.
//
// Conventions: row data are row-major float vectors (every float32, float16,
// bfloat16 and float8 value is exact in float). Moves return float (a product
// x*w is formed in double and rounded once to float, SPEC's float32
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
Plan make_plan(const std::vector<int64_t>& top_experts, int64_t num_tokens, int top_k, int num_experts,
               int alignment);

// SPEC 2, padded_gather: returns [P*H]; padding rows zero. weights (if not
// null) has A entries, indexed by assignment id.
std::vector<float> padded_gather(const std::vector<float>& x, int64_t hidden, const Plan& plan,
                                 const std::vector<float>* weights);

// SPEC 2, padded_scatter: returns [T*H], sum over k in double.
std::vector<double> padded_scatter(const std::vector<float>& y, int64_t hidden, const Plan& plan,
                                   const std::vector<float>* weights);

// SPEC 2, padded_scatter_wgrad: returns [A], wgrad[a] = <y[dest_rows[a]], grad[a/K]> in double.
std::vector<double> padded_scatter_wgrad(const std::vector<float>& y, const std::vector<float>& grad,
                                         int64_t hidden, const Plan& plan);

// SPEC 3, pad_to_alignment on h[N*H] with counts[E].
struct PadResult {
  std::vector<float> padded;                // [P*H]
  std::vector<int64_t> permutation_map;     // [P]
  std::vector<int64_t> inclusive_offsets;   // [E]
  int64_t padded_rows = 0;                  // P
};
PadResult pad_to_alignment(const std::vector<float>& h, int64_t hidden, const std::vector<int64_t>& tokens_per_expert,
                           int alignment);

// SPEC 3, unpad_from_alignment: returns [N*H]; probs (if not null) has N entries.
std::vector<float> unpad_from_alignment(const std::vector<float>& padded, int64_t hidden,
                                        const std::vector<int64_t>& permutation_map, int64_t original_size,
                                        const std::vector<float>* probs);

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
std::vector<int64_t> row_experts(const std::vector<int64_t>& top_experts, int num_experts, int alignment,
                                 int64_t rows);
// vLLM's expert_ids for a buffer of `rows` rows: ceil(rows / m) entries, the expert of each block of
// m rows (every expert's run is padded to whole blocks), -1 for blocks at or past P.
std::vector<int64_t> block_experts(const std::vector<int64_t>& top_experts, int num_experts, int alignment,
                                   int64_t rows);
struct AlignedBlocks {
  std::vector<int64_t> sorted_token_ids, expert_ids;
  int64_t num_tokens_post_padded = 0;
};
AlignedBlocks moe_align_block_size(const std::vector<int64_t>& top_experts, int block_size, int num_experts,
                                   bool pad_sorted_ids);

}  // namespace ref
}  // namespace padmoe
