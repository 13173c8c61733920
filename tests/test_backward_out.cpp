// test_backward_out.cpp — the caller-owned-output forms of the backward ops
// (padded_gather_backward_out, padded_scatter_backward_out,
// dispatch_backward_out, unpad_from_alignment_backward_out) and padmoe::copy.
//
// Each _out form must be bitwise equal to its allocating form and match the
// reference (test_rows_plan.cpp / test_padding.cpp state the rules):
//   grad of gather / dispatch (rows)    = ref padded_scatter(grad_y, weights)   (tolerance)
//   grad of gather / dispatch (weights) = ref wgrad(grad_y, x)                   (tolerance)
//   grad of scatter (rows)              = ref padded_gather(grad_out, weights)   (bitwise)
//   grad of scatter (weights)           = ref wgrad(y, grad_out)                 (tolerance)
//   unpad backward                      = ref unpad_from_alignment_backward
// Outputs start as poison (NaN bytes): rows past P of a larger grad_y keep it,
// an empty TensorView{} skips the weight gradient, and a bad output raises
// padmoe::Error naming it before anything is written.
#include <tuple>

#include "test_util.hpp"

namespace pt {
namespace {

constexpr int kValue = static_cast<int>(padmoe::ErrorKind::kValue);
constexpr int kType = static_cast<int>(padmoe::ErrorKind::kType);

// A row dtype other than dt (for "wrong dtype" outputs).
DType other_row_dtype(DType dt) { return dt == DType::kFloat32 ? DType::kBFloat16 : DType::kFloat32; }
// A float dtype padmoe writes no weight gradient in (float8; float32, float16 and bfloat16 all are).
DType bad_wgrad_dtype(DType) { return DType::kFloat8E4M3; }

// A copy of a tensor's bytes, to show an op left its inputs alone.
std::vector<unsigned char> bytes_of(const TensorView& t) {
  const auto* p = static_cast<const unsigned char*>(t.data);
  return std::vector<unsigned char>(p, p + static_cast<size_t>(t.numel()) * esize(t.dtype));
}

// Runs f, which must raise padmoe::Error naming `op` and `arg`, and then every
// tensor of `outs` must still hold the poison byte.
template <class F>
void expect_rejected(F&& f, const std::string& op, const std::string& arg, int kind,
                     std::initializer_list<const Tensor*> outs, unsigned char poison = kPoison) {
  EXPECT_TRUE(throws_error(f, {op + ": " + arg + ": "}, kind)) << op << " with a bad " << arg;
  for (const Tensor* t : outs)
    if (t->defined() && t->numel() > 0)
      EXPECT_TRUE(bytes_are(*t, 0, t->size(0), poison)) << op << " wrote an output before rejecting " << arg;
}

// ---------------------------------------------------------------------------
// MegaBlocks family
// ---------------------------------------------------------------------------
struct MbSetup {
  int64_t T, H, A, P;
  int E, K, m;
  DType dtype, wdtype;
  ref::Plan p;
  PlanHolder ph;          // plan built from the reference
  padmoe::Plan lib_plan;  // plan built by the library
  IndexInputs ii;
  std::vector<float> xf, wf, yf, gof, gyf;  // x[T,H], w[A], y[P,H], grad_out[T,H], grad_y[P,H]
  Tensor x, w, y, grad_out, grad_y;
};

MbSetup make_mb(int64_t T, int64_t H, int E, int K, int m, DType dtype, DType wdtype, DType idx, uint64_t seed) {
  MbSetup s;
  s.T = T;
  s.H = H;
  s.E = E;
  s.K = K;
  s.m = m;
  s.dtype = dtype;
  s.wdtype = wdtype;
  s.A = T * K;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, seed);
  s.p = ref::make_plan(te, T, K, E, m);
  s.P = s.p.padded_rows;
  s.ph = plan_from_ref(s.p);
  s.lib_plan = padmoe::make_plan(index_matrix(te, T, K, DType::kInt32), E, m);
  s.ii = index_inputs(s.p, idx);
  Rng rng(seed + 11);
  s.xf = random_values(T * H, dtype, rng);
  s.wf = random_values(s.A, wdtype, rng, 0.0, 1.0);
  s.yf = random_values(s.P * H, dtype, rng);
  s.gof = random_values(T * H, dtype, rng);
  s.gyf = random_values(s.P * H, dtype, rng);
  s.x = rows_from_float(s.xf, dtype, T, H);
  s.w = vec_from_float(s.wf, wdtype);
  s.grad_out = rows_from_float(s.gof, dtype, T, H);
  s.y = rows_from_float(s.yf, dtype, s.P, H);
  s.grad_y = rows_from_float(s.gyf, dtype, s.P, H);
  // Padding rows of the padded inputs are never read: NaN there would show.
  poison_padding_rows(s.y, s.p, s.P, H, dtype);
  poison_padding_rows(s.grad_y, s.p, s.P, H, dtype);
  return s;
}

// row dtype, weight dtype kind (0: float32, 1: the row dtype); kind 1 also uses int64 index inputs.
using OutParam = std::tuple<DType, int>;
class BackwardOut : public ::testing::TestWithParam<OutParam> {
 protected:
  void SetUp() override {
    std::tie(dt, wkind) = GetParam();
    wdt = wkind == 0 ? DType::kFloat32 : dt;
    s = make_mb(173, 37, 12, 4, 8, dt, wdt, wkind == 0 ? DType::kInt32 : DType::kInt64,
                static_cast<uint64_t>(dt) * 5 + static_cast<uint64_t>(wkind) + 1);
  }
  DType dt = DType::kFloat32, wdt = DType::kFloat32;
  int wkind = 0;
  MbSetup s;
};

// grad_x = scatter(grad_y, w), grad_w = <grad_y[row], x[token]>: shared by
// padded_gather_backward_out and dispatch_backward_out. `run` calls the _out
// form, `alloc` the allocating form.
void check_gather_like_backward(
    const MbSetup& s, const std::string& op,
    const std::function<void(const std::optional<TensorView>&, const TensorView&, const TensorView&)>& run,
    const std::function<padmoe::RowGrads(const std::optional<TensorView>&)>& alloc) {
  const int64_t T = s.T, H = s.H, A = s.A;
  const std::vector<unsigned char> x0 = bytes_of(s.x), gy0 = bytes_of(s.grad_y), w0 = bytes_of(s.w);
  const std::vector<double> want_gw = ref::padded_scatter_wgrad(s.gyf, s.xf, H, s.p);
  const std::vector<double> abs_gw = ref::padded_scatter_wgrad(abs_of(s.gyf), abs_of(s.xf), H, s.p);
  for (bool weighted : {false, true}) {
    SCOPED_TRACE(op + (weighted ? " weighted" : " unweighted"));
    std::optional<TensorView> wopt;
    if (weighted) wopt = s.w.view();
    const std::vector<double> want_gx = ref::padded_scatter(s.gyf, H, s.p, weighted ? &s.wf : nullptr);
    const std::vector<double> abs_gx = ref_scatter_abs(s.gyf, H, s.p, weighted ? &s.wf : nullptr);
    const padmoe::RowGrads g = alloc(wopt);
    ASSERT_EQ(g.grad_rows.size(0), T);
    EXPECT_EQ(g.grad_weights.defined(), weighted);

    // grad_weights in the weights' dtype (what the allocating form returns): bitwise equal.
    Tensor gx = poison_rows(s.dtype, T, H);
    Tensor gw = filled(s.wdtype, {A}, kPoison);
    run(wopt, gx, weighted ? gw.view() : TensorView{});
    EXPECT_TRUE(same_bytes(gx, g.grad_rows)) << "grad_x differs from the allocating form";
    EXPECT_TRUE(sums_close(gx, want_gx, abs_gx, s.K, T)) << "grad_x vs reference";
    if (weighted) {
      EXPECT_TRUE(same_bytes(gw, g.grad_weights)) << "grad_weights differs from the allocating form";
      EXPECT_TRUE(sums_close(gw, want_gw, abs_gw, H, A)) << "grad_weights vs reference";
    } else {
      EXPECT_TRUE(all_bytes_are(gw, kPoison)) << "skipped grad_weights was written";
    }

    // grad_weights in the other accepted dtype (float32 <-> row dtype).
    if (weighted) {
      const DType other = s.wdtype == DType::kFloat32 ? s.dtype : DType::kFloat32;
      Tensor gx2 = poison_rows(s.dtype, T, H);
      Tensor gw2 = filled(other, {A}, kPoison);
      run(wopt, gx2, gw2);
      EXPECT_TRUE(same_bytes(gx2, g.grad_rows));
      EXPECT_TRUE(sums_close(gw2, want_gw, abs_gw, H, A)) << "grad_weights (" << dname(other) << ") vs reference";
    }

    // Weight gradient skipped with an empty view: grad_x unchanged, nothing else written.
    if (weighted) {
      Tensor gx3 = poison_rows(s.dtype, T, H);
      Tensor spare = filled(s.wdtype, {A}, kPoison);  // what would have been grad_weights
      run(wopt, gx3, TensorView{});
      EXPECT_TRUE(same_bytes(gx3, g.grad_rows)) << "grad_x with the weight gradient skipped";
      EXPECT_TRUE(all_bytes_are(spare, kPoison));
    }
  }
  EXPECT_EQ(bytes_of(s.x), x0) << op << " modified x";
  EXPECT_EQ(bytes_of(s.grad_y), gy0) << op << " modified grad_y";
  EXPECT_EQ(bytes_of(s.w), w0) << op << " modified weights";

  // Bad outputs: padmoe::Error naming the argument, no output written.
  const std::optional<TensorView> w = s.w.view();
  Tensor gx = poison_rows(s.dtype, T, H);
  Tensor gw = filled(DType::kFloat32, {A}, kPoison);
  {
    Tensor bad = poison_rows(other_row_dtype(s.dtype), T, H);
    expect_rejected([&] { run(w, bad, gw); }, op, "grad_x", kType, {&bad, &gw});
  }
  {
    Tensor bad = poison_rows(s.dtype, T - 1, H);
    expect_rejected([&] { run(w, bad, gw); }, op, "grad_x", kValue, {&bad, &gw});
  }
  {
    Tensor bad = poison_rows(s.dtype, T + 1, H);  // grad_x must have exactly T rows
    expect_rejected([&] { run(w, bad, gw); }, op, "grad_x", kValue, {&bad, &gw});
  }
  {
    Tensor bad = poison_rows(s.dtype, T, H + 1);
    expect_rejected([&] { run(w, bad, gw); }, op, "grad_x", kValue, {&bad, &gw});
  }
  for (int64_t len : {A - 1, A + 1}) {
    Tensor bad = filled(DType::kFloat32, {len}, kPoison);
    expect_rejected([&] { run(w, gx, bad); }, op, "grad_weights", kValue, {&gx, &bad});
  }
  {
    Tensor bad = filled(bad_wgrad_dtype(s.dtype), {A}, kPoison);
    expect_rejected([&] { run(w, gx, bad); }, op, "grad_weights", kType, {&gx, &bad});
    Tensor bad_i = filled(DType::kInt32, {A}, kPoison);
    expect_rejected([&] { run(w, gx, bad_i); }, op, "grad_weights", kType, {&gx, &bad_i});
  }
  {
    Tensor bad = filled(DType::kFloat32, {2 * A}, kPoison);  // strided: not contiguous
    const TensorView strided = TensorView::matrix(bad.data(), DType::kFloat32, A, 1, 2);
    expect_rejected([&] { run(w, gx, strided); }, op, "grad_weights", kValue, {&gx, &bad});
  }
}

TEST_P(BackwardOut, PaddedGatherBackward) {
  const IndexInputs& ii = s.ii;
  const int K = s.K;
  check_gather_like_backward(
      s, "padded_gather_backward",
      [&](const std::optional<TensorView>& w, const TensorView& gx, const TensorView& gw) {
        padmoe::padded_gather_backward_out(s.grad_y, s.x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, K, w, gx,
                                           gw);
      },
      [&](const std::optional<TensorView>& w) {
        return padmoe::padded_gather_backward(s.grad_y, s.x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, K, w);
      });
}

TEST_P(BackwardOut, DispatchBackward) {
  for (bool lib : {false, true}) {
    SCOPED_TRACE(lib ? "library plan" : "reference plan");
    const padmoe::PlanView pv = lib ? s.lib_plan.view() : s.ph.view;
    check_gather_like_backward(
        s, "dispatch_backward",
        [&](const std::optional<TensorView>& w, const TensorView& gx, const TensorView& gw) {
          padmoe::dispatch_backward_out(s.grad_y, s.x, pv, w, gx, gw);
        },
        [&](const std::optional<TensorView>& w) { return padmoe::dispatch_backward(s.grad_y, s.x, pv, w); });
  }
}

TEST_P(BackwardOut, PaddedScatterBackward) {
  const int64_t T = s.T, H = s.H, A = s.A, P = s.P, K = s.K;
  const IndexInputs& ii = s.ii;
  auto run = [&](const std::optional<TensorView>& w, const TensorView& gy, const TensorView& gw) {
    padmoe::padded_scatter_backward_out(s.grad_out, s.y, ii.indices, ii.bin_ids, w, ii.bins, ii.padded_bins,
                                        static_cast<int>(K), gy, gw);
  };
  const std::vector<unsigned char> y0 = bytes_of(s.y), go0 = bytes_of(s.grad_out), w0 = bytes_of(s.w);
  const std::vector<double> want_gw = ref::padded_scatter_wgrad(s.yf, s.gof, H, s.p);
  const std::vector<double> abs_gw = ref::padded_scatter_wgrad(abs_of(s.yf), abs_of(s.gof), H, s.p);
  for (bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "weighted" : "unweighted");
    std::optional<TensorView> wopt;
    if (weighted) wopt = s.w.view();
    const std::vector<float> want_gy = ref::padded_gather(s.gof, H, s.p, weighted ? &s.wf : nullptr);
    const padmoe::RowGrads g = padmoe::padded_scatter_backward(s.grad_out, s.y, ii.indices, ii.bin_ids, wopt, ii.bins,
                                                               ii.padded_bins, static_cast<int>(K));
    ASSERT_EQ(g.grad_rows.size(0), P);
    EXPECT_EQ(g.grad_weights.defined(), weighted);

    // Exactly P rows.
    Tensor gy = poison_rows(dt, P, H);
    Tensor gw = filled(wdt, {A}, kPoison);
    run(wopt, gy, weighted ? gw.view() : TensorView{});
    EXPECT_TRUE(same_bytes(gy, g.grad_rows)) << "grad_y differs from the allocating form";
    EXPECT_TRUE(rows_bitwise(gy, want_gy, P)) << "grad_y vs reference";
    if (weighted) {
      EXPECT_TRUE(same_bytes(gw, g.grad_weights)) << "grad_weights differs from the allocating form";
      EXPECT_TRUE(sums_close(gw, want_gw, abs_gw, H, A)) << "grad_weights vs reference";
    } else {
      EXPECT_TRUE(all_bytes_are(gw, kPoison));
    }

    // A larger grad_y (capacity rows): rows past P keep their poison; grad_weights in the other dtype.
    const int64_t R = s.p.capacity + 3;
    Tensor gyR = poison_rows(dt, R, H);
    const DType other = wdt == DType::kFloat32 ? dt : DType::kFloat32;
    Tensor gw2 = filled(other, {A}, kPoison);
    run(wopt, gyR, weighted ? gw2.view() : TensorView{});
    EXPECT_TRUE(rows_bitwise(gyR, want_gy, P));
    EXPECT_TRUE(bytes_are(gyR, P, R, kPoison)) << "padded_scatter_backward_out wrote past P";
    if (weighted) EXPECT_TRUE(sums_close(gw2, want_gw, abs_gw, H, A)) << "grad_weights (" << dname(other) << ")";

    // A strided grad_y (row stride H + 5): the gap columns stay poison.
    if (weighted) {
      Tensor buf = poison_rows(dt, P, H + 5);
      const TensorView gyS = TensorView::matrix(buf.data(), dt, P, H, H + 5);
      run(wopt, gyS, TensorView{});
      EXPECT_TRUE(rows_bitwise(gyS, want_gy, P)) << "strided grad_y";
      for (int64_t r = 0; r < P; ++r)
        for (int64_t c = H; c < H + 5; ++c)
          ASSERT_EQ(*elem_ptr(buf, r, c), kPoison) << "strided grad_y: gap written at row " << r << " col " << c;
    }

    // Weight gradient skipped.
    if (weighted) {
      Tensor gy3 = poison_rows(dt, P + 2, H);
      Tensor spare = filled(wdt, {A}, kPoison);
      run(wopt, gy3, TensorView{});
      EXPECT_TRUE(rows_bitwise(gy3, want_gy, P));
      EXPECT_TRUE(bytes_are(gy3, P, P + 2, kPoison));
      EXPECT_TRUE(all_bytes_are(spare, kPoison));
    }
  }
  EXPECT_EQ(bytes_of(s.y), y0) << "modified y";
  EXPECT_EQ(bytes_of(s.grad_out), go0) << "modified grad_out";
  EXPECT_EQ(bytes_of(s.w), w0) << "modified weights";

