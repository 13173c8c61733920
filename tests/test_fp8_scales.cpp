// test_fp8_scales.cpp — rows moved with their scales (ops.hpp section 4):
// dispatch / padded_gather / pad_to_alignment / unpad_from_alignment `_scaled` forms, every scale
// layout (per row 1-D and [rows, 1], per 128 columns, MXFP8 E8M0) x float8 e4m3 / e5m2 (and a
// 16-bit case), against the reference loops: data rows bitwise, scale rows byte for byte, padding
// rows zero with a scale that decodes to 1, rows past P untouched (or zeroed with scale 1 under
// zero_tail), zero_padding = false, empty experts, T = 0, H = 0, and bad inputs (a named error,
// nothing written).
#include "test_util.hpp"

namespace pt {
namespace {

enum class Layout { kPerRow1D, kPerRow2D, kBlock128, kMx };
const Layout kLayouts[] = {Layout::kPerRow1D, Layout::kPerRow2D, Layout::kBlock128, Layout::kMx};

const char* lname(Layout l) {
  switch (l) {
    case Layout::kPerRow1D: return "per-row[rows]";
    case Layout::kPerRow2D: return "per-row[rows,1]";
    case Layout::kBlock128: return "block128";
    case Layout::kMx: return "mxfp8-e8m0";
  }
  return "?";
}

int64_t layout_cols(Layout l, int64_t H) {
  switch (l) {
    case Layout::kPerRow1D:
    case Layout::kPerRow2D: return 1;
    case Layout::kBlock128: return (H + 127) / 128;
    case Layout::kMx: return (H + 31) / 32;
  }
  return 1;
}
bool is_mx(Layout l) { return l == Layout::kMx; }
int64_t scale_row_bytes(Layout l, int64_t H) { return layout_cols(l, H) * (is_mx(l) ? 1 : 4); }

// An uninitialized (poisoned) scale tensor of `rows` rows in layout l.
Tensor poison_scales(Layout l, int64_t rows, int64_t H) {
  if (l == Layout::kPerRow1D) return filled(DType::kFloat32, {rows}, kPoison);
  return filled(is_mx(l) ? DType::kUInt8 : DType::kFloat32, {rows, layout_cols(l, H)}, kPoison);
}

// Random scales: float32 in (0, 4), or E8M0 bytes in [100, 150].
Tensor random_scales(Layout l, int64_t rows, int64_t H, Rng& rng) {
  Tensor t = poison_scales(l, rows, H);
  const int64_t n = rows * layout_cols(l, H);
  for (int64_t i = 0; i < n; ++i) {
    if (is_mx(l)) t.data_as<uint8_t>()[i] = static_cast<uint8_t>(100 + rng.below(51));
    else t.data_as<float>()[i] = static_cast<float>(rng.uniform(0.01, 4.0));
  }
  return t;
}

std::vector<uint8_t> bytes_of(const TensorView& t) {
  const size_t n = static_cast<size_t>(t.numel()) * esize(t.dtype);
  const auto* p = static_cast<const uint8_t*>(t.data);
  return n == 0 ? std::vector<uint8_t>{} : std::vector<uint8_t>(p, p + n);
}

// Scale rows [0, want.size() / row_bytes) of `got` equal `want` byte for byte.
::testing::AssertionResult scale_rows_are(const TensorView& got, const std::vector<uint8_t>& want, int64_t row_bytes) {
  const auto* p = static_cast<const uint8_t*>(got.data);
  for (size_t i = 0; i < want.size(); ++i) {
    if (p[i] != want[i]) {
      return ::testing::AssertionFailure() << "scale byte " << i << " (row " << (row_bytes ? int64_t(i) / row_bytes : 0)
                                           << ") is 0x" << std::hex << int(p[i]) << ", want 0x" << int(want[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

// Scale rows [r0, r1) of `got` are all poison / all scale 1.
::testing::AssertionResult scale_rows_poison(const TensorView& got, int64_t r0, int64_t r1, int64_t row_bytes) {
  const auto* p = static_cast<const uint8_t*>(got.data);
  for (int64_t i = r0 * row_bytes; i < r1 * row_bytes; ++i)
    if (p[i] != kPoison) return ::testing::AssertionFailure() << "scale row " << i / row_bytes << " was written";
  return ::testing::AssertionSuccess();
}
::testing::AssertionResult scale_rows_one(const TensorView& got, int64_t r0, int64_t r1, Layout l, int64_t H) {
  const std::vector<uint8_t> one = ref::scale_one_row(is_mx(l), layout_cols(l, H));
  const int64_t rb = scale_row_bytes(l, H);
  const auto* p = static_cast<const uint8_t*>(got.data);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < rb; ++b)
      if (p[r * rb + b] != one[static_cast<size_t>(b)])
        return ::testing::AssertionFailure() << "scale row " << r << " is not 1";
  return ::testing::AssertionSuccess();
}

// One routing with its token rows and token scales.
struct Case {
  int64_t T = 0, H = 0;
  int K = 2, E = 5, m = 8;
  DType dt = DType::kFloat8E4M3;
  Layout layout = Layout::kBlock128;
  ref::Plan p;
  std::vector<float> xf;
  Tensor x, xs, top;
};

Case make_case(DType dt, Layout l, int64_t T, int64_t H, int K, int E, int m, Dist dist, uint64_t seed) {
  Case c;
  c.T = T, c.H = H, c.K = K, c.E = E, c.m = m, c.dt = dt, c.layout = l;
  const std::vector<int64_t> te = make_routing(T, K, E, dist, seed);
  c.p = ref::make_plan(te, T, K, E, m);
  Rng rng(seed + 11);
  c.xf = random_values(T * H, dt, rng, -400.0, 400.0);
  c.x = rows_from_float(c.xf, dt, T, H);
  c.xs = random_scales(l, T, H, rng);
  c.top = index_matrix(te, T, K, DType::kInt32);
  return c;
}

// Rows and scales of a spread output of `rows` >= P rows: [0, P) as the reference (padding zero /
// scale 1, or poison when !zero_padding); [P, rows) poison, or zero / scale 1 with zero_tail.
void expect_spread(const Case& c, const TensorView& y, const TensorView& ys, bool zero_padding, bool zero_tail) {
  const int64_t P = c.p.padded_rows, rows = y.shape[0], rb = scale_row_bytes(c.layout, c.H);
  const std::vector<float> want = ref::padded_gather(c.xf, c.H, c.p, nullptr);
  const std::vector<uint8_t> swant = ref::move_scale_rows(
      bytes_of(c.xs), rb, ref::spread_sources(c.p), ref::scale_one_row(is_mx(c.layout), layout_cols(c.layout, c.H)));
  for (int64_t r = 0; r < P; ++r) {
    const bool real = c.p.row_sources[static_cast<size_t>(r)] >= 0;
    if (real || zero_padding) {
      std::vector<float> one(want.begin() + r * c.H, want.begin() + (r + 1) * c.H);
      EXPECT_TRUE(rows_bitwise(y, one, 1, 0, c.H, r)) << "row " << r;
      const std::vector<uint8_t> srow(swant.begin() + r * rb, swant.begin() + (r + 1) * rb);
      TensorView at = ys;
      at.data = static_cast<uint8_t*>(ys.data) + r * rb;
      EXPECT_TRUE(scale_rows_are(at, srow, rb)) << "scale row " << r << (real ? " (real)" : " (padding)");
    } else {
      EXPECT_TRUE(bytes_are(y, r, r + 1, kPoison)) << "padding row " << r;
      EXPECT_TRUE(scale_rows_poison(ys, r, r + 1, rb)) << "padding scale row " << r;
    }
  }
  if (zero_tail) {
    EXPECT_TRUE(bytes_are(y, P, rows, 0)) << "rows past P zeroed";
    EXPECT_TRUE(scale_rows_one(ys, P, rows, c.layout, c.H)) << "scale rows past P";
  } else {
    EXPECT_TRUE(bytes_are(y, P, rows, kPoison)) << "rows past P untouched";
    EXPECT_TRUE(scale_rows_poison(ys, P, rows, rb)) << "scale rows past P untouched";
  }
}

const DType kFp8[] = {DType::kFloat8E4M3, DType::kFloat8E5M2};

// --- dispatch and padded_gather ---------------------------------------------------

TEST(Fp8Scales, DispatchAndGatherEveryLayout) {
  for (DType dt : {DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kBFloat16}) {
    for (Layout l : kLayouts) {
      for (int64_t H : {200, 256, 96}) {  // 200: not a multiple of 128 or 32
        SCOPED_TRACE(std::string(dname(dt)) + " " + lname(l) + " H=" + std::to_string(H));
        const Case c = make_case(dt, l, 45, H, 3, 7, 8, Dist::kSkewed, 3 + H);
        ASSERT_GT(c.p.padded_rows, c.T * c.K) << "the case must have padding rows";
        const padmoe::Plan plan = padmoe::make_plan(c.top, c.E, c.m);
        const int64_t rows = c.p.capacity + 3;  // output capacity larger than P
        Tensor y = poison_rows(dt, rows, H), ys = poison_scales(l, rows, H);
        padmoe::dispatch_scaled_out(c.x, plan.view(), c.xs, y, ys);
        expect_spread(c, y, ys, true, false);

        const IndexInputs ii = index_inputs(c.p, DType::kInt64);
        Tensor g = poison_rows(dt, rows, H), gs = poison_scales(l, rows, H);
        padmoe::padded_gather_scaled_out(c.x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, c.K, c.xs, g, gs);
        expect_spread(c, g, gs, true, false);

        // allocating forms: exactly P rows, the input scales' layout
        const padmoe::ScaledRows d = padmoe::dispatch_scaled(c.x, plan.view(), c.xs);
        ASSERT_EQ(d.rows.size(0), c.p.padded_rows);
        ASSERT_EQ(d.scales.size(0), c.p.padded_rows);
        ASSERT_EQ(d.scales.ndim(), c.xs.ndim());
        ASSERT_EQ(d.scales.dtype(), c.xs.dtype());
        expect_spread(c, d.rows, d.scales, true, false);
        const padmoe::ScaledRows a =
            padmoe::padded_gather_scaled(c.x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, c.K, c.xs);
        EXPECT_TRUE(same_bytes(a.rows, d.rows));
        EXPECT_TRUE(same_bytes(a.scales, d.scales));
      }
    }
  }
}

TEST(Fp8Scales, ZeroTailAndZeroPaddingOptions) {
  for (DType dt : kFp8) {
    for (Layout l : kLayouts) {
      SCOPED_TRACE(std::string(dname(dt)) + " " + lname(l));
      const Case c = make_case(dt, l, 37, 200, 2, 5, 16, Dist::kSkewed, 17);
      const padmoe::Plan plan = padmoe::make_plan(c.top, c.E, c.m);
      const IndexInputs ii = index_inputs(c.p, DType::kInt32);
      for (bool zero_padding : {true, false}) {
        for (bool zero_tail : {false, true}) {
          padmoe::Options o;
          o.zero_padding = zero_padding;
          o.zero_tail = zero_tail;
          const int64_t rows = c.p.capacity + 5;
          Tensor y = poison_rows(dt, rows, c.H), ys = poison_scales(l, rows, c.H);
          padmoe::dispatch_scaled_out(c.x, plan.view(), c.xs, y, ys, o);
          expect_spread(c, y, ys, zero_padding, zero_tail);
          Tensor g = poison_rows(dt, rows, c.H), gs = poison_scales(l, rows, c.H);
          padmoe::padded_gather_scaled_out(c.x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, c.K, c.xs, g, gs, o);
          expect_spread(c, g, gs, zero_padding, zero_tail);
        }
      }
    }
  }
}

TEST(Fp8Scales, EmptyExpertsNoTokensAndNoColumns) {
  for (Layout l : kLayouts) {
    SCOPED_TRACE(lname(l));
    // every even expert empty
    const Case odd = make_case(DType::kFloat8E4M3, l, 29, 160, 2, 8, 4, Dist::kOdd, 5);
    const padmoe::Plan plan = padmoe::make_plan(odd.top, odd.E, odd.m);
    Tensor y = poison_rows(odd.dt, odd.p.capacity, odd.H), ys = poison_scales(l, odd.p.capacity, odd.H);
    padmoe::dispatch_scaled_out(odd.x, plan.view(), odd.xs, y, ys);
    expect_spread(odd, y, ys, true, false);
    // T = 0: nothing to move, P = 0
    const Case none = make_case(DType::kFloat8E5M2, l, 0, 64, 2, 4, 8, Dist::kUniform, 6);
    const padmoe::Plan p0 = padmoe::make_plan(none.top, none.E, none.m);
    const padmoe::ScaledRows d = padmoe::dispatch_scaled(none.x, p0.view(), none.xs);
    EXPECT_EQ(d.rows.size(0), 0);
    EXPECT_EQ(d.scales.size(0), 0);
    // H = 0: per-row scales still move (per 128 / per 32 columns have no columns)
    const Case flat = make_case(DType::kFloat8E4M3, l, 13, 0, 2, 3, 4, Dist::kUniform, 7);
    const padmoe::Plan pf = padmoe::make_plan(flat.top, flat.E, flat.m);
    Tensor fy = poison_rows(flat.dt, flat.p.capacity, 0), fs = poison_scales(l, flat.p.capacity, 0);
    padmoe::dispatch_scaled_out(flat.x, pf.view(), flat.xs, fy, fs);
    expect_spread(flat, fy, fs, true, false);
  }
}

TEST(Fp8Scales, ThreadCountDoesNotChangeBytes) {
  const Case c = make_case(DType::kFloat8E4M3, Layout::kMx, 301, 448, 4, 9, 32, Dist::kUniform, 9);
  const padmoe::Plan plan = padmoe::make_plan(c.top, c.E, c.m);
  padmoe::Options one, many;
  one.num_threads = 1;
  many.num_threads = 0;
  const padmoe::ScaledRows a = padmoe::dispatch_scaled(c.x, plan.view(), c.xs, one);
  const padmoe::ScaledRows b = padmoe::dispatch_scaled(c.x, plan.view(), c.xs, many);
  EXPECT_TRUE(same_bytes(a.rows, b.rows));
  EXPECT_TRUE(same_bytes(a.scales, b.scales));
  expect_spread(c, a.rows, a.scales, true, false);
}

// --- pad_to_alignment and unpad_from_alignment ------------------------------------

struct Grouped {
  int64_t N = 0, H = 0;
  Layout layout = Layout::kBlock128;
  DType dt = DType::kFloat8E4M3;
  std::vector<int64_t> counts;
  std::vector<float> hf;
  Tensor h, hs, tpe;
};

// Expert-grouped rows: sum(counts) real rows plus `extra` ignored rows.
Grouped make_grouped(DType dt, Layout l, std::vector<int64_t> counts, int64_t H, int64_t extra, uint64_t seed) {
  Grouped g;
  g.dt = dt, g.layout = l, g.H = H, g.counts = counts;
  for (int64_t n : counts) g.N += n;
  g.N += extra;
  Rng rng(seed);
  g.hf = random_values(g.N * H, dt, rng, -200.0, 200.0);
  g.h = rows_from_float(g.hf, dt, g.N, H);
  g.hs = random_scales(l, g.N, H, rng);
  g.tpe = index_tensor(counts, DType::kInt32);
  return g;
}

TEST(Fp8Scales, PadEveryLayout) {
  for (DType dt : {DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kFloat16}) {
    for (Layout l : kLayouts) {
      SCOPED_TRACE(std::string(dname(dt)) + " " + lname(l));
      const Grouped g = make_grouped(dt, l, {5, 0, 17, 1, 0, 8}, 200, 3, 21);
      const int alignment = 8;
      const ref::PadResult want = ref::pad_to_alignment(g.hf, g.H, g.counts, alignment);
      const int64_t P = want.padded_rows, rows = P + 6, rb = scale_row_bytes(l, g.H);
      const std::vector<uint8_t> swant = ref::move_scale_rows(bytes_of(g.hs), rb, want.permutation_map,
                                                              ref::scale_one_row(is_mx(l), layout_cols(l, g.H)));
      for (bool zero_padding : {true, false}) {
        padmoe::Options o;
        o.zero_padding = zero_padding;
        Tensor padded = poison_rows(dt, rows, g.H), ps = poison_scales(l, rows, g.H), map = poison_index(rows),
               offs = poison_index(static_cast<int64_t>(g.counts.size()));
        padmoe::pad_to_alignment_scaled_out(g.h, g.tpe, alignment, g.hs, padded, ps, map, offs, o);
        EXPECT_EQ(index_to_vec(offs), want.inclusive_offsets);
        const std::vector<int64_t> m = index_to_vec(map);
        for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(m[r], r < P ? want.permutation_map[r] : -1) << "map entry " << r;
        for (int64_t r = 0; r < P; ++r) {
          const bool real = want.permutation_map[static_cast<size_t>(r)] >= 0;
          TensorView at = ps;
          at.data = static_cast<uint8_t*>(ps.data()) + r * rb;
          if (real || zero_padding) {
            std::vector<float> one(want.padded.begin() + r * g.H, want.padded.begin() + (r + 1) * g.H);
            EXPECT_TRUE(rows_bitwise(padded, one, 1, 0, g.H, r)) << "row " << r;
            EXPECT_TRUE(
                scale_rows_are(at, std::vector<uint8_t>(swant.begin() + r * rb, swant.begin() + (r + 1) * rb), rb))
                << "scale row " << r;
          } else {
            EXPECT_TRUE(bytes_are(padded, r, r + 1, kPoison)) << "padding row " << r;
            EXPECT_TRUE(scale_rows_poison(ps, r, r + 1, rb)) << "padding scale row " << r;
          }
        }
        EXPECT_TRUE(bytes_are(padded, P, rows, kPoison)) << "rows past P untouched";
        EXPECT_TRUE(scale_rows_poison(ps, P, rows, rb)) << "scale rows past P untouched";
      }
      const padmoe::PadScaledResult a = padmoe::pad_to_alignment_scaled(g.h, g.tpe, alignment, g.hs);
      ASSERT_EQ(a.padded.size(0), P);
      ASSERT_EQ(a.padded_scales.size(0), P);
      EXPECT_TRUE(scale_rows_are(a.padded_scales, swant, rb));
      EXPECT_TRUE(rows_bitwise(a.padded, want.padded, P));
    }
  }
}

TEST(Fp8Scales, UnpadEveryLayout) {
  for (DType dt : kFp8) {
    for (Layout l : kLayouts) {
      SCOPED_TRACE(std::string(dname(dt)) + " " + lname(l));
      const int64_t H = 72, N = 30, P = 48, rb = scale_row_bytes(l, H);
      // A map naming 22 of the 30 output rows once each (8 rows unnamed), -1 elsewhere.
      Rng rng(33);
      std::vector<int64_t> targets(static_cast<size_t>(N));
      for (int64_t n = 0; n < N; ++n) targets[static_cast<size_t>(n)] = n;
      for (size_t i = targets.size(); i > 1; --i)
        std::swap(targets[i - 1], targets[static_cast<size_t>(rng.below(int64_t(i)))]);
      std::vector<int64_t> map(static_cast<size_t>(P), -1);
      for (int64_t i = 0; i < 22; ++i) map[static_cast<size_t>((i * 7) % P)] = targets[static_cast<size_t>(i)];
      const std::vector<float> pf = random_values(P * H, dt, rng, -100.0, 100.0);
      const Tensor padded = rows_from_float(pf, dt, P, H);
      const Tensor ps = random_scales(l, P, H, rng);
      const std::vector<float> want = ref::unpad_from_alignment(pf, H, map, N, nullptr);
      const std::vector<int64_t> sources = ref::unpad_sources(map, N);
      const std::vector<uint8_t> swant =
          ref::move_scale_rows(bytes_of(ps), rb, sources, ref::scale_one_row(is_mx(l), layout_cols(l, H)));
      for (DType mt : {DType::kInt32, DType::kInt64}) {
        const Tensor mt_map = index_tensor(map, mt);
        Tensor out = poison_rows(dt, N, H), os = poison_scales(l, N, H);
        padmoe::unpad_from_alignment_scaled_out(padded, mt_map, ps, out, os);
        EXPECT_TRUE(rows_bitwise(out, want, N));
        EXPECT_TRUE(scale_rows_are(os, swant, rb));
        const padmoe::ScaledRows a = padmoe::unpad_from_alignment_scaled(padded, mt_map, N, ps);
        EXPECT_TRUE(same_bytes(a.rows, out));
        EXPECT_TRUE(same_bytes(a.scales, os));
      }
      int unnamed = 0;
      for (int64_t n = 0; n < N; ++n) unnamed += sources[static_cast<size_t>(n)] < 0;
      EXPECT_EQ(unnamed, 8);  // rows no entry names: zero data, scale 1 (checked through swant)
    }
  }
}

TEST(Fp8Scales, PadThenUnpadRoundTrip) {
  const Grouped g = make_grouped(DType::kFloat8E4M3, Layout::kMx, {3, 9, 0, 4}, 100, 0, 41);
  const padmoe::PadScaledResult p = padmoe::pad_to_alignment_scaled(g.h, g.tpe, 16, g.hs);
  const padmoe::ScaledRows u = padmoe::unpad_from_alignment_scaled(p.padded, p.permutation_map, g.N, p.padded_scales);
  EXPECT_TRUE(same_bytes(u.rows, g.h));
  EXPECT_TRUE(same_bytes(u.scales, g.hs));
}

// --- layouts and bad input ------------------------------------------------------------

TEST(Fp8Scales, LayoutInference) {
  using padmoe::ScaleLayout;
  const Tensor f1 = Tensor::empty(DType::kFloat32, {4}), f1c = Tensor::empty(DType::kFloat32, {4, 1}),
               f2 = Tensor::empty(DType::kFloat32, {4, 2}), u7 = Tensor::empty(DType::kUInt8, {4, 7});
  EXPECT_EQ(padmoe::scale_layout(f1, 200), ScaleLayout::kPerRow);
  EXPECT_EQ(padmoe::scale_layout(f1c, 200), ScaleLayout::kPerRow);
  EXPECT_EQ(padmoe::scale_layout(f2, 200), ScaleLayout::kBlock128);
  EXPECT_EQ(padmoe::scale_layout(u7, 200), ScaleLayout::kMxE8M0);
  EXPECT_EQ(padmoe::scale_layout(f1c, 128), ScaleLayout::kPerRow);  // H <= 128: the two float layouts coincide
  EXPECT_EQ(padmoe::scale_columns(ScaleLayout::kBlock128, 7168), 56);
  EXPECT_EQ(padmoe::scale_columns(ScaleLayout::kMxE8M0, 7168), 224);
  EXPECT_EQ(padmoe::scale_columns(ScaleLayout::kMxE8M0, 33), 2);
  EXPECT_TRUE(throws_error([&] { padmoe::scale_layout(f2, 300); }, {"scales", "ceil(H/128)", "[4, 2]"}));
  EXPECT_TRUE(throws_error([&] { padmoe::scale_layout(u7, 300); }, {"scales", "ceil(H/32)"}));
}

TEST(Fp8Scales, BadScalesAreNamedErrorsAndNothingIsWritten) {
  const Case c = make_case(DType::kFloat8E4M3, Layout::kBlock128, 20, 200, 2, 4, 8, Dist::kUniform, 51);
  const padmoe::Plan plan = padmoe::make_plan(c.top, c.E, c.m);
  const int64_t rows = c.p.capacity;
  const IndexInputs ii = index_inputs(c.p, DType::kInt32);
  const int kType = static_cast<int>(padmoe::ErrorKind::kType), kValue = static_cast<int>(padmoe::ErrorKind::kValue);
  struct Bad {
    const char* what;
    Tensor xs, ys;
    std::vector<std::string> needles;
    int kind;
  };
  Tensor strided = Tensor::empty(DType::kFloat32, {c.T, 4});
  TensorView strided_view = strided.view();
  strided_view.shape[1] = 2;  // [T, 2] with row stride 4: not contiguous
  std::vector<Bad> bad;
  bad.push_back({"int32 scales",
                 Tensor::empty(DType::kInt32, {c.T, 2}),
                 poison_scales(Layout::kBlock128, rows, 200),
                 {"x_scales", "int32"},
                 kType});
  bad.push_back({"wrong float column count",
                 Tensor::empty(DType::kFloat32, {c.T, 3}),
                 poison_scales(Layout::kBlock128, rows, 200),
                 {"x_scales", "ceil(H/128)", "[20, 3]"},
                 kValue});
  bad.push_back({"wrong e8m0 column count",
                 Tensor::empty(DType::kUInt8, {c.T, 6}),
                 poison_scales(Layout::kMx, rows, 200),
                 {"x_scales", "ceil(H/32)", "[rows, 7]"},
                 kValue});
  bad.push_back({"1-D e8m0",
                 Tensor::empty(DType::kUInt8, {c.T}),
                 poison_scales(Layout::kMx, rows, 200),
                 {"x_scales", "uint8"},
                 kValue});
  bad.push_back({"3-D scales",
                 Tensor::empty(DType::kFloat32, {c.T, 2, 1}),
                 poison_scales(Layout::kBlock128, rows, 200),
                 {"x_scales", "[rows, columns]"},
                 kValue});
  bad.push_back({"rows do not match x",
                 Tensor::empty(DType::kFloat32, {c.T - 1, 2}),
                 poison_scales(Layout::kBlock128, rows, 200),
                 {"x_scales", "expected 20 rows"},
                 kValue});
  bad.push_back({"output dtype", c.xs, filled(DType::kUInt8, {rows, 2}, kPoison), {"y_scales", "float32"}, kType});
  bad.push_back({"output layout", c.xs, poison_scales(Layout::kPerRow1D, rows, 200), {"y_scales", "layout"}, kValue});
  bad.push_back({"output rows", c.xs, poison_scales(Layout::kBlock128, rows - 1, 200), {"y_scales", "rows"}, kValue});
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    Tensor y = poison_rows(c.dt, rows, c.H);
    EXPECT_TRUE(throws_error([&] { padmoe::dispatch_scaled_out(c.x, plan.view(), b.xs, y, b.ys); }, b.needles, b.kind));
    EXPECT_TRUE(throws_error(
        [&] {
          padmoe::padded_gather_scaled_out(c.x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, c.K, b.xs, y, b.ys);
        },
        b.needles, b.kind));
    EXPECT_TRUE(all_bytes_are(y, kPoison)) << "rows written before the error";
    if (b.ys.ndim() >= 1 && b.ys.numel() > 0 && b.ys.dtype() != DType::kInt32) {
      EXPECT_TRUE(bytes_are(b.ys, 0, b.ys.size(0), kPoison)) << "scales written before the error";
    }
  }
  Tensor y = poison_rows(c.dt, rows, c.H), ys = poison_scales(Layout::kBlock128, rows, 200);
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_scaled_out(c.x, plan.view(), strided_view, y, ys); },
                           {"x_scales", "contiguous"}, kValue));
  // A bad routing is still reported before anything moves.
  Tensor bad_bins = index_tensor(std::vector<int64_t>{1, 2, 3, 4}, DType::kInt32);
  EXPECT_TRUE(throws_error(
      [&] {
        padmoe::padded_gather_scaled_out(c.x, ii.indices, ii.bin_ids, bad_bins, ii.padded_bins, c.K, c.xs, y, ys);
      },
      {"padded_gather", "bins"}));
  EXPECT_TRUE(all_bytes_are(y, kPoison));
  EXPECT_TRUE(bytes_are(ys, 0, rows, kPoison));
}

TEST(Fp8Scales, BadPadAndUnpadScales) {
  const Grouped g = make_grouped(DType::kFloat8E5M2, Layout::kMx, {4, 6}, 64, 0, 61);
  const int64_t P = 16;
  Tensor padded = poison_rows(g.dt, P, g.H), ps = poison_scales(Layout::kMx, P, g.H), map = poison_index(P),
         offs = poison_index(2);
  const Tensor short_hs = Tensor::empty(DType::kUInt8, {g.N - 1, 2});
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_scaled_out(g.h, g.tpe, 8, short_hs, padded, ps, map, offs); },
                           {"pad_to_alignment", "hidden_scales", "rows"}));
  const Tensor wide_ps = Tensor::empty(DType::kUInt8, {P, 3});
  EXPECT_TRUE(
      throws_error([&] { padmoe::pad_to_alignment_scaled_out(g.h, g.tpe, 8, g.hs, padded, wide_ps, map, offs); },
                   {"pad_to_alignment", "padded_scales", "layout"}));
  EXPECT_TRUE(all_bytes_are(padded, kPoison));
  EXPECT_TRUE(bytes_are(ps, 0, P, kPoison));
  EXPECT_TRUE(bytes_are(map, 0, P, kIndexPoison));
  // a bad count is reported before the scales move
  const Tensor bad_tpe = index_tensor(std::vector<int64_t>{4, -1}, DType::kInt32);
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_scaled_out(g.h, bad_tpe, 8, g.hs, padded, ps, map, offs); },
                           {"tokens_per_expert", "negative"}));
  EXPECT_TRUE(bytes_are(ps, 0, P, kPoison));

  const padmoe::PadScaledResult r = padmoe::pad_to_alignment_scaled(g.h, g.tpe, 8, g.hs);
  Tensor out = poison_rows(g.dt, g.N, g.H), os = poison_scales(Layout::kMx, g.N, g.H);
  const Tensor f32 = Tensor::empty(DType::kFloat32, {P, 2});
  EXPECT_TRUE(throws_error([&] { padmoe::unpad_from_alignment_scaled_out(r.padded, r.permutation_map, f32, out, os); },
                           {"unpad_from_alignment", "padded_scales", "ceil(H/128)"}));
  const Tensor short_os = poison_scales(Layout::kMx, g.N - 1, g.H);
  EXPECT_TRUE(throws_error(
      [&] { padmoe::unpad_from_alignment_scaled_out(r.padded, r.permutation_map, r.padded_scales, out, short_os); },
      {"unpad_from_alignment", "out_scales", "rows"}));
  EXPECT_TRUE(all_bytes_are(out, kPoison));
  EXPECT_TRUE(bytes_are(os, 0, g.N, kPoison));
}

}  // namespace
}  // namespace pt
