// test_rows_plan.cpp — dispatch / combine on a plan, and every backward rule of
// docs/spec.md §9, against expected values built from the reference:
//   grad of gather (rows)   = reference scatter(grad_y, weights = None)
//   grad of gather (weights)= reference wgrad(grad_y, x)      (<grad_y[row], x[token]>)
//   grad of scatter (rows)  = reference gather(grad_out, weights)   (bitwise)
//   grad of scatter (w)     = reference wgrad(y, grad_out)
// Moves are compared bitwise, sums within the tolerance of test_util.hpp.
#include <tuple>

#include "rows_case.hpp"

namespace pt {
namespace {

struct Fixture {
  int64_t T, H;
  int E, K, m;
  DType dtype, wdtype;
  ref::Plan p;
  PlanHolder ph;          // plan built from the reference
  padmoe::Plan lib_plan;  // plan built by the library
  IndexInputs ii;
  std::vector<float> xf, wf, yf, gof, gyf;  // x[T,H], w[A], y[P,H] (padding rows 0), grad_out[T,H], grad_y[P,H]
  Tensor x, w, y, grad_out, grad_y;
};

Fixture make_setup(int64_t T, int64_t H, int E, int K, int m, DType dtype, DType wdtype, uint64_t seed,
                   Dist dist = Dist::kUniform) {
  Fixture s{T, H, E, K, m, dtype, wdtype, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  const std::vector<int64_t> te = make_routing(T, K, E, dist, seed);
  s.p = ref::make_plan(te, T, K, E, m);
  s.ph = plan_from_ref(s.p);
  s.lib_plan = padmoe::make_plan(index_matrix(te, T, K, DType::kInt32), E, m);
  s.ii = index_inputs(s.p, DType::kInt32);
  Rng rng(seed + 1);
  const int64_t P = s.p.padded_rows, A = T * K;
  s.xf = random_values(T * H, dtype, rng);
  s.wf = random_values(A, wdtype, rng, 0.0, 1.0);
  s.yf = random_values(P * H, dtype, rng);
  s.gof = random_values(T * H, dtype, rng);
  s.gyf = random_values(P * H, dtype, rng);
  // Padding rows of y / grad_y: the contract says they are never read; fill them
  // with NaN in the tensors (the reference never reads them either).
  s.x = rows_from_float(s.xf, dtype, T, H);
  s.w = vec_from_float(s.wf, wdtype);
  s.grad_out = rows_from_float(s.gof, dtype, T, H);
  s.y = rows_from_float(s.yf, dtype, P, H);
  s.grad_y = rows_from_float(s.gyf, dtype, P, H);
  poison_padding_rows(s.y, s.p, P, H, dtype);
  poison_padding_rows(s.grad_y, s.p, P, H, dtype);
  return s;
}

using FusedParam = std::tuple<DType, int, int, bool>;  // row dtype, weight dtype kind, K, library plan?
class Fused : public ::testing::TestWithParam<FusedParam> {};

TEST_P(Fused, DispatchCombineAndBackward) {
  DType dt;
  int wkind, K;
  bool use_lib_plan;
  std::tie(dt, wkind, K, use_lib_plan) = GetParam();
  // weights: float32, the rows' dtype, or a 16-bit float dtype other than the rows' (docs/spec.md §11:
  // any float dtype, whatever the rows' dtype; e.g. bf16 router weights beside float32 rows under autocast)
  const DType other16 = dt == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
  const DType wdt = wkind == 0 ? DType::kFloat32 : wkind == 1 ? dt : other16;
  const Fixture s = make_setup(301, 37, 12, K, 8, dt, wdt, static_cast<uint64_t>(K) * 3 + wkind, Dist::kSkewed);
  const padmoe::PlanView pv = use_lib_plan ? s.lib_plan.view() : s.ph.view;
  const int64_t T = s.T, H = s.H, A = T * K, P = s.p.padded_rows;
  const std::vector<float>* wp = &s.wf;

  // --- dispatch == padded_gather (bitwise), with and without weights; rows past P untouched.
  for (bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "weighted dispatch" : "plain dispatch");
    std::optional<TensorView> wopt;
    if (weighted) wopt = s.w.view();
    const std::vector<float> want = ref::padded_gather(s.xf, H, s.p, weighted ? wp : nullptr);
    Tensor y = poison_rows(dt, s.p.capacity + 2, H);
    padmoe::dispatch_out(s.x, pv, wopt, y);
    EXPECT_TRUE(rows_bitwise(y, want, P));
    EXPECT_TRUE(bytes_are(y, P, s.p.capacity + 2, kPoison)) << "dispatch wrote past P";
    const Tensor y2 = padmoe::dispatch(s.x, pv, wopt);
    ASSERT_EQ(y2.size(0), P);
    EXPECT_TRUE(rows_bitwise(y2, want, P));
  }

  // --- combine == padded_scatter (tolerance), padding rows of y (NaN) never read.
  for (bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "weighted combine" : "plain combine");
    std::optional<TensorView> wopt;
    if (weighted) wopt = s.w.view();
    const std::vector<double> want = ref::padded_scatter(s.yf, H, s.p, weighted ? wp : nullptr);
    const std::vector<double> abs = ref_scatter_abs(s.yf, H, s.p, weighted ? wp : nullptr);
    Tensor out = poison_rows(dt, T, H);
    padmoe::combine_out(s.y, pv, wopt, out);
    EXPECT_TRUE(sums_close(out, want, abs, K, T));
    const Tensor out2 = padmoe::combine(s.y, pv, wopt);
    EXPECT_TRUE(same_bytes(out, out2));
  }

