// quant.cpp — quantize (ops.hpp section 4): the quantizer of
// dispatch_quantized without the routing, and the checks both share.
#include "api/quant.hpp"

#include <string>

namespace padmoe {
namespace detail {

void check_quant_input(const Checker& c, const TensorView& x, const char* name) {
  if (x.dtype != DType::kFloat32 && x.dtype != DType::kFloat16 && x.dtype != DType::kBFloat16) {
    c.fail(ErrorKind::kType, name,
           std::string("expected float32, float16 or bfloat16 rows to quantize, got ") + dtype_name(x.dtype) +
               (is_float8(x.dtype) ? " (rows already quantized: move them with dispatch_scaled)" : ""));
  }
}

bool check_fp8_dtype(const Checker& c, DType dtype, const char* name) {
  if (!is_float8(dtype)) {
    c.fail(ErrorKind::kType, name,
           std::string("expected float8_e4m3 or float8_e5m2 (quantized rows), got ") + dtype_name(dtype));
  }
  return dtype == DType::kFloat8E5M2;
}

cpu::QuantScales cpu_quant_scales(const TensorView& scales, const ScaleSpec& spec, bool e5m2) {
  return cpu::QuantScales{scales.data, spec.layout, spec.cols, e5m2};
}

cuda::QuantScalesArg cuda_quant_scales(const TensorView& scales, const ScaleSpec& spec, bool e5m2) {
  return cuda::QuantScalesArg{scales.data, spec.layout, spec.cols, e5m2};
}

ScaleSpec quant_spec(ScaleLayout layout, int64_t hidden) {
  ScaleSpec s;
  s.layout = layout;
  s.dtype = layout == ScaleLayout::kMxE8M0 ? DType::kUInt8 : DType::kFloat32;
  s.cols = scale_columns(layout, hidden);
  return s;
}

NewTensor quant_scales(ScaleLayout layout, int64_t rows, int64_t hidden) {
  const ScaleSpec s = quant_spec(layout, hidden);
  if (layout == ScaleLayout::kPerRow) return NewTensor(DType::kFloat32, {rows});
  return NewTensor(s.dtype, {rows, s.cols});
}

}  // namespace detail

namespace {

using detail::Checker;

// x [N, H]: float32 / float16 / bfloat16 rows on a served device.
void quantize_inputs(const Checker& c, const TensorView& x) {
  detail::check_quant_input(c, x, "x");
  c.row_tensor(x, "x", -1, -1, /*allow_fp8=*/false);
  detail::require_backend(c, x.device);
}

void run_quantize(const TensorView& x, const TensorView& y, const TensorView& ys, const detail::ScaleSpec& spec,
                  bool e5m2, const Options& o) {
  if (x.device.is_cuda()) {
    cuda::quantize_spread_rows(cuda::RowsArg::of(x), 1, nullptr, cuda::RowsArg::of(y),
                               detail::cuda_quant_scales(ys, spec, e5m2), cuda::PaddingRef{}, false, false, o.stream);
    return;
  }
  cpu::quantize_spread_rows(cpu::RowsRef::of(x), 1, nullptr, cpu::RowsRef::of(y),
                            detail::cpu_quant_scales(ys, spec, e5m2), nullptr, x.shape[0], false, false, o.num_threads);
}

}  // namespace

void quantize_out(const TensorView& x, const TensorView& y, const TensorView& y_scales, const Options& options) {
  const Checker c("quantize");
  quantize_inputs(c, x);
  const bool e5m2 = detail::check_fp8_dtype(c, y.dtype, "y");
  c.row_output(y, "y", x.shape[0], /*at_least=*/false, x.shape[1], y.dtype);
  c.same_device(y, "y", x.device);
  const detail::ScaleSpec spec = detail::check_scales(c, y_scales, "y_scales", x.shape[0], x.shape[1], x.device);
  detail::check_disjoint_all(c, {detail::named(y, "y"), detail::named(y_scales, "y_scales")}, {detail::named(x, "x")});
  run_quantize(x, y, y_scales, spec, e5m2, options);
}

ScaledRows quantize(const TensorView& x, ScaleLayout layout, DType dtype, const Options& options) {
  const Checker c("quantize");
  quantize_inputs(c, x);
  const bool e5m2 = detail::check_fp8_dtype(c, dtype, "dtype");
  return detail::allocate_outputs<ScaledRows>(
      x.device, {{dtype, {x.shape[0], x.shape[1]}}, detail::quant_scales(layout, x.shape[0], x.shape[1])},
      [&](const ScaledRows& out) {
        run_quantize(x, out.rows, out.scales, detail::quant_spec(layout, x.shape[1]), e5m2, options);
      });
}

}  // namespace padmoe
