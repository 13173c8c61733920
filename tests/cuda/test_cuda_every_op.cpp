// test_cuda_every_op.cpp — every op on the GPU (padmoe_cuda_tests; helpers: cuda_fixture.hpp):
//   1. CpuVsGpu: every op on CPU and GPU from the same inputs, over a list of
//      workloads (empty T / H, zero-token experts, counts on / over the
//      multiple, top_k 1..8, odd H, alignments 1..128, MegaBlocks' grid and
//      the Ascend tutorial cases, T*K >= 131072), f32 / f16 / bf16 rows and
//      int32 / int64 index inputs. Plan fields and moves bitwise (GPU vs CPU
//      and vs the reference), sums within test_util.hpp's tolerance vs the
//      float64 reference. _out forms into capacity-sized, poison-filled
//      buffers (rows past P keep the poison, padding rows are zero), and the
//      allocating forms (P rows).
//   2. Determinism: every op twice on the GPU, bitwise equal.
#include "cuda_fixture.hpp"

namespace pt {

// ---------------------------------------------------------------------------
// 1. CPU vs GPU on every op
// ---------------------------------------------------------------------------
std::vector<Combo> combos_of(int which) {
  const std::vector<Combo> all = {
      {DType::kFloat32, DType::kInt32, DType::kFloat32},   {DType::kFloat32, DType::kInt64, DType::kFloat32},
      {DType::kFloat16, DType::kInt32, DType::kFloat32},   {DType::kFloat16, DType::kInt64, DType::kFloat16},
      {DType::kBFloat16, DType::kInt32, DType::kBFloat16}, {DType::kBFloat16, DType::kInt64, DType::kFloat32}};
  if (which == 1) return {all[4]};
  if (which == 2) return {all[3]};
  if (which == 3) return {all[1]};
  return all;
}

void run_cpu_vs_gpu(const Workload& wl, const Combo& cb, uint64_t seed) {
  const int64_t T = wl.T, H = wl.H, A = T * wl.K;
  const int E = wl.E, K = wl.K, m = wl.m;
  const DType dt = cb.dtype, idx = cb.idx, wdt = cb.wdtype;
  SCOPED_TRACE(wl.name + " T=" + std::to_string(T) + " E=" + std::to_string(E) + " K=" + std::to_string(K) +
               " H=" + std::to_string(H) + " m=" + std::to_string(m) + " " + dname(dt) + " idx=" + dname(idx) +
               " w=" + dname(wdt));
  const std::vector<int64_t> te =
      wl.counts.empty() ? make_routing(T, K, E, wl.dist, seed) : routing_with_counts(wl.counts, seed);
  ASSERT_EQ(static_cast<int64_t>(te.size()), A);
  const ref::Plan p = ref::make_plan(te, T, K, E, m);
  const int64_t P = p.padded_rows, cap = p.capacity;
  ASSERT_EQ(cap, padmoe::padded_rows_bound(T, K, E, m));

  Rng rng(seed * 7 + 3);
  const std::vector<float> xf = random_values(T * H, dt, rng);
  const std::vector<float> wf = random_values(A, wdt, rng, 0.0, 1.0);
  const std::vector<float> yf = random_values(P * H, dt, rng);
  const std::vector<float> gof = random_values(T * H, dt, rng);
  const std::vector<float> gyf = random_values(P * H, dt, rng);
  const Tensor hx = rows_from_float(xf, dt, T, H), hw = vec_from_float(wf, wdt), hgo = rows_from_float(gof, dt, T, H);
  Tensor hy = rows_from_float(yf, dt, P, H), hgy = rows_from_float(gyf, dt, P, H);
  // Padding rows of padded inputs: never read; NaN poison.
  for (int64_t r = 0; r < P; ++r)
    if (p.row_sources[static_cast<size_t>(r)] < 0 && H > 0) {
      std::memset(static_cast<unsigned char*>(hy.data()) + r * H * esize(dt), kPoison, H * esize(dt));
      std::memset(static_cast<unsigned char*>(hgy.data()) + r * H * esize(dt), kPoison, H * esize(dt));
    }
  const Tensor hte = index_matrix(te, T, K, idx);
  const IndexInputs hii = index_inputs(p, idx);
  const Tensor dx = to_gpu(hx), dw = to_gpu(hw), dgo = to_gpu(hgo), dy = to_gpu(hy), dgy = to_gpu(hgy),
               dte = to_gpu(hte);
  const IndexInputs dii{to_gpu(hii.indices), to_gpu(hii.bin_ids), to_gpu(hii.bins), to_gpu(hii.padded_bins)};

  // --- plan
  const padmoe::Plan cplan = padmoe::make_plan(hte, E, m);
  GpuPlan gp = gpu_plan_buffers(T, K, E, m);
  padmoe::make_plan_out(dte, E, m, gp.view);
  expect_plan_equal(gp.view, cplan, p, "make_plan_out");
  {
    const padmoe::Plan galloc = padmoe::make_plan(dte, E, m);
    EXPECT_EQ(galloc.row_sources.numel(), cap);
    expect_plan_equal(galloc.view(), cplan, p, "make_plan (allocating)");
  }
  EXPECT_EQ(padmoe::padded_rows(gp.view), P);
  const padmoe::PlanView gpv = gp.view, cpv = cplan.view();

  // wgrad (no weights)
  {
    const std::vector<double> want = ref::padded_scatter_wgrad(yf, gof, H, p);
    const std::vector<double> abs = ref::padded_scatter_wgrad(abs_of(yf), abs_of(gof), H, p);
    Tensor g = gpu_filled(DType::kFloat32, {A}, kPoison);
    padmoe::padded_scatter_wgrad_out(dy, dgo, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, K, g);
    EXPECT_TRUE(gpu_sums(g, want, abs, H, A)) << "padded_scatter_wgrad_out";
    const Tensor g2 = padmoe::padded_scatter_wgrad(dy, dgo, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, K);
    EXPECT_EQ(g2.dtype(), dt);
    EXPECT_EQ(g2.numel(), A);
    EXPECT_TRUE(gpu_sums(g2, want, abs, H, A)) << "padded_scatter_wgrad (allocating)";
  }

  for (bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "weighted" : "unweighted");
    std::optional<TensorView> cw, gw;
    if (weighted) {
      cw = hw.view();
      gw = dw.view();
    }
    const std::vector<float>* wp = weighted ? &wf : nullptr;

    // --- moves: padded_gather / dispatch
    {
      const std::vector<float> want = ref::padded_gather(xf, H, p, wp);
      const Tensor cy = padmoe::padded_gather(hx, hii.indices, hii.bin_ids, hii.bins, hii.padded_bins, K, cw);
      Tensor gy = gpu_poison_rows(dt, cap + 3, H);
      padmoe::padded_gather_out(dx, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, K, gw, gy);
      expect_move("padded_gather_out", gy, cy, want, P);
      const Tensor gy2 = padmoe::padded_gather(dx, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, K, gw);
      ASSERT_EQ(gy2.size(0), P);
      EXPECT_TRUE(all_same(to_cpu(gy2), cy)) << "padded_gather (allocating): GPU vs CPU";

      const Tensor cd = padmoe::dispatch(hx, cpv, cw);
      Tensor gd = gpu_poison_rows(dt, cap + 3, H);
      padmoe::dispatch_out(dx, gpv, gw, gd);
      expect_move("dispatch_out", gd, cd, want, P);
      const Tensor gd2 = padmoe::dispatch(dx, gpv, gw);
      ASSERT_EQ(gd2.size(0), P);
      EXPECT_TRUE(all_same(to_cpu(gd2), cd)) << "dispatch (allocating): GPU vs CPU";
    }

    // --- sums: padded_scatter / combine
    {
      const std::vector<double> want = ref::padded_scatter(yf, H, p, wp);
      const std::vector<double> abs = ref_scatter_abs(yf, H, p, wp);
      Tensor go = gpu_poison_rows(dt, T, H);
      padmoe::padded_scatter_out(dy, dii.indices, dii.bin_ids, gw, dii.bins, dii.padded_bins, K, go);
      EXPECT_TRUE(gpu_sums(go, want, abs, K, T)) << "padded_scatter_out";
      const Tensor go2 = padmoe::padded_scatter(dy, dii.indices, dii.bin_ids, gw, dii.bins, dii.padded_bins, K);
      EXPECT_TRUE(all_same(to_cpu(go2), to_cpu(go))) << "padded_scatter allocating vs _out";
      Tensor gc = gpu_poison_rows(dt, T, H);
      padmoe::combine_out(dy, gpv, gw, gc);
      EXPECT_TRUE(gpu_sums(gc, want, abs, K, T)) << "combine_out";
      const Tensor gc2 = padmoe::combine(dy, gpv, gw);
      EXPECT_TRUE(gpu_sums(gc2, want, abs, K, T)) << "combine (allocating)";
    }

    // --- backward of gather / dispatch: grad_x = scatter(grad_y, w), grad_w = <grad_y[row], x[token]>
    {
      const std::vector<double> want_gx = ref::padded_scatter(gyf, H, p, wp);
      const std::vector<double> abs_gx = ref_scatter_abs(gyf, H, p, wp);
      const std::vector<double> want_gw = ref::padded_scatter_wgrad(gyf, xf, H, p);
      const std::vector<double> abs_gw = ref::padded_scatter_wgrad(abs_of(gyf), abs_of(xf), H, p);
      Tensor gx = gpu_poison_rows(dt, T, H), gwt = gpu_filled(DType::kFloat32, {A}, kPoison);
      padmoe::padded_gather_backward_out(dgy, dx, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, K, gw, gx, gwt);
      EXPECT_TRUE(gpu_sums(gx, want_gx, abs_gx, K, T)) << "padded_gather_backward_out grad_x";
      EXPECT_TRUE(gpu_sums(gwt, want_gw, abs_gw, H, A)) << "padded_gather_backward_out grad_weights";
      const padmoe::RowGrads g =
          padmoe::padded_gather_backward(dgy, dx, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, K, gw);
      EXPECT_TRUE(gpu_sums(g.grad_rows, want_gx, abs_gx, K, T)) << "padded_gather_backward grad_x";
      EXPECT_EQ(g.grad_weights.defined(), weighted);
      if (weighted) EXPECT_TRUE(gpu_sums(g.grad_weights, want_gw, abs_gw, H, A)) << "padded_gather_backward grad_w";

      Tensor dx2 = gpu_poison_rows(dt, T, H), dwt = gpu_filled(DType::kFloat32, {A}, kPoison);
      padmoe::dispatch_backward_out(dgy, dx, gpv, gw, dx2, dwt);
      EXPECT_TRUE(gpu_sums(dx2, want_gx, abs_gx, K, T)) << "dispatch_backward_out grad_x";
      EXPECT_TRUE(gpu_sums(dwt, want_gw, abs_gw, H, A)) << "dispatch_backward_out grad_weights";
      const padmoe::RowGrads d = padmoe::dispatch_backward(dgy, dx, gpv, gw);
      EXPECT_TRUE(gpu_sums(d.grad_rows, want_gx, abs_gx, K, T)) << "dispatch_backward grad_x";
      EXPECT_EQ(d.grad_weights.defined(), weighted);
      if (weighted) EXPECT_TRUE(gpu_sums(d.grad_weights, want_gw, abs_gw, H, A)) << "dispatch_backward grad_w";
    }

    // --- backward of scatter / combine: grad_y = gather(grad_out, w) (move), grad_w = <y[row], grad_out[token]>
    {
      const std::vector<float> want_gy = ref::padded_gather(gof, H, p, wp);
      const std::vector<double> want_gw = ref::padded_scatter_wgrad(yf, gof, H, p);
      const std::vector<double> abs_gw = ref::padded_scatter_wgrad(abs_of(yf), abs_of(gof), H, p);
      const padmoe::RowGrads cs =
          padmoe::padded_scatter_backward(hgo, hy, hii.indices, hii.bin_ids, cw, hii.bins, hii.padded_bins, K);
      Tensor gyo = gpu_poison_rows(dt, cap + 3, H), gwt = gpu_filled(DType::kFloat32, {A}, kPoison);
      padmoe::padded_scatter_backward_out(dgo, dy, dii.indices, dii.bin_ids, gw, dii.bins, dii.padded_bins, K, gyo,
                                          gwt);
      expect_move("padded_scatter_backward_out grad_y", gyo, cs.grad_rows, want_gy, P);
      EXPECT_TRUE(gpu_sums(gwt, want_gw, abs_gw, H, A)) << "padded_scatter_backward_out grad_weights";
      const padmoe::RowGrads gs =
          padmoe::padded_scatter_backward(dgo, dy, dii.indices, dii.bin_ids, gw, dii.bins, dii.padded_bins, K);
      ASSERT_EQ(gs.grad_rows.size(0), P);
      EXPECT_TRUE(all_same(to_cpu(gs.grad_rows), cs.grad_rows)) << "padded_scatter_backward grad_y: GPU vs CPU";
      EXPECT_EQ(gs.grad_weights.defined(), weighted);
      if (weighted) EXPECT_TRUE(gpu_sums(gs.grad_weights, want_gw, abs_gw, H, A)) << "padded_scatter_backward grad_w";

      const padmoe::RowGrads cc = padmoe::combine_backward(hgo, hy, cpv, cw);
      Tensor cgy = gpu_poison_rows(dt, cap + 3, H), cgw = gpu_filled(DType::kFloat32, {A}, kPoison);
      padmoe::combine_backward_out(dgo, dy, gpv, gw, cgy, cgw);
      expect_move("combine_backward_out grad_y", cgy, cc.grad_rows, want_gy, P);
      EXPECT_TRUE(gpu_sums(cgw, want_gw, abs_gw, H, A)) << "combine_backward_out grad_weights";
      Tensor cgy2 = gpu_poison_rows(dt, cap, H);
      padmoe::combine_backward_out(dgo, dy, gpv, gw, cgy2, TensorView{});
      expect_move("combine_backward_out grad_y (no grad_weights)", cgy2, cc.grad_rows, want_gy, P);
      const padmoe::RowGrads gc = padmoe::combine_backward(dgo, dy, gpv, gw);
      ASSERT_EQ(gc.grad_rows.size(0), P);
      EXPECT_TRUE(all_same(to_cpu(gc.grad_rows), cc.grad_rows)) << "combine_backward grad_y: GPU vs CPU";
      EXPECT_EQ(gc.grad_weights.defined(), weighted);
      if (weighted) {
        EXPECT_EQ(gc.grad_weights.dtype(), wdt);
        EXPECT_TRUE(gpu_sums(gc.grad_weights, want_gw, abs_gw, H, A)) << "combine_backward grad_w";
      }
    }
  }

