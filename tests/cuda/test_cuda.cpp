// test_cuda.cpp — the GPU test suite (padmoe_cuda_tests; not registered with
// ctest: CI has no GPU, scripts run it on the GPU machine).
//
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
//   3. CheckedMode: bad data throws padmoe::Error naming the argument and
//      leaves the output unwritten; unchecked mode agrees on valid input.
//   4. CudaGraph: make_plan_out + dispatch_out + combine_out captured once on
//      a non-default stream and replayed on new router outputs / activations.
//   5. Large: a DeepSeek-V3-like step (T=4096, E=256, K=8, H=7168, bf16).
//
// Without a CUDA device every test skips.
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <atomic>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <thread>

#include "core/kernel_overrides.hpp"
#include "core/kernel_policy.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/quant_backend.hpp"
#include "test_util.hpp"
#include "workload/workload.hpp"

namespace pt {
namespace {

// Kernel choices are forced through the internal overrides (default: the policy decides).
namespace pol = padmoe::policy;
using padmoe::detail::KernelOverrides;
using padmoe::detail::ScopedKernelOverrides;
KernelOverrides& kernel_overrides() { return padmoe::detail::kernel_overrides(); }

// ---------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------
bool gpu_available() {
  static const int n = [] {
    int c = 0;
    if (cudaGetDeviceCount(&c) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return c;
  }();
  return n > 0;
}

#define REQUIRE_GPU()                                                                      \
  do {                                                                                     \
    if (!gpu_available()) GTEST_SKIP() << "no CUDA device: padmoe_cuda_tests needs a GPU"; \
  } while (0)

const padmoe::Device kGpu = padmoe::Device::cuda(0);

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define CUDA_OK(expr) cuda_ok((expr), #expr)

size_t nbytes(const TensorView& t) { return static_cast<size_t>(t.numel()) * esize(t.dtype); }

Tensor to_gpu(const TensorView& h) {
  Tensor d = Tensor::empty(h.dtype, h.ndim, h.shape, kGpu);
  padmoe::copy(h, d);
  return d;
}
Tensor to_cpu(const TensorView& d) {
  Tensor h = Tensor::empty(d.dtype, d.ndim, d.shape);
  padmoe::copy(d, h);
  return h;
}
Tensor gpu_filled(DType dt, std::initializer_list<int64_t> shape, unsigned char byte) {
  Tensor d = Tensor::empty(dt, shape, kGpu);
  if (d.numel() > 0) CUDA_OK(cudaMemset(d.data(), byte, nbytes(d)));
  return d;
}
Tensor gpu_poison_rows(DType dt, int64_t rows, int64_t cols) { return gpu_filled(dt, {rows, cols}, kPoison); }
Tensor gpu_poison_index(int64_t n) { return gpu_filled(DType::kInt32, {n}, kIndexPoison); }

// Rows [r0, r1) of two contiguous host row tensors (or entries of vectors) byte-equal.
::testing::AssertionResult rows_same(const TensorView& a, const TensorView& b, int64_t r0, int64_t r1) {
  if (a.dtype != b.dtype) return ::testing::AssertionFailure() << "dtypes differ";
  const int64_t ca = a.ndim == 1 ? 1 : a.shape[1], cb = b.ndim == 1 ? 1 : b.shape[1];
  if (ca != cb) return ::testing::AssertionFailure() << "column counts differ";
  if (a.shape[0] < r1 || b.shape[0] < r1) return ::testing::AssertionFailure() << "too few rows";
  const size_t row = static_cast<size_t>(ca) * esize(a.dtype);
  for (int64_t r = r0; r < r1; ++r) {
    const auto* pa = static_cast<const unsigned char*>(a.data) + r * row;
    const auto* pb = static_cast<const unsigned char*>(b.data) + r * row;
    if (row > 0 && std::memcmp(pa, pb, row) != 0) {
      for (size_t i = 0; i < row; ++i)
        if (pa[i] != pb[i])
          return ::testing::AssertionFailure() << "first difference at row " << r << " byte " << i << ": 0x" << std::hex
                                               << int(pa[i]) << " vs 0x" << int(pb[i]);
    }
  }
  return ::testing::AssertionSuccess();
}
::testing::AssertionResult all_same(const TensorView& a, const TensorView& b) {
  if (a.numel() != b.numel() || a.shape[0] != b.shape[0])
    return ::testing::AssertionFailure() << "shapes differ: " << a.shape[0] << " vs " << b.shape[0] << " rows";
  return rows_same(a, b, 0, a.shape[0]);
}

std::vector<float> ones(int64_t n) { return std::vector<float>(static_cast<size_t>(n), 1.0f); }

// Capacity-sized int32 plan buffers on the GPU, filled with the index poison (row_sources:
// `rows` entries when given).
struct GpuPlan {
  Tensor indices, bin_ids, tpe, bins, ptpe, padded_bins, dest_rows, row_sources;
  padmoe::PlanView view;
};
GpuPlan gpu_plan_buffers(int64_t T, int K, int E, int m, int64_t rows = -1) {
  GpuPlan g;
  const int64_t A = T * K, cap = rows >= 0 ? rows : padmoe::capacity_bound(T, K, E, m);
  g.indices = gpu_poison_index(A);
  g.bin_ids = gpu_poison_index(A);
  g.tpe = gpu_poison_index(E);
  g.bins = gpu_poison_index(E);
  g.ptpe = gpu_poison_index(E);
  g.padded_bins = gpu_poison_index(E);
  g.dest_rows = gpu_poison_index(A);
  g.row_sources = gpu_poison_index(cap);
  g.view.indices = g.indices;
  g.view.bin_ids = g.bin_ids;
  g.view.tokens_per_expert = g.tpe;
  g.view.bins = g.bins;
  g.view.padded_tokens_per_expert = g.ptpe;
  g.view.padded_bins = g.padded_bins;
  g.view.dest_rows = g.dest_rows;
  g.view.row_sources = g.row_sources;
  g.view.num_tokens = T;
  g.view.top_k = K;
  g.view.num_experts = E;
  g.view.alignment = m;
  return g;
}

// make_plan's layouts for R rows at alignment m on the GPU (row_experts, block_experts,
// padded_total), filled with the index poison.
struct GpuLayouts {
  Tensor row_experts, block_experts, padded_total;
  padmoe::PlanLayouts view;
};
GpuLayouts gpu_layout_buffers(int64_t R, int m) {
  GpuLayouts l;
  l.row_experts = gpu_poison_index(R);
  l.block_experts = gpu_poison_index((R + m - 1) / m);
  l.padded_total = gpu_poison_index(1);
  l.view.row_experts = l.row_experts;
  l.view.block_experts = l.block_experts;
  l.view.padded_total = l.padded_total;
  return l;
}

// Every field of a GPU plan view equals the CPU plan (bitwise) and the reference.
void expect_plan_equal(const padmoe::PlanView& g, const padmoe::Plan& c, const ref::Plan& p, const char* what) {
  SCOPED_TRACE(what);
  const std::pair<const TensorView*, const Tensor*> fields[] = {
      {&g.indices, &c.indices},
      {&g.bin_ids, &c.bin_ids},
      {&g.tokens_per_expert, &c.tokens_per_expert},
      {&g.bins, &c.bins},
      {&g.padded_tokens_per_expert, &c.padded_tokens_per_expert},
      {&g.padded_bins, &c.padded_bins},
      {&g.dest_rows, &c.dest_rows},
      {&g.row_sources, &c.row_sources}};
  const char* names[] = {"indices",     "bin_ids",   "tokens_per_expert", "bins", "padded_tokens_per_expert",
                         "padded_bins", "dest_rows", "row_sources"};
  const std::vector<int64_t>* refs[] = {
      &p.indices,     &p.bin_ids,   &p.tokens_per_expert, &p.bins, &p.padded_tokens_per_expert,
      &p.padded_bins, &p.dest_rows, &p.row_sources};
  for (int i = 0; i < 8; ++i) {
    const Tensor h = to_cpu(*fields[i].first);
    EXPECT_TRUE(all_same(h, *fields[i].second)) << "plan." << names[i] << ": GPU vs CPU";
    EXPECT_EQ(index_to_vec(h), *refs[i]) << "plan." << names[i] << ": GPU vs reference";
  }
}

// A move into a capacity-sized, poisoned GPU buffer: rows [0, P) equal the
// reference and the CPU result bitwise (padding rows zero), rows past P poison.
void expect_move(const char* what, const TensorView& gpu_dev, const TensorView& cpu, const std::vector<float>& want,
                 int64_t P) {
  const Tensor g = to_cpu(gpu_dev);
  EXPECT_TRUE(rows_bitwise(g, want, P)) << what << ": GPU vs reference";
  EXPECT_TRUE(rows_same(g, cpu, 0, P)) << what << ": GPU vs CPU";
  EXPECT_TRUE(bytes_are(g, P, g.size(0), kPoison)) << what << ": GPU wrote at or past P";
}

::testing::AssertionResult gpu_sums(const TensorView& gpu_dev, const std::vector<double>& want,
                                    const std::vector<double>& abs, int64_t n_terms, int64_t rows) {
  return sums_close(to_cpu(gpu_dev), want, abs, n_terms, rows);
}

// ---------------------------------------------------------------------------
// 1. CPU vs GPU on every op
// ---------------------------------------------------------------------------
struct Workload {
  std::string name;
  int64_t T;
  int E, K;
  int64_t H;
  int m;
  Dist dist = Dist::kUniform;
  std::vector<int64_t> counts;  // explicit per-expert counts (sum T*K) instead of dist
  int combos = 0;               // 0: all six (dtype, index) combinations; 1: bf16/int32 only; 2: f16/int64 only
};

struct Combo {
  DType dtype, idx, wdtype;
};
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
  ASSERT_EQ(cap, padmoe::capacity_bound(T, K, E, m));

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

// pad_to_alignment with no experts: P = 0, so every row of the padded output
// is "past P" and must stay untouched (the CPU leaves it alone).
TEST(CpuVsGpuEdge, PadWithNoExperts) {
  REQUIRE_GPU();
  const int64_t H = 8;
  const Tensor hh = rows_from_float(ones(5 * H), DType::kFloat32, 5, H);
  const Tensor hc = index_tensor({}, DType::kInt32);
  Tensor cpad = poison_rows(DType::kFloat32, 4, H), cmap = poison_index(4), coff = poison_index(0);
  padmoe::pad_to_alignment_out(hh, hc, 8, cpad, cmap, coff);
  Tensor gpad = gpu_poison_rows(DType::kFloat32, 4, H), gmap = gpu_poison_index(4), goff = gpu_poison_index(0);
  padmoe::pad_to_alignment_out(to_gpu(hh), to_gpu(hc), 8, gpad, gmap, goff);
  EXPECT_TRUE(all_bytes_are(cpad, kPoison)) << "CPU";
  EXPECT_TRUE(all_bytes_are(to_cpu(gpad), kPoison)) << "GPU wrote rows past P = 0";
  EXPECT_TRUE(all_same(to_cpu(gmap), cmap)) << "permutation_map: GPU vs CPU";
}

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


// The layouts of make_plan (DeepGEMM's rows, vLLM's blocks, P) and moe_align_block_size: the GPU
// against the references, with few tokens (A < E: vLLM's smaller buffer) and many, both count kernels.
TEST(CpuVsGpuEdge, PlanLayoutsAndAlignedBlocks) {
  REQUIRE_GPU();
  struct Case {
    int64_t T;
    int K, E, m;
  };
  for (const Case c :
       {Case{3, 2, 64, 16}, Case{1000, 8, 256, 128}, Case{4096, 2, 8, 64}, Case{777, 4, 2048, 16}, Case{0, 2, 8, 16}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) + " E=" + std::to_string(c.E) +
                 " m=" + std::to_string(c.m));
    const std::vector<int64_t> te = make_routing(c.T, c.K, c.E, Dist::kSkewed, 31);
    const int64_t A = c.T * c.K;
    const int64_t R = padmoe::aligned_rows_bound(A, c.E, c.m);
    const ref::Plan p = ref::make_plan(te, c.T, c.K, c.E, c.m);
    const Tensor dte = to_gpu(index_matrix(te, c.T, c.K, DType::kInt64));
    Tensor ind = gpu_poison_index(A), bid = gpu_poison_index(A), tpe = gpu_poison_index(c.E),
           bins = gpu_poison_index(c.E), ptpe = gpu_poison_index(c.E), pb = gpu_poison_index(c.E),
           dest = gpu_poison_index(A), rs = gpu_poison_index(R);
    padmoe::PlanView out;
    out.indices = ind;
    out.bin_ids = bid;
    out.tokens_per_expert = tpe;
    out.bins = bins;
    out.padded_tokens_per_expert = ptpe;
    out.padded_bins = pb;
    out.dest_rows = dest;
    out.row_sources = rs;
    GpuLayouts l = gpu_layout_buffers(R, c.m);
    padmoe::make_plan_out(dte, c.E, c.m, out, l.view);
    EXPECT_EQ(index_to_vec(to_cpu(l.row_experts)), ref::row_experts(te, c.E, c.m, R));
    std::vector<int64_t> rows_src = p.row_sources;
    rows_src.resize(static_cast<size_t>(R), -1);
    EXPECT_EQ(index_to_vec(to_cpu(rs)), rows_src);
    EXPECT_EQ(index_to_vec(to_cpu(l.block_experts)), ref::block_experts(te, c.E, c.m, R));  // -1 past P
    EXPECT_EQ(index_to_vec(to_cpu(l.padded_total)), std::vector<int64_t>{p.padded_rows});
    // vLLM's ignore_invalid_experts map: every third expert elsewhere, the rest local in reverse order
    std::vector<int64_t> map(static_cast<size_t>(c.E), -1);
    int64_t next = 0;
    for (int e = c.E - 1; e >= 0; --e) {
      if (e % 3 != 1) map[static_cast<size_t>(e)] = next++;
    }
    const Tensor dmap = to_gpu(index_matrix(map, 1, c.E, DType::kInt32));
    const padmoe::TensorView map_view =
        padmoe::TensorView::contiguous(dmap.data(), DType::kInt32, {c.E}, dmap.device());
    for (bool pad : {false, true}) {
      for (bool mapped : {false, true}) {
        SCOPED_TRACE(std::string(pad ? "pad_sorted_ids" : "unpadded") + (mapped ? ", expert_map" : ""));
        const ref::AlignedBlocks w = ref::moe_align_block_size(te, c.m, c.E, pad, mapped ? &map : nullptr);
        const padmoe::AlignedBlocks g = mapped ? padmoe::moe_align_block_size(dte, c.m, c.E, map_view, pad)
                                               : padmoe::moe_align_block_size(dte, c.m, c.E, pad);
        EXPECT_EQ(index_to_vec(to_cpu(g.sorted_token_ids)), w.sorted_token_ids);
        EXPECT_EQ(index_to_vec(to_cpu(g.expert_ids)), w.expert_ids);  // 0 past P, as vLLM
        EXPECT_EQ(index_to_vec(to_cpu(g.num_tokens_post_padded)), std::vector<int64_t>{w.num_tokens_post_padded});
      }
    }
  }
}

// vLLM's batched layout (batched_moe_align_block_size): the GPU bitwise against the CPU backend and
// the reference, checked and unchecked, int32 and int64 counts, over the one-launch form (E <= 4096)
// and the two-launch one (E = 5000), E = 0, max_tokens 0, block_size 1 and larger than max_tokens.
// Checked mode names the first bad count as the CPU does and writes nothing; unchecked mode reads a
// bad count as clamped into [0, max_tokens].
TEST(CpuVsGpuEdge, BatchedAlignBlocks) {
  REQUIRE_GPU();
  struct Case {
    int E, max_tokens, block;
  };
  Rng rng(23);
  for (const Case c : {Case{0, 16, 8}, Case{1, 13, 16}, Case{8, 16, 8}, Case{7, 5, 64}, Case{64, 100, 1},
                       Case{32, 512, 64}, Case{256, 1024, 16}, Case{4096, 64, 16}, Case{5000, 24, 16}, Case{3, 0, 4}}) {
    SCOPED_TRACE("E=" + std::to_string(c.E) + " max_tokens=" + std::to_string(c.max_tokens) +
                 " block=" + std::to_string(c.block));
    std::vector<int64_t> counts(static_cast<size_t>(c.E));
    for (int64_t& n : counts) {
      const int64_t r = rng.below(4);  // 0, the maximum, or anything between
      n = r == 0 ? 0 : (r == 1 ? c.max_tokens : rng.below(c.max_tokens + 1));
    }
    const ref::AlignedBlocks want = ref::batched_moe_align_block_size(counts, c.max_tokens, c.block);
    const int64_t n = static_cast<int64_t>(want.sorted_token_ids.size());
    for (const DType idx : {DType::kInt32, DType::kInt64}) {
      const Tensor hc = index_tensor(counts, idx);
      const padmoe::AlignedBlocks cpu = padmoe::batched_moe_align_block_size(hc, c.max_tokens, c.block);
      const Tensor dc = to_gpu(hc);
      for (const bool checked : {true, false}) {
        SCOPED_TRACE(std::string(idx == DType::kInt64 ? "int64" : "int32") + (checked ? " checked" : " unchecked"));
        padmoe::Options o;
        o.check_data = checked;
        Tensor sorted = gpu_poison_index(n), blocks = gpu_poison_index(n / c.block), post = gpu_poison_index(1);
        padmoe::batched_moe_align_block_size_out(dc, c.max_tokens, c.block, sorted, blocks, post, o);
        EXPECT_TRUE(all_same(to_cpu(sorted), cpu.sorted_token_ids));
        EXPECT_TRUE(all_same(to_cpu(blocks), cpu.expert_ids));
        EXPECT_TRUE(all_same(to_cpu(post), cpu.num_tokens_post_padded));
        EXPECT_EQ(index_to_vec(to_cpu(sorted)), want.sorted_token_ids);
        EXPECT_EQ(index_to_vec(to_cpu(blocks)), want.expert_ids);
        EXPECT_EQ(index_to_vec(to_cpu(post)), std::vector<int64_t>{want.num_tokens_post_padded});
      }
      const padmoe::AlignedBlocks gpu = padmoe::batched_moe_align_block_size(dc, c.max_tokens, c.block);
      EXPECT_TRUE(all_same(to_cpu(gpu.sorted_token_ids), cpu.sorted_token_ids));
      EXPECT_TRUE(all_same(to_cpu(gpu.expert_ids), cpu.expert_ids));
    }
  }
  for (const int E : {3, 5000}) {  // both forms
    SCOPED_TRACE("bad counts, E=" + std::to_string(E));
    std::vector<int64_t> bad(static_cast<size_t>(E), 2);
    bad[1] = 17;
    bad[static_cast<size_t>(E) - 1] = -1;
    std::vector<int64_t> clamped = bad;
    clamped[1] = 16;
    clamped[static_cast<size_t>(E) - 1] = 0;
    const ref::AlignedBlocks want = ref::batched_moe_align_block_size(clamped, 16, 8);
    const int64_t n = static_cast<int64_t>(want.sorted_token_ids.size());
    for (const DType idx : {DType::kInt32, DType::kInt64}) {
      const Tensor dc = to_gpu(index_tensor(bad, idx));
      Tensor sorted = gpu_poison_index(n), blocks = gpu_poison_index(n / 8), post = gpu_poison_index(1);
      EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size_out(dc, 16, 8, sorted, blocks, post); },
                               {"batched_moe_align_block_size: expert_num_tokens: entry 1 is 17, outside [0, "
                                "max_tokens_per_batch = 16]"},
                               static_cast<int>(padmoe::ErrorKind::kValue)));
      EXPECT_TRUE(all_bytes_are(to_cpu(sorted), kIndexPoison));
      EXPECT_TRUE(all_bytes_are(to_cpu(blocks), kIndexPoison));
      EXPECT_TRUE(all_bytes_are(to_cpu(post), kIndexPoison));
      padmoe::Options o;
      o.check_data = false;
      padmoe::batched_moe_align_block_size_out(dc, 16, 8, sorted, blocks, post, o);
      EXPECT_EQ(index_to_vec(to_cpu(sorted)), want.sorted_token_ids);
      EXPECT_EQ(index_to_vec(to_cpu(blocks)), want.expert_ids);
      EXPECT_EQ(index_to_vec(to_cpu(post)), std::vector<int64_t>{want.num_tokens_post_padded});
    }
  }
}

