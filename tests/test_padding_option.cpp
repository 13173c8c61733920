// test_padding_option.cpp — Options::zero_padding = false: the forward spreads
// (padded_gather, dispatch, pad_to_alignment) leave padding rows unwritten (their poison stays), write
// every real row as the reference does, and the backward outputs still zero their padding rows.
#include "test_util.hpp"

namespace pt {
namespace {

struct PadCase {
  int64_t T = 37, H = 24;
  int K = 2, E = 5, m = 8;
  std::vector<int64_t> te;
  ref::Plan p;
  std::vector<float> xf;
  Tensor x, top;
};

PadCase make_setup(DType dt) {
  PadCase s;
  s.te = make_routing(s.T, s.K, s.E, Dist::kSkewed, 17);
  s.p = ref::make_plan(s.te, s.T, s.K, s.E, s.m);
  Rng rng(5);
  s.xf = random_values(s.T * s.H, dt, rng);
  s.x = rows_from_float(s.xf, dt, s.T, s.H);
  s.top = index_matrix(s.te, s.T, s.K, DType::kInt32);
  return s;
}

// Real rows equal to the reference, padding rows still poisoned (or zero when zero_padding).
::testing::AssertionResult rows_as_expected(const TensorView& y, const std::vector<float>& want, const ref::Plan& p,
                                            int64_t H, bool zero_padding) {
  for (int64_t r = 0; r < p.padded_rows; ++r) {
    const bool real = p.row_sources[static_cast<size_t>(r)] >= 0;
    if (real || zero_padding) {
      std::vector<float> one(want.begin() + r * H, want.begin() + (r + 1) * H);
      auto ok = rows_bitwise(y, one, 1, 0, H, r);
      if (!ok) return ok << " (row " << r << (real ? ", real" : ", padding") << ")";
    } else {
      auto ok = bytes_are(y, r, r + 1, kPoison);
      if (!ok) return ok << " (padding row " << r << " was written)";
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(ZeroPaddingOption, ForwardSpreadsLeavePaddingUnwritten) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat8E4M3}) {
    SCOPED_TRACE(dname(dt));
    PadCase s = make_setup(dt);
    const padmoe::Plan plan = padmoe::make_plan(s.top, s.E, s.m);
    const std::vector<float> want = ref::padded_gather(s.xf, s.H, s.p, nullptr);
    ASSERT_GT(s.p.padded_rows, s.T * s.K) << "the case must have padding rows";
    for (bool zero : {true, false}) {
      padmoe::Options o;
      o.zero_padding = zero;
      Tensor y = poison_rows(dt, s.p.capacity, s.H);
      padmoe::dispatch_out(s.x, plan.view(), std::nullopt, y, o);
      EXPECT_TRUE(rows_as_expected(y, want, s.p, s.H, zero)) << "dispatch zero_padding=" << zero;
      EXPECT_TRUE(bytes_are(y, s.p.padded_rows, s.p.capacity, kPoison)) << "rows past P";
      Tensor g = poison_rows(dt, s.p.capacity, s.H);
      const IndexInputs ii = index_inputs(s.p, DType::kInt32);
      padmoe::padded_gather_out(s.x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, s.K, std::nullopt, g, o);
      EXPECT_TRUE(rows_as_expected(g, want, s.p, s.H, zero)) << "padded_gather zero_padding=" << zero;
      // pad_to_alignment of the expert-grouped rows (h = x[indices / K]) gives the same padded layout
      std::vector<float> hf;
      for (int64_t i = 0; i < s.T * s.K; ++i) {
        const int64_t t = s.p.indices[static_cast<size_t>(i)] / s.K;
        hf.insert(hf.end(), s.xf.begin() + t * s.H, s.xf.begin() + (t + 1) * s.H);
      }
      const Tensor h = rows_from_float(hf, dt, s.T * s.K, s.H);
      const Tensor tpe = index_tensor(s.p.tokens_per_expert, DType::kInt32);
      Tensor padded = poison_rows(dt, s.p.padded_rows, s.H), map = poison_index(s.p.padded_rows),
             offs = poison_index(s.E);
      padmoe::pad_to_alignment_out(h, tpe, s.m, padded, map, offs, o);
      EXPECT_TRUE(rows_as_expected(padded, want, s.p, s.H, zero)) << "pad_to_alignment zero_padding=" << zero;
    }
  }
}

TEST(ZeroPaddingOption, BackwardOutputsStillZeroPadding) {
  PadCase s = make_setup(DType::kFloat32);
  const padmoe::Plan plan = padmoe::make_plan(s.top, s.E, s.m);
  padmoe::Options o;
  o.zero_padding = false;
  Tensor gy = poison_rows(DType::kFloat32, s.p.capacity, s.H);
  Tensor y = rows_from_float(std::vector<float>(static_cast<size_t>(s.p.capacity * s.H), 1.0f), DType::kFloat32,
                             s.p.capacity, s.H);
  padmoe::combine_backward_out(s.x, y, plan.view(), std::nullopt, gy, TensorView{}, o);
  const std::vector<float> want = ref::padded_gather(s.xf, s.H, s.p, nullptr);  // grad_y = spread of grad_out
  EXPECT_TRUE(rows_as_expected(gy, want, s.p, s.H, /*zero_padding=*/true));
}

}  // namespace
}  // namespace pt
