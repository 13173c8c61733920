// test_rows.cpp — padded_gather / padded_scatter / padded_scatter_wgrad
// against the reference: MegaBlocks' test grid, the Ascend tutorial cases,
// the Ascend design's verification list, alignments, dtypes and index dtypes.
#include <tuple>

#include "rows_case.hpp"

namespace pt {
namespace {

// ---------------------------------------------------------------------------
// MegaBlocks' grid: tokens x hidden x experts x top_k, alignment 128, bfloat16.
// Gather unweighted, scatter weighted (as MegaBlocks' tests), wgrad.
// ---------------------------------------------------------------------------
using GridParam = std::tuple<int64_t, int64_t, int, int>;
class MegaBlocksGrid : public ::testing::TestWithParam<GridParam> {};

TEST_P(MegaBlocksGrid, GatherScatterWgradMatchReference) {
  RowsCase c;
  std::tie(c.T, c.H, c.E, c.K) = GetParam();
  c.m = 128;
  c.dtype = DType::kBFloat16;
  c.seed = static_cast<uint64_t>(c.T * 7 + c.H * 13 + c.E * 3 + c.K);
  c.check_alloc = c.T * c.H <= 1024 * 768;  // the allocating forms on the smaller half of the grid
  run_rows_case(c);
}

INSTANTIATE_TEST_SUITE_P(Grid, MegaBlocksGrid,
                         ::testing::Combine(::testing::Values<int64_t>(4, 1024, 16384),
                                            ::testing::Values<int64_t>(1, 2, 768, 1536),
                                            ::testing::Values(2, 4, 64, 128), ::testing::Values(1, 2, 4)),
                         [](const ::testing::TestParamInfo<GridParam>& i) {
                           return "T" + std::to_string(std::get<0>(i.param)) + "_H" +
                                  std::to_string(std::get<1>(i.param)) + "_E" + std::to_string(std::get<2>(i.param)) +
                                  "_K" + std::to_string(std::get<3>(i.param));
                         });

// ---------------------------------------------------------------------------
// The Triton-Ascend tutorial's cases (tokens, hidden, experts, top_k), 16-bit rows.
// ---------------------------------------------------------------------------
using AscendParam = std::tuple<int64_t, int64_t, int, int>;
class AscendTutorial : public ::testing::TestWithParam<AscendParam> {};

TEST_P(AscendTutorial, MatchesReference) {
  RowsCase c;
  std::tie(c.T, c.H, c.E, c.K) = GetParam();
  c.m = 128;
  c.dtype = DType::kFloat16;
  c.gather_weighted = true;
  c.seed = 99;
  c.check_alloc = false;
  run_rows_case(c);
}

INSTANTIATE_TEST_SUITE_P(Cases, AscendTutorial,
                         ::testing::Values(AscendParam{1024, 4, 64, 4}, AscendParam{1024, 1536, 64, 4},
                                           AscendParam{1024, 1536, 128, 4}, AscendParam{16384, 768, 64, 4},
                                           AscendParam{16384, 768, 128, 4}),
                         [](const ::testing::TestParamInfo<AscendParam>& i) {
                           return "T" + std::to_string(std::get<0>(i.param)) + "_H" +
                                  std::to_string(std::get<1>(i.param)) + "_E" + std::to_string(std::get<2>(i.param)) +
                                  "_K" + std::to_string(std::get<3>(i.param));
                         });

// ---------------------------------------------------------------------------
// Alignment x row dtype x index dtype x weighting (moderate size).
// ---------------------------------------------------------------------------
using DtypeParam = std::tuple<int, DType, DType, bool>;
class AlignDtype : public ::testing::TestWithParam<DtypeParam> {};

TEST_P(AlignDtype, MatchesReference) {
  RowsCase c;
  c.T = 257;
  c.H = 33;
  c.E = 16;
  c.K = 2;
  DType idx;
  bool weighted;
  std::tie(c.m, c.dtype, idx, weighted) = GetParam();
  c.idx = idx;
  c.gather_weighted = weighted;
  c.scatter_weighted = weighted;
  c.dist = Dist::kSkewed;
  c.seed = static_cast<uint64_t>(c.m) * 5 + static_cast<uint64_t>(c.dtype);
  run_rows_case(c);
  // weights in the row dtype
  c.wdtype = c.dtype;
  c.seed += 1000;
  run_rows_case(c);
}

INSTANTIATE_TEST_SUITE_P(All, AlignDtype,
                         ::testing::Combine(::testing::Values(1, 8, 16, 128),
                                            ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values(DType::kInt32, DType::kInt64), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<DtypeParam>& i) {
                           return "m" + std::to_string(std::get<0>(i.param)) + "_" + dname(std::get<1>(i.param)) + "_" +
                                  dname(std::get<2>(i.param)) + (std::get<3>(i.param) ? "_weighted" : "_plain");
                         });

// ---------------------------------------------------------------------------
// The Ascend design's verification list.
// ---------------------------------------------------------------------------

TEST(SeedVerification, ExpertsWithZeroTokens) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    RowsCase c;
    c.T = 100;
    c.H = 17;
    c.E = 16;
    c.K = 2;
    c.m = 8;
    c.dtype = dt;
    c.gather_weighted = true;
    c.dist = Dist::kOdd;  // every even expert is empty, including expert 0
    run_rows_case(c);
    // Only the last expert gets tokens; and only the first.
    for (int64_t only : {int64_t{15}, int64_t{0}}) {
      std::vector<int64_t> counts(16, 0);
      counts[static_cast<size_t>(only)] = 200;
      const std::vector<int64_t> te = routing_with_counts(counts, 3);
      c.routing = &te;
      c.seed = 5 + static_cast<uint64_t>(only);
      run_rows_case(c);
      c.routing = nullptr;
    }
  }
}