  // --- combine_backward: grad_y = w * grad_out[token] (bitwise), grad_w = <y[row], grad_out[token]>.
  {
    const std::vector<float> want_gy = ref::padded_gather(s.gof, H, s.p, wp);
    const std::vector<double> want_gw = ref::padded_scatter_wgrad(s.yf, s.gof, H, s.p);
    const std::vector<double> abs_gw = ref::padded_scatter_wgrad(abs_of(s.yf), abs_of(s.gof), H, s.p);
    const padmoe::RowGrads g = padmoe::combine_backward(s.grad_out, s.y, pv, s.w.view());
    ASSERT_EQ(g.grad_rows.size(0), P);
    EXPECT_TRUE(rows_bitwise(g.grad_rows, want_gy, P)) << "combine_backward grad_y";
    ASSERT_TRUE(g.grad_weights.defined());
    ASSERT_EQ(g.grad_weights.numel(), A);
    EXPECT_TRUE(sums_close(g.grad_weights, want_gw, abs_gw, H, A)) << "combine_backward grad_weights";
    // _out with a larger grad_y and a float32 grad_weights
    Tensor gy = poison_rows(dt, P + 5, H);
    Tensor gw = filled(DType::kFloat32, {A}, kPoison);
    padmoe::combine_backward_out(s.grad_out, s.y, pv, s.w.view(), gy, gw);
    EXPECT_TRUE(rows_bitwise(gy, want_gy, P));
    EXPECT_TRUE(bytes_are(gy, P, P + 5, kPoison));
    EXPECT_TRUE(sums_close(gw, want_gw, abs_gw, H, A));
    // grad_weights skipped (empty view)
    Tensor gy2 = poison_rows(dt, P, H);
    padmoe::combine_backward_out(s.grad_out, s.y, pv, s.w.view(), gy2, TensorView{});
    EXPECT_TRUE(same_bytes(gy2, g.grad_rows));
    // unweighted: grad_y = grad_out[token], no weight grad
    const padmoe::RowGrads g0 = padmoe::combine_backward(s.grad_out, s.y, pv);
    EXPECT_TRUE(rows_bitwise(g0.grad_rows, ref::padded_gather(s.gof, H, s.p, nullptr), P));
    EXPECT_FALSE(g0.grad_weights.defined());
  }