// mask_plan_out on the GPU equals the CPU's, entry for entry, over sizes that take one and several
// tiles a chunk, experts not a multiple of 32, cuts, padding, one_bin and the E above 3072 that
// needs more than 48 KiB of shared memory; the GPU's outputs are the same on a second run.
TEST(CpuVsGpuEdge, MaskPlan) {
  REQUIRE_GPU();
  struct Case {
    int64_t T, E;
    int alignment;
    bool one_bin;
    double cut;
  };
  Rng rng(29);
  for (const Case c : {Case{1, 1, 1, true, 1.0}, Case{33, 8, 1, true, 0.5}, Case{256, 256, 1, true, 1.0},
                       Case{256, 256, 16, false, 1.0}, Case{1000, 7, 128, false, 1.0}, Case{4099, 40, 1, false, 0.8},
                       Case{20000, 8, 16, false, 1.0}, Case{70000, 3, 1, true, 1.0}, Case{9, 4000, 4, false, 1.0},
                       Case{0, 16, 16, false, 1.0}, Case{5, 0, 1, true, 1.0}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " align=" + std::to_string(c.alignment) +
                 (c.one_bin ? " one_bin" : "") + " cut=" + std::to_string(c.cut));
    Tensor map = Tensor::empty(DType::kUInt8, {c.T, c.E});
    int64_t routed = 0;
    for (int64_t i = 0; i < c.T * c.E; ++i) {
      const bool set = rng.below(c.E > 8 ? c.E / 8 : 2) == 0;
      map.data_as<uint8_t>()[i] = set ? 1 : 0;
      routed += set;
    }
    const int64_t total = c.one_bin ? routed : routed + c.E * (c.alignment - 1);
    const int64_t rows = static_cast<int64_t>(total * c.cut);
    const int64_t bins = c.one_bin ? 1 : c.E;
    const int64_t sources_len = c.one_bin ? rows : (c.E > 0 ? (rows + c.E - 1) / c.E * c.E : 0);
    Tensor counts = poison_index(4 * bins), dest = poison_index(c.T * c.E), sources = poison_index(sources_len);
    Tensor rim = filled(DType::kInt32, {c.T, 2 * c.E + 1}, kIndexPoison);
    Tensor indices = poison_index(c.T * c.E), bin_ids = poison_index(c.T * c.E);
    padmoe::mask_plan_out(map, c.alignment, rows, c.one_bin, counts, dest, sources, rim, indices, bin_ids);
    const Tensor dmap = to_gpu(map);
    for (int run = 0; run < 2; ++run) {
      Tensor gc = gpu_poison_index(4 * bins), gd = gpu_poison_index(c.T * c.E), gs = gpu_poison_index(sources_len);
      Tensor gr = gpu_filled(DType::kInt32, {c.T, 2 * c.E + 1}, kIndexPoison);
      Tensor gi = gpu_poison_index(c.T * c.E), gb = gpu_poison_index(c.T * c.E);
      padmoe::mask_plan_out(dmap, c.alignment, rows, c.one_bin, gc, gd, gs, gr, gi, gb);
      EXPECT_TRUE(all_same(to_cpu(gc), counts));
      EXPECT_TRUE(all_same(to_cpu(gd), dest));
      EXPECT_TRUE(all_same(to_cpu(gs), sources));
      EXPECT_TRUE(all_same(to_cpu(gr), rim));
      EXPECT_TRUE(all_same(to_cpu(gi), indices));
      EXPECT_TRUE(all_same(to_cpu(gb), bin_ids));
    }
  }
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

// ---------------------------------------------------------------------------
// 2. Determinism: every op twice on the GPU gives the same bytes.
// ---------------------------------------------------------------------------
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
      const int64_t R = cpu.capacity();
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

// Programmatic dependent launch: a chain of ops on one stream with no host synchronization
// between them (each reads what the one before wrote, and the pad / unpad ops are several
// launches), run with PDL off and on. Every kernel must wait for its predecessor before its
// first access, so both runs give the same bits, and the moves and sums equal the CPU's.
TEST(Pdl, ChainedOpsMatchWithAndWithoutPdl) {
  REQUIRE_GPU();
  const int64_t T = 4096, H = 512;
  const int E = 64, K = 8, m = 16;
  const int64_t A = T * K, cap = padmoe::capacity_bound(T, K, E, m);
  const DType dt = DType::kBFloat16;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 31);
  Rng rng(41);
  const Tensor hte = index_matrix(te, T, K, DType::kInt32);
  const Tensor hx = rows_from_float(random_values(T * H, dt, rng), dt, T, H);
  const Tensor hw = vec_from_float(random_values(A, DType::kFloat32, rng, 0, 1), DType::kFloat32);
  const Tensor dte = to_gpu(hte), dx = to_gpu(hx), dw = to_gpu(hw);

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t ws_bytes = padmoe::workspace_bound(T, K, E, m);
  void* ws = nullptr;
  CUDA_OK(cudaMalloc(&ws, ws_bytes));
  padmoe::Options o;
  o.stream = stream;
  o.check_data = false;
  o.workspace = ws;
  o.workspace_bytes = ws_bytes;

  auto chain = [&](int pdl) {
    kernel_overrides().pdl = pdl != 0;
    GpuPlan gp = gpu_plan_buffers(T, K, E, m);
    const Tensor y = gpu_poison_rows(dt, cap, H), out = gpu_poison_rows(dt, T, H);
    const Tensor gy = gpu_poison_rows(dt, cap, H), gx = gpu_poison_rows(dt, T, H);
    const Tensor gw = gpu_filled(DType::kFloat32, {A}, 0xff), gw2 = gpu_filled(DType::kFloat32, {A}, 0xff);
    const Tensor padded = gpu_poison_rows(dt, cap, H), map = gpu_poison_index(cap), offs = gpu_poison_index(E);
    const Tensor back = gpu_poison_rows(dt, A, H);
    CUDA_OK(cudaDeviceSynchronize());  // the poison memsets ran on the legacy stream
    padmoe::make_plan_out(dte, E, m, gp.view, o);
    padmoe::dispatch_out(dx, gp.view, dw.view(), y, o);
    padmoe::combine_out(y, gp.view, dw.view(), out, o);
    padmoe::combine_backward_out(out, y, gp.view, dw.view(), gy, gw, o);
    padmoe::dispatch_backward_out(gy, dx, gp.view, dw.view(), gx, gw2, o);
    padmoe::pad_to_alignment_out(gy, gp.tpe, m, padded, map, offs, o);  // gy's first A rows as grouped rows
    padmoe::unpad_from_alignment_out(padded, map, std::nullopt, back, o);
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<Tensor> r;
    for (const Tensor* t : std::initializer_list<const Tensor*>{&gp.dest_rows, &gp.row_sources, &y, &out, &gy, &gw, &gx,
                                                                &gw2, &padded, &map, &offs, &back})
      r.push_back(to_cpu(*t));
    return r;
  };
  const std::vector<Tensor> off = chain(0);
  const std::vector<Tensor> on = chain(1);
  kernel_overrides().pdl.reset();
  ASSERT_EQ(off.size(), on.size());
  for (size_t i = 0; i < off.size(); ++i) EXPECT_TRUE(all_same(off[i], on[i])) << "output " << i << " differs with PDL";

  // the moves and sums against the CPU (bitwise); the dots (gw, gw2) are covered by DotKernels
  const padmoe::Plan cp = padmoe::make_plan(hte, E, m);
  const int64_t P = padmoe::padded_rows(cp);
  const Tensor cy = padmoe::dispatch(hx, cp.view(), hw.view());
  EXPECT_TRUE(rows_same(on[2], cy, 0, P)) << "dispatch vs CPU";
  const Tensor cout = padmoe::combine(cy, cp.view(), hw.view());
  EXPECT_TRUE(all_same(on[3], cout)) << "combine vs CPU";
  const padmoe::RowGrads cgb = padmoe::combine_backward(cout, cy, cp.view(), hw.view());
  EXPECT_TRUE(rows_same(on[4], cgb.grad_rows, 0, P)) << "combine_backward vs CPU";
  const padmoe::RowGrads cdb = padmoe::dispatch_backward(cgb.grad_rows, hx, cp.view(), hw.view());
  EXPECT_TRUE(all_same(on[6], cdb.grad_rows)) << "dispatch_backward vs CPU";
  CUDA_OK(cudaFree(ws));
  CUDA_OK(cudaStreamDestroy(stream));
}