  // Bad outputs.
  const std::string op = "padded_scatter_backward";
  const std::optional<TensorView> w = s.w.view();
  Tensor gy = poison_rows(dt, P, H);
  Tensor gw = filled(DType::kFloat32, {A}, kPoison);
  {
    Tensor bad = poison_rows(other_row_dtype(dt), P, H);
    expect_rejected([&] { run(w, bad, gw); }, op, "grad_y", kType, {&bad, &gw});
  }
  {
    Tensor bad = poison_rows(dt, P - 1, H);
    expect_rejected([&] { run(w, bad, gw); }, op, "grad_y", kValue, {&bad, &gw});
  }
  {
    Tensor bad = poison_rows(dt, P, H - 1);
    expect_rejected([&] { run(w, bad, gw); }, op, "grad_y", kValue, {&bad, &gw});
  }
  for (int64_t len : {A - 1, A + 1}) {
    Tensor bad = filled(DType::kFloat32, {len}, kPoison);
    expect_rejected([&] { run(w, gy, bad); }, op, "grad_weights", kValue, {&gy, &bad});
  }
  {
    Tensor bad = filled(bad_wgrad_dtype(dt), {A}, kPoison);
    expect_rejected([&] { run(w, gy, bad); }, op, "grad_weights", kType, {&gy, &bad});
  }
  (void)T;
}

