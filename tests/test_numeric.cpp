// test_numeric.cpp — float16 / bfloat16 / float8 conversions (numeric.hpp):
// every bit pattern decodes to the value an independent decoder computes and
// round-trips; float -> small format rounds to nearest, ties to even.
#include <cmath>

#include "test_util.hpp"

namespace pt {
namespace {

// Independent decoder of an IEEE-like small float (with subnormals).
double decode(uint32_t bits, int exp_bits, int man_bits, bool fn_e4m3 = false) {
  const uint32_t sign = (bits >> (exp_bits + man_bits)) & 1u;
  const uint32_t e = (bits >> man_bits) & ((1u << exp_bits) - 1);
  const uint32_t m = bits & ((1u << man_bits) - 1);
  const int bias = (1 << (exp_bits - 1)) - 1;
  double v;
  if (!fn_e4m3 && e == (1u << exp_bits) - 1) v = m ? NAN : INFINITY;
  else if (fn_e4m3 && e == 15 && m == 7) v = NAN;
  else if (e == 0) v = std::ldexp(static_cast<double>(m), 1 - bias - man_bits);
  else v = std::ldexp(static_cast<double>(m + (1u << man_bits)), static_cast<int>(e) - bias - man_bits);
  return sign ? -v : v;
}

TEST(Numeric, Float16AllPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = num::half_to_float(static_cast<uint16_t>(b));
    const double want = decode(b, 5, 10);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << b;
      ASSERT_TRUE(std::isnan(num::half_to_float(num::float_to_half(f))));
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), want) << "pattern " << b;
    ASSERT_EQ(num::float_to_half(f), b) << "round trip of pattern " << b;
  }
}

TEST(Numeric, BFloat16AllPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = num::bf16_to_float(static_cast<uint16_t>(b));
    const double want = decode(b, 8, 7);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f));
      ASSERT_TRUE(std::isnan(num::bf16_to_float(num::float_to_bf16(f))));
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), want) << "pattern " << b;
    ASSERT_EQ(num::float_to_bf16(f), b) << "round trip of pattern " << b;
  }
}

