// quant_backend.hpp — the CUDA launcher of dispatch_quantized / quantize
// (src/cuda/quant.cu; a throwing stub in builds without CUDA,
// src/cuda/no_cuda_quant.cpp). No CUDA header: the API layer includes it.
#pragma once

#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "padmoe/ops.hpp"

namespace padmoe {
namespace cuda {

// The quantized output's scales (contiguous, `cols` entries a row: float32,
// or E8M0 bytes for kMxE8M0) and the fp8 format of the rows.
struct QuantScalesArg {
  void* data = nullptr;
  ScaleLayout layout = ScaleLayout::kBlock128;
  int64_t cols = 0;
  bool e5m2 = false;
};

// One block per token: x[t] (float32/16/bf16) is read and quantized once
// (src/core/quant_math.hpp; the amax of a 32- or 128-column block by a warp
// shuffle reduction, of a whole row (per-row scales) by a block reduction)
// and its codes and scale row are stored to y[dest[t*K+k]] for every k with
// dest >= 0. Extra blocks zero the padding rows below P (zero_padding) and
// the rows at or past P (zero_past_end), scale 1. dest == nullptr: the
// identity (quantize: top_k 1, no padding rows). No host synchronization.
void quantize_spread_rows(const RowsArg& x, int top_k, const int32_t* dest, const RowsArg& y,
                          const QuantScalesArg& scales, const PaddingRef& padding, bool zero_padding,
                          bool zero_past_end, void* stream);
// Tests: the float32 bit patterns (NaNs left out) whose fp8 code from the hardware conversion
// differs from quant::fp8_saturate's (e4m3fn, or e5m2), with the smallest in *first_bits
// (0xffffffff when none), and in *compared the patterns compared. Synchronizes the device.
int64_t fp8_convert_mismatches(bool e5m2, uint32_t* first_bits, int64_t* compared);

}  // namespace cuda
}  // namespace padmoe