  // --- padded_scatter_backward: same rule through the unfused API.
  {
    const padmoe::RowGrads g = padmoe::padded_scatter_backward(s.grad_out, s.y, s.ii.indices, s.ii.bin_ids, s.w.view(),
                                                               s.ii.bins, s.ii.padded_bins, K);
    ASSERT_EQ(g.grad_rows.size(0), P);
    EXPECT_TRUE(rows_bitwise(g.grad_rows, ref::padded_gather(s.gof, H, s.p, wp), P));
    ASSERT_TRUE(g.grad_weights.defined());
    EXPECT_TRUE(sums_close(g.grad_weights, ref::padded_scatter_wgrad(s.yf, s.gof, H, s.p),
                           ref::padded_scatter_wgrad(abs_of(s.yf), abs_of(s.gof), H, s.p), H, A));
    const padmoe::RowGrads g0 = padmoe::padded_scatter_backward(s.grad_out, s.y, s.ii.indices, s.ii.bin_ids,
                                                                std::nullopt, s.ii.bins, s.ii.padded_bins, K);
    EXPECT_TRUE(rows_bitwise(g0.grad_rows, ref::padded_gather(s.gof, H, s.p, nullptr), P));
    EXPECT_FALSE(g0.grad_weights.defined());
  }

  // --- dispatch_backward / padded_gather_backward:
  //     without weights grad_x = scatter(grad_y, None) (docs/spec.md §9);
  //     with weights (y[row(a)] = w[a] * x[a / K]) the chain rule gives
  //     grad_x = scatter(grad_y, weights), and grad_w[a] = <grad_y[dest_rows[a]], x[a / K]>.
  //     (docs/spec.md §9 and ops.hpp note that "weights=None", which is the rule of MegaBlocks'
  //     unweighted gather; for a weighted gather only the weighted form is a gradient.)
  {
    const std::vector<double> want_gx0 = ref::padded_scatter(s.gyf, H, s.p, nullptr);
    const std::vector<double> abs_gx0 = ref_scatter_abs(s.gyf, H, s.p, nullptr);
    const std::vector<double> want_gx = ref::padded_scatter(s.gyf, H, s.p, wp);
    const std::vector<double> abs_gx = ref_scatter_abs(s.gyf, H, s.p, wp);
    const std::vector<double> want_gw = ref::padded_scatter_wgrad(s.gyf, s.xf, H, s.p);
    const std::vector<double> abs_gw = ref::padded_scatter_wgrad(abs_of(s.gyf), abs_of(s.xf), H, s.p);
    const padmoe::RowGrads g = padmoe::dispatch_backward(s.grad_y, s.x, pv, s.w.view());
    ASSERT_EQ(g.grad_rows.size(0), T);
    EXPECT_TRUE(sums_close(g.grad_rows, want_gx, abs_gx, K, T)) << "dispatch_backward grad_x";
    ASSERT_TRUE(g.grad_weights.defined());
    EXPECT_TRUE(sums_close(g.grad_weights, want_gw, abs_gw, H, A)) << "dispatch_backward grad_weights";
    const padmoe::RowGrads g0 = padmoe::dispatch_backward(s.grad_y, s.x, pv);
    EXPECT_TRUE(sums_close(g0.grad_rows, want_gx0, abs_gx0, K, T));
    EXPECT_FALSE(g0.grad_weights.defined());

    const padmoe::RowGrads h = padmoe::padded_gather_backward(s.grad_y, s.x, s.ii.indices, s.ii.bin_ids, s.ii.bins,
                                                              s.ii.padded_bins, K, s.w.view());
    EXPECT_TRUE(sums_close(h.grad_rows, want_gx, abs_gx, K, T)) << "padded_gather_backward grad_x";
    ASSERT_TRUE(h.grad_weights.defined());
    EXPECT_TRUE(sums_close(h.grad_weights, want_gw, abs_gw, H, A)) << "padded_gather_backward grad_weights";
    const padmoe::RowGrads h0 =
        padmoe::padded_gather_backward(s.grad_y, s.x, s.ii.indices, s.ii.bin_ids, s.ii.bins, s.ii.padded_bins, K);
    EXPECT_TRUE(sums_close(h0.grad_rows, want_gx0, abs_gx0, K, T));
    EXPECT_FALSE(h0.grad_weights.defined());
  }
}

INSTANTIATE_TEST_SUITE_P(All, Fused,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values(0, 1, 2), ::testing::Values(1, 2, 4, 8),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<FusedParam>& i) {
                           return std::string(dname(std::get<0>(i.param))) +
                                  (std::get<1>(i.param) == 0   ? "_wf32"
                                   : std::get<1>(i.param) == 1 ? "_wrow"
                                                               : "_wother") +
                                  "_K" + std::to_string(std::get<2>(i.param)) +
                                  (std::get<3>(i.param) ? "_libplan" : "_refplan");
                         });