TEST(SeedVerification, CountsOnAndOneOverTheMultiple) {
  // m = 8: counts 8 (on), 9 (one over), 16 (on), 7 (one under), 1, 0, 17, 24.
  const std::vector<int64_t> counts = {8, 9, 16, 7, 1, 0, 17, 24};  // sum 82
  const std::vector<int64_t> te = routing_with_counts(counts, 11);
  const ref::Plan p = ref::make_plan(te, 41, 2, 8, 8);
  EXPECT_EQ(p.padded_tokens_per_expert, (std::vector<int64_t>{8, 16, 16, 8, 8, 0, 24, 24}));
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    RowsCase c;
    c.T = 41;
    c.H = 9;
    c.E = 8;
    c.K = 2;
    c.m = 8;
    c.dtype = dt;
    c.gather_weighted = true;
    c.routing = &te;
    run_rows_case(c);
  }
  // m = 128 with counts 128 and 129.
  const std::vector<int64_t> counts2 = {128, 129, 0, 127};
  const std::vector<int64_t> te2 = routing_with_counts(counts2, 12);
  RowsCase c;
  c.T = 384;
  c.H = 5;
  c.E = 4;
  c.K = 1;
  c.m = 128;
  c.routing = &te2;
  run_rows_case(c);
}

TEST(SeedVerification, SeveralExpertsInsideOneSubBlock) {
  // Many tiny segments (1-3 rows) so every sub-block of rows spans several experts,
  // with and without padding between them.
  for (int m : {1, 2, 4}) {
    RowsCase c;
    c.T = 48;
    c.H = 40;
    c.E = 64;
    c.K = 2;
    c.m = m;
    c.gather_weighted = true;
    c.dtype = DType::kBFloat16;
    c.seed = 100 + static_cast<uint64_t>(m);
    run_rows_case(c);
  }
}

TEST(SeedVerification, TopK) {
  for (int K : {1, 2, 4, 8}) {
    for (bool weighted : {false, true}) {
      RowsCase c;
      c.T = 200;
      c.H = 24;
      c.E = 16;
      c.K = K;
      c.m = 16;
      c.gather_weighted = weighted;
      c.scatter_weighted = weighted;
      c.dist = Dist::kDistinct;
      c.seed = static_cast<uint64_t>(K) * 2 + weighted;
      run_rows_case(c);
      c.dist = Dist::kUniform;  // repeated experts within a token
      c.dtype = DType::kFloat16;
      run_rows_case(c);
    }
  }
}

