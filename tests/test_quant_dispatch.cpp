// test_quant_dispatch.cpp — the fused quantizing dispatch (ops.hpp section 4):
// dispatch_quantized / quantize, bfloat16 / float16 / float32 rows in, float8 e4m3 / e5m2 rows plus
// DeepSeek-V3 1x128 blockwise, MXFP8 E8M0 or per-row scales out. Against the reference quantizer
// (src/reference, written from the OCP MX v1.0 and DeepSeek-V3 definitions with its own rounding)
// byte for byte; against quantize() followed by dispatch_scaled (the two-pass way); hand-computed
// values (all-zero blocks, ties, saturation, NaN / inf blocks); padding rows, zero_padding = false,
// zero_tail, capacity > P, empty experts, T = 0, H = 0; thread counts; bad inputs (a named error,
// nothing written).
#include "core/quant_math.hpp"
#include "test_util.hpp"

namespace pt {
namespace {

using padmoe::ScaleLayout;
using QL = ref::QuantLayout;

QL ref_layout(ScaleLayout l) {
  switch (l) {
    case ScaleLayout::kPerRow: return QL::kPerRow;
    case ScaleLayout::kBlock128: return QL::kBlock128;
    case ScaleLayout::kMxE8M0: return QL::kMxE8M0;
  }
  return QL::kPerRow;
}
const char* lname(ScaleLayout l) {
  switch (l) {
    case ScaleLayout::kPerRow: return "per-row";
    case ScaleLayout::kBlock128: return "block128";
    case ScaleLayout::kMxE8M0: return "mxfp8";
  }
  return "?";
}
const ScaleLayout kLayouts[] = {ScaleLayout::kBlock128, ScaleLayout::kMxE8M0, ScaleLayout::kPerRow};
const DType kInputs[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
const DType kOutputs[] = {DType::kFloat8E4M3, DType::kFloat8E5M2};

bool is_e5m2(DType d) { return d == DType::kFloat8E5M2; }
int64_t scols(ScaleLayout l, int64_t H) { return padmoe::scale_columns(l, H); }
int64_t srow_bytes(ScaleLayout l, int64_t H) { return scols(l, H) * (l == ScaleLayout::kMxE8M0 ? 1 : 4); }

// An uninitialized (poisoned) scale tensor of `rows` rows.
Tensor poison_scales(ScaleLayout l, int64_t rows, int64_t H) {
  if (l == ScaleLayout::kPerRow) return filled(DType::kFloat32, {rows}, kPoison);
  return filled(l == ScaleLayout::kMxE8M0 ? DType::kUInt8 : DType::kFloat32, {rows, scols(l, H)}, kPoison);
}

std::vector<uint8_t> bytes_of(const TensorView& t) {
  const size_t n = static_cast<size_t>(t.numel()) * esize(t.dtype);
  const auto* p = static_cast<const uint8_t*>(t.data);
  return n == 0 ? std::vector<uint8_t>{} : std::vector<uint8_t>(p, p + n);
}

// Bytes [b0, b1) of `got` equal want[b0, b1).
::testing::AssertionResult same_range(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, size_t b0,
                                      size_t b1, int64_t row_bytes, const char* what) {
  for (size_t i = b0; i < b1; ++i) {
    if (got[i] != want[i]) {
      return ::testing::AssertionFailure()
             << what << " byte " << i << " (row " << (row_bytes ? int64_t(i) / row_bytes : 0) << ", col "
             << (row_bytes ? int64_t(i) % row_bytes : 0) << ") is 0x" << std::hex << int(got[i]) << ", want 0x"
             << int(want[i]);
    }
  }
  return ::testing::AssertionSuccess();
}
::testing::AssertionResult all_range(const std::vector<uint8_t>& got, size_t b0, size_t b1, uint8_t v,
                                     const char* what) {
  for (size_t i = b0; i < b1; ++i)
    if (got[i] != v)
      return ::testing::AssertionFailure() << what << " byte " << i << " is 0x" << std::hex << int(got[i]);
  return ::testing::AssertionSuccess();
}

// Token rows with every kind of block: random, all zero, tiny, huge, exact ties of the output
// format at scale 1, near-saturating (amax mantissa close to 2), negative zeros; NaN / inf
// blocks when `specials`. Values are exact in `dt`.
std::vector<float> make_values(int64_t T, int64_t H, DType dt, DType out, bool specials, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(T * H));
  const bool e5m2 = is_e5m2(out);
  const float fp8_max = e5m2 ? 57344.0f : 448.0f;
  const float tiny = dt == DType::kFloat16 ? 3e-6f : 1e-38f;  // f16: around its subnormals; bf16/f32: float32's
  const float huge = dt == DType::kFloat16 ? 30000.0f : 1e37f;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c0 = 0; c0 < H; c0 += 32) {  // a kind per 32 columns (MXFP8 block; 4 per 128-block)
      const int64_t kinds = specials ? 9 : 7;
      const int64_t kind = (t * 7 + c0 / 32 * 3 + static_cast<int64_t>(seed)) % kinds;
      for (int64_t c = c0; c < std::min(H, c0 + 32); ++c) {
        float x = 0.0f;
        switch (kind) {
          case 0:
          case 1: x = static_cast<float>(rng.uniform(-3.0, 3.0)); break;
          case 2:
            x = 0.0f;
            if (rng.below(3) == 0) x = -0.0f;
            break;  // an all-zero block (some -0)
          case 3: x = tiny * static_cast<float>(rng.uniform(-4.0, 4.0)); break;
          case 4: x = huge * static_cast<float>(rng.uniform(-1.0, 1.0)); break;
          case 5: {  // ties: midpoints of consecutive codes of the output format, with fp8_max in the block
            if (c == c0) {
              x = rng.below(2) ? fp8_max : -fp8_max;
            } else {
              const int code = static_cast<int>(rng.below(e5m2 ? 0x7b : 0x7e));
              const float mid = 0.5f * (ref::fp8_value(static_cast<uint8_t>(code), e5m2) +
                                        ref::fp8_value(static_cast<uint8_t>(code + 1), e5m2));
              x = rng.below(2) ? mid : -mid;
            }
            break;
          }
          case 6: {  // amax mantissa near 2: x / 2^X lands in [fp8_max, 2^(emax+1)): saturates
            x = (c == c0 ? 1.96875f : static_cast<float>(rng.uniform(-1.9, 1.9))) * 1024.0f;
            break;
          }
          case 7: x = (c == c0 + 5) ? NAN : static_cast<float>(rng.uniform(-2.0, 2.0)); break;
          case 8: x = (c == c0 + 3) ? -INFINITY : static_cast<float>(rng.uniform(-2.0, 2.0)); break;
        }
        v[static_cast<size_t>(t * H + c)] = num::round_to(dt, x);
      }
    }
  }
  return v;
}