// ---------------------------------------------------------------------------
// 3. Checked mode
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

// ---------------------------------------------------------------------------
// 4. CUDA graph: plan + dispatch + combine captured once, replayed on new inputs.
// ---------------------------------------------------------------------------
// T=512: a one-chunk plan (an ordinary launch); T=16384, K=8, E=256: the plan's cooperative
// launch (a grid barrier) captured and replayed.
void capture_once_replay(const int64_t T, const int E, const int K) {
  SCOPED_TRACE("T=" + std::to_string(T) + " E=" + std::to_string(E) + " K=" + std::to_string(K));
  const int64_t H = 256;
  const int m = 16;
  const int64_t A = T * K, cap = padmoe::capacity_bound(T, K, E, m);
  const DType dt = DType::kBFloat16;

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t ws_bytes = padmoe::workspace_bound(T, K, E, m);
  void* ws = nullptr;
  CUDA_OK(cudaMalloc(&ws, ws_bytes));

  const Tensor d_te = gpu_filled(DType::kInt32, {T, K}, 0);
  const Tensor d_x = gpu_filled(dt, {T, H}, 0);
  const Tensor d_w = gpu_filled(DType::kFloat32, {A}, 0);
  GpuPlan gp = gpu_plan_buffers(T, K, E, m);
  const Tensor d_y = gpu_poison_rows(dt, cap, H);
  const Tensor d_out = gpu_poison_rows(dt, T, H);

  padmoe::Options o;
  o.stream = stream;
  o.check_data = false;
  o.workspace = ws;
  o.workspace_bytes = ws_bytes;

  CUDA_OK(cudaDeviceSynchronize());  // the poison memsets ran on the legacy stream
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  bool threw = false;
  std::string error;
  try {
    padmoe::make_plan_out(d_te, E, m, gp.view, o);
    padmoe::dispatch_out(d_x, gp.view, d_w.view(), d_y, o);
    padmoe::combine_out(d_y, gp.view, d_w.view(), d_out, o);
  } catch (const std::exception& e) {
    threw = true;
    error = e.what();
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t qerr = cudaStreamIsCapturing(stream, &status);
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  ASSERT_FALSE(threw) << "an op failed during capture (a host synchronization or allocation?): " << error;
  ASSERT_EQ(qerr, cudaSuccess) << cudaGetErrorString(qerr);
  ASSERT_EQ(status, cudaStreamCaptureStatusActive) << "capture was invalidated by an op";
  ASSERT_EQ(end, cudaSuccess) << "cudaStreamEndCapture: " << cudaGetErrorString(end);
  ASSERT_NE(graph, nullptr);
  size_t num_nodes = 0;
  CUDA_OK(cudaGraphGetNodes(graph, nullptr, &num_nodes));
  EXPECT_GE(num_nodes, 3u);  // the plan (one launch when E <= 512), dispatch, combine
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const padmoe::workload::Routing rt = padmoe::workload::random_router(T, E, K, 1234 + round);
    std::vector<int64_t> te(rt.top_experts.begin(), rt.top_experts.end());
    if (round == 2)  // a skewed round: different P, many empty experts
      te = make_routing(T, K, E, Dist::kSkewed, 99);
    const std::vector<int32_t> te32(te.begin(), te.end());
    Rng rng(500 + round);
    const std::vector<float> xf = random_values(T * H, dt, rng);
    const Tensor hx = rows_from_float(xf, dt, T, H);
    const std::vector<float>& wf = rt.weights;
    CUDA_OK(cudaMemcpyAsync(d_te.data(), te32.data(), te32.size() * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(d_x.data(), hx.data(), nbytes(hx), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(d_w.data(), wf.data(), wf.size() * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));

    const ref::Plan p = ref::make_plan(te, T, K, E, m);
    const int64_t P = p.padded_rows;
    const padmoe::Plan cplan = padmoe::make_plan(index_matrix(te, T, K, DType::kInt32), E, m);
    expect_plan_equal(gp.view, cplan, p, "graph make_plan_out");
    const Tensor hw = vec_from_float(wf, DType::kFloat32);
    const Tensor cy = padmoe::dispatch(hx, cplan.view(), hw.view());
    const std::vector<float> want_y = ref::padded_gather(xf, H, p, &wf);
    const Tensor gy = to_cpu(d_y);
    EXPECT_TRUE(rows_bitwise(gy, want_y, P)) << "graph dispatch vs reference";
    EXPECT_TRUE(rows_same(gy, cy, 0, P)) << "graph dispatch vs CPU";
    if (round == 0) EXPECT_TRUE(bytes_are(gy, P, cap, kPoison)) << "graph dispatch wrote past P";
    const std::vector<float> yf = rows_to_float(cy);
    const std::vector<double> want = ref::padded_scatter(yf, H, p, &wf);
    const std::vector<double> abs = ref_scatter_abs(yf, H, p, &wf);
    EXPECT_TRUE(sums_close(to_cpu(d_out), want, abs, K, T)) << "graph combine vs reference";
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaFree(ws));
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(CudaGraph, CaptureOnceReplayOnNewRouting) {
  REQUIRE_GPU();
  capture_once_replay(512, 16, 4);
  capture_once_replay(16384, 256, 8);
}

// ---------------------------------------------------------------------------
// 5. A DeepSeek-V3-like step: T=4096, E=256, K=8, H=7168, bf16, alignment 128.
// ---------------------------------------------------------------------------
TEST(Large, DeepSeekV3DispatchCombine) {
  REQUIRE_GPU();
  const int64_t T = 4096, H = 7168;
  const int E = 256, K = 8, m = 128;
  const int64_t A = T * K, cap = padmoe::capacity_bound(T, K, E, m);
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

// Options::zero_tail on the GPU: rows at or past P of a capacity-sized dispatch
// output are zero (bitwise equal to the CPU's), untouched without it.
namespace pt {
namespace {
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
    const int64_t P = rp.padded_rows, cap = cpu.plan.capacity();
    ASSERT_EQ(cap, padmoe::capacity_bound(T, K, E, m));
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
  const int64_t cap = padmoe::capacity_bound(T, K, E, m);
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

TEST(ZeroTail, DispatchOnGpuMatchesCpu) {
  REQUIRE_GPU();
  const int64_t T = 300, H = 72;
  const int E = 9, K = 3, m = 16;
  const int64_t cap = padmoe::capacity_bound(T, K, E, m);
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
}  // namespace
}  // namespace pt

// sort_chunks (ops.hpp section 5) on the GPU: bitwise equal to the CPU backend
// (and the reference), checked-mode errors in the CPU's words with nothing
// written, and an unchecked _out captured in a CUDA graph.
namespace pt {
namespace {

std::string sort_chunks_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const padmoe::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<int64_t> sort_chunks_sizes(int64_t C, int m, Rng& rng) {
  std::vector<int64_t> s(static_cast<size_t>(C));
  for (auto& n : s) n = rng.below(4) == 0 ? 0 : rng.below(3 * m + 7);
  return s;
}

TEST(SortChunksGpu, MatchesCpuBitwise) {
  REQUIRE_GPU();
  struct Cfg {
    int R, E, m;
    DType dt, sdt;
    bool sorted, two_d;
    int64_t H = 0;  // 0: 66 for float32, else 256
  };
  const std::vector<Cfg> cfgs = {
      {8, 4, 16, DType::kBFloat16, DType::kInt32, false, true},
      {8, 32, 128, DType::kBFloat16, DType::kInt64, false, false},
      {1, 6, 4, DType::kFloat32, DType::kInt64, false, false},
      {5, 1, 8, DType::kFloat16, DType::kInt32, false, true},
      {4, 8, 1, DType::kFloat32, DType::kInt32, true, false},
      {3, 5, 16, DType::kFloat8E4M3, DType::kInt64, true, true},
      {64, 16, 16, DType::kBFloat16, DType::kInt32, false, true},
      {2, 3, 4, DType::kFloat8E5M2, DType::kInt32, false, false},
      {16, 70, 8, DType::kFloat32, DType::kInt64, true, false},  // C = 1120 > the scan's 1024 threads
      {16, 160, 8, DType::kBFloat16, DType::kInt32, true, true},  // C = 2560: past the shared-memory layout
      // rows that are not 16-byte multiples: the one-launch form's 1- and 2-byte words
      {8, 32, 16, DType::kFloat8E4M3, DType::kInt32, false, true, 33},
      {4, 16, 8, DType::kBFloat16, DType::kInt64, true, false, 35},
      // rows of 256 words and more (the one launch's row-by-row form, forms 3 and 4): 300 16-byte
      // words, and 1101 4-byte words
      {8, 8, 16, DType::kBFloat16, DType::kInt32, false, true, 2400},
      {4, 6, 8, DType::kFloat32, DType::kInt64, true, false, 1101},
      // form 4's bounds: C = 256 chunks with 256-word rows, and 4-byte words with no sorted_index
      {8, 32, 16, DType::kBFloat16, DType::kInt64, false, false, 2048},
      {4, 6, 8, DType::kFloat32, DType::kInt32, false, true, 1101}};
  for (const Cfg& cf : cfgs) {
    SCOPED_TRACE("R=" + std::to_string(cf.R) + " E=" + std::to_string(cf.E) + " m=" + std::to_string(cf.m) + " " +
                 dname(cf.dt) + (cf.sorted ? " sorted" : ""));
    Rng rng(static_cast<uint64_t>(cf.R * 1000 + cf.E * 10 + cf.m));
    const int64_t C = static_cast<int64_t>(cf.R) * cf.E, H = cf.H > 0 ? cf.H : (cf.dt == DType::kFloat32 ? 66 : 256);
    const std::vector<int64_t> sizes = sort_chunks_sizes(C, cf.m, rng);
    const int64_t sum = std::accumulate(sizes.begin(), sizes.end(), int64_t{0}), N = sum + 3;
    std::vector<int64_t> perm(static_cast<size_t>(C));
    std::iota(perm.begin(), perm.end(), int64_t{0});
    for (int64_t i = C - 1; i > 0; --i)
      std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(rng.below(i + 1))]);
    const std::vector<float> hf = random_values(N * H, cf.dt, rng);
    const Tensor hh = rows_from_float(hf, cf.dt, N, H);
    const Tensor hs = cf.two_d ? index_matrix(sizes, cf.R, cf.E, cf.sdt) : index_tensor(sizes, cf.sdt);
    const Tensor hp = index_tensor(perm, DType::kInt64);
    const Tensor dh = to_gpu(hh), ds = to_gpu(hs), dp = to_gpu(hp);
    const std::optional<TensorView> hsi = cf.sorted ? std::optional<TensorView>(hp.view()) : std::nullopt;
    const std::optional<TensorView> dsi = cf.sorted ? std::optional<TensorView>(dp.view()) : std::nullopt;

    const ref::PadResult want = ref::sort_chunks(hf, H, sizes, cf.R, cf.m, cf.sorted ? &perm : nullptr);
    const int64_t P = want.padded_rows, cap = padmoe::sort_chunks_capacity(N, C, cf.R, cf.m);
    const padmoe::PadResult cpu = padmoe::sort_chunks(hh, hs, cf.R, cf.m, hsi);
    ASSERT_EQ(cpu.padded.size(0), P);
    EXPECT_TRUE(rows_bitwise(cpu.padded, want.padded, P));
    // five forms (unchecked calls only; checked ones validate on the device first, then take form
    // 0 or 1): 0 the layout, chunk_map, the gather; 1 the layout's fused map, the gather; 2 one
    // launch (chunk_rows_kernel, C <= 1024), the flattened loop; 3 the one launch moving a row at a
    // time (rows of 256 words and more; else form 2); 4 the layout in one block scan, one row a
    // block (chunk_rows_one_scan_kernel: no sorted_index, C <= 256, rows of 256 words and more;
    // else form 3). Form 4 is the default where it applies: the allocating call below takes it.
    for (int form : {0, 1, 2, 3, 4})
      for (bool checked : {true, false}) {
        for (bool zero_tail : {false, true}) {
          for (bool zero_padding : {true, false}) {
            SCOPED_TRACE("form " + std::to_string(form) + (zero_padding ? "" : " zero_padding off"));
            KernelOverrides ko;
            ko.chunk_map_fused = form != 0;
            ko.chunk_rows = form >= 2;
            ko.chunk_rows_form = form == 4   ? pol::ChunkRowsForm::kOneScan
                                 : form == 3 ? pol::ChunkRowsForm::kRowwise
                                             : pol::ChunkRowsForm::kFlat;
            kernel_overrides() = ko;
            padmoe::Options o;
            o.check_data = checked;
            o.zero_tail = zero_tail;
            o.zero_padding = zero_padding;
            Tensor gpad = gpu_poison_rows(cf.dt, cap, H), gmap = gpu_poison_index(cap), goff = gpu_poison_index(cf.E);
            padmoe::sort_chunks_out(dh, ds, cf.R, cf.m, dsi, gpad, gmap, goff, o);
            kernel_overrides() = KernelOverrides{};
            Tensor cpad = poison_rows(cf.dt, cap, H), cmap = poison_index(cap), coff = poison_index(cf.E);
            padmoe::sort_chunks_out(hh, hs, cf.R, cf.m, hsi, cpad, cmap, coff, o);
            const Tensor hpad = to_cpu(gpad);
            EXPECT_TRUE(all_same(hpad, cpad)) << "padded, checked=" << checked << " zero_tail=" << zero_tail;
            EXPECT_TRUE(all_same(to_cpu(gmap), cmap)) << "permutation_map";
            EXPECT_TRUE(all_same(to_cpu(goff), coff)) << "inclusive_offsets";
            if (zero_padding) EXPECT_TRUE(rows_bitwise(hpad, want.padded, P));
            EXPECT_TRUE(bytes_are(hpad, P, cap, zero_tail && zero_padding ? 0x00 : kPoison)) << "rows past P";
            EXPECT_EQ(index_to_vec(to_cpu(goff)), want.inclusive_offsets);
          }
        }
      }
    const padmoe::PadResult gpu = padmoe::sort_chunks(dh, ds, cf.R, cf.m, dsi);
    EXPECT_TRUE(all_same(to_cpu(gpu.padded), cpu.padded)) << "allocating form";
    EXPECT_TRUE(all_same(to_cpu(gpu.permutation_map), cpu.permutation_map));
    // The way back on the GPU (unsort_chunks = unpad_from_alignment), with probs for 16/32-bit rows.
    const Tensor cb = padmoe::unsort_chunks(cpu.padded, cpu.permutation_map, N);
    EXPECT_TRUE(all_same(to_cpu(padmoe::unsort_chunks(gpu.padded, gpu.permutation_map, N)), cb)) << "unsort";
    if (!padmoe::is_float8(cf.dt)) {
      const Tensor pr = vec_from_float(random_values(N, DType::kFloat32, rng, 0.0, 1.0), DType::kFloat32);
      const Tensor dpr = to_gpu(pr);
      EXPECT_TRUE(all_same(to_cpu(padmoe::unsort_chunks(gpu.padded, gpu.permutation_map, N, dpr.view())),
                           padmoe::unsort_chunks(cpu.padded, cpu.permutation_map, N, pr.view())))
          << "unsort with probs";
    }
  }
}

TEST(SortChunksGpu, CheckedModeErrorsAsCpuNothingWritten) {
  REQUIRE_GPU();
  const int64_t N = 10, H = 8;
  Rng rng(1);
  const Tensor hh = rows_from_float(random_values(N * H, DType::kFloat32, rng), DType::kFloat32, N, H);
  const Tensor dh = to_gpu(hh);
  struct Case {
    std::vector<int64_t> sizes;
    std::vector<int64_t> perm;  // empty: none
    int64_t rows;               // output rows
  };
  const std::vector<Case> cases = {
      {{1, -1, 0, -2, 1, 1}, {}, 64},           // negative: first [0, 1]
      {{1, 2, 11, 3, 1, 1}, {}, 64},            // entry past the rows
      {{1, 2, 4, 3, 1, 1}, {}, 64},             // sum past the rows
      {{1, 2, 0, 3, 1, 1}, {0, 1, 9, 3, -1, 5}, 64},  // sorted_index out of range
      {{1, 2, 0, 3, 1, 1}, {0, 4, 2, 4, 1, 2}, 64},   // repeated chunks 2 and 4
      {{1, 2, 0, 3, 1, 1}, {}, 11},             // P = 12 > 11 rows
      {{-1, 20, 0, 3, 1, 1}, {0, 0, 0, 0, 0, 0}, 64},  // several: the lowest code first
  };
  for (const Case& k : cases) {
    for (DType sdt : {DType::kInt32, DType::kInt64}) {
      const Tensor hs = index_matrix(k.sizes, 2, 3, sdt), ds = to_gpu(hs);
      const Tensor hp = index_tensor(k.perm, DType::kInt32);
      const Tensor dp = k.perm.empty() ? Tensor() : to_gpu(hp);
      const std::optional<TensorView> hsi = k.perm.empty() ? std::nullopt : std::optional<TensorView>(hp.view());
      const std::optional<TensorView> dsi = k.perm.empty() ? std::nullopt : std::optional<TensorView>(dp.view());
      Tensor cpad = poison_rows(DType::kFloat32, k.rows, H), cmap = poison_index(k.rows), coff = poison_index(3);
      Tensor gpad = gpu_poison_rows(DType::kFloat32, k.rows, H), gmap = gpu_poison_index(k.rows),
             goff = gpu_poison_index(3);
      const std::string cpu_msg =
          sort_chunks_error([&] { padmoe::sort_chunks_out(hh, hs, 2, 4, hsi, cpad, cmap, coff); });
      const std::string gpu_msg =
          sort_chunks_error([&] { padmoe::sort_chunks_out(dh, ds, 2, 4, dsi, gpad, gmap, goff); });
      EXPECT_NE(cpu_msg, "(no error)");
      EXPECT_EQ(gpu_msg, cpu_msg);
      EXPECT_TRUE(all_bytes_are(to_cpu(gpad), kPoison)) << gpu_msg;
      EXPECT_TRUE(all_bytes_are(to_cpu(gmap), kIndexPoison)) << gpu_msg;
      EXPECT_TRUE(all_bytes_are(to_cpu(goff), kIndexPoison)) << gpu_msg;
      if (k.rows == 64) {  // the allocating form reads the sizes on the host: the same words
        EXPECT_EQ(sort_chunks_error([&] { padmoe::sort_chunks(dh, ds, 2, 4, dsi); }), cpu_msg);
      }
    }
  }
}

TEST(SortChunksGpu, UncheckedCapturedInCudaGraph) {
  REQUIRE_GPU();
  const int R = 8, E = 4, m = 16;
  const int64_t C = R * E, N = 2048, H = 512;
  const DType dt = DType::kBFloat16;
  const int64_t cap = padmoe::sort_chunks_capacity(N, C, R, m);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t ws_bytes = padmoe::sort_chunks_workspace_bytes(C);
  void* ws = nullptr;
  CUDA_OK(cudaMalloc(&ws, ws_bytes));
  const Tensor d_h = gpu_filled(dt, {N, H}, 0), d_s = gpu_filled(DType::kInt32, {R, E}, 0);
  const Tensor d_pad = gpu_poison_rows(dt, cap, H), d_map = gpu_poison_index(cap), d_off = gpu_poison_index(E);
  padmoe::Options o;
  o.stream = stream;
  o.check_data = false;
  o.workspace = ws;
  o.workspace_bytes = ws_bytes;
  CUDA_OK(cudaDeviceSynchronize());
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  std::string error;
  try {
    padmoe::sort_chunks_out(d_h, d_s, R, m, std::nullopt, d_pad, d_map, d_off, o);
  } catch (const std::exception& e) {
    error = e.what();
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  ASSERT_EQ(error, "") << "sort_chunks_out failed during capture (a host synchronization?)";
  ASSERT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    Rng rng(77 + round);
    std::vector<int64_t> sizes(static_cast<size_t>(C));
    for (auto& n : sizes) n = rng.below(N / C + 20);
    if (round == 2) std::fill(sizes.begin(), sizes.end(), 0);
    const int64_t sum = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    ASSERT_LE(sum, N);
    const std::vector<int32_t> s32(sizes.begin(), sizes.end());
    const std::vector<float> hf = random_values(N * H, dt, rng);
    const Tensor hh = rows_from_float(hf, dt, N, H);
    CUDA_OK(cudaMemcpyAsync(d_s.data(), s32.data(), s32.size() * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(d_h.data(), hh.data(), nbytes(hh), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const ref::PadResult want = ref::sort_chunks(hf, H, sizes, R, m, nullptr);
    const Tensor gpad = to_cpu(d_pad);
    EXPECT_TRUE(rows_bitwise(gpad, want.padded, want.padded_rows));
    std::vector<int64_t> map = want.permutation_map;
    map.resize(static_cast<size_t>(cap), -1);
    EXPECT_EQ(index_to_vec(to_cpu(d_map)), map);
    EXPECT_EQ(index_to_vec(to_cpu(d_off)), want.inclusive_offsets);
    if (round == 0) EXPECT_TRUE(bytes_are(gpad, want.padded_rows, cap, kPoison)) << "wrote past P";
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaFree(ws));
  CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace pt

// Rows moved with their scales (ops.hpp section 4) on the GPU: every `_scaled` op, every scale layout,
// float8 e4m3 / e5m2 and bf16 rows, bitwise equal to the CPU backend (rows and scale rows, including the
// poison past P), under zero_padding / zero_tail / unchecked mode; shape errors leave the outputs unwritten.
namespace pt {
namespace {

enum class Fp8Layout { kPerRow1D, kPerRow2D, kBlock128, kMx };

int64_t fp8_cols(Fp8Layout l, int64_t H) {
  return l == Fp8Layout::kBlock128 ? (H + 127) / 128 : l == Fp8Layout::kMx ? (H + 31) / 32 : 1;
}
Tensor fp8_poison_scales(Fp8Layout l, int64_t rows, int64_t H) {
  if (l == Fp8Layout::kPerRow1D) return filled(DType::kFloat32, {rows}, kPoison);
  return filled(l == Fp8Layout::kMx ? DType::kUInt8 : DType::kFloat32, {rows, fp8_cols(l, H)}, kPoison);
}
Tensor fp8_random_scales(Fp8Layout l, int64_t rows, int64_t H, Rng& rng) {
  Tensor t = fp8_poison_scales(l, rows, H);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (l == Fp8Layout::kMx) t.data_as<uint8_t>()[i] = static_cast<uint8_t>(100 + rng.below(51));
    else t.data_as<float>()[i] = static_cast<float>(rng.uniform(0.01, 4.0));
  }
  return t;
}

TEST(Fp8ScalesGpu, EveryScaledOpMatchesCpuBitwise) {
  REQUIRE_GPU();
  const Fp8Layout layouts[] = {Fp8Layout::kPerRow1D, Fp8Layout::kPerRow2D, Fp8Layout::kBlock128, Fp8Layout::kMx};
  for (DType dt : {DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kBFloat16}) {
    for (Fp8Layout l : layouts) {
      for (int64_t H : {int64_t{200}, int64_t{7168}, int64_t{0}}) {
        SCOPED_TRACE(std::string(dname(dt)) + " layout " + std::to_string(static_cast<int>(l)) +
                     " H=" + std::to_string(H));
        const int64_t T = 333;
        const int K = 4, E = 9, m = 32;
        const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 71 + H);
        const ref::Plan p = ref::make_plan(te, T, K, E, m);
        const int64_t rows = p.capacity + 3;
        Rng rng(5 + H);
        const Tensor hx = rows_from_float(random_values(T * H, dt, rng, -300.0, 300.0), dt, T, H);
        const Tensor hs = fp8_random_scales(l, T, H, rng);
        const Tensor dx = to_gpu(hx), ds = to_gpu(hs);
        const Tensor hte = index_matrix(te, T, K, DType::kInt32);
        const padmoe::Plan cplan = padmoe::make_plan(hte, E, m);
        GpuPlan gp = gpu_plan_buffers(T, K, E, m);
        padmoe::make_plan_out(to_gpu(hte), E, m, gp.view);
        const IndexInputs hi = index_inputs(p, DType::kInt64);
        const Tensor di = to_gpu(hi.indices), db = to_gpu(hi.bin_ids), dbins = to_gpu(hi.bins),
                     dpb = to_gpu(hi.padded_bins);
        for (int variant = 0; variant < 4; ++variant) {
          padmoe::Options o;
          o.zero_padding = variant != 1;
          o.zero_tail = variant == 2;
          o.check_data = variant != 3;
          SCOPED_TRACE("variant " + std::to_string(variant));
          Tensor cy = poison_rows(dt, rows, H), cs = fp8_poison_scales(l, rows, H);
          padmoe::dispatch_scaled_out(hx, cplan.view(), hs, cy, cs, o);
          // the default, the block spread, a warp a token
          for (const std::optional<pol::SpreadKernel> spread :
               {std::optional<pol::SpreadKernel>(), std::optional<pol::SpreadKernel>(pol::SpreadKernel::kBlock),
                std::optional<pol::SpreadKernel>(pol::SpreadKernel::kWarp)}) {
            SCOPED_TRACE("spread " + std::string(!spread                               ? "default"
                                                 : *spread == pol::SpreadKernel::kWarp ? "warp"
                                                                                       : "block"));
            kernel_overrides().spread = spread;
            Tensor gy = gpu_poison_rows(dt, rows, H), gs = to_gpu(fp8_poison_scales(l, rows, H));
            padmoe::dispatch_scaled_out(dx, gp.view, ds, gy, gs, o);
            EXPECT_TRUE(all_same(to_cpu(gy), cy)) << "dispatch rows";
            EXPECT_TRUE(all_same(to_cpu(gs), cs)) << "dispatch scales";
            Tensor ggy = gpu_poison_rows(dt, rows, H), ggs = to_gpu(fp8_poison_scales(l, rows, H));
            padmoe::padded_gather_scaled_out(dx, di, db, dbins, dpb, K, ds, ggy, ggs, o);
            EXPECT_TRUE(all_same(to_cpu(ggy), cy)) << "padded_gather rows";
            EXPECT_TRUE(all_same(to_cpu(ggs), cs)) << "padded_gather scales";
          }
          kernel_overrides().spread.reset();

          // pad the expert-grouped rows, then unpad them (every other map entry dropped: unnamed rows)
          std::vector<float> hf;
          const std::vector<float> xf = rows_to_float(hx);
          Tensor grouped_s = fp8_poison_scales(l, T * K, H);
          const int64_t srow =
              static_cast<int64_t>(grouped_s.numel() / std::max<int64_t>(T * K, 1)) * esize(grouped_s.dtype());
          for (int64_t i = 0; i < T * K; ++i) {
            const int64_t t = p.indices[static_cast<size_t>(i)] / K;
            hf.insert(hf.end(), xf.begin() + t * H, xf.begin() + (t + 1) * H);
            std::memcpy(static_cast<char*>(grouped_s.data()) + i * srow, static_cast<const char*>(hs.data()) + t * srow,
                        static_cast<size_t>(srow));
          }
          const Tensor hh = rows_from_float(hf, dt, T * K, H);
          const Tensor tpe = index_tensor(p.tokens_per_expert, DType::kInt32);
          const int64_t prow = p.padded_rows + 5;
          Tensor cp = poison_rows(dt, prow, H), cps = fp8_poison_scales(l, prow, H), cm = poison_index(prow),
                 co = poison_index(E);
          padmoe::pad_to_alignment_scaled_out(hh, tpe, m, grouped_s, cp, cps, cm, co, o);
          Tensor gpd = gpu_poison_rows(dt, prow, H), gps = to_gpu(fp8_poison_scales(l, prow, H)),
                 gm = gpu_poison_index(prow), go = gpu_poison_index(E);
          padmoe::pad_to_alignment_scaled_out(to_gpu(hh), to_gpu(tpe), m, to_gpu(grouped_s), gpd, gps, gm, go, o);
          EXPECT_TRUE(all_same(to_cpu(gpd), cp)) << "pad rows";
          EXPECT_TRUE(all_same(to_cpu(gps), cps)) << "pad scales";
          EXPECT_TRUE(all_same(to_cpu(gm), cm)) << "pad map";
          std::vector<int64_t> map = index_to_vec(cm);
          for (size_t i = 0; i < map.size(); i += 2) map[i] = -1;
          const Tensor hmap = index_tensor(map, DType::kInt32);
          const Tensor src_rows = rows_from_float(random_values(prow * H, dt, rng), dt, prow, H);
          const Tensor src_scales = fp8_random_scales(l, prow, H, rng);
          Tensor cu = poison_rows(dt, T * K, H), cus = fp8_poison_scales(l, T * K, H);
          padmoe::unpad_from_alignment_scaled_out(src_rows, hmap, src_scales, cu, cus, o);
          Tensor gu = gpu_poison_rows(dt, T * K, H), gus = to_gpu(fp8_poison_scales(l, T * K, H));
          padmoe::unpad_from_alignment_scaled_out(to_gpu(src_rows), to_gpu(hmap), to_gpu(src_scales), gu, gus, o);
          EXPECT_TRUE(all_same(to_cpu(gu), cu)) << "unpad rows";
          EXPECT_TRUE(all_same(to_cpu(gus), cus)) << "unpad scales";
        }
        // allocating forms (P rows)
        const padmoe::ScaledRows c = padmoe::dispatch_scaled(hx, cplan.view(), hs);
        const padmoe::ScaledRows g = padmoe::dispatch_scaled(dx, gp.view, ds);
        EXPECT_TRUE(all_same(to_cpu(g.rows), c.rows));
        EXPECT_TRUE(all_same(to_cpu(g.scales), c.scales));
      }
    }
  }
}

TEST(Fp8ScalesGpu, ShapeErrorsWriteNothing) {
  REQUIRE_GPU();
  const int64_t T = 40, H = 200;
  const int K = 2, E = 4, m = 8;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kUniform, 81);
  const ref::Plan p = ref::make_plan(te, T, K, E, m);
  const padmoe::Plan gplan = padmoe::make_plan(to_gpu(index_matrix(te, T, K, DType::kInt32)), E, m);
  const Tensor dx = gpu_poison_rows(DType::kFloat8E4M3, T, H);
  Tensor gy = gpu_poison_rows(DType::kFloat8E4M3, p.capacity, H);
  Tensor gs = to_gpu(fp8_poison_scales(Fp8Layout::kMx, p.capacity, H));
  const Tensor bad_cols = to_gpu(fp8_poison_scales(Fp8Layout::kMx, T, 100));  // ceil(100/32) = 4 columns, H needs 7
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_scaled_out(dx, gplan.view(), bad_cols, gy, gs); },
                           {"dispatch", "x_scales", "ceil(H/32)"}));
  const Tensor host_scales = fp8_poison_scales(Fp8Layout::kMx, T, H);  // on the CPU
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_scaled_out(dx, gplan.view(), host_scales, gy, gs); },
                           {"dispatch", "x_scales", "cuda:0"}));
  EXPECT_TRUE(all_bytes_are(to_cpu(gy), kPoison));
  EXPECT_TRUE(bytes_are(to_cpu(gs), 0, p.capacity, kPoison));
}

}  // namespace
}  // namespace pt

