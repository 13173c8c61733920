// test_plan.cpp — make_plan / make_plan_out against the reference plan and
// hand-computed examples: stable sort, every field, int32 and int64
// top_experts, the capacity bound, row_sources past P.
#include <tuple>

#include "test_util.hpp"

namespace pt {
namespace {

void expect_plan_matches(const padmoe::PlanView& lib, const ref::Plan& r, int64_t row_sources_len) {
  const int64_t A = r.num_tokens * r.top_k;
  const int64_t E = r.num_experts;
  auto check = [&](const TensorView& v, const std::vector<int64_t>& want, int64_t n, const char* name) {
    SCOPED_TRACE(name);
    ASSERT_EQ(v.dtype, DType::kInt32) << "index outputs are int32";
    ASSERT_EQ(v.numel(), n);
    EXPECT_EQ(index_to_vec(v), want);
  };
  check(lib.indices, r.indices, A, "indices");
  check(lib.bin_ids, r.bin_ids, A, "bin_ids");
  check(lib.tokens_per_expert, r.tokens_per_expert, E, "tokens_per_expert");
  check(lib.bins, r.bins, E, "bins");
  check(lib.padded_tokens_per_expert, r.padded_tokens_per_expert, E, "padded_tokens_per_expert");
  check(lib.padded_bins, r.padded_bins, E, "padded_bins");
  check(lib.dest_rows, r.dest_rows, A, "dest_rows");
  std::vector<int64_t> rs = r.row_sources;
  rs.resize(static_cast<size_t>(row_sources_len), -1);  // rows past P (and past capacity) are -1
  check(lib.row_sources, rs, row_sources_len, "row_sources");
  EXPECT_EQ(padmoe::padded_rows(lib), r.padded_rows);
}

// Caller buffers for make_plan_out, every entry poisoned; row_sources has `rows` entries.
struct PoisonedPlan {
  Tensor ind, bid, tpe, bins, ptpe, pb, dest, rs;
  padmoe::PlanView out;
  PoisonedPlan(int64_t A, int E, int64_t rows)
      : ind(poison_index(A)), bid(poison_index(A)), tpe(poison_index(E)), bins(poison_index(E)), ptpe(poison_index(E)),
        pb(poison_index(E)), dest(poison_index(A)), rs(poison_index(rows)) {
    out.indices = ind;
    out.bin_ids = bid;
    out.tokens_per_expert = tpe;
    out.bins = bins;
    out.padded_tokens_per_expert = ptpe;
    out.padded_bins = pb;
    out.dest_rows = dest;
    out.row_sources = rs;
  }
  padmoe::PlanView filled(int64_t T, int K, int E, int m) const {
    padmoe::PlanView v = out;
    v.num_tokens = T;
    v.top_k = K;
    v.num_experts = E;
    v.alignment = m;
    return v;
  }
};

using PlanParam = std::tuple<int64_t, int, int, int, DType, int>;  // T, K, E, m, idx dtype, dist
class MakePlan : public ::testing::TestWithParam<PlanParam> {};

TEST_P(MakePlan, MatchesReference) {
  int64_t T;
  int K, E, m, d;
  DType idx;
  std::tie(T, K, E, m, idx, d) = GetParam();
  if (static_cast<Dist>(d) == Dist::kDistinct && K > E) GTEST_SKIP() << "K > E cannot be distinct";
  const std::vector<int64_t> te = make_routing(T, K, E, static_cast<Dist>(d), static_cast<uint64_t>(T + K + E + m));
  const ref::Plan r = ref::make_plan(te, T, K, E, m);
  const Tensor tet = index_matrix(te, T, K, idx);
  const padmoe::Plan plan = padmoe::make_plan(tet, E, m);
  EXPECT_EQ(plan.num_tokens, T);
  EXPECT_EQ(plan.top_k, K);
  EXPECT_EQ(plan.num_experts, E);
  EXPECT_EQ(plan.alignment, m);
  EXPECT_EQ(plan.num_assignments(), T * K);
  EXPECT_EQ(plan.padded_rows_bound(), r.capacity);
  EXPECT_EQ(plan.padded_rows_bound(), T * K + static_cast<int64_t>(E) * (m - 1));
  EXPECT_EQ(padmoe::padded_rows_bound(T, K, E, m), r.capacity);
  EXPECT_LE(r.padded_rows, r.capacity);
  EXPECT_EQ(padmoe::padded_rows(plan), r.padded_rows);
  expect_plan_matches(plan.view(), r, r.capacity);

  // make_plan_out into poisoned caller buffers, row_sources larger than capacity.
  const int64_t A = T * K, extra = 13;
  const PoisonedPlan buf(A, E, r.capacity + extra);
  padmoe::make_plan_out(tet, E, m, buf.out);
  expect_plan_matches(buf.filled(T, K, E, m), r, r.capacity + extra);
}

// make_plan_and_dispatch: the plan is the reference plan and y the reference gather (bit for bit),
// allocating (y of capacity rows, rows past P zero) and _out (poisoned buffers, rows past P
// untouched), weighted and not.
TEST_P(MakePlan, AndDispatchMatchesReference) {
  int64_t T;
  int K, E, m, d;
  DType idx;
  std::tie(T, K, E, m, idx, d) = GetParam();
  if (static_cast<Dist>(d) == Dist::kDistinct && K > E) GTEST_SKIP() << "K > E cannot be distinct";
  const std::vector<int64_t> te = make_routing(T, K, E, static_cast<Dist>(d), static_cast<uint64_t>(5 * T + K + E + m));
  const ref::Plan r = ref::make_plan(te, T, K, E, m);
  const Tensor tet = index_matrix(te, T, K, idx);
  const int64_t A = T * K, H = 24, P = r.padded_rows;
  Rng rng(static_cast<uint64_t>(T + 7 * K + E));
  const std::vector<float> xf = random_values(T * H, DType::kBFloat16, rng);
  const std::vector<float> wf = random_values(A, DType::kFloat32, rng, 0.0, 1.0);
  const Tensor x = rows_from_float(xf, DType::kBFloat16, T, H);
  const Tensor w = vec_from_float(wf, DType::kFloat32);
  for (bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "weighted" : "unweighted");
    std::optional<TensorView> wopt;
    if (weighted) wopt = w.view();
    const std::vector<float> want = ref::padded_gather(xf, H, r, weighted ? &wf : nullptr);
    const padmoe::PlannedRows pr = padmoe::make_plan_and_dispatch(x, tet, E, m, wopt);
    EXPECT_EQ(pr.plan.num_tokens, T);
    EXPECT_EQ(pr.plan.top_k, K);
    expect_plan_matches(pr.plan.view(), r, r.capacity);
    ASSERT_EQ(pr.y.size(0), r.capacity);
    ASSERT_EQ(pr.y.size(1), H);
    EXPECT_TRUE(rows_bitwise(pr.y, want, P));
    EXPECT_TRUE(bytes_are(pr.y, P, r.capacity, 0)) << "rows past P of the allocating form";
    const PoisonedPlan buf(A, E, r.capacity + 3);
    Tensor y = poison_rows(DType::kBFloat16, r.capacity + 5, H);
    padmoe::make_plan_and_dispatch_out(x, tet, E, m, buf.out, wopt, y);
    expect_plan_matches(buf.filled(T, K, E, m), r, r.capacity + 3);
    EXPECT_TRUE(rows_bitwise(y, want, P));
    EXPECT_TRUE(bytes_are(y, P, r.capacity + 5, kPoison)) << "the _out form wrote past P";
  }
}

TEST(MakePlanAndDispatch, BadInputNamesTheArgumentBeforeWriting) {
  const int64_t T = 5, H = 8;
  const int K = 2, E = 3, m = 4;
  std::vector<int64_t> te = {0, 1, 2, 0, 1, 1, 2, 2, 0, 1};
  const int64_t A = T * K, cap = padmoe::padded_rows_bound(T, K, E, m);
  Rng rng(3);
  const Tensor x = rows_from_float(random_values(T * H, DType::kFloat32, rng), DType::kFloat32, T, H);
  const Tensor w = vec_from_float(random_values(A, DType::kFloat32, rng), DType::kFloat32);
  auto untouched = [&](const PoisonedPlan& b, const Tensor& y) {
    EXPECT_TRUE(all_bytes_are(b.dest, kIndexPoison));
    EXPECT_TRUE(all_bytes_are(b.rs, kIndexPoison));
    EXPECT_TRUE(all_bytes_are(y, kPoison));
  };
  {
    std::vector<int64_t> bad = te;
    bad[7] = 3;  // [3, 1]
    const PoisonedPlan b(A, E, cap);
    Tensor y = poison_rows(DType::kFloat32, cap, H);
    EXPECT_TRUE(throws_error(
        [&] {
          padmoe::make_plan_and_dispatch_out(x, index_matrix(bad, T, K, DType::kInt32), E, m, b.out, std::nullopt, y);
        },
        {"make_plan_and_dispatch", "top_experts", "[3, 1]"}));
    untouched(b, y);
  }
  const Tensor tet = index_matrix(te, T, K, DType::kInt64);
  {
    const Tensor x6 = rows_from_float(std::vector<float>((T + 1) * H, 1.0f), DType::kFloat32, T + 1, H);
    const PoisonedPlan b(A, E, cap);
    Tensor y = poison_rows(DType::kFloat32, cap, H);
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_and_dispatch_out(x6, tet, E, m, b.out, std::nullopt, y); },
                             {"make_plan_and_dispatch", "x"}));
    untouched(b, y);
  }
  {
    const Tensor w9 = vec_from_float(std::vector<float>(A - 1, 0.5f), DType::kFloat32);
    const PoisonedPlan b(A, E, cap);
    Tensor y = poison_rows(DType::kFloat32, cap, H);
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_and_dispatch_out(x, tet, E, m, b.out, w9.view(), y); },
                             {"make_plan_and_dispatch", "weights"}));
    untouched(b, y);
  }
  {
    const PoisonedPlan b(A, E, cap);
    Tensor y = poison_rows(DType::kFloat32, cap - 1, H);  // fewer rows than out.row_sources
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_and_dispatch_out(x, tet, E, m, b.out, w.view(), y); },
                             {"make_plan_and_dispatch", "y"}));
    untouched(b, y);
  }
  {
    const PoisonedPlan b(A, E, cap);
    Tensor y = poison_rows(DType::kFloat16, cap, H);  // not x's dtype
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_and_dispatch_out(x, tet, E, m, b.out, w.view(), y); },
                             {"make_plan_and_dispatch", "y"}));
    untouched(b, y);
  }
}

