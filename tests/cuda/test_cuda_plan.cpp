// test_cuda_plan.cpp — make_plan on the GPU: every kernel path bitwise against the CPU, its
// PlanOptions against the CPU and the reference (checked-mode errors in the CPU's words), and
// make_plan_and_dispatch against the CPU and the two separate calls. Helpers: cuda_fixture.hpp.
#include "cuda_fixture.hpp"

namespace pt {
namespace {

// Every make_plan kernel path gives the CPU's plan, layouts included, bitwise: the split
// launches, the default (the small kernel for one chunk, A <= 2048; the fused launch above,
// cooperative), and the fused launch capped at 1 or 3 blocks (at one chunk: the fused kernel with
// its replicas; above: several chunks a block, ranks through the workspace); A from 0 past
// 270K (more chunks than resident blocks), E from 1 to 512 (the fused limit) and 513 (split),
// chunk edges (2048, 2049), and another rank's experts dropped (a local range).
TEST(PlanKernels, EveryPathMatchesCpu) {
  REQUIRE_GPU();
  struct Case {
    int64_t T;
    int K, E, m, global, first;
  };
  const Case cases[] = {
      {0, 2, 8, 16, 0, 0},     {3, 2, 64, 16, 0, 0},      {256, 8, 256, 16, 0, 0},    {1024, 2, 8, 1, 0, 0},
      {2049, 1, 16, 4, 0, 0},  {16384, 8, 256, 16, 0, 0}, {70000, 8, 256, 128, 0, 0}, {5000, 4, 512, 1, 0, 0},
      {5000, 4, 513, 4, 0, 0}, {1000, 8, 1, 16, 0, 0},    {4096, 8, 32, 16, 256, 64}, {300, 8, 128, 8, 1024, 896},
      {200, 8, 512, 4, 0, 0},  {100, 4, 1, 16, 0, 0},     {250, 8, 32, 16, 256, 64},  {37, 3, 96, 3, 0, 0}};
  for (const Case& c : cases) {
    const int64_t A = c.T * c.K;
    const int G = c.global == 0 ? c.E : c.global;
    std::vector<int64_t> te = make_routing(c.T, c.K, G, Dist::kSkewed, static_cast<uint64_t>(c.T + c.E));
    const Tensor hte = index_matrix(te, c.T, c.K, DType::kInt32), dte = to_gpu(hte);
    padmoe::PlanOptions po;
    po.global_experts = c.global;
    po.first_expert = c.first;
    const int64_t R = padmoe::aligned_rows_bound(A, c.E, c.m);
    padmoe::Plan cpu = padmoe::Plan::empty(c.T, c.K, c.E, c.m);
    cpu.row_sources = poison_index(R);
    Tensor cre = poison_index(R), cbe = poison_index((R + c.m - 1) / c.m), ctot = poison_index(1);
    padmoe::PlanLayouts cl;
    cl.row_experts = cre;
    cl.block_experts = cbe;
    cl.padded_total = ctot;
    padmoe::make_plan_out(hte, c.E, c.m, cpu.view(), cl, po);
    // plan paths: split, the default, fused on 1 and 3 blocks; the fused one also with either key
    // search forced and with its block counts as ints and as pairs; one chunk through the fused
    // kernel as well as the small one
    struct Path {
      const char* name;
      std::optional<pol::PlanPath> path;
      int blocks = 0;
      std::optional<pol::PlanMatch> match;
      std::optional<pol::PlanCounts> counts;
    };
    const Path paths[] = {{"split", pol::PlanPath::kSplit},
                          {"default", std::nullopt},
                          {"match", std::nullopt, 0, pol::PlanMatch::kMatchAny},
                          {"ballot", std::nullopt, 0, pol::PlanMatch::kBallot},
                          {"fused:1", pol::PlanPath::kFused, 1},
                          {"fused:3", pol::PlanPath::kFused, 3},
                          {"fused", pol::PlanPath::kFused},
                          {"ints", std::nullopt, 0, std::nullopt, pol::PlanCounts::kInts},
                          {"fused:3 ints", pol::PlanPath::kFused, 3, std::nullopt, pol::PlanCounts::kInts},
                          {"pairs", std::nullopt, 0, std::nullopt, pol::PlanCounts::kPairs}};
    for (const Path& pm : paths) {
      SCOPED_TRACE("T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) + " E=" + std::to_string(c.E) +
                   " m=" + std::to_string(c.m) + " global=" + std::to_string(c.global) + " path=" + pm.name);
      KernelOverrides ko;
      ko.plan_path = pm.path;
      ko.plan_fused_blocks = pm.blocks;
      ko.plan_match = pm.match;
      ko.plan_counts = pm.counts;
      const ScopedKernelOverrides forced(ko);
      GpuPlan g = gpu_plan_buffers(c.T, c.K, c.E, c.m, R);
      GpuLayouts l = gpu_layout_buffers(R, c.m);
      padmoe::Options o;
      o.check_data = false;
      padmoe::make_plan_out(dte, c.E, c.m, g.view, l.view, po, o);
      const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> fields[] = {
          {"indices", {&g.indices, &cpu.indices}},
          {"bin_ids", {&g.bin_ids, &cpu.bin_ids}},
          {"tokens_per_expert", {&g.tpe, &cpu.tokens_per_expert}},
          {"bins", {&g.bins, &cpu.bins}},
          {"padded_tokens_per_expert", {&g.ptpe, &cpu.padded_tokens_per_expert}},
          {"padded_bins", {&g.padded_bins, &cpu.padded_bins}},
          {"dest_rows", {&g.dest_rows, &cpu.dest_rows}},
          {"row_sources", {&g.row_sources, &cpu.row_sources}},
          {"row_experts", {&l.row_experts, &cre}},
          {"block_experts", {&l.block_experts, &cbe}},
          {"padded_total", {&l.padded_total, &ctot}}};
      for (const auto& f : fields) EXPECT_TRUE(all_same(to_cpu(*f.second.first), *f.second.second)) << f.first;
      // and twice: the same bits (no atomics in the ranks)
      GpuPlan g2 = gpu_plan_buffers(c.T, c.K, c.E, c.m, R);
      padmoe::make_plan_out(dte, c.E, c.m, g2.view, padmoe::PlanLayouts{}, po, o);
      EXPECT_TRUE(all_same(to_cpu(g2.dest_rows), cpu.dest_rows)) << "dest_rows, second run";
      EXPECT_TRUE(all_same(to_cpu(g2.row_sources), cpu.row_sources)) << "row_sources, second run";
    }
  }
  // the CPU plan itself against the reference on one case (the others: CpuVsGpu)
  const std::vector<int64_t> te = make_routing(2049, 1, 16, Dist::kSkewed, 2065);
  const padmoe::Plan cpu = padmoe::make_plan(index_matrix(te, 2049, 1, DType::kInt32), 16, 4);
  EXPECT_EQ(index_to_vec(cpu.dest_rows), ref::make_plan(te, 2049, 1, 16, 4).dest_rows);
}

// make_plan's PlanOptions on the GPU (local range, expert map, dropped invalid ids, capacity with both
// drop policies): every field, the layouts and the dropped count bitwise equal to the CPU's and the
// reference; checked and unchecked; the row ops on the dropped plan as the CPU's; and checked-mode
// errors worded as the CPU's, nothing written.
TEST(RoutingOptionsGpu, MatchesCpuAndReference) {
  REQUIRE_GPU();
  struct Case {
    int64_t T;
    int K, E, m, G, first;
    bool map, drop_invalid;
    int64_t C;
    bool by_probs, ties;
  };
  const Case cases[] = {
      {301, 3, 4, 4, 16, 5, false, false, -1, false, false},   // local range
      {4096, 8, 32, 16, 256, 0, true, false, -1, false, false},  // expert map, many experts
      {777, 2, 6, 1, 0, 0, false, true, -1, false, false},     // invalid ids dropped
      {333, 2, 7, 8, 0, 0, false, false, 40, false, false},    // capacity, first C
      {333, 2, 7, 1, 0, 0, false, false, 0, false, false},     // capacity 0
      {16384, 8, 64, 1, 0, 0, false, false, 1536, true, false},  // capacity, largest probs (radix select)
      {5000, 4, 8, 8, 0, 0, false, false, 1000, true, true},   // probs with ties
      {4000, 4, 3, 4, 9, 0, true, true, 64, true, false},      // all together
      {0, 2, 4, 4, 8, 2, false, false, 16, false, false},      // no tokens
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " C=" + std::to_string(c.C) +
                 " probs=" + std::to_string(c.by_probs));
    const int64_t A = c.T * c.K;
    const int G = c.G == 0 ? c.E : c.G;
    Rng rng(static_cast<uint64_t>(c.T + c.E));
    std::vector<int64_t> te(static_cast<size_t>(A));
    for (auto& x : te) x = c.drop_invalid ? rng.below(G + 3) - 1 : rng.below(G);
    ref::RoutingOptions r;
    r.global_experts = c.G;
    r.first_expert = c.first;
    if (c.map) {
      r.expert_map.assign(static_cast<size_t>(G), -1);
      for (int e = 0; e < c.E; ++e) r.expert_map[static_cast<size_t>((e * 7 + 3) % G)] = e;
    }
    r.drop_invalid = c.drop_invalid;
    r.expert_capacity = c.C;
    r.by_probs = c.by_probs;
    if (c.by_probs) {
      r.probs.resize(static_cast<size_t>(A));
      for (auto& p : r.probs)
        p = c.ties ? static_cast<float>(rng.below(5)) / 4.0f : static_cast<float>(rng.uniform(0, 1));
    }
    const Tensor hte = index_matrix(te, c.T, c.K, DType::kInt64);
    const Tensor hmap = index_tensor(r.expert_map.empty() ? std::vector<int64_t>{0} : r.expert_map, DType::kInt32);
    const Tensor hprobs = vec_from_float(r.probs.empty() ? std::vector<float>{0.0f} : r.probs, DType::kBFloat16);
    auto options_on = [&](bool gpu, Tensor& map, Tensor& probs, Tensor& dropped) {
      padmoe::PlanOptions o;
      o.global_experts = c.G;
      o.first_expert = c.first;
      if (c.map) {
        map = gpu ? to_gpu(hmap) : hmap;
        o.expert_map = map;
      }
      o.drop_invalid = c.drop_invalid;
      o.expert_capacity = c.C;
      if (c.by_probs) {
        o.drop_policy = padmoe::DropPolicy::kProbs;
        probs = gpu ? to_gpu(hprobs) : hprobs;
        o.probs = probs;
      }
      dropped = gpu ? gpu_poison_index(1) : poison_index(1);
      o.dropped = dropped;
      return o;
    };
    // the reference with the bf16-rounded probs the backends read
    if (c.by_probs) {
      for (auto& p : r.probs) p = num::round_to(DType::kBFloat16, p);
    }
    const ref::RoutedPlan want16 = ref::make_plan(te, c.T, c.K, c.E, c.m, r);
    Tensor cm, cp, cd;
    const padmoe::PlanOptions co = options_on(false, cm, cp, cd);
    const padmoe::Plan cpu = padmoe::make_plan(hte, c.E, c.m, co);
    ASSERT_EQ(index_to_vec(cpu.dest_rows), want16.plan.dest_rows);
    EXPECT_EQ(index_to_vec(cd)[0], want16.dropped);
    const Tensor dte = to_gpu(hte);
    for (bool checked : {true, false}) {
      SCOPED_TRACE(checked ? "checked" : "unchecked");
      Tensor gm, gp, gd;
      const padmoe::PlanOptions go = options_on(true, gm, gp, gd);
      padmoe::Options o;
      o.check_data = checked;
      const int64_t R = cpu.padded_rows_bound();
      GpuPlan g = gpu_plan_buffers(c.T, c.K, c.E, c.m, R);
      GpuLayouts l = gpu_layout_buffers(R, c.m);
      padmoe::make_plan_out(dte, c.E, c.m, g.view, l.view, go, o);
      expect_plan_equal(g.view, cpu, want16.plan, "plan with options");
      EXPECT_EQ(index_to_vec(to_cpu(gd))[0], want16.dropped);
      Tensor cre = poison_index(R), cbe = poison_index((R + c.m - 1) / c.m), ctot = poison_index(1);
      padmoe::PlanLayouts cl;
      cl.row_experts = cre;
      cl.block_experts = cbe;
      cl.padded_total = ctot;
      padmoe::Plan cpu_out = padmoe::Plan::empty(c.T, c.K, c.E, c.m);
      cpu_out.row_sources = poison_index(R);
      padmoe::make_plan_out(hte, c.E, c.m, cpu_out.view(), cl, co);
      EXPECT_TRUE(all_same(to_cpu(l.row_experts), cre)) << "row_experts";
      EXPECT_TRUE(all_same(to_cpu(l.block_experts), cbe)) << "block_experts";
      EXPECT_TRUE(all_same(to_cpu(l.padded_total), ctot)) << "padded_total";
      // the row ops on the dropped plan
      if (c.T > 0 && c.T <= 5000) {
        const int64_t H = 72, P = want16.plan.padded_rows;
        const std::vector<float> xf = random_values(c.T * H, DType::kBFloat16, rng);
        const std::vector<float> wf = random_values(A, DType::kFloat32, rng, 0, 1);
        const Tensor hx = rows_from_float(xf, DType::kBFloat16, c.T, H), hw = vec_from_float(wf, DType::kFloat32);
        Tensor gy = gpu_poison_rows(DType::kBFloat16, P, H), cy = poison_rows(DType::kBFloat16, P, H);
        padmoe::dispatch_out(to_gpu(hx), g.view, TensorView(to_gpu(hw)), gy, o);
        padmoe::dispatch_out(hx, cpu.view(), TensorView(hw), cy);
        EXPECT_TRUE(all_same(to_cpu(gy), cy)) << "dispatch";
        const Tensor gout = padmoe::combine(gy, g.view, TensorView(to_gpu(hw)), o);
        const Tensor cout = padmoe::combine(cy, cpu.view(), TensorView(hw));
        EXPECT_TRUE(all_same(to_cpu(gout), cout)) << "combine";
        const padmoe::RowGrads gg = padmoe::combine_backward(gout, gy, g.view, TensorView(to_gpu(hw)), o);
        const padmoe::RowGrads cg = padmoe::combine_backward(cout, cy, cpu.view(), TensorView(hw));
        // dot products: the backends sum in different orders (close, not bitwise); dropped: exactly 0
        const std::vector<float> gw = vec_to_float(to_cpu(gg.grad_weights)), cw = vec_to_float(cg.grad_weights);
        const std::vector<int64_t> dest = index_to_vec(cpu.dest_rows);
        for (int64_t a = 0; a < A; ++a) {
          if (dest[a] < 0) ASSERT_EQ(gw[a], 0.0f) << "dropped assignment " << a;
          else ASSERT_NEAR(gw[a], cw[a], 1e-5 * (1.0 + std::fabs(cw[a]))) << "assignment " << a;
        }
        EXPECT_TRUE(all_same(to_cpu(gg.grad_rows), cg.grad_rows)) << "combine_backward grad_y";
      }
    }
  }
}

// The capacity pass sizes its grid and reads by the checked arguments, never by the output view's
// own scalar fields (they are the caller's: defaults, or far larger than the buffers).
TEST(RoutingOptionsGpu, CapacityPlanIgnoresTheViewFields) {
  REQUIRE_GPU();
  const int64_t T = 4;
  const int K = 1, E = 10, m = 128;
  const std::vector<int64_t> te = {6, 7, 0, 1};
  ref::RoutingOptions r;
  r.global_experts = 17;
  r.first_expert = 6;
  r.expert_capacity = 384;
  const ref::RoutedPlan want = ref::make_plan(te, T, K, E, m, r);
  padmoe::PlanOptions o;
  o.global_experts = 17;
  o.first_expert = 6;
  o.expert_capacity = 384;
  const Tensor hte = index_matrix(te, T, K, DType::kInt32);
  const padmoe::Plan cpu = padmoe::make_plan(hte, E, m, o);
  const Tensor dte = to_gpu(hte);
  const int64_t R = int64_t{E} * 384;
  for (int fields = 0; fields < 3; ++fields) {
    SCOPED_TRACE("view fields " + std::to_string(fields));
    GpuPlan g = gpu_plan_buffers(T, K, E, m, R);
    g.view.num_tokens = fields == 0 ? 0 : fields == 1 ? T : 1000;
    g.view.top_k = fields == 0 ? 1 : fields == 1 ? K : 7;
    g.view.num_experts = fields == 0 ? 0 : fields == 1 ? 40 : 1 << 20;
    g.view.alignment = fields == 0 ? 1 : fields == 1 ? m : 3;
    GpuLayouts l = gpu_layout_buffers(R, m);
    padmoe::make_plan_out(dte, E, m, g.view, l.view, o);
    expect_plan_equal(g.view, cpu, want.plan, "capacity plan");
    EXPECT_EQ(index_to_vec(to_cpu(l.padded_total))[0], R);
  }
}

std::string plan_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const padmoe::Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(RoutingOptionsGpu, CheckedErrorsAsCpuNothingWritten) {
  REQUIRE_GPU();
  const int64_t T = 50;
  const int K = 2, E = 4;
  std::vector<int64_t> te(static_cast<size_t>(T * K));
  Rng rng(3);
  for (auto& x : te) x = rng.below(8);
  te[37] = 8;  // outside [0, 8)
  const Tensor hte = index_matrix(te, T, K, DType::kInt32);
  const Tensor dte = to_gpu(hte);
  const Tensor hmap = index_tensor({-1, 0, 1, 2, 3, 4, -1, -1}, DType::kInt32);  // entry 5 is bad
  const Tensor dmap = to_gpu(hmap);
  for (int which = 0; which < 2; ++which) {
    padmoe::PlanOptions ho, go;
    ho.global_experts = go.global_experts = 8;
    if (which == 1) {
      ho.expert_map = hmap;
      go.expert_map = dmap;
      ho.drop_invalid = go.drop_invalid = true;  // only the map is wrong
    }
    padmoe::Plan cpu = padmoe::Plan::empty(T, K, E, 4);
    const std::string want = plan_error([&] { padmoe::make_plan_out(hte, E, 4, cpu.view(), {}, ho); });
    GpuPlan g = gpu_plan_buffers(T, K, E, 4);
    const std::string got = plan_error([&] { padmoe::make_plan_out(dte, E, 4, g.view, {}, go); });
    EXPECT_EQ(got, want);
    EXPECT_NE(want.find(which == 0 ? "expert id 8 at [18, 1]" : "plan_options.expert_map: entry 5 is 4"),
              std::string::npos)
        << want;
    EXPECT_TRUE(all_bytes_are(to_cpu(g.dest_rows), kIndexPoison)) << "written before the error";
  }
}

// make_plan_and_dispatch on the GPU against the CPU (and the reference plan) and against
// make_plan_out + dispatch_out on the GPU, bit for bit, at the decode shape and awkward ones (E = 1, E = 512 with A =
// 2048, experts left empty, K = 1, unaligned and odd H, int64 ids, weights, float8 rows), zero_tail and zero_padding
// both ways; twice, equal.
TEST(PlanAndDispatchGpu, MatchesCpuAndSeparateCalls) {
  REQUIRE_GPU();
  struct Shape {
    int64_t T;
    int E, K;
    int64_t H;
    int m;
    Dist dist;
    DType dt, idx;
    bool weighted;
  };
  const Shape shapes[] = {
      {256, 256, 8, 7168, 16, Dist::kUniform, DType::kBFloat16, DType::kInt32, false},
      {256, 256, 8, 7168, 16, Dist::kSkewed, DType::kBFloat16, DType::kInt64, true},
      {7, 5, 3, 40, 4, Dist::kUniform, DType::kFloat32, DType::kInt32, true},
      {33, 1, 2, 37, 8, Dist::kUniform, DType::kFloat16, DType::kInt32, false},
      {512, 512, 4, 64, 16, Dist::kUniform, DType::kBFloat16, DType::kInt32, true},
      {2048, 300, 1, 24, 128, Dist::kSkewed, DType::kFloat32, DType::kInt64, false},
      {64, 64, 8, 256, 1, Dist::kSkewed, DType::kFloat8E4M3, DType::kInt32, false},
      {1, 16, 6, 4096, 32, Dist::kUniform, DType::kBFloat16, DType::kInt32, true},
  };
  uint64_t seed = 41;
  for (const Shape& sh : shapes) {
    const int64_t T = sh.T, H = sh.H, A = T * sh.K;
    const int E = sh.E, K = sh.K, m = sh.m;
    SCOPED_TRACE("T " + std::to_string(T) + " E " + std::to_string(E) + " K " + std::to_string(K) + " H " +
                 std::to_string(H) + " " + dname(sh.dt));
    const std::vector<int64_t> te = make_routing(T, K, E, sh.dist, ++seed);
    const ref::Plan rp = ref::make_plan(te, T, K, E, m);
    const Tensor hte = index_matrix(te, T, K, sh.idx);
    Rng rng(++seed);
    std::vector<float> xf = random_values(T * H, sh.dt == DType::kFloat8E4M3 ? DType::kFloat32 : sh.dt, rng);
    if (sh.dt == DType::kFloat8E4M3) {
      for (auto& v : xf) v = num::round_to(sh.dt, v * 8.0f);
    }
    const Tensor hx = rows_from_float(xf, sh.dt, T, H);
    const Tensor hw = vec_from_float(random_values(A, DType::kFloat32, rng, 0.0, 1.0), DType::kFloat32);
    std::optional<TensorView> hwo, dwo;
    const Tensor dte = to_gpu(hte), dx = to_gpu(hx), dw = to_gpu(hw);
    if (sh.weighted) {
      hwo = hw.view();
      dwo = dw.view();
    }
    const padmoe::PlannedRows cpu = padmoe::make_plan_and_dispatch(hx, hte, E, m, hwo);
    const int64_t P = rp.padded_rows, cap = cpu.plan.padded_rows_bound();
    ASSERT_EQ(cap, padmoe::padded_rows_bound(T, K, E, m));
    for (bool zero_tail : {false, true}) {
      for (bool zero_padding : {true, false}) {
        SCOPED_TRACE(std::string("zero_tail ") + (zero_tail ? "1" : "0") + " zero_padding " +
                     (zero_padding ? "1" : "0"));
        padmoe::Options o;
        o.zero_tail = zero_tail;
        o.zero_padding = zero_padding;
        std::vector<Tensor> ys;
        for (int form : {1, 0, 1}) {  // one call, the two calls, one call again
          GpuPlan gp = gpu_plan_buffers(T, K, E, m);
          Tensor gy = gpu_poison_rows(sh.dt, cap + 3, H);
          if (form == 1) {
            padmoe::make_plan_and_dispatch_out(dx, dte, E, m, gp.view, dwo, gy, o);
          } else {
            padmoe::make_plan_out(dte, E, m, gp.view, o);
            padmoe::dispatch_out(dx, gp.view, dwo, gy, o);
          }
          expect_plan_equal(gp.view, cpu.plan, rp, form == 1 ? "one call" : "two calls");
          const Tensor hy = to_cpu(gy);
          for (int64_t r = 0; r < P; ++r) {  // real rows as the CPU's; padding rows zero or untouched
            const bool pad = rp.row_sources[r] < 0;
            if (pad && !zero_padding) {
              EXPECT_TRUE(bytes_are(hy, r, r + 1, kPoison)) << "padding row " << r << " written";
            } else {
              EXPECT_TRUE(rows_same(hy, cpu.y, r, r + 1)) << "row " << r;
            }
          }
          EXPECT_TRUE(bytes_are(hy, P, cap + 3, zero_tail ? 0x00 : kPoison)) << "rows past P";
          ys.push_back(hy);
        }
        EXPECT_TRUE(all_same(ys[0], ys[1])) << "one call vs two calls";
        EXPECT_TRUE(all_same(ys[0], ys[2])) << "one call twice";
      }
    }
    const padmoe::PlannedRows gpu = padmoe::make_plan_and_dispatch(dx, dte, E, m, dwo);
    expect_plan_equal(gpu.plan.view(), cpu.plan, rp, "allocating");
    EXPECT_TRUE(all_same(to_cpu(gpu.y), cpu.y)) << "allocating y (rows past P zero)";
  }
}

// Unchecked ids outside [0, E) are dropped as by make_plan + dispatch (dest_rows -1, no row),
// nothing written out of bounds; checked mode names the first bad id and writes nothing.
TEST(PlanAndDispatchGpu, BadIdsUncheckedDroppedCheckedRaised) {
  REQUIRE_GPU();
  const int64_t T = 96, H = 256;
  const int K = 4, E = 32, m = 8;
  std::vector<int64_t> te = make_routing(T, K, E, Dist::kUniform, 7);
  te[5] = E;
  te[77] = -1;
  te[300] = 1000;
  const Tensor dte = to_gpu(index_matrix(te, T, K, DType::kInt32));
  Rng rng(9);
  const Tensor dx = to_gpu(rows_from_float(random_values(T * H, DType::kBFloat16, rng), DType::kBFloat16, T, H));
  const int64_t cap = padmoe::padded_rows_bound(T, K, E, m);
  padmoe::Options unchecked;
  unchecked.check_data = false;
  unchecked.zero_tail = true;
  std::vector<Tensor> got;
  for (int form : {1, 0}) {
    GpuPlan gp = gpu_plan_buffers(T, K, E, m);
    Tensor gy = gpu_poison_rows(DType::kBFloat16, cap + 2, H);
    if (form == 1) {
      padmoe::make_plan_and_dispatch_out(dx, dte, E, m, gp.view, std::nullopt, gy, unchecked);
    } else {
      padmoe::make_plan_out(dte, E, m, gp.view, unchecked);
      padmoe::dispatch_out(dx, gp.view, std::nullopt, gy, unchecked);
    }
    const std::vector<int64_t> dest = index_to_vec(to_cpu(gp.dest_rows));
    EXPECT_EQ(dest[5], -1);
    EXPECT_EQ(dest[77], -1);
    EXPECT_EQ(dest[300], -1);
    for (const Tensor* t :
         {&gp.indices, &gp.bin_ids, &gp.tpe, &gp.bins, &gp.ptpe, &gp.padded_bins, &gp.dest_rows, &gp.row_sources}) {
      got.push_back(to_cpu(*t));
    }
    const Tensor hy = to_cpu(gy);
    EXPECT_TRUE(bytes_are(hy, padmoe::padded_rows(gp.view), cap + 2, 0x00)) << "rows past P (zero_tail)";
    got.push_back(hy);
  }
  const size_t n = got.size() / 2;
  for (size_t i = 0; i < n; ++i)
    EXPECT_TRUE(all_same(got[i], got[n + i])) << "output " << i << ": one call vs two calls";
  GpuPlan gp = gpu_plan_buffers(T, K, E, m);
  Tensor gy = gpu_poison_rows(DType::kBFloat16, cap, H);
  EXPECT_TRUE(throws_error([&] { padmoe::make_plan_and_dispatch_out(dx, dte, E, m, gp.view, std::nullopt, gy); },
                           {"make_plan_and_dispatch", "top_experts", "[1, 1]"}));
  EXPECT_TRUE(all_bytes_are(to_cpu(gp.dest_rows), kIndexPoison));
  EXPECT_TRUE(all_bytes_are(to_cpu(gy), kPoison));
}

}  // namespace
}  // namespace pt
