// mask_plan.cpp — a plan from a routing mask (TransformerEngine's mask map): check, size, dispatch
// to the backend.
#include <memory>
#include <string>

#include "api/checks.hpp"
#include "cpu/cpu_backend.hpp"
#include "cuda/cuda_backend.hpp"
#include "padmoe/index_math.hpp"
#include "padmoe/ops.hpp"

namespace padmoe {

void mask_plan_out(const TensorView& routing_map, int alignment, int64_t rows, bool one_bin, const TensorView& counts,
                   const TensorView& dest_rows, const TensorView& row_sources, const TensorView& row_id_map,
                   const TensorView& indices, const TensorView& bin_ids, const Options& options) {
  mask_plan_out(routing_map, alignment, rows, one_bin, counts, dest_rows, row_sources, row_id_map, indices, bin_ids,
                TensorView{}, TensorView{}, options);
}

void mask_plan_out(const TensorView& routing_map, int alignment, int64_t rows, bool one_bin, const TensorView& counts,
                   const TensorView& dest_rows, const TensorView& row_sources, const TensorView& row_id_map,
                   const TensorView& indices, const TensorView& bin_ids, const TensorView& probs,
                   const TensorView& moved_probs, const Options& options) {
  mask_plan_out(routing_map, alignment, rows, one_bin, counts, dest_rows, row_sources, row_id_map, indices, bin_ids,
                probs, moved_probs, TensorView{}, options);
}

void mask_plan_out(const TensorView& routing_map, int alignment, int64_t rows, bool one_bin, const TensorView& counts,
                   const TensorView& dest_rows, const TensorView& row_sources, const TensorView& row_id_map,
                   const TensorView& indices, const TensorView& bin_ids, const TensorView& probs,
                   const TensorView& moved_probs, const TensorView& probs_nonzero, const Options& options) {
  const detail::Checker c("mask_plan");
  if (routing_map.ndim != 2) {
    c.value_error("routing_map", "expected a 2-D [num_tokens, num_experts] tensor, got " +
                                     std::to_string(routing_map.ndim) + " dimensions");
  }
  if (routing_map.dtype != DType::kUInt8) {
    c.fail(ErrorKind::kType, "routing_map",
           std::string("expected uint8 (a bool mask's bytes), got ") + dtype_name(routing_map.dtype));
  }
  if (!routing_map.is_contiguous()) {
    c.value_error("routing_map", "expected a contiguous tensor");
  }
  c.alignment(alignment);
  if (rows < 0) c.value_error("rows", "must be >= 0, got " + std::to_string(rows));
  detail::check_int32_extent(c, "rows", rows);
  if (one_bin && alignment != 1)
    c.value_error("alignment", "one_bin needs alignment 1, got " + std::to_string(alignment));
  const int64_t tokens = routing_map.shape[0], experts = routing_map.shape[1];
  const Device device = routing_map.device;
  detail::require_backend(c, device);
  const int64_t assignments = detail::checked_mul(c, "routing_map", tokens, experts);
  detail::check_int32_extent(c, "routing_map", assignments);
  // the padded total: every count padded by at most alignment - 1
  const int64_t pad = detail::checked_mul(c, "alignment", experts, alignment - 1);
  detail::check_int32_extent(c, "alignment", assignments + pad);
  if (device.is_cuda() && experts > cuda::kMaskPlanMaxExperts) {
    c.value_error("routing_map", "CUDA takes at most " + std::to_string(cuda::kMaskPlanMaxExperts) + " experts, got " +
                                     std::to_string(experts));
  }
  const bool sorted = detail::plan_outputs(c, counts, one_bin ? 4 : 4 * experts, dest_rows, row_sources, indices,
                                           bin_ids, assignments, device);
  const bool with_map = row_id_map.data != nullptr;
  if (with_map) {
    const int64_t width = 2 * experts + 1;
    if (row_id_map.dtype != DType::kInt32 || row_id_map.ndim != 2 || row_id_map.shape[0] != tokens ||
        row_id_map.shape[1] != width || !row_id_map.is_contiguous()) {
      c.value_error("row_id_map", "expected a contiguous int32 [" + std::to_string(tokens) + ", " +
                                      std::to_string(width) + "] tensor");
    }
    c.same_device(row_id_map, "row_id_map", device);
  }
  const bool with_probs = probs.data != nullptr || moved_probs.data != nullptr;
  if (with_probs) {
    if (probs.dtype != DType::kFloat32 && probs.dtype != DType::kFloat16 && probs.dtype != DType::kBFloat16) {
      c.fail(ErrorKind::kType, "probs",
             std::string("expected float32, float16 or bfloat16, got ") + dtype_name(probs.dtype));
    }
    if (probs.ndim != 2 || probs.shape[0] != tokens || probs.shape[1] != experts || !probs.is_contiguous()) {
      c.value_error("probs",
                    "expected a contiguous [" + std::to_string(tokens) + ", " + std::to_string(experts) + "] tensor");
    }
    if (moved_probs.dtype != probs.dtype || moved_probs.ndim != 1 || moved_probs.shape[0] != row_sources.numel() ||
        !moved_probs.is_contiguous()) {
      c.value_error("moved_probs", std::string("expected a contiguous ") + dtype_name(probs.dtype) + " [" +
                                       std::to_string(row_sources.numel()) +
                                       "] tensor (probs' dtype, row_sources' length)");
    }
    c.same_device(probs, "probs", device);
    c.same_device(moved_probs, "moved_probs", device);
  }
  const bool with_nonzero = probs_nonzero.data != nullptr;
  if (with_nonzero) {
    if (!with_probs) c.value_error("probs_nonzero", "needs probs (the probs it flags)");
    if (probs_nonzero.dtype != DType::kFloat32 || probs_nonzero.ndim != 1 || probs_nonzero.shape[0] != assignments ||
        !probs_nonzero.is_contiguous()) {
      c.value_error("probs_nonzero",
                    "expected a contiguous float32 [" + std::to_string(assignments) + "] tensor (one per pair)");
    }
    c.same_device(probs_nonzero, "probs_nonzero", device);
  }
  detail::check_disjoint_all(c,
                             {detail::named(counts, "counts"), detail::named(dest_rows, "dest_rows"),
                              detail::named(row_sources, "row_sources"), detail::named(row_id_map, "row_id_map"),
                              detail::named(indices, "indices"), detail::named(bin_ids, "bin_ids"),
                              detail::named(moved_probs, "moved_probs"), detail::named(probs_nonzero, "probs_nonzero")},
                             {detail::named(routing_map, "routing_map"), detail::named(probs, "probs")});
  backend::MovedProbs moved;
  if (with_probs) {
    moved.probs = probs.data;
    moved.moved = moved_probs.data;
    moved.bytes = probs.dtype == DType::kFloat32 ? 4 : 2;
    moved.nonzero = with_nonzero ? probs_nonzero.data_as<float>() : nullptr;
  }
  const uint8_t* map = routing_map.data_as<const uint8_t>();
  int32_t* rim = with_map ? row_id_map.data_as<int32_t>() : nullptr;
  int32_t* idx = sorted ? indices.data_as<int32_t>() : nullptr;
  int32_t* bid = sorted ? bin_ids.data_as<int32_t>() : nullptr;
  const int64_t sources_len = row_sources.numel();
  if (device.is_cuda()) {
    const size_t bytes = cuda::mask_plan_workspace_bytes(tokens, experts);
    std::unique_ptr<cuda::Scratch> scratch;
    if (bytes > 0) scratch.reset(new cuda::Scratch(options, bytes, device.index));
    cuda::mask_plan(map, tokens, static_cast<int>(experts), alignment, rows, one_bin, counts.data_as<int32_t>(),
                    dest_rows.data_as<int32_t>(), row_sources.data_as<int32_t>(), sources_len, idx, bid, rim, moved,
                    scratch ? scratch->get() : nullptr, options.stream);
    return;
  }
  cpu::mask_plan(map, tokens, experts, alignment, rows, one_bin, counts.data_as<int32_t>(),
                 dest_rows.data_as<int32_t>(), row_sources.data_as<int32_t>(), sources_len, idx, bid, rim, moved,
                 options.num_threads);
}

}  // namespace padmoe