// The fused quantizing dispatch (ops.hpp section 4) on the GPU: dispatch_quantized and
// quantize, every scale layout x bf16 / f16 / f32 rows x e4m3 / e5m2, widths with partial blocks and
// unaligned rows, values with all-zero, tiny, huge, tied, saturating and NaN / inf blocks; bitwise equal
// to the CPU backend (codes, scales, padding rows, the poison past P) and to the reference quantizer,
// under zero_padding / zero_tail / unchecked mode, top_k past the kernel's staging group (70), and a bad
// output dtype / layout written nowhere.
namespace pt {
namespace {

std::vector<float> quant_values(int64_t T, int64_t H, DType dt, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < H; ++c) {
      const int64_t kind = (t * 5 + c / 32 + static_cast<int64_t>(seed)) % 8;
      float x = static_cast<float>(rng.uniform(-3.0, 3.0));
      if (kind == 1) x = 0.0f;                                                 // all-zero block
      if (kind == 2) x *= dt == DType::kFloat16 ? 1e-6f : 1e-38f;               // tiny
      if (kind == 3) x *= dt == DType::kFloat16 ? 20000.0f : 1e37f;             // huge
      if (kind == 4) x = (c % 32 == 0) ? 448.0f : 1.0625f + 0.125f * static_cast<float>(rng.below(8));  // e4m3 ties
      if (kind == 5 && c % 32 == 0) x = 1.96875f * 4096.0f;                    // saturating MX block
      if (kind == 6 && c % 32 == 7) x = NAN;
      if (kind == 7 && c % 32 == 9) x = INFINITY;
      v[static_cast<size_t>(t * H + c)] = num::round_to(dt, x);
    }
  }
  return v;
}

