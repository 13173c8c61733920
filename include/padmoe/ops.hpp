// padmoe/ops.hpp — every routing op of docs/spec.md §3-§10.
//
// Each op comes in two forms:
//   - `op(...)` allocates its outputs (on the inputs' device) and returns them;
//   - `op_out(..., out)` writes into caller-owned buffers and allocates nothing
//     on the hot path.
// The backend is chosen by the tensors' device. All arguments are checked
// before anything is written (docs/spec.md §12); a failure throws padmoe::Error
// naming the op, the argument and the first offending position.
//
// Row tensors: float32, float16, bfloat16 ([rows, H], unit column stride,
// any row stride >= H); float8 e4m3/e5m2 are accepted by the move-only ops
// (gather/dispatch without weights, pad, unpad without probs), whose `_scaled`
// forms (section 4 below) move a scale tensor with the rows. Index inputs:
// int32 or int64, contiguous. Index outputs: int32. Router weights / probs:
// float32, float16 or bfloat16, whatever the rows' dtype. Arithmetic is float32; sums run in ascending k and
// are cast once, so results are bitwise deterministic on a backend and do not
// depend on the thread count.
//
// Output capacity: every op that produces padded rows accepts an output of at
// least P = padded_bins[E-1] rows; rows at or past P are left untouched.
// Allocating forms allocate exactly P rows (on CUDA they read P from the
// device: one synchronization). On CUDA, the _out forms with check_data =
// false never synchronize with the host (capturable in a CUDA graph); P is then
// known on the device only, so size outputs with padded_rows_bound().
//
// CUDA checked mode (check_data = true, the default) validates the
// data-dependent properties on the device and synchronizes once to raise the
// error on the host, before the op writes anything.
#pragma once

#include <cstdint>
#include <optional>

#include "padmoe/tensor.hpp"

namespace padmoe {

// Execution options shared by every op.
struct Options {
  // cudaStream_t for CUDA tensors (declared as void* so this header stays
  // free of CUDA headers); ignored on the CPU.
  void* stream = nullptr;
  // CUDA: validate data-dependent properties (expert ids, bins, permutation)
  // with a small device kernel before running. The CPU backend always
  // validates everything.
  bool check_data = true;
  // CPU: worker threads; 0 uses every hardware thread.
  int num_threads = 0;
  // CUDA: caller-owned device scratch memory. An op that needs more than
  // workspace_bytes (see workspace_bound) takes stream-ordered memory
  // instead (scratch_alloc below, else padmoe's pool). Unused on the CPU.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Outputs of padded rows written by a spread (padded_gather, dispatch, and
  // the grad_y of padded_scatter_backward / combine_backward): also zero the
  // rows at or past P, in the same pass, so that an output sized by
  // padded_rows_bound() is fully defined (padmoe.torch uses this). Off by
  // default: those rows are left untouched.
  bool zero_tail = false;
  // Forward spreads (padded_gather, dispatch, pad_to_alignment): false leaves
  // padding rows (rows below P that hold no assignment) unwritten, for
  // consumers that never read them (DeepGEMM with the -1 row layout, masked
  // grouped GEMMs): P - A fewer rows written. Safe for an inference forward;
  // never for a tensor whose padded rows enter a reduction (a weight gradient
  // over all P rows, a GEMM that reads every row). Backward outputs
  // (grad_y of combine_backward / padded_scatter_backward, unpad's
  // grad_padded) always zero their padding rows.
  bool zero_padding = true;
  // CUDA: scratch memory an op needs beyond `workspace` comes from
  // scratch_alloc(bytes, stream, scratch_ctx) and goes back through
  // scratch_free(ptr, stream, scratch_ctx) once the op's work is queued (a
  // framework's stream-ordered caching allocator: padmoe.torch passes torch's).
  // Unset: padmoe's own stream-ordered pool per device, which keeps freed
  // memory for reuse (cudaMallocFromPoolAsync; cudaMallocAsync while the
  // stream captures a graph).
  void* (*scratch_alloc)(size_t bytes, void* stream, void* ctx) = nullptr;
  void (*scratch_free)(void* ptr, void* stream, void* ctx) = nullptr;
  void* scratch_ctx = nullptr;
};

// Device scratch bytes that suffice for every op on a routing of num_tokens x
// top_k over num_experts at `alignment` (and for pad / unpad of up to
// A + E*(alignment-1) rows): allocate once, pass as Options::workspace.
size_t workspace_bound(int64_t num_tokens, int top_k, int num_experts, int alignment);

// ---------------------------------------------------------------------------
// 1. Routing plan
// ---------------------------------------------------------------------------

// Caller-owned plan buffers (all int32, on one device). Sizes: indices,
// bin_ids, dest_rows: [A]; tokens_per_expert, bins, padded_tokens_per_expert,
// padded_bins: [E]; row_sources: [R] with R >= P (use padded_rows_bound to size
// it without knowing P; rows at or past P are set to -1).
struct PlanView {
  TensorView indices;                   // assignment ids, stable-sorted by expert
  TensorView bin_ids;                   // expert of indices[i]; nondecreasing
  TensorView tokens_per_expert;         // count of each expert
  TensorView bins;                      // inclusive cumsum of tokens_per_expert
  TensorView padded_tokens_per_expert;  // round_up(count, alignment)
  TensorView padded_bins;               // inclusive cumsum of the padded counts
  TensorView dest_rows;                 // padded row of assignment a
  TensorView row_sources;               // assignment stored in each padded row, or -1
  int64_t num_tokens = 0;               // T
  int top_k = 1;                        // K
  int num_experts = 0;                  // E
  int alignment = 1;                    // m
};

// An owning plan, as returned by make_plan().
struct Plan {
  Tensor indices, bin_ids, tokens_per_expert, bins, padded_tokens_per_expert, padded_bins, dest_rows, row_sources;
  int64_t num_tokens = 0;
  int top_k = 1;
  int num_experts = 0;
  int alignment = 1;

