// The kernel policy (src/core/kernel_policy.hpp): each choice and the boundaries between choices,
// for an H200 (132 SMs, 50 MiB L2) and a smaller device; the overrides' parser.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "core/kernel_overrides.hpp"
#include "core/kernel_policy.hpp"

namespace {

using namespace padmoe::policy;
const Device kH200{132, int64_t{50} << 20, true};
const Device kSmall{20, int64_t{4} << 20, false};

// PADMOE_TEST_PORTABLE_LOOPS=1 (the ctest cpu_sums_portable_loops): the CPU sums' portable loops
// for the whole run, through the overrides.
struct PortableLoops : ::testing::Environment {
  void SetUp() override {
    const char* v = std::getenv("PADMOE_TEST_PORTABLE_LOOPS");
    if (v != nullptr && std::strcmp(v, "1") == 0) padmoe::detail::kernel_overrides().cpu_avx2 = false;
  }
};
const auto* const kPortableLoops = ::testing::AddGlobalTestEnvironment(new PortableLoops);

TEST(KernelPolicy, PlanPath) {
  EXPECT_EQ(plan_path(1, 8), PlanPath::kSmall);
  EXPECT_EQ(plan_path(2048, 256), PlanPath::kSmall);  // one chunk
  EXPECT_EQ(plan_path(2049, 256), PlanPath::kFused);
  EXPECT_EQ(plan_path(2048, 512), PlanPath::kSmall);
  EXPECT_EQ(plan_path(1 << 20, 512), PlanPath::kFused);
  EXPECT_EQ(plan_path(100, 513), PlanPath::kSplit);
  EXPECT_EQ(plan_path(1 << 20, 1024), PlanPath::kSplit);
  EXPECT_EQ(plan_path(100, 0), PlanPath::kSplit);
}

TEST(KernelPolicy, PlanMatchAndCounts) {
  EXPECT_EQ(plan_match(63), PlanMatch::kMatchAny);
  EXPECT_EQ(plan_match(64), PlanMatch::kBallot);
  EXPECT_EQ(plan_counts(1, 64), PlanCounts::kPairs);
  EXPECT_EQ(plan_counts(1, 63), PlanCounts::kInts);
  EXPECT_EQ(plan_counts(31, 256), PlanCounts::kPairs);  // 31 * 2048 = 63488 <= 0xffff
  EXPECT_EQ(plan_counts(32, 256), PlanCounts::kInts);   // 65536 does not fit 16 bits
  EXPECT_TRUE(plan_pairs_fit(31));
  EXPECT_FALSE(plan_pairs_fit(32));
}

TEST(KernelPolicy, PlanReplicas) {
  EXPECT_EQ(plan_replicas(1, 1, 132, 264), 16);  // one chunk: up to 16 blocks rank it
  EXPECT_EQ(plan_replicas(8, 1, 132, 264), 16);  // 8 * 16 = 128 <= 132
  EXPECT_EQ(plan_replicas(9, 1, 132, 264), 8);   // 9 * 16 = 144 > 132
  EXPECT_EQ(plan_replicas(66, 1, 132, 264), 2);
  EXPECT_EQ(plan_replicas(67, 1, 132, 264), 1);
  EXPECT_EQ(plan_replicas(8, 1, 132, 64), 8);    // at most the resident blocks
  EXPECT_EQ(plan_replicas(8, 2, 132, 264), 1);   // several chunks a block: 1
  EXPECT_EQ(plan_replicas(0, 1, 132, 264), 1);
}

TEST(KernelPolicy, FewTokensAndTwoUnits) {
  EXPECT_EQ(few_tokens_blocks(kH200), 528);
  EXPECT_TRUE(few_tokens(527, kH200));
  EXPECT_FALSE(few_tokens(528, kH200));
  EXPECT_FALSE(two_units_window(131, 512, kH200));
  EXPECT_TRUE(two_units_window(132, 512, kH200));
  EXPECT_TRUE(two_units_window(329, 512, kH200));   // 658 < 660
  EXPECT_FALSE(two_units_window(330, 512, kH200));  // 660
  EXPECT_FALSE(two_units_window(256, 511, kH200));  // rows under 8 KiB
}

TEST(KernelPolicy, Slicing) {
  const Slicing none = reduce_slicing(600, 896, 256, false, 528);
  EXPECT_EQ(none.slices, 1);
  EXPECT_EQ(none.slice_units, 896);
  EXPECT_EQ(reduce_slicing(64, 896, 256, true, 528).slices, 1);  // dots: whole rows
  EXPECT_EQ(reduce_slicing(64, 256, 256, false, 528).slices, 1);  // a row of one granule
  const Slicing s = reduce_slicing(64, 896, 256, false, 528);    // 9 wanted, spans of 256
  EXPECT_EQ(s.slices, 4);
  EXPECT_EQ(s.slice_units, 256);
  EXPECT_EQ(reduce_slicing(64, 896, 256, false, 0).slices, 1);    // target 0: off
  EXPECT_EQ(reduce_slice_granule(2), 512);
  EXPECT_EQ(reduce_slice_granule(3), 256);
}

TEST(KernelPolicy, Spread) {
  EXPECT_EQ(spread_kernel(16 * 132, 512, 4, kH200), SpreadKernel::kWarp);
  EXPECT_EQ(spread_kernel(16 * 132 - 1, 512, 4, kH200), SpreadKernel::kBlock);
  EXPECT_EQ(spread_kernel(1 << 16, 513, 1, kH200), SpreadKernel::kBlock);
  EXPECT_EQ(spread_kernel(1 << 16, 256, 8, kH200), SpreadKernel::kWarp);  // 2048 units of copies
  EXPECT_EQ(spread_kernel(1 << 16, 256, 9, kH200), SpreadKernel::kBlock);
  EXPECT_EQ(spread_kernel(256, 448, 8, kH200), SpreadKernel::kBlock);     // decode
  EXPECT_EQ(spread_kernel(320, 64, 2, kSmall), SpreadKernel::kWarp);
}

TEST(KernelPolicy, PlainReduce) {
  const int64_t u = 896;  // 14 KiB bf16 rows
  EXPECT_EQ(plain_reduce_kernel(64, 8, u, kH200), ReduceKernel::kBlockWide);
  EXPECT_EQ(plain_reduce_kernel(131, 8, u, kH200), ReduceKernel::kBlockWide);
  EXPECT_EQ(plain_reduce_kernel(131, 2, u, kH200), ReduceKernel::kBlock);
  EXPECT_EQ(plain_reduce_kernel(132, 8, u, kH200), ReduceKernel::kTokenBlockTwoUnits);
  EXPECT_EQ(plain_reduce_kernel(256, 8, u, kH200), ReduceKernel::kTokenBlockTwoUnits);
  EXPECT_EQ(plain_reduce_kernel(330, 8, u, kH200), ReduceKernel::kTokenBlock);
  EXPECT_EQ(plain_reduce_kernel(256, 8, 256, kH200), ReduceKernel::kTokenBlock);  // short rows
  EXPECT_EQ(plain_reduce_kernel(16384, 8, u, kH200), ReduceKernel::kTokenBlock);
  EXPECT_EQ(plain_reduce_kernel(527, 9, u, kH200), ReduceKernel::kBlockWide);
  EXPECT_EQ(plain_reduce_kernel(528, 9, u, kH200), ReduceKernel::kBlock);
  EXPECT_EQ(plain_reduce_fit(ReduceKernel::kTokenBlock, 9), ReduceKernel::kBlock);
  EXPECT_EQ(plain_reduce_fit(ReduceKernel::kBlockWide, 2), ReduceKernel::kBlock);
  EXPECT_EQ(plain_reduce_fit(ReduceKernel::kBlockWide, 3), ReduceKernel::kBlockWide);
  EXPECT_EQ(plain_reduce_fit(ReduceKernel::kTokenBlockTwoUnits, 8), ReduceKernel::kTokenBlockTwoUnits);
}

TEST(KernelPolicy, ReduceDots) {
  const int64_t u = 896;
  EXPECT_EQ(reduce_dots_kernel(64, 8, u, kH200), ReduceDotsKernel::kTokenBlock);
  EXPECT_EQ(reduce_dots_kernel(256, 8, u, kH200), ReduceDotsKernel::kTokenBlockTwoUnits);
  EXPECT_EQ(reduce_dots_kernel(256, 2, u, kH200), ReduceDotsKernel::kTokenBlockTwoUnits);
  EXPECT_EQ(reduce_dots_kernel(400, 8, u, kH200), ReduceDotsKernel::kTokenBlock);
  EXPECT_EQ(reduce_dots_kernel(527, 8, u, kH200), ReduceDotsKernel::kTokenBlock);
  EXPECT_EQ(reduce_dots_kernel(528, 8, u, kH200), ReduceDotsKernel::kTokenWarp);
  EXPECT_EQ(reduce_dots_kernel(100, 16, u, kH200), ReduceDotsKernel::kBlockWide);
  EXPECT_EQ(reduce_dots_kernel(1000, 16, u, kH200), ReduceDotsKernel::kBlock);
  EXPECT_EQ(reduce_dots_fit(ReduceDotsKernel::kTokenWarp, 1000, 16, kH200), ReduceDotsKernel::kBlock);
  EXPECT_EQ(reduce_dots_fit(ReduceDotsKernel::kTokenWarp, 10, 16, kH200), ReduceDotsKernel::kBlockWide);
  EXPECT_EQ(reduce_dots_fit(ReduceDotsKernel::kBlock, 10, 4, kH200), ReduceDotsKernel::kBlock);
}

TEST(KernelPolicy, RowDotsAndSearch) {
  EXPECT_EQ(row_dots_kernel(1), RowDotsKernel::kAssignmentWarp);
  EXPECT_EQ(row_dots_kernel(2), RowDotsKernel::kAssignmentWarp);
  EXPECT_EQ(row_dots_kernel(3), RowDotsKernel::kTokenBlock);
  EXPECT_EQ(row_dots_kernel(8), RowDotsKernel::kTokenBlock);
  EXPECT_EQ(row_dots_kernel(9), RowDotsKernel::kAssignmentWarp);
  EXPECT_EQ(row_dots_fit(RowDotsKernel::kTokenBlock, 9), RowDotsKernel::kAssignmentWarp);
  EXPECT_EQ(row_dots_fit(RowDotsKernel::kTokenBlock, 2), RowDotsKernel::kTokenBlock);
  EXPECT_TRUE(dest_search_fits(4096, 256, 8));
  EXPECT_FALSE(dest_search_fits(4097, 256, 8));
  EXPECT_FALSE(dest_search_fits(4096, 257, 8));
  EXPECT_FALSE(dest_search_fits(4096, 256, 9));
}

TEST(KernelPolicy, ZeroRowsAndPrefetch) {
  EXPECT_EQ(zero_rows_per_block(528, 14336, kH200), 32);
  EXPECT_EQ(zero_rows_per_block(256, 14336, kH200), 4);
  EXPECT_EQ(zero_rows_per_block(256, 7168, kH200), 8);
  EXPECT_EQ(zero_rows_per_block(256, 100000, kH200), 4);
  EXPECT_EQ(zero_rows_per_block(256, 512, kH200), 32);
  EXPECT_EQ(zero_rows_per_block(256, 0, kH200), 32);
  const int64_t l2 = kH200.l2_bytes / 10 * 6;
  EXPECT_TRUE(l2_prefetch(l2 / 1024, 1024, kH200));
  EXPECT_FALSE(l2_prefetch(l2 / 1024 + 1, 1024, kH200));
  EXPECT_FALSE(l2_prefetch(1, 1024, kSmall));  // no PDL: no wait to overlap
}

TEST(KernelPolicy, SpreadDots) {
  EXPECT_FALSE(spread_dots_by_token(1));
  EXPECT_FALSE(spread_dots_by_token(8));
  EXPECT_TRUE(spread_dots_by_token(9));
  EXPECT_TRUE(spread_dots_by_token(256));
}

// One tile of 32 tokens a block up to 4 blocks a multiprocessor (528 tiles on 132), then the grid
// stays near that with more tiles a block.
TEST(KernelPolicy, MaskPlan) {
  EXPECT_EQ(mask_tiles_per_chunk(0, kH200), 1);
  EXPECT_EQ(mask_tiles_per_chunk(256, kH200), 1);
  EXPECT_EQ(mask_tiles_per_chunk(528 * 32, kH200), 1);
  EXPECT_EQ(mask_tiles_per_chunk(528 * 32 + 1, kH200), 2);
  EXPECT_EQ(mask_tiles_per_chunk(1 << 20, kH200), 63);  // 32768 tiles: 521 blocks
  Device one;
  one.sms = 1;
  EXPECT_EQ(mask_tiles_per_chunk(4 * 32, one), 1);
  EXPECT_EQ(mask_tiles_per_chunk(4 * 32 + 1, one), 2);
  EXPECT_EQ(mask_chunks(0, kH200), 1);
  EXPECT_EQ(mask_chunks(256, kH200), 8);
  EXPECT_EQ(mask_chunks(528 * 32 + 1, kH200), 265);  // 529 tiles, 2 a chunk
  EXPECT_EQ(mask_chunks(1 << 20, kH200), 521);
  EXPECT_EQ(mask_chunks(4 * 32 + 1, one), 3);
}

// The per-expert scan runs inside the place blocks for a grid of up to 16 chunks (decode, T = 256:
// 8 chunks), as a launch of its own past that.
TEST(KernelPolicy, MaskScanFused) {
  EXPECT_TRUE(mask_scan_fused(1));
  EXPECT_TRUE(mask_scan_fused(mask_chunks(256, kH200)));
  EXPECT_TRUE(mask_scan_fused(16));
  EXPECT_FALSE(mask_scan_fused(17));
  EXPECT_FALSE(mask_scan_fused(mask_chunks(4096, kH200)));
}

// Count and place fit one cooperative launch at the decode sizes: one-tile chunks summed in the
// place blocks, a grid of at most one block a multiprocessor, E <= 1024.
TEST(KernelPolicy, MaskOneLaunchFits) {
  auto one_launch = [](int64_t tokens, int experts, const Device& d) {
    return mask_one_launch_fits(experts, mask_tiles_per_chunk(tokens, d), mask_chunks(tokens, d),
                                mask_place_slices(tokens, d), d.sms);
  };
  EXPECT_TRUE(one_launch(256, 256, kH200));   // decode: 8 chunks x 4 slices
  EXPECT_TRUE(one_launch(512, 256, kH200));   // 16 chunks x 4 slices: 64 blocks
  EXPECT_TRUE(one_launch(0, 8, kH200));
  EXPECT_TRUE(one_launch(256, 1024, kH200));
  EXPECT_FALSE(one_launch(256, 1025, kH200));  // more shared memory than the bound
  EXPECT_FALSE(one_launch(256, 0, kH200));
  EXPECT_FALSE(one_launch(513, 256, kH200));   // 17 chunks: the scan launch's sizes
  Device few;
  few.sms = 16;
  EXPECT_FALSE(one_launch(256, 256, few));     // 32 blocks on 16 multiprocessors
  EXPECT_TRUE(mask_one_launch_fits(256, 1, 8, 2, 16));
  EXPECT_FALSE(mask_one_launch_fits(256, 2, 8, 1, 132));  // chunks of two tiles
}

// A chunk of one tile split over up to 4 place blocks while the grid stays within 4 blocks a
// multiprocessor; none once a chunk holds several tiles.
TEST(KernelPolicy, MaskPlaceSlices) {
  EXPECT_EQ(mask_place_slices(0, kH200), 4);
  EXPECT_EQ(mask_place_slices(256, kH200), 4);        // decode: 8 tiles, 32 blocks
  EXPECT_EQ(mask_place_slices(132 * 32, kH200), 4);   // 132 tiles: 528 blocks
  EXPECT_EQ(mask_place_slices(133 * 32, kH200), 2);
  EXPECT_EQ(mask_place_slices(264 * 32, kH200), 2);   // 528 blocks
  EXPECT_EQ(mask_place_slices(265 * 32, kH200), 1);
  EXPECT_EQ(mask_place_slices(16384, kH200), 1);      // 512 tiles
  EXPECT_EQ(mask_place_slices(1 << 20, kH200), 1);    // several tiles a chunk
  Device one;
  one.sms = 1;
  EXPECT_EQ(mask_place_slices(32, one), 4);  // 1 tile: 4 blocks
  EXPECT_EQ(mask_place_slices(64, one), 2);
  EXPECT_EQ(mask_place_slices(65, one), 1);
}

TEST(KernelPolicy, Chunks) {
  EXPECT_TRUE(chunk_map_fused(16384));
  EXPECT_FALSE(chunk_map_fused(16385));
  EXPECT_TRUE(chunk_rows_one_launch(1024, 50 << 10, kH200));
  EXPECT_FALSE(chunk_rows_one_launch(1025, 50 << 10, kH200));
  EXPECT_EQ(chunk_rows_form(false, 256, 256), ChunkRowsForm::kOneScan);
  EXPECT_EQ(chunk_rows_form(false, 257, 256), ChunkRowsForm::kRowwise);
  EXPECT_EQ(chunk_rows_form(true, 8, 256), ChunkRowsForm::kRowwise);
  EXPECT_EQ(chunk_rows_form(false, 8, 255), ChunkRowsForm::kFlat);
  EXPECT_EQ(chunk_rows_fit(ChunkRowsForm::kOneScan, true, 8, 256), ChunkRowsForm::kRowwise);
  EXPECT_EQ(chunk_rows_fit(ChunkRowsForm::kOneScan, true, 8, 100), ChunkRowsForm::kFlat);
  EXPECT_EQ(chunk_rows_fit(ChunkRowsForm::kFlat, false, 8, 1000), ChunkRowsForm::kFlat);
}

TEST(KernelPolicy, Quant) {
  EXPECT_EQ(quant_slices(256, 7168, false, kH200), 4);   // 1024 blocks <= 1056
  EXPECT_EQ(quant_slices(264, 7168, false, kH200), 4);   // 1056
  EXPECT_EQ(quant_slices(265, 7168, false, kH200), 1);
  EXPECT_EQ(quant_slices(256, 7168, true, kH200), 1);    // per-row scales
  EXPECT_EQ(quant_slices(256, 2048, false, kH200), 1);   // one step
  EXPECT_TRUE(quant_loose(QuantScaleKind::kBlock128));
  EXPECT_FALSE(quant_loose(QuantScaleKind::kMx));
  EXPECT_EQ(quant_zero_rows(256, 7168, QuantScaleKind::kBlock128, kH200), 4);
  EXPECT_EQ(quant_zero_rows(256, 7168, QuantScaleKind::kPerRow, kH200), 32);
  EXPECT_EQ(quant_zero_rows(600, 7168, QuantScaleKind::kMx, kH200), 32);
}

TEST(KernelOverrides, Variants) {
  padmoe::detail::KernelOverrides o;
  std::string err;
  EXPECT_TRUE(set_kernel_variant(o, "reduce", "token-block-two", &err));
  EXPECT_EQ(o.reduce, ReduceKernel::kTokenBlockTwoUnits);
  EXPECT_TRUE(set_kernel_variant(o, "reduce", "auto", &err));
  EXPECT_FALSE(o.reduce.has_value());
  EXPECT_TRUE(set_kernel_variant(o, "pdl", "off", &err));
  EXPECT_EQ(o.pdl, false);
  EXPECT_TRUE(set_kernel_variant(o, "plan", "split", &err));
  EXPECT_EQ(o.plan_path, PlanPath::kSplit);
  EXPECT_TRUE(set_kernel_variant(o, "plan-blocks", "4", &err));
  EXPECT_EQ(o.plan_fused_blocks, 4);
  EXPECT_FALSE(set_kernel_variant(o, "reduce", "wide", &err));
  EXPECT_NE(err.find("unknown value"), std::string::npos);
  EXPECT_FALSE(set_kernel_variant(o, "nope", "1", &err));
  EXPECT_NE(err.find("unknown key"), std::string::npos);
  EXPECT_FALSE(set_kernel_variant(o, "slice-blocks", "-2", &err));
  EXPECT_TRUE(set_kernel_variant(o, "mask-one-launch", "on", &err));
  EXPECT_EQ(o.mask_one_launch, true);
  EXPECT_TRUE(set_kernel_variant(o, "mask-one-launch", "auto", &err));
  EXPECT_FALSE(o.mask_one_launch.has_value());
}

}  // namespace
