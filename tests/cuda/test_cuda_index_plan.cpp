// test_cuda_index_plan.cpp — index_plan (a plan from an index map of unbounded ids) on the GPU
// against the CPU backend. Helpers: cuda_fixture.hpp.
#include "cuda_fixture.hpp"

namespace pt {
namespace {

// index_plan_out on the GPU equals the CPU's, entry for entry, on both kernel paths (one block's
// radix sort up to kIndexPlanBlockSort assignments, the device radix sort above), over ids of every
// sign, cuts, spare rows (the -1 fill past A by the fill blocks) and empty maps; the GPU's outputs
// are the same on a second run.
TEST(CpuVsGpuEdge, IndexPlan) {
  REQUIRE_GPU();
  struct Case {
    int64_t T, K;
    int64_t bound;  // ids uniform in [0, bound) with some -1; 0: any int32
    double cut;
  };
  Rng rng(31);
  const int64_t block = padmoe::cuda::kIndexPlanBlockSort;
  for (const Case c : {Case{1, 1, 4, 1.0}, Case{33, 8, 16, 0.5}, Case{256, 8, 256, 1.0}, Case{256, 8, 0, 1.0},
                       Case{block / 8, 8, 64, 1.0}, Case{block / 8 + 1, 8, 64, 0.9}, Case{257, 1, 3, 40.0},
                       Case{4096, 2, 8, 1.0}, Case{16384, 8, 128, 1.0}, Case{20000, 3, 0, 0.7}, Case{3000, 8, 0, 3.0},
                       Case{0, 8, 8, 1.0}, Case{5, 0, 1, 1.0}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) + " bound=" + std::to_string(c.bound) +
                 " cut=" + std::to_string(c.cut));
    const int64_t a = c.T * c.K;
    Tensor ids = Tensor::empty(DType::kInt32, {c.T, c.K});
    for (int64_t i = 0; i < a; ++i) {
      ids.data_as<int32_t>()[i] = c.bound == 0         ? static_cast<int32_t>(static_cast<uint32_t>(rng.next()))
                                  : rng.below(10) == 0 ? -1
                                                       : static_cast<int32_t>(rng.below(c.bound));
    }
    const int64_t rows = static_cast<int64_t>(a * c.cut);
    Tensor counts = poison_index(4), dest = poison_index(a), sources = poison_index(rows);
    Tensor indices = poison_index(a), bin_ids = poison_index(a);
    padmoe::index_plan_out(ids, rows, counts, dest, sources, indices, bin_ids);
    const Tensor dids = to_gpu(ids);
    for (int run = 0; run < 2; ++run) {
      Tensor gc = gpu_poison_index(4), gd = gpu_poison_index(a), gs = gpu_poison_index(rows);
      Tensor gi = gpu_poison_index(a), gb = gpu_poison_index(a);
      padmoe::index_plan_out(dids, rows, gc, gd, gs, gi, gb);
      EXPECT_TRUE(all_same(to_cpu(gc), counts));
      EXPECT_TRUE(all_same(to_cpu(gd), dest));
      EXPECT_TRUE(all_same(to_cpu(gs), sources));
      EXPECT_TRUE(all_same(to_cpu(gi), indices));
      EXPECT_TRUE(all_same(to_cpu(gb), bin_ids));
    }
  }
}

}  // namespace
}  // namespace pt