struct Case {
  int64_t T = 0, H = 0;
  int K = 2, E = 5, m = 8;
  DType dt = DType::kBFloat16, out = DType::kFloat8E4M3;
  ScaleLayout layout = ScaleLayout::kBlock128;
  ref::Plan p;
  std::vector<float> xf;
  Tensor x, top;
  padmoe::Plan plan;
};

Case make_case(DType dt, DType out, ScaleLayout l, int64_t T, int64_t H, int K, int E, int m, Dist dist, uint64_t seed,
               bool specials = true) {
  Case c;
  c.T = T, c.H = H, c.K = K, c.E = E, c.m = m, c.dt = dt, c.out = out, c.layout = l;
  const std::vector<int64_t> te = make_routing(T, K, E, dist, seed);
  c.p = ref::make_plan(te, T, K, E, m);
  c.xf = make_values(T, H, dt, out, specials, seed + 5);
  c.x = rows_from_float(c.xf, dt, T, H);
  c.top = index_matrix(te, T, K, DType::kInt32);
  c.plan = padmoe::make_plan(c.top, E, m);
  return c;
}

// A dispatch_quantized output of rows >= P: [0, P) the reference (padding rows zero / scale 1, or
// poison when !zero_padding); [P, rows) poison, or zero / scale 1 with zero_tail.
void expect_quantized(const Case& c, const TensorView& y, const TensorView& ys, bool zero_padding, bool zero_tail) {
  const ref::QuantRows want = ref::dispatch_quantized(c.xf, c.H, c.p, ref_layout(c.layout), is_e5m2(c.out));
  const int64_t P = c.p.padded_rows, rows = y.shape[0], H = c.H, rb = want.row_bytes;
  ASSERT_EQ(rb, srow_bytes(c.layout, H));
  const std::vector<uint8_t> got = bytes_of(y), gots = bytes_of(ys);
  ASSERT_EQ(static_cast<int64_t>(got.size()), rows * H);
  ASSERT_EQ(static_cast<int64_t>(gots.size()), rows * rb);
  for (int64_t r = 0; r < P; ++r) {
    const bool real = c.p.row_sources[static_cast<size_t>(r)] >= 0;
    const size_t d0 = static_cast<size_t>(r * H), d1 = static_cast<size_t>((r + 1) * H);
    const size_t s0 = static_cast<size_t>(r * rb), s1 = static_cast<size_t>((r + 1) * rb);
    if (real || zero_padding) {
      ASSERT_TRUE(same_range(got, want.rows, d0, d1, H, real ? "codes" : "padding codes")) << "row " << r;
      ASSERT_TRUE(same_range(gots, want.scales, s0, s1, rb, real ? "scales" : "padding scales")) << "row " << r;
    } else {
      ASSERT_TRUE(all_range(got, d0, d1, kPoison, "unwritten padding row")) << "row " << r;
      ASSERT_TRUE(all_range(gots, s0, s1, kPoison, "unwritten padding scales")) << "row " << r;
    }
  }
  const std::vector<uint8_t> one = ref::scale_one_row(c.layout == ScaleLayout::kMxE8M0, scols(c.layout, H));
  for (int64_t r = P; r < rows; ++r) {
    const size_t d0 = static_cast<size_t>(r * H), d1 = static_cast<size_t>((r + 1) * H);
    if (zero_tail) {
      ASSERT_TRUE(all_range(got, d0, d1, 0, "row past P (zero_tail)")) << "row " << r;
      for (int64_t b = 0; b < rb; ++b) ASSERT_EQ(gots[static_cast<size_t>(r * rb + b)], one[static_cast<size_t>(b)]);
    } else {
      ASSERT_TRUE(all_range(got, d0, d1, kPoison, "row past P")) << "row " << r;
      ASSERT_TRUE(
          all_range(gots, static_cast<size_t>(r * rb), static_cast<size_t>((r + 1) * rb), kPoison, "scales past P"))
          << "row " << r;
    }
  }
}

