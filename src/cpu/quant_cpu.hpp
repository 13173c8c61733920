// quant_cpu.hpp — the CPU kernel of dispatch_quantized / quantize (ops.hpp
// section 4): raw pointers and sizes, every argument checked by the API layer.
#pragma once

#include <cstdint>

#include "cpu/cpu_backend.hpp"
#include "padmoe/ops.hpp"

namespace padmoe {
namespace cpu {

// The quantized output's scales: contiguous, `cols` entries a row (float32,
// or E8M0 bytes for kMxE8M0), and the fp8 format of the rows.
struct QuantScales {
  void* data = nullptr;
  ScaleLayout layout = ScaleLayout::kBlock128;
  int64_t cols = 0;
  bool e5m2 = false;
};

// Token-driven quantizing spread: each row x[t] (float32/16/bf16) is
// quantized once (src/core/quant_math.hpp) and its fp8 codes and scale row
// written to y[dest[t*K+k]] for every k with dest >= 0; rows r < padded_rows
// with row_sources[r] < 0 get zero codes and scale 1 (unless !zero_padding),
// rows in [padded_rows, y.rows) too when zero_past_end. dest == nullptr: the
// identity (quantize: top_k 1, row t -> row t, no padding rows).
void quantize_spread_rows(const RowsRef& x, int top_k, const int32_t* dest, const RowsRef& y, const QuantScales& s,
                          const int32_t* row_sources, int64_t padded_rows, bool zero_padding, bool zero_past_end,
                          int threads);

}  // namespace cpu
}  // namespace padmoe