  // --- Megatron family: h [N, H] grouped by expert with the plan's counts (+3 ignored rows).
  const int64_t N = A + 3;
  const std::vector<float> hf = random_values(N * H, dt, rng);
  const std::vector<float> pf = random_values(N, wdt, rng, 0.0, 1.0);
  const std::vector<float> g2f = random_values(N * H, dt, rng);
  const Tensor hh = rows_from_float(hf, dt, N, H), hc = index_tensor(p.tokens_per_expert, idx);
  const Tensor hp = vec_from_float(pf, wdt), hg2 = rows_from_float(g2f, dt, N, H);
  const Tensor dh = to_gpu(hh), dc = to_gpu(hc), dp = to_gpu(hp), dg2 = to_gpu(hg2);
  const ref::PadResult rp = ref::pad_to_alignment(hf, H, p.tokens_per_expert, m);
  ASSERT_EQ(rp.padded_rows, P);
  {
    const padmoe::PadResult cpad = padmoe::pad_to_alignment(hh, hc, m);
    Tensor gpad = gpu_poison_rows(dt, cap + 2, H), gmap = gpu_poison_index(cap + 2), goff = gpu_poison_index(E);
    padmoe::pad_to_alignment_out(dh, dc, m, gpad, gmap, goff);
    expect_move("pad_to_alignment_out", gpad, cpad.padded, rp.padded, P);
    const Tensor hmap = to_cpu(gmap);
    EXPECT_TRUE(rows_same(hmap, cpad.permutation_map, 0, P)) << "permutation_map: GPU vs CPU";
    std::vector<int64_t> want_map = rp.permutation_map;
    want_map.resize(static_cast<size_t>(cap + 2), -1);
    EXPECT_EQ(index_to_vec(hmap), want_map) << "permutation_map (entries past P are -1)";
    const Tensor hoff = to_cpu(goff);
    EXPECT_TRUE(all_same(hoff, cpad.inclusive_offsets)) << "inclusive_offsets: GPU vs CPU";
    EXPECT_EQ(index_to_vec(hoff), rp.inclusive_offsets);
    const padmoe::PadResult gpa = padmoe::pad_to_alignment(dh, dc, m);
    ASSERT_EQ(gpa.padded.size(0), P);
    EXPECT_TRUE(all_same(to_cpu(gpa.padded), cpad.padded)) << "pad_to_alignment (allocating)";
    EXPECT_TRUE(all_same(to_cpu(gpa.permutation_map), cpad.permutation_map));
    EXPECT_TRUE(all_same(to_cpu(gpa.inclusive_offsets), cpad.inclusive_offsets));
  }

