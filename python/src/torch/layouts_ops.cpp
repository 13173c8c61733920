// layouts_ops.cpp — vLLM's moe_align_block_size (from one make_plan) and batched_moe_align_block_size:
// their schemas and CPU / CUDA kernels (no Autograd kernels: their outputs are integers).
#include <algorithm>
#include <limits>
#include <tuple>

#include "common.hpp"
#include "kernels.hpp"

namespace padmoe_torch {

std::tuple<Tensor, Tensor, Tensor> moe_align_kernel(const Tensor& ids_in, int64_t block_size, int64_t num_experts,
                                                    bool pad_sorted_ids, int64_t check, const OptTensor& map_in) {
  const char* op = "moe_align_block_size";
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (block_size < 1 || block_size > kMax)
    value_error(op, "block_size", "must be in [1, 2^31), got " + std::to_string(block_size));
  if (num_experts < 1 || num_experts > kMax)
    value_error(op, "num_experts", "must be in [1, 2^31), got " + std::to_string(num_experts));
  if (ids_in.dim() != 2) value_error(op, "topk_ids", "expected [T, K], got shape " + shape_of(ids_in));
  Tensor ids = index_arg(ids_in);
  const int64_t a = ids.numel();
  if (a > kMax) value_error(op, "topk_ids", "size overflow: " + std::to_string(a) + " assignments do not fit int32");
  const int64_t r =
      padmoe::aligned_rows_bound(a, static_cast<int>(num_experts), static_cast<int>(block_size), pad_sorted_ids);
  check_rows_fit(op, "sorted_token_ids", r);
  const auto int32 = ids.options().dtype(at::kInt);
  Tensor sorted = at::empty({r}, int32);
  Tensor experts = at::empty({(r + block_size - 1) / block_size}, int32);
  Tensor post = at::empty({1}, int32);
  c10::OptionalDeviceGuard guard(ids.device());
  const padmoe::Options o = options_for(ids, check);
  // vLLM's ignore_invalid_experts=True: assignments of experts mapped to -1 get no entry
  Tensor map;
  if (map_in && map_in->defined()) map = index_arg(*map_in);
  native([&] {
    padmoe::moe_align_block_size_out(
        view(ids, op, "topk_ids"), static_cast<int>(block_size), static_cast<int>(num_experts),
        map.defined() ? view(map, op, "expert_map") : padmoe::TensorView{}, view(sorted, op, "sorted_token_ids"),
        view(experts, op, "expert_ids"), view(post, op, "num_tokens_post_padded"), o);
  });
  return {sorted, experts, post};
}

// N = ceil(max_tokens_per_batch / block_size) * block_size * E entries. The library takes int sizes:
// where N > 0 both fit (each is at most N < 2^31); where N = 0 (E = 0 or max_tokens_per_batch = 0)
// neither changes a result, so a larger one is passed as INT32_MAX.
std::tuple<Tensor, Tensor, Tensor> batched_align_kernel(const Tensor& counts_in, int64_t max_tokens_per_batch,
                                                        int64_t block_size, int64_t check) {
  const char* op = "batched_moe_align_block_size";
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (max_tokens_per_batch < 0)
    value_error(op, "max_tokens_per_batch", "must be >= 0, got " + std::to_string(max_tokens_per_batch));
  if (block_size < 1) value_error(op, "block_size", "must be >= 1, got " + std::to_string(block_size));
  if (counts_in.dim() != 1)
    value_error(op, "expert_num_tokens", "expected a 1-D tensor, got shape " + shape_of(counts_in));
  Tensor counts = index_arg(counts_in);
  const int64_t experts = counts.numel();
  int64_t n = 0;
  if (experts > 0 && max_tokens_per_batch > 0) {
    if (max_tokens_per_batch > kMax || block_size > kMax || experts > kMax) {
      value_error(op, "sorted_ids",
                  "size overflow: ceil(max_tokens_per_batch / block_size) * block_size * E entries do not fit the "
                  "int32 outputs");
    }
    n = (max_tokens_per_batch + block_size - 1) / block_size * block_size * experts;  // < 2^32 * 2^31
    check_rows_fit(op, "sorted_ids", n);
  }
  const int max_tokens = static_cast<int>(std::min(max_tokens_per_batch, kMax));
  const int block = static_cast<int>(std::min(block_size, kMax));
  const auto int32 = counts.options().dtype(at::kInt);
  Tensor sorted = at::empty({n}, int32);
  Tensor blocks = at::empty({n / block}, int32);
  Tensor post = at::empty({1}, int32);
  c10::OptionalDeviceGuard guard(counts.device());
  const padmoe::Options o = options_for(counts, check);
  native([&] {
    padmoe::batched_moe_align_block_size_out(view(counts, op, "expert_num_tokens"), max_tokens, block,
                                             view(sorted, op, "sorted_ids"), view(blocks, op, "block_ids"),
                                             view(post, op, "num_tokens_post_pad"), o);
  });
  return {sorted, blocks, post};
}

TORCH_LIBRARY_FRAGMENT(padmoe, m) {
  m.def(
      "moe_align_block_size(Tensor topk_ids, int block_size, int num_experts, bool pad_sorted_ids=False, "
      "int check=2, Tensor? expert_map=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "batched_moe_align_block_size(Tensor expert_num_tokens, int max_tokens_per_batch, int block_size, "
      "int check=2) -> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(padmoe, CPU, m) {
  m.impl("moe_align_block_size", moe_align_kernel);
  m.impl("batched_moe_align_block_size", batched_align_kernel);
}
#ifdef PADMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(padmoe, CUDA, m) {
  m.impl("moe_align_block_size", moe_align_kernel);
  m.impl("batched_moe_align_block_size", batched_align_kernel);
}
#endif

}  // namespace padmoe_torch
