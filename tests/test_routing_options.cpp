// test_routing_options.cpp — make_plan's PlanOptions: local experts by a
// range or an expert map, dropping invalid ids, a fixed capacity with the position and probs drop
// policies, the dropped count; the row ops on plans with dropped assignments; bad options.
// Everything against ref::make_plan(..., RoutingOptions), written from docs/spec.md §4's words.
#include "test_util.hpp"

namespace pt {
namespace {

using padmoe::DropPolicy;
using padmoe::PlanOptions;

// Ids in [lo, hi) (so some are invalid when lo < 0 or hi > G), K distinct per token where possible.
std::vector<int64_t> ids_in(int64_t T, int K, int64_t lo, int64_t hi, uint64_t seed) {
  Rng rng(seed);
  std::vector<int64_t> v(static_cast<size_t>(T * K));
  for (auto& x : v) x = lo + rng.below(hi - lo);
  return v;
}

PlanOptions to_options(const ref::RoutingOptions& r, Tensor& map_holder, Tensor& probs_holder) {
  PlanOptions o;
  o.global_experts = r.global_experts;
  o.first_expert = r.first_expert;
  if (!r.expert_map.empty()) {
    map_holder = index_tensor(r.expert_map, DType::kInt64);
    o.expert_map = map_holder;
  }
  o.drop_invalid = r.drop_invalid;
  o.expert_capacity = r.expert_capacity;
  if (r.by_probs) {
    o.drop_policy = DropPolicy::kProbs;
    probs_holder = vec_from_float(r.probs, DType::kFloat32);
    o.probs = probs_holder;
  }
  return o;
}

// make_plan (both forms) and make_plan_out with layouts against the reference.
void expect_routed(const std::vector<int64_t>& te, int64_t T, int K, int E, int m, const ref::RoutingOptions& r,
                   DType id_dtype = DType::kInt32, int threads = 0) {
  const ref::RoutedPlan want = ref::make_plan(te, T, K, E, m, r);
  Tensor top = index_matrix(te, T, K, id_dtype);
  Tensor map_holder, probs_holder;
  PlanOptions o = to_options(r, map_holder, probs_holder);
  Tensor dropped = poison_index(1);
  o.dropped = dropped;
  padmoe::Options opt;
  opt.num_threads = threads;
  const padmoe::Plan plan = padmoe::make_plan(top, E, m, o, opt);
  ASSERT_EQ(plan.padded_rows_bound(), want.plan.capacity);
  EXPECT_TRUE(plan_equals(plan.view(), want.plan));
  EXPECT_EQ(index_to_vec(dropped)[0], want.dropped);
  EXPECT_EQ(padmoe::padded_rows(plan), want.plan.padded_rows);

  // _out form with every layout, into poisoned buffers one row larger than needed.
  const int64_t R = want.plan.capacity + 1;
  padmoe::Plan out = padmoe::Plan::empty(T, K, E, m);
  out.row_sources = poison_index(R);
  Tensor row_experts = poison_index(R), block_experts = poison_index((R + m - 1) / m), total = poison_index(1);
  padmoe::PlanLayouts l;
  l.row_experts = row_experts;
  l.block_experts = block_experts;
  l.padded_total = total;
  padmoe::make_plan_out(top, E, m, out.view(), l, o, opt);
  ref::Plan wide = want.plan;
  wide.row_sources.push_back(-1);
  EXPECT_TRUE(plan_equals(out.view(), wide));
  std::vector<int64_t> want_rows(static_cast<size_t>(R), -1);
  for (int64_t row = 0, e = 0; row < want.plan.padded_rows; ++row) {
    while (want.plan.padded_bins[e] <= row) ++e;  // the segment holding the row
    if (want.plan.row_sources[row] >= 0) want_rows[row] = e;
  }
  EXPECT_TRUE(same_vec(row_experts, want_rows, "row_experts"));
  std::vector<int64_t> want_blocks(static_cast<size_t>((R + m - 1) / m), -1);
  for (int64_t b = 0; b < static_cast<int64_t>(want_blocks.size()); ++b) {
    for (int64_t e = 0; e < E && b * m < want.plan.padded_rows; ++e) {
      if (b * m < want.plan.padded_bins[e]) {
        want_blocks[b] = e;
        break;
      }
    }
  }
  EXPECT_TRUE(same_vec(block_experts, want_blocks, "block_experts"));
  EXPECT_EQ(index_to_vec(total)[0], want.plan.padded_rows);
}

TEST(RoutingOptions, LocalExpertRange) {
  const int64_t T = 301;
  const int K = 3, G = 16, E = 4;
  const std::vector<int64_t> te = ids_in(T, K, 0, G, 1);
  for (int first : {0, 5, 12}) {
    for (int m : {1, 4, 16}) {
      SCOPED_TRACE("first=" + std::to_string(first) + " m=" + std::to_string(m));
      ref::RoutingOptions r;
      r.global_experts = G;
      r.first_expert = first;
      expect_routed(te, T, K, E, m, r);
      expect_routed(te, T, K, E, m, r, DType::kInt64, 1);
    }
  }
}

TEST(RoutingOptions, ExpertMap) {
  const int64_t T = 257;
  const int K = 4, G = 12, E = 5;
  const std::vector<int64_t> te = ids_in(T, K, 0, G, 2);
  // global 1, 3, 4, 8, 11 are local (in a shuffled order); the rest -1
  ref::RoutingOptions r;
  r.global_experts = G;
  r.expert_map.assign(G, -1);
  r.expert_map[1] = 3;
  r.expert_map[3] = 0;
  r.expert_map[4] = 4;
  r.expert_map[8] = 1;
  r.expert_map[11] = 2;
  for (int m : {1, 8}) expect_routed(te, T, K, E, m, r);
  // a map that keeps nothing: an empty plan
  ref::RoutingOptions none = r;
  none.expert_map.assign(G, -1);
  expect_routed(te, T, K, E, 4, none);
}

TEST(RoutingOptions, DropInvalidIds) {
  const int64_t T = 199;
  const int K = 2, E = 6;
  // ids in [-2, E]: negatives and transformers' E for tokens of other ranks
  const std::vector<int64_t> te = ids_in(T, K, -2, E + 1, 3);
  ref::RoutingOptions r;
  r.drop_invalid = true;
  for (int m : {1, 4}) expect_routed(te, T, K, E, m, r);
  // with expert parallelism too
  r.global_experts = E;
  ref::RoutingOptions ep = r;
  ep.global_experts = 12;
  ep.first_expert = 3;
  expect_routed(ids_in(T, K, -1, 13, 4), T, K, 4, 2, ep);

  // not asked for: an error naming the first invalid id, with nothing written
  Tensor top = index_matrix(te, T, K, DType::kInt32);
  int64_t first = 0;
  while (te[first] >= 0 && te[first] < E) ++first;
  padmoe::Plan out = padmoe::Plan::empty(T, K, E, 4);
  Tensor before = poison_index(out.dest_rows.numel());
  std::memcpy(out.dest_rows.data(), before.data(), static_cast<size_t>(before.numel()) * 4);
  PlanOptions o;
  EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(top, E, 4, out.view(), {}, o); },
                           {"make_plan: top_experts: expert id " + std::to_string(te[first]) + " at [" +
                                std::to_string(first / K) + ", " + std::to_string(first % K) + "]",
                            "outside [0, 6)"}));
  EXPECT_TRUE(same_bytes(out.dest_rows, before)) << "written before the error";
}

