// rows_ops.cpp — MegaBlocks' drop-ins on the sorted form of a plan (indices, bin_ids, bins,
// padded_bins): padded_gather (+ _backward), padded_scatter (+ _backward), padded_scatter_wgrad:
// their schemas, CPU / CUDA kernels and autograd. padded_gather's output rows, P = padded_bins[-1],
// are read on the host (CUDA: one synchronization, as MegaBlocks does). The same row ops on the
// packed plan (dispatch, combine and their backward) are in plan_ops.cpp, beside make_plan.
#include <algorithm>
#include <tuple>

#include "common.hpp"
#include "kernels.hpp"

namespace padmoe_torch {
namespace {

// dest_rows from the sorted (MegaBlocks) form: dest[indices[i]] = padded_start(e) + i - real_start(e).
Tensor dest_of(const Tensor& indices, const Tensor& bin_ids, const Tensor& bins, const Tensor& padded_bins) {
  const int64_t a = indices.numel();
  Tensor e = bin_ids.to(at::kLong);
  Tensor zero = at::zeros({1}, bins.options().dtype(at::kLong));
  Tensor real_start = at::cat({zero, bins.to(at::kLong).narrow(0, 0, std::max<int64_t>(bins.numel() - 1, 0))});
  Tensor pad_start =
      at::cat({zero, padded_bins.to(at::kLong).narrow(0, 0, std::max<int64_t>(padded_bins.numel() - 1, 0))});
  Tensor rows = pad_start.index_select(0, e) + at::arange(a, e.options()) - real_start.index_select(0, e);
  Tensor dest = at::empty({a}, indices.options().dtype(at::kInt));
  dest.index_put_({indices.to(at::kLong)}, rows.to(at::kInt));
  return dest;
}

}  // namespace

Tensor padded_gather_kernel(const Tensor& x_in, const Tensor& indices_in, const Tensor& bin_ids_in,
                            const Tensor& bins_in, const Tensor& padded_bins_in, int64_t top_k,
                            const OptTensor& weights, int64_t check, bool zero_padding) {
  const char* op = "padded_gather";
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  const int64_t p = host_last(padded_bins, op, "padded_bins");
  check_rows_fit(op, "padded_bins", p);
  const bool f64 = is_f64(x_in);
  Tensor x = f64 ? x_in : rows_arg(x_in);
  OptTensor w = scale_arg(weights);
  c10::OptionalDeviceGuard guard(x.device());
  padmoe::Options o = options_for(x, check);
  o.zero_padding = zero_padding || f64;  // float64 rows are moved by torch below (padding zero)
  const int64_t cols = x.dim() == 2 ? x.size(1) : 0;
  if (!f64 && p * std::max<int64_t>(cols, 1) * static_cast<int64_t>(x.element_size()) >= kCheckBeforeBytes) {
    // P comes from the data: a large output only after the op's checks passed on column-less
    // stand-ins (a bad bins[0] beside padded_bins[-1] = 2^31 - 1 is the op's ValueError, not an
    // out-of-memory error); the op proper then skips the device validation
    native([&] {
      padmoe::padded_gather_out(shadow(x), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
                                view(bins, op, "bins"), view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
                                opt_view(w, op, "weights"), shadow_rows(p, x), o);
    });
    o.check_data = false;
  }
  Tensor y = f64 ? Tensor() : at::empty({p, cols}, x.options());
  native([&] {
    padmoe::padded_gather_out(f64 ? shadow(x) : view(x, op, "x"), view(indices, op, "indices"),
                              view(bin_ids, op, "bin_ids"), view(bins, op, "bins"),
                              view(padded_bins, op, "padded_bins"), static_cast<int>(top_k), opt_view(w, op, "weights"),
                              f64 ? shadow_rows(p, x) : view(y, op, "y"), o);
  });
  if (f64) return spread64(x_in, dest_of(indices, bin_ids, bins, padded_bins), top_k, weights, p);
  return y;
}

std::tuple<Tensor, Tensor> padded_gather_backward_kernel(const Tensor& grad_y_in, const Tensor& x_in,
                                                         const Tensor& indices_in, const Tensor& bin_ids_in,
                                                         const Tensor& bins_in, const Tensor& padded_bins_in,
                                                         int64_t top_k, const OptTensor& weights, bool need_wgrad,
                                                         int64_t check) {
  const char* op = "padded_gather_backward";
  const bool want_w = need_wgrad && weights && weights->defined();
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  if (is_f64(x_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::padded_gather_backward_out(
          shadow(grad_y_in), shadow(x_in), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
          view(bins, op, "bins"), view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
          opt_view(w, op, "weights"), shadow(x_in), TensorView{}, options_for(x_in, check));
    });
    Tensor dest = dest_of(indices, bin_ids, bins, padded_bins);
    Tensor gx = reduce64(grad_y_in, dest, top_k, weights);
    Tensor gw =
        want_w ? dots64(grad_y_in, dest, top_k, x_in).to(weights->scalar_type()) : no_grad_placeholder(x_in, weights);
    return {gx, gw};
  }
  Tensor grad_y = rows_arg(grad_y_in), x = rows_arg(x_in);
  OptTensor w = scale_arg(weights);
  Tensor gx = at::empty(x.sizes(), x.options());
  Tensor gw = want_w ? wgrad_buffer(*weights, indices.numel()) : Tensor();
  c10::OptionalDeviceGuard guard(x.device());
  const padmoe::Options o = options_for(x, check);
  native([&] {
    padmoe::padded_gather_backward_out(
        view(grad_y, op, "grad_y"), view(x, op, "x"), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
        view(bins, op, "bins"), view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
        opt_view(w, op, "weights"), view(gx, op, "grad_x"), want_w ? view(gw, op, "grad_weights") : TensorView{}, o);
  });
  return {gx, want_w ? as_weights_dtype(gw, weights) : no_grad_placeholder(x, weights)};
}

