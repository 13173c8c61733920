// scales.hpp — the scale tensors of the `_scaled` ops (rows moved with their
// scales, ops.hpp section 4): layout inference and argument checks (docs/spec.md
// §12: named argument, before anything is written), and the kernels'
// views of a checked (source, destination) pair.
#pragma once

#include <cstdint>

#include "api/checks.hpp"
#include "cpu/cpu_backend.hpp"
#include "cuda/cuda_backend.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"

namespace padmoe {
namespace detail {

// A checked scale tensor: its layout, dtype and columns per row.
struct ScaleSpec {
  ScaleLayout layout = ScaleLayout::kPerRow;
  DType dtype = DType::kFloat32;
  int64_t cols = 1;
};

// The scales of `rows` rows of `hidden` columns on `device`: float32 or uint8,
// 1-D (per-row float32 only) or 2-D, contiguous, `rows` rows, columns of one
// of the three layouts. Returns the layout.
ScaleSpec check_scales(const Checker& c, const TensorView& s, const char* name, int64_t rows, int64_t hidden,
                       Device device);
// An output of `like`'s layout (same dtype and columns; per-row may be 1-D or
// [rows, 1] either way) with exactly `rows` rows, on `device`.
void check_scales_out(const Checker& c, const TensorView& s, const char* name, int64_t rows, const ScaleSpec& like,
                      Device device);

// The scale rows of a `_scaled` op (checked): src moves to dst with the rows.
struct ScalePair {
  TensorView src, dst;
  ScaleSpec spec;
};

// The kernels' view of a checked pair (src -> dst).
cpu::ScaleRows cpu_scale_rows(const TensorView& src, const TensorView& dst, const ScaleSpec& spec);
cuda::ScaleRowsArg cuda_scale_rows(const TensorView& src, const TensorView& dst, const ScaleSpec& spec);

}  // namespace detail
}  // namespace padmoe
