// rows_ops.cpp — padmoe._C's bindings of MegaBlocks' ops on the sorted form of a plan (indices,
// bin_ids, bins, padded_bins): padded_gather, padded_scatter, padded_scatter_wgrad and the backward
// of padded_gather and padded_scatter.
#include "common.hpp"

namespace padmoe_ext {

void bind_rows(nb::module_& m) {
  // --- MegaBlocks family -----------------------------------------------------

  m.def(
      "padded_gather_out",
      [](const In& x, const In& indices, const In& bin_ids, const In& bins, const In& padded_bins, int top_k,
         const OptIn& weights, const Out& y, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_gather";
        const TensorView vx = to_view(x, op, "x"), vi = to_view(indices, op, "indices"),
                         vb = to_view(bin_ids, op, "bin_ids"), vbins = to_view(bins, op, "bins"),
                         vp = to_view(padded_bins, op, "padded_bins"), vy = to_view(y, op, "y");
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_gather_out(vx, vi, vb, vbins, vp, top_k, vw, vy, o);
      },
      nb::arg("x"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("bins"), nb::arg("padded_bins"), nb::arg("top_k"),
      nb::arg("weights").none(), nb::arg("y"), PADMOE_OPTIONS);

  m.def(
      "padded_scatter_out",
      [](const In& y, const In& indices, const In& bin_ids, const OptIn& weights, const In& bins, const In& padded_bins,
         int top_k, const Out& out, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_scatter";
        const TensorView vy = to_view(y, op, "y"), vi = to_view(indices, op, "indices"),
                         vb = to_view(bin_ids, op, "bin_ids"), vbins = to_view(bins, op, "bins"),
                         vp = to_view(padded_bins, op, "padded_bins"), vo = to_view(out, op, "out");
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_scatter_out(vy, vi, vb, vw, vbins, vp, top_k, vo, o);
      },
      nb::arg("y"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("weights").none(), nb::arg("bins"),
      nb::arg("padded_bins"), nb::arg("top_k"), nb::arg("out"), PADMOE_OPTIONS);

  m.def(
      "padded_scatter_wgrad_out",
      [](const In& y, const In& grad, const In& indices, const In& bin_ids, const In& bins, const In& padded_bins,
         int top_k, const Out& wgrad, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_scatter_wgrad";
        const TensorView vy = to_view(y, op, "y"), vg = to_view(grad, op, "grad"), vi = to_view(indices, op, "indices"),
                         vb = to_view(bin_ids, op, "bin_ids"), vbins = to_view(bins, op, "bins"),
                         vp = to_view(padded_bins, op, "padded_bins"), vw = to_view(wgrad, op, "wgrad");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_scatter_wgrad_out(vy, vg, vi, vb, vbins, vp, top_k, vw, o);
      },
      nb::arg("y"), nb::arg("grad"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("bins"), nb::arg("padded_bins"),
      nb::arg("top_k"), nb::arg("wgrad"), PADMOE_OPTIONS);

  m.def(
      "padded_gather_backward_out",
      [](const In& grad_y, const In& x, const In& indices, const In& bin_ids, const In& bins, const In& padded_bins,
         int top_k, const OptIn& weights, const Out& grad_x, const OptOut& grad_weights, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_gather_backward";
        const TensorView vgy = to_view(grad_y, op, "grad_y"), vx = to_view(x, op, "x"),
                         vi = to_view(indices, op, "indices"), vb = to_view(bin_ids, op, "bin_ids"),
                         vbins = to_view(bins, op, "bins"), vp = to_view(padded_bins, op, "padded_bins"),
                         vgx = to_view(grad_x, op, "grad_x"), vgw = to_out_view(grad_weights, op, "grad_weights");
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_gather_backward_out(vgy, vx, vi, vb, vbins, vp, top_k, vw, vgx, vgw, o);
      },
      nb::arg("grad_y"), nb::arg("x"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("bins"), nb::arg("padded_bins"),
      nb::arg("top_k"), nb::arg("weights").none(), nb::arg("grad_x"), nb::arg("grad_weights").none(), PADMOE_OPTIONS);

  m.def(
      "padded_scatter_backward_out",
      [](const In& grad_out, const In& y, const In& indices, const In& bin_ids, const OptIn& weights, const In& bins,
         const In& padded_bins, int top_k, const Out& grad_y, const OptOut& grad_weights, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_scatter_backward";
        const TensorView vgo = to_view(grad_out, op, "grad_out"), vy = to_view(y, op, "y"),
                         vi = to_view(indices, op, "indices"), vb = to_view(bin_ids, op, "bin_ids"),
                         vbins = to_view(bins, op, "bins"), vp = to_view(padded_bins, op, "padded_bins"),
                         vgy = to_view(grad_y, op, "grad_y"), vgw = to_out_view(grad_weights, op, "grad_weights");
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_scatter_backward_out(vgo, vy, vi, vb, vw, vbins, vp, top_k, vgy, vgw, o);
      },
      nb::arg("grad_out"), nb::arg("y"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("weights").none(),
      nb::arg("bins"), nb::arg("padded_bins"), nb::arg("top_k"), nb::arg("grad_y"), nb::arg("grad_weights").none(),
      PADMOE_OPTIONS);
}

}  // namespace padmoe_ext
