// test_cuda_mask_plan.cpp — mask_plan (a plan from TransformerEngine's routing mask) on the GPU
// against the CPU backend. Helpers: cuda_fixture.hpp.
#include "cuda_fixture.hpp"

namespace pt {
namespace {

// mask_plan_out on the GPU equals the CPU's, entry for entry, over sizes that fit one launch (up to
// T = 512 and E = 1024) and not, one and several tiles a chunk, experts not a multiple of 32 or of
// 4 (the byte-wise map read), cuts, padding, one_bin and the E above 3072 that needs more than 48
// KiB of shared memory; the GPU's outputs are the same on a second run, which also moves bfloat16
// probs with the rows and flags the nonzero ones (bitwise the CPU's); both runs again with count
// and place forced into one launch where they fit.
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
                       Case{0, 16, 16, false, 1.0}, Case{5, 0, 1, true, 1.0}, Case{200, 64, 16, false, 0.7},
                       Case{256, 128, 1, true, 0.6}, Case{97, 30, 8, false, 1.0}, Case{256, 409, 4, false, 0.9},
                       Case{257, 8, 1, true, 1.0}, Case{512, 1024, 8, false, 1.0}, Case{513, 64, 1, true, 1.0}}) {
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
    // probs moved with the rows and their nonzero flags (bfloat16, a fifth of the routed ones +-0;
    // NaN where unrouted: never read)
    std::vector<float> pv(static_cast<size_t>(c.T * c.E));
    for (size_t i = 0; i < pv.size(); ++i) {
      const int64_t kind = rng.below(10);
      const float p = kind == 0 ? 0.0f : kind == 1 ? -0.0f : static_cast<float>(rng.uniform(0.0, 1.0));
      pv[i] = map.data_as<uint8_t>()[i] != 0 ? num::round_to(DType::kBFloat16, p) : NAN;
    }
    const Tensor probs = rows_from_float(pv, DType::kBFloat16, c.T, c.E);
    Tensor moved = filled(DType::kBFloat16, {sources_len}, 0x7f), nonzero = filled(DType::kFloat32, {c.T * c.E}, 0x7f);
    padmoe::mask_plan_out(map, c.alignment, rows, c.one_bin, counts, dest, sources, rim, indices, bin_ids, probs, moved,
                          nonzero);
    const Tensor dmap = to_gpu(map), dprobs = to_gpu(probs);
    // runs 0 and 1 in two launches, 2 and 3 in one (where it fits)
    for (int run = 0; run < 4; ++run) {
      KernelOverrides ko;
      ko.mask_one_launch = run >= 2;
      const ScopedKernelOverrides forced(ko);
      const bool with_probs = run % 2 == 1;
      Tensor gc = gpu_poison_index(4 * bins), gd = gpu_poison_index(c.T * c.E), gs = gpu_poison_index(sources_len);
      Tensor gr = gpu_filled(DType::kInt32, {c.T, 2 * c.E + 1}, kIndexPoison);
      Tensor gi = gpu_poison_index(c.T * c.E), gb = gpu_poison_index(c.T * c.E);
      Tensor gm = gpu_filled(DType::kBFloat16, {sources_len}, 0x7f);
      Tensor gz = gpu_filled(DType::kFloat32, {c.T * c.E}, 0x7f);
      if (!with_probs) padmoe::mask_plan_out(dmap, c.alignment, rows, c.one_bin, gc, gd, gs, gr, gi, gb);
      else padmoe::mask_plan_out(dmap, c.alignment, rows, c.one_bin, gc, gd, gs, gr, gi, gb, dprobs, gm, gz);
      EXPECT_TRUE(all_same(to_cpu(gc), counts));
      EXPECT_TRUE(all_same(to_cpu(gd), dest));
      EXPECT_TRUE(all_same(to_cpu(gs), sources));
      EXPECT_TRUE(all_same(to_cpu(gr), rim));
      EXPECT_TRUE(all_same(to_cpu(gi), indices));
      EXPECT_TRUE(all_same(to_cpu(gb), bin_ids));
      if (with_probs) EXPECT_TRUE(all_same(to_cpu(gm), moved));
      if (with_probs) EXPECT_TRUE(all_same(to_cpu(gz), nonzero));
    }
  }
}

}  // namespace
}  // namespace pt
