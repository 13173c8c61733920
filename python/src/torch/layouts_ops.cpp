// layouts_ops.cpp — vLLM's moe_align_block_size (from one make_plan), batched_moe_align_block_size
// and the plans of TransformerEngine's routing mask and index map: their schemas and CPU / CUDA
// kernels (no Autograd kernels: their outputs are integers).
#include <algorithm>
#include <limits>
#include <tuple>

#include "common.hpp"
#include "kernels.hpp"
#include "packed_plan.hpp"

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
  if (ids_in.scalar_type() != at::kInt && ids_in.scalar_type() != at::kLong)  // vLLM's name for the argument
    type_error(op, "topk_ids", "expected int32 or int64, got " + dtype_name(ids_in.scalar_type()));
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

// mask_plan(routing_map[T, E], rows, alignment, one_bin, with_row_id_map, probs, probs_nonzero) ->
// (packed, row_id_map, moved_probs, nonzero): padmoe::mask_plan_out into a packed plan (the layout
// of padmoe.torch's plans: indices and bin_ids [A], the four count arrays, dest_rows [A],
// row_sources) of B experts of capacity C: B = 1, C = rows with one_bin; else B = E, C =
// ceil(rows / E). row_id_map: TE's [T, 2E + 1] int32, or [0, 0] when not asked for. moved_probs:
// probs [T, E] moved with the rows ([B * C], probs' dtype, 0 in rows without an assignment), or [0]
// float32 without probs. nonzero: with probs_nonzero (and probs), float32 [A], 1 where the pair has
// a row and a nonzero prob, else 0 (TE's with-probs dispatch weights); else [0] float32.
std::tuple<Tensor, Tensor, Tensor, Tensor> mask_plan_kernel(const Tensor& map_in, int64_t rows, int64_t alignment,
                                                            bool one_bin, bool with_row_id_map,
                                                            const std::optional<Tensor>& probs_in, bool probs_nonzero) {
  const char* op = "mask_plan";
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (map_in.dim() != 2)
    value_error(op, "routing_map", "expected [num_tokens, num_experts], got shape " + shape_of(map_in));
  if (map_in.is_floating_point() || map_in.is_complex())
    type_error(op, "routing_map", "expected a bool or integer tensor, got " + dtype_name(map_in.scalar_type()));
  if (rows < 0 || rows > kMax) value_error(op, "rows", "must be in [0, 2^31), got " + std::to_string(rows));
  if (alignment < 1 || alignment > kMax)
    value_error(op, "alignment", "must be in [1, 2^31), got " + std::to_string(alignment));
  Tensor map =
      map_in.scalar_type() == at::kBool || map_in.scalar_type() == at::kByte ? index_arg(map_in) : map_in.ne(0);
  if (map.scalar_type() == at::kBool) map = map.view(at::kByte);
  const int64_t t = map.size(0), e = map.size(1);
  if (e > 0 && t > kMax / e)
    value_error(op, "routing_map",
                "size overflow: " + std::to_string(t) + " x " + std::to_string(e) + " pairs do not fit int32");
  const int64_t a = t * e;
  const int64_t bins = one_bin ? 1 : e;
  const int64_t cap = one_bin ? rows : (e > 0 ? (rows + e - 1) / e : 0);
  const int64_t sources = bins * cap;
  check_rows_fit(op, "rows", sources);
  const auto int32 = map.options().dtype(at::kInt);
  Tensor packed = at::empty({3 * a + 4 * bins + sources}, int32);
  Tensor row_id_map = with_row_id_map ? at::empty({t, 2 * e + 1}, int32) : at::empty({0, 0}, int32);
  const bool with_probs = probs_in.has_value() && probs_in->defined();
  Tensor probs, moved;
  if (with_probs) {
    if (probs_in->dim() != 2 || probs_in->size(0) != t || probs_in->size(1) != e)
      value_error(op, "probs",
                  "expected [" + std::to_string(t) + ", " + std::to_string(e) + "], got shape " + shape_of(*probs_in));
    probs = probs_in->contiguous();
    moved = at::empty({sources}, probs.options());
  } else {
    moved = at::empty({0}, map.options().dtype(at::kFloat));
  }
  if (probs_nonzero && !with_probs) value_error(op, "probs_nonzero", "needs probs (the probs it flags)");
  Tensor nonzero = at::empty({probs_nonzero ? a : 0}, map.options().dtype(at::kFloat));
  c10::OptionalDeviceGuard guard(map.device());
  const padmoe::Options o = options_for(map, 0);
  native([&] {
    padmoe::mask_plan_out(view(map, op, "routing_map"), static_cast<int>(alignment), rows, one_bin,
                          view(packed.narrow(0, 2 * a, 4 * bins), op, "counts"),
                          view(packed.narrow(0, 2 * a + 4 * bins, a), op, "dest_rows"),
                          view(packed.narrow(0, 3 * a + 4 * bins, sources), op, "row_sources"),
                          with_row_id_map ? view(row_id_map, op, "row_id_map") : padmoe::TensorView{},
                          view(packed.narrow(0, 0, a), op, "indices"), view(packed.narrow(0, a, a), op, "bin_ids"),
                          with_probs ? view(probs, op, "probs") : padmoe::TensorView{},
                          with_probs ? view(moved, op, "moved_probs") : padmoe::TensorView{},
                          probs_nonzero ? view(nonzero, op, "probs_nonzero") : padmoe::TensorView{}, o);
  });
  return {packed, row_id_map, moved, nonzero};
}

