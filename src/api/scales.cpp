// scales.cpp — layout inference and checks of the `_scaled` ops' scale tensors.
#include "api/scales.hpp"

#include <string>

#include "padmoe/index_math.hpp"

namespace padmoe {
namespace detail {
namespace {

std::string str(int64_t v) { return std::to_string(v); }


constexpr uint32_t kFloatOne = 0x3f800000u;  // float32 1.0f
constexpr uint32_t kE8M0One = 127u;          // E8M0: 2^(127 - 127)

// The layout of `s` for rows of `hidden` columns, or a named error.
ScaleSpec infer(const Checker& c, const TensorView& s, const char* name, int64_t hidden) {
  if (s.dtype != DType::kFloat32 && s.dtype != DType::kUInt8) {
    c.fail(ErrorKind::kType, name,
           std::string("expected float32 scales (per row or per 128 columns) or uint8 E8M0 scales (MXFP8), got ") +
               dtype_name(s.dtype));
  }
  if (s.ndim != 1 && s.ndim != 2) {
    c.value_error(name, "expected a [rows] or [rows, columns] scale tensor, got shape " + shape_str(s));
  }
  for (int d = 0; d < s.ndim; ++d) {
    if (s.shape[d] < 0) c.value_error(name, "negative size in shape " + shape_str(s));
  }
  ScaleSpec spec;
  spec.dtype = s.dtype;
  if (s.dtype == DType::kUInt8) {
    const int64_t want = index::ceil_div(hidden, 32);
    if (s.ndim != 2 || s.shape[1] != want) {
      c.value_error(name, "uint8 (E8M0) scales must be [rows, ceil(H/32)] = [rows, " + str(want) +
                              "] for H = " + str(hidden) + ", got shape " + shape_str(s));
    }
    spec.layout = ScaleLayout::kMxE8M0;
    spec.cols = want;
    return spec;
  }
  const int64_t blocks = index::ceil_div(hidden, 128);
  if (s.ndim == 1 || s.shape[1] == 1) {
    spec.layout = ScaleLayout::kPerRow;
    spec.cols = 1;
  } else if (s.shape[1] == blocks) {
    spec.layout = ScaleLayout::kBlock128;
    spec.cols = blocks;
  } else {
    c.value_error(name, "float32 scales must be [rows] or [rows, 1] (per row) or [rows, ceil(H/128)] = [rows, " +
                            str(blocks) + "] (per 128 columns) for H = " + str(hidden) + ", got shape " + shape_str(s));
  }
  if (s.ndim == 2 && s.shape[1] == 0) spec.cols = 0;  // H = 0, per 128 columns: no columns
  return spec;
}

void check_common(const Checker& c, const TensorView& s, const char* name, int64_t rows, Device device) {
  if (s.shape[0] != rows) {
    c.value_error(name, "expected " + str(rows) + " rows (one scale row per row), got shape " + shape_str(s));
  }
  c.same_device(s, name, device);
  if (!s.is_contiguous()) c.value_error(name, "expected a contiguous (row-major) tensor, got shape " + shape_str(s));
  if (s.data == nullptr && s.numel() > 0) c.value_error(name, "null data pointer");
}

}  // namespace

ScaleSpec check_scales(const Checker& c, const TensorView& s, const char* name, int64_t rows, int64_t hidden,
                       Device device) {
  const ScaleSpec spec = infer(c, s, name, hidden);
  check_common(c, s, name, rows, device);
  return spec;
}

void check_scales_out(const Checker& c, const TensorView& s, const char* name, int64_t rows, const ScaleSpec& like,
                      Device device) {
  if (s.dtype != like.dtype) {
    c.fail(
        ErrorKind::kType, name,
        std::string("expected dtype ") + dtype_name(like.dtype) + " (the input scales'), got " + dtype_name(s.dtype));
  }
  if (s.ndim != 1 && s.ndim != 2) {
    c.value_error(name, "expected a [rows] or [rows, columns] scale tensor, got shape " + shape_str(s));
  }
  const bool per_row = like.layout == ScaleLayout::kPerRow;
  const bool ok = s.ndim == 1 ? per_row : s.shape[1] == like.cols;
  if (!ok) {
    c.value_error(name, "expected the input scales' layout (" + str(like.cols) + " column" +
                            (like.cols == 1 ? "" : "s") + " per row), got shape " + shape_str(s));
  }
  check_common(c, s, name, rows, device);
}

namespace {

// The backends' scale-row arguments have the same fields (cpu::ScaleRows, cuda::ScaleRowsArg).
template <class R>
R scale_rows_of(const TensorView& src, const TensorView& dst, const ScaleSpec& spec) {
  R r;
  r.src = src.data;
  r.dst = dst.data;
  r.cols = spec.cols;
  r.elem = spec.dtype == DType::kUInt8 ? 1 : 4;
  r.one = spec.dtype == DType::kUInt8 ? kE8M0One : kFloatOne;
  return r;
}

}  // namespace

cpu::ScaleRows cpu_scale_rows(const TensorView& src, const TensorView& dst, const ScaleSpec& spec) {
  return scale_rows_of<cpu::ScaleRows>(src, dst, spec);
}

cuda::ScaleRowsArg cuda_scale_rows(const TensorView& src, const TensorView& dst, const ScaleSpec& spec) {
  return scale_rows_of<cuda::ScaleRowsArg>(src, dst, spec);
}

}  // namespace detail

ScaleLayout scale_layout(const TensorView& scales, int64_t hidden, const char* name) {
  const detail::Checker c("scale_layout");
  if (hidden < 0) c.value_error("hidden", "must be >= 0, got " + std::to_string(hidden));
  return detail::infer(c, scales, name, hidden).layout;
}

int64_t scale_columns(ScaleLayout layout, int64_t hidden) {
  switch (layout) {
    case ScaleLayout::kPerRow: return 1;
    case ScaleLayout::kBlock128: return index::ceil_div(hidden, 128);
    case ScaleLayout::kMxE8M0: return index::ceil_div(hidden, 32);
  }
  return 1;
}

}  // namespace padmoe
