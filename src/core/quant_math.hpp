// quant_math.hpp — the quantizers of dispatch_quantized (ops.hpp section 4),
// the one place the backends' quantization math is written: the CPU backend
// and the CUDA kernels call these same functions (PADMOE_HD), so both compute
// the same bits. The reference (src/reference) writes the definitions again
// in its own way (docs/design.md, "Fused quantizing dispatch").
//
// Per block of columns (128 for DeepSeek-V3 blockwise, 32 for MXFP8, the whole
// row for per-row scales):
//   amax = max |x| over the block, taken on the float32 bit patterns of |x|
//          (for non-negative floats bit order is value order; NaN and inf
//          sort above every finite value, so a block holding one is seen);
//   a block holding a NaN or an infinity is "non-finite": scale NaN
//          (float32 0x7fc00000, E8M0 byte 0xff) and every element the fp8
//          NaN byte 0x7f;
//   blockwise / per row: scale = amax / fp8_max (float32 division, round to
//          nearest even); scale == 0 (amax == 0, or a float32 amax so small
//          that the quotient underflows) is replaced by 1;
//          q = fp8_sat(x / scale) (float32 division);
//   MXFP8: X = floor(log2(amax)) - emax_elem (exponent bits, exact; 8 for
//          e4m3, 15 for e5m2), clamped to [-127, 127]; amax == 0 gives X = 0;
//          scale byte = X + 127; q = fp8_sat(x / 2^X) (exact: a power of two);
//   fp8_sat: round to nearest, ties to even, |.| >= fp8_max -> +-fp8_max
//          (no overflow to NaN: numeric::float_to_fp8e4m3 is the
//          non-saturating conversion). Signs are kept (-0 -> 0x80).
#pragma once

#include <cstdint>
#include <cstring>

#include "padmoe/config.hpp"

