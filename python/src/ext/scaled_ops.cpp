// scaled_ops.cpp — padmoe._C's bindings of the ops that move rows with their scales
// (dispatch_scaled, padded_gather_scaled, pad_to_alignment_scaled, unpad_from_alignment_scaled) and
// of the fused quantizing dispatch (dispatch_quantized, quantize).
#include "common.hpp"

namespace padmoe_ext {

namespace {

// A uint8 array of float8 codes read as the float8 format `fp8` ("e4m3" /
// "e5m2"); "" keeps the view's dtype (dispatch_quantized / quantize outputs).
TensorView fp8_codes(TensorView v, const std::string& fp8, const char* op) {
  if (fp8.empty()) return v;
  if (fp8 != "e4m3" && fp8 != "e5m2")
    fail(ErrorKind::kValue, op, "fp8", "expected 'e4m3' or 'e5m2', got '" + fp8 + "'");
  if (v.dtype != DType::kUInt8) {
    fail(ErrorKind::kType, op, "y",
         std::string("fp8='") + fp8 + "' reads uint8 code bytes, got " + padmoe::dtype_name(v.dtype));
  }
  v.dtype = fp8 == "e4m3" ? DType::kFloat8E4M3 : DType::kFloat8E5M2;
  return v;
}

}  // namespace

void bind_scaled(nb::module_& m) {
  // --- rows moved with their scales (ops.hpp section 4) -----------------------

  m.def(
      "dispatch_scaled_out",
      [](const In& x, nb::handle plan, const In& x_scales, const Out& y, const Out& y_scales, PADMOE_OPTION_PARAMS) {
        const char* op = "dispatch";
        const TensorView vx = to_view(x, op, "x"), vxs = to_view(x_scales, op, "x_scales"), vy = to_view(y, op, "y"),
                         vys = to_view(y_scales, op, "y_scales");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::dispatch_scaled_out(vx, p.view, vxs, vy, vys, o);
      },
      nb::arg("x"), nb::arg("plan"), nb::arg("x_scales"), nb::arg("y"), nb::arg("y_scales"), PADMOE_OPTIONS);

  m.def(
      "padded_gather_scaled_out",
      [](const In& x, const In& indices, const In& bin_ids, const In& bins, const In& padded_bins, int top_k,
         const In& x_scales, const Out& y, const Out& y_scales, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_gather";
        const TensorView vx = to_view(x, op, "x"), vi = to_view(indices, op, "indices"),
                         vb = to_view(bin_ids, op, "bin_ids"), vbins = to_view(bins, op, "bins"),
                         vp = to_view(padded_bins, op, "padded_bins"), vxs = to_view(x_scales, op, "x_scales"),
                         vy = to_view(y, op, "y"), vys = to_view(y_scales, op, "y_scales");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_gather_scaled_out(vx, vi, vb, vbins, vp, top_k, vxs, vy, vys, o);
      },
      nb::arg("x"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("bins"), nb::arg("padded_bins"), nb::arg("top_k"),
      nb::arg("x_scales"), nb::arg("y"), nb::arg("y_scales"), PADMOE_OPTIONS);

  m.def(
      "pad_to_alignment_scaled_out",
      [](const In& hidden_states, const In& tokens_per_expert, int alignment, const In& hidden_scales,
         const Out& padded, const Out& padded_scales, const Out& permutation_map, const Out& inclusive_offsets,
         PADMOE_OPTION_PARAMS) {
        const char* op = "pad_to_alignment";
        const TensorView vh = to_view(hidden_states, op, "hidden_states"),
                         vt = to_view(tokens_per_expert, op, "tokens_per_expert"),
                         vhs = to_view(hidden_scales, op, "hidden_scales"), vp = to_view(padded, op, "padded"),
                         vps = to_view(padded_scales, op, "padded_scales"),
                         vm = to_view(permutation_map, op, "permutation_map"),
                         vo = to_view(inclusive_offsets, op, "inclusive_offsets");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::pad_to_alignment_scaled_out(vh, vt, alignment, vhs, vp, vps, vm, vo, o);
      },
      nb::arg("hidden_states"), nb::arg("tokens_per_expert"), nb::arg("alignment"), nb::arg("hidden_scales"),
      nb::arg("padded"), nb::arg("padded_scales"), nb::arg("permutation_map"), nb::arg("inclusive_offsets"),
      PADMOE_OPTIONS);

  m.def(
      "unpad_from_alignment_scaled_out",
      [](const In& padded, const In& permutation_map, const In& padded_scales, const Out& out, const Out& out_scales,
         PADMOE_OPTION_PARAMS) {
        const char* op = "unpad_from_alignment";
        const TensorView vp = to_view(padded, op, "padded_output"),
                         vm = to_view(permutation_map, op, "permutation_map"),
                         vps = to_view(padded_scales, op, "padded_scales"), vo = to_view(out, op, "out"),
                         vos = to_view(out_scales, op, "out_scales");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::unpad_from_alignment_scaled_out(vp, vm, vps, vo, vos, o);
      },
      nb::arg("padded"), nb::arg("permutation_map"), nb::arg("padded_scales"), nb::arg("out"), nb::arg("out_scales"),
      PADMOE_OPTIONS);

  // --- fused quantizing dispatch (ops.hpp section 4) ----------------------------
  // `fp8` ("e4m3" / "e5m2") reads a uint8 y as float8 codes of that format
  // (numpy has no float8 dtype); "" takes y's own dtype (torch float8 tensors).
  m.def(
      "dispatch_quantized_out",
      [](const In& x, nb::handle plan, const Out& y, const Out& y_scales, const std::string& fp8,
         PADMOE_OPTION_PARAMS) {
        const char* op = "dispatch_quantized";
        const TensorView vx = to_view(x, op, "x"), vy = fp8_codes(to_view(y, op, "y"), fp8, op),
                         vys = to_view(y_scales, op, "y_scales");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::dispatch_quantized_out(vx, p.view, vy, vys, o);
      },
      nb::arg("x"), nb::arg("plan"), nb::arg("y"), nb::arg("y_scales"), nb::arg("fp8") = "", PADMOE_OPTIONS);

  m.def(
      "quantize_out",
      [](const In& x, const Out& y, const Out& y_scales, const std::string& fp8, PADMOE_OPTION_PARAMS) {
        const char* op = "quantize";
        const TensorView vx = to_view(x, op, "x"), vy = fp8_codes(to_view(y, op, "y"), fp8, op),
                         vys = to_view(y_scales, op, "y_scales");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::quantize_out(vx, vy, vys, o);
      },
      nb::arg("x"), nb::arg("y"), nb::arg("y_scales"), nb::arg("fp8") = "", PADMOE_OPTIONS);
}

}  // namespace padmoe_ext