Tensor quant_poison_scales(padmoe::ScaleLayout l, int64_t rows, int64_t H) {
  if (l == padmoe::ScaleLayout::kPerRow) return filled(DType::kFloat32, {rows}, kPoison);
  return filled(l == padmoe::ScaleLayout::kMxE8M0 ? DType::kUInt8 : DType::kFloat32,
                {rows, padmoe::scale_columns(l, H)}, kPoison);
}

std::vector<uint8_t> quant_bytes(const TensorView& t) {
  const auto* p = static_cast<const uint8_t*>(t.data);
  return std::vector<uint8_t>(p, p + nbytes(t));
}

TEST(QuantDispatchGpu, MatchesCpuAndReferenceBitwise) {
  REQUIRE_GPU();
  using padmoe::ScaleLayout;
  const ScaleLayout layouts[] = {ScaleLayout::kBlock128, ScaleLayout::kMxE8M0, ScaleLayout::kPerRow};
  for (ScaleLayout l : layouts) {
    for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
        for (int64_t H : {int64_t{1}, int64_t{31}, int64_t{200}, int64_t{2100}, int64_t{7168}, int64_t{0}}) {
          for (int K : {4, 70}) {
            if (K == 70 && H > 200) continue;
            SCOPED_TRACE(std::string(dname(dt)) + " -> " + dname(out) + " layout " +
                         std::to_string(static_cast<int>(l)) + " H=" + std::to_string(H) + " K=" + std::to_string(K));
            const int64_t T = H >= 2048 ? 97 : 333;
            const int E = 9, m = 32;
            const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 71 + H + K);
            const ref::Plan p = ref::make_plan(te, T, K, E, m);
            const int64_t rows = p.capacity + 3;
            const std::vector<float> xf = quant_values(T, H, dt, 9 + H);
            const Tensor hx = rows_from_float(xf, dt, T, H), dx = to_gpu(hx);
            const Tensor hte = index_matrix(te, T, K, DType::kInt32);
            const padmoe::Plan cplan = padmoe::make_plan(hte, E, m);
            GpuPlan gp = gpu_plan_buffers(T, K, E, m);
            padmoe::make_plan_out(to_gpu(hte), E, m, gp.view);
            const ref::QuantRows want = ref::dispatch_quantized(
                xf, H, p, static_cast<ref::QuantLayout>(static_cast<int>(l)), out == DType::kFloat8E5M2);
            // 0 the defaults, 1 zero_padding off, 2 zero_tail, 3 unchecked (T = 97 at H = 2100 and
            // 7168: the row's steps in blocks of their own, policy::quant_slices)
            for (int variant = 0; variant < 4; ++variant) {
              padmoe::Options o;
              o.zero_padding = variant != 1;
              o.zero_tail = variant == 2;
              o.check_data = variant != 3;
              SCOPED_TRACE("variant " + std::to_string(variant));
              Tensor cy = poison_rows(out, rows, H), cs = quant_poison_scales(l, rows, H);
              padmoe::dispatch_quantized_out(hx, cplan.view(), cy, cs, o);
              Tensor gy = gpu_poison_rows(out, rows, H), gs = to_gpu(quant_poison_scales(l, rows, H));
              padmoe::dispatch_quantized_out(dx, gp.view, gy, gs, o);
              EXPECT_TRUE(all_same(to_cpu(gy), cy)) << "codes";
              EXPECT_TRUE(all_same(to_cpu(gs), cs)) << "scales";
              if (variant == 0) {  // and the reference, rows [0, P)
                const std::vector<uint8_t> got = quant_bytes(to_cpu(gy)), gots = quant_bytes(to_cpu(gs));
                EXPECT_TRUE(std::equal(want.rows.begin(), want.rows.end(), got.begin())) << "codes vs reference";
                EXPECT_TRUE(std::equal(want.scales.begin(), want.scales.end(), gots.begin())) << "scales vs reference";
              }
            }
            // allocating forms, and quantize alone
            const padmoe::ScaledRows c = padmoe::dispatch_quantized(hx, cplan.view(), l, out);
            const padmoe::ScaledRows g = padmoe::dispatch_quantized(dx, gp.view, l, out);
            EXPECT_TRUE(all_same(to_cpu(g.rows), c.rows));
            EXPECT_TRUE(all_same(to_cpu(g.scales), c.scales));
            const padmoe::ScaledRows cq = padmoe::quantize(hx, l, out);
            const padmoe::ScaledRows gq = padmoe::quantize(dx, l, out);
            EXPECT_TRUE(all_same(to_cpu(gq.rows), cq.rows));
            EXPECT_TRUE(all_same(to_cpu(gq.scales), cq.scales));
          }
        }
      }
    }
  }
}

