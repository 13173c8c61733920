// kernels.hpp — the CPU / CUDA kernels of the operators, as each domain file defines them.
//
// Their signatures are the operators' (the dispatcher calls them unboxed): the autograd nodes
// and the Python entry points (fast_path.cpp) call an operator through a handle typed by the
// kernel's signature, so they need these declarations, not the definitions.
#pragma once

#include <c10/util/string_view.h>

#include <tuple>

#include "common.hpp"

namespace padmoe_torch {

// plan_ops.cpp
Tensor make_plan_kernel(const Tensor& top_experts_in, int64_t num_experts, int64_t alignment, int64_t check,
                        const OptTensor& weights);
std::tuple<Tensor, Tensor> make_plan_routed_kernel(const Tensor& top_experts_in, int64_t num_experts, int64_t alignment,
                                                   const OptTensor& expert_map, int64_t first_expert,
                                                   int64_t global_experts, bool drop_invalid, OptInt expert_capacity,
                                                   bool by_probs, const OptTensor& probs, int64_t check);
Tensor dispatch_kernel(const Tensor& x_in, const Tensor& plan, const OptTensor& weights, int64_t top_k,
                       int64_t num_experts, int64_t alignment, OptInt expert_capacity, int64_t check,
                       bool zero_padding);
std::tuple<Tensor, Tensor> dispatch_backward_kernel(const Tensor& grad_y_in, const OptTensor& x_in, const Tensor& plan,
                                                    const OptTensor& weights, int64_t top_k, int64_t num_experts,
                                                    int64_t alignment, OptInt expert_capacity, bool need_wgrad,
                                                    int64_t check);
std::tuple<Tensor, Tensor> make_plan_and_dispatch_kernel(const Tensor& x_in, const Tensor& top_experts_in,
                                                         int64_t num_experts, int64_t alignment,
                                                         const OptTensor& weights, int64_t check, bool zero_padding);
Tensor combine_kernel(const Tensor& y_in, const Tensor& plan, const OptTensor& weights, int64_t top_k,
                      int64_t num_experts, int64_t alignment, OptInt expert_capacity, int64_t check);
std::tuple<Tensor, Tensor> combine_backward_kernel(const Tensor& grad_out_in, const OptTensor& y_in, const Tensor& plan,
                                                   const OptTensor& weights, int64_t top_k, int64_t num_experts,
                                                   int64_t alignment, OptInt expert_capacity, bool need_wgrad,
                                                   int64_t check, int64_t rows);

// rows_ops.cpp
Tensor padded_gather_kernel(const Tensor& x_in, const Tensor& indices_in, const Tensor& bin_ids_in,
                            const Tensor& bins_in, const Tensor& padded_bins_in, int64_t top_k,
                            const OptTensor& weights, int64_t check, bool zero_padding);
std::tuple<Tensor, Tensor> padded_gather_backward_kernel(const Tensor& grad_y_in, const Tensor& x_in,
                                                         const Tensor& indices_in, const Tensor& bin_ids_in,
                                                         const Tensor& bins_in, const Tensor& padded_bins_in,
                                                         int64_t top_k, const OptTensor& weights, bool need_wgrad,
                                                         int64_t check);
Tensor padded_scatter_kernel(const Tensor& y_in, const Tensor& indices_in, const Tensor& bin_ids_in,
                             const OptTensor& weights, const Tensor& bins_in, const Tensor& padded_bins_in,
                             int64_t top_k, int64_t check);
std::tuple<Tensor, Tensor> padded_scatter_backward_kernel(const Tensor& grad_out_in, const Tensor& y_in,
                                                          const Tensor& indices_in, const Tensor& bin_ids_in,
                                                          const OptTensor& weights, const Tensor& bins_in,
                                                          const Tensor& padded_bins_in, int64_t top_k, bool need_wgrad,
                                                          int64_t check);
Tensor padded_scatter_wgrad_kernel(const Tensor& y_in, const Tensor& grad_in, const Tensor& indices_in,
                                   const Tensor& bin_ids_in, const Tensor& bins_in, const Tensor& padded_bins_in,
                                   int64_t top_k, int64_t check);

// padding_ops.cpp
std::tuple<Tensor, Tensor, Tensor> pad_kernel(const Tensor& h_in, const Tensor& tpe_in, int64_t alignment,
                                              int64_t check, bool zero_padding);
Tensor unpad_kernel(const Tensor& padded_in, const Tensor& map_in, int64_t original_size, const OptTensor& probs,
                    int64_t check);
std::tuple<Tensor, Tensor> unpad_backward_kernel(const Tensor& grad_out_in, const Tensor& padded_in,
                                                 const Tensor& map_in, const OptTensor& probs, bool need_pgrad,
                                                 int64_t check);

// chunks_ops.cpp
std::tuple<Tensor, Tensor, Tensor> sort_chunks_kernel(const Tensor& received_in, const Tensor& sizes_in,
                                                      int64_t num_ranks, int64_t alignment, const OptTensor& sorted_in,
                                                      int64_t check, bool zero_padding, int64_t rows);

// layouts_ops.cpp
std::tuple<Tensor, Tensor, Tensor> moe_align_kernel(const Tensor& ids_in, int64_t block_size, int64_t num_experts,
                                                    bool pad_sorted_ids, int64_t check, const OptTensor& map_in);

// scaled_ops.cpp
std::tuple<Tensor, Tensor> dispatch_scaled_kernel(const Tensor& x_in, const Tensor& plan, const Tensor& x_scales,
                                                  int64_t top_k, int64_t num_experts, int64_t alignment,
                                                  OptInt expert_capacity, int64_t check, bool zero_padding);
std::tuple<Tensor, Tensor> padded_gather_scaled_kernel(const Tensor& x_in, const Tensor& indices_in,
                                                       const Tensor& bin_ids_in, const Tensor& bins_in,
                                                       const Tensor& padded_bins_in, int64_t top_k,
                                                       const Tensor& x_scales, int64_t check, bool zero_padding);
std::tuple<Tensor, Tensor, Tensor, Tensor> pad_scaled_kernel(const Tensor& h_in, const Tensor& tpe_in,
                                                             int64_t alignment, const Tensor& h_scales, int64_t check,
                                                             bool zero_padding);
std::tuple<Tensor, Tensor> unpad_scaled_kernel(const Tensor& padded_in, const Tensor& map_in, int64_t original_size,
                                               const Tensor& padded_scales, int64_t check);
std::tuple<Tensor, Tensor> dispatch_quantized_kernel(const Tensor& x_in, const Tensor& plan, int64_t top_k,
                                                     int64_t num_experts, int64_t alignment, OptInt expert_capacity,
                                                     c10::string_view scale_layout, at::ScalarType dtype, int64_t check,
                                                     bool zero_padding, int64_t rows);

}  // namespace padmoe_torch
