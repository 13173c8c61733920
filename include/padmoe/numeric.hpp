// padmoe/numeric.hpp — host conversions between float32 and the 16- and
// 8-bit row formats, bit-exact and table-free.
//
// float -> 16/8-bit rounds to nearest, ties to even; NaN stays NaN;
// overflow gives infinity (float16, bfloat16, e5m2) or NaN (e4m3, which has
// no infinity). Every float16, bfloat16 and float8 value is exact in float.
#pragma once

#include <cstdint>
#include <cstring>

#include "padmoe/tensor.hpp"

namespace padmoe {
namespace numeric {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: normalise
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    man &= 0x3ffu;
    return bits_float(sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (man << 13));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// Generic round-to-nearest-even of a float into a small float format with
// `exp_bits` exponent bits and `man_bits` mantissa bits (IEEE-like, with
// subnormals). Returns the magnitude bits (no sign) and whether it overflowed.
inline uint32_t round_small_float(float f, int exp_bits, int man_bits, bool* overflow) {
  const uint32_t u = float_bits(f) & 0x7fffffffu;
  const int bias = (1 << (exp_bits - 1)) - 1;
  const int e = static_cast<int>(u >> 23) - 127;  // unbiased exponent of f
  *overflow = false;
  if (u == 0) return 0;
  uint64_t mant = (u & 0x7fffffu) | (e > -127 ? 0x800000u : 0u);  // 24-bit significand
  int shift;                                                     // bits to drop from mant
  int out_exp;
  if (e + bias >= 1) {  // normal in the target
    shift = 23 - man_bits;
    out_exp = e + bias;
  } else {  // subnormal in the target
    shift = 23 - man_bits + (1 - (e + bias));
    out_exp = 0;
  }
  if (shift > 25) return 0;  // far below half the smallest subnormal
  const uint64_t half = uint64_t{1} << (shift - 1);
  uint64_t q = mant >> shift;
  const uint64_t rem = mant & ((uint64_t{1} << shift) - 1);
  if (rem > half || (rem == half && (q & 1))) ++q;
  // q holds the significand (with the implicit bit when normal); rebuild.
  uint32_t bits;
  if (out_exp == 0) {
    bits = static_cast<uint32_t>(q);  // may carry into the smallest normal: still correct encoding
  } else {
    if (q >> (man_bits + 1)) {
      q >>= 1;
      ++out_exp;
    }
    bits = (static_cast<uint32_t>(out_exp) << man_bits) | (static_cast<uint32_t>(q) & ((1u << man_bits) - 1));
  }
  if ((bits >> man_bits) >= static_cast<uint32_t>((1 << exp_bits) - 1)) *overflow = true;
  return bits;
}

inline uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if ((u & 0x7fffffffu) == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);
  bool overflow;
  const uint32_t mag = round_small_float(f, 5, 10, &overflow);
  return static_cast<uint16_t>(sign | (overflow ? 0x7c00u : mag));
}

// float8 e4m3 (fn: no infinity, max 448, NaN = 0x7f) and e5m2 (IEEE-like).
inline float fp8e4m3_to_float(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exp = (v >> 3) & 0xfu, man = v & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_float(sign | 0x7fc00000u);
  float mag;
  if (exp == 0) mag = static_cast<float>(man) * (1.0f / 512.0f);  // man * 2^-9
  else mag = bits_float(((exp + 120u) << 23) | (man << 20));
  return bits_float(float_bits(mag) | sign);
}
inline uint8_t float_to_fp8e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if ((u & 0x7fffffffu) >= 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  bool overflow;
  const uint32_t mag = round_small_float(f, 4, 3, &overflow);
  // e4m3fn uses exponent 15 for finite values except mantissa 7 (NaN).
  if (mag > 0x7eu) return static_cast<uint8_t>(sign | 0x7fu);
  return static_cast<uint8_t>(sign | mag);
}
inline float fp8e5m2_to_float(uint8_t v) { return half_to_float(static_cast<uint16_t>(v) << 8); }
inline uint8_t float_to_fp8e5m2(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7eu);
  if ((u & 0x7fffffffu) == 0x7f800000u) return static_cast<uint8_t>(sign | 0x7cu);
  bool overflow;
  const uint32_t mag = round_small_float(f, 5, 2, &overflow);
  return static_cast<uint8_t>(sign | (overflow ? 0x7cu : mag));
}

// Element i of a row buffer of `dtype` as float, and the reverse.
inline float load_as_float(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(data)[i];
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kFloat8E4M3: return fp8e4m3_to_float(static_cast<const uint8_t*>(data)[i]);
    case DType::kFloat8E5M2: return fp8e5m2_to_float(static_cast<const uint8_t*>(data)[i]);
    case DType::kInt32: return static_cast<float>(static_cast<const int32_t*>(data)[i]);
    case DType::kInt64: return static_cast<float>(static_cast<const int64_t*>(data)[i]);
    case DType::kUInt8: return static_cast<float>(static_cast<const uint8_t*>(data)[i]);
  }
  return 0.0f;
}
inline void store_from_float(void* data, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(data)[i] = v; break;
    case DType::kFloat16: static_cast<uint16_t*>(data)[i] = float_to_half(v); break;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[i] = float_to_bf16(v); break;
    case DType::kFloat8E4M3: static_cast<uint8_t*>(data)[i] = float_to_fp8e4m3(v); break;
    case DType::kFloat8E5M2: static_cast<uint8_t*>(data)[i] = float_to_fp8e5m2(v); break;
    case DType::kInt32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v); break;
    case DType::kInt64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v); break;
    case DType::kUInt8: static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(v); break;
  }
}
// Round a float to the nearest value representable in dtype.
inline float round_to(DType dtype, float v) {
  uint64_t tmp = 0;
  store_from_float(&tmp, dtype, 0, v);
  return load_as_float(&tmp, dtype, 0);
}

}  // namespace numeric
}  // namespace padmoe
