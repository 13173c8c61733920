// test_cuda_rows.cpp — the row ops on the GPU (dispatch / combine, padded_gather / padded_scatter /
// padded_scatter_wgrad and the backward ops) beyond test_cuda_every_op.cpp's sweep: float8 moves,
// the plain reduce's row slices, every kernel of the reduce, reduce-with-dots and row_dots families
// and both forms of the sorted routing's destinations (each rerunning CpuVsGpu's workloads under
// the forced choice), Options::zero_padding = false and zero_tail, and a DeepSeek-V3-like step.
// Helpers: cuda_fixture.hpp.
#include "cuda_fixture.hpp"

namespace pt {
namespace {

// Float8 rows through the move-only GPU paths (vectorized and element-wise).
TEST(CpuVsGpuEdge, Float8MoveOnly) {
  REQUIRE_GPU();
  for (DType dt : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    for (int64_t H : {int64_t{32}, int64_t{21}}) {
      SCOPED_TRACE(std::string(dname(dt)) + " H=" + std::to_string(H));
      const int64_t T = 90;
      const int K = 2, E = 6, m = 16;
      const std::vector<int64_t> te = make_routing(T, K, E, Dist::kUniform, 21);
      const ref::Plan p = ref::make_plan(te, T, K, E, m);
      Rng rng(3);
      std::vector<float> xf(static_cast<size_t>(T * H));
      for (auto& v : xf) v = num::round_to(dt, static_cast<float>(rng.uniform() * 8.0));
      const Tensor hx = rows_from_float(xf, dt, T, H);
      const padmoe::Plan cplan = padmoe::make_plan(index_matrix(te, T, K, DType::kInt32), E, m);
      const padmoe::Plan gplan = padmoe::make_plan(to_gpu(index_matrix(te, T, K, DType::kInt32)), E, m);
      const Tensor cy = padmoe::dispatch(hx, cplan.view());
      Tensor gy = gpu_poison_rows(dt, p.capacity, H);
      padmoe::dispatch_out(to_gpu(hx), gplan.view(), std::nullopt, gy);
      expect_move("float8 dispatch_out", gy, cy, ref::padded_gather(xf, H, p, nullptr), p.padded_rows);
    }
  }
}

// The plain reduce's row slices (small T: a row split over several blocks) against no slicing and
// the CPU, bitwise, with the spreads a block and a warp a token: the moves and sums without dot
// products (dispatch and gather forms, combine and scatter, the unweighted backward ops),
// vectorized and element-wise rows, a row shorter than a slice, and T below and above the slicing
// threshold. The weighted backward ops (dots) never slice; they run here too, unchanged.
TEST(RowSlices, MatchNoSlicingAndCpu) {
  REQUIRE_GPU();
  struct Case {
    int64_t T, H;
    int K, E, m;
    DType dt;
  };
  for (const Case c : {Case{100, 7168, 8, 16, 16, DType::kBFloat16}, Case{37, 4100, 4, 5, 8, DType::kBFloat16},
                       Case{64, 3000, 2, 4, 1, DType::kFloat32}, Case{3, 200, 8, 8, 16, DType::kFloat16},
                       Case{700, 2048, 8, 32, 16, DType::kBFloat16}, Case{50, 300, 40, 64, 8, DType::kBFloat16}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " " + dname(c.dt));
    const std::vector<int64_t> te = make_routing(c.T, c.K, c.E, Dist::kSkewed, static_cast<uint64_t>(c.H));
    const Tensor hte = index_matrix(te, c.T, c.K, DType::kInt32);
    const padmoe::Plan cplan = padmoe::make_plan(hte, c.E, c.m);
    const padmoe::Plan gplan = padmoe::make_plan(to_gpu(hte), c.E, c.m);
    const int64_t P = padmoe::padded_rows(cplan.view());
    Rng rng(static_cast<uint64_t>(c.T));
    const Tensor hx = rows_from_float(random_values(c.T * c.H, c.dt, rng), c.dt, c.T, c.H);
    const Tensor hy = rows_from_float(random_values(P * c.H, c.dt, rng), c.dt, P, c.H);
    const Tensor hw = vec_from_float(random_values(c.T * c.K, DType::kFloat32, rng, 0, 1), DType::kFloat32);
    const Tensor dx = to_gpu(hx), dy = to_gpu(hy), dw = to_gpu(hw);
    const padmoe::PlanView gv = gplan.view(), cv = cplan.view();
    // each op on the GPU and on the CPU, every output
    using Outs = std::vector<Tensor>;
    const std::vector<std::pair<const char*, std::pair<std::function<Outs()>, std::function<Outs()>>>> ops = {
        {"dispatch(w)",
         {[&] { return Outs{padmoe::dispatch(dx, gv, TensorView(dw))}; },
          [&] { return Outs{padmoe::dispatch(hx, cv, TensorView(hw))}; }}},
        {"dispatch", {[&] { return Outs{padmoe::dispatch(dx, gv)}; }, [&] { return Outs{padmoe::dispatch(hx, cv)}; }}},
        {"combine(w)",
         {[&] { return Outs{padmoe::combine(dy, gv, TensorView(dw))}; },
          [&] { return Outs{padmoe::combine(hy, cv, TensorView(hw))}; }}},
        {"combine_backward",
         {[&] { return Outs{padmoe::combine_backward(dx, dy, gv).grad_rows}; },
          [&] { return Outs{padmoe::combine_backward(hx, hy, cv).grad_rows}; }}},
        {"dispatch_backward",
         {[&] { return Outs{padmoe::dispatch_backward(dy, dx, gv).grad_rows}; },
          [&] { return Outs{padmoe::dispatch_backward(hy, hx, cv).grad_rows}; }}},
        {"combine_backward(w)",
         {[&] {
            const padmoe::RowGrads g = padmoe::combine_backward(dx, dy, gv, TensorView(dw));
            return Outs{g.grad_rows, g.grad_weights};
          },
          [&] {
            const padmoe::RowGrads g = padmoe::combine_backward(hx, hy, cv, TensorView(hw));
            return Outs{g.grad_rows, g.grad_weights};
          }}},
    };
    for (const auto& op : ops) {
      SCOPED_TRACE(op.first);
      const Outs cpu = op.second.second();
      std::vector<Outs> runs;
      // the reduce with no slices, the default, as many as the row allows (the spreads a block a
      // token); then the spreads a warp a token (top_k 40: two rounds of 32 destinations), and the
      // policy's choice
      const std::pair<int, std::optional<pol::SpreadKernel>> settings[] = {{0, pol::SpreadKernel::kBlock},
                                                                           {-1, pol::SpreadKernel::kBlock},
                                                                           {1 << 20, pol::SpreadKernel::kBlock},
                                                                           {-1, pol::SpreadKernel::kWarp},
                                                                           {-1, std::nullopt}};
      for (const auto& [blocks, spread] : settings) {
        KernelOverrides ko;
        ko.reduce_slice_blocks = blocks;
        ko.spread = spread;
        const ScopedKernelOverrides forced(ko);
        Outs g = op.second.first();
        for (auto& t : g) t = to_cpu(t);
        runs.push_back(std::move(g));
      }
      for (size_t r = 0; r < runs.size(); ++r) {
        for (size_t i = 0; i < cpu.size(); ++i) {
          EXPECT_TRUE(all_same(runs[r][i], runs[0][i])) << "output " << i << ", run " << r << " vs no slicing";
          // moves and the ascending-k float32 sums are the CPU's bits; dots reduce in another order
          if (i == 0) {
            EXPECT_TRUE(all_same(runs[r][i], cpu[i])) << "output 0, run " << r << " vs CPU";
            continue;
          }
          const std::vector<float> g = vec_to_float(runs[r][i]), want = vec_to_float(cpu[i]);
          ASSERT_EQ(g.size(), want.size());
          for (size_t a = 0; a < g.size(); ++a) {
            ASSERT_NEAR(g[a], want[a], 2e-3 * (1.0 + std::fabs(want[a]))) << "dot " << a << ", run " << r;
          }
        }
      }
    }
  }
}

// The CPU-vs-GPU comparison on the named workloads (every dtype combo for most; H3 and topk8: the
// first combo only), as the kernel-family tests run it for each setting.
void run_named_workloads(const std::vector<std::string>& names, uint64_t seed) {
  for (const Workload& wl : workloads()) {
    if (std::find(names.begin(), names.end(), wl.name) == names.end()) continue;
    for (const Combo& cb : combos_of(wl.name == "H3" || wl.name == "topk8" ? 0 : 1)) run_cpu_vs_gpu(wl, cb, seed);
  }
}

// wgrad (got[a], a < T*K) against float64 sums of y[dest[a]] * x[a / K] over H columns (y, x as
// float; the tolerance allows the bf16 rounding of the output).
void expect_wgrad_near_float64(const std::vector<float>& got, const std::vector<float>& yv,
                               const std::vector<float>& xv, const int32_t* d, int64_t T, int K, int64_t H,
                               const char* what) {
  ASSERT_EQ(got.size(), static_cast<size_t>(T * K));
  for (int64_t a = 0; a < T * K; ++a) {
    double want = 0.0, scale = 0.0;
    for (int64_t h = 0; h < H; ++h) {
      const double p = static_cast<double>(yv[d[a] * H + h]) * xv[(a / K) * H + h];
      want += p;
      scale += std::fabs(p);
    }
    ASSERT_NEAR(got[a], want, 1e-5 * (1.0 + scale) + std::fabs(want) / 256.0) << what << ", assignment " << a;
  }
}

// The reduce with dots' kernels (KernelOverrides::reduce_dots: 0 a block a token at (1, 4), 1 the
// same at (2, 8), 2 a warp a token, 3 a block a token in the warp kernel's form, 4 the same with two
// units a lane at a time) against the reference on the CPU-vs-GPU
// workloads with dots (wgrad, the weighted backward ops, unpad's backward with probs, whose fused
// warp kernel runs in both), then each op twice, bitwise, in each mode at a decode-like shape.
TEST(DotKernels, BothFamiliesMatchReferenceAndRepeat) {
  REQUIRE_GPU();
  const std::vector<std::string> names = {"tiny",
                                          "empty_T",
                                          "empty_H",
                                          "skewed",
                                          "topk1",
                                          "topk8",
                                          "H3",
                                          "H4097",
                                          "H4096_vec",
                                          "align16_tiny_segments",
                                          "mb_T1024_H768_E64_K4",
                                          "only_last_expert"};
  std::vector<Tensor> family3;  // mode 4 (two units a lane) must give mode 3's bits
  const pol::ReduceDotsKernel kernels[] = {pol::ReduceDotsKernel::kBlock, pol::ReduceDotsKernel::kBlockWide,
                                           pol::ReduceDotsKernel::kTokenWarp, pol::ReduceDotsKernel::kTokenBlock,
                                           pol::ReduceDotsKernel::kTokenBlockTwoUnits};
  for (int mode : {0, 1, 2, 3, 4}) {
    SCOPED_TRACE("dot kernels " + std::to_string(mode));
    kernel_overrides().reduce_dots = kernels[mode];
    run_named_workloads(names, 11);
    // determinism: T = 300, K = 8, H = 7168 (both row-length rules), every dot op twice
    const int64_t T = 300, H = 7168;
    const int K = 8, E = 64, m = 16;
    const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 5);
    const Tensor dte = to_gpu(index_matrix(te, T, K, DType::kInt32));
    const padmoe::Plan plan = padmoe::make_plan(dte, E, m);
    const int64_t P = padmoe::padded_rows(plan.view());
    Rng rng(9);
    const Tensor dx = to_gpu(rows_from_float(random_values(T * H, DType::kBFloat16, rng), DType::kBFloat16, T, H));
    const Tensor dy = to_gpu(rows_from_float(random_values(P * H, DType::kBFloat16, rng), DType::kBFloat16, P, H));
    const Tensor dw = to_gpu(vec_from_float(random_values(T * K, DType::kFloat32, rng, 0, 1), DType::kFloat32));
    const padmoe::PlanView v = plan.view();
    // unpad's backward: rows grouped by expert (the plan's counts), padded, then unpadded
    const Tensor dh =
        to_gpu(rows_from_float(random_values(T * K * H, DType::kBFloat16, rng), DType::kBFloat16, T * K, H));
    const padmoe::PadResult pad = padmoe::pad_to_alignment(dh, v.tokens_per_expert, m);
    auto run = [&] {
      std::vector<Tensor> o;
      const padmoe::RowGrads a = padmoe::combine_backward(dx, dy, v, TensorView(dw));
      const padmoe::RowGrads b = padmoe::dispatch_backward(dy, dx, v, TensorView(dw));
      const padmoe::RowGrads u =
          padmoe::unpad_from_alignment_backward(dh, pad.padded, pad.permutation_map, TensorView(dw));
      o = {to_cpu(a.grad_rows),    to_cpu(a.grad_weights), to_cpu(b.grad_rows),
           to_cpu(b.grad_weights), to_cpu(u.grad_rows),    to_cpu(u.grad_weights)};
      o.push_back(to_cpu(padmoe::padded_scatter_wgrad(dy, dx, v.indices, v.bin_ids, v.bins, v.padded_bins, K)));
      return o;
    };
    const std::vector<Tensor> first = run(), second = run();
    for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(all_same(first[i], second[i])) << "output " << i;
    if (mode == 3) family3 = first;
    if (mode == 4) {
      for (size_t i = 0; i < first.size(); ++i)
        EXPECT_TRUE(all_same(family3[i], first[i])) << "mode 3 vs 4, output " << i;
    }
    if (mode != 4) continue;
    // By shape (-1) at this T (about two tokens an SM on the H200, where the reduce with dots
    // loads two units a lane; the family depends on the card's SM count): run twice, bitwise;
    // and wgrad against float64 sums (rounded once to bf16, y's dtype).
    kernel_overrides().reduce_dots.reset();
    const std::vector<Tensor> by_shape = run(), again = run();
    for (size_t i = 0; i < by_shape.size(); ++i)
      EXPECT_TRUE(all_same(by_shape[i], again[i])) << "by shape, output " << i;
    const Tensor dest = to_cpu(v.dest_rows);
    expect_wgrad_near_float64(vec_to_float(by_shape.back()), rows_to_float(to_cpu(dy)), rows_to_float(to_cpu(dx)),
                              static_cast<const int32_t*>(dest.data()), T, K, H, "wgrad by shape");
  }
  kernel_overrides().reduce_dots.reset();
}

// row_dots' kernels (KernelOverrides::row_dots: 0 a warp an assignment, 1 a block a token with every source
// row's unit loaded together) against the reference on the CPU-vs-GPU workloads (wgrad among the
// ops), then wgrad at a decode-like shape against float64 sums, twice, bitwise.
TEST(RowDots, EveryKernelMatchesReferenceAndRepeats) {
  REQUIRE_GPU();
  const std::vector<std::string> names = {"tiny",
                                          "empty_T",
                                          "empty_H",
                                          "skewed",
                                          "topk1",
                                          "topk8",
                                          "H3",
                                          "H4097",
                                          "H4096_vec",
                                          "mb_T1024_H768_E64_K4",
                                          "only_last_expert"};
  const int64_t T = 260, H = 7168;
  const int K = 8, E = 64, m = 16;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 17);
  const Tensor dte = to_gpu(index_matrix(te, T, K, DType::kInt32));
  const padmoe::Plan plan = padmoe::make_plan(dte, E, m);
  const padmoe::PlanView v = plan.view();
  const int64_t P = padmoe::padded_rows(v);
  Rng rng(23);
  const Tensor dx = to_gpu(rows_from_float(random_values(T * H, DType::kBFloat16, rng), DType::kBFloat16, T, H));
  const Tensor dy = to_gpu(rows_from_float(random_values(P * H, DType::kBFloat16, rng), DType::kBFloat16, P, H));
  const std::vector<float> yv = rows_to_float(to_cpu(dy)), xv = rows_to_float(to_cpu(dx));
  const Tensor dest = to_cpu(v.dest_rows);
  const int32_t* d = static_cast<const int32_t*>(dest.data());
  for (int mode : {0, 1}) {
    SCOPED_TRACE("row dots " + std::to_string(mode));
    kernel_overrides().row_dots = mode == 0 ? pol::RowDotsKernel::kAssignmentWarp : pol::RowDotsKernel::kTokenBlock;
    run_named_workloads(names, 13);
    auto run = [&] {
      return to_cpu(padmoe::padded_scatter_wgrad(dy, dx, v.indices, v.bin_ids, v.bins, v.padded_bins, K));
    };
    const Tensor first = run(), second = run();
    EXPECT_TRUE(all_same(first, second)) << "wgrad twice";
    expect_wgrad_near_float64(vec_to_float(first), yv, xv, d, T, K, H, "wgrad");
  }
  kernel_overrides().row_dots.reset();
}