INSTANTIATE_TEST_SUITE_P(All, BackwardOut,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values(0, 1)),
                         [](const ::testing::TestParamInfo<OutParam>& i) {
                           return std::string(dname(std::get<0>(i.param))) +
                                  (std::get<1>(i.param) == 0 ? "_wf32_i32" : "_wrow_i64");
                         });

// ---------------------------------------------------------------------------
// unpad_from_alignment_backward_out
// ---------------------------------------------------------------------------
class UnpadBackwardOut : public ::testing::TestWithParam<OutParam> {};

TEST_P(UnpadBackwardOut, MatchesAllocatingFormAndReference) {
  DType dt;
  int pkind;
  std::tie(dt, pkind) = GetParam();
  const DType pdt = pkind == 0 ? DType::kFloat32 : dt;
  const DType mdt = pkind == 0 ? DType::kInt32 : DType::kInt64;  // map dtype
  Rng rng(static_cast<uint64_t>(dt) * 13 + static_cast<uint64_t>(pkind) + 3);
  const int E = 9, m = 16;
  std::vector<int64_t> counts(E);
  for (int e = 0; e < E; ++e) counts[static_cast<size_t>(e)] = rng.below(4) == 0 ? 0 : rng.below(3 * m);
  counts[2] = m;
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  const int64_t extra = 5;  // rows of grad_out no map entry names: grad_probs 0 there
  const int64_t N = total + extra, H = 41;
  const std::vector<float> hf = random_values(N * H, dt, rng);
  const ref::PadResult pr = ref::pad_to_alignment(hf, H, counts, m);
  const int64_t P = pr.padded_rows;
  std::vector<float> paddedf = pr.padded;
  Tensor padded = rows_from_float(paddedf, dt, P, H);
  // padding rows of padded are never read
  for (int64_t p = 0; p < P; ++p)
    if (pr.permutation_map[static_cast<size_t>(p)] < 0)
      std::memset(static_cast<unsigned char*>(padded.data()) + p * H * esize(dt), kPoison, H * esize(dt));
  const Tensor map = index_tensor(pr.permutation_map, mdt);
  const std::vector<float> gof = random_values(N * H, dt, rng);
  const Tensor grad_out = rows_from_float(gof, dt, N, H);
  const std::vector<float> probsf = random_values(N, pdt, rng, 0.0, 1.0);
  const Tensor probs = vec_from_float(probsf, pdt);
  const std::vector<unsigned char> padded0 = bytes_of(padded), go0 = bytes_of(grad_out), pr0 = bytes_of(probs);

  auto run = [&](const std::optional<TensorView>& pv, const TensorView& gp, const TensorView& gprobs) {
    padmoe::unpad_from_alignment_backward_out(grad_out, padded, map, pv, gp, gprobs);
  };

  for (bool with_probs : {false, true}) {
    SCOPED_TRACE(with_probs ? "with probs" : "without probs");
    std::optional<TensorView> popt;
    if (with_probs) popt = probs.view();
    const ref::UnpadGrads want =
        ref::unpad_from_alignment_backward(gof, paddedf, H, pr.permutation_map, with_probs ? &probsf : nullptr);
    const std::vector<float> aprobs = abs_of(probsf);
    const ref::UnpadGrads wabs = ref::unpad_from_alignment_backward(abs_of(gof), abs_of(paddedf), H, pr.permutation_map,
                                                                    with_probs ? &aprobs : nullptr);
    const padmoe::RowGrads g = padmoe::unpad_from_alignment_backward(grad_out, padded, map, popt);
    ASSERT_EQ(g.grad_rows.size(0), P);
    EXPECT_EQ(g.grad_weights.defined(), with_probs);

    Tensor gp = poison_rows(dt, P, H);
    Tensor gprobs = filled(pdt, {N}, kPoison);
    run(popt, gp, with_probs ? gprobs.view() : TensorView{});
    EXPECT_TRUE(same_bytes(gp, g.grad_rows)) << "grad_padded differs from the allocating form";
    EXPECT_TRUE(rows_bitwise(gp, want.grad_padded, P)) << "grad_padded vs reference";
    for (int64_t p = 0; p < P; ++p)
      if (pr.permutation_map[static_cast<size_t>(p)] < 0)
        EXPECT_TRUE(bytes_are(gp, p, p + 1, 0x00)) << "grad_padded padding row " << p << " not zero";
    if (with_probs) {
      EXPECT_TRUE(same_bytes(gprobs, g.grad_weights)) << "grad_probs differs from the allocating form";
      EXPECT_TRUE(sums_close(gprobs, want.grad_probs, wabs.grad_probs, H, N)) << "grad_probs vs reference";
      EXPECT_TRUE(bytes_are(gprobs, total, N, 0x00)) << "grad_probs of rows no entry names must be zero";
      // the other accepted dtype for grad_probs
      const DType other = pdt == DType::kFloat32 ? dt : DType::kFloat32;
      Tensor gp2 = poison_rows(dt, P, H);
      Tensor gprobs2 = filled(other, {N}, kPoison);
      run(popt, gp2, gprobs2);
      EXPECT_TRUE(same_bytes(gp2, g.grad_rows));
      EXPECT_TRUE(sums_close(gprobs2, want.grad_probs, wabs.grad_probs, H, N)) << "grad_probs (" << dname(other) << ")";
      // skipped: grad_padded unchanged, nothing else written
      Tensor gp3 = poison_rows(dt, P, H);
      Tensor spare = filled(pdt, {N}, kPoison);
      run(popt, gp3, TensorView{});
      EXPECT_TRUE(same_bytes(gp3, g.grad_rows)) << "grad_padded with grad_probs skipped";
      EXPECT_TRUE(all_bytes_are(spare, kPoison));
    } else {
      EXPECT_TRUE(all_bytes_are(gprobs, kPoison)) << "skipped grad_probs was written";
    }
  }
  EXPECT_EQ(bytes_of(padded), padded0) << "modified padded";
  EXPECT_EQ(bytes_of(grad_out), go0) << "modified grad_out";
  EXPECT_EQ(bytes_of(probs), pr0) << "modified probs";

  // Bad outputs.
  const std::string op = "unpad_from_alignment_backward";
  const std::optional<TensorView> pv = probs.view();
  Tensor gp = poison_rows(dt, P, H);
  Tensor gprobs = filled(DType::kFloat32, {N}, kPoison);
  {
    Tensor bad = poison_rows(other_row_dtype(dt), P, H);
    expect_rejected([&] { run(pv, bad, gprobs); }, op, "grad_padded", kType, {&bad, &gprobs});
  }
  for (int64_t rows : {P - 1, P + 1}) {  // grad_padded has padded's shape exactly
    Tensor bad = poison_rows(dt, rows, H);
    expect_rejected([&] { run(pv, bad, gprobs); }, op, "grad_padded", kValue, {&bad, &gprobs});
  }
  {
    Tensor bad = poison_rows(dt, P, H + 1);
    expect_rejected([&] { run(pv, bad, gprobs); }, op, "grad_padded", kValue, {&bad, &gprobs});
  }
  for (int64_t len : {N - 1, N + 1}) {
    Tensor bad = filled(DType::kFloat32, {len}, kPoison);
    expect_rejected([&] { run(pv, gp, bad); }, op, "grad_probs", kValue, {&gp, &bad});
  }
  {
    Tensor bad = filled(bad_wgrad_dtype(dt), {N}, kPoison);
    expect_rejected([&] { run(pv, gp, bad); }, op, "grad_probs", kType, {&gp, &bad});
  }
}

