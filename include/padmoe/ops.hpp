// padmoe/ops.hpp — every routing op of SPEC sections 1-3.
//
// Each op comes in two forms:
//   - `op(...)` allocates its outputs (on the inputs' device) and returns them;
//   - `op_out(..., out)` writes into caller-owned buffers and allocates nothing
//     on the hot path.
// The backend is chosen by the tensors' device. All arguments are checked
// before anything is written (SPEC section 5); a failure throws padmoe::Error
// naming the op, the argument and the first offending position.
//
// Row tensors: float32, float16, bfloat16 ([rows, H], unit column stride,
// any row stride >= H); float8 e4m3/e5m2 are accepted by the move-only ops
// (gather/dispatch without weights, pad, unpad without probs). Index inputs:
// int32 or int64, contiguous. Index outputs: int32. Router weights / probs:
// float32 or the row dtype. Arithmetic is float32; sums run in ascending k and
// are cast once, so results are bitwise deterministic on a backend and do not
// depend on the thread count.
//
// Output capacity: every op that produces padded rows accepts an output of at
// least P = padded_bins[E-1] rows; rows at or past P are left untouched.
// Allocating forms allocate exactly P rows (on CUDA they read P from the
// device: one synchronization). On CUDA, the _out forms with check_data =
// false never synchronize with the host (capturable in a CUDA graph); P is then
// known on the device only, so size outputs with capacity_bound().
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
  // capacity_bound() is fully defined (padmoe.torch uses this). Off by
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
// padded_bins: [E]; row_sources: [R] with R >= P (use capacity_bound to size
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
  Tensor indices, bin_ids, tokens_per_expert, bins, padded_tokens_per_expert, padded_bins,
      dest_rows, row_sources;
  int64_t num_tokens = 0;
  int top_k = 1;
  int num_experts = 0;
  int alignment = 1;

  // Uninitialized buffers for make_plan_out on `device` (row_sources with
  // capacity() entries): allocate once, refill each step (e.g. in a CUDA graph).
  static Plan empty(int64_t num_tokens, int top_k, int num_experts, int alignment, Device device = Device::cpu());

  PlanView view() const;
  int64_t num_assignments() const { return num_tokens * top_k; }
  // Host-side bound on P: A + E*(alignment-1) (the size of row_sources).
  int64_t capacity() const;
};

// Host-side bound on P.
int64_t capacity_bound(int64_t num_tokens, int top_k, int num_experts, int alignment);

// P = padded_bins[E-1], read on the host (on CUDA this synchronizes the stream).
int64_t padded_rows(const PlanView& plan, const Options& options = {});
int64_t padded_rows(const Plan& plan, const Options& options = {});

// make_plan(top_experts[T, K] int32|int64, E, m): SPEC section 1. On CUDA,
// out.row_sources needs at least capacity_bound() entries (P is not known on
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
//                 blocks at or past P / m (vLLM's expert_ids; m = alignment =
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

// vLLM / SGLang's moe_align_block_size(topk_ids, block_size, num_experts)
// contract, from one make_plan: sorted_token_ids [R] (the assignment ids
// t*K+k of each expert in stable order, each expert padded to a multiple of
// block_size with the sentinel A), expert_ids [ceil(R / block_size)] (-1
// past the last block), num_tokens_post_padded [1] = P, with
// R = A + min(A, E) * (block_size - 1), rounded up to block_size when
// pad_sorted_ids. padmoe keeps assignment order within an expert (vLLM's
// atomic kernel does not promise an order).
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

// ---------------------------------------------------------------------------
// 2. MegaBlocks family (input in token order)
// ---------------------------------------------------------------------------

// y[row(i)] = x[indices[i] / K] (* weights[indices[i]]); padding rows zero.
// y has P rows (allocating form) or at least P rows (_out).
Tensor padded_gather(const TensorView& x, const TensorView& indices, const TensorView& bin_ids,
                     const TensorView& bins, const TensorView& padded_bins, int top_k,
                     const std::optional<TensorView>& weights = std::nullopt, const Options& options = {});
void padded_gather_out(const TensorView& x, const TensorView& indices, const TensorView& bin_ids,
                       const TensorView& bins, const TensorView& padded_bins, int top_k,
                       const std::optional<TensorView>& weights, const TensorView& y,
                       const Options& options = {});

// out[t] = sum_k w(t*K+k) * y[dest_rows[t*K+k]] in float32, ascending k.
// out has T = A / K rows.
Tensor padded_scatter(const TensorView& y, const TensorView& indices, const TensorView& bin_ids,
                      const std::optional<TensorView>& weights, const TensorView& bins,
                      const TensorView& padded_bins, int top_k, const Options& options = {});