TEST(QuantDispatchGpu, HardwareConversionMatchesSoftwareOnEveryFloat) {
  REQUIRE_GPU();
  // cvt.rn.satfinite against quant::fp8_saturate (the CPU's conversion) on all 2^32 - 2^24 non-NaN
  // float32 patterns: infinities, float32 subnormals, fp8 subnormals, ties and saturation included.
  for (bool e5m2 : {false, true}) {
    uint32_t first = 0;
    int64_t compared = 0;
    const int64_t n = padmoe::cuda::fp8_convert_mismatches(e5m2, &first, &compared);
    EXPECT_EQ(n, 0) << (e5m2 ? "e5m2" : "e4m3fn") << ": first mismatch at float32 bits 0x" << std::hex << first;
    EXPECT_EQ(compared, (int64_t{1} << 32) - 2 * ((int64_t{1} << 23) - 1));  // every pattern but the NaNs
  }
}

TEST(QuantDispatchGpu, UnalignedRowsMatchCpu) {
  REQUIRE_GPU();
  // x a column slice (row stride 203 elements: rows not 16-byte aligned), y with an odd row stride
  const int64_t T = 150, H = 130, xs = 203, ys_stride = 133;
  const int K = 3, E = 5, m = 16;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kUniform, 17);
  const ref::Plan p = ref::make_plan(te, T, K, E, m);
  const std::vector<float> wide = quant_values(T, xs, DType::kBFloat16, 3);
  const Tensor hw = rows_from_float(wide, DType::kBFloat16, T, xs), dw = to_gpu(hw);
  const TensorView hx = TensorView::matrix(hw.data(), DType::kBFloat16, T, H, xs);
  const TensorView dx = TensorView::matrix(dw.data(), DType::kBFloat16, T, H, xs, kGpu);
  const Tensor hte = index_matrix(te, T, K, DType::kInt32);
  const padmoe::Plan cplan = padmoe::make_plan(hte, E, m);
  const padmoe::Plan gplan = padmoe::make_plan(to_gpu(hte), E, m);
  for (padmoe::ScaleLayout l : {padmoe::ScaleLayout::kBlock128, padmoe::ScaleLayout::kMxE8M0}) {
    const int64_t rows = p.capacity;
    Tensor cyb = poison_rows(DType::kFloat8E4M3, rows, ys_stride),
           gyb = gpu_poison_rows(DType::kFloat8E4M3, rows, ys_stride);
    const TensorView cy = TensorView::matrix(cyb.data(), DType::kFloat8E4M3, rows, H, ys_stride);
    const TensorView gy = TensorView::matrix(gyb.data(), DType::kFloat8E4M3, rows, H, ys_stride, kGpu);
    Tensor cs = quant_poison_scales(l, rows, H), gs = to_gpu(quant_poison_scales(l, rows, H));
    padmoe::dispatch_quantized_out(hx, cplan.view(), cy, cs);
    padmoe::dispatch_quantized_out(dx, gplan.view(), gy, gs);
    EXPECT_TRUE(all_same(to_cpu(gyb), cyb));
    EXPECT_TRUE(all_same(to_cpu(gs), cs));
  }
}

