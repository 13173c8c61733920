// workload_data.hpp — the workload of `check` and `bench` (sizes from the
// command line) and Data, every buffer the ops read and write.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common.hpp"
#include "gpu.hpp"
#include "reference/reference.hpp"
#include "workload/workload.hpp"

namespace cli {

// ===========================================================================
// Workload
// ===========================================================================

struct Workload {
  std::string label;  // what the header prints
  int64_t T = 0;
  int E = 0, K = 0;
  int64_t H = 0;
  int m = 1;
  DType dtype = DType::kBFloat16;
  Device device = Device::cpu();
  uint64_t seed = 0;
  int threads = 0;  // 0 = all
};

// The workload of --preset and the size flags, checked (UsageError, or the
// library's padmoe::Error for sizes it would reject) before anything is allocated.
Workload parse_workload(const Args& args);

// Everything the ops read and write, allocated once. Inputs in the padded
// layout ([P, H]) hold NaN in their padding rows, which no op may read.
struct Data {
  Workload w;
  Options opt;
  std::shared_ptr<GpuContext> gpu;  // --device cuda only; opt.stream is its stream
  int64_t A = 0, P = 0, R = 0, N = 0;  // assignments, padded rows, capacity, Megatron rows (= A)

  workload::Routing routing;
  Tensor top_experts;  // [T, K] int32
  Tensor weights;      // [A] float32 router weights, by assignment id
  Plan plan;           // the plan every op runs on

  Tensor x, grad_out;        // [T, H]
  Tensor y, grad_y;          // [P, H], padding rows NaN
  Tensor tokens_per_expert;  // [E] int32 (the plan's)
  Tensor h, grad_unpadded;   // [N, H]: h = x rows in expert-sorted order
  Tensor padded, perm_map;   // [P, H] (padding NaN), [P] int32: h padded as pad_to_alignment does
  Tensor probs;              // [N] float32: probs[i] = weights[indices[i]]
  // sort_chunks: h read as an all-to-all's rank-major receive buffer of ep_ranks ranks
  // (8 when E divides by 8, else 1), chunk (r, e) = global expert r*(E/ep_ranks) + e.
  int ep_ranks = 1;
  int64_t Pc = 0;            // sort_chunks' padded rows (E/ep_ranks local experts)
  Tensor split_sizes;        // [ep_ranks, E/ep_ranks] int32: tokens_per_expert as chunks
  Tensor x8, x8_scales;      // [T, H] float8 e4m3 (x rounded) and [T, ceil(H/128)] float32 scales

  // Outputs, reused by every op (no allocation inside a timed run).
  Plan plan_out;         // row_sources has R entries
  Tensor out_rows_R;     // [R, H]: gather / dispatch / pad outputs
  Tensor out_rows_T;     // [T, H]: scatter / combine outputs
  Tensor out_rows_N;     // [N, H]: unpad outputs
  Tensor out_rows_R2;    // [R, H]: grad_y of combine_backward / padded_scatter_backward
  Tensor out_rows_P;     // [P, H]: unpad backward grad_padded (padded's shape exactly)
  Tensor out_f32_A;      // [A] float32: wgrad / grad_weights
  Tensor out_f32_N;      // [N] float32: unpad backward grad_probs
  Tensor out_map_R;      // [R] int32
  Tensor out_offsets_E;  // [E] int32
  Tensor out_row_experts_R, out_block_experts, out_total_1;  // make_plan's layouts: [R], [ceil(R/m)], [1]
  Tensor out_sorted_V, out_block_ids_V, out_post_1;          // moe_align_block_size: [V], [ceil(V/m)], [1]
  // batched_moe_align_block_size over tokens_per_expert with max_tokens_per_batch = the largest count
  // (batched_max): B = round_up(batched_max, m) * E entries; [B], [B/m], [1]
  int batched_max = 0;
  int64_t B = 0;
  Tensor out_batched_B, out_batched_blocks, out_batched_post_1;
  // mask_plan: the routing as TE's mask map [T, E] uint8 (an input), and the plan of it with
  // Rm = T*E + E*(m-1) row_sources: counts [4E], dest_rows / indices / bin_ids [T*E], [T, 2E+1]
  Tensor mask;
  std::vector<uint8_t> mask_ref;
  Tensor out_mask_counts, out_mask_dest, out_mask_sources, out_mask_indices, out_mask_bin_ids, out_mask_row_id_map;
  // index_plan: the plan of top_experts read as ids with no known bound (TE's index map): counts [4],
  // dest_rows / row_sources / indices / bin_ids [A]
  Tensor out_index_counts, out_index_dest, out_index_sources, out_index_indices, out_index_bin_ids;
  Tensor out_rows8_R, out_scales_R;  // [R, H] e4m3 and [R, ceil(H/128)] float32: dispatch(fp8+scales)
  Tensor out_e8m0_R;                 // [R, ceil(H/32)] uint8 E8M0: dispatch(quant-mxfp8)
  // make_plan with PlanOptions: rank 1's local experts of ep_ranks ([E/ep_ranks] plan), and an expert
  // capacity C = round_down(A / E, m) (capacity factor 1) with the probs drop policy (E*C <= R rows).
  Plan plan_ep;
  Tensor out_dropped_1;
  int64_t expert_capacity = 0;

  // Host float copies for the reference loops (filled only when needed).
  bool have_reference = false;
  ref::Plan ref_plan;
  std::vector<float> x_f, grad_out_f, y_f, grad_y_f, h_f, grad_unpadded_f, padded_f, probs_f;
  std::vector<float> x8_f, x8_scales_f;
  std::vector<int64_t> perm_map_ref, tokens_per_expert_ref;
  std::vector<int64_t> split_sizes_ref;
  std::vector<float> composite_f;  // the plan+dispatch+combine reference's intermediate rows

  // --device cuda: host copies of device outputs, made on demand by on_host().
  std::map<const void*, Tensor> host_mirrors;
};

// The output tensors of Data (what the ops write).
std::vector<Tensor*> output_tensors(Data& d);

// Builds the workload, always on the host; with --device cuda every input is
// then staged to the GPU and the outputs are allocated there (see the definition).
Data build_data(const Workload& w, bool reference);

// The output view v as host memory (a refreshed host mirror for a device output).
TensorView on_host(Data& d, const TensorView& v);

}  // namespace cli