INSTANTIATE_TEST_SUITE_P(All, UnpadBackwardOut,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values(0, 1)),
                         [](const ::testing::TestParamInfo<OutParam>& i) {
                           return std::string(dname(std::get<0>(i.param))) +
                                  (std::get<1>(i.param) == 0 ? "_pf32_i32" : "_prow_i64");
                         });

// ---------------------------------------------------------------------------
// padmoe::copy
// ---------------------------------------------------------------------------

// Fills n bytes with a seeded pattern (8 bytes per step: fast for 64 MiB).
void fill_pattern(void* p, size_t n, uint64_t seed) {
  Rng rng(seed);
  auto* b = static_cast<unsigned char*>(p);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = rng.next();
    std::memcpy(b + i, &v, 8);
  }
  for (; i < n; ++i) b[i] = static_cast<unsigned char>(rng.next());
}

// Copies `n` elements of dtype between 1-D views that start `src_off` /
// `dst_off` bytes into their buffers; dst's buffer has poison guard bytes
// before and after the view, which must survive.
::testing::AssertionResult copy_case(DType dtype, int64_t n, size_t src_off, size_t dst_off, int threads) {
  const size_t es = esize(dtype), bytes = static_cast<size_t>(n) * es, guard = 64;
  Tensor sbuf = Tensor::empty(DType::kFloat8E4M3, {static_cast<int64_t>(bytes + src_off)});
  Tensor dbuf = Tensor::empty(DType::kFloat8E4M3, {static_cast<int64_t>(bytes + dst_off + guard)});
  fill_pattern(sbuf.data(), bytes + src_off, static_cast<uint64_t>(n) * 7 + es);
  std::memset(dbuf.data(), kPoison, bytes + dst_off + guard);
  auto* s = static_cast<unsigned char*>(sbuf.data()) + src_off;
  auto* d = static_cast<unsigned char*>(dbuf.data()) + dst_off;
  const TensorView src = TensorView::contiguous(s, dtype, {n});
  const TensorView dst = TensorView::contiguous(d, dtype, {n});
  padmoe::Options o;
  o.num_threads = threads;
  padmoe::copy(src, dst, o);
  if (bytes > 0 && std::memcmp(s, d, bytes) != 0) {
    size_t i = 0;
    while (s[i] == d[i]) ++i;
    return ::testing::AssertionFailure() << "first differing byte " << i << " of " << bytes;
  }
  const auto* base = static_cast<const unsigned char*>(dbuf.data());
  for (size_t i = 0; i < dst_off; ++i)
    if (base[i] != kPoison) return ::testing::AssertionFailure() << "wrote " << dst_off - i << " bytes before dst";
  for (size_t i = 0; i < guard; ++i)
    if (d[bytes + i] != kPoison) return ::testing::AssertionFailure() << "wrote byte " << i << " past the end of dst";
  return ::testing::AssertionSuccess();
}