// --- the conversion itself -------------------------------------------------------------

TEST(QuantDispatch, SaturatingConversionMatchesTheReferenceOnEveryBf16AndRandomFloats) {
  for (bool e5m2 : {false, true}) {
    SCOPED_TRACE(e5m2 ? "e5m2" : "e4m3");
    const padmoe::quant::Fp8Format fmt = padmoe::quant::fp8_format(e5m2);
    const float fp8_max = e5m2 ? 57344.0f : 448.0f;
    auto check = [&](float f) {
      const uint8_t got = padmoe::quant::fp8_saturate(f, fmt), want = ref::fp8_saturate(f, e5m2);
      if (got != want) {
        ADD_FAILURE() << "value " << f << " (bits 0x" << std::hex << num::float_bits(f) << "): 0x" << int(got)
                      << ", reference 0x" << int(want);
        return false;
      }
      // A third conversion: numeric's non-saturating one agrees wherever nothing saturates.
      if (!std::isnan(f) && std::fabs(f) < fp8_max) {
        const uint8_t plain = e5m2 ? num::float_to_fp8e5m2(f) : num::float_to_fp8e4m3(f);
        if (plain != got) {
          ADD_FAILURE() << "value " << f << ": 0x" << std::hex << int(got) << ", numeric 0x" << int(plain);
          return false;
        }
      }
      return true;
    };
    for (uint32_t h = 0; h < 65536; ++h)
      if (!check(num::bf16_to_float(static_cast<uint16_t>(h)))) return;
    Rng rng(77);
    for (int i = 0; i < 200000; ++i)
      if (!check(num::bits_float(static_cast<uint32_t>(rng.next())))) return;
    // saturation and the edges
    EXPECT_EQ(padmoe::quant::fp8_saturate(1e30f, fmt), e5m2 ? 0x7b : 0x7e);
    EXPECT_EQ(padmoe::quant::fp8_saturate(-INFINITY, fmt), e5m2 ? 0xfb : 0xfe);
    EXPECT_EQ(padmoe::quant::fp8_saturate(NAN, fmt), 0x7f);
    EXPECT_EQ(padmoe::quant::fp8_saturate(-0.0f, fmt), 0x80);
  }
  // e4m3 ties to even, by hand: 1.0625 between 1.0 (0x38) and 1.125 (0x39) -> 0x38; 1.1875 -> 1.25 (0x3a);
  // 464 (between 448 and the NaN slot 480) saturates to 448; 2^-10 (half the smallest subnormal) -> 0.
  const padmoe::quant::Fp8Format e4 = padmoe::quant::fp8_format(false);
  EXPECT_EQ(padmoe::quant::fp8_saturate(1.0625f, e4), 0x38);
  EXPECT_EQ(padmoe::quant::fp8_saturate(1.1875f, e4), 0x3a);
  EXPECT_EQ(padmoe::quant::fp8_saturate(464.0f, e4), 0x7e);
  EXPECT_EQ(padmoe::quant::fp8_saturate(std::ldexp(1.0f, -10), e4), 0x00);
  EXPECT_EQ(padmoe::quant::fp8_saturate(std::ldexp(3.0f, -10), e4), 0x02);  // 1.5 * 2^-9: tie -> 2 * 2^-9
}