TEST(Fused, Float8MoveOnlyDispatch) {
  // float8 rows are accepted by unweighted dispatch / gather; moves are bitwise.
  for (DType dt : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    const Fixture s = make_setup(90, 20, 6, 2, 16, DType::kFloat32, DType::kFloat32, 21);
    std::vector<float> xf = s.xf;
    for (auto& v : xf) v = num::round_to(dt, v * 8.0f);
    const Tensor x = rows_from_float(xf, dt, s.T, s.H);
    const std::vector<float> want = ref::padded_gather(xf, s.H, s.p, nullptr);
    Tensor y = poison_rows(dt, s.p.padded_rows + 1, s.H);
    padmoe::dispatch_out(x, s.ph.view, std::nullopt, y);
    EXPECT_TRUE(rows_bitwise(y, want, s.p.padded_rows));
    EXPECT_TRUE(bytes_are(y, s.p.padded_rows, s.p.padded_rows + 1, kPoison));
    Tensor y2 = poison_rows(dt, s.p.padded_rows, s.H);
    padmoe::padded_gather_out(x, s.ii.indices, s.ii.bin_ids, s.ii.bins, s.ii.padded_bins, 2, std::nullopt, y2);
    EXPECT_TRUE(rows_bitwise(y2, want, s.p.padded_rows));
  }
}

TEST(Fused, LargeDispatchCombine) {
  // A = 131072 through the fused path.
  const Fixture s = make_setup(16384, 16, 64, 8, 128, DType::kBFloat16, DType::kFloat32, 5, Dist::kDistinct);
  const int64_t P = s.p.padded_rows;
  Tensor y = poison_rows(DType::kBFloat16, P, 16);
  padmoe::dispatch_out(s.x, s.lib_plan.view(), s.w.view(), y);
  EXPECT_TRUE(rows_bitwise(y, ref::padded_gather(s.xf, 16, s.p, &s.wf), P));
  const Tensor out = padmoe::combine(s.y, s.lib_plan.view(), s.w.view());
  EXPECT_TRUE(
      sums_close(out, ref::padded_scatter(s.yf, 16, s.p, &s.wf), ref_scatter_abs(s.yf, 16, s.p, &s.wf), 8, s.T));
}

