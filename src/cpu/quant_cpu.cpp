// quant_cpu.cpp — the CPU quantizing spread (dispatch_quantized, quantize):
// workers over contiguous token ranges; each token row is read and quantized
// once into a small buffer (its fp8 codes and scale row), then written to its
// K destination rows. Padding rows are zeroed (scale 1) by the same workers.
// Bitwise equal to the CUDA kernel: both call src/core/quant_math.hpp.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/quant_math.hpp"
#include "cpu/quant_cpu.hpp"
#include "cpu/thread_pool.hpp"
#include "padmoe/index_math.hpp"
#include "padmoe/numeric.hpp"

namespace padmoe {
namespace cpu {
namespace {

// Row elements as float (bit-exact widening of the 16-bit formats).
template <DType D>
void load_row(const char* row, int64_t n, float* out) {
  if (D == DType::kFloat32) {
    if (n > 0) std::memcpy(out, row, static_cast<size_t>(n) * 4);
    return;
  }
  for (int64_t c = 0; c < n; ++c) {
    uint16_t h;
    std::memcpy(&h, row + 2 * c, 2);
    out[c] = D == DType::kBFloat16 ? numeric::bits_float(static_cast<uint32_t>(h) << 16) : numeric::half_to_float(h);
  }
}

void load_element_row(const char* row, DType dtype, int64_t n, float* out) {
  switch (dtype) {
    case DType::kBFloat16: load_row<DType::kBFloat16>(row, n, out); break;
    case DType::kFloat16: load_row<DType::kFloat16>(row, n, out); break;
    default: load_row<DType::kFloat32>(row, n, out); break;
  }
}

// Row `src` of `hidden` columns -> codes[hidden] and scales[cols] (raw entries).
void quantize_row(const char* src, DType dtype, int64_t hidden, const QuantScales& s, float* vals, uint8_t* codes,
                  unsigned char* scale_row) {
  const quant::Fp8Format fmt = quant::fp8_format(s.e5m2);
  load_element_row(src, dtype, hidden, vals);
  const int64_t block = s.layout == ScaleLayout::kMxE8M0 ? 32 : s.layout == ScaleLayout::kBlock128 ? 128 : hidden;
  const int64_t nblocks = s.layout == ScaleLayout::kPerRow ? 1 : s.cols;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t c0 = b * block, c1 = std::min(hidden, c0 + block);
    uint32_t amax = 0;
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, quant::abs_bits(vals[c]));
    const bool bad = quant::non_finite(amax);
    float divisor;
    if (s.layout == ScaleLayout::kMxE8M0) {
      const int x = bad ? 0 : quant::mx_exponent(amax, fmt);
      scale_row[b] = bad ? quant::kE8M0NaN : static_cast<unsigned char>(x + 127);
      divisor = quant::pow2(x);
    } else {
      divisor = quant::block_scale(amax, fmt);
      std::memcpy(scale_row + 4 * b, &divisor, 4);
    }
    if (bad) std::memset(codes + c0, quant::kFp8NaN, static_cast<size_t>(c1 - c0));
    else quant::quantize_elements(vals + c0, divisor, c1 - c0, fmt, codes + c0);
  }
}

}  // namespace

void quantize_spread_rows(const RowsRef& x, int top_k, const int32_t* dest, const RowsRef& y, const QuantScales& s,
                          const int32_t* row_sources, int64_t padded_rows, bool zero_padding, bool zero_past_end,
                          int threads) {
  const int64_t tokens = x.rows, hidden = x.cols;
  const int64_t scale_bytes = s.cols * (s.layout == ScaleLayout::kMxE8M0 ? 1 : 4);
  const int64_t zero_end = zero_past_end && y.rows > padded_rows ? y.rows : padded_rows;
  const int64_t zero_begin = zero_padding ? 0 : padded_rows;
  const int64_t zero_rows = dest == nullptr ? 0 : zero_end - zero_begin;
  const int workers = workers_for(threads, tokens * (top_k + 1) + zero_rows, std::max<int64_t>(hidden, 1));
  std::vector<unsigned char> one_row(static_cast<size_t>(scale_bytes));
  for (int64_t c = 0; c < s.cols; ++c) {
    if (s.layout == ScaleLayout::kMxE8M0) one_row[static_cast<size_t>(c)] = quant::kE8M0One;
    else std::memcpy(one_row.data() + 4 * c, &quant::kFloatOneBits, 4);
  }
  auto* scales = static_cast<unsigned char*>(s.data);
  parallel_run(workers, [&](int wid) {
    std::vector<float> vals(static_cast<size_t>(hidden));
    std::vector<uint8_t> codes(static_cast<size_t>(hidden));
    std::vector<unsigned char> srow(static_cast<size_t>(scale_bytes));
    const index::Range tr = index::work_range(wid, workers, tokens);
    for (int64_t t = tr.begin; t < tr.end; ++t) {
      // rows of no columns may have null data: no pointer arithmetic on it
      quantize_row(hidden > 0 ? x.row(t) : nullptr, x.dtype, hidden, s, vals.data(), codes.data(), srow.data());
      for (int k = 0; k < top_k; ++k) {
        const int64_t r = dest == nullptr ? t : dest[index::assignment_id(t, k, top_k)];
        if (r < 0) continue;
        if (hidden > 0) std::memcpy(y.row(r), codes.data(), static_cast<size_t>(hidden));
        if (scale_bytes > 0) std::memcpy(scales + r * scale_bytes, srow.data(), static_cast<size_t>(scale_bytes));
      }
    }
    const index::Range pr = index::work_range(wid, workers, zero_rows);
    for (int64_t r = zero_begin + pr.begin; r < zero_begin + pr.end; ++r) {
      if (r >= padded_rows || row_sources[r] < 0) {
        if (hidden > 0) std::memset(y.row(r), 0, static_cast<size_t>(hidden));
        if (scale_bytes > 0) std::memcpy(scales + r * scale_bytes, one_row.data(), static_cast<size_t>(scale_bytes));
      }
    }
  });
}

}  // namespace cpu
}  // namespace padmoe