Tensor padded_scatter_kernel(const Tensor& y_in, const Tensor& indices_in, const Tensor& bin_ids_in,
                             const OptTensor& weights, const Tensor& bins_in, const Tensor& padded_bins_in,
                             int64_t top_k, int64_t check) {
  const char* op = "padded_scatter";
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  if (is_f64(y_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::padded_scatter_out(shadow(y_in), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
                                 opt_view(w, op, "weights"), view(bins, op, "bins"),
                                 view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
                                 shadow_rows(top_k >= 1 ? indices.numel() / top_k : 0, y_in), options_for(y_in, check));
    });
    return reduce64(y_in, dest_of(indices, bin_ids, bins, padded_bins), top_k, weights);
  }
  Tensor y = rows_arg(y_in);
  OptTensor w = scale_arg(weights);
  const int64_t tokens = top_k >= 1 ? indices.numel() / top_k : 0;
  Tensor out = at::empty({tokens, y.dim() == 2 ? y.size(1) : 0}, y.options());
  c10::OptionalDeviceGuard guard(y.device());
  const padmoe::Options o = options_for(y, check);
  native([&] {
    padmoe::padded_scatter_out(view(y, op, "y"), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
                               opt_view(w, op, "weights"), view(bins, op, "bins"), view(padded_bins, op, "padded_bins"),
                               static_cast<int>(top_k), view(out, op, "out"), o);
  });
  return out;
}