TEST(RoutingOptions, CapacityFirstAssignments) {
  const int64_t T = 333;
  const int K = 2, E = 7;
  for (Dist d : {Dist::kUniform, Dist::kSkewed}) {
    const std::vector<int64_t> te = make_routing(T, K, E, d, 9);
    for (int64_t C : {0, 1, 8, 40, 96, 1000}) {
      for (int m : {1, 8}) {
        if (C % m != 0) continue;
        SCOPED_TRACE("C=" + std::to_string(C) + " m=" + std::to_string(m));
        ref::RoutingOptions r;
        r.expert_capacity = C;
        expect_routed(te, T, K, E, m, r);
      }
    }
  }
}

TEST(RoutingOptions, CapacityLargestProbs) {
  const int64_t T = 517;
  const int K = 3, E = 5;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 10);
  Rng rng(11);
  for (bool ties : {false, true}) {
    std::vector<float> probs(static_cast<size_t>(T * K));
    // with ties: probs from 7 values, so the threshold value repeats and ids break the tie
    for (auto& p : probs) p = ties ? static_cast<float>(rng.below(7)) / 8.0f : static_cast<float>(rng.uniform(0, 1));
    for (int64_t C : {0, 3, 64, 100, 4096}) {
      SCOPED_TRACE("ties=" + std::to_string(ties) + " C=" + std::to_string(C));
      ref::RoutingOptions r;
      r.expert_capacity = C;
      r.by_probs = true;
      r.probs = probs;
      expect_routed(te, T, K, E, 1, r);
      expect_routed(te, T, K, E, 1, r, DType::kInt64, 1);
    }
  }
}