void padded_scatter_out(const TensorView& y, const TensorView& indices, const TensorView& bin_ids,
                        const std::optional<TensorView>& weights, const TensorView& bins,
                        const TensorView& padded_bins, int top_k, const TensorView& out,
                        const Options& options = {});

// wgrad[a] = sum_h y[dest_rows[a], h] * grad[a / K, h] in float32.
// Allocating form returns y's dtype (as MegaBlocks); _out accepts float32 or y's dtype.
Tensor padded_scatter_wgrad(const TensorView& y, const TensorView& grad, const TensorView& indices,
                            const TensorView& bin_ids, const TensorView& bins, const TensorView& padded_bins,
                            int top_k, const Options& options = {});
void padded_scatter_wgrad_out(const TensorView& y, const TensorView& grad, const TensorView& indices,
                              const TensorView& bin_ids, const TensorView& bins,
                              const TensorView& padded_bins, int top_k, const TensorView& wgrad,
                              const Options& options = {});

// Gradients of a forward op: grad of the row input, and of the weights when
// weights were given (grad_weights is undefined otherwise).
struct RowGrads {
  Tensor grad_rows;
  Tensor grad_weights;
};

// Backward of padded_gather: grad_x = padded_scatter(grad_y, weights), i.e.
// grad_x[t] = sum_k w(a) * grad_y[dest_rows[a]] (SPEC's weights=None is the
// unweighted case; a weighted gather scales its gradient by the same weights);
// grad_weights[a] = <grad_y[dest_rows[a]], x[a / K]> when weights were given.
RowGrads padded_gather_backward(const TensorView& grad_y, const TensorView& x, const TensorView& indices,
                                const TensorView& bin_ids, const TensorView& bins,
                                const TensorView& padded_bins, int top_k,
                                const std::optional<TensorView>& weights = std::nullopt,
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
                                 const TensorView& grad_y, const TensorView& grad_weights,
                                 const Options& options = {});

// Fused forms on a plan. dispatch == padded_gather, reading each token row
// once and writing its K copies; combine == padded_scatter.
Tensor dispatch(const TensorView& x, const PlanView& plan,
                const std::optional<TensorView>& weights = std::nullopt, const Options& options = {});
void dispatch_out(const TensorView& x, const PlanView& plan, const std::optional<TensorView>& weights,
                  const TensorView& y, const Options& options = {});

Tensor combine(const TensorView& y, const PlanView& plan,
               const std::optional<TensorView>& weights = std::nullopt, const Options& options = {});
void combine_out(const TensorView& y, const PlanView& plan, const std::optional<TensorView>& weights,
                 const TensorView& out, const Options& options = {});

// Backward of combine from one read of grad_out:
//   grad_y[dest_rows[a]] = w(a) * grad_out[a / K] (padding rows zero), and
//   grad_weights[a] = <y[dest_rows[a]], grad_out[a / K]> when weights are given.
// _out: grad_weights float32 or y's dtype with A elements, or an empty
// TensorView{} to skip it.
RowGrads combine_backward(const TensorView& grad_out, const TensorView& y, const PlanView& plan,
                          const std::optional<TensorView>& weights = std::nullopt,
                          const Options& options = {});
void combine_backward_out(const TensorView& grad_out, const TensorView& y, const PlanView& plan,
                          const std::optional<TensorView>& weights, const TensorView& grad_y,
                          const TensorView& grad_weights, const Options& options = {});

// Backward of dispatch: grad_x = combine(grad_y, weights) (unweighted when the
// dispatch was) and
// grad_weights[a] = <grad_y[dest_rows[a]], x[a / K]> when weights were given.
RowGrads dispatch_backward(const TensorView& grad_y, const TensorView& x, const PlanView& plan,
                           const std::optional<TensorView>& weights = std::nullopt,
                           const Options& options = {});
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
// _out: padded has >= P rows (rows past P untouched); permutation_map has as
// many entries as padded has rows (entries past P are set to -1).
void pad_to_alignment_out(const TensorView& hidden_states, const TensorView& tokens_per_expert, int alignment,
                          const TensorView& padded, const TensorView& permutation_map,
                          const TensorView& inclusive_offsets, const Options& options = {});

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
// Utilities
// ---------------------------------------------------------------------------

// dst = src byte for byte: same dtype and element count, both contiguous, on
// any devices (host <-> CUDA too, ordered on options.stream; a copy that
// touches host memory synchronizes the stream). On the CPU a parallel copy
// that streams large buffers past the caches (the copy padmoe's benchmarks
// also report as a bandwidth ceiling).
void copy(const TensorView& src, const TensorView& dst, const Options& options = {});

}  // namespace padmoe