std::tuple<Tensor, Tensor> padded_scatter_backward_kernel(const Tensor& grad_out_in, const Tensor& y_in,
                                                          const Tensor& indices_in, const Tensor& bin_ids_in,
                                                          const OptTensor& weights, const Tensor& bins_in,
                                                          const Tensor& padded_bins_in, int64_t top_k, bool need_wgrad,
                                                          int64_t check) {
  const char* op = "padded_scatter_backward";
  const bool want_w = need_wgrad && weights && weights->defined();
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  if (is_f64(y_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::padded_scatter_backward_out(
          shadow(grad_out_in), shadow(y_in), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
          opt_view(w, op, "weights"), view(bins, op, "bins"), view(padded_bins, op, "padded_bins"),
          static_cast<int>(top_k), shadow(y_in), TensorView{}, options_for(y_in, check));
    });
    Tensor dest = dest_of(indices, bin_ids, bins, padded_bins);
    Tensor gy = spread64(grad_out_in, dest, top_k, weights, y_in.size(0));
    Tensor gw =
        want_w ? dots64(y_in, dest, top_k, grad_out_in).to(weights->scalar_type()) : no_grad_placeholder(y_in, weights);
    return {gy, gw};
  }
  Tensor grad_out = rows_arg(grad_out_in), y = rows_arg(y_in);
  OptTensor w = scale_arg(weights);
  Tensor gy = at::empty(y.sizes(), y.options());
  Tensor gw = want_w ? wgrad_buffer(*weights, indices.numel()) : Tensor();
  c10::OptionalDeviceGuard guard(y.device());
  const padmoe::Options o = options_for(y, check, /*zero_tail=*/true);
  native([&] {
    padmoe::padded_scatter_backward_out(
        view(grad_out, op, "grad_out"), view(y, op, "y"), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
        opt_view(w, op, "weights"), view(bins, op, "bins"), view(padded_bins, op, "padded_bins"),
        static_cast<int>(top_k), view(gy, op, "grad_y"), want_w ? view(gw, op, "grad_weights") : TensorView{}, o);
  });
  return {gy, want_w ? as_weights_dtype(gw, weights) : no_grad_placeholder(y, weights)};
}

Tensor padded_scatter_wgrad_kernel(const Tensor& y_in, const Tensor& grad_in, const Tensor& indices_in,
                                   const Tensor& bin_ids_in, const Tensor& bins_in, const Tensor& padded_bins_in,
                                   int64_t top_k, int64_t check) {
  const char* op = "padded_scatter_wgrad";
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  if (is_f64(y_in)) {
    native([&] {
      padmoe::padded_scatter_wgrad_out(
          shadow(y_in), shadow(grad_in), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
          view(bins, op, "bins"), view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
          TensorView::contiguous(nullptr, DType::kFloat32, {indices.numel()}), options_for(y_in, check));
    });
    return dots64(y_in, dest_of(indices, bin_ids, bins, padded_bins), top_k, grad_in);
  }
  Tensor y = rows_arg(y_in), grad = rows_arg(grad_in);
  Tensor out = at::empty({indices.numel()}, y.options());
  c10::OptionalDeviceGuard guard(y.device());
  const padmoe::Options o = options_for(y, check);
  native([&] {
    padmoe::padded_scatter_wgrad_out(view(y, op, "y"), view(grad, op, "grad"), view(indices, op, "indices"),
                                     view(bin_ids, op, "bin_ids"), view(bins, op, "bins"),
                                     view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
                                     view(out, op, "wgrad"), o);
  });
  return out;
}

namespace {

// MegaBlocks drop-ins: padded_gather (x, ..., weights) and padded_scatter (y, ..., weights). Edges: (rows, weights).
struct SortedOpBackward : Node {
  bool is_scatter = false;
  Saved rows, weights;
  Tensor indices, bin_ids, bins, padded_bins;
  std::vector<int64_t> weight_shape;
  int64_t top_k = 1, check = 0;
  bool need_w = false;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(2);
    Tensor r = rows.get(), w = weights.get();
    Tensor g_rows, g_w;
    if (is_scatter) {
      static auto op = handle<decltype(padded_scatter_backward_kernel)>("padmoe::padded_scatter_backward");
      std::tie(g_rows, g_w) =
          op.call(grads[0], r, indices, bin_ids, optional_of(w), bins, padded_bins, top_k, need_w, check);
    } else {
      static auto op = handle<decltype(padded_gather_backward_kernel)>("padmoe::padded_gather_backward");
      std::tie(g_rows, g_w) =
          op.call(grads[0], r, indices, bin_ids, bins, padded_bins, top_k, optional_of(w), need_w, check);
    }
    return {g_rows, need_w ? shaped_as(g_w, weight_shape) : Tensor()};
  }
  void release_variables() override {
    rows.release();
    weights.release();
  }
  std::string name() const override {
    return is_scatter ? "padmoe::PaddedScatterBackward" : "padmoe::PaddedGatherBackward";
  }
};