// index_plan(top_experts[T, K], rows) -> packed: padmoe::index_plan_out into a packed plan of one
// expert of capacity `rows` (plan_layout(A, 1, 1, rows)): the assignments stable-sorted by their id
// read as uint32, the first `rows` kept. int64 ids are read as their low 32 bits (an int32 copy).
Tensor index_plan_kernel(const Tensor& ids_in, int64_t rows) {
  const char* op = "index_plan";
  if (ids_in.dim() != 2) value_error(op, "top_experts", "expected [num_tokens, top_k], got shape " + shape_of(ids_in));
  if (ids_in.scalar_type() != at::kInt && ids_in.scalar_type() != at::kLong)
    type_error(op, "top_experts", "expected int32 or int64, got " + dtype_name(ids_in.scalar_type()));
  if (rows < 0 || rows > std::numeric_limits<int32_t>::max())
    value_error(op, "rows", "must be in [0, 2^31), got " + std::to_string(rows));
  const Tensor ids = ids_in.to(at::kInt).contiguous();
  const PlanLayout l = plan_layout(ids.numel(), 1, 1, rows);
  if (l.overflow) value_error(op, "rows", "size overflow");
  Tensor packed = at::empty({l.total}, ids.options());
  auto field = [&](int i, const char* name) { return view(packed.narrow(0, l.offset[i], l.length[i]), op, name); };
  c10::OptionalDeviceGuard guard(ids.device());
  const padmoe::Options o = options_for(ids, 0);
  native([&] {
    padmoe::index_plan_out(view(ids, op, "top_experts"), rows, view(packed.narrow(0, l.offset[2], 4), op, "counts"),
                           field(6, "dest_rows"), field(7, "row_sources"), field(0, "indices"), field(1, "bin_ids"), o);
  });
  return packed;
}

TORCH_LIBRARY_FRAGMENT(padmoe, m) {
  m.def(
      "moe_align_block_size(Tensor topk_ids, int block_size, int num_experts, bool pad_sorted_ids=False, "
      "int check=2, Tensor? expert_map=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "batched_moe_align_block_size(Tensor expert_num_tokens, int max_tokens_per_batch, int block_size, "
      "int check=2) -> (Tensor, Tensor, Tensor)");
  m.def(
      "mask_plan(Tensor routing_map, int rows, int alignment=1, bool one_bin=False, bool with_row_id_map=True, "
      "Tensor? probs=None, bool probs_nonzero=False) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("index_plan(Tensor top_experts, int rows) -> Tensor");
}
TORCH_LIBRARY_IMPL(padmoe, CPU, m) {
  m.impl("moe_align_block_size", moe_align_kernel);
  m.impl("batched_moe_align_block_size", batched_align_kernel);
  m.impl("mask_plan", mask_plan_kernel);
  m.impl("index_plan", index_plan_kernel);
}
#ifdef PADMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(padmoe, CUDA, m) {
  m.impl("moe_align_block_size", moe_align_kernel);
  m.impl("batched_moe_align_block_size", batched_align_kernel);
  m.impl("mask_plan", mask_plan_kernel);
  m.impl("index_plan", index_plan_kernel);
}
#endif

}  // namespace padmoe_torch