// The MegaBlocks-argument ops find their rows by a search of the sorted form where A is small
// (the default: A <= 4096, E <= 256, top_k <= 8), else through a dest_rows array built first:
// both forms against the reference on the CPU-vs-GPU workloads (the suite's other tests run the
// default), and the search form at a decode-like size bitwise equal to the dest_rows form.
TEST(DestSearch, BothFormsMatchReference) {
  REQUIRE_GPU();
  const std::vector<std::string> names = {"tiny",
                                          "empty_T",
                                          "empty_H",
                                          "skewed",
                                          "topk1",
                                          "topk8",
                                          "H3",
                                          "H4097",
                                          "H4096_vec",
                                          "align16_tiny_segments",
                                          "mb_T1024_H768_E64_K4",
                                          "only_last_expert"};
  for (int mode : {0, -1}) {
    SCOPED_TRACE("dest search " + std::to_string(mode));
    kernel_overrides().dest_search = mode == 0 ? std::optional<bool>(false) : std::nullopt;
    run_named_workloads(names, 19);
  }
  // T = 256, K = 8, E = 256, H = 7168 (decode): every MegaBlocks op, searched and built
  const int64_t T = 256, H = 7168;
  const int K = 8, E = 256, m = 16;
  ASSERT_TRUE(padmoe::cuda::dest_search_fits(T * K, E, K));
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 29);
  const ref::Plan p = ref::make_plan(te, T, K, E, m);
  const IndexInputs hii = index_inputs(p, DType::kInt32);
  const IndexInputs d{to_gpu(hii.indices), to_gpu(hii.bin_ids), to_gpu(hii.bins), to_gpu(hii.padded_bins)};
  const int64_t P = p.padded_rows;
  Rng rng(31);
  const Tensor dx = to_gpu(rows_from_float(random_values(T * H, DType::kBFloat16, rng), DType::kBFloat16, T, H));
  const Tensor dy = to_gpu(rows_from_float(random_values(P * H, DType::kBFloat16, rng), DType::kBFloat16, P, H));
  const Tensor dw = to_gpu(vec_from_float(random_values(T * K, DType::kFloat32, rng, 0, 1), DType::kFloat32));
  auto run = [&] {
    std::vector<Tensor> o;
    for (bool weighted : {false, true}) {
      std::optional<TensorView> w;
      if (weighted) w = dw.view();
      o.push_back(to_cpu(padmoe::padded_gather(dx, d.indices, d.bin_ids, d.bins, d.padded_bins, K, w)));
      o.push_back(to_cpu(padmoe::padded_scatter(dy, d.indices, d.bin_ids, w, d.bins, d.padded_bins, K)));
      const padmoe::RowGrads gb =
          padmoe::padded_gather_backward(dy, dx, d.indices, d.bin_ids, d.bins, d.padded_bins, K, w);
      const padmoe::RowGrads sb =
          padmoe::padded_scatter_backward(dx, dy, d.indices, d.bin_ids, w, d.bins, d.padded_bins, K);
      o.push_back(to_cpu(gb.grad_rows));
      o.push_back(to_cpu(sb.grad_rows));
      if (weighted) {
        o.push_back(to_cpu(gb.grad_weights));
        o.push_back(to_cpu(sb.grad_weights));
      }
    }
    o.push_back(to_cpu(padmoe::padded_scatter_wgrad(dy, dx, d.indices, d.bin_ids, d.bins, d.padded_bins, K)));
    return o;
  };
  kernel_overrides().dest_search = false;
  const std::vector<Tensor> built = run();
  kernel_overrides().dest_search.reset();
  const std::vector<Tensor> searched = run(), again = run();
  ASSERT_EQ(built.size(), searched.size());
  for (size_t i = 0; i < built.size(); ++i) {
    EXPECT_TRUE(all_same(built[i], searched[i])) << "output " << i << ": searched vs built";
    EXPECT_TRUE(all_same(searched[i], again[i])) << "output " << i << ": searched twice";
  }
}

