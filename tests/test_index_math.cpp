// test_index_math.cpp — the shared index math (index_math.hpp) against
// brute-force definitions.
#include <vector>

#include "padmoe/index_math.hpp"
#include "test_util.hpp"

namespace pt {
namespace {

namespace ix = padmoe::index;

TEST(IndexMath, CeilDivAndRoundUp) {
  for (int64_t m = 1; m <= 130; ++m)
    for (int64_t x = 0; x <= 400; ++x) {
      int64_t want = 0;
      while (want < x) want += m;  // smallest multiple of m >= x
      ASSERT_EQ(ix::round_up(x, m), want) << x << " " << m;
      ASSERT_EQ(ix::ceil_div(x, m), want / m);
    }
  EXPECT_EQ(ix::round_up(0, 128), 0);
  EXPECT_EQ(ix::round_up(128, 128), 128);
  EXPECT_EQ(ix::round_up(129, 128), 256);
  EXPECT_EQ(ix::round_up(int64_t{3000000000}, 128), int64_t{3000000000} + 0);  // 3e9 = 23437500 * 128
  EXPECT_EQ(ix::round_up(int64_t{3000000001}, 128), int64_t{3000000128});
}

TEST(IndexMath, PaddedRowsBoundHoldsForEveryCountSplit) {
  EXPECT_EQ(ix::padded_rows_bound(131072, 256, 128), 131072 + 256 * 127);
  EXPECT_EQ(padmoe::padded_rows_bound(16384, 8, 256, 16), 16384 * 8 + 256 * 15);
  Rng rng(5);
  for (int trial = 0; trial < 500; ++trial) {
    const int64_t E = 1 + rng.below(20), m = 1 + rng.below(40), A = rng.below(300);
    std::vector<int64_t> counts(static_cast<size_t>(E), 0);
    for (int64_t a = 0; a < A; ++a) ++counts[static_cast<size_t>(rng.below(E))];
    int64_t P = 0;
    for (int64_t c : counts) P += ix::round_up(c, m);
    ASSERT_LE(P, ix::padded_rows_bound(A, E, m));
  }
  // the bound is attained: every expert one over a multiple
  EXPECT_EQ(ix::padded_rows_bound(4 * 9, 4, 8), 4 * 16);
}

TEST(IndexMath, SegmentStartPaddedRowAndFindSegment) {
  // counts with empty segments: [0, 3, 0, 0, 5, 1, 0]
  const std::vector<int32_t> bins = {0, 3, 3, 3, 8, 9, 9};
  const std::vector<int32_t> padded_bins = {0, 4, 4, 4, 12, 16, 16};  // m = 4
  EXPECT_EQ(ix::segment_start(bins.data(), 0), 0);
  EXPECT_EQ(ix::segment_start(bins.data(), 1), 0);
  EXPECT_EQ(ix::segment_start(bins.data(), 4), 3);
  EXPECT_EQ(ix::segment_start(padded_bins.data(), 5), 12);
  // brute force: sorted position i -> expert, padded row
  std::vector<int64_t> expert_of, row_of;
  int64_t pstart = 0, prev = 0;
  for (int e = 0; e < 7; ++e) {
    for (int64_t j = 0; j < bins[static_cast<size_t>(e)] - prev; ++j) {
      expert_of.push_back(e);
      row_of.push_back(pstart + j);
    }
    prev = bins[static_cast<size_t>(e)];
    pstart = padded_bins[static_cast<size_t>(e)];
  }
  ASSERT_EQ(expert_of.size(), 9u);
  for (int64_t i = 0; i < 9; ++i) {
    EXPECT_EQ(ix::find_segment(bins.data(), 7, i), expert_of[static_cast<size_t>(i)]) << i;
    EXPECT_EQ(ix::find_segment(padded_bins.data(), 7, row_of[static_cast<size_t>(i)]),
              expert_of[static_cast<size_t>(i)]);
    EXPECT_EQ(ix::padded_row_of(bins.data(), padded_bins.data(), expert_of[static_cast<size_t>(i)], i),
              row_of[static_cast<size_t>(i)]);
  }
  EXPECT_EQ(row_of, (std::vector<int64_t>{0, 1, 2, 4, 5, 6, 7, 8, 12}));
  EXPECT_EQ(ix::find_segment(bins.data(), 7, 9), 7);  // past the end
  EXPECT_EQ(ix::find_segment(bins.data(), 7, 100), 7);
  // padding rows belong to the expert whose padded segment holds them
  EXPECT_EQ(ix::find_segment(padded_bins.data(), 7, 3), 1);
  EXPECT_EQ(ix::find_segment(padded_bins.data(), 7, 15), 5);
  // all empty
  const std::vector<int32_t> zeros = {0, 0, 0};
  EXPECT_EQ(ix::find_segment(zeros.data(), 3, 0), 3);
  EXPECT_EQ(ix::padded_row(10, 7, 20), 23);
  EXPECT_EQ(ix::token_of(13, 4), 3);
  EXPECT_EQ(ix::assignment_id(3, 1, 4), 13);
}

TEST(IndexMath, FindSegmentRandomAgainstLinearScan) {
  Rng rng(17);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = 1 + rng.below(40);
    std::vector<int64_t> cum(static_cast<size_t>(n));
    int64_t run = 0;
    for (auto& c : cum) {
      run += rng.below(3) == 0 ? 0 : rng.below(6);
      c = run;
    }
    for (int64_t pos = 0; pos <= run + 2; ++pos) {
      int64_t want = n;
      for (int64_t e = 0; e < n; ++e)
        if (cum[static_cast<size_t>(e)] > pos) {
          want = e;
          break;
        }
      ASSERT_EQ(ix::find_segment(cum.data(), n, pos), want);
    }
  }
}

TEST(IndexMath, WorkRangePartitionsExactlyOnce) {
  for (int64_t programs = 1; programs <= 70; ++programs)
    for (int64_t total : {0, 1, 2, 5, 47, 48, 49, 100, 1000, 4097, 131072}) {
      std::vector<int> hits(static_cast<size_t>(total), 0);
      const int64_t B = (total + programs - 1) / programs;
      int64_t expect_begin = 0;
      for (int64_t pid = 0; pid < programs; ++pid) {
        const ix::Range r = ix::work_range(pid, programs, total);
        ASSERT_GE(r.begin, 0);
        ASSERT_LE(r.end, total);
        ASSERT_LE(r.begin, r.end);
        ASSERT_EQ(r.begin, std::min(pid * B, total));  // contiguous, in pid order
        ASSERT_EQ(r.begin, expect_begin);
        ASSERT_EQ(r.size(), r.end - r.begin);
        expect_begin = r.end;
        for (int64_t i = r.begin; i < r.end; ++i) ++hits[static_cast<size_t>(i)];
      }
      ASSERT_EQ(expect_begin, total);
      for (int64_t i = 0; i < total; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << programs << " " << total;
    }
  EXPECT_EQ(ix::Range({5, 3}).size(), 0);
}

TEST(IndexMath, ColumnTiles) {
  for (int64_t h : {0, 1, 3, 16, 33, 4097})
    for (int64_t bx : {1, 8, 16, 256, 5120}) {
      const int64_t n = ix::num_column_tiles(h, bx);
      EXPECT_EQ(n, (h + bx - 1) / bx);
      int64_t covered = 0;
      for (int64_t t = 0; t < n; ++t) {
        const ix::Range r = ix::column_tile(t, bx, h);
        ASSERT_EQ(r.begin, covered);
        ASSERT_GT(r.size(), 0);
        ASSERT_LE(r.size(), bx);
        if (t + 1 < n) ASSERT_EQ(r.size(), bx);  // only the last tile may be short
        covered = r.end;
      }
      EXPECT_EQ(covered, h);
    }
}

TEST(IndexMath, SixtyFourBitOffsets) {
  // row * H past 2^31: padded_row stays exact in 64 bits.
  const int64_t big = int64_t{1} << 33;
  EXPECT_EQ(ix::padded_row(big + 5, big, big * 2), big * 2 + 5);
  EXPECT_EQ(ix::padded_rows_bound(int64_t{3} << 31, 256, 128), (int64_t{3} << 31) + 256 * 127);
}

}  // namespace
}  // namespace pt