  // unpad: padded input = the reference pad with padding rows poisoned (never read).
  Tensor hpad = rows_from_float(rp.padded, dt, P, H);
  for (int64_t r = 0; r < P; ++r)
    if (rp.permutation_map[static_cast<size_t>(r)] < 0 && H > 0)
      std::memset(static_cast<unsigned char*>(hpad.data()) + r * H * esize(dt), kPoison, H * esize(dt));
  const Tensor hmap = index_tensor(rp.permutation_map, idx);
  const Tensor dpad = to_gpu(hpad), dmap = to_gpu(hmap);
  const std::vector<float> unit = ones(N);
  for (bool with_probs : {false, true}) {
    SCOPED_TRACE(with_probs ? "with probs" : "without probs");
    std::optional<TensorView> cpr, gpr;
    if (with_probs) {
      cpr = hp.view();
      gpr = dp.view();
    }
    const std::vector<float>* pp = with_probs ? &pf : nullptr;
    {
      const std::vector<float> want = ref::unpad_from_alignment(rp.padded, H, rp.permutation_map, N, pp);
      const Tensor cu = padmoe::unpad_from_alignment(hpad, hmap, N, cpr);
      Tensor gu = gpu_poison_rows(dt, N, H);
      padmoe::unpad_from_alignment_out(dpad, dmap, gpr, gu);
      expect_move("unpad_from_alignment_out", gu, cu, want, N);
      EXPECT_TRUE(all_same(to_cpu(padmoe::unpad_from_alignment(dpad, dmap, N, gpr)), cu))
          << "unpad_from_alignment (allocating)";
    }
    {
      const ref::UnpadGrads want = ref::unpad_from_alignment_backward(g2f, rp.padded, H, rp.permutation_map, pp);
      const std::vector<float> ag2 = abs_of(g2f), apad = abs_of(rp.padded);
      const ref::UnpadGrads want_gp = ref::unpad_from_alignment_backward(g2f, rp.padded, H, rp.permutation_map, &unit);
      const ref::UnpadGrads abs_gp = ref::unpad_from_alignment_backward(ag2, apad, H, rp.permutation_map, &unit);
      const padmoe::RowGrads cg = padmoe::unpad_from_alignment_backward(hg2, hpad, hmap, cpr);
      Tensor ggp = gpu_poison_rows(dt, P, H), ggr = gpu_filled(DType::kFloat32, {N}, kPoison);
      padmoe::unpad_from_alignment_backward_out(dg2, dpad, dmap, gpr, ggp, ggr);
      expect_move("unpad_from_alignment_backward_out grad_padded", ggp, cg.grad_rows, want.grad_padded, P);
      EXPECT_TRUE(gpu_sums(ggr, want_gp.grad_probs, abs_gp.grad_probs, H, N))
          << "unpad_from_alignment_backward_out grad_probs";
      const padmoe::RowGrads gg = padmoe::unpad_from_alignment_backward(dg2, dpad, dmap, gpr);
      EXPECT_TRUE(all_same(to_cpu(gg.grad_rows), cg.grad_rows)) << "unpad_from_alignment_backward grad_padded";
      EXPECT_EQ(gg.grad_weights.defined(), with_probs);
      if (with_probs)
        EXPECT_TRUE(gpu_sums(gg.grad_weights, want_gp.grad_probs, abs_gp.grad_probs, H, N))
            << "unpad_from_alignment_backward grad_probs";
    }
  }
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaGetLastError());
}