// Bad unchecked input (an assignment id past A, an expert past E) through the MegaBlocks ops, in
// both forms: no error, nothing written past the rows given; in the search form the two entries
// are skipped, so every other row of padded_gather is the clean result and theirs keep the poison.
TEST(DestSearch, BadUncheckedInputStaysInBounds) {
  REQUIRE_GPU();
  const int64_t T = 64, H = 64;
  const int K = 4, E = 16, m = 8;
  const int64_t A = T * K;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 37);
  const ref::Plan p = ref::make_plan(te, T, K, E, m);
  const int64_t P = p.padded_rows;
  ref::Plan bad = p;
  bad.indices[3] = A + 7;
  bad.bin_ids[5] = E + 2;
  const IndexInputs hii = index_inputs(bad, DType::kInt32);
  const IndexInputs d{to_gpu(hii.indices), to_gpu(hii.bin_ids), to_gpu(hii.bins), to_gpu(hii.padded_bins)};
  Rng rng(41);
  const std::vector<float> xf = random_values(T * H, DType::kFloat32, rng);
  const Tensor dx = to_gpu(rows_from_float(xf, DType::kFloat32, T, H));
  const Tensor dy = to_gpu(rows_from_float(random_values(P * H, DType::kFloat32, rng), DType::kFloat32, P, H));
  const std::vector<float> want = ref::padded_gather(xf, H, p, nullptr);  // the clean routing
  // rows of the two bad positions (the sorted form's row of position i)
  auto row_of = [&](int64_t i, int e) {
    return i - (e == 0 ? 0 : p.bins[e - 1]) + (e == 0 ? 0 : p.padded_bins[e - 1]);
  };
  const int64_t bad_rows[2] = {row_of(3, static_cast<int>(p.bin_ids[3])), row_of(5, static_cast<int>(p.bin_ids[5]))};
  padmoe::Options o;
  o.check_data = false;
  constexpr int64_t kGuard = 8;
  for (int mode : {0, -1}) {
    SCOPED_TRACE("dest search " + std::to_string(mode));
    kernel_overrides().dest_search = mode == 0 ? std::optional<bool>(false) : std::nullopt;
    Tensor gy = gpu_poison_rows(DType::kFloat32, P + kGuard, H);
    TensorView yv = gy.view();
    yv.shape[0] = P;
    padmoe::padded_gather_out(dx, d.indices, d.bin_ids, d.bins, d.padded_bins, K, std::nullopt, yv, o);
    Tensor out = gpu_poison_rows(DType::kFloat32, T, H), gw = gpu_filled(DType::kFloat32, {A}, kPoison);
    padmoe::padded_scatter_out(dy, d.indices, d.bin_ids, std::nullopt, d.bins, d.padded_bins, K, out, o);
    padmoe::padded_scatter_wgrad_out(dy, dx, d.indices, d.bin_ids, d.bins, d.padded_bins, K, gw, o);
    padmoe::padded_gather_backward_out(dy, dx, d.indices, d.bin_ids, d.bins, d.padded_bins, K, std::nullopt, out, gw,
                                       o);
    Tensor gy2 = gpu_poison_rows(DType::kFloat32, P + kGuard, H);
    TensorView y2 = gy2.view();
    y2.shape[0] = P;
    padmoe::padded_scatter_backward_out(dx, dy, d.indices, d.bin_ids, std::nullopt, d.bins, d.padded_bins, K, y2, gw,
                                        o);
    const Tensor hy = to_cpu(gy), hy2 = to_cpu(gy2);  // a kernel fault would throw here
    const unsigned char* b = static_cast<const unsigned char*>(hy.data());
    const unsigned char* b2 = static_cast<const unsigned char*>(hy2.data());
    for (int64_t i = P * H * 4; i < (P + kGuard) * H * 4; ++i) {
      ASSERT_EQ(b[i], kPoison) << "padded_gather wrote past P, byte " << i;
      ASSERT_EQ(b2[i], kPoison) << "padded_scatter_backward wrote past P, byte " << i;
    }
    if (mode != -1) continue;
    const std::vector<float> got = rows_to_float(hy);
    for (int64_t r = 0; r < P; ++r) {
      const bool skipped = r == bad_rows[0] || r == bad_rows[1];
      for (int64_t h = 0; h < H; ++h) {
        if (skipped) {
          ASSERT_EQ(std::memcmp(b + (r * H + h) * 4, b + P * H * 4, 4), 0) << "row " << r << " (a bad entry's) written";
        } else {
          ASSERT_EQ(got[r * H + h], want[r * H + h]) << "row " << r << ", column " << h;
        }
      }
    }
  }
  kernel_overrides().dest_search.reset();
}

