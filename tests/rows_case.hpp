// rows_case.hpp — one MegaBlocks-family case (padded_gather, padded_scatter,
// padded_scatter_wgrad) run through the library and compared with the
// reference: gather bitwise (including weighted gather: the float32 product,
// cast once), scatter and wgrad within the tolerance stated in test_util.hpp.
// Large cases are compared in column chunks so the reference never
// materializes a [P, H] float / [T, H] double buffer of the whole problem.
#pragma once

#include <optional>

#include "test_util.hpp"

namespace pt {

struct RowsCase {
  int64_t T = 16;
  int64_t H = 8;
  int E = 4;
  int K = 2;
  int m = 8;
  DType dtype = DType::kFloat32;
  DType idx = DType::kInt32;
  DType wdtype = DType::kFloat32;  // weights: float32 or the row dtype
  bool gather_weighted = false;
  bool scatter_weighted = true;
  Dist dist = Dist::kUniform;
  uint64_t seed = 1;
  int64_t extra_rows = 3;  // caller-provided gather output has P + extra_rows rows
  bool gather = true, scatter = true, wgrad = true;
  bool check_alloc = true;  // also run the allocating forms and compare with _out
  int num_threads = 0;
  const std::vector<int64_t>* routing = nullptr;  // explicit top_experts [T*K] (overrides dist)
};

inline std::string describe(const RowsCase& c) {
  std::ostringstream os;
  os << "T=" << c.T << " H=" << c.H << " E=" << c.E << " K=" << c.K << " m=" << c.m << " " << dname(c.dtype)
     << " idx=" << dname(c.idx) << " w=" << dname(c.wdtype) << " gw=" << c.gather_weighted
     << " sw=" << c.scatter_weighted << " seed=" << c.seed;
  return os.str();
}

inline Tensor random_rows(DType dtype, int64_t rows, int64_t cols, Rng& rng) {
  Tensor t = Tensor::empty(dtype, {rows, cols});
  for (int64_t i = 0; i < rows * cols; ++i)
    num::store_from_float(t.data(), dtype, i, static_cast<float>(rng.uniform()));
  return t;
}

inline int64_t chunk_width(int64_t H, int64_t rows) {
  const int64_t budget = int64_t{1} << 22;  // floats per chunk buffer
  return std::max<int64_t>(1, std::min<int64_t>(H, budget / std::max<int64_t>(rows, 1)));
}

inline void run_rows_case(const RowsCase& c) {
  SCOPED_TRACE(describe(c));
  const int64_t T = c.T, H = c.H, A = T * c.K;
  const std::vector<int64_t> te = c.routing ? *c.routing : make_routing(T, c.K, c.E, c.dist, c.seed);
  const ref::Plan p = ref::make_plan(te, T, c.K, c.E, c.m);
  const int64_t P = p.padded_rows;
  Rng rng(c.seed * 31 + 17);
  padmoe::Options opt;
  opt.num_threads = c.num_threads;

  const std::vector<float> wf = random_values(A, c.wdtype, rng, 0.0, 1.0);
  const Tensor w = vec_from_float(wf, c.wdtype);
  const IndexInputs ii = index_inputs(p, c.idx);

  if (c.gather) {
    const Tensor x = random_rows(c.dtype, T, H, rng);
    std::optional<TensorView> wopt;
    if (c.gather_weighted) wopt = w.view();
    Tensor y = poison_rows(c.dtype, P + c.extra_rows, H);
    padmoe::padded_gather_out(x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, c.K, wopt, y, opt);
    const int64_t cw = chunk_width(H, std::max(P, T));
    for (int64_t c0 = 0; c0 < H; c0 += cw) {
      const int64_t w1 = std::min(H, c0 + cw) - c0;
      const std::vector<float> xf = rows_to_float(x, c0, c0 + w1);
      const std::vector<float> yr = ref::padded_gather(xf, w1, p, c.gather_weighted ? &wf : nullptr);
      ASSERT_TRUE(rows_bitwise(y, yr, P, c0, w1)) << "padded_gather rows, columns from " << c0;
    }
    EXPECT_TRUE(bytes_are(y, P, P + c.extra_rows, kPoison)) << "padded_gather wrote past P";
    if (c.check_alloc) {
      const Tensor y2 = padmoe::padded_gather(x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, c.K, wopt, opt);
      ASSERT_EQ(y2.ndim(), 2);
      ASSERT_EQ(y2.size(0), P);
      ASSERT_EQ(y2.size(1), H);
      ASSERT_EQ(y2.dtype(), c.dtype);
      EXPECT_TRUE(P * H == 0 || std::memcmp(y2.data(), y.data(), static_cast<size_t>(P * H) * esize(c.dtype)) == 0)
          << "allocating padded_gather differs from padded_gather_out";
    }
  }

  if (c.scatter || c.wgrad) {
    // y: real rows random, padding rows poison (NaN) — the ops must never read them.
    Tensor yin = poison_rows(c.dtype, P, H);
    for (int64_t r = 0; r < P; ++r)
      if (p.row_sources[static_cast<size_t>(r)] >= 0)
        for (int64_t h = 0; h < H; ++h)
          num::store_from_float(yin.data(), c.dtype, r * H + h, static_cast<float>(rng.uniform()));
    const int64_t cw = chunk_width(H, std::max(P, T));

    if (c.scatter) {
      std::optional<TensorView> wopt;
      if (c.scatter_weighted) wopt = w.view();
      Tensor out = poison_rows(c.dtype, T, H);
      padmoe::padded_scatter_out(yin, ii.indices, ii.bin_ids, wopt, ii.bins, ii.padded_bins, c.K, out, opt);
      const std::vector<float> awf = abs_of(wf);
      for (int64_t c0 = 0; c0 < H; c0 += cw) {
        const int64_t w1 = std::min(H, c0 + cw) - c0;
        const std::vector<float> yf = rows_to_float(yin, c0, c0 + w1);
        const std::vector<double> r = ref::padded_scatter(yf, w1, p, c.scatter_weighted ? &wf : nullptr);
        const std::vector<double> ra = ref::padded_scatter(abs_of(yf), w1, p, c.scatter_weighted ? &awf : nullptr);
        ASSERT_TRUE(sums_close(out, r, ra, c.K, T, c0, w1)) << "padded_scatter, columns from " << c0;
      }
      if (c.check_alloc) {
        const Tensor out2 =
            padmoe::padded_scatter(yin, ii.indices, ii.bin_ids, wopt, ii.bins, ii.padded_bins, c.K, opt);
        ASSERT_EQ(out2.ndim(), 2);
        ASSERT_EQ(out2.size(0), T);
        ASSERT_EQ(out2.size(1), H);
        EXPECT_TRUE(same_bytes(out2, out)) << "allocating padded_scatter differs from padded_scatter_out";
      }
    }

    if (c.wgrad) {
      const Tensor grad = random_rows(c.dtype, T, H, rng);
      Tensor wg32 = filled(DType::kFloat32, {A}, kPoison);
      padmoe::padded_scatter_wgrad_out(yin, grad, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, c.K, wg32, opt);
      std::vector<double> r(static_cast<size_t>(A), 0.0), ra(static_cast<size_t>(A), 0.0);
      for (int64_t c0 = 0; c0 < H; c0 += cw) {
        const int64_t w1 = std::min(H, c0 + cw) - c0;
        const std::vector<float> yf = rows_to_float(yin, c0, c0 + w1);
        const std::vector<float> gf = rows_to_float(grad, c0, c0 + w1);
        const std::vector<double> rc = ref::padded_scatter_wgrad(yf, gf, w1, p);
        const std::vector<double> rac = ref::padded_scatter_wgrad(abs_of(yf), abs_of(gf), w1, p);
        for (int64_t a = 0; a < A; ++a) {
          r[static_cast<size_t>(a)] += rc[static_cast<size_t>(a)];
          ra[static_cast<size_t>(a)] += rac[static_cast<size_t>(a)];
        }
      }
      EXPECT_TRUE(sums_close(wg32, r, ra, H, A)) << "padded_scatter_wgrad_out (float32)";
      if (c.check_alloc) {
        const Tensor wg =
            padmoe::padded_scatter_wgrad(yin, grad, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, c.K, opt);
        ASSERT_EQ(wg.numel(), A);
        EXPECT_EQ(wg.dtype(), c.dtype) << "allocating wgrad returns y's dtype (as MegaBlocks)";
        EXPECT_TRUE(sums_close(wg, r, ra, H, A)) << "padded_scatter_wgrad (allocating)";
      }
    }
  }
}

}  // namespace pt
