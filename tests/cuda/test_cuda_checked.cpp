// test_cuda_checked.cpp — checked mode on the GPU: bad data throws padmoe::Error naming the argument
// and leaves the output unwritten; unchecked mode agrees on valid input. Helpers: cuda_fixture.hpp.
#include "cuda_fixture.hpp"

namespace pt {
namespace {

// ---------------------------------------------------------------------------
// Checked mode
// ---------------------------------------------------------------------------
struct CheckedSetup {
  int64_t T = 64, H = 16;
  int E = 8, K = 2, m = 8;
  std::vector<int64_t> te;
  ref::Plan p;
  Tensor hx, hw;
  Tensor dx, dw;
};
CheckedSetup checked_setup() {
  CheckedSetup s;
  s.te = make_routing(s.T, s.K, s.E, Dist::kUniform, 5);
  s.p = ref::make_plan(s.te, s.T, s.K, s.E, s.m);
  Rng rng(6);
  s.hx = rows_from_float(random_values(s.T * s.H, DType::kFloat32, rng), DType::kFloat32, s.T, s.H);
  s.hw = vec_from_float(random_values(s.T * s.K, DType::kFloat32, rng, 0, 1), DType::kFloat32);
  s.dx = to_gpu(s.hx);
  s.dw = to_gpu(s.hw);
  return s;
}

TEST(CheckedMode, BadDataThrowsAndWritesNothing) {
  REQUIRE_GPU();
  const CheckedSetup s = checked_setup();
  const int64_t P = s.p.padded_rows, cap = s.p.capacity, A = s.T * s.K;
  ASSERT_GE(s.p.tokens_per_expert[3], 1);

  // Bad expert id -> make_plan_out: "top_experts"; nothing written.
  {
    std::vector<int64_t> te = s.te;
    te[37] = s.E;
    const Tensor dte = to_gpu(index_matrix(te, s.T, s.K, DType::kInt32));
    GpuPlan gp = gpu_plan_buffers(s.T, s.K, s.E, s.m);
    const std::string at = "[" + std::to_string(37 / s.K) + ", " + std::to_string(37 % s.K) + "]";
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(dte, s.E, s.m, gp.view); },
                             {"make_plan", "top_experts", "expert id 8", at.c_str()}));
    for (const Tensor* t :
         {&gp.indices, &gp.bin_ids, &gp.tpe, &gp.bins, &gp.ptpe, &gp.padded_bins, &gp.dest_rows, &gp.row_sources})
      EXPECT_TRUE(all_bytes_are(to_cpu(*t), kIndexPoison)) << "make_plan_out wrote a plan buffer";
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan(dte, s.E, s.m); }, {"top_experts"}));
    std::vector<int64_t> te2 = s.te;
    te2[3] = -1;
    const Tensor dte2 = to_gpu(index_matrix(te2, s.T, s.K, DType::kInt64));
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(dte2, s.E, s.m, gp.view); }, {"top_experts", "-1"}));
    EXPECT_TRUE(all_bytes_are(to_cpu(gp.row_sources), kIndexPoison));
  }

  // MegaBlocks-style routing arguments, each corrupted one way.
  struct Bad {
    const char* what;
    std::function<void(ref::Plan&)> corrupt;
    std::vector<std::string> needles;
  };
  const std::vector<Bad> bads = {
      {"bins decreasing", [](ref::Plan& p) { p.bins[2] = p.bins[1] - 1; }, {"bins", "nondecreasing"}},
      {"padded segment too small",
       [](ref::Plan& p) { p.padded_bins[3] = p.padded_bins[2] + (p.bins[3] - p.bins[2]) - 1; },
       {"padded_bins", "expert 3"}},
      {"bin_ids inconsistent",
       [](ref::Plan& p) { p.bin_ids[10] = (p.bin_ids[10] + 1) % 8; },
       {"bin_ids", "position 10"}},
      {"repeated index", [](ref::Plan& p) { p.indices[5] = p.indices[6]; }, {"indices", "more than once"}},
      {"index out of range", [](ref::Plan& p) { p.indices[7] = 100000; }, {"indices", "position 7"}},
  };
  for (const Bad& b : bads) {
    SCOPED_TRACE(b.what);
    for (DType idx : {DType::kInt32, DType::kInt64}) {
      ref::Plan q = s.p;
      b.corrupt(q);
      const IndexInputs hii = index_inputs(q, idx);
      const IndexInputs dii{to_gpu(hii.indices), to_gpu(hii.bin_ids), to_gpu(hii.bins), to_gpu(hii.padded_bins)};
      // CPU agrees that it is an error naming the same argument.
      EXPECT_TRUE(throws_error(
          [&] {
            Tensor y = poison_rows(DType::kFloat32, cap, s.H);
            padmoe::padded_gather_out(s.hx, hii.indices, hii.bin_ids, hii.bins, hii.padded_bins, s.K, s.hw.view(), y);
          },
          {b.needles[0]}));
      Tensor gy = gpu_poison_rows(DType::kFloat32, cap, s.H);
      EXPECT_TRUE(throws_error(
          [&] {
            padmoe::padded_gather_out(s.dx, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, s.K, s.dw.view(), gy);
          },
          b.needles));
      EXPECT_TRUE(all_bytes_are(to_cpu(gy), kPoison)) << "padded_gather_out wrote before failing";
      Tensor go = gpu_poison_rows(DType::kFloat32, s.T, s.H);
      const Tensor dyin = gpu_filled(DType::kFloat32, {cap, s.H}, 0);
      EXPECT_TRUE(throws_error(
          [&] {
            padmoe::padded_scatter_out(dyin, dii.indices, dii.bin_ids, s.dw.view(), dii.bins, dii.padded_bins, s.K, go);
          },
          b.needles));
      EXPECT_TRUE(all_bytes_are(to_cpu(go), kPoison)) << "padded_scatter_out wrote before failing";
      Tensor gwg = gpu_filled(DType::kFloat32, {A}, kPoison);
      EXPECT_TRUE(throws_error(
          [&] {
            padmoe::padded_scatter_wgrad_out(dyin, s.dx, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, s.K, gwg);
          },
          b.needles));
      EXPECT_TRUE(all_bytes_are(to_cpu(gwg), kPoison)) << "padded_scatter_wgrad_out wrote before failing";
    }
  }

  // Output with too few rows (P - 1): padded_gather_out and dispatch_out.
  {
    const IndexInputs hii = index_inputs(s.p, DType::kInt32);
    const IndexInputs dii{to_gpu(hii.indices), to_gpu(hii.bin_ids), to_gpu(hii.bins), to_gpu(hii.padded_bins)};
    Tensor gy = gpu_poison_rows(DType::kFloat32, P - 1, s.H);
    EXPECT_TRUE(throws_error(
        [&] {
          padmoe::padded_gather_out(s.dx, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, s.K, std::nullopt, gy);
        },
        {"padded_gather", "y", std::to_string(P)}));
    EXPECT_TRUE(all_bytes_are(to_cpu(gy), kPoison));
    const padmoe::Plan plan = padmoe::make_plan(to_gpu(index_matrix(s.te, s.T, s.K, DType::kInt32)), s.E, s.m);
    EXPECT_TRUE(throws_error([&] { padmoe::dispatch_out(s.dx, plan.view(), s.dw.view(), gy); },
                             {"dispatch", "y", std::to_string(P)}));
    EXPECT_TRUE(all_bytes_are(to_cpu(gy), kPoison));
    Tensor cgy = gpu_poison_rows(DType::kFloat32, P - 1, s.H);
    const Tensor dyin = gpu_filled(DType::kFloat32, {P, s.H}, 0);
    const Tensor dgo = gpu_filled(DType::kFloat32, {s.T, s.H}, 0);
    EXPECT_TRUE(
        throws_error([&] { padmoe::combine_backward_out(dgo, dyin, plan.view(), s.dw.view(), cgy, TensorView{}); },
                     {"combine_backward", std::to_string(P)}));
    EXPECT_TRUE(all_bytes_are(to_cpu(cgy), kPoison));
    // A plan whose dest_rows does not match row_sources.
    GpuPlan gp = gpu_plan_buffers(s.T, s.K, s.E, s.m);
    padmoe::make_plan_out(to_gpu(index_matrix(s.te, s.T, s.K, DType::kInt32)), s.E, s.m, gp.view);
    std::vector<int32_t> dest(static_cast<size_t>(A));
    CUDA_OK(cudaMemcpy(dest.data(), gp.dest_rows.data(), A * 4, cudaMemcpyDeviceToHost));
    std::swap(dest[0], dest[1]);
    if (dest[0] == dest[1]) dest[1] = -1;
    CUDA_OK(cudaMemcpy(gp.dest_rows.data(), dest.data(), A * 4, cudaMemcpyHostToDevice));
    Tensor gy2 = gpu_poison_rows(DType::kFloat32, cap, s.H);
    EXPECT_TRUE(throws_error([&] { padmoe::dispatch_out(s.dx, gp.view, std::nullopt, gy2); }, {"dispatch", "plan."}));
    EXPECT_TRUE(all_bytes_are(to_cpu(gy2), kPoison));
  }

  // Negative count / counts summing past the rows -> pad_to_alignment_out.
  {
    const Tensor dh = to_gpu(rows_from_float(ones(A * s.H), DType::kFloat32, A, s.H));
    for (int which = 0; which < 3; ++which) {
      std::vector<int64_t> counts = s.p.tokens_per_expert;
      std::vector<std::string> needles = {"pad_to_alignment", "tokens_per_expert"};
      int64_t rows = cap;
      if (which == 0) {
        counts[2] = -1;
        needles.push_back("negative");
      } else if (which == 1) {
        counts[5] += 1;  // sums to A + 1 > A rows
        needles.push_back(std::to_string(A + 1));
      } else {
        rows = P - 1;  // padded output too small
        needles = {"pad_to_alignment", "padded", std::to_string(P)};
      }
      SCOPED_TRACE(which);
      for (DType idx : {DType::kInt32, DType::kInt64}) {
        const Tensor dc = to_gpu(index_tensor(counts, idx));
        Tensor gpad = gpu_poison_rows(DType::kFloat32, rows, s.H), gmap = gpu_poison_index(rows),
               goff = gpu_poison_index(s.E);
        EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_out(dh, dc, s.m, gpad, gmap, goff); }, needles));
        EXPECT_TRUE(all_bytes_are(to_cpu(gpad), kPoison));
        EXPECT_TRUE(all_bytes_are(to_cpu(gmap), kIndexPoison));
        EXPECT_TRUE(all_bytes_are(to_cpu(goff), kIndexPoison));
        if (which < 2) EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment(dh, dc, s.m); }, {"tokens_per_expert"}));
      }
    }
  }

  // Repeated / out-of-range permutation_map rows -> unpad and its backward.
  {
    const ref::PadResult rp = ref::pad_to_alignment(ones(A * s.H), s.H, s.p.tokens_per_expert, s.m);
    const Tensor dpad = to_gpu(rows_from_float(rp.padded, DType::kFloat32, P, s.H));
    int64_t p1 = -1, p2 = -1;
    for (int64_t r = 0; r < P; ++r)
      if (rp.permutation_map[static_cast<size_t>(r)] >= 0) {
        if (p1 < 0) p1 = r;
        else if (p2 < 0) p2 = r;
      }
    ASSERT_GE(p2, 0);
    for (int which = 0; which < 2; ++which) {
      std::vector<int64_t> map = rp.permutation_map;
      if (which == 0) map[static_cast<size_t>(p2)] = map[static_cast<size_t>(p1)];
      else map[static_cast<size_t>(p2)] = A + 5;
      SCOPED_TRACE(which == 0 ? "repeated row" : "row out of range");
      for (DType idx : {DType::kInt32, DType::kInt64}) {
        const Tensor dmap = to_gpu(index_tensor(map, idx));
        Tensor gu = gpu_poison_rows(DType::kFloat32, A, s.H);
        EXPECT_TRUE(throws_error([&] { padmoe::unpad_from_alignment_out(dpad, dmap, std::nullopt, gu); },
                                 {"unpad_from_alignment", "permutation_map"}));
        EXPECT_TRUE(all_bytes_are(to_cpu(gu), kPoison));
        const Tensor dgo = gpu_filled(DType::kFloat32, {A, s.H}, 0);
        Tensor ggp = gpu_poison_rows(DType::kFloat32, P, s.H), ggr = gpu_filled(DType::kFloat32, {A}, kPoison);
        EXPECT_TRUE(
            throws_error([&] { padmoe::unpad_from_alignment_backward_out(dgo, dpad, dmap, std::nullopt, ggp, ggr); },
                         {"unpad_from_alignment_backward", "permutation_map"}));
        EXPECT_TRUE(all_bytes_are(to_cpu(ggp), kPoison));
        EXPECT_TRUE(all_bytes_are(to_cpu(ggr), kPoison));
      }
    }
  }
  CUDA_OK(cudaDeviceSynchronize());
}