// Every shape of the plain reduce (combine, padded_scatter, the unweighted backward ops): the
// CPU's bits on the edge workloads (top-1, top-2, top-8, odd H, few and many tokens), and the
// default's bits at decode size (T = 256, K = 8, H = 7168), twice.
TEST(ReduceShapes, MatchReferenceAndDefault) {
  REQUIRE_GPU();
  const std::vector<std::string> names = {"tiny",
                                          "empty_T",
                                          "empty_H",
                                          "skewed",
                                          "topk1",
                                          "topk8",
                                          "H3",
                                          "H4097",
                                          "H4096_vec",
                                          "mb_T1024_H768_E64_K4",
                                          "only_last_expert"};
  const int64_t T = 256, H = 7168;
  const int K = 8, E = 256, m = 16;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 3);
  const Tensor dte = to_gpu(index_matrix(te, T, K, DType::kInt32));
  const padmoe::Plan plan = padmoe::make_plan(dte, E, m);
  const padmoe::PlanView v = plan.view();
  const int64_t P = padmoe::padded_rows(v);
  Rng rng(21);
  const Tensor dy = to_gpu(rows_from_float(random_values(P * H, DType::kBFloat16, rng), DType::kBFloat16, P, H));
  const Tensor dw = to_gpu(vec_from_float(random_values(T * K, DType::kFloat32, rng, 0, 1), DType::kFloat32));
  auto run = [&] {
    return std::vector<Tensor>{
        to_cpu(padmoe::combine(dy, v, TensorView(dw))), to_cpu(padmoe::combine(dy, v)),
        to_cpu(padmoe::padded_scatter(dy, v.indices, v.bin_ids, TensorView(dw), v.bins, v.padded_bins, K))};
  };
  kernel_overrides().reduce.reset();
  const std::vector<Tensor> want = run();
  const pol::ReduceKernel shapes[] = {pol::ReduceKernel::kBlock, pol::ReduceKernel::kBlockWide,
                                      pol::ReduceKernel::kTokenBlock, pol::ReduceKernel::kTokenBlockTwoUnits};
  for (int shape = 0; shape < 4; ++shape) {
    SCOPED_TRACE("reduce shape " + std::to_string(shape));
    kernel_overrides().reduce = shapes[shape];
    for (const Workload& wl : workloads()) {
      if (std::find(names.begin(), names.end(), wl.name) == names.end()) continue;
      for (const Combo& cb : combos_of(wl.name == "H3" ? 0 : 1)) run_cpu_vs_gpu(wl, cb, 13);
    }
    for (int r = 0; r < 2; ++r) {
      const std::vector<Tensor> got = run();
      for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(all_same(want[i], got[i])) << "output " << i << " run " << r;
    }
  }
  kernel_overrides().reduce.reset();
}