// The CPU backend's vectorized element loop (quant::quantize_elements: integer rounding for normal
// targets, a float add for subnormal ones) against fp8_saturate(x / divisor): every rounding cut
// of every binade (each cut position, the kept bits around it, the remainder at 0, 1, half - 1,
// half, half + 1 and all ones), both signs, NaN and infinity, random floats, and divisors that
// are not 1 (blockwise scales and MXFP8 powers of two).
TEST(QuantDispatch, BatchConversionMatchesTheElementOne) {
  for (bool e5m2 : {false, true}) {
    SCOPED_TRACE(e5m2 ? "e5m2" : "e4m3");
    const padmoe::quant::Fp8Format fmt = padmoe::quant::fp8_format(e5m2);
    std::vector<float> xs;
    for (uint32_t field = 0; field < 256; ++field) {
      for (uint32_t cut = 1; cut <= 24; ++cut) {
        const uint32_t half = 1u << (cut - 1), low = (cut >= 23 ? 0x800000u : (1u << cut)) - 1u;
        for (uint32_t hi = 0; hi < 8; ++hi) {
          for (uint32_t lo : {0u, 1u, half - 1u, half, half + 1u, low}) {
            const uint32_t mant = ((cut >= 23 ? 0u : hi << cut) | (lo & low)) & 0x7fffffu;
            for (uint32_t sign : {0u, 0x80000000u}) xs.push_back(num::bits_float(sign | field << 23 | mant));
          }
        }
      }
    }
    Rng rng(91);
    for (int i = 0; i < 200000; ++i) xs.push_back(num::bits_float(static_cast<uint32_t>(rng.next())));
    for (int i = 0; i < 200000; ++i) xs.push_back(static_cast<float>(rng.uniform(-600.0, 600.0)));
    xs.push_back(INFINITY);
    xs.push_back(-INFINITY);
    xs.push_back(NAN);
    for (float divisor : {1.0f, 0.5f, 3.0f, 0.0078125f, 1.3e-7f, 2.2e5f, std::ldexp(1.0f, -127)}) {
      SCOPED_TRACE(divisor);
      // odd lengths and offsets: the batch's chunk edges and a tail
      const int64_t n = static_cast<int64_t>(xs.size()) - 3;
      std::vector<uint8_t> got(static_cast<size_t>(n));
      padmoe::quant::quantize_elements(xs.data() + 3, divisor, n, fmt, got.data());
      for (int64_t i = 0; i < n; ++i) {
        const float x = xs[static_cast<size_t>(i + 3)];
        const uint8_t want = padmoe::quant::quantize_element(x, divisor, false, fmt);
        if (got[static_cast<size_t>(i)] != want) {
          FAIL() << "x bits 0x" << std::hex << num::float_bits(x) << ": 0x" << int(got[static_cast<size_t>(i)])
                 << ", element form 0x" << int(want);
        }
      }
    }
  }
}

// --- values by hand -----------------------------------------------------------------------