namespace padmoe {
namespace quant {

constexpr uint32_t kFloatInfBits = 0x7f800000u;
constexpr uint32_t kFloatNaNBits = 0x7fc00000u;
constexpr uint32_t kFloatOneBits = 0x3f800000u;
constexpr uint8_t kFp8NaN = 0x7f;    // e4m3fn and e5m2: exponent all ones, mantissa != 0
constexpr uint8_t kE8M0NaN = 0xff;
constexpr uint8_t kE8M0One = 127;

PADMOE_HD uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
PADMOE_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// a / b in float32, round to nearest even (IEEE division; no reciprocal).
PADMOE_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The fp8 formats: e4m3fn (max 448, no infinity) and e5m2 (max 57344).
struct Fp8Format {
  int man_bits;
  int bias;
  uint32_t max_bits;  // float32 bits of the largest finite value
  uint8_t max_code;   // its fp8 code
  int emax;           // OCP emax_elem: exponent of the largest normal
};
PADMOE_HD Fp8Format fp8_format(bool e5m2) {
  return e5m2 ? Fp8Format{2, 15, 0x47600000u, 0x7bu, 15} : Fp8Format{3, 7, 0x43e00000u, 0x7eu, 8};
}

// float32 -> fp8, round to nearest even, saturating to +-max (infinities too);
// NaN -> 0x7f. Branch-free: value = m * 2^(e - 23) (m the 24-bit
// significand); q = m >> shift rounded to nearest even, with the shift of a
// normal target (23 - man_bits) or of its subnormals (larger; past 25 bits
// q is 0, which the formula gives by itself). A normal q carries its
// implicit bit, so code = q + ((e + bias - 1) << man_bits): a rounding carry
// into the next binade lands on the right code by the addition.
PADMOE_HD uint8_t fp8_saturate(float f, const Fp8Format& fmt) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t field = a >> 23;
  const int e = field == 0 ? -126 : static_cast<int>(field) - 127;  // float32 subnormals: 2^-126 scale
  const uint32_t m = (a & 0x7fffffu) | (field == 0 ? 0u : 0x800000u);
  const int min_e = 1 - fmt.bias;  // smallest normal exponent of the fp8 format
  const bool normal = e >= min_e;
  int shift = 23 - fmt.man_bits + (normal ? 0 : min_e - e);
  shift = shift > 31 ? 31 : shift;  // m < 2^24: any shift past 25 gives q = 0
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  q += (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
  const uint32_t code = q + (normal ? static_cast<uint32_t>(e + fmt.bias - 1) << fmt.man_bits : 0u);
  const uint32_t mag = a >= fmt.max_bits ? fmt.max_code : code;  // saturate (infinities too)
  return a > kFloatInfBits ? kFp8NaN : static_cast<uint8_t>(sign | mag);
}

// Bits of |x| (the amax reduction runs on these as unsigned integers).
PADMOE_HD uint32_t abs_bits(float x) { return bits_of(x) & 0x7fffffffu; }
PADMOE_HD bool non_finite(uint32_t amax_bits) { return amax_bits >= kFloatInfBits; }

// Blockwise / per-row scale from amax (as bits): amax / max, 0 -> 1, NaN when non-finite.
PADMOE_HD float block_scale(uint32_t amax_bits, const Fp8Format& fmt) {
  if (non_finite(amax_bits)) return float_of(kFloatNaNBits);
  const float s = div_rn(float_of(amax_bits), float_of(fmt.max_bits));
  return s == 0.0f ? 1.0f : s;
}

// MXFP8 shared exponent X from amax (as bits, finite): floor(log2(amax)) -
// emax, clamped to [-127, 127]; 0 for amax == 0.
PADMOE_HD int mx_exponent(uint32_t amax_bits, const Fp8Format& fmt) {
  if (amax_bits == 0) return 0;
  const uint32_t field = amax_bits >> 23;
  int floor_log2;
  if (field != 0) {
    floor_log2 = static_cast<int>(field) - 127;
  } else {  // float32 subnormal: 2^-149 times the mantissa; its highest set bit
    int h = 22;
    while (((amax_bits >> h) & 1u) == 0u) --h;
    floor_log2 = h - 149;
  }
  int x = floor_log2 - fmt.emax;
  if (x < -127) x = -127;
  if (x > 127) x = 127;
  return x;
}
// 2^X as a float32 (exact; X = -127 is the subnormal 2^-127).
PADMOE_HD float pow2(int x) {
  return x >= -126 ? float_of(static_cast<uint32_t>(x + 127) << 23) : float_of(0x00400000u);
}

// One element: q = fp8_sat(x / divisor), or NaN in a non-finite block.
PADMOE_HD uint8_t quantize_element(float x, float divisor, bool bad, const Fp8Format& fmt) {
  return bad ? kFp8NaN : fp8_saturate(div_rn(x, divisor), fmt);
}

#if !defined(__CUDA_ARCH__)
// Host only: codes[i] = quantize_element(x[i], divisor, false, fmt) for n elements, in a form the
// compiler vectorizes (the CPU backend's element loop; fp8_saturate's per-element shifts and
// selects around a trapping float division are not). Same bits, by another route:
//   a normal target (|q| >= 2^min_e): round |q|'s bits to man_bits mantissa bits, ties to even,
//     by the integer add (a + 2^(s-1) - 1 + bit s of a) >> s, s = 23 - man_bits, then move the
//     exponent from float32's bias to the format's (a carry into the next binade lands right);
//   a subnormal target: |q| + M in float32 with M = 2^(min_e - man_bits + 23), whose ulp is the
//     format's subnormal step, so the add rounds |q| to that step, ties to even (the default
//     rounding mode), and bits(|q| + M) - bits(M) is the code;
//   |q| >= max saturates, NaN gives 0x7f, the sign is kept.
// The float work (the division and the add) runs in a loop with no selects, the integer selects
// in a second one, over chunks of kFp8Batch. QuantDispatch.BatchConversionMatchesTheElementOne
// compares it with fp8_saturate (every mantissa of every binade near the formats' ranges, the
// rest sampled, both signs); the same comparison over all 2^32 patterns passed once by hand.
constexpr int kFp8Batch = 256;
inline void quantize_elements(const float* __restrict x, float divisor, int64_t n, const Fp8Format& fmt,
                              uint8_t* __restrict codes) {
  const int min_e = 1 - fmt.bias;
  const uint32_t min_normal = static_cast<uint32_t>(min_e + 127) << 23;
  const uint32_t magic_bits = static_cast<uint32_t>(min_e - fmt.man_bits + 23 + 127) << 23;
  const float magic = float_of(magic_bits);
  const uint32_t sh = static_cast<uint32_t>(23 - fmt.man_bits), below_half = (1u << (sh - 1)) - 1u;
  const uint32_t rebias = static_cast<uint32_t>(127 - fmt.bias) << fmt.man_bits;
  const uint32_t max_bits = fmt.max_bits, max_code = fmt.max_code;
  uint32_t qb[kFp8Batch], sb[kFp8Batch];
  for (int64_t i0 = 0; i0 < n; i0 += kFp8Batch) {
    const int64_t m = n - i0 < kFp8Batch ? n - i0 : kFp8Batch;
    for (int64_t i = 0; i < m; ++i) {
      const uint32_t q = bits_of(x[i0 + i] / divisor);
      qb[i] = q;
      sb[i] = bits_of(float_of(q & 0x7fffffffu) + magic);
    }
    for (int64_t i = 0; i < m; ++i) {
      const uint32_t q = qb[i], sign = (q >> 24) & 0x80u, a = q & 0x7fffffffu;
      const uint32_t normal = ((a + below_half + ((a >> sh) & 1u)) >> sh) - rebias;
      uint32_t mag = a < min_normal ? sb[i] - magic_bits : normal;
      mag = a >= max_bits ? max_code : mag;
      codes[i0 + i] = static_cast<uint8_t>(a > kFloatInfBits ? kFp8NaN : (sign | mag));
    }
  }
}
#endif

}  // namespace quant
}  // namespace padmoe