TEST(QuantDispatchGpu, ShapeErrorsWriteNothing) {
  REQUIRE_GPU();
  const int64_t T = 40, H = 200;
  const int K = 2, E = 4, m = 8;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kUniform, 81);
  const ref::Plan p = ref::make_plan(te, T, K, E, m);
  const padmoe::Plan gplan = padmoe::make_plan(to_gpu(index_matrix(te, T, K, DType::kInt32)), E, m);
  const Tensor dx = gpu_poison_rows(DType::kBFloat16, T, H);
  Tensor gy = gpu_poison_rows(DType::kFloat8E4M3, p.capacity, H);
  Tensor gs = to_gpu(quant_poison_scales(padmoe::ScaleLayout::kMxE8M0, p.capacity, H));
  const Tensor bad_cols = to_gpu(quant_poison_scales(padmoe::ScaleLayout::kMxE8M0, p.capacity, 100));
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_quantized_out(dx, gplan.view(), gy, bad_cols); },
                           {"dispatch_quantized", "y_scales", "ceil(H/32)"}));
  Tensor gb = gpu_poison_rows(DType::kBFloat16, p.capacity, H);
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_quantized_out(dx, gplan.view(), gb, gs); },
                           {"dispatch_quantized", "y", "float8_e4m3 or float8_e5m2"}));
  const Tensor host_scales = quant_poison_scales(padmoe::ScaleLayout::kMxE8M0, p.capacity, H);
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_quantized_out(dx, gplan.view(), gy, host_scales); },
                           {"dispatch_quantized", "y_scales", "cuda:0"}));
  EXPECT_TRUE(all_bytes_are(to_cpu(gy), kPoison));
  EXPECT_TRUE(all_bytes_are(to_cpu(gs), kPoison));
  EXPECT_TRUE(all_bytes_are(to_cpu(gb), kPoison));
}

// ---------------------------------------------------------------------------
// L2 prefetch before the wait (common.cuh: l2_prefetch). A kernel may ask L2 for its rows before
// its pdl_wait, while the kernel ahead of it may still be writing them: here every prefetched row
// was written by the launch just before (dispatch and the quantizing dispatch of combine's
// output, sort_chunks of it, pad of the second dispatch's rows), PDL on, no host synchronization
// in the chain. The prefetch off, by the default rule and at every size: the same bits, and the
// CPU's.
// ---------------------------------------------------------------------------
TEST(L2Prefetch, OpsOnRowsJustWrittenMatchOffAndCpu) {
  REQUIRE_GPU();
  const int64_t T = 512, H = 1024;
  const int E = 32, K = 4, m = 16, R = 4;
  const int64_t A = T * K, cap = padmoe::capacity_bound(T, K, E, m), C = int64_t{R} * E;
  const DType dt = DType::kBFloat16;
  const padmoe::ScaleLayout ql = padmoe::ScaleLayout::kBlock128;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 57);
  Rng rng(58);
  const Tensor hte = index_matrix(te, T, K, DType::kInt32);
  const Tensor hx = rows_from_float(random_values(T * H, dt, rng), dt, T, H);
  const Tensor hw = vec_from_float(random_values(A, DType::kFloat32, rng, 0, 1), DType::kFloat32);
  std::vector<int64_t> sizes(static_cast<size_t>(C));
  for (auto& n : sizes) n = rng.below(5);  // at most 4 * C = T rows
  const Tensor hs = index_tensor(sizes, DType::kInt32);
  const int64_t scap = padmoe::sort_chunks_capacity(T, C, R, m);
  const Tensor dte = to_gpu(hte), dx = to_gpu(hx), dw = to_gpu(hw), ds = to_gpu(hs);

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  padmoe::Options o;
  o.stream = stream;
  o.check_data = false;

  auto chain = [&](int mode) {
    if (mode == 1) kernel_overrides().l2_prefetch.reset();
    else kernel_overrides().l2_prefetch = mode == 2;
    GpuPlan gp = gpu_plan_buffers(T, K, E, m);
    const Tensor y = gpu_poison_rows(dt, cap, H), out = gpu_poison_rows(dt, T, H), y2 = gpu_poison_rows(dt, cap, H);
    const Tensor q = gpu_poison_rows(DType::kFloat8E4M3, cap, H), qs = to_gpu(quant_poison_scales(ql, cap, H));
    const Tensor sp = gpu_poison_rows(dt, scap, H), smap = gpu_poison_index(scap), soff = gpu_poison_index(E);
    const Tensor padded = gpu_poison_rows(dt, cap, H), map = gpu_poison_index(cap), offs = gpu_poison_index(E);
    CUDA_OK(cudaDeviceSynchronize());  // the poison memsets ran on the legacy stream
    padmoe::make_plan_out(dte, E, m, gp.view, o);
    padmoe::dispatch_out(dx, gp.view, dw.view(), y, o);
    padmoe::combine_out(y, gp.view, dw.view(), out, o);
    padmoe::dispatch_out(out, gp.view, std::nullopt, y2, o);  // out: written by the launch before
    padmoe::dispatch_quantized_out(out, gp.view, q, qs, o);
    padmoe::sort_chunks_out(out, ds, R, m, std::nullopt, sp, smap, soff, o);
    padmoe::pad_to_alignment_out(y2, gp.tpe, m, padded, map, offs, o);  // y2's first A rows as grouped rows
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<Tensor> r;
    for (const Tensor* t : std::initializer_list<const Tensor*>{&y, &out, &y2, &q, &qs, &sp, &smap, &padded, &map})
      r.push_back(to_cpu(*t));
    return r;
  };
  kernel_overrides().pdl = true;
  const std::vector<Tensor> off = chain(0), rule = chain(1), all = chain(2);
  kernel_overrides().l2_prefetch.reset();
  kernel_overrides().pdl.reset();
  for (size_t i = 0; i < off.size(); ++i) {
    EXPECT_TRUE(all_same(off[i], rule[i])) << "output " << i << " differs with the default prefetch";
    EXPECT_TRUE(all_same(off[i], all[i])) << "output " << i << " differs with the prefetch at every size";
  }
  // the CPU's results (bitwise; rows [0, P) of the padded outputs)
  const padmoe::Plan cp = padmoe::make_plan(hte, E, m);
  const int64_t P = padmoe::padded_rows(cp);
  const Tensor cy = padmoe::dispatch(hx, cp.view(), hw.view());
  const Tensor cout = padmoe::combine(cy, cp.view(), hw.view());
  EXPECT_TRUE(all_same(all[1], cout)) << "combine vs CPU";
  const Tensor cy2 = padmoe::dispatch(cout, cp.view());
  EXPECT_TRUE(rows_same(all[2], cy2, 0, P)) << "dispatch of combine's output vs CPU";
  const padmoe::ScaledRows cq = padmoe::dispatch_quantized(cout, cp.view(), ql, DType::kFloat8E4M3);
  EXPECT_TRUE(rows_same(all[3], cq.rows, 0, P)) << "quantizing dispatch vs CPU";
  const padmoe::PadResult cs = padmoe::sort_chunks(cout, hs, R, m);
  const int64_t SP = cs.padded.size(0);
  EXPECT_TRUE(rows_same(all[5], cs.padded, 0, SP)) << "sort_chunks vs CPU";
  Tensor cpad = poison_rows(dt, cap, H), cmap = poison_index(cap), coff = poison_index(E);
  padmoe::Options co;
  co.check_data = false;
  padmoe::pad_to_alignment_out(all[2], cp.tokens_per_expert, m, cpad, cmap, coff, co);
  EXPECT_TRUE(all_same(all[7], cpad)) << "pad_to_alignment vs CPU";
  EXPECT_TRUE(all_same(all[8], cmap)) << "pad's map vs CPU";
  CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace pt