TEST(RoutingOptions, CapacityWithExpertMapAndInvalidIds) {
  const int64_t T = 400;
  const int K = 4, G = 9, E = 3;
  const std::vector<int64_t> te = ids_in(T, K, -1, G + 1, 12);
  Rng rng(13);
  ref::RoutingOptions r;
  r.global_experts = G;
  r.expert_map = {-1, 2, -1, 0, -1, -1, 1, -1, -1};
  r.drop_invalid = true;
  r.expert_capacity = 24;
  expect_routed(te, T, K, E, 4, r);
  r.by_probs = true;
  r.probs.resize(static_cast<size_t>(T * K));
  for (auto& p : r.probs) p = static_cast<float>(rng.uniform(0, 1));
  expect_routed(te, T, K, E, 4, r);
}

TEST(RoutingOptions, DeterministicAcrossThreads) {
  const int64_t T = 40000;  // several workers
  const int K = 2, E = 8;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 14);
  Rng rng(15);
  ref::RoutingOptions r;
  r.expert_capacity = 6000;
  r.by_probs = true;
  r.probs.resize(static_cast<size_t>(T * K));
  for (auto& p : r.probs) p = static_cast<float>(rng.below(50)) / 64.0f;
  for (int threads : {1, 3, 16}) expect_routed(te, T, K, E, 8, r, DType::kInt32, threads);
}

// The row ops on a plan with dropped assignments: dispatch writes only kept rows, combine adds
// nothing for a dropped assignment, its weight gradient is zero.
TEST(RoutingOptions, RowOpsSkipDroppedAssignments) {
  const int64_t T = 97, H = 40;
  const int K = 3, G = 10, E = 4;
  const std::vector<int64_t> te = ids_in(T, K, 0, G, 16);
  ref::RoutingOptions r;
  r.global_experts = G;
  r.first_expert = 2;
  r.expert_capacity = 24;
  const ref::RoutedPlan want = ref::make_plan(te, T, K, E, 4, r);
  ASSERT_GT(want.dropped, 0);
  Tensor top = index_matrix(te, T, K, DType::kInt32);
  Tensor mh, ph;
  const padmoe::Plan plan = padmoe::make_plan(top, E, 4, to_options(r, mh, ph));
  Rng rng(17);
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(dname(dt));
    const std::vector<float> xf = random_values(T * H, dt, rng);
    std::vector<float> wf = random_values(T * K, DType::kFloat32, rng, 0, 1);
    Tensor x = rows_from_float(xf, dt, T, H), w = vec_from_float(wf, DType::kFloat32);
    const int64_t P = want.plan.padded_rows;
    // dispatch (weighted): kept rows as the reference, padding rows zero
    Tensor y = poison_rows(dt, P, H);
    padmoe::dispatch_out(x, plan.view(), TensorView(w), y);
    EXPECT_TRUE(rows_bitwise(y, ref::padded_gather(xf, H, want.plan, &wf), P, 0, H));
    // combine: dropped assignments add nothing
    const std::vector<float> yf = random_values(P * H, dt, rng);
    Tensor yin = rows_from_float(yf, dt, P, H);
    Tensor out = padmoe::combine(yin, plan.view(), TensorView(w));
    EXPECT_TRUE(
        sums_close(out, ref::padded_scatter(yf, H, want.plan, &wf), ref_scatter_abs(yf, H, want.plan, &wf), K, T));
    // combine_backward: grad_weights zero for dropped assignments, grad_y as the reference
    const std::vector<float> gf = random_values(T * H, dt, rng);
    Tensor g = rows_from_float(gf, dt, T, H);
    padmoe::RowGrads grads = padmoe::combine_backward(g, yin, plan.view(), TensorView(w));
    const std::vector<double> wg = ref::padded_scatter_wgrad(yf, gf, H, want.plan);
    const std::vector<float> gw = vec_to_float(grads.grad_weights);
    for (int64_t a = 0; a < T * K; ++a) {
      if (want.plan.dest_rows[a] < 0) {
        EXPECT_EQ(gw[a], 0.0f) << "dropped assignment " << a;
      } else {
        EXPECT_NEAR(gw[a], wg[a], 1e-2 * (1 + std::fabs(wg[a]))) << "assignment " << a;
      }
    }
    EXPECT_TRUE(rows_bitwise(grads.grad_rows, ref::padded_gather(gf, H, want.plan, &wf), P, 0, H));
  }
}