TEST(QuantDispatch, HandComputedBlocks) {
  // One token, K = 1, one expert, alignment 1: y row 0 is the token.
  const int64_t H = 160;  // block128: a full block and a 32-column tail; MXFP8: 5 blocks
  std::vector<float> x(static_cast<size_t>(H), 0.0f);
  x[0] = 448.0f, x[1] = 1.0625f, x[2] = -1.1875f, x[3] = 3.0f / 1024.0f;  // block 0: amax 448
  for (int64_t c = 32; c < 64; ++c) x[static_cast<size_t>(c)] = 0.0f;     // MX block 1 all zero
  x[64] = 7.0f;                                                           // MX block 2: amax 7
  x[65] = -3.5f;
  x[128] = NAN;  // block128 tail / MX block 4 non-finite
  x[129] = 2.0f;
  const Tensor xt = rows_from_float(x, DType::kBFloat16, 1, H);
  const Tensor top = index_matrix({0}, 1, 1, DType::kInt32);
  const padmoe::Plan plan = padmoe::make_plan(top, 1, 1);

  const padmoe::ScaledRows b = padmoe::dispatch_quantized(xt, plan.view(), ScaleLayout::kBlock128);
  ASSERT_EQ(b.scales.size(1), 2);
  const float* bs = b.scales.data_as<float>();
  EXPECT_EQ(bs[0], 1.0f);  // 448 / 448
  EXPECT_EQ(num::float_bits(bs[1]), 0x7fc00000u);  // NaN block
  const uint8_t* bq = b.rows.data_as<uint8_t>();
  EXPECT_EQ(bq[0], 0x7e);  // 448
  EXPECT_EQ(bq[1], 0x38);  // 1.0625 -> 1.0 (tie to even)
  EXPECT_EQ(bq[2], 0xba);  // -1.1875 -> -1.25
  EXPECT_EQ(bq[3], 0x02);  // 1.5 * 2^-9 -> 2 * 2^-9 (subnormal tie to even)
  EXPECT_EQ(bq[64], 0x4e); // 7.0 = 1.75 * 2^2
  EXPECT_EQ(bq[40], 0x00);
  EXPECT_EQ(bq[128], 0x7f);
  EXPECT_EQ(bq[129], 0x7f);  // the whole non-finite block is NaN

  const padmoe::ScaledRows m = padmoe::dispatch_quantized(xt, plan.view(), ScaleLayout::kMxE8M0);
  ASSERT_EQ(m.scales.size(1), 5);
  const uint8_t* ms = m.scales.data_as<uint8_t>();
  EXPECT_EQ(ms[0], 127);         // floor(log2 448) = 8, X = 8 - 8 = 0
  EXPECT_EQ(ms[1], 127);         // all zero: X = 0
  EXPECT_EQ(ms[2], 127 + 2 - 8);  // floor(log2 7) = 2, X = -6
  EXPECT_EQ(ms[3], 127);
  EXPECT_EQ(ms[4], 0xff);        // NaN
  const uint8_t* mq = m.rows.data_as<uint8_t>();
  EXPECT_EQ(mq[0], 0x7e);
  EXPECT_EQ(mq[1], 0x38);
  EXPECT_EQ(mq[64], 0x7e);  // 7 * 2^6 = 448
  EXPECT_EQ(mq[65], 0xf6);  // -3.5 * 64 = -224 = -1.75 * 2^7
  EXPECT_EQ(mq[129], 0x7f);

  // MXFP8 saturation: amax = 1.96875 * 2^10 -> X = 2, 1.96875 * 2^8 = 504 > 448 saturates.
  std::vector<float> s(32, 0.0f);
  s[0] = 1.96875f * 1024.0f;
  s[1] = -1.96875f * 1024.0f;
  s[2] = 1.0f;
  const padmoe::ScaledRows sm =
      padmoe::dispatch_quantized(rows_from_float(s, DType::kFloat16, 1, 32), plan.view(), ScaleLayout::kMxE8M0);
  EXPECT_EQ(sm.scales.data_as<uint8_t>()[0], 127 + 2);
  EXPECT_EQ(sm.rows.data_as<uint8_t>()[0], 0x7e);
  EXPECT_EQ(sm.rows.data_as<uint8_t>()[1], 0xfe);
  EXPECT_EQ(sm.rows.data_as<uint8_t>()[2], 0x28);  // 1 / 4 = 2^-2: exponent field 5
  // blockwise: scale = amax / 448 (float32 division), codes x / scale
  const padmoe::ScaledRows sb =
      padmoe::dispatch_quantized(rows_from_float(s, DType::kFloat16, 1, 32), plan.view(), ScaleLayout::kBlock128);
  const float scale = (1.96875f * 1024.0f) / 448.0f;
  EXPECT_EQ(num::float_bits(sb.scales.data_as<float>()[0]), num::float_bits(scale));
  EXPECT_EQ(sb.rows.data_as<uint8_t>()[0], 0x7e);
  EXPECT_EQ(sb.rows.data_as<uint8_t>()[2], num::float_to_fp8e4m3(1.0f / scale));
}

// --- against the reference --------------------------------------------------------------------