TEST(CheckedMode, UncheckedAgreesOnValidInput) {
  REQUIRE_GPU();
  const CheckedSetup s = checked_setup();
  const int64_t P = s.p.padded_rows, cap = s.p.capacity, A = s.T * s.K;
  padmoe::Options fast;
  fast.check_data = false;
  const padmoe::Options checked{};
  const Tensor dte = to_gpu(index_matrix(s.te, s.T, s.K, DType::kInt64));
  GpuPlan a = gpu_plan_buffers(s.T, s.K, s.E, s.m), b = gpu_plan_buffers(s.T, s.K, s.E, s.m);
  padmoe::make_plan_out(dte, s.E, s.m, a.view, checked);
  padmoe::make_plan_out(dte, s.E, s.m, b.view, fast);
  EXPECT_TRUE(all_same(to_cpu(a.dest_rows), to_cpu(b.dest_rows)));
  EXPECT_TRUE(all_same(to_cpu(a.row_sources), to_cpu(b.row_sources)));
  EXPECT_TRUE(all_same(to_cpu(a.indices), to_cpu(b.indices)));
  EXPECT_TRUE(all_same(to_cpu(a.padded_bins), to_cpu(b.padded_bins)));

  const IndexInputs hii = index_inputs(s.p, DType::kInt32);
  const IndexInputs dii{to_gpu(hii.indices), to_gpu(hii.bin_ids), to_gpu(hii.bins), to_gpu(hii.padded_bins)};
  auto both = [&](const char* what, auto&& op, std::initializer_list<int64_t> shape) {
    Tensor o1 = gpu_filled(DType::kFloat32, shape, kPoison), o2 = gpu_filled(DType::kFloat32, shape, kPoison);
    op(o1, checked);
    op(o2, fast);
    EXPECT_TRUE(all_same(to_cpu(o1), to_cpu(o2))) << what << ": unchecked differs from checked";
  };
  both("padded_gather_out",
       [&](Tensor& o, const padmoe::Options& opt) {
         padmoe::padded_gather_out(s.dx, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, s.K, s.dw.view(), o, opt);
       },
       {cap, s.H});
  const Tensor dy = to_gpu(rows_from_float(ones(P * s.H), DType::kFloat32, P, s.H));
  both("padded_scatter_out",
       [&](Tensor& o, const padmoe::Options& opt) {
         padmoe::padded_scatter_out(dy, dii.indices, dii.bin_ids, s.dw.view(), dii.bins, dii.padded_bins, s.K, o, opt);
       },
       {s.T, s.H});
  both("dispatch_out",
       [&](Tensor& o, const padmoe::Options& opt) { padmoe::dispatch_out(s.dx, a.view, s.dw.view(), o, opt); },
       {cap, s.H});
  both("combine_out",
       [&](Tensor& o, const padmoe::Options& opt) { padmoe::combine_out(dy, a.view, s.dw.view(), o, opt); },
       {s.T, s.H});
  const Tensor dc = to_gpu(index_tensor(s.p.tokens_per_expert, DType::kInt32));
  const Tensor dh = to_gpu(rows_from_float(ones(A * s.H), DType::kFloat32, A, s.H));
  Tensor map1 = gpu_poison_index(cap), map2 = gpu_poison_index(cap), off1 = gpu_poison_index(s.E),
         off2 = gpu_poison_index(s.E);
  both("pad_to_alignment_out",
       [&](Tensor& o, const padmoe::Options& opt) {
         padmoe::pad_to_alignment_out(dh, dc, s.m, o, opt.check_data ? map1 : map2, opt.check_data ? off1 : off2, opt);
       },
       {cap, s.H});
  EXPECT_TRUE(all_same(to_cpu(map1), to_cpu(map2)));
  EXPECT_TRUE(all_same(to_cpu(off1), to_cpu(off2)));
  TensorView pmap = map1.view();
  pmap.shape[0] = P;
  TensorView ppad = dy.view();
  both(
      "unpad_from_alignment_out",
      [&](Tensor& o, const padmoe::Options& opt) { padmoe::unpad_from_alignment_out(ppad, pmap, s.dw.view(), o, opt); },
      {A, s.H});
}

}  // namespace
}  // namespace pt