std::vector<Workload> workloads() {
  std::vector<Workload> w;
  w.push_back({"tiny", 1, 1, 1, 1, 1});
  w.push_back({"empty_T", 0, 4, 2, 16, 8});
  w.push_back({"empty_H", 37, 4, 2, 0, 8});
  w.push_back({"zero_token_experts", 300, 8, 2, 33, 16, Dist::kOdd});
  w.push_back({"skewed", 301, 12, 4, 37, 8, Dist::kSkewed});
  w.push_back({"counts_on_over_multiple", 41, 8, 2, 9, 8, Dist::kUniform, {8, 9, 16, 7, 1, 0, 17, 24}});
  w.push_back({"counts_128", 384, 4, 1, 5, 128, Dist::kUniform, {128, 129, 0, 127}});
  w.push_back(
      {"only_last_expert", 100, 16, 2, 24, 16, Dist::kUniform, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 200}});
  w.push_back({"topk1", 200, 16, 1, 24, 16, Dist::kDistinct});
  w.push_back({"topk2", 200, 16, 2, 24, 16, Dist::kUniform});
  w.push_back({"topk4", 200, 16, 4, 24, 16, Dist::kDistinct});
  w.push_back({"topk8", 200, 16, 8, 24, 16, Dist::kUniform});
  // above top_k 8: the reduce stages live assignments and the spread with dots takes a block a token
  w.push_back({"topk16", 200, 32, 16, 24, 16, Dist::kDistinct});
  w.push_back({"topk64", 40, 64, 64, 40, 8, Dist::kDistinct});
  w.push_back({"H1", 300, 8, 2, 1, 16});
  w.push_back({"H3", 300, 8, 2, 3, 16});
  w.push_back({"H33", 300, 8, 2, 33, 16});
  w.push_back({"H4097", 64, 8, 2, 4097, 16});
  w.push_back({"H4096_vec", 64, 8, 2, 4096, 16});
  w.push_back({"align1", 257, 32, 2, 64, 1});
  w.push_back({"align8", 257, 32, 2, 64, 8});
  w.push_back({"align16_tiny_segments", 48, 64, 2, 40, 16});
  w.push_back({"align128", 257, 32, 2, 64, 128});
  // MegaBlocks' grid (alignment 128, bf16 rows) and the Ascend tutorial (f16 rows).
  w.push_back({"mb_T4_H2_E2_K1", 4, 2, 1, 2, 128, Dist::kUniform, {}, 1});
  w.push_back({"mb_T4_H768_E128_K4", 4, 128, 4, 768, 128, Dist::kUniform, {}, 1});
  w.push_back({"mb_T1024_H1_E64_K2", 1024, 64, 2, 1, 128, Dist::kUniform, {}, 1});
  w.push_back({"mb_T1024_H768_E4_K2", 1024, 4, 2, 768, 128, Dist::kUniform, {}, 1});
  w.push_back({"mb_T1024_H768_E64_K4", 1024, 64, 4, 768, 128, Dist::kUniform, {}, 1});
  w.push_back({"ascend_T1024_H4_E64_K4", 1024, 64, 4, 4, 128, Dist::kUniform, {}, 2});
  w.push_back({"ascend_T1024_H1536_E128_K4", 1024, 128, 4, 1536, 128, Dist::kUniform, {}, 2});
  // T*K >= 131072
  w.push_back({"large_A_T32768_K4", 32768, 64, 4, 33, 128, Dist::kUniform, {}, 1});
  w.push_back({"large_A_T16384_E256_K8", 16384, 256, 8, 8, 16, Dist::kDistinct, {}, 3});
  // Many experts: the plan's shared-memory counts and scan at E = 1024 and 4096.
  w.push_back({"experts_1024", 4096, 1024, 8, 16, 16, Dist::kDistinct, {}, 1});
  w.push_back({"experts_4096", 2048, 4096, 4, 8, 8, Dist::kUniform, {}, 1});
  return w;
}