TEST(QuantDispatch, EveryLayoutDtypeAndWidthMatchesTheReference) {
  for (ScaleLayout l : kLayouts) {
    for (DType dt : kInputs) {
      for (DType out : kOutputs) {
        for (int64_t H : {1, 31, 32, 127, 128, 200, 7168}) {
          SCOPED_TRACE(std::string(lname(l)) + " " + dname(dt) + " -> " + dname(out) + " H=" + std::to_string(H));
          const int64_t T = H >= 4096 ? 11 : 37;
          const Case c = make_case(dt, out, l, T, H, 3, 7, 8, Dist::kSkewed, 3 + H + static_cast<int>(dt));
          ASSERT_GT(c.p.padded_rows, c.T * c.K) << "the case must have padding rows";
          const int64_t rows = c.p.capacity + 3;  // capacity larger than P
          Tensor y = poison_rows(out, rows, H), ys = poison_scales(l, rows, H);
          padmoe::dispatch_quantized_out(c.x, c.plan.view(), y, ys);
          expect_quantized(c, y, ys, true, false);
          if (HasFatalFailure()) return;

          // allocating form: exactly P rows
          const padmoe::ScaledRows a = padmoe::dispatch_quantized(c.x, c.plan.view(), l, out);
          ASSERT_EQ(a.rows.size(0), c.p.padded_rows);
          ASSERT_EQ(a.rows.dtype(), out);
          ASSERT_EQ(a.scales.size(0), c.p.padded_rows);
          ASSERT_EQ(a.scales.ndim(), l == ScaleLayout::kPerRow ? 1 : 2);
          expect_quantized(c, a.rows, a.scales, true, false);

          // the two-pass way: quantize the token rows, then dispatch_scaled moves them
          Tensor q = poison_rows(out, c.T, H), qs = poison_scales(l, c.T, H);
          padmoe::quantize_out(c.x, q, qs);
          const ref::QuantRows tok = ref::quantize_rows(c.xf, c.T, H, ref_layout(l), is_e5m2(out));
          EXPECT_EQ(bytes_of(q), tok.rows);
          EXPECT_EQ(bytes_of(qs), tok.scales);
          const padmoe::ScaledRows two = padmoe::dispatch_scaled(q, c.plan.view(), qs);
          EXPECT_TRUE(same_bytes(two.rows, a.rows));
          EXPECT_TRUE(same_bytes(two.scales, a.scales));
          const padmoe::ScaledRows qa = padmoe::quantize(c.x, l, out);
          EXPECT_TRUE(same_bytes(qa.rows, q));
          EXPECT_TRUE(same_bytes(qa.scales, qs));
        }
      }
    }
  }
}

TEST(QuantDispatch, PerRowEqualsBlockwiseUpTo128Columns) {
  for (int64_t H : {1, 77, 128}) {
    const Case c =
        make_case(DType::kBFloat16, DType::kFloat8E4M3, ScaleLayout::kPerRow, 40, H, 2, 6, 4, Dist::kUniform, 91 + H);
    const padmoe::ScaledRows r = padmoe::dispatch_quantized(c.x, c.plan.view(), ScaleLayout::kPerRow);
    const padmoe::ScaledRows b = padmoe::dispatch_quantized(c.x, c.plan.view(), ScaleLayout::kBlock128);
    EXPECT_TRUE(same_bytes(r.rows, b.rows));
    EXPECT_EQ(bytes_of(r.scales), bytes_of(b.scales));
    // a [rows, 1] float32 output is the per-row layout (scale_layout's inference) and gives the same bytes
    Tensor y = poison_rows(DType::kFloat8E4M3, c.p.padded_rows, H),
           ys = filled(DType::kFloat32, {c.p.padded_rows, 1}, kPoison);
    padmoe::dispatch_quantized_out(c.x, c.plan.view(), y, ys);
    EXPECT_TRUE(same_bytes(y, r.rows));
    EXPECT_EQ(bytes_of(ys), bytes_of(r.scales));
  }
}

TEST(QuantDispatch, ZeroPaddingAndZeroTailOptions) {
  for (ScaleLayout l : kLayouts) {
    for (DType out : kOutputs) {
      SCOPED_TRACE(std::string(lname(l)) + " " + dname(out));
      const Case c = make_case(DType::kBFloat16, out, l, 37, 200, 2, 5, 16, Dist::kSkewed, 17);
      for (bool zero_padding : {true, false}) {
        for (bool zero_tail : {false, true}) {
          padmoe::Options o;
          o.zero_padding = zero_padding;
          o.zero_tail = zero_tail;
          const int64_t rows = c.p.capacity + 5;
          Tensor y = poison_rows(out, rows, c.H), ys = poison_scales(l, rows, c.H);
          padmoe::dispatch_quantized_out(c.x, c.plan.view(), y, ys, o);
          expect_quantized(c, y, ys, zero_padding, zero_tail);
        }
      }
    }
  }
}