// The layouts other kernels consume (PlanLayouts, moe_align_block_size) against references written
// from DeepGEMM's and vLLM's definitions, on the same grid.
TEST_P(MakePlan, LayoutsMatchReference) {
  int64_t T;
  int K, E, m, d;
  DType idx;
  std::tie(T, K, E, m, idx, d) = GetParam();
  if (static_cast<Dist>(d) == Dist::kDistinct && K > E) GTEST_SKIP() << "K > E cannot be distinct";
  const std::vector<int64_t> te = make_routing(T, K, E, static_cast<Dist>(d), static_cast<uint64_t>(3 * T + K + E + m));
  const Tensor tet = index_matrix(te, T, K, idx);
  const int64_t A = T * K;
  const int64_t tight = padmoe::aligned_rows_bound(A, E, m);
  EXPECT_EQ(tight, A + std::min<int64_t>(A, E) * (m - 1));
  const ref::Plan r = ref::make_plan(te, T, K, E, m);
  for (int64_t R : {tight, r.capacity + 5}) {
    SCOPED_TRACE("rows " + std::to_string(R));
    const PoisonedPlan buf(A, E, R);
    Tensor re = poison_index(R), be = poison_index((R + m - 1) / m), pt = poison_index(1);
    padmoe::PlanLayouts layouts;
    layouts.row_experts = re;
    layouts.block_experts = be;
    layouts.padded_total = pt;
    padmoe::make_plan_out(tet, E, m, buf.out, layouts);
    expect_plan_matches(buf.filled(T, K, E, m), r, R);  // the plan itself unchanged by the layouts
    EXPECT_EQ(index_to_vec(re), ref::row_experts(te, E, m, R));
    EXPECT_EQ(index_to_vec(be), ref::block_experts(te, E, m, R));
    EXPECT_EQ(index_to_vec(pt), std::vector<int64_t>{r.padded_rows});
  }
  // vLLM's ignore_invalid_experts map: the even experts local in reverse order, the odd ones elsewhere
  std::vector<int64_t> map(static_cast<size_t>(E), -1);
  for (int e = 0; e < E; e += 2) map[static_cast<size_t>(e)] = (E - 1 - e) / 2;
  const Tensor map_t = index_matrix(map, 1, E, idx);
  const padmoe::TensorView map_view = padmoe::TensorView::contiguous(map_t.data(), idx, {E});
  for (bool pad : {false, true}) {
    for (bool mapped : {false, true}) {
      SCOPED_TRACE(std::string(pad ? "pad_sorted_ids" : "unpadded") + (mapped ? ", expert_map" : ""));
      const ref::AlignedBlocks want = ref::moe_align_block_size(te, m, E, pad, mapped ? &map : nullptr);
      const padmoe::AlignedBlocks got = mapped ? padmoe::moe_align_block_size(tet, m, E, map_view, pad)
                                               : padmoe::moe_align_block_size(tet, m, E, pad);
      EXPECT_EQ(index_to_vec(got.sorted_token_ids), want.sorted_token_ids);
      EXPECT_EQ(index_to_vec(got.expert_ids), want.expert_ids);
      EXPECT_EQ(index_to_vec(got.num_tokens_post_padded), std::vector<int64_t>{want.num_tokens_post_padded});
      EXPECT_EQ(got.sorted_token_ids.view().numel(), padmoe::aligned_rows_bound(A, E, m, pad));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, MakePlan,
                         ::testing::Combine(::testing::Values<int64_t>(0, 7, 4096), ::testing::Values(1, 2, 8),
                                            ::testing::Values(1, 16, 128), ::testing::Values(1, 8, 128),
                                            ::testing::Values(DType::kInt32, DType::kInt64),
                                            ::testing::Values(static_cast<int>(Dist::kUniform),
                                                              static_cast<int>(Dist::kSkewed))));

TEST(PlanLayouts, HandExample) {
  // top_experts [[1,0],[0,1],[1,0]], E = 3, block 4: expert 0 <- {1,2,5}, expert 1 <- {0,3,4}, expert 2 <- {}
  const Tensor top = index_matrix({1, 0, 0, 1, 1, 0}, 3, 2, DType::kInt32);
  const padmoe::AlignedBlocks r = padmoe::moe_align_block_size(top, 4, 3);
  // R = 6 + min(6, 3) * 3 = 15; sentinel 6
  EXPECT_EQ(index_to_vec(r.sorted_token_ids), (std::vector<int64_t>{1, 2, 5, 6, 0, 3, 4, 6, 6, 6, 6, 6, 6, 6, 6}));
  EXPECT_EQ(index_to_vec(r.expert_ids), (std::vector<int64_t>{0, 1, -1, -1}));  // -1 past P, as vLLM's kernel
  EXPECT_EQ(index_to_vec(r.num_tokens_post_padded), std::vector<int64_t>{8});
  const padmoe::AlignedBlocks p = padmoe::moe_align_block_size(top, 4, 3, /*pad_sorted_ids=*/true);
  EXPECT_EQ(p.sorted_token_ids.view().numel(), 16);
  EXPECT_EQ(p.expert_ids.view().numel(), 4);
  // expert_map {-1, 0, 1}: expert 0's assignments {1, 2, 5} get no entry; expert 1's are local 0
  const Tensor map = index_matrix({-1, 0, 1}, 1, 3, DType::kInt64);
  const padmoe::AlignedBlocks m =
      padmoe::moe_align_block_size(top, 4, 3, padmoe::TensorView::contiguous(map.data(), DType::kInt64, {3}));
  EXPECT_EQ(index_to_vec(m.sorted_token_ids), (std::vector<int64_t>{0, 3, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6}));
  EXPECT_EQ(index_to_vec(m.expert_ids), (std::vector<int64_t>{0, -1, -1, -1}));
  EXPECT_EQ(index_to_vec(m.num_tokens_post_padded), std::vector<int64_t>{4});
}

// vLLM skips ids outside [0, E) in every mode: their assignments get no entry and count towards no
// expert. The pattern of vLLM's own test (-1, -2, E and E + 7 among valid ids, or nothing else).
TEST(PlanLayouts, SkipsIdsOutsideTheExperts) {
  for (const int E : {8, 80}) {
    for (const bool all_invalid : {false, true}) {
      const int64_t T = 300, K = 4, A = T * K;
      std::vector<int64_t> te(static_cast<size_t>(A));
      for (int64_t i = 0; i < A; ++i) {
        int64_t v = i % E;
        if (all_invalid) v = i % 3 == 0 ? -1 : (i % 3 == 1 ? E : E + 7);
        else if (i % 11 == 0) v = -1;
        else if (i % 17 == 3) v = -2;
        else if (i % 19 == 5) v = E;
        else if (i % 23 == 7) v = E + 7;
        te[static_cast<size_t>(i)] = v;
      }
      std::vector<int64_t> map(static_cast<size_t>(E), -1);
      for (int e = 0; e < E; e += 2) map[static_cast<size_t>(e)] = e / 2;
      for (const DType idx : {DType::kInt32, DType::kInt64}) {
        const Tensor tet = index_matrix(te, T, static_cast<int>(K), idx);
        const Tensor map_t = index_matrix(map, 1, E, idx);
        const padmoe::TensorView map_view = padmoe::TensorView::contiguous(map_t.data(), idx, {E});
        for (const bool mapped : {false, true}) {
          SCOPED_TRACE("E " + std::to_string(E) + (all_invalid ? ", all invalid" : "") +
                       (idx == DType::kInt64 ? ", int64" : ", int32") + (mapped ? ", expert_map" : ""));
          const int block = E == 8 ? 16 : 8;
          const ref::AlignedBlocks want = ref::moe_align_block_size(te, block, E, false, mapped ? &map : nullptr);
          const padmoe::AlignedBlocks got = mapped ? padmoe::moe_align_block_size(tet, block, E, map_view)
                                                   : padmoe::moe_align_block_size(tet, block, E);
          EXPECT_EQ(index_to_vec(got.sorted_token_ids), want.sorted_token_ids);
          EXPECT_EQ(index_to_vec(got.expert_ids), want.expert_ids);
          EXPECT_EQ(index_to_vec(got.num_tokens_post_padded), std::vector<int64_t>{want.num_tokens_post_padded});
          if (all_invalid) EXPECT_EQ(want.num_tokens_post_padded, 0);
        }
      }
    }
  }
}

TEST(PlanLayouts, BadInputNamesTheArgument) {
  const Tensor top = index_matrix({1, 0, 0, 1, 1, 0}, 3, 2, DType::kInt32);
  EXPECT_TRUE(throws_error([&] { padmoe::moe_align_block_size(top, 0, 3); }, {"moe_align_block_size", "block_size"}));
  const Tensor bad_map = index_matrix({0, 3, -1}, 1, 3, DType::kInt32);
  EXPECT_TRUE(throws_error(
      [&] {
        padmoe::moe_align_block_size(top, 4, 3, padmoe::TensorView::contiguous(bad_map.data(), DType::kInt32, {3}));
      },
      {"moe_align_block_size", "expert_map", "entry 1 is 3"}));
  const Tensor short_map = index_matrix({0, 1}, 1, 2, DType::kInt32);
  EXPECT_TRUE(throws_error(
      [&] {
        padmoe::moe_align_block_size(top, 4, 3, padmoe::TensorView::contiguous(short_map.data(), DType::kInt32, {2}));
      },
      {"moe_align_block_size", "expert_map"}));
  padmoe::Plan plan = padmoe::Plan::empty(3, 2, 3, 4);
  Tensor short_rows = poison_index(plan.padded_rows_bound() - 1);
  padmoe::PlanLayouts l;
  l.row_experts = short_rows;
  EXPECT_TRUE(
      throws_error([&] { padmoe::make_plan_out(top, 3, 4, plan.view(), l); }, {"make_plan", "layouts.row_experts"}));
  Tensor f32 = Tensor::empty(DType::kFloat32, {1});
  padmoe::PlanLayouts l2;
  l2.padded_total = f32;
  EXPECT_TRUE(
      throws_error([&] { padmoe::make_plan_out(top, 3, 4, plan.view(), l2); }, {"make_plan", "layouts.padded_total"}));
}

TEST(MakePlan, StableSortHandExample) {
  // top_experts [[1,0],[0,1],[1,0]] (K = 2): a -> expert: 0->1 1->0 2->0 3->1 4->1 5->0
  const std::vector<int64_t> te = {1, 0, 0, 1, 1, 0};
  for (DType idx : {DType::kInt32, DType::kInt64}) {
    const padmoe::Plan p = padmoe::make_plan(index_matrix(te, 3, 2, idx), 2, 4);
    EXPECT_EQ(index_to_vec(p.indices), (std::vector<int64_t>{1, 2, 5, 0, 3, 4}));
    EXPECT_EQ(index_to_vec(p.bin_ids), (std::vector<int64_t>{0, 0, 0, 1, 1, 1}));
    EXPECT_EQ(index_to_vec(p.tokens_per_expert), (std::vector<int64_t>{3, 3}));
    EXPECT_EQ(index_to_vec(p.bins), (std::vector<int64_t>{3, 6}));
    EXPECT_EQ(index_to_vec(p.padded_tokens_per_expert), (std::vector<int64_t>{4, 4}));
    EXPECT_EQ(index_to_vec(p.padded_bins), (std::vector<int64_t>{4, 8}));
    EXPECT_EQ(index_to_vec(p.dest_rows), (std::vector<int64_t>{4, 0, 1, 5, 6, 2}));
    // capacity = 6 + 2 * 3 = 12
    EXPECT_EQ(index_to_vec(p.row_sources), (std::vector<int64_t>{1, 2, 5, -1, 0, 3, 4, -1, -1, -1, -1, -1}));
    EXPECT_EQ(padmoe::padded_rows(p), 8);
  }
}

TEST(MakePlan, AlignmentOneHasNoPadding) {
  const std::vector<int64_t> te = {2, 2, 0, 2, 1, 0};
  const padmoe::Plan p = padmoe::make_plan(index_matrix(te, 6, 1, DType::kInt32), 4, 1);
  EXPECT_EQ(index_to_vec(p.indices), (std::vector<int64_t>{2, 5, 4, 0, 1, 3}));
  EXPECT_EQ(index_to_vec(p.bins), (std::vector<int64_t>{2, 3, 6, 6}));
  EXPECT_EQ(index_to_vec(p.padded_bins), (std::vector<int64_t>{2, 3, 6, 6}));
  EXPECT_EQ(index_to_vec(p.row_sources), (std::vector<int64_t>{2, 5, 4, 0, 1, 3}));
  EXPECT_EQ(index_to_vec(p.dest_rows), (std::vector<int64_t>{3, 4, 0, 5, 2, 1}));
}

TEST(MakePlan, AllTokensToOneExpertAndEmptyExperts) {
  const int64_t T = 37;
  const std::vector<int64_t> te(T, 5);
  const padmoe::Plan p = padmoe::make_plan(index_matrix(te, T, 1, DType::kInt64), 8, 16);
  EXPECT_EQ(index_to_vec(p.tokens_per_expert), (std::vector<int64_t>{0, 0, 0, 0, 0, 37, 0, 0}));
  EXPECT_EQ(index_to_vec(p.padded_tokens_per_expert), (std::vector<int64_t>{0, 0, 0, 0, 0, 48, 0, 0}));
  EXPECT_EQ(index_to_vec(p.padded_bins), (std::vector<int64_t>{0, 0, 0, 0, 0, 48, 48, 48}));
  std::vector<int64_t> rs(static_cast<size_t>(T + 8 * 15), -1);
  for (int64_t t = 0; t < T; ++t) rs[static_cast<size_t>(t)] = t;
  EXPECT_EQ(index_to_vec(p.row_sources), rs);
}

TEST(MakePlan, EmptyInput) {
  Tensor te = Tensor::empty(DType::kInt32, {0, 4});
  const padmoe::Plan p = padmoe::make_plan(te, 3, 8);
  EXPECT_EQ(p.num_assignments(), 0);
  EXPECT_EQ(p.indices.numel(), 0);
  EXPECT_EQ(index_to_vec(p.bins), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(index_to_vec(p.padded_bins), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(padmoe::padded_rows(p), 0);
  EXPECT_EQ(index_to_vec(p.row_sources), std::vector<int64_t>(3 * 7, -1));
}

// A view of no elements is contiguous whatever its strides (as torch and numpy say: torch.empty(6, 0)
// has strides (1, 1)), so a [T, 0] map gets the error on what is wrong with it: top_k.
TEST(MakePlan, ZeroTopKWithAnyStrides) {
  Tensor storage = Tensor::empty(DType::kInt32, {1});
  padmoe::TensorView top = storage.view();
  top.ndim = 2;
  top.shape[0] = 6;
  top.shape[1] = 0;
  top.strides[0] = 1;
  top.strides[1] = 1;
  EXPECT_TRUE(top.is_contiguous());
  EXPECT_TRUE(throws_error([&] { padmoe::make_plan(top, 3, 4); }, {"make_plan: top_k: ", "got 0"}));
  Tensor sorted = poison_index(64), experts = poison_index(4), total = poison_index(1);
  EXPECT_TRUE(
      throws_error([&] { padmoe::moe_align_block_size_out(top, 16, 3, padmoe::TensorView{}, sorted, experts, total); },
                   {"moe_align_block_size: top_k: ", "got 0"}));
  // one element with a wrong stride is not contiguous
  top.shape[1] = 1;
  top.strides[0] = 2;
  EXPECT_FALSE(top.is_contiguous());
}

TEST(MakePlan, ThreadCountDoesNotChangeThePlan) {
  const int64_t T = 5000;
  const int K = 4, E = 64, m = 16;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 77);
  const ref::Plan r = ref::make_plan(te, T, K, E, m);
  const Tensor tet = index_matrix(te, T, K, DType::kInt32);
  for (int threads : {1, 2, 3, 7}) {
    SCOPED_TRACE(threads);
    padmoe::Options o;
    o.num_threads = threads;
    const padmoe::Plan p = padmoe::make_plan(tet, E, m, o);
    expect_plan_matches(p.view(), r, r.capacity);
  }
}


// vLLM's batched_moe_align_block_size against the reference loops: E = 0, counts 0 and at the
// maximum, block_size 1 and larger than max_tokens, int32 and int64 counts, one thread and several.
// Every entry of the poisoned _out buffers is written.
TEST(BatchedAlignBlocks, MatchesReference) {
  Rng rng(17);
  for (const int E : {0, 1, 3, 64, 300}) {
    for (const int max_tokens : {0, 1, 13, 16, 512}) {
      for (const int block : {1, 8, 16, 64, 600}) {
        std::vector<int64_t> counts(static_cast<size_t>(E));
        for (int e = 0; e < E; ++e) {
          const int64_t r = rng.below(4);  // 0, the maximum, or anything between
          counts[static_cast<size_t>(e)] = r == 0 ? 0 : (r == 1 ? max_tokens : rng.below(max_tokens + 1));
        }
        const ref::AlignedBlocks want = ref::batched_moe_align_block_size(counts, max_tokens, block);
        const int64_t n = static_cast<int64_t>(want.sorted_token_ids.size());
        ASSERT_EQ(n, (max_tokens + block - 1) / block * block * E);
        for (const DType idx : {DType::kInt32, DType::kInt64}) {
          for (const int threads : {1, 4}) {
            SCOPED_TRACE("E " + std::to_string(E) + " max_tokens " + std::to_string(max_tokens) + " block " +
                         std::to_string(block) + (idx == DType::kInt64 ? " int64" : " int32") + " threads " +
                         std::to_string(threads));
            const Tensor c = index_tensor(counts, idx);
            Tensor sorted = poison_index(n), blocks = poison_index(n / block), post = poison_index(1);
            padmoe::Options o;
            o.num_threads = threads;
            padmoe::batched_moe_align_block_size_out(c, max_tokens, block, sorted, blocks, post, o);
            EXPECT_EQ(index_to_vec(sorted), want.sorted_token_ids);
            EXPECT_EQ(index_to_vec(blocks), want.expert_ids);
            EXPECT_EQ(index_to_vec(post), std::vector<int64_t>{want.num_tokens_post_padded});
          }
        }
        const padmoe::AlignedBlocks got =
            padmoe::batched_moe_align_block_size(index_tensor(counts, DType::kInt32), max_tokens, block);
        EXPECT_EQ(index_to_vec(got.sorted_token_ids), want.sorted_token_ids);
        EXPECT_EQ(index_to_vec(got.expert_ids), want.expert_ids);
        EXPECT_EQ(index_to_vec(got.num_tokens_post_padded), std::vector<int64_t>{want.num_tokens_post_padded});
      }
    }
  }
}

TEST(BatchedAlignBlocks, HandExample) {
  // counts {3, 0, 16, 5}, max_tokens 16, block 8: runs of 8, 0, 16 and 8 entries; sentinel 4 * 16 = 64
  const Tensor c = index_tensor({3, 0, 16, 5}, DType::kInt64);
  const padmoe::AlignedBlocks r = padmoe::batched_moe_align_block_size(c, 16, 8);
  std::vector<int64_t> want(64, 64);
  for (int j = 0; j < 3; ++j) want[static_cast<size_t>(j)] = j;
  for (int j = 0; j < 16; ++j) want[static_cast<size_t>(8 + j)] = 32 + j;
  for (int j = 0; j < 5; ++j) want[static_cast<size_t>(24 + j)] = 48 + j;
  EXPECT_EQ(index_to_vec(r.sorted_token_ids), want);
  EXPECT_EQ(index_to_vec(r.expert_ids), (std::vector<int64_t>{0, 2, 2, 3, -1, -1, -1, -1}));
  EXPECT_EQ(index_to_vec(r.num_tokens_post_padded), std::vector<int64_t>{32});
  // E = 0: empty outputs, a padded total of 0 (any max_tokens and block_size)
  const padmoe::AlignedBlocks z = padmoe::batched_moe_align_block_size(index_tensor({}, DType::kInt32), 1 << 30, 7);
  EXPECT_EQ(z.sorted_token_ids.view().numel(), 0);
  EXPECT_EQ(z.expert_ids.view().numel(), 0);
  EXPECT_EQ(index_to_vec(z.num_tokens_post_padded), std::vector<int64_t>{0});
  // max_tokens 0: no entries, every count must be 0
  const padmoe::AlignedBlocks m0 = padmoe::batched_moe_align_block_size(index_tensor({0, 0, 0}, DType::kInt32), 0, 4);
  EXPECT_EQ(m0.sorted_token_ids.view().numel(), 0);
  EXPECT_EQ(index_to_vec(m0.num_tokens_post_padded), std::vector<int64_t>{0});
}

TEST(BatchedAlignBlocks, BadInputNamesTheArgumentAndWritesNothing) {
  const char* op = "batched_moe_align_block_size";
  const int kValue = static_cast<int>(padmoe::ErrorKind::kValue), kType = static_cast<int>(padmoe::ErrorKind::kType);
  for (const DType idx : {DType::kInt32, DType::kInt64}) {
    for (const auto& bad : {std::make_pair(std::vector<int64_t>{3, 17, -1}, "entry 1 is 17"),
                            std::make_pair(std::vector<int64_t>{3, -1, 17}, "entry 1 is -1"),
                            std::make_pair(std::vector<int64_t>{0, 0, 0, 16, 0, 0, 99}, "entry 6 is 99")}) {
      const Tensor c = index_tensor(bad.first, idx);
      const int64_t n = 16 * static_cast<int64_t>(bad.first.size());
      Tensor sorted = poison_index(n), blocks = poison_index(n / 8), post = poison_index(1);
      EXPECT_TRUE(throws_error(
          [&] { padmoe::batched_moe_align_block_size_out(c, 16, 8, sorted, blocks, post); },
          {std::string(op) + ": expert_num_tokens: " + bad.second + ", outside [0, max_tokens_per_batch = 16]"},
          kValue));
      EXPECT_TRUE(all_bytes_are(sorted, kIndexPoison));
      EXPECT_TRUE(all_bytes_are(blocks, kIndexPoison));
      EXPECT_TRUE(all_bytes_are(post, kIndexPoison));
    }
  }
  const Tensor c = index_tensor({3, 0, 5}, DType::kInt32);
  EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size(c, 16, 0); },
                           {std::string(op) + ": block_size: must be >= 1, got 0"}, kValue));
  EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size(c, -1, 8); },
                           {std::string(op) + ": max_tokens_per_batch: must be >= 0, got -1"}, kValue));
  EXPECT_TRUE(throws_error(
      [&] { padmoe::batched_moe_align_block_size(index_tensor({1, 4}, DType::kInt32), 0, 8); },
      {std::string(op) + ": expert_num_tokens: entry 0 is 1, outside [0, max_tokens_per_batch = 0]"}, kValue));
  const Tensor f = Tensor::empty(DType::kFloat32, {3});
  EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size(f, 16, 8); },
                           {op, "expert_num_tokens", "expected int32 or int64"}, kType));
  const Tensor c2 = index_matrix({3, 0, 5, 1}, 2, 2, DType::kInt32);
  EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size(c2, 16, 8); },
                           {op, "expert_num_tokens", "expected a 1-D tensor"}, kValue));
  // N = 2^31 entries: one past the int32 outputs
  const Tensor wide = Tensor::empty(DType::kInt32, {int64_t{1} << 16});
  EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size(wide, 1 << 15, 8); },
                           {op, "sorted_ids", "size overflow"}, kValue));
  // output sizes, dtypes and aliasing
  Tensor sorted = poison_index(48), blocks = poison_index(6), post = poison_index(1);
  Tensor short_sorted = poison_index(40), long_blocks = poison_index(7), two = poison_index(2);
  EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size_out(c, 16, 8, short_sorted, blocks, post); },
                           {op, "sorted_ids", "needs 48 entries, got 40"}, kValue));
  EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size_out(c, 16, 8, sorted, long_blocks, post); },
                           {op, "block_ids", "needs 6 entries, got 7"}, kValue));
  EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size_out(c, 16, 8, sorted, blocks, two); },
                           {op, "num_tokens_post_pad"}, kValue));
  const Tensor f48 = Tensor::empty(DType::kFloat32, {48});
  EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size_out(c, 16, 8, f48, blocks, post); },
                           {op, "sorted_ids", "expected int32"}, kType));
  const TensorView head = TensorView::contiguous(sorted.data(), DType::kInt32, {6});
  EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size_out(c, 16, 8, sorted, head, post); },
                           {op, "block_ids: shares memory with sorted_ids"}, kValue));
  EXPECT_TRUE(all_bytes_are(sorted, kIndexPoison));
}

}  // namespace
}  // namespace pt
