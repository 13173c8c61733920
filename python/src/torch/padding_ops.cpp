// padding_ops.cpp — Megatron's drop-ins: pad_to_alignment, unpad_from_alignment (+ _backward):
// their schemas, CPU / CUDA kernels and autograd. P, pad_to_alignment's output rows, comes from
// padmoe's host read of the counts (CUDA: one synchronization, as Megatron has).
#include <tuple>

#include "common.hpp"
#include "kernels.hpp"

namespace padmoe_torch {

std::tuple<Tensor, Tensor, Tensor> pad_kernel(const Tensor& h_in, const Tensor& tpe_in, int64_t alignment,
                                              int64_t check, bool zero_padding) {
  const char* op = "pad_to_alignment";
  Tensor tpe = index_arg(tpe_in);
  Tensor h = is_f64(h_in) ? h_in : rows_arg(h_in);
  const int64_t p = pad_rows(op, h, tpe, alignment, check);
  const int64_t e = tpe.dim() == 1 ? tpe.numel() : 0;
  Tensor map = at::empty({p}, h.options().dtype(at::kInt));
  Tensor offs = at::empty({e}, h.options().dtype(at::kInt));
  if (is_f64(h)) {  // the map and offsets from padmoe on float32 rows of no columns, then an exact move
    Tensor none = at::empty({h.size(0), 0}, h.options().dtype(at::kFloat));
    Tensor pn = at::empty({p, 0}, none.options());
    c10::OptionalDeviceGuard guard(h.device());
    const padmoe::Options o = options_for(h, check);
    native([&] {
      padmoe::pad_to_alignment_out(view(none, op, "hidden_states"), view(tpe, op, "tokens_per_expert"),
                                   static_cast<int>(alignment), view(pn, op, "padded"),
                                   view(map, op, "permutation_map"), view(offs, op, "inclusive_offsets"), o);
    });
    Tensor keep = map.ge(0).to(h.scalar_type()).unsqueeze(1);
    Tensor padded = h.index_select(0, map.clamp_min(0).to(at::kLong)) * keep;
    return {padded, map, offs};
  }
  Tensor padded = at::empty({p, h.dim() == 2 ? h.size(1) : 0}, h.options());
  c10::OptionalDeviceGuard guard(h.device());
  padmoe::Options o = options_for(h, check);
  o.zero_padding = zero_padding;
  native([&] {
    padmoe::pad_to_alignment_out(view(h, op, "hidden_states"), view(tpe, op, "tokens_per_expert"),
                                 static_cast<int>(alignment), view(padded, op, "padded"),
                                 view(map, op, "permutation_map"), view(offs, op, "inclusive_offsets"), o);
  });
  return {padded, map, offs};
}

Tensor unpad_kernel(const Tensor& padded_in, const Tensor& map_in, int64_t original_size, const OptTensor& probs,
                    int64_t check) {
  const char* op = "unpad_from_alignment";
  if (original_size < 0) value_error(op, "original_size", "must be >= 0, got " + std::to_string(original_size));
  Tensor map = index_arg(map_in);
  if (is_f64(padded_in)) {
    OptTensor pr = scale_arg(probs);
    native([&] {
      padmoe::unpad_from_alignment_out(shadow(padded_in), view(map, op, "permutation_map"), opt_view(pr, op, "probs"),
                                       shadow_rows(original_size, padded_in), options_for(padded_in, check));
    });
    Tensor out = at::zeros({original_size, padded_in.size(1)}, padded_in.options());
    Tensor src = at::nonzero(map.ge(0)).squeeze(1);
    Tensor dst = map.to(at::kLong).index_select(0, src);
    Tensor rows = padded_in.index_select(0, src);
    if (probs && probs->defined())
      rows = rows * probs->reshape({-1}).to(rows.scalar_type()).index_select(0, dst).unsqueeze(1);
    out.index_put_({dst}, rows);
    return out;
  }
  Tensor padded = rows_arg(padded_in);
  OptTensor pr = scale_arg(probs);
  Tensor out = at::empty({original_size, padded.dim() == 2 ? padded.size(1) : 0}, padded.options());
  c10::OptionalDeviceGuard guard(padded.device());
  const padmoe::Options o = options_for(padded, check);
  native([&] {
    padmoe::unpad_from_alignment_out(view(padded, op, "padded"), view(map, op, "permutation_map"),
                                     opt_view(pr, op, "probs"), view(out, op, "out"), o);
  });
  return out;
}

std::tuple<Tensor, Tensor> unpad_backward_kernel(const Tensor& grad_out_in, const Tensor& padded_in,
                                                 const Tensor& map_in, const OptTensor& probs, bool need_pgrad,
                                                 int64_t check) {
  const char* op = "unpad_from_alignment_backward";
  const bool want_p = need_pgrad && probs && probs->defined();
  Tensor map = index_arg(map_in);
  const int64_t n = grad_out_in.dim() >= 1 ? grad_out_in.size(0) : 0;
  if (is_f64(padded_in)) {
    OptTensor pr = scale_arg(probs);
    native([&] {
      padmoe::unpad_from_alignment_backward_out(shadow(grad_out_in), shadow(padded_in),
                                                view(map, op, "permutation_map"), opt_view(pr, op, "probs"),
                                                shadow(padded_in), TensorView{}, options_for(padded_in, check));
    });
    Tensor src = at::nonzero(map.ge(0)).squeeze(1);
    Tensor dst = map.to(at::kLong).index_select(0, src);
    Tensor g = grad_out_in.index_select(0, dst);
    Tensor gp = at::zeros_like(padded_in);
    if (probs && probs->defined()) {
      gp.index_put_({src}, g * probs->reshape({-1}).to(g.scalar_type()).index_select(0, dst).unsqueeze(1));
    } else {
      gp.index_put_({src}, g);
    }
    if (!want_p) return {gp, no_grad_placeholder(padded_in, probs)};
    Tensor gpr = at::zeros({n}, g.options());
    gpr.index_put_({dst}, (padded_in.index_select(0, src) * g).sum(-1));
    return {gp, gpr.to(probs->scalar_type())};
  }
  Tensor grad_out = rows_arg(grad_out_in), padded = rows_arg(padded_in);
  OptTensor pr = scale_arg(probs);
  Tensor gp = at::empty(padded.sizes(), padded.options());
  Tensor gpr = want_p ? wgrad_buffer(*probs, n) : Tensor();
  c10::OptionalDeviceGuard guard(padded.device());
  const padmoe::Options o = options_for(padded, check);
  native([&] {
    padmoe::unpad_from_alignment_backward_out(
        view(grad_out, op, "grad_out"), view(padded, op, "padded"), view(map, op, "permutation_map"),
        opt_view(pr, op, "probs"), view(gp, op, "grad_padded"), want_p ? view(gpr, op, "grad_probs") : TensorView{}, o);
  });
  return {gp, want_p ? as_weights_dtype(gpr, probs) : no_grad_placeholder(padded, probs)};
}

// pad_to_alignment's node (common.hpp; sort_chunks' too): edge (hidden_states); its backward is
// unpad of the gradient.
variable_list PadBackward::apply(variable_list&& grads) {
  if (!grads[0].defined()) return variable_list(1);
  static auto op = handle<decltype(unpad_kernel)>("padmoe::unpad_from_alignment");
  return {op.call(grads[0], permutation_map, rows, std::nullopt, check)};
}

namespace {

std::tuple<Tensor, Tensor, Tensor> pad_autograd(const Tensor& h, const Tensor& tpe, int64_t alignment, int64_t check,
                                                bool zero_padding) {
  std::tuple<Tensor, Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(pad_kernel)>("padmoe::pad_to_alignment");
    out = op.call(h, tpe, alignment, check, zero_padding);
  }
  if (recording(h, std::nullopt)) {
    NodePtr node = new_node<PadBackward>();
    auto* n = static_cast<PadBackward*>(node.get());
    n->set_next_edges(torch::autograd::collect_next_edges(h));
    n->permutation_map = std::get<1>(out);
    n->rows = h.dim() >= 1 ? h.size(0) : 0;
    n->check = backward_check(check);
    torch::autograd::set_history(std::get<0>(out), node);  // the map and offsets are integers: no history
  }
  return out;
}

// unpad: edges (padded_output, probs).
struct UnpadBackward : Node {
  Saved padded, probs;
  Tensor permutation_map;
  std::vector<int64_t> probs_shape;
  int64_t check = 0;
  bool need_p = false;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(2);
    static auto op = handle<decltype(unpad_backward_kernel)>("padmoe::unpad_from_alignment_backward");
    Tensor p = padded.get(), pr = probs.get();
    auto [gp, gpr] = op.call(grads[0], p, permutation_map, optional_of(pr), need_p, check);
    return {gp, need_p ? shaped_as(gpr, probs_shape) : Tensor()};
  }
  void release_variables() override {
    padded.release();
    probs.release();
    permutation_map = Tensor();
  }
  std::string name() const override { return "padmoe::UnpadFromAlignmentBackward"; }
};