TEST(QuantDispatch, EmptyExpertsNoTokensAndNoColumns) {
  for (ScaleLayout l : kLayouts) {
    SCOPED_TRACE(lname(l));
    const Case odd = make_case(DType::kFloat16, DType::kFloat8E4M3, l, 29, 160, 2, 8, 4, Dist::kOdd, 5);
    Tensor y = poison_rows(odd.out, odd.p.capacity, odd.H), ys = poison_scales(l, odd.p.capacity, odd.H);
    padmoe::dispatch_quantized_out(odd.x, odd.plan.view(), y, ys);
    expect_quantized(odd, y, ys, true, false);
    // T = 0: P = 0
    const Case none = make_case(DType::kBFloat16, DType::kFloat8E5M2, l, 0, 64, 2, 4, 8, Dist::kUniform, 6);
    const padmoe::ScaledRows d = padmoe::dispatch_quantized(none.x, none.plan.view(), l, DType::kFloat8E5M2);
    EXPECT_EQ(d.rows.size(0), 0);
    EXPECT_EQ(d.scales.size(0), 0);
    Tensor ny = poison_rows(none.out, 4, 64), nys = poison_scales(l, 4, 64);
    padmoe::dispatch_quantized_out(none.x, none.plan.view(), ny, nys);
    EXPECT_TRUE(all_bytes_are(ny, kPoison));  // nothing below P = 0; rows past P untouched
    // H = 0: per-row scales are still written (scale 1: amax 0); the other layouts have no columns
    const Case flat = make_case(DType::kBFloat16, DType::kFloat8E4M3, l, 13, 0, 2, 3, 4, Dist::kUniform, 7);
    Tensor fy = poison_rows(flat.out, flat.p.capacity, 0), fs = poison_scales(l, flat.p.capacity, 0);
    padmoe::dispatch_quantized_out(flat.x, flat.plan.view(), fy, fs);
    expect_quantized(flat, fy, fs, true, false);
  }
}

TEST(QuantDispatch, ThreadCountDoesNotChangeBytes) {
  for (ScaleLayout l : kLayouts) {
    const Case c = make_case(DType::kBFloat16, DType::kFloat8E4M3, l, 301, 448, 4, 9, 32, Dist::kUniform, 9);
    padmoe::Options one, three, many;
    one.num_threads = 1;
    three.num_threads = 3;
    many.num_threads = 0;
    const padmoe::ScaledRows a = padmoe::dispatch_quantized(c.x, c.plan.view(), l, DType::kFloat8E4M3, one);
    const padmoe::ScaledRows b = padmoe::dispatch_quantized(c.x, c.plan.view(), l, DType::kFloat8E4M3, three);
    const padmoe::ScaledRows d = padmoe::dispatch_quantized(c.x, c.plan.view(), l, DType::kFloat8E4M3, many);
    EXPECT_TRUE(same_bytes(a.rows, b.rows));
    EXPECT_TRUE(same_bytes(a.scales, b.scales));
    EXPECT_TRUE(same_bytes(a.rows, d.rows));
    EXPECT_TRUE(same_bytes(a.scales, d.scales));
    expect_quantized(c, a.rows, a.scales, true, false);
  }
}

TEST(QuantDispatch, StridedInputRows) {
  // x with a row stride larger than H (a column slice of a wider buffer)
  const int64_t T = 23, H = 96, stride = 130;
  const Case c =
      make_case(DType::kBFloat16, DType::kFloat8E4M3, ScaleLayout::kMxE8M0, T, H, 2, 4, 8, Dist::kUniform, 13);
  Tensor wide = filled(DType::kBFloat16, {T, stride}, 0x7f);
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(static_cast<char*>(wide.data()) + t * stride * 2, static_cast<const char*>(c.x.data()) + t * H * 2,
                H * 2);
  const TensorView xs = TensorView::matrix(wide.data(), DType::kBFloat16, T, H, stride);
  const padmoe::ScaledRows a = padmoe::dispatch_quantized(xs, c.plan.view(), ScaleLayout::kMxE8M0);
  expect_quantized(c, a.rows, a.scales, true, false);
}

// --- bad input ------------------------------------------------------------------------------