TEST(RoutingOptions, BadOptionsAreNamedErrors) {
  const int64_t T = 20;
  const int K = 2, E = 4;
  const std::vector<int64_t> te = ids_in(T, K, 0, 8, 18);
  Tensor top = index_matrix(te, T, K, DType::kInt32);
  padmoe::Plan out = padmoe::Plan::empty(T, K, E, 4);
  out.row_sources = poison_index(T * K * 4);
  Tensor before = poison_index(T * K);
  std::memcpy(out.dest_rows.data(), before.data(), static_cast<size_t>(T * K) * 4);
  auto expect_error = [&](const PlanOptions& o, std::vector<std::string> needles, int m = 4) {
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(top, E, m, out.view(), {}, o); }, needles));
    EXPECT_TRUE(same_bytes(out.dest_rows, before)) << "written before the error";
  };
  PlanOptions o;
  o.global_experts = 8;
  Tensor short_map = index_tensor({0, 1, 2}, DType::kInt32);
  PlanOptions m1 = o;
  m1.expert_map = short_map;
  expect_error(m1, {"plan_options.expert_map", "expected 8 entries"});
  Tensor bad_map = index_tensor({-1, 0, 1, 2, 3, 4, -1, -1}, DType::kInt32);
  PlanOptions m2 = o;
  m2.expert_map = bad_map;
  expect_error(m2, {"plan_options.expert_map: entry 5 is 4, outside [-1, 4)"});
  Tensor low_map = index_tensor({-1, 0, 1, -2, 3, 2, -1, -1}, DType::kInt64);
  PlanOptions m3 = o;
  m3.expert_map = low_map;
  expect_error(m3, {"plan_options.expert_map: entry 3 is -2"});
  PlanOptions m4 = m2;
  m4.expert_map = index_tensor({-1, 0, 1, 2, 3, -1, -1, -1}, DType::kInt32);
  m4.first_expert = 2;
  expect_error(m4, {"plan_options.first_expert", "must be 0 with an expert_map"});
  PlanOptions r1 = o;
  r1.first_expert = 5;
  expect_error(r1, {"plan_options.first_expert", "[5, 9)", "inside [0, global_experts = 8)"});
  PlanOptions r2;
  r2.global_experts = -3;
  expect_error(r2, {"plan_options.global_experts", "must be >= 0"});
  PlanOptions ids;  // ids up to 7 with 4 experts and no global_experts
  expect_error(ids, {"make_plan: top_experts: expert id", "outside [0, 4)"});
  PlanOptions c1 = o;
  c1.expert_capacity = 6;
  expect_error(c1, {"plan_options.expert_capacity", "alignment 4 must divide the capacity 6"});
  PlanOptions c2 = o;
  c2.expert_capacity = -2;
  expect_error(c2, {"plan_options.expert_capacity", "must be >= 0"});
  PlanOptions c3 = o;
  c3.expert_capacity = int64_t{1} << 30;
  expect_error(c3, {"plan_options.expert_capacity", "size overflow"});
  PlanOptions p1 = o;
  p1.drop_policy = DropPolicy::kProbs;
  expect_error(p1, {"plan_options.drop_policy", "needs a capacity"});
  PlanOptions p2 = p1;
  p2.expert_capacity = 8;
  expect_error(p2, {"plan_options.probs", "needs the router weights"});
  Tensor probs_short = vec_from_float(std::vector<float>(T * K - 1, 0.5f), DType::kFloat32);
  PlanOptions p3 = p2;
  p3.probs = probs_short;
  expect_error(p3, {"plan_options.probs", "expected " + std::to_string(T * K) + " elements"});
  Tensor probs = vec_from_float(std::vector<float>(T * K, 0.5f), DType::kFloat32);
  PlanOptions p4 = o;
  p4.probs = probs;
  expect_error(p4, {"plan_options.probs", "are read only by the probs drop policy"});
  Tensor probs_int = index_tensor(std::vector<int64_t>(T * K, 0), DType::kInt32);
  PlanOptions p5 = p2;
  p5.probs = probs_int;
  expect_error(p5, {"plan_options.probs", "expected float32, float16 or bfloat16"});
  Tensor dropped64 = index_tensor({0}, DType::kInt64);
  PlanOptions d1 = o;
  d1.dropped = dropped64;
  expect_error(d1, {"plan_options.dropped", "expected int32"});
  // capacity: row_sources must hold E * C rows
  PlanOptions c4 = o;
  c4.expert_capacity = 64;  // E * C = 256 > the 160 given
  expect_error(c4, {"out.row_sources", "output capacity: needs at least 256"});
}

}  // namespace
}  // namespace pt
