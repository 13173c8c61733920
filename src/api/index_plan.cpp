// index_plan.cpp — a plan from an index map of unbounded ids (TransformerEngine's index map
// without a number of experts): check, size, dispatch to the backend.
#include <memory>
#include <string>

#include "api/checks.hpp"
#include "cpu/cpu_backend.hpp"
#include "cuda/cuda_backend.hpp"
#include "padmoe/ops.hpp"

namespace padmoe {

void index_plan_out(const TensorView& top_experts, int64_t rows, const TensorView& counts, const TensorView& dest_rows,
                    const TensorView& row_sources, const TensorView& indices, const TensorView& bin_ids,
                    const Options& options) {
  const detail::Checker c("index_plan");
  if (top_experts.ndim != 2) {
    c.value_error("top_experts",
                  "expected a 2-D [num_tokens, top_k] tensor, got " + std::to_string(top_experts.ndim) + " dimensions");
  }
  if (top_experts.dtype != DType::kInt32) {
    c.fail(ErrorKind::kType, "top_experts", std::string("expected int32, got ") + dtype_name(top_experts.dtype));
  }
  if (!top_experts.is_contiguous()) {
    c.value_error("top_experts", "expected a contiguous tensor");
  }
  if (rows < 0) c.value_error("rows", "must be >= 0, got " + std::to_string(rows));
  detail::check_int32_extent(c, "rows", rows);
  const Device device = top_experts.device;
  detail::require_backend(c, device);
  const int64_t assignments = detail::checked_mul(c, "top_experts", top_experts.shape[0], top_experts.shape[1]);
  detail::check_int32_extent(c, "top_experts", assignments);
  const bool sorted = detail::plan_outputs(c, counts, 4, dest_rows, row_sources, indices, bin_ids, assignments, device);
  detail::check_disjoint_all(
      c,
      {detail::named(counts, "counts"), detail::named(dest_rows, "dest_rows"),
       detail::named(row_sources, "row_sources"), detail::named(indices, "indices"), detail::named(bin_ids, "bin_ids")},
      {detail::named(top_experts, "top_experts")});
  const int32_t* ids = top_experts.data_as<const int32_t>();
  int32_t* idx = sorted ? indices.data_as<int32_t>() : nullptr;
  int32_t* bid = sorted ? bin_ids.data_as<int32_t>() : nullptr;
  const int64_t sources_len = row_sources.numel();
  if (device.is_cuda()) {
    const size_t bytes = cuda::index_plan_workspace_bytes(assignments);
    std::unique_ptr<cuda::Scratch> scratch;
    if (bytes > 0) scratch.reset(new cuda::Scratch(options, bytes, device.index));
    cuda::index_plan(ids, assignments, rows, counts.data_as<int32_t>(), dest_rows.data_as<int32_t>(),
                     row_sources.data_as<int32_t>(), sources_len, idx, bid, scratch ? scratch->get() : nullptr, bytes,
                     options.stream);
    return;
  }
  cpu::index_plan(ids, assignments, rows, counts.data_as<int32_t>(), dest_rows.data_as<int32_t>(),
                  row_sources.data_as<int32_t>(), sources_len, idx, bid, options.num_threads);
}

}  // namespace padmoe