void attach_sorted(bool is_scatter, const Tensor& out, const Tensor& rows, const Tensor& indices, const Tensor& bin_ids,
                   const Tensor& bins, const Tensor& padded_bins, const OptTensor& weights, int64_t top_k,
                   int64_t check) {
  NodePtr node = new_node<SortedOpBackward>();
  auto* n = static_cast<SortedOpBackward*>(node.get());
  n->set_next_edges(torch::autograd::collect_next_edges(rows, weights));
  n->is_scatter = is_scatter;
  n->rows.save(rows);
  if (weights) n->weights.save(*weights);
  n->indices = indices;
  n->bin_ids = bin_ids;
  n->bins = bins;
  n->padded_bins = padded_bins;
  n->need_w = wants_grad(weights);
  if (n->need_w) n->weight_shape = weights->sizes().vec();
  n->top_k = top_k;
  n->check = backward_check(check);
  torch::autograd::set_history(out, node);
}

Tensor padded_gather_autograd(const Tensor& x, const Tensor& indices, const Tensor& bin_ids, const Tensor& bins,
                              const Tensor& padded_bins, int64_t top_k, const OptTensor& weights, int64_t check,
                              bool zero_padding) {
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(padded_gather_kernel)>("padmoe::padded_gather");
    out = op.call(x, indices, bin_ids, bins, padded_bins, top_k, weights, check, zero_padding);
  }
  if (recording(x, weights)) attach_sorted(false, out, x, indices, bin_ids, bins, padded_bins, weights, top_k, check);
  return out;
}
Tensor padded_scatter_autograd(const Tensor& y, const Tensor& indices, const Tensor& bin_ids, const OptTensor& weights,
                               const Tensor& bins, const Tensor& padded_bins, int64_t top_k, int64_t check) {
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(padded_scatter_kernel)>("padmoe::padded_scatter");
    out = op.call(y, indices, bin_ids, weights, bins, padded_bins, top_k, check);
  }
  if (recording(y, weights)) attach_sorted(true, out, y, indices, bin_ids, bins, padded_bins, weights, top_k, check);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(padmoe, m) {
  m.def(
      "padded_gather(Tensor x, Tensor indices, Tensor bin_ids, Tensor bins, Tensor padded_bins, int top_k, "
      "Tensor? weights=None, int check=2, bool zero_padding=True) -> Tensor");
  m.def(
      "padded_gather_backward(Tensor grad_y, Tensor x, Tensor indices, Tensor bin_ids, Tensor bins, "
      "Tensor padded_bins, int top_k, Tensor? weights, bool need_wgrad, int check=2) -> (Tensor, Tensor)");
  m.def(
      "padded_scatter(Tensor y, Tensor indices, Tensor bin_ids, Tensor? weights, Tensor bins, Tensor padded_bins, "
      "int top_k, int check=2) -> Tensor");
  m.def(
      "padded_scatter_backward(Tensor grad_out, Tensor y, Tensor indices, Tensor bin_ids, Tensor? weights, "
      "Tensor bins, Tensor padded_bins, int top_k, bool need_wgrad, int check=2) -> (Tensor, Tensor)");
  m.def(
      "padded_scatter_wgrad(Tensor y, Tensor grad, Tensor indices, Tensor bin_ids, Tensor bins, "
      "Tensor padded_bins, int top_k, int check=2) -> Tensor");
}

#define PADMOE_TORCH_MEGABLOCKS_KERNELS(m)                           \
  m.impl("padded_gather", padded_gather_kernel);                     \
  m.impl("padded_gather_backward", padded_gather_backward_kernel);   \
  m.impl("padded_scatter", padded_scatter_kernel);                   \
  m.impl("padded_scatter_backward", padded_scatter_backward_kernel); \
  m.impl("padded_scatter_wgrad", padded_scatter_wgrad_kernel)

TORCH_LIBRARY_IMPL(padmoe, CPU, m) { PADMOE_TORCH_MEGABLOCKS_KERNELS(m); }
#ifdef PADMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(padmoe, CUDA, m) { PADMOE_TORCH_MEGABLOCKS_KERNELS(m); }
#endif
#undef PADMOE_TORCH_MEGABLOCKS_KERNELS

TORCH_LIBRARY_IMPL(padmoe, Autograd, m) {
  m.impl("padded_gather", padded_gather_autograd);
  m.impl("padded_scatter", padded_scatter_autograd);
}

}  // namespace padmoe_torch