TEST(QuantDispatch, BadInputsAreNamedErrorsAndNothingIsWritten) {
  const Case c =
      make_case(DType::kBFloat16, DType::kFloat8E4M3, ScaleLayout::kBlock128, 20, 200, 2, 4, 8, Dist::kUniform, 51);
  const int64_t rows = c.p.capacity;
  const int kType = static_cast<int>(padmoe::ErrorKind::kType), kValue = static_cast<int>(padmoe::ErrorKind::kValue);
  const Tensor x8 = filled(DType::kFloat8E4M3, {c.T, 200}, 0);
  const Tensor xi = filled(DType::kInt32, {c.T, 200}, 0);
  const Tensor x_short =
      rows_from_float(std::vector<float>(static_cast<size_t>((c.T - 1) * 200), 1.0f), DType::kBFloat16, c.T - 1, 200);
  struct Bad {
    const char* what;
    TensorView x;
    Tensor y, ys;
    std::vector<std::string> needles;
    int kind;
  };
  std::vector<Bad> bad;
  const Tensor good_ys = poison_scales(ScaleLayout::kBlock128, rows, 200);
  bad.push_back({"float8 x",
                 x8,
                 poison_rows(DType::kFloat8E4M3, rows, 200),
                 good_ys,
                 {"dispatch_quantized", "x", "float8_e4m3", "dispatch_scaled"},
                 kType});
  bad.push_back({"int32 x", xi, poison_rows(DType::kFloat8E4M3, rows, 200), good_ys, {"x", "int32"}, kType});
  bad.push_back({"x rows", x_short, poison_rows(DType::kFloat8E4M3, rows, 200), good_ys, {"x", "20 rows"}, kValue});
  bad.push_back({"bf16 y",
                 c.x,
                 poison_rows(DType::kBFloat16, rows, 200),
                 good_ys,
                 {"y", "float8_e4m3 or float8_e5m2", "bfloat16"},
                 kType});
  bad.push_back({"y columns",
                 c.x,
                 poison_rows(DType::kFloat8E4M3, rows, 199),
                 poison_scales(ScaleLayout::kBlock128, rows, 199),
                 {"y", "200 columns"},
                 kValue});
  bad.push_back({"y capacity",
                 c.x,
                 poison_rows(DType::kFloat8E4M3, c.p.padded_rows - 1, 200),
                 poison_scales(ScaleLayout::kBlock128, c.p.padded_rows - 1, 200),
                 {"y", "output capacity"},
                 kValue});
  bad.push_back({"int32 scales",
                 c.x,
                 poison_rows(DType::kFloat8E4M3, rows, 200),
                 filled(DType::kInt32, {rows, 2}, kPoison),
                 {"y_scales", "int32"},
                 kType});
  bad.push_back({"float scale columns",
                 c.x,
                 poison_rows(DType::kFloat8E4M3, rows, 200),
                 filled(DType::kFloat32, {rows, 3}, kPoison),
                 {"y_scales", "ceil(H/128)", "3]"},
                 kValue});
  bad.push_back({"e8m0 scale columns",
                 c.x,
                 poison_rows(DType::kFloat8E4M3, rows, 200),
                 filled(DType::kUInt8, {rows, 6}, kPoison),
                 {"y_scales", "ceil(H/32)", "7]"},
                 kValue});
  bad.push_back({"scale rows",
                 c.x,
                 poison_rows(DType::kFloat8E4M3, rows, 200),
                 poison_scales(ScaleLayout::kMxE8M0, rows - 1, 200),
                 {"y_scales", "rows"},
                 kValue});
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    EXPECT_TRUE(
        throws_error([&] { padmoe::dispatch_quantized_out(b.x, c.plan.view(), b.y, b.ys); }, b.needles, b.kind));
    EXPECT_TRUE(all_bytes_are(b.y, kPoison)) << "rows written before the error";
    if (b.ys.numel() > 0) EXPECT_TRUE(all_bytes_are(b.ys, kPoison)) << "scales written before the error";
  }
  // a bad plan is reported before anything moves (the plan checks dispatch uses)
  padmoe::PlanView broken = c.plan.view();
  Tensor dest = index_tensor(c.p.dest_rows, DType::kInt32);
  dest.data_as<int32_t>()[3] = dest.data_as<int32_t>()[4];  // two assignments on one row
  broken.dest_rows = dest;
  Tensor y = poison_rows(DType::kFloat8E4M3, rows, 200), ys = poison_scales(ScaleLayout::kMxE8M0, rows, 200);
  EXPECT_TRUE(
      throws_error([&] { padmoe::dispatch_quantized_out(c.x, broken, y, ys); }, {"dispatch_quantized", "plan"}));
  EXPECT_TRUE(all_bytes_are(y, kPoison));
  EXPECT_TRUE(all_bytes_are(ys, kPoison));
  // allocating forms: the output dtype is named
  EXPECT_TRUE(
      throws_error([&] { padmoe::dispatch_quantized(c.x, c.plan.view(), ScaleLayout::kMxE8M0, DType::kFloat16); },
                   {"dispatch_quantized", "dtype", "float16"}, kType));
  EXPECT_TRUE(throws_error([&] { padmoe::quantize(x8, ScaleLayout::kMxE8M0); }, {"quantize", "x", "float8"}, kType));
  // quantize: y must have x's rows exactly
  Tensor qy = poison_rows(DType::kFloat8E4M3, c.T + 1, 200), qs = poison_scales(ScaleLayout::kMxE8M0, c.T + 1, 200);
  EXPECT_TRUE(throws_error([&] { padmoe::quantize_out(c.x, qy, qs); }, {"quantize", "y", "20 rows"}, kValue));
  EXPECT_TRUE(all_bytes_are(qy, kPoison));
  EXPECT_TRUE(all_bytes_are(qs, kPoison));
}

}  // namespace
}  // namespace pt