// Options::zero_padding = false: the GPU's forward spreads leave padding rows unwritten (poison stays)
// and write the real rows as the CPU does; backward grad_y still zeroes them.
TEST(CpuVsGpuEdge, ZeroPaddingOff) {
  REQUIRE_GPU();
  const int64_t T = 300, H = 40;
  const int K = 2, E = 7, m = 16;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 41);
  const ref::Plan p = ref::make_plan(te, T, K, E, m);
  Rng rng(9);
  for (DType dt : {DType::kBFloat16, DType::kFloat8E5M2}) {
    SCOPED_TRACE(dname(dt));
    const std::vector<float> xf = random_values(T * H, dt, rng);
    const Tensor hx = rows_from_float(xf, dt, T, H);
    const padmoe::Plan gplan = padmoe::make_plan(to_gpu(index_matrix(te, T, K, DType::kInt32)), E, m);
    padmoe::Options o;
    o.zero_padding = false;
    Tensor gy = gpu_poison_rows(dt, p.capacity, H);
    padmoe::dispatch_out(to_gpu(hx), gplan.view(), std::nullopt, gy, o);
    const Tensor hy = to_cpu(gy);
    const std::vector<float> want = ref::padded_gather(xf, H, p, nullptr);
    for (int64_t r = 0; r < p.capacity; ++r) {
      if (r < p.padded_rows && p.row_sources[static_cast<size_t>(r)] >= 0) {
        std::vector<float> one(want.begin() + r * H, want.begin() + (r + 1) * H);
        ASSERT_TRUE(rows_bitwise(hy, one, 1, 0, H, r)) << "real row " << r;
      } else {
        ASSERT_TRUE(bytes_are(hy, r, r + 1, kPoison)) << "row " << r << " (padding or past P) was written";
      }
    }
    std::vector<float> hf;
    for (int64_t i = 0; i < T * K; ++i) {
      const int64_t t = p.indices[static_cast<size_t>(i)] / K;
      hf.insert(hf.end(), xf.begin() + t * H, xf.begin() + (t + 1) * H);
    }
    Tensor gpad = gpu_poison_rows(dt, p.padded_rows, H), gmap = gpu_poison_index(p.padded_rows),
           goff = gpu_poison_index(E);
    padmoe::pad_to_alignment_out(to_gpu(rows_from_float(hf, dt, T * K, H)),
                                 to_gpu(index_tensor(p.tokens_per_expert, DType::kInt32)), m, gpad, gmap, goff, o);
    const Tensor hp = to_cpu(gpad);
    for (int64_t r = 0; r < p.padded_rows; ++r) {
      if (p.row_sources[static_cast<size_t>(r)] >= 0) {
        std::vector<float> one(want.begin() + r * H, want.begin() + (r + 1) * H);
        ASSERT_TRUE(rows_bitwise(hp, one, 1, 0, H, r)) << "pad: real row " << r;
      } else {
        ASSERT_TRUE(bytes_are(hp, r, r + 1, kPoison)) << "pad: padding row " << r << " was written";
      }
    }
  }
  // backward: padding rows of grad_y zeroed whatever the option
  const std::vector<float> gf = random_values(T * H, DType::kFloat32, rng);
  const padmoe::Plan gplan = padmoe::make_plan(to_gpu(index_matrix(te, T, K, DType::kInt32)), E, m);
  padmoe::Options o;
  o.zero_padding = false;
  Tensor ggy = gpu_poison_rows(DType::kFloat32, p.capacity, H);
  const Tensor y1 = to_gpu(
      rows_from_float(std::vector<float>(static_cast<size_t>(p.capacity * H), 1.0f), DType::kFloat32, p.capacity, H));
  padmoe::combine_backward_out(to_gpu(rows_from_float(gf, DType::kFloat32, T, H)), y1, gplan.view(), std::nullopt, ggy,
                               TensorView{}, o);
  EXPECT_TRUE(rows_bitwise(to_cpu(ggy), ref::padded_gather(gf, H, p, nullptr), p.padded_rows));
}