  // Uninitialized buffers for make_plan_out on `device` (row_sources with
  // padded_rows_bound() entries): allocate once, refill each step (e.g. in a CUDA graph).
  static Plan empty(int64_t num_tokens, int top_k, int num_experts, int alignment, Device device = Device::cpu());

  PlanView view() const;
  int64_t num_assignments() const { return num_tokens * top_k; }
  // Host-side bound on P: the size of row_sources, A + E*(alignment-1) (E * C for
  // a plan made with a capacity).
  int64_t padded_rows_bound() const;
  [[deprecated("use padded_rows_bound")]] int64_t capacity() const { return padded_rows_bound(); }
};

// Host-side bound on P: A + E * (alignment - 1). The size helpers here (padded_rows_bound,
// workspace_bound, plan_rows_bound, aligned_rows_bound, sort_chunks_rows_bound, Plan::empty) check
// their arguments and throw padmoe::Error ("<helper>: <argument>: size overflow") rather than
// return a bound that does not fit 64 bits.
int64_t padded_rows_bound(int64_t num_tokens, int top_k, int num_experts, int alignment);
// Deprecated name of padded_rows_bound (removed in the next release).
[[deprecated("use padded_rows_bound")]] inline int64_t capacity_bound(int64_t num_tokens, int top_k, int num_experts,
                                                                      int alignment) {
  return padded_rows_bound(num_tokens, top_k, num_experts, alignment);
}

// P = padded_bins[E-1], read on the host (on CUDA this synchronizes the stream).
int64_t padded_rows(const PlanView& plan, const Options& options = {});
int64_t padded_rows(const Plan& plan, const Options& options = {});

// Every _out form writes by its checked arguments and the output arrays' shapes: an output
// PlanView's scalar fields are never read. In every _out form (and copy) outputs must not share
// memory with the inputs or with each other (refused as "<op>: <output>: shares memory with
// <input>"); column slices of one buffer side by side do not overlap.
//
// make_plan(top_experts[T, K] int32|int64, E, m): docs/spec.md §3. On CUDA,
// out.row_sources needs at least padded_rows_bound() entries (P is not known on
// the host); in unchecked mode an expert id outside [0, E) is dropped
// (dest_rows -1) rather than validated.
Plan make_plan(const TensorView& top_experts, int num_experts, int alignment, const Options& options = {});
void make_plan_out(const TensorView& top_experts, int num_experts, int alignment, const PlanView& out,
                   const Options& options = {});

// Layouts other kernels consume, written by make_plan_out in the same pass as
// the plan (no pass over the rows). Each output is optional: an unset
// TensorView (default-constructed: data == nullptr, ndim 0) is skipped. All int32, on the
// plan's device. R = out.row_sources.shape[0].
//   row_experts   [R]: the expert of each padded row, -1 on padding rows and
//                 rows at or past P (DeepGEMM's contiguous grouped layout).
//   block_experts [ceil(R / m)]: the expert of each block of m rows, -1 for
//                 blocks at or past P / m (vLLM's expert_ids, m = alignment =
//                 the block size).
//   padded_total  [1]: P (vLLM's num_tokens_post_padded), on the device.
// On CUDA make_plan_out accepts a row_sources of at least
// A + min(A, E) * (m - 1) entries (aligned_rows_bound: vLLM's
// max_num_tokens_padded), which bounds P.
struct PlanLayouts {
  TensorView row_experts;
  TensorView block_experts;
  TensorView padded_total;
};
void make_plan_out(const TensorView& top_experts, int num_experts, int alignment, const PlanView& out,
                   const PlanLayouts& layouts, const Options& options = {});

// Routing choices of make_plan beyond the plain sort: expert parallelism
// (local experts), dropping of invalid ids, and a fixed per-expert capacity.
// Every one drops assignments the same way on both backends: a dropped
// assignment a has dest_rows[a] = -1 and no sorted position; the kept ones
// fill sorted positions [0, bins[E-1]) in the usual stable order and
// positions [bins[E-1], A) hold indices = bin_ids = -1; counts, bins and
// padding cover kept assignments only. The row ops treat a dropped
// assignment as absent: dispatch writes no row for it, combine adds nothing
// for it, and its weight gradient is zero.
enum class DropPolicy {
  kPosition,  // an expert keeps its first C assignments in the stable (assignment id) order
  kProbs,     // the C with the largest router weight (Megatron's "probs"); ties: lower id first
};
struct PlanOptions {
  // Expert parallelism: ids in top_experts are global, in [0, global_experts)
  // (0: global_experts = num_experts), and the plan's num_experts experts are
  // local. With expert_map ([global_experts] int32/int64 on top_experts'
  // device: local id in [0, num_experts), or -1 = not local): local =
  // expert_map[e]. Without: the range [first_expert, first_expert +
  // num_experts), local = e - first_expert. Other experts' assignments are
  // dropped.
  int global_experts = 0;
  int first_expert = 0;
  TensorView expert_map;  // unset (data == nullptr): the range
  // Ids outside [0, global_experts) (negative ids, transformers' id E for
  // tokens routed to no local expert): an error naming the first one (false,
  // the default), or dropped (true).
  bool drop_invalid = false;
  // Fixed capacity C >= 0 (-1: none). Every expert's padded segment is exactly
  // C rows (layout [E, C, H]: P = E * C, known on the host); an expert keeps C
  // of its assignments by drop_policy, the rest are dropped. alignment must
  // divide C.
  int64_t expert_capacity = -1;
  DropPolicy drop_policy = DropPolicy::kPosition;
  TensorView probs;  // kProbs: router weights [T, K] (float32/float16/bfloat16), on the device
  // Optional [1] int32 output on the device: the number of assignments to local
  // experts dropped because their expert was full (no host read; assert on it
  // asynchronously). Written whenever given (0 without a capacity).
  TensorView dropped;
};

// Rows of row_sources (and of padded outputs) a plan with these options can
// need: E * C with an expert_capacity, else padded_rows_bound(). Host-side, no data read.
int64_t plan_rows_bound(int64_t num_tokens, int top_k, int num_experts, int alignment, const PlanOptions& plan_options);

// make_plan with PlanOptions. The allocating form sizes row_sources with
// plan_rows_bound. On CUDA with check_data, the ids (and expert_map entries,
// which must be in [-1, num_experts)) are validated on the device first.
Plan make_plan(const TensorView& top_experts, int num_experts, int alignment, const PlanOptions& plan_options,
               const Options& options = {});
void make_plan_out(const TensorView& top_experts, int num_experts, int alignment, const PlanView& out,
                   const PlanLayouts& layouts, const PlanOptions& plan_options, const Options& options = {});

// vLLM / SGLang's moe_align_block_size(topk_ids, block_size, num_experts)
// contract, from one make_plan: sorted_token_ids [R] (the assignment ids
// t*K+k of each expert in stable order, each expert padded to a multiple of
// block_size with the sentinel A), expert_ids [ceil(R / block_size)] (each
// block's expert; -1 for the blocks at or past P, as vLLM's kernel writes),
// num_tokens_post_padded [1] = P, with R = A + min(A, E) * (block_size - 1),
// rounded up to block_size when pad_sorted_ids. padmoe keeps assignment order
// within an expert (vLLM's atomic kernel does not promise an order). As in
// vLLM, ids outside [0, E) are skipped: their assignments get no entry and
// count towards no expert (make_plan, by contrast, rejects them).
//
// With expert_map ([E] int32/int64 on top_experts' device: local id in
// [0, E), or -1): vLLM's ignore_invalid_experts=True. Assignments whose expert
// maps to -1 get no entry; the others are grouped, padded and ordered by their
// local id, and expert_ids hold local ids. R is the same bound.
struct AlignedBlocks {
  Tensor sorted_token_ids, expert_ids, num_tokens_post_padded;
};
int64_t aligned_rows_bound(int64_t assignments, int num_experts, int block_size, bool pad_sorted_ids = false);
AlignedBlocks moe_align_block_size(const TensorView& top_experts, int block_size, int num_experts,
                                   bool pad_sorted_ids = false, const Options& options = {});
// _out: sorted_token_ids has at least aligned_rows_bound(A, E, block_size)
// entries (R; every one written), expert_ids ceil(R / block_size), and
// num_tokens_post_padded 1. On CUDA no host synchronization (unchecked);
// the plan's other arrays come from scratch_alloc or padmoe's pool
// (Options::workspace serves make_plan's own scratch).
void moe_align_block_size_out(const TensorView& top_experts, int block_size, int num_experts,
                              const TensorView& sorted_token_ids, const TensorView& expert_ids,
                              const TensorView& num_tokens_post_padded, const Options& options = {});
AlignedBlocks moe_align_block_size(const TensorView& top_experts, int block_size, int num_experts,
                                   const TensorView& expert_map, bool pad_sorted_ids = false,
                                   const Options& options = {});
void moe_align_block_size_out(const TensorView& top_experts, int block_size, int num_experts,
                              const TensorView& expert_map, const TensorView& sorted_token_ids,
                              const TensorView& expert_ids, const TensorView& num_tokens_post_padded,
                              const Options& options = {});

// vLLM's batched_moe_align_block_size(max_tokens_per_batch, block_size,
// expert_num_tokens) for the batched layout, where expert e's tokens are the
// rows e * max_tokens_per_batch + j, j < expert_num_tokens[e]. With E experts
// and N = ceil(max_tokens_per_batch / block_size) * block_size * E:
//   sorted_ids [N]: expert e's row ids in ascending order, its run padded to a
//     multiple of block_size, the runs back to back in expert order; every
//     other entry the sentinel E * max_tokens_per_batch;
//   block_ids [N / block_size]: each block's expert, -1 for the blocks past
//     the runs;
//   num_tokens_post_pad [1]: the padded total (0 when E = 0).
// expert_num_tokens: [E] int32/int64, every count in [0, max_tokens_per_batch]
// (checked on the CPU always, on CUDA with check_data: one synchronization;
// unchecked, a count outside that range reads as clamped into it). Outputs
// int32, exactly these sizes, on the counts' device; every entry is written.
// On CUDA unchecked: no host synchronization (capturable in a CUDA graph).
void batched_moe_align_block_size_out(const TensorView& expert_num_tokens, int max_tokens_per_batch, int block_size,
                                      const TensorView& sorted_ids, const TensorView& block_ids,
                                      const TensorView& num_tokens_post_pad, const Options& options = {});
// The allocating form: (sorted_ids, block_ids, num_tokens_post_pad) as AlignedBlocks'
// (sorted_token_ids, expert_ids, num_tokens_post_padded).
AlignedBlocks batched_moe_align_block_size(const TensorView& expert_num_tokens, int max_tokens_per_batch,
                                           int block_size, const Options& options = {});

// A plan from a routing mask (TransformerEngine's mask map): routing_map [T, E]
// uint8 (a bool tensor's bytes; nonzero = token t routed to expert e), the
// assignment of (t, e) being a = t * E + e (top_k = E). Rows go expert-major,
// tokens ascending within an expert, each expert's rows padded to a multiple of
// `alignment`: dest(t, e) = pstart[e] + (tokens before t routed to e), where
// pstart is the exclusive sum of the padded counts; a destination at or past
// `rows` is dropped (-1), as is every unrouted pair. Outputs, int32, every entry
// written:
//   counts [4 * E]: tokens_per_expert, bins (inclusive sums), the padded counts,
//     padded_bins (a plan's four [E] arrays; the counts before any drop); or,
//     with one_bin (alignment 1 only), [4]: {kept, kept, rows, rows} with kept =
//     min(routed, rows): the plan seen as one expert of capacity `rows`;
//   dest_rows [T * E]: the destinations above;
//   row_sources [S] (any S >= 0): the assignment whose destination is r, -1 for
//     padding rows and rows past the routed ones;
//   indices, bin_ids [T * E] (optional, both or neither): the kept assignments
//     and their experts in sorted (expert-major, token) order, then -1;
//   row_id_map [T, 2E + 1] (optional: unset skips it): TransformerEngine's mask
//     row_id_map: per token the kept destinations in descending expert order,
//     less the expert's padding offset (pstart[e] - the unpadded start), then
//     those experts, the rest of both halves -1, and the count last.
// T * E and rows at most INT32_MAX. No data checks (every mask is valid); on
// CUDA no host synchronization, two or three launches (capturable in a CUDA graph).
void mask_plan_out(const TensorView& routing_map, int alignment, int64_t rows, bool one_bin, const TensorView& counts,
                   const TensorView& dest_rows, const TensorView& row_sources, const TensorView& row_id_map,
                   const TensorView& indices = {}, const TensorView& bin_ids = {}, const Options& options = {});
// The same with router probabilities moved with the rows (TransformerEngine's permute with probs):
// probs [T, E] (float32, float16 or bfloat16, contiguous; only the routed entries are read) and
// moved_probs [S] of probs' dtype (S = row_sources' length): moved_probs[r] = probs[a] for the
// assignment a = row_sources[r], 0 where row_sources[r] is -1. Unset probs and moved_probs (both):
// the form above.
void mask_plan_out(const TensorView& routing_map, int alignment, int64_t rows, bool one_bin, const TensorView& counts,
                   const TensorView& dest_rows, const TensorView& row_sources, const TensorView& row_id_map,
                   const TensorView& indices, const TensorView& bin_ids, const TensorView& probs,
                   const TensorView& moved_probs, const Options& options = {});
// The same, also writing probs_nonzero [T * E] float32 (with probs only): 1 where the pair has a
// row (dest_rows >= 0) and its prob is nonzero (a NaN included, -0 not), 0 elsewhere. They are
// the dispatch weights of TransformerEngine's permute with probs, which writes a zero row for a
// routed slot of probability 0 (Megatron's padded routing map), made in the plan's pass instead
// of a pass over probs of their own. Unset: the form above.
void mask_plan_out(const TensorView& routing_map, int alignment, int64_t rows, bool one_bin, const TensorView& counts,
                   const TensorView& dest_rows, const TensorView& row_sources, const TensorView& row_id_map,
                   const TensorView& indices, const TensorView& bin_ids, const TensorView& probs,
                   const TensorView& moved_probs, const TensorView& probs_nonzero, const Options& options = {});

// A plan from an index map whose ids have no known bound (TransformerEngine's index map without a
// number of experts): top_experts [T, K] int32, the assignment of (t, k) being a = t * K + k. The
// assignments are stable-sorted by their id read as uint32 (a negative id sorts after every
// non-negative one, -1 last) and the j-th sorted goes to row j; a row at or past `rows` is dropped.
// The plan is one expert of capacity `rows`. Outputs, int32, every entry written:
//   counts [4]: {kept, kept, rows, rows} with kept = min(T * K, rows);
//   dest_rows [T * K]: the row of each assignment, -1 where dropped;
//   row_sources [S] (any S >= 0): the assignment in row r for r < kept, -1 after;
//   indices, bin_ids [T * K] (optional, both or neither): the kept assignments in sorted order and
//     their expert (0), then -1.
// T * K and rows at most INT32_MAX. No data checks (every id is valid); on CUDA no host
// synchronization: one launch up to cuda::kIndexPlanBlockSort assignments (a block's radix sort),
// else three (a device-wide radix sort; scratch from Options::workspace or padmoe's pool).
void index_plan_out(const TensorView& top_experts, int64_t rows, const TensorView& counts, const TensorView& dest_rows,
                    const TensorView& row_sources, const TensorView& indices = {}, const TensorView& bin_ids = {},
                    const Options& options = {});

// ---------------------------------------------------------------------------
// 2. MegaBlocks family (input in token order)
// ---------------------------------------------------------------------------

// y[row(i)] = x[indices[i] / K] (* weights[indices[i]]); padding rows zero.
// y has P rows (allocating form) or at least P rows (_out).
Tensor padded_gather(const TensorView& x, const TensorView& indices, const TensorView& bin_ids, const TensorView& bins,
                     const TensorView& padded_bins, int top_k, const std::optional<TensorView>& weights = std::nullopt,
                     const Options& options = {});
void padded_gather_out(const TensorView& x, const TensorView& indices, const TensorView& bin_ids,
                       const TensorView& bins, const TensorView& padded_bins, int top_k,
                       const std::optional<TensorView>& weights, const TensorView& y, const Options& options = {});

// out[t] = sum_k w(t*K+k) * y[dest_rows[t*K+k]] in float32, ascending k.
// out has T = A / K rows.
Tensor padded_scatter(const TensorView& y, const TensorView& indices, const TensorView& bin_ids,
                      const std::optional<TensorView>& weights, const TensorView& bins, const TensorView& padded_bins,
                      int top_k, const Options& options = {});
void padded_scatter_out(const TensorView& y, const TensorView& indices, const TensorView& bin_ids,
                        const std::optional<TensorView>& weights, const TensorView& bins, const TensorView& padded_bins,
                        int top_k, const TensorView& out, const Options& options = {});

// wgrad[a] = sum_h y[dest_rows[a], h] * grad[a / K, h] in float32.
// Allocating form returns y's dtype (as MegaBlocks); _out accepts float32 or y's dtype.
Tensor padded_scatter_wgrad(const TensorView& y, const TensorView& grad, const TensorView& indices,
                            const TensorView& bin_ids, const TensorView& bins, const TensorView& padded_bins, int top_k,
                            const Options& options = {});
void padded_scatter_wgrad_out(const TensorView& y, const TensorView& grad, const TensorView& indices,
                              const TensorView& bin_ids, const TensorView& bins, const TensorView& padded_bins,
                              int top_k, const TensorView& wgrad, const Options& options = {});

// Gradients of a forward op: grad of the row input, and of the weights when
// weights were given (grad_weights is undefined otherwise).
struct RowGrads {
  Tensor grad_rows;
  Tensor grad_weights;
};

// Backward of padded_gather: grad_x = padded_scatter(grad_y, weights), i.e.
// grad_x[t] = sum_k w(a) * grad_y[dest_rows[a]] (MegaBlocks' weights=None is the
// unweighted case; a weighted gather scales its gradient by the same weights);
// grad_weights[a] = <grad_y[dest_rows[a]], x[a / K]> when weights were given.
RowGrads padded_gather_backward(const TensorView& grad_y, const TensorView& x, const TensorView& indices,
                                const TensorView& bin_ids, const TensorView& bins, const TensorView& padded_bins,
                                int top_k, const std::optional<TensorView>& weights = std::nullopt,
                                const Options& options = {});

// _out: grad_x [T, H]; grad_weights float32 or x's dtype with A elements, or
// an empty TensorView{} to skip it. In every backward _out form a given
// weight-gradient output is filled even when the forward had no weights (the
// gradient with respect to unit weights).
void padded_gather_backward_out(const TensorView& grad_y, const TensorView& x, const TensorView& indices,
                                const TensorView& bin_ids, const TensorView& bins, const TensorView& padded_bins,
                                int top_k, const std::optional<TensorView>& weights, const TensorView& grad_x,
                                const TensorView& grad_weights, const Options& options = {});

// Backward of padded_scatter: grad_y = padded_gather(grad_out, weights) (P rows,
// padding zero); grad_weights = padded_scatter_wgrad(y, grad_out) when weights
// were given.
RowGrads padded_scatter_backward(const TensorView& grad_out, const TensorView& y, const TensorView& indices,
                                 const TensorView& bin_ids, const std::optional<TensorView>& weights,
                                 const TensorView& bins, const TensorView& padded_bins, int top_k,
                                 const Options& options = {});

// _out: grad_y [>= P, H] (rows past P untouched); grad_weights float32 or y's
// dtype with A elements, or an empty TensorView{} to skip it.
void padded_scatter_backward_out(const TensorView& grad_out, const TensorView& y, const TensorView& indices,
                                 const TensorView& bin_ids, const std::optional<TensorView>& weights,
                                 const TensorView& bins, const TensorView& padded_bins, int top_k,
                                 const TensorView& grad_y, const TensorView& grad_weights, const Options& options = {});

// Fused forms on a plan. dispatch == padded_gather, reading each token row
// once and writing its K copies; combine == padded_scatter.
Tensor dispatch(const TensorView& x, const PlanView& plan, const std::optional<TensorView>& weights = std::nullopt,
                const Options& options = {});
void dispatch_out(const TensorView& x, const PlanView& plan, const std::optional<TensorView>& weights,
                  const TensorView& y, const Options& options = {});

// make_plan then dispatch in one call: the plan of top_experts[T, K] (make_plan's, bit for bit)
// and y[dest_rows[a]] = x[a / K] (times weights[a] when given), padding rows zero: make_plan's
// launch then dispatch's, with one set of checks (padmoe.torch: one operator call instead of two).
// Errors are make_plan's and dispatch's, raised before anything is written. (A single CUDA kernel
// doing both at decode sizes was measured and not kept: docs/decisions.md.)
// The allocating form returns y with plan.padded_rows_bound() rows (no host synchronization: rows at or
// past P are zero, as padmoe.torch.dispatch's). _out: y needs at least as many rows as
// out.row_sources (padded_rows_bound() on CUDA, P on the CPU), x's columns and dtype; rows at or past
// P are zeroed only with options.zero_tail; options.zero_padding as dispatch's.
struct PlannedRows {
  Plan plan;
  Tensor y;
};
PlannedRows make_plan_and_dispatch(const TensorView& x, const TensorView& top_experts, int num_experts, int alignment,
                                   const std::optional<TensorView>& weights = std::nullopt,
                                   const Options& options = {});
void make_plan_and_dispatch_out(const TensorView& x, const TensorView& top_experts, int num_experts, int alignment,
                                const PlanView& out, const std::optional<TensorView>& weights, const TensorView& y,
                                const Options& options = {});

Tensor combine(const TensorView& y, const PlanView& plan, const std::optional<TensorView>& weights = std::nullopt,
               const Options& options = {});
void combine_out(const TensorView& y, const PlanView& plan, const std::optional<TensorView>& weights,
                 const TensorView& out, const Options& options = {});

// Backward of combine from one read of grad_out:
//   grad_y[dest_rows[a]] = w(a) * grad_out[a / K] (padding rows zero), and
//   grad_weights[a] = <y[dest_rows[a]], grad_out[a / K]> when weights are given.
// _out: grad_weights float32 or y's dtype with A elements, or an empty
// TensorView{} to skip it.
RowGrads combine_backward(const TensorView& grad_out, const TensorView& y, const PlanView& plan,
                          const std::optional<TensorView>& weights = std::nullopt, const Options& options = {});
void combine_backward_out(const TensorView& grad_out, const TensorView& y, const PlanView& plan,
                          const std::optional<TensorView>& weights, const TensorView& grad_y,
                          const TensorView& grad_weights, const Options& options = {});

// Backward of dispatch: grad_x = combine(grad_y, weights) (unweighted when the
// dispatch was) and
// grad_weights[a] = <grad_y[dest_rows[a]], x[a / K]> when weights were given.
RowGrads dispatch_backward(const TensorView& grad_y, const TensorView& x, const PlanView& plan,
                           const std::optional<TensorView>& weights = std::nullopt, const Options& options = {});
void dispatch_backward_out(const TensorView& grad_y, const TensorView& x, const PlanView& plan,
                           const std::optional<TensorView>& weights, const TensorView& grad_x,
                           const TensorView& grad_weights, const Options& options = {});

// ---------------------------------------------------------------------------
// 3. Megatron family (input already expert-grouped)
// ---------------------------------------------------------------------------

struct PadResult {
  Tensor padded;             // [P, H]
  Tensor permutation_map;    // [P] int32: source row of h, or -1 for padding
  Tensor inclusive_offsets;  // [E] int32: padded inclusive cumsum (grouped GEMM offs)
};

// Expert e's rows [excl(e), excl(e)+count(e)) of h move, in order, to
// [pexcl(e), pexcl(e)+count(e)); padding rows are zero and map to -1. Rows of
// h at or past sum(tokens_per_expert) are ignored.
PadResult pad_to_alignment(const TensorView& hidden_states, const TensorView& tokens_per_expert, int alignment,
                           const Options& options = {});
// _out: padded has >= P rows (rows past P untouched, or zeroed with options.zero_tail, as a
// spread's: padmoe's Python rows= form asks for it); permutation_map has as
// many entries as padded has rows (entries past P are set to -1).
void pad_to_alignment_out(const TensorView& hidden_states, const TensorView& tokens_per_expert, int alignment,
                          const TensorView& padded, const TensorView& permutation_map,
                          const TensorView& inclusive_offsets, const Options& options = {});
// P for these inputs, after every check pad_to_alignment makes before it allocates (on CUDA the
// counts are read to the host: one synchronization): how a caller that allocates the outputs
// itself sizes them, so that counts from bad data never size an allocation.
int64_t pad_to_alignment_rows(const TensorView& hidden_states, const TensorView& tokens_per_expert, int alignment,
                              const Options& options = {});

// out[map[p]] = padded[p] (* probs[map[p]]) for every map[p] >= 0; rows no
// entry names are zero. out has original_size rows. Entries of map must be
// -1 or distinct rows in [0, original_size).
Tensor unpad_from_alignment(const TensorView& padded, const TensorView& permutation_map, int64_t original_size,
                            const std::optional<TensorView>& probs = std::nullopt, const Options& options = {});
void unpad_from_alignment_out(const TensorView& padded, const TensorView& permutation_map,
                              const std::optional<TensorView>& probs, const TensorView& out,
                              const Options& options = {});

// Backward of unpad_from_alignment:
//   grad_padded[p] = grad_out[map[p]] (* probs[map[p]]), zero where map[p] < 0;
//   grad_probs[n]  = <grad_out[n], padded[p]> for the p with map[p] == n, else 0
//                    (only when probs were given).
// The backward of pad_to_alignment is unpad_from_alignment(grad, map, N).
RowGrads unpad_from_alignment_backward(const TensorView& grad_out, const TensorView& padded,
                                       const TensorView& permutation_map,
                                       const std::optional<TensorView>& probs = std::nullopt,
                                       const Options& options = {});
// _out: grad_padded has padded's shape; grad_probs float32 or the rows' dtype
// with N elements, or an empty TensorView{} to skip it.
void unpad_from_alignment_backward_out(const TensorView& grad_out, const TensorView& padded,
                                       const TensorView& permutation_map, const std::optional<TensorView>& probs,
                                       const TensorView& grad_padded, const TensorView& grad_probs,
                                       const Options& options = {});

// ---------------------------------------------------------------------------
// 4. Rows moved with their scales (float8 + scales; docs/spec.md §10)
// ---------------------------------------------------------------------------
//
// The move-only ops (dispatch and padded_gather without weights,
// pad_to_alignment, unpad_from_alignment without probs) in `_scaled` forms
// that move a scale tensor alongside the rows: the scale row of a source row
// goes wherever the row goes, written by the same work item in the same pass
// (one CPU loop, one CUDA launch). The `_scaled` forms take the scales where
// the plain forms take weights / probs (there are no weights: a weighted
// move of quantized rows would need a requantization), and the output scales
// right after the output rows. Scale layouts, inferred from dtype and shape
// for rows of H columns (row-major, contiguous, rows matching their rows):
//   per row       float32 [rows] or [rows, 1]
//   per 128 cols  float32 [rows, ceil(H/128)]        (DeepSeek-V3 blockwise)
//   MXFP8 E8M0    uint8   [rows, ceil(H/32)]         (OCP MX v1.0 shared exponents)
// (for H <= 128 the first two coincide). The output scales have the input's
// layout (same dtype and column count). Rows may be of any row dtype (float8
// e4m3/e5m2 is the intended use; 16-bit or float32 rows only move their
// metadata). Output padding rows get zero data and a scale that decodes to 1
// (float32 1.0f, E8M0 byte 127): both left unwritten with
// Options::zero_padding = false. Rows at or past P are untouched, or zeroed
// with scale 1 when Options::zero_tail asks a spread (dispatch, gather) to.
// unpad: output rows no map entry names get zero data and scale 1.

enum class ScaleLayout { kPerRow, kBlock128, kMxE8M0 };

// The layout of `scales` for rows of `hidden` columns; throws padmoe::Error
// (naming `name`) for a dtype / shape that is none of the three.
ScaleLayout scale_layout(const TensorView& scales, int64_t hidden, const char* name = "scales");
// Scale columns of a layout for rows of `hidden` columns (1, ceil(H/128), ceil(H/32)).
int64_t scale_columns(ScaleLayout layout, int64_t hidden);

// Rows and their scales (allocating `_scaled` forms).
struct ScaledRows {
  Tensor rows;    // [P, H] (dispatch, gather) or [N, H] (unpad)
  Tensor scales;  // the input scales' layout, as many rows as `rows`
};
struct PadScaledResult {
  Tensor padded, padded_scales, permutation_map, inclusive_offsets;
};

// dispatch (no weights) moving x_scales [T, ...] to y_scales [rows of y, ...].
ScaledRows dispatch_scaled(const TensorView& x, const PlanView& plan, const TensorView& x_scales,
                           const Options& options = {});
void dispatch_scaled_out(const TensorView& x, const PlanView& plan, const TensorView& x_scales, const TensorView& y,
                         const TensorView& y_scales, const Options& options = {});

// Fused quantizing dispatch: x [T, H] float32 / float16 /
// bfloat16 in, float8 rows (e4m3, or e5m2) plus scales out, in one read of
// each token row: the row is quantized once (per block: amax -> scale ->
// codes) and its codes and scale row are written to each of its K
// destination rows. The layout is y_scales' (inferred as above, rows = y's
// rows): float32 [rows, ceil(H/128)] DeepSeek-V3 1x128 blockwise, uint8
// [rows, ceil(H/32)] MXFP8 E8M0 (OCP MX v1.0), float32 [rows] / [rows, 1]
// per row. The quantizers (docs/design.md, "Fused quantizing dispatch"):
//   blockwise / per row: scale = amax / fp8_max (float32 division; 448 for
//     e4m3, 57344 for e5m2; amax == 0 -> scale 1), q = sat(x / scale);
//   MXFP8: X = floor(log2(amax)) - emax_elem (8 e4m3, 15 e5m2), clamped to
//     [-127, 127], byte X + 127 (amax == 0 -> 127), q = sat(x / 2^X);
//   sat: round to nearest even, saturating to +-fp8_max; a block holding a
//     NaN or infinity gets scale NaN (0x7fc00000 / byte 0xff) and NaN codes.
// Padding rows: zero codes and scale 1 (both unwritten with
// Options::zero_padding = false); rows at or past P untouched, or zeroed with
// scale 1 under Options::zero_tail. Unweighted only: applying router weights
// before quantizing is another op (the scales would be per assignment, not
// per token). Bitwise the same on the CPU and CUDA, and the same as quantize()
// followed by dispatch_scaled (the two-pass way).
// Allocating form: P rows of `dtype` (float8) and scales of `layout` ([P] for
// per row).
ScaledRows dispatch_quantized(const TensorView& x, const PlanView& plan, ScaleLayout layout,
                              DType dtype = DType::kFloat8E4M3, const Options& options = {});
void dispatch_quantized_out(const TensorView& x, const PlanView& plan, const TensorView& y, const TensorView& y_scales,
                            const Options& options = {});

// The quantizer alone (no routing): x [N, H] -> y [N, H] float8 and y_scales
// [N, ...] (the layout inferred from y_scales), the same bits as
// dispatch_quantized gives each token.
ScaledRows quantize(const TensorView& x, ScaleLayout layout, DType dtype = DType::kFloat8E4M3,
                    const Options& options = {});
void quantize_out(const TensorView& x, const TensorView& y, const TensorView& y_scales, const Options& options = {});

// padded_gather (no weights) moving x_scales [T, ...] to y_scales [rows of y, ...].
ScaledRows padded_gather_scaled(const TensorView& x, const TensorView& indices, const TensorView& bin_ids,
                                const TensorView& bins, const TensorView& padded_bins, int top_k,
                                const TensorView& x_scales, const Options& options = {});
void padded_gather_scaled_out(const TensorView& x, const TensorView& indices, const TensorView& bin_ids,
                              const TensorView& bins, const TensorView& padded_bins, int top_k,
                              const TensorView& x_scales, const TensorView& y, const TensorView& y_scales,
                              const Options& options = {});

// pad_to_alignment moving hidden_scales [N, ...] to padded_scales [rows of padded, ...].
PadScaledResult pad_to_alignment_scaled(const TensorView& hidden_states, const TensorView& tokens_per_expert,
                                        int alignment, const TensorView& hidden_scales, const Options& options = {});
void pad_to_alignment_scaled_out(const TensorView& hidden_states, const TensorView& tokens_per_expert, int alignment,
                                 const TensorView& hidden_scales, const TensorView& padded,
                                 const TensorView& padded_scales, const TensorView& permutation_map,
                                 const TensorView& inclusive_offsets, const Options& options = {});

// unpad_from_alignment (no probs) moving padded_scales [rows of padded, ...] to out_scales [N, ...].
ScaledRows unpad_from_alignment_scaled(const TensorView& padded, const TensorView& permutation_map,
                                       int64_t original_size, const TensorView& padded_scales,
                                       const Options& options = {});
void unpad_from_alignment_scaled_out(const TensorView& padded, const TensorView& permutation_map,
                                     const TensorView& padded_scales, const TensorView& out,
                                     const TensorView& out_scales, const Options& options = {});

// ---------------------------------------------------------------------------
// 5. Expert parallelism: chunk sort after an all-to-all
// ---------------------------------------------------------------------------
//
// After an expert-parallel all-to-all a rank holds a rank-major buffer
// received[N, H]: C = R*E chunks, chunk c = r*E + e holding split_sizes[c]
// rows (the rows from source rank r for local expert e), in the order
// c = 0..C-1. sort_chunks moves it, in one pass over the rows, to
// pad_to_alignment's expert-major padded layout:
//   output chunk positions j = 0..C-1 hold the source chunks
//     src(j) = sorted_index[j]                       (given: TE's order), or
//     src(j) = (j % R) * E + j / R                    (default: expert-major,
//              i.e. position e*R + r holds chunk r*E + e, Megatron's
//              sort_input_by_local_experts);
//   the positions form E = C / R groups of R consecutive positions (group g =
//   positions [g*R, (g+1)*R): local expert g by default); each group's rows
//   are padded to a multiple of `alignment` with zero rows.
// Outputs are pad_to_alignment's (PadResult): padded[P, H] with
// P = sum_g round_up(sum_{j in g} split_sizes[src(j)], alignment),
// permutation_map[P] int32 (source row in `received`, -1 for padding) and
// inclusive_offsets[E] int32 (padded inclusive cumsum per group: grouped-GEMM
// offs). Rows of `received` at or past sum(split_sizes) are ignored.
// TE's moe_sort_chunks_by_index(inp, split_sizes, sorted_index) is
// sort_chunks(inp, split_sizes, R, 1, sorted_index).padded for any R that
// divides C (alignment 1 adds no padding; R only groups the offsets).
//
// split_sizes: int32 or int64, contiguous, [C] or [R, E] (row-major; a 2-D
// tensor must have num_ranks rows). sorted_index: int32 or int64 [C], a
// permutation of [0, C). Checked (always on the CPU; on CUDA in checked
// mode, on the device): num_ranks >= 1 divides C, alignment >= 1, split sizes
// nonnegative (first offending [r, e]), their sum <= N, sorted_index a
// permutation (first out-of-range position, else the smallest repeated
// chunk), P within int32, output capacity.
//
// The way back (expert-major padded -> rank-major, padding dropped, each row
// optionally times probs[n] of its rank-major row n) is exactly
// unpad_from_alignment(padded, permutation_map, N, probs): the map names each
// source row once, so unpad is the inverse move, also one pass (rows of the
// rank-major output that no map entry names, i.e. rows at or past
// sum(split_sizes), are zero). unsort_chunks below is that call under this
// section's name; its errors name unpad_from_alignment. For autograd: the
// backward of sort_chunks is unsort_chunks(grad, map, N) and the backward of
// unsort_chunks is unpad_from_alignment_backward.
PadResult sort_chunks(const TensorView& received, const TensorView& split_sizes, int num_ranks, int alignment,
                      const std::optional<TensorView>& sorted_index = std::nullopt, const Options& options = {});
// _out: padded has >= P rows (rows past P untouched, or zeroed when
// Options::zero_tail); permutation_map has as many entries as padded has rows
// (entries past P are -1); inclusive_offsets has E = C / num_ranks entries.
// Size padded with sort_chunks_rows_bound() to avoid reading P. On CUDA with
// check_data = false: no host synchronization (capturable); device scratch
// of sort_chunks_workspace_bytes(C) bytes (Options::workspace or the pool).
// Options::zero_padding = false leaves padding rows (and rows past P)
// unwritten, as for pad_to_alignment.
void sort_chunks_out(const TensorView& received, const TensorView& split_sizes, int num_ranks, int alignment,
                     const std::optional<TensorView>& sorted_index, const TensorView& padded,
                     const TensorView& permutation_map, const TensorView& inclusive_offsets,
                     const Options& options = {});
// Host-side bound on P: received_rows + (num_chunks / num_ranks) * (alignment - 1).
int64_t sort_chunks_rows_bound(int64_t received_rows, int64_t num_chunks, int num_ranks, int alignment);
// Deprecated name of sort_chunks_rows_bound (removed in the next release).
[[deprecated("use sort_chunks_rows_bound")]] inline int64_t sort_chunks_capacity(int64_t received_rows,
                                                                                 int64_t num_chunks, int num_ranks,
                                                                                 int alignment) {
  return sort_chunks_rows_bound(received_rows, num_chunks, num_ranks, alignment);
}
// P for these inputs, after every check sort_chunks makes before it allocates (on CUDA the sizes
// and sorted_index are read to the host: one synchronization); see pad_to_alignment_rows.
int64_t sort_chunks_rows(const TensorView& received, const TensorView& split_sizes, int num_ranks, int alignment,
                         const std::optional<TensorView>& sorted_index = std::nullopt, const Options& options = {});
// CUDA scratch bytes sort_chunks_out needs for num_chunks chunks (0 on the CPU).
size_t sort_chunks_workspace_bytes(int64_t num_chunks);

// The inverse of sort_chunks: unpad_from_alignment under this section's name.
inline Tensor unsort_chunks(const TensorView& padded, const TensorView& permutation_map, int64_t received_rows,
                            const std::optional<TensorView>& probs = std::nullopt, const Options& options = {}) {
  return unpad_from_alignment(padded, permutation_map, received_rows, probs, options);
}
inline void unsort_chunks_out(const TensorView& padded, const TensorView& permutation_map,
                              const std::optional<TensorView>& probs, const TensorView& out,
                              const Options& options = {}) {
  unpad_from_alignment_out(padded, permutation_map, probs, out, options);
}

// ---------------------------------------------------------------------------
// Utilities
// ---------------------------------------------------------------------------

// dst = src byte for byte: same dtype and element count, both contiguous, on
// any devices (host <-> CUDA too, ordered on options.stream; a copy that
// touches host memory synchronizes the stream). On the CPU a parallel copy
// that streams large buffers past the caches (the copy padmoe's benchmarks
// also report as a bandwidth ceiling).
void copy(const TensorView& src, const TensorView& dst, const Options& options = {});

}  // namespace padmoe