TEST(SeedVerification, HiddenTails) {
  for (int64_t H : {1, 3, 33, 4097}) {
    for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      RowsCase c;
      c.T = H > 1000 ? 64 : 300;
      c.H = H;
      c.E = 8;
      c.K = 2;
      c.m = 16;
      c.dtype = dt;
      c.gather_weighted = true;
      c.seed = static_cast<uint64_t>(H);
      run_rows_case(c);
    }
  }
}

TEST(SeedVerification, LargeRoutedBatch) {
  RowsCase c;
  c.T = 32768;
  c.H = 33;
  c.E = 64;
  c.K = 4;
  c.m = 128;  // A = 131072
  c.dtype = DType::kBFloat16;
  c.gather_weighted = true;
  c.check_alloc = false;
  run_rows_case(c);
  RowsCase d;
  d.T = 16384;
  d.H = 8;
  d.E = 256;
  d.K = 8;
  d.m = 16;  // A = 131072, DeepSeek-like E/K
  d.dist = Dist::kDistinct;
  d.idx = DType::kInt64;
  d.check_alloc = false;
  run_rows_case(d);
}

TEST(MegaBlocks, EmptyInputs) {
  // T = 0
  RowsCase c;
  c.T = 0;
  c.H = 8;
  c.E = 4;
  c.K = 2;
  c.m = 8;
  run_rows_case(c);
  // H = 0
  RowsCase d;
  d.T = 10;
  d.H = 0;
  d.E = 4;
  d.K = 2;
  d.m = 8;
  d.gather_weighted = true;
  run_rows_case(d);
}

TEST(MegaBlocks, StridedRowViews) {
  // x and y with row strides > H: only the H columns of each row are read / written.
  const int64_t T = 50, H = 12, XS = 19, YS = 16;
  const int K = 2, E = 5, m = 4;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kUniform, 8);
  const ref::Plan p = ref::make_plan(te, T, K, E, m);
  const int64_t P = p.padded_rows;
  Rng rng(4);
  const IndexInputs ii = index_inputs(p, DType::kInt32);
  const std::vector<float> wf = random_values(T * K, DType::kFloat32, rng, 0, 1);
  const Tensor w = vec_from_float(wf, DType::kFloat32);
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    Tensor xbuf = poison_rows(dt, T, XS);
    std::vector<float> xf = random_values(T * H, dt, rng);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        num::store_from_float(xbuf.data(), dt, t * XS + h, xf[static_cast<size_t>(t * H + h)]);
    const TensorView xv = TensorView::matrix(xbuf.data(), dt, T, H, XS);
    Tensor ybuf = poison_rows(dt, P, YS);
    const TensorView yv = TensorView::matrix(ybuf.data(), dt, P, H, YS);
    padmoe::padded_gather_out(xv, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, K, w.view(), yv);
    EXPECT_TRUE(rows_bitwise(yv, ref::padded_gather(xf, H, p, &wf), P));
    // the gap columns [H, YS) of every y row stay poison
    for (int64_t r = 0; r < P; ++r)
      for (int64_t h = H; h < YS; ++h) {
        const unsigned char* b = static_cast<unsigned char*>(ybuf.data()) + (r * YS + h) * esize(dt);
        for (size_t k = 0; k < esize(dt); ++k) ASSERT_EQ(b[k], kPoison) << "gap column written at row " << r;
      }
    // scatter from the strided y into a strided out
    Tensor obuf = poison_rows(dt, T, XS);
    const TensorView ov = TensorView::matrix(obuf.data(), dt, T, H, XS);
    padmoe::padded_scatter_out(yv, ii.indices, ii.bin_ids, w.view(), ii.bins, ii.padded_bins, K, ov);
    std::vector<float> yf(static_cast<size_t>(P * H));
    for (int64_t r = 0; r < P; ++r)
      for (int64_t h = 0; h < H; ++h) yf[static_cast<size_t>(r * H + h)] = elem_float(yv, r, h);
    EXPECT_TRUE(sums_close(ov, ref::padded_scatter(yf, H, p, &wf), ref::padded_scatter(abs_of(yf), H, p, &wf), K, T));
  }
}

}  // namespace
}  // namespace pt
