// quant.hpp — argument checks and kernel views shared by dispatch_quantized
// (src/api/rows.cpp, on a plan) and quantize (src/api/quant.cpp).
#pragma once

#include "api/alloc.hpp"
#include "api/checks.hpp"
#include "api/scales.hpp"
#include "cpu/quant_cpu.hpp"
#include "cuda/quant_backend.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"

namespace padmoe {
namespace detail {

// The rows to quantize: float32, float16 or bfloat16 (float8 rows are named:
// they are quantized already). Only the dtype; shapes are row_tensor's.
void check_quant_input(const Checker& c, const TensorView& x, const char* name);
// An output dtype of quantized rows: float8 e4m3 or e5m2. Returns true for e5m2.
bool check_fp8_dtype(const Checker& c, DType dtype, const char* name);

cpu::QuantScales cpu_quant_scales(const TensorView& scales, const ScaleSpec& spec, bool e5m2);
cuda::QuantScalesArg cuda_quant_scales(const TensorView& scales, const ScaleSpec& spec, bool e5m2);

// The scale output of `rows` quantized rows of `hidden` columns: [rows] float32
// (per row), [rows, ceil(H/128)] float32, [rows, ceil(H/32)] uint8.
NewTensor quant_scales(ScaleLayout layout, int64_t rows, int64_t hidden);
// The spec of a layout for rows of `hidden` columns (the allocating forms).
ScaleSpec quant_spec(ScaleLayout layout, int64_t hidden);

}  // namespace detail
}  // namespace padmoe