// ---- pad and unpad against the CPU and the reference -----------------------------
// pad_to_alignment at many expert counts (up to 1024), capacity rows past P, 1- and 2-byte words,
// and unchecked bad counts; unpad_from_alignment over partial maps (rows no entry names), int64
// maps, probs of each dtype and many rows a block. (Written for one-launch forms of both, which
// were measured on the H200 and removed.)
namespace pt {
namespace {

TEST(PadUnpadGpu, PadMatchesCpuAndReference) {
  REQUIRE_GPU();
  struct Cfg {
    int E, m;
    DType dt, cdt;
    int64_t H, extra;  // extra: capacity rows past P (left untouched)
  };
  const std::vector<Cfg> cfgs = {{8, 16, DType::kBFloat16, DType::kInt32, 256, 5},
                                 {256, 16, DType::kBFloat16, DType::kInt64, 64, 0},
                                 {1, 4, DType::kFloat32, DType::kInt32, 66, 3},
                                 {33, 8, DType::kFloat16, DType::kInt64, 35, 17},  // 2-byte words
                                 {70, 1, DType::kFloat8E4M3, DType::kInt32, 33, 2},  // 1-byte words
                                 {1024, 4, DType::kBFloat16, DType::kInt32, 8, 9}};  // E = the kernel's 1024
  for (const Cfg& cf : cfgs) {
    SCOPED_TRACE("E=" + std::to_string(cf.E) + " m=" + std::to_string(cf.m) + " " + dname(cf.dt) +
                 " H=" + std::to_string(cf.H));
    Rng rng(static_cast<uint64_t>(cf.E * 31 + cf.m));
    std::vector<int64_t> counts(static_cast<size_t>(cf.E));
    for (auto& n : counts) n = rng.below(4) == 0 ? 0 : rng.below(3 * cf.m + 5);
    const int64_t sum = std::accumulate(counts.begin(), counts.end(), int64_t{0}), N = sum + 3, H = cf.H;
    const std::vector<float> hf = random_values(N * H, cf.dt, rng);
    const Tensor hh = rows_from_float(hf, cf.dt, N, H), hc = index_tensor(counts, cf.cdt);
    const Tensor dh = to_gpu(hh), dc = to_gpu(hc);
    const ref::PadResult want = ref::pad_to_alignment(hf, H, counts, cf.m);
    const int64_t P = want.padded_rows, cap = P + cf.extra;
    {
      for (bool checked : {true, false}) {
        for (bool zero_padding : {true, false}) {
          SCOPED_TRACE(std::string(checked ? "checked" : "unchecked") + (zero_padding ? "" : " zero_padding off"));
          padmoe::Options o;
          o.check_data = checked;
          o.zero_padding = zero_padding;
          Tensor gpad = gpu_poison_rows(cf.dt, cap, H), gmap = gpu_poison_index(cap), goff = gpu_poison_index(cf.E);
          padmoe::pad_to_alignment_out(dh, dc, cf.m, gpad, gmap, goff, o);
          Tensor cpad = poison_rows(cf.dt, cap, H), cmap = poison_index(cap), coff = poison_index(cf.E);
          padmoe::pad_to_alignment_out(hh, hc, cf.m, cpad, cmap, coff, o);
          const Tensor hpad = to_cpu(gpad);
          EXPECT_TRUE(all_same(hpad, cpad)) << "padded";
          EXPECT_TRUE(all_same(to_cpu(gmap), cmap)) << "permutation_map";
          EXPECT_TRUE(all_same(to_cpu(goff), coff)) << "inclusive_offsets";
          if (zero_padding) EXPECT_TRUE(rows_bitwise(hpad, want.padded, P));
          EXPECT_TRUE(bytes_are(hpad, P, cap, kPoison)) << "rows past P";
          const std::vector<int64_t> gm = index_to_vec(to_cpu(gmap));
          for (int64_t p = 0; p < cap; ++p) {
            ASSERT_EQ(gm[static_cast<size_t>(p)], p < P ? want.permutation_map[static_cast<size_t>(p)] : -1)
                << "map " << p;
          }
          EXPECT_EQ(index_to_vec(to_cpu(goff)), want.inclusive_offsets);
        }
      }
    }
    const padmoe::PadResult cpu = padmoe::pad_to_alignment(hh, hc, cf.m);
    const padmoe::PadResult gpu = padmoe::pad_to_alignment(dh, dc, cf.m);
    EXPECT_TRUE(all_same(to_cpu(gpu.padded), cpu.padded)) << "allocating form";
    EXPECT_TRUE(all_same(to_cpu(gpu.permutation_map), cpu.permutation_map));
  }
  // bad counts in unchecked mode (a negative entry, one past the rows, a sum past the rows): no
  // write outside the outputs (memcheck), the same bytes twice
  const int64_t N = 40, H = 64, E = 6, cap = 96;
  const Tensor dh = to_gpu(rows_from_float(std::vector<float>(N * H, 1.5f), DType::kBFloat16, N, H));
  const Tensor dc = to_gpu(index_tensor({5, -3, 60, 7, 30, 2}, DType::kInt64));
  padmoe::Options o;
  o.check_data = false;
  std::vector<Tensor> runs;
  for (int i = 0; i < 2; ++i) {
    Tensor gpad = gpu_poison_rows(DType::kBFloat16, cap, H), gmap = gpu_poison_index(cap), goff = gpu_poison_index(E);
    padmoe::pad_to_alignment_out(dh, dc, 8, gpad, gmap, goff, o);
    runs.push_back(to_cpu(gpad));
    runs.push_back(to_cpu(gmap));
  }
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(all_same(runs[0], runs[2]));
  EXPECT_TRUE(all_same(runs[1], runs[3]));
  for (int64_t v : index_to_vec(runs[1])) EXPECT_TRUE(v >= -1 && v < N) << v;
}

// A map naming k of the N rows from k distinct positions of P (the rest -1).
std::vector<int64_t> partial_map(int64_t P, int64_t N, int64_t k, Rng& rng) {
  std::vector<int64_t> pos(static_cast<size_t>(P)), rows(static_cast<size_t>(N)), map(static_cast<size_t>(P), -1);
  std::iota(pos.begin(), pos.end(), int64_t{0});
  std::iota(rows.begin(), rows.end(), int64_t{0});
  for (int64_t i = P - 1; i > 0; --i)
    std::swap(pos[static_cast<size_t>(i)], pos[static_cast<size_t>(rng.below(i + 1))]);
  for (int64_t i = N - 1; i > 0; --i)
    std::swap(rows[static_cast<size_t>(i)], rows[static_cast<size_t>(rng.below(i + 1))]);
  for (int64_t i = 0; i < k; ++i) map[static_cast<size_t>(pos[static_cast<size_t>(i)])] = rows[static_cast<size_t>(i)];
  return map;
}

TEST(PadUnpadGpu, UnpadMatchesCpuAndReference) {
  REQUIRE_GPU();
  struct Cfg {
    int64_t N, P, H;
    DType dt, mdt, pdt;  // pdt: probs' dtype (kInt32: no probs)
    int64_t named;       // rows the map names (N: all)
  };
  const std::vector<Cfg> cfgs = {
      {300, 500, 256, DType::kBFloat16, DType::kInt32, DType::kFloat32, 300},
      {2048, 4128, 128, DType::kBFloat16, DType::kInt32, DType::kInt32, 2048},  // decode's sizes, short rows
      {20000, 16000, 8, DType::kFloat32, DType::kInt64, DType::kFloat32, 15000},  // many rows a block
      {77, 130, 35, DType::kBFloat16, DType::kInt64, DType::kBFloat16, 60},  // 2-byte elements, not 16-byte rows
      {50, 64, 33, DType::kFloat8E4M3, DType::kInt32, DType::kInt32, 50},
      {1000, 1200, 66, DType::kFloat16, DType::kInt32, DType::kFloat16, 999},
      {5, 9, 16, DType::kFloat32, DType::kInt32, DType::kFloat32, 0}};  // names no row: all zero
  for (const Cfg& cf : cfgs) {
    SCOPED_TRACE("N=" + std::to_string(cf.N) + " P=" + std::to_string(cf.P) + " H=" + std::to_string(cf.H) + " " +
                 dname(cf.dt));
    Rng rng(static_cast<uint64_t>(cf.N * 7 + cf.P));
    const int64_t N = cf.N, P = cf.P, H = cf.H;
    const std::vector<int64_t> map = partial_map(P, N, cf.named, rng);
    const std::vector<float> pf = random_values(P * H, cf.dt, rng);
    const bool with_probs = cf.pdt != DType::kInt32;
    const std::vector<float> prf = random_values(N, with_probs ? cf.pdt : DType::kFloat32, rng, 0.0, 1.0);
    const Tensor hp = rows_from_float(pf, cf.dt, P, H), hm = index_tensor(map, cf.mdt);
    const Tensor hpr = vec_from_float(prf, with_probs ? cf.pdt : DType::kFloat32);
    const Tensor dp = to_gpu(hp), dm = to_gpu(hm), dpr = to_gpu(hpr);
    const std::optional<TensorView> cprobs = with_probs ? std::optional<TensorView>(hpr.view()) : std::nullopt;
    const std::optional<TensorView> gprobs = with_probs ? std::optional<TensorView>(dpr.view()) : std::nullopt;
    const std::vector<float> want = ref::unpad_from_alignment(pf, H, map, N, with_probs ? &prf : nullptr);
    const Tensor cu = padmoe::unpad_from_alignment(hp, hm, N, cprobs);
    ASSERT_TRUE(rows_bitwise(cu, want, N)) << "CPU";
    for (bool checked : {true, false}) {
      SCOPED_TRACE(checked ? "checked" : "unchecked");
      padmoe::Options o;
      o.check_data = checked;
      Tensor gu = gpu_poison_rows(cf.dt, N, H);
      padmoe::unpad_from_alignment_out(dp, dm, gprobs, gu, o);
      const Tensor ga = padmoe::unpad_from_alignment(dp, dm, N, gprobs, o);
      EXPECT_TRUE(all_same(to_cpu(gu), cu)) << "out form";
      EXPECT_TRUE(all_same(to_cpu(ga), cu)) << "allocating form";
    }
  }
  // bad entries in unchecked mode (below -1, past N, past int32) name no row: in bounds, the same
  // bytes as the plain-loop rule
  const int64_t N = 24, P = 40, H = 32;
  Rng rng(99);
  std::vector<int64_t> map = partial_map(P, N, 20, rng);
  map[11] = -9, map[12] = N + 4, map[13] = (int64_t{1} << 40), map[14] = -(int64_t{1} << 40);
  const std::vector<float> pf = random_values(P * H, DType::kBFloat16, rng);
  std::vector<float> want(static_cast<size_t>(N * H), 0.0f);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t n = map[static_cast<size_t>(p)];
    if (n < 0 || n >= N) continue;
    for (int64_t x = 0; x < H; ++x) want[static_cast<size_t>(n * H + x)] = pf[static_cast<size_t>(p * H + x)];
  }
  const Tensor dp = to_gpu(rows_from_float(pf, DType::kBFloat16, P, H)), dm = to_gpu(index_tensor(map, DType::kInt64));
  padmoe::Options o;
  o.check_data = false;
  Tensor gu = gpu_poison_rows(DType::kBFloat16, N, H);
  padmoe::unpad_from_alignment_out(dp, dm, std::nullopt, gu, o);
  EXPECT_TRUE(rows_bitwise(to_cpu(gu), want, N));
  CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace pt