namespace {

class CpuVsGpu : public ::testing::TestWithParam<Workload> {};

TEST_P(CpuVsGpu, EveryOp) {
  REQUIRE_GPU();
  const Workload& wl = GetParam();
  uint64_t seed = 1000;
  for (const Combo& cb : combos_of(wl.combos)) {
    run_cpu_vs_gpu(wl, cb, ++seed + static_cast<uint64_t>(wl.T * 31 + wl.H));
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Workloads, CpuVsGpu, ::testing::ValuesIn(workloads()),
                         [](const ::testing::TestParamInfo<Workload>& i) { return i.param.name; });

// ---------------------------------------------------------------------------
// Determinism: every op twice on the GPU gives the same bytes.
// ---------------------------------------------------------------------------
TEST(Determinism, EveryOpTwiceBitwise) {
  REQUIRE_GPU();
  struct Case {
    int64_t T;
    int E, K;
    int64_t H;
    int m;
    DType dt;
  };
  for (const Case& c : {Case{3001, 16, 4, 67, 16, DType::kFloat32}, Case{3001, 16, 4, 67, 16, DType::kBFloat16},
                        Case{2048, 64, 8, 1024, 128, DType::kBFloat16}, Case{777, 8, 2, 1024, 8, DType::kFloat16}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " " + dname(c.dt));
    const int64_t A = c.T * c.K;
    const std::vector<int64_t> te = make_routing(c.T, c.K, c.E, Dist::kSkewed, 9);
    const ref::Plan p = ref::make_plan(te, c.T, c.K, c.E, c.m);
    const int64_t P = p.padded_rows, N = A;
    Rng rng(77);
    const Tensor dte = to_gpu(index_matrix(te, c.T, c.K, DType::kInt32));
    const Tensor dx = to_gpu(rows_from_float(random_values(c.T * c.H, c.dt, rng), c.dt, c.T, c.H));
    const Tensor dgo = to_gpu(rows_from_float(random_values(c.T * c.H, c.dt, rng), c.dt, c.T, c.H));
    const Tensor dy = to_gpu(rows_from_float(random_values(P * c.H, c.dt, rng), c.dt, P, c.H));
    const Tensor dw = to_gpu(vec_from_float(random_values(A, DType::kFloat32, rng, 0, 1), DType::kFloat32));
    const Tensor dc = to_gpu(index_tensor(p.tokens_per_expert, DType::kInt32));
    const Tensor dprobs = to_gpu(vec_from_float(random_values(N, DType::kFloat32, rng, 0, 1), DType::kFloat32));
    const IndexInputs hii = index_inputs(p, DType::kInt64);
    const IndexInputs dii{to_gpu(hii.indices), to_gpu(hii.bin_ids), to_gpu(hii.bins), to_gpu(hii.padded_bins)};

    auto run_all = [&]() {
      std::vector<Tensor> r;
      const padmoe::Plan plan = padmoe::make_plan(dte, c.E, c.m);
      for (const Tensor* t :
           {&plan.indices, &plan.bin_ids, &plan.bins, &plan.padded_bins, &plan.dest_rows, &plan.row_sources})
        r.push_back(to_cpu(*t));
      const padmoe::PlanView pv = plan.view();
      r.push_back(
          to_cpu(padmoe::padded_gather(dx, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, c.K, dw.view())));
      r.push_back(
          to_cpu(padmoe::padded_scatter(dy, dii.indices, dii.bin_ids, dw.view(), dii.bins, dii.padded_bins, c.K)));
      r.push_back(
          to_cpu(padmoe::padded_scatter_wgrad(dy, dgo, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, c.K)));
      const padmoe::RowGrads gb =
          padmoe::padded_gather_backward(dy, dx, dii.indices, dii.bin_ids, dii.bins, dii.padded_bins, c.K, dw.view());
      r.push_back(to_cpu(gb.grad_rows));
      r.push_back(to_cpu(gb.grad_weights));
      r.push_back(to_cpu(padmoe::dispatch(dx, pv, dw.view())));
      r.push_back(to_cpu(padmoe::combine(dy, pv, dw.view())));
      const padmoe::RowGrads cb = padmoe::combine_backward(dgo, dy, pv, dw.view());
      r.push_back(to_cpu(cb.grad_rows));
      r.push_back(to_cpu(cb.grad_weights));
      const padmoe::RowGrads db = padmoe::dispatch_backward(dy, dx, pv, dw.view());
      r.push_back(to_cpu(db.grad_rows));
      r.push_back(to_cpu(db.grad_weights));
      TensorView h = dy.view();  // P >= A rows: the first A are the grouped input
      const padmoe::PadResult pad = padmoe::pad_to_alignment(h, dc, c.m);
      r.push_back(to_cpu(pad.padded));
      r.push_back(to_cpu(pad.permutation_map));
      r.push_back(to_cpu(pad.inclusive_offsets));
      r.push_back(to_cpu(padmoe::unpad_from_alignment(pad.padded, pad.permutation_map, N, dprobs.view())));
      Tensor gout = Tensor::empty(c.dt, {N, c.H}, kGpu);
      CUDA_OK(cudaMemcpy(gout.data(), dy.data(), nbytes(gout), cudaMemcpyDeviceToDevice));
      const padmoe::RowGrads ub =
          padmoe::unpad_from_alignment_backward(gout, pad.padded, pad.permutation_map, dprobs.view());
      r.push_back(to_cpu(ub.grad_rows));
      r.push_back(to_cpu(ub.grad_weights));
      return r;
    };
    ASSERT_GE(P, N);
    const std::vector<Tensor> a = run_all();
    const std::vector<Tensor> b = run_all();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(all_same(a[i], b[i])) << "output " << i << " differs between runs";
  }
}

}  // namespace
}  // namespace pt