// ---------------------------------------------------------------------------
// Determinism: two runs are bitwise equal, and so are runs with 1, 2, 3, 7 threads.
// ---------------------------------------------------------------------------
TEST(Determinism, BitwiseAcrossRunsAndThreadCounts) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(dname(dt));
    const Fixture s = make_setup(3001, 67, 16, 4, 16, dt, DType::kFloat32, 9, Dist::kSkewed);
    const padmoe::PlanView pv = s.lib_plan.view();
    const int K = 4;
    std::vector<Tensor> base;
    auto run_all = [&](int threads) {
      padmoe::Options o;
      o.num_threads = threads;
      std::vector<Tensor> r;
      r.push_back(
          padmoe::padded_gather(s.x, s.ii.indices, s.ii.bin_ids, s.ii.bins, s.ii.padded_bins, K, s.w.view(), o));
      r.push_back(
          padmoe::padded_scatter(s.y, s.ii.indices, s.ii.bin_ids, s.w.view(), s.ii.bins, s.ii.padded_bins, K, o));
      Tensor wg = Tensor::empty(DType::kFloat32, {s.T * K});
      padmoe::padded_scatter_wgrad_out(s.y, s.grad_out, s.ii.indices, s.ii.bin_ids, s.ii.bins, s.ii.padded_bins, K, wg,
                                       o);
      r.push_back(wg);
      r.push_back(padmoe::dispatch(s.x, pv, s.w.view(), o));
      r.push_back(padmoe::combine(s.y, pv, s.w.view(), o));
      padmoe::RowGrads cb = padmoe::combine_backward(s.grad_out, s.y, pv, s.w.view(), o);
      r.push_back(cb.grad_rows);
      r.push_back(cb.grad_weights);
      padmoe::RowGrads db = padmoe::dispatch_backward(s.grad_y, s.x, pv, s.w.view(), o);
      r.push_back(db.grad_rows);
      r.push_back(db.grad_weights);
      return r;
    };
    base = run_all(1);
    // sanity: the single-threaded run is itself right (combine vs reference)
    EXPECT_TRUE(sums_close(base[4], ref::padded_scatter(s.yf, s.H, s.p, &s.wf), ref_scatter_abs(s.yf, s.H, s.p, &s.wf),
                           K, s.T));
    for (int threads : {1, 2, 3, 7, 0}) {
      const std::vector<Tensor> r = run_all(threads);
      ASSERT_EQ(r.size(), base.size());
      for (size_t i = 0; i < r.size(); ++i)
        EXPECT_TRUE(same_bytes(r[i], base[i])) << "output " << i << " differs with num_threads=" << threads;
    }
  }
}

// Options::zero_tail: an output sized by padded_rows_bound() is fully defined —
// rows at or past P zero — for dispatch and the grad_y of combine_backward;
// without it those rows keep their bytes.
TEST(ZeroTail, DispatchAndCombineBackwardZeroRowsPastP) {
  for (bool zero_tail : {false, true}) {
    Fixture s = make_setup(37, 20, 5, 3, 8, DType::kBFloat16, DType::kFloat32, 77);
    const int64_t P = s.p.padded_rows;
    const int64_t R = padmoe::padded_rows_bound(s.T, s.K, s.E, s.m);
    ASSERT_GT(R, P);
    padmoe::Options o;
    o.zero_tail = zero_tail;
    const padmoe::PlanView pv = s.lib_plan.view();
    Tensor y = poison_rows(s.dtype, R, s.H);
    padmoe::dispatch_out(s.x, pv, s.w.view(), y, o);
    EXPECT_TRUE(rows_bitwise(y, ref::padded_gather(s.xf, s.H, s.p, &s.wf), P));
    if (zero_tail) EXPECT_TRUE(bytes_are(y, P, R, 0x00));
    else EXPECT_TRUE(bytes_are(y, P, R, kPoison));
    Tensor gy = poison_rows(s.dtype, R, s.H);
    padmoe::combine_backward_out(s.grad_out, s.y, pv, std::nullopt, gy, TensorView{}, o);
    EXPECT_TRUE(rows_bitwise(gy, ref::padded_gather(s.gof, s.H, s.p, nullptr), P));
    if (zero_tail) EXPECT_TRUE(bytes_are(gy, P, R, 0x00));
    else EXPECT_TRUE(bytes_are(gy, P, R, kPoison));
  }
}

}  // namespace
}  // namespace pt