TEST(Copy, SizesAndDtypes) {
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2,
                   DType::kInt32, DType::kInt64}) {
    for (int64_t n : {0, 1, 7, 4095, 4096, 4097, 100003}) {
      for (int threads : {1, 0}) {
        SCOPED_TRACE(std::string(dname(dt)) + " n=" + std::to_string(n) + " threads=" + std::to_string(threads));
        EXPECT_TRUE(copy_case(dt, n, 0, 0, threads));
      }
    }
  }
  // Misaligned starts (element-aligned for the dtype, not 16-byte aligned).
  EXPECT_TRUE(copy_case(DType::kFloat8E4M3, 4097, 1, 3, 0));
  EXPECT_TRUE(copy_case(DType::kFloat16, 4097, 2, 6, 0));
  EXPECT_TRUE(copy_case(DType::kFloat32, 4097, 4, 12, 3));
}

TEST(Copy, StreamingSizes) {
  // 64 MiB + 3 bytes: past the streaming threshold, with a ragged tail.
  const int64_t n = (int64_t{64} << 20) + 3;
  EXPECT_TRUE(copy_case(DType::kFloat8E4M3, n, 0, 0, 0)) << "aligned";
  EXPECT_TRUE(copy_case(DType::kFloat8E4M3, n, 1, 0, 0)) << "unaligned src";
  EXPECT_TRUE(copy_case(DType::kFloat8E4M3, n, 0, 5, 3)) << "unaligned dst";
  // The same bytes as float32 elements (16 Mi + 1 of them), one thread.
  EXPECT_TRUE(copy_case(DType::kFloat32, (int64_t{16} << 20) + 1, 0, 0, 1)) << "float32, 1 thread";
}