TEST(Numeric, Float8AllPatterns) {
  for (uint32_t b = 0; b < 256; ++b) {
    const float f4 = num::fp8e4m3_to_float(static_cast<uint8_t>(b));
    const double w4 = decode(b, 4, 3, true);
    if (std::isnan(w4)) {
      EXPECT_TRUE(std::isnan(f4)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(f4), w4) << "e4m3 pattern " << b;
      EXPECT_EQ(num::float_to_fp8e4m3(f4), b) << "e4m3 round trip " << b;
    }
    const float f5 = num::fp8e5m2_to_float(static_cast<uint8_t>(b));
    const double w5 = decode(b, 5, 2);
    if (std::isnan(w5)) {
      EXPECT_TRUE(std::isnan(f5)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(f5), w5) << "e5m2 pattern " << b;
      EXPECT_EQ(num::float_to_fp8e5m2(f5), b) << "e5m2 round trip " << b;
    }
  }
  EXPECT_EQ(num::fp8e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(num::fp8e5m2_to_float(0x7b), 57344.0f);
}

TEST(Numeric, RoundToNearestEvenSpotChecks) {
  const float one = 1.0f;
  // float16: ulp at 1 is 2^-10
  EXPECT_EQ(num::float_to_half(one + std::ldexp(1.0f, -11)), 0x3C00);      // tie -> even (down)
  EXPECT_EQ(num::float_to_half(one + 3 * std::ldexp(1.0f, -11)), 0x3C02);  // tie -> even (up)
  EXPECT_EQ(num::float_to_half(one + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3C01);
  EXPECT_EQ(num::float_to_half(65504.0f), 0x7BFF);
  EXPECT_EQ(num::float_to_half(65519.0f), 0x7BFF);
  EXPECT_EQ(num::float_to_half(65520.0f), 0x7C00);  // rounds to infinity
  EXPECT_EQ(num::float_to_half(-INFINITY), 0xFC00);
  EXPECT_EQ(num::float_to_half(std::ldexp(1.0f, -24)), 0x0001);      // smallest subnormal
  EXPECT_EQ(num::float_to_half(std::ldexp(1.0f, -25)), 0x0000);      // tie -> even (zero)
  EXPECT_EQ(num::float_to_half(3 * std::ldexp(1.0f, -25)), 0x0002);  // tie -> even
  EXPECT_EQ(num::float_to_half(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(num::half_to_float(num::float_to_half(NAN))));
  // bfloat16: ulp at 1 is 2^-7
  EXPECT_EQ(num::float_to_bf16(one + std::ldexp(1.0f, -8)), 0x3F80);
  EXPECT_EQ(num::float_to_bf16(one + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_EQ(num::float_to_bf16(one + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3F81);
  EXPECT_EQ(num::float_to_bf16(3.4e38f), 0x7F80);  // overflow -> inf
  EXPECT_TRUE(std::isnan(num::bf16_to_float(num::float_to_bf16(NAN))));
  // e4m3: 448 max, 464 ties to 448 (even), beyond -> NaN
  EXPECT_EQ(num::float_to_fp8e4m3(448.0f), 0x7E);
  EXPECT_EQ(num::float_to_fp8e4m3(464.0f), 0x7E);
  EXPECT_TRUE(std::isnan(num::fp8e4m3_to_float(num::float_to_fp8e4m3(500.0f))));
  EXPECT_EQ(num::float_to_fp8e4m3(1.0625f), 0x38);  // 1 + 2^-4 ties to 1.0 (even)
  EXPECT_EQ(num::float_to_fp8e4m3(1.1875f), 0x3A);  // 1 + 3*2^-4 ties up to 1.25
  // e5m2 overflow -> inf
  EXPECT_EQ(num::float_to_fp8e5m2(1e6f), 0x7C);
  EXPECT_EQ(num::float_to_fp8e5m2(57344.0f), 0x7B);
}

// For random floats, the encoder picks the nearest representable value, ties to even.
template <class Enc, class Dec>
void check_nearest(Enc enc, Dec dec, uint32_t max_finite_bits, double max_finite, int n, uint64_t seed) {
  Rng rng(seed);
  for (int i = 0; i < n; ++i) {
    // magnitudes spread over the format's range (including subnormals)
    const double mag = std::ldexp(rng.uniform(0.5, 1.0), static_cast<int>(rng.below(60)) - 40);
    const float f = static_cast<float>(rng.below(2) ? mag : -mag);
    if (std::fabs(f) > max_finite) continue;
    const uint32_t b = enc(f);
    const uint32_t mag_bits = b & (max_finite_bits | (max_finite_bits >> 1));
    const double got = dec(b);
    ASSERT_FALSE(std::isnan(got)) << f;
    const double err = std::fabs(got - f);
    // neighbours (same sign): mag_bits +- 1
    for (int d : {-1, 1}) {
      const int64_t nb = static_cast<int64_t>(mag_bits) + d;
      if (nb < 0 || nb > static_cast<int64_t>(max_finite_bits)) continue;
      const uint32_t nbits = (b & ~(max_finite_bits | (max_finite_bits >> 1))) | static_cast<uint32_t>(nb);
      const double other = std::fabs(dec(nbits) - f);
      ASSERT_LE(err, other) << "value " << f << " encoded " << b;
      if (err == other) ASSERT_EQ(mag_bits & 1u, 0u) << "tie not to even for " << f;
    }
  }
}

TEST(Numeric, EncodersRoundToNearestEven) {
  check_nearest([](float f) { return static_cast<uint32_t>(num::float_to_half(f)); },
                [](uint32_t b) { return decode(b, 5, 10); }, 0x7BFF, 65504.0, 200000, 1);
  check_nearest([](float f) { return static_cast<uint32_t>(num::float_to_bf16(f)); },
                [](uint32_t b) { return decode(b, 8, 7); }, 0x7F7F, 3.3e38, 200000, 2);
  check_nearest([](float f) { return static_cast<uint32_t>(num::float_to_fp8e4m3(f)); },
                [](uint32_t b) { return decode(b, 4, 3, true); }, 0x7E, 448.0, 100000, 3);
  check_nearest([](float f) { return static_cast<uint32_t>(num::float_to_fp8e5m2(f)); },
                [](uint32_t b) { return decode(b, 5, 2); }, 0x7B, 57344.0, 100000, 4);
}

TEST(Numeric, LoadStoreAndDtypeInfo) {
  EXPECT_EQ(padmoe::element_size(DType::kFloat32), 4u);
  EXPECT_EQ(padmoe::element_size(DType::kBFloat16), 2u);
  EXPECT_EQ(padmoe::element_size(DType::kFloat16), 2u);
  EXPECT_EQ(padmoe::element_size(DType::kFloat8E4M3), 1u);
  EXPECT_EQ(padmoe::element_size(DType::kInt64), 8u);
  EXPECT_STREQ(padmoe::dtype_name(DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(padmoe::dtype_name(DType::kFloat32), "float32");
  EXPECT_TRUE(padmoe::is_float8(DType::kFloat8E5M2));
  EXPECT_FALSE(padmoe::is_float8(DType::kFloat16));
  EXPECT_TRUE(padmoe::is_index(DType::kInt32));
  EXPECT_FALSE(padmoe::is_floating(DType::kInt64));
  for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    uint64_t buf[2] = {0, 0};
    num::store_from_float(buf, d, 1, 1.5f);
    EXPECT_EQ(num::load_as_float(buf, d, 1), 1.5f) << dname(d);
    EXPECT_EQ(num::round_to(d, 1.5f), 1.5f);
  }
  EXPECT_EQ(num::round_to(DType::kBFloat16, 1.00390625f), 1.0f);
}

}  // namespace
}  // namespace pt