Tensor unpad_autograd(const Tensor& padded, const Tensor& map, int64_t original_size, const OptTensor& probs,
                      int64_t check) {
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(unpad_kernel)>("padmoe::unpad_from_alignment");
    out = op.call(padded, map, original_size, probs, check);
  }
  if (recording(padded, probs)) {
    NodePtr node = new_node<UnpadBackward>();
    auto* n = static_cast<UnpadBackward*>(node.get());
    n->set_next_edges(torch::autograd::collect_next_edges(padded, probs));
    n->padded.save(padded);
    if (probs) n->probs.save(*probs);
    n->permutation_map = map;
    n->need_p = wants_grad(probs);
    if (n->need_p) n->probs_shape = probs->sizes().vec();
    n->check = backward_check(check);
    torch::autograd::set_history(out, node);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(padmoe, m) {
  m.def(
      "pad_to_alignment(Tensor hidden_states, Tensor tokens_per_expert, int alignment, int check=2, "
      "bool zero_padding=True) -> (Tensor, Tensor, Tensor)");
  m.def(
      "unpad_from_alignment(Tensor padded_output, Tensor permutation_map, int original_size, Tensor? probs=None, "
      "int check=2) -> Tensor");
  m.def(
      "unpad_from_alignment_backward(Tensor grad_out, Tensor padded_output, Tensor permutation_map, Tensor? probs, "
      "bool need_pgrad, int check=2) -> (Tensor, Tensor)");
}

#define PADMOE_TORCH_MEGATRON_KERNELS(m)        \
  m.impl("pad_to_alignment", pad_kernel);       \
  m.impl("unpad_from_alignment", unpad_kernel); \
  m.impl("unpad_from_alignment_backward", unpad_backward_kernel)

TORCH_LIBRARY_IMPL(padmoe, CPU, m) { PADMOE_TORCH_MEGATRON_KERNELS(m); }
#ifdef PADMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(padmoe, CUDA, m) { PADMOE_TORCH_MEGATRON_KERNELS(m); }
#endif
#undef PADMOE_TORCH_MEGATRON_KERNELS

TORCH_LIBRARY_IMPL(padmoe, Autograd, m) {
  m.impl("pad_to_alignment", pad_autograd);
  m.impl("unpad_from_alignment", unpad_autograd);
}

}  // namespace padmoe_torch
