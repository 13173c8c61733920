// layouts_ops.cpp — padmoe._C's bindings of vLLM's layout: moe_align_block_size_out and its bound
// aligned_rows_bound.
#include "common.hpp"

namespace padmoe_ext {

void bind_layouts(nb::module_& m) {
  m.def(
      "moe_align_block_size_out",
      [](const In& top_experts, int block_size, int num_experts, const Out& sorted_token_ids, const Out& expert_ids,
         const Out& num_tokens_post_padded, const OptIn& expert_map, PADMOE_OPTION_PARAMS) {
        const char* op = "moe_align_block_size";
        const TensorView te = to_view(top_experts, op, "topk_ids");
        const TensorView vs = to_view(sorted_token_ids, op, "sorted_token_ids"),
                         ve = to_view(expert_ids, op, "expert_ids"),
                         vn = to_view(num_tokens_post_padded, op, "num_tokens_post_padded");
        const TensorView vm = expert_map ? to_view(*expert_map, op, "expert_map") : TensorView{};
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::moe_align_block_size_out(te, block_size, num_experts, vm, vs, ve, vn, o);
      },
      nb::arg("topk_ids"), nb::arg("block_size"), nb::arg("num_experts"), nb::arg("sorted_token_ids"),
      nb::arg("expert_ids"), nb::arg("num_tokens_post_padded"), nb::arg("expert_map").none() = nb::none(),
      PADMOE_OPTIONS);

  m.def(
      "aligned_rows_bound",
      [](int64_t assignments, int num_experts, int block_size, bool pad_sorted_ids) {
        return padmoe::aligned_rows_bound(assignments, num_experts, block_size, pad_sorted_ids);
      },
      nb::arg("assignments"), nb::arg("num_experts"), nb::arg("block_size"), nb::arg("pad_sorted_ids") = false,
      "A + min(A, E) * (block_size - 1) (rounded up to block_size when pad_sorted_ids): vLLM's "
      "max_num_tokens_padded, a bound on P.");
}

}  // namespace padmoe_ext