// Options::zero_tail on the GPU: rows at or past P of a capacity-sized dispatch
// output are zero (bitwise equal to the CPU's), untouched without it.
TEST(ZeroTail, DispatchOnGpuMatchesCpu) {
  REQUIRE_GPU();
  const int64_t T = 300, H = 72;
  const int E = 9, K = 3, m = 16;
  const int64_t cap = padmoe::padded_rows_bound(T, K, E, m);
  const DType dt = DType::kBFloat16;
  const padmoe::workload::Routing rt = padmoe::workload::random_router(T, E, K, 5);
  const Tensor hte = Tensor::empty(DType::kInt32, {T, K});
  std::memcpy(hte.data(), rt.top_experts.data(), static_cast<size_t>(T * K) * 4);
  const Tensor hx = Tensor::empty(dt, {T, H});
  padmoe::workload::fill_uniform(hx.data(), dt, T * H, 3);
  const padmoe::Plan cplan = padmoe::make_plan(hte, E, m);
  const int64_t P = padmoe::padded_rows(cplan);
  ASSERT_LT(P, cap);
  GpuPlan gp = gpu_plan_buffers(T, K, E, m);
  padmoe::make_plan_out(to_gpu(hte), E, m, gp.view);
  const Tensor dx = to_gpu(hx);
  for (bool zero_tail : {false, true}) {
    padmoe::Options o;
    o.zero_tail = zero_tail;
    Tensor cy = poison_rows(dt, cap, H);
    padmoe::dispatch_out(hx, cplan.view(), std::nullopt, cy, o);
    Tensor gy = gpu_poison_rows(dt, cap, H);
    padmoe::dispatch_out(dx, gp.view, std::nullopt, gy, o);
    const Tensor hy = to_cpu(gy);
    EXPECT_TRUE(rows_same(hy, cy, 0, cap)) << "zero_tail=" << zero_tail;
    EXPECT_TRUE(bytes_are(hy, P, cap, zero_tail ? 0x00 : kPoison)) << "zero_tail=" << zero_tail;
  }
}

