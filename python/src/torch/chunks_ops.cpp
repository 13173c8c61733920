// chunks_ops.cpp — the expert-parallel chunk sort (ops.hpp section 5): sort_chunks, its schema,
// CPU / CUDA kernel and autograd.
//
// sort_chunks(received, split_sizes, num_ranks, alignment, sorted_index, check, zero_padding, rows):
// rows < 0 allocates exactly P rows (read on the host: one synchronization on CUDA, like the
// Megatron drop-ins); rows >= 0 allocates that many (>= P, e.g. sort_chunks_rows_bound) with the rows
// past P zeroed (zero_tail): static shapes, no synchronization with check=0. Its backward is
// unpad_from_alignment(grad, permutation_map, N) (the unsort), the inverse move.
#include <tuple>

#include "common.hpp"
#include "kernels.hpp"

namespace padmoe_torch {

std::tuple<Tensor, Tensor, Tensor> sort_chunks_kernel(const Tensor& received_in, const Tensor& sizes_in,
                                                      int64_t num_ranks, int64_t alignment, const OptTensor& sorted_in,
                                                      int64_t check, bool zero_padding, int64_t rows) {
  const char* op = "sort_chunks";
  Tensor sizes = index_arg(sizes_in);
  OptTensor sorted = sorted_in && sorted_in->defined() ? OptTensor(index_arg(*sorted_in)) : std::nullopt;
  if (num_ranks < 1) value_error(op, "num_ranks", "must be >= 1, got " + std::to_string(num_ranks));
  Tensor h = is_f64(received_in) ? received_in : rows_arg(received_in);
  // P from padmoe's host read of the sizes (CUDA: one synchronization), after the checks the op
  // makes before it allocates: sizes from bad data must not size the outputs
  int64_t p = rows;
  if (rows >= 0) {
    check_rows_fit(op, "rows", rows);
  } else {
    native([&] {
      p = padmoe::sort_chunks_rows(is_f64(h) ? shadow(h) : view(h, op, "received"), view(sizes, op, "split_sizes"),
                                   static_cast<int>(num_ranks), static_cast<int>(alignment),
                                   opt_view(sorted, op, "sorted_index"), options_for(h, check));
    });
  }
  const int64_t e = sizes.numel() / num_ranks;
  Tensor map = at::empty({p}, h.options().dtype(at::kInt));
  Tensor offs = at::empty({e}, h.options().dtype(at::kInt));
  c10::OptionalDeviceGuard guard(h.device());
  padmoe::Options o = options_for(h, check, /*zero_tail=*/rows >= 0);
  if (is_f64(h)) {  // the map and offsets from padmoe on float32 rows of no columns, then an exact move
    Tensor none = at::empty({h.size(0), 0}, h.options().dtype(at::kFloat));
    Tensor pn = at::empty({p, 0}, none.options());
    native([&] {
      padmoe::sort_chunks_out(view(none, op, "received"), view(sizes, op, "split_sizes"), static_cast<int>(num_ranks),
                              static_cast<int>(alignment), opt_view(sorted, op, "sorted_index"), view(pn, op, "padded"),
                              view(map, op, "permutation_map"), view(offs, op, "inclusive_offsets"), o);
    });
    Tensor keep = map.ge(0).to(h.scalar_type()).unsqueeze(1);
    Tensor padded = h.index_select(0, map.clamp_min(0).to(at::kLong)) * keep;
    return {padded, map, offs};
  }
  Tensor padded = at::empty({p, h.dim() == 2 ? h.size(1) : 0}, h.options());
  o.zero_padding = zero_padding;
  native([&] {
    padmoe::sort_chunks_out(view(h, op, "received"), view(sizes, op, "split_sizes"), static_cast<int>(num_ranks),
                            static_cast<int>(alignment), opt_view(sorted, op, "sorted_index"),
                            view(padded, op, "padded"), view(map, op, "permutation_map"),
                            view(offs, op, "inclusive_offsets"), o);
  });
  return {padded, map, offs};
}

namespace {

// Edge (received); the backward is the unsort of the gradient (PadBackward's formula).
struct SortChunksBackward : PadBackward {
  std::string name() const override { return "padmoe::SortChunksBackward"; }
};

std::tuple<Tensor, Tensor, Tensor> sort_chunks_autograd(const Tensor& received, const Tensor& sizes, int64_t num_ranks,
                                                        int64_t alignment, const OptTensor& sorted, int64_t check,
                                                        bool zero_padding, int64_t rows) {
  std::tuple<Tensor, Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(sort_chunks_kernel)>("padmoe::sort_chunks");
    out = op.call(received, sizes, num_ranks, alignment, sorted, check, zero_padding, rows);
  }
  if (recording(received, std::nullopt)) {
    NodePtr node = new_node<SortChunksBackward>();
    auto* n = static_cast<SortChunksBackward*>(node.get());
    n->set_next_edges(torch::autograd::collect_next_edges(received));
    n->permutation_map = std::get<1>(out);
    n->rows = received.dim() >= 1 ? received.size(0) : 0;
    n->check = backward_check(check);
    torch::autograd::set_history(std::get<0>(out), node);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(padmoe, m) {
  m.def(
      "sort_chunks(Tensor received, Tensor split_sizes, int num_ranks, int alignment, Tensor? sorted_index=None, "
      "int check=2, bool zero_padding=True, int rows=-1) -> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(padmoe, CPU, m) { m.impl("sort_chunks", sort_chunks_kernel); }
#ifdef PADMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(padmoe, CUDA, m) { m.impl("sort_chunks", sort_chunks_kernel); }
#endif
TORCH_LIBRARY_IMPL(padmoe, Autograd, m) { m.impl("sort_chunks", sort_chunks_autograd); }

}  // namespace padmoe_torch
