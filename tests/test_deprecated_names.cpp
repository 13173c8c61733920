// test_deprecated_names.cpp — the C++ names renamed to Python's still work, for one release:
// capacity_bound, Plan::capacity, sort_chunks_capacity, plan_tiles and index::capacity_bound give
// what padded_rows_bound, Plan::padded_rows_bound, sort_chunks_rows_bound, tile_config and
// index::padded_rows_bound give. They are [[deprecated]]: this test alone calls them.
#include "padmoe/index_math.hpp"
#include "padmoe/tiling.hpp"
#include "test_util.hpp"

namespace pt {
namespace {

#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

TEST(DeprecatedNames, GiveWhatTheirNewNamesGive) {
  EXPECT_EQ(padmoe::capacity_bound(13, 2, 5, 4), padmoe::padded_rows_bound(13, 2, 5, 4));
  EXPECT_EQ(padmoe::sort_chunks_capacity(30, 8, 2, 4), padmoe::sort_chunks_rows_bound(30, 8, 2, 4));
  EXPECT_EQ(padmoe::index::capacity_bound(26, 5, 4), padmoe::index::padded_rows_bound(26, 5, 4));

  const padmoe::Plan plan = padmoe::Plan::empty(13, 2, 5, 4);
  EXPECT_EQ(plan.capacity(), plan.padded_rows_bound());
  EXPECT_EQ(plan.capacity(), 13 * 2 + 5 * 3);

  const padmoe::TargetInfo gpu = padmoe::target_info(padmoe::TileTarget::kGpu, 132);
  const padmoe::TileConfig old_name = padmoe::plan_tiles(gpu, padmoe::TileOp::kGather, 512, DType::kFloat32);
  const padmoe::TileConfig new_name = padmoe::tile_config(gpu, padmoe::TileOp::kGather, 512, DType::kFloat32);
  EXPECT_EQ(old_name.programs, new_name.programs);
  EXPECT_EQ(old_name.sub_block_rows, new_name.sub_block_rows);
  EXPECT_EQ(old_name.block_x, new_name.block_x);
  EXPECT_EQ(old_name.buffer_bytes, new_name.buffer_bytes);
  EXPECT_EQ(old_name.buffers, new_name.buffers);
}

#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace
}  // namespace pt