TEST(Copy, ShapesWithTheSameElementCount) {
  Tensor src = Tensor::empty(DType::kBFloat16, {6, 7});
  fill_pattern(src.data(), 6 * 7 * 2, 5);
  Tensor dst = filled(DType::kBFloat16, {42}, kPoison);
  padmoe::copy(src, dst);
  EXPECT_TRUE(same_bytes(src, dst));
  Tensor dst3 = filled(DType::kBFloat16, {2, 3, 7}, kPoison);
  padmoe::copy(dst, dst3);
  EXPECT_TRUE(same_bytes(src, dst3));
}

TEST(Copy, Errors) {
  Tensor src = Tensor::empty(DType::kFloat32, {8, 16});
  fill_pattern(src.data(), 8 * 16 * 4, 9);
  const std::vector<unsigned char> src0 = bytes_of(src);
  {  // dtype mismatch (same byte count)
    Tensor dst = filled(DType::kInt32, {8, 16}, kPoison);
    expect_rejected([&] { padmoe::copy(src, dst); }, "copy", "dst", kType, {&dst});
    Tensor dst16 = filled(DType::kFloat16, {8, 32}, kPoison);
    expect_rejected([&] { padmoe::copy(src, dst16); }, "copy", "dst", kType, {&dst16});
  }
  for (int64_t n : {127, 129}) {  // element count mismatch
    Tensor dst = filled(DType::kFloat32, {n}, kPoison);
    expect_rejected([&] { padmoe::copy(src, dst); }, "copy", "dst", kValue, {&dst});
  }
  {  // non-contiguous src: 8 rows of 8 columns, row stride 16
    const TensorView strided = TensorView::matrix(src.data(), DType::kFloat32, 8, 8, 16);
    Tensor dst = filled(DType::kFloat32, {8, 8}, kPoison);
    expect_rejected([&] { padmoe::copy(strided, dst); }, "copy", "src", kValue, {&dst});
  }
  {  // non-contiguous dst
    Tensor buf = filled(DType::kFloat32, {16, 16}, kPoison);
    const TensorView strided = TensorView::matrix(buf.data(), DType::kFloat32, 8, 16, 32);
    expect_rejected([&] { padmoe::copy(src, strided); }, "copy", "dst", kValue, {&buf});
  }
  {  // non-contiguous 1-D view (stride 2)
    Tensor buf = filled(DType::kFloat32, {256}, kPoison);
    TensorView strided = TensorView::contiguous(buf.data(), DType::kFloat32, {128});
    strided.strides[0] = 2;
    expect_rejected([&] { padmoe::copy(src, strided); }, "copy", "dst", kValue, {&buf});
  }
  EXPECT_EQ(bytes_of(src), src0) << "copy modified src";
}

// A default TensorView{} has ndim 0 (numel 1) and a null pointer: copy must
// reject it like every op rejects a null data pointer (docs/spec.md §12), not
// dereference it. Disabled: padmoe::copy does not check data pointers yet.
TEST(Copy, NullDataPointerRejected) {
  Tensor dst = filled(DType::kFloat32, {1}, kPoison);
  EXPECT_TRUE(throws_error([&] { padmoe::copy(TensorView{}, dst); }, {"copy: src: "}, kValue));
  EXPECT_TRUE(all_bytes_are(dst, kPoison));
  Tensor src = filled(DType::kFloat32, {1}, 0);
  EXPECT_TRUE(throws_error([&] { padmoe::copy(src, TensorView{}); }, {"copy: dst: "}, kValue));
}

}  // namespace
}  // namespace pt