// ---------------------------------------------------------------------------
// A DeepSeek-V3-like step: T=4096, E=256, K=8, H=7168, bf16, alignment 128.
// ---------------------------------------------------------------------------
TEST(Large, DeepSeekV3DispatchCombine) {
  REQUIRE_GPU();
  const int64_t T = 4096, H = 7168;
  const int E = 256, K = 8, m = 128;
  const int64_t A = T * K, cap = padmoe::padded_rows_bound(T, K, E, m);
  const DType dt = DType::kBFloat16;
  const padmoe::workload::Routing rt = padmoe::workload::random_router(T, E, K, 42);
  const Tensor hte = Tensor::empty(DType::kInt32, {T, K});
  std::memcpy(hte.data(), rt.top_experts.data(), static_cast<size_t>(A) * 4);
  const Tensor hw = vec_from_float(rt.weights, DType::kFloat32);
  const Tensor hx = Tensor::empty(dt, {T, H});
  padmoe::workload::fill_uniform(hx.data(), dt, T * H, 7);

  const padmoe::Plan cplan = padmoe::make_plan(hte, E, m);
  const int64_t P = padmoe::padded_rows(cplan);
  const Tensor dte = to_gpu(hte), dx = to_gpu(hx), dw = to_gpu(hw);
  GpuPlan gp = gpu_plan_buffers(T, K, E, m);
  padmoe::make_plan_out(dte, E, m, gp.view);
  for (const auto& f :
       {std::make_pair(&gp.indices, &cplan.indices), std::make_pair(&gp.dest_rows, &cplan.dest_rows),
        std::make_pair(&gp.row_sources, &cplan.row_sources), std::make_pair(&gp.padded_bins, &cplan.padded_bins)})
    EXPECT_TRUE(all_same(to_cpu(*f.first), *f.second)) << "plan field GPU vs CPU";

  // dispatch (weighted): bitwise vs CPU, rows past P untouched.
  const Tensor cy = padmoe::dispatch(hx, cplan.view(), hw.view());
  Tensor gy = gpu_poison_rows(dt, cap, H);
  padmoe::dispatch_out(dx, gp.view, dw.view(), gy);
  const Tensor hy = to_cpu(gy);
  EXPECT_TRUE(rows_same(hy, cy, 0, P)) << "dispatch GPU vs CPU";
  EXPECT_TRUE(bytes_are(hy, P, std::min<int64_t>(cap, P + 64), kPoison)) << "dispatch wrote past P";

  // combine (weighted) of the dispatched rows: GPU and CPU vs a float64 sum.
  const Tensor cout = padmoe::combine(cy, cplan.view(), hw.view());
  Tensor gout = gpu_poison_rows(dt, T, H);
  padmoe::combine_out(gy, gp.view, dw.view(), gout);
  const Tensor hout = to_cpu(gout);
  const int32_t* dest = cplan.dest_rows.data_as<int32_t>();
  std::atomic<int64_t> bad{0};
  const unsigned nthreads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  std::vector<std::string> first(nthreads);
  for (unsigned w = 0; w < nthreads; ++w)
    pool.emplace_back([&, w] {
      for (int64_t t = w; t < T; t += nthreads)
        for (int64_t h = 0; h < H; ++h) {
          double s = 0, sa = 0;
          for (int k = 0; k < K; ++k) {
            const int64_t a = t * K + k;
            const double v = static_cast<double>(rt.weights[a]) *
                             num::load_as_float(cy.data(), dt, static_cast<int64_t>(dest[a]) * H + h);
            s += v;
            sa += std::fabs(v);
          }
          const double tol = sum_tolerance(K, sa, s, dt);
          const double g = num::load_as_float(hout.data(), dt, t * H + h);
          const double c = num::load_as_float(cout.data(), dt, t * H + h);
          if (!(std::fabs(g - s) <= tol) || !(std::fabs(c - s) <= tol)) {
            if (bad.fetch_add(1) < 1)
              first[w] = "t=" + std::to_string(t) + " h=" + std::to_string(h) + " gpu=" + std::to_string(g) +
                         " cpu=" + std::to_string(c) + " want=" + std::to_string(s);
          }
        }
    });
  for (auto& th : pool) th.join();
  std::string msg;
  for (const auto& s : first) msg += s;
  EXPECT_EQ(bad.load(), 0) << "combine out of tolerance: " << msg;
}

}  // namespace
}  // namespace pt
