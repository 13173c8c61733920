// test_tiling.cpp — the tile planner (docs/spec.md §15, tiling.hpp): the
// planner's configs satisfy every rule, tile_buffer_bytes equals the formula
// of tiling.hpp's header computed here independently, and hand-made bad
// configs are rejected.
#include <tuple>

#include "padmoe/tiling.hpp"
#include "test_util.hpp"

namespace pt {
namespace {

using padmoe::TileConfig;
using padmoe::TileOp;
using padmoe::TileTarget;

// tiling.hpp rule 2, written out independently.
int64_t formula_bytes(TileOp op, const TileConfig& c, DType dt) {
  const int64_t s = static_cast<int64_t>(esize(dt));
  int64_t row_slices = 1, index_bytes = 8, f32_temps = 1;
  switch (op) {
    case TileOp::kGather:
      row_slices = 1;
      index_bytes = 8;
      f32_temps = 1;
      break;
    case TileOp::kScatter:
      row_slices = 1;
      index_bytes = 8;
      f32_temps = 2;
      break;
    case TileOp::kWgrad:
      row_slices = 2;
      index_bytes = 8;
      f32_temps = 1;
      break;
  }
  return static_cast<int64_t>(c.buffers) *
         (static_cast<int64_t>(c.sub_block_rows) * (row_slices * c.block_x * s + index_bytes) +
          f32_temps * static_cast<int64_t>(c.block_x) * 4);
}

int64_t max_block_x(TileTarget t, TileOp op) {
  if (t == TileTarget::kAscendA2) return op == TileOp::kGather ? 20000 : op == TileOp::kScatter ? 6144 : 5120;
  if (t == TileTarget::kGpu) return op == TileOp::kGather ? 1024 : 2048;
  return op == TileOp::kGather ? 16384 : op == TileOp::kScatter ? 64 : 4096;
}

TEST(Tiling, TargetInfo) {
  const padmoe::TargetInfo a = padmoe::target_info(TileTarget::kAscendA2);
  EXPECT_EQ(a.target, TileTarget::kAscendA2);
  EXPECT_EQ(a.cores, 48);
  EXPECT_EQ(a.buffer_total_bytes, 192 * 1024);
  EXPECT_EQ(a.reserve_bytes, 16 * 1024);
  EXPECT_EQ(a.buffers, 2);
  EXPECT_EQ(padmoe::target_info(TileTarget::kAscendA2, 40).cores, 40);  // queried at run time
  const padmoe::TargetInfo c = padmoe::target_info(TileTarget::kCpu);
  EXPECT_EQ(c.target, TileTarget::kCpu);
  EXPECT_GE(c.cores, 1);
  EXPECT_GT(c.buffer_total_bytes, 0);
  EXPECT_EQ(c.buffers, 1);
  EXPECT_EQ(padmoe::target_info(TileTarget::kCpu, 3).cores, 3);
  const padmoe::TargetInfo g = padmoe::target_info(TileTarget::kGpu);
  EXPECT_EQ(g.cores, 132);  // H200 SMs
  EXPECT_EQ(g.programs_per_core, 32);
  EXPECT_EQ(g.buffer_total_bytes, 24 * 1024);
  EXPECT_EQ(g.buffers, 1);
  EXPECT_EQ(padmoe::target_info(TileTarget::kGpu, 78).cores, 78);  // queried at run time
  EXPECT_EQ(padmoe::target_info(TileTarget::kCpu).programs_per_core, 1);
  EXPECT_EQ(a.programs_per_core, 1);
  EXPECT_STREQ(padmoe::tile_target_name(TileTarget::kGpu), "gpu");
  TileTarget parsed = TileTarget::kCpu;
  EXPECT_TRUE(padmoe::parse_tile_target("gpu", &parsed));
  EXPECT_EQ(parsed, TileTarget::kGpu);
  EXPECT_TRUE(padmoe::parse_tile_target("ascend", &parsed));
  EXPECT_EQ(parsed, TileTarget::kAscendA2);
  EXPECT_FALSE(padmoe::parse_tile_target("tpu", &parsed));
  EXPECT_STREQ(padmoe::tile_target_name(TileTarget::kCpu), "cpu");
  EXPECT_STREQ(padmoe::tile_target_name(TileTarget::kAscendA2), "ascend-a2");
  EXPECT_STREQ(padmoe::tile_op_name(TileOp::kGather), "gather");
  EXPECT_STREQ(padmoe::tile_op_name(TileOp::kScatter), "scatter");
  EXPECT_STREQ(padmoe::tile_op_name(TileOp::kWgrad), "wgrad");
}

TEST(Tiling, BufferBytesMatchesHeaderFormula) {
  Rng rng(3);
  for (TileOp op : {TileOp::kGather, TileOp::kScatter, TileOp::kWgrad})
    for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3})
      for (int i = 0; i < 50; ++i) {
        TileConfig c;
        c.programs = 1 + static_cast<int>(rng.below(64));
        c.sub_block_rows = 1 + static_cast<int>(rng.below(300));
        c.block_x = 1 + static_cast<int>(rng.below(20000));
        c.buffers = 1 + static_cast<int>(rng.below(2));
        c.buffer_bytes = 1 << 20;
        EXPECT_EQ(padmoe::tile_buffer_bytes(op, c, dt), formula_bytes(op, c, dt))
            << padmoe::tile_op_name(op) << " " << dname(dt) << " rows " << c.sub_block_rows << " bx " << c.block_x;
      }
  // A worked example: Ascend gather, bf16, 128 rows x 256 columns, double-buffered:
  // 2 * (128 * (256*2 + 8) + 256*4) = 2 * (66560 + 1024) = 135168
  TileConfig c{48, 128, 256, 176 * 1024, 2};
  EXPECT_EQ(padmoe::tile_buffer_bytes(TileOp::kGather, c, DType::kBFloat16), 135168);
}

using PlanParam = std::tuple<TileTarget, TileOp, DType, int64_t>;
class TilePlanner : public ::testing::TestWithParam<PlanParam> {};

TEST_P(TilePlanner, SatisfiesRules) {
  TileTarget tgt;
  TileOp op;
  DType dt;
  int64_t H;
  std::tie(tgt, op, dt, H) = GetParam();
  const padmoe::TargetInfo info = padmoe::target_info(tgt);
  const TileConfig c = padmoe::tile_config(info, op, H, dt);
  SCOPED_TRACE(padmoe::describe_tile_config(op, c, H, dt));
  const int64_t s = static_cast<int64_t>(esize(dt));
  const int64_t g = 32 / s;  // 32 bytes in elements
  EXPECT_NO_THROW(padmoe::validate_tile_config(op, c, H, dt));
  EXPECT_EQ(c.programs, info.cores * info.programs_per_core);
  EXPECT_EQ(c.buffers, info.buffers);
  EXPECT_GE(c.block_x, 1);
  EXPECT_GE(c.sub_block_rows, 1);
  EXPECT_LE(c.sub_block_rows, 256);
  EXPECT_EQ((c.block_x * s) % 32, 0) << "block_x * element_size must be a multiple of 32 bytes";
  EXPECT_LE(c.buffer_bytes, info.buffer_total_bytes - info.reserve_bytes);
  EXPECT_GT(c.buffer_bytes, 0);
  EXPECT_LE(padmoe::tile_buffer_bytes(op, c, dt), c.buffer_bytes);
  EXPECT_EQ(padmoe::tile_buffer_bytes(op, c, dt), formula_bytes(op, c, dt));
  // block_x = round_up(min(H, max_block_x), 32 B), shrunk in 32-byte steps only until one row fits.
  const int64_t start = ((std::min(H, max_block_x(tgt, op)) + g - 1) / g) * g;
  EXPECT_LE(c.block_x, start);
  if (c.block_x < start) {
    TileConfig bigger = c;
    bigger.block_x = c.block_x + static_cast<int>(g);
    bigger.sub_block_rows = 1;
    EXPECT_GT(formula_bytes(op, bigger, dt), c.buffer_bytes) << "block_x was shrunk further than needed";
  }
  // wgrad across column tiles -> one row per step
  if (op == TileOp::kWgrad && H > c.block_x) EXPECT_EQ(c.sub_block_rows, 1);
  // otherwise: the most rows that fit (capped at 256)
  if (!(op == TileOp::kWgrad && H > c.block_x) && c.sub_block_rows < 256) {
    TileConfig more = c;
    more.sub_block_rows = c.sub_block_rows + 1;
    EXPECT_GT(formula_bytes(op, more, dt), c.buffer_bytes) << "sub_block_rows is not the most that fit";
  }
}

std::string planner_name(const ::testing::TestParamInfo<PlanParam>& i) {
  return std::string(std::get<0>(i.param) == TileTarget::kCpu   ? "cpu"
                     : std::get<0>(i.param) == TileTarget::kGpu ? "gpu"
                                                                : "ascend") +
         "_" + padmoe::tile_op_name(std::get<1>(i.param)) + "_" + dname(std::get<2>(i.param)) + "_H" +
         std::to_string(std::get<3>(i.param));
}
const auto kHiddens = ::testing::Values<int64_t>(1, 3, 33, 768, 4097, 7168, 20000, 65536);

INSTANTIATE_TEST_SUITE_P(
    All, TilePlanner,
    ::testing::Combine(::testing::Values(TileTarget::kCpu, TileTarget::kAscendA2, TileTarget::kGpu),
                       ::testing::Values(TileOp::kGather, TileOp::kScatter, TileOp::kWgrad),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16), kHiddens),
    planner_name);
// float8 is move-only: gather tiles only.
INSTANTIATE_TEST_SUITE_P(Float8, TilePlanner,
                         ::testing::Combine(::testing::Values(TileTarget::kCpu, TileTarget::kAscendA2,
                                                              TileTarget::kGpu),
                                            ::testing::Values(TileOp::kGather),
                                            ::testing::Values(DType::kFloat8E4M3, DType::kFloat8E5M2), kHiddens),
                         planner_name);

TEST(Tiling, AscendTutorialShapes) {
  // 16-bit rows on the A2: small H gives block_x = round_up(H, 16); wgrad with H > 5120 steps one row.
  const padmoe::TargetInfo a = padmoe::target_info(TileTarget::kAscendA2);
  EXPECT_EQ(padmoe::tile_config(a, TileOp::kGather, 768, DType::kBFloat16).block_x, 768);
  EXPECT_EQ(padmoe::tile_config(a, TileOp::kGather, 33, DType::kFloat16).block_x, 48);
  EXPECT_EQ(padmoe::tile_config(a, TileOp::kScatter, 1536, DType::kBFloat16).block_x, 1536);
  const TileConfig w = padmoe::tile_config(a, TileOp::kWgrad, 7168, DType::kBFloat16);
  EXPECT_LE(w.block_x, 5120);
  EXPECT_EQ(w.sub_block_rows, 1);
  EXPECT_EQ(padmoe::tile_config(a, TileOp::kGather, 1, DType::kFloat32).block_x, 8);  // 8 * 4 B = 32 B
}

TEST(Tiling, GpuTargetShapes) {
  // The gpu target's constants were chosen from an H200 sweep of padmoe.triton (bench/bench_triton.py
  // --sweep): 32 programs per SM; bf16 gather 9 rows (Triton: 8) x 1024 columns, scatter and wgrad 1 x 2048.
  const padmoe::TargetInfo g = padmoe::target_info(TileTarget::kGpu, 132);
  for (int64_t H : {2048, 4096, 7168}) {
    const TileConfig ga = padmoe::tile_config(g, TileOp::kGather, H, DType::kBFloat16);
    EXPECT_EQ(ga.programs, 132 * 32);
    EXPECT_EQ(ga.block_x, 1024);
    EXPECT_EQ(ga.sub_block_rows, 9);
    const TileConfig sc = padmoe::tile_config(g, TileOp::kScatter, H, DType::kBFloat16);
    EXPECT_EQ(sc.block_x, 2048);
    EXPECT_EQ(sc.sub_block_rows, 1);
    const TileConfig wg = padmoe::tile_config(g, TileOp::kWgrad, H, DType::kBFloat16);
    EXPECT_EQ(wg.block_x, 2048);
    EXPECT_EQ(wg.sub_block_rows, 1);
  }
}

TEST(Tiling, BadConfigsRejected) {
  const DType bf = DType::kBFloat16;
  const int64_t budget = 176 * 1024;
  auto rejects = [&](TileOp op, TileConfig c, int64_t H) {
    return throws_error([&] { padmoe::validate_tile_config(op, c, H, bf); }, {},
                        static_cast<int>(padmoe::ErrorKind::kValue));
  };
  const TileConfig good{48, 8, 256, budget, 2};
  EXPECT_NO_THROW(padmoe::validate_tile_config(TileOp::kGather, good, 1000, bf));
  TileConfig c = good;
  c.block_x = 250;  // 500 bytes: not a multiple of 32
  EXPECT_TRUE(rejects(TileOp::kGather, c, 1000));
  c = good;
  c.block_x = 0;
  EXPECT_TRUE(rejects(TileOp::kGather, c, 1000));
  c = good;
  c.sub_block_rows = 0;
  EXPECT_TRUE(rejects(TileOp::kGather, c, 1000));
  c = good;
  c.programs = 0;
  EXPECT_TRUE(rejects(TileOp::kGather, c, 1000));
  c = good;
  c.sub_block_rows = 200;
  c.block_x = 4096;  // 2 * 200 * 8200 bytes: over budget
  EXPECT_TRUE(rejects(TileOp::kScatter, c, 4096));
  c = good;
  c.buffer_bytes = formula_bytes(TileOp::kGather, good, bf) - 1;  // one byte short
  EXPECT_TRUE(rejects(TileOp::kGather, c, 1000));
  c = good;
  c.buffer_bytes = formula_bytes(TileOp::kGather, good, bf);  // exactly fits
  EXPECT_NO_THROW(padmoe::validate_tile_config(TileOp::kGather, c, 1000, bf));
  // wgrad with H > block_x needs sub_block_rows == 1
  c = good;
  c.block_x = 256;
  c.sub_block_rows = 2;
  EXPECT_TRUE(rejects(TileOp::kWgrad, c, 1000));
  c.sub_block_rows = 1;
  EXPECT_NO_THROW(padmoe::validate_tile_config(TileOp::kWgrad, c, 1000, bf));
  c.sub_block_rows = 2;  // H <= block_x: several rows are fine
  EXPECT_NO_THROW(padmoe::validate_tile_config(TileOp::kWgrad, c, 256, bf));
  // float32: block_x must be a multiple of 8
  TileConfig f{1, 1, 12, budget, 1};
  EXPECT_TRUE(throws_error([&] { padmoe::validate_tile_config(TileOp::kGather, f, 100, DType::kFloat32); }, {}));
  f.block_x = 16;
  EXPECT_NO_THROW(padmoe::validate_tile_config(TileOp::kGather, f, 100, DType::kFloat32));
}

}  // namespace
}  // namespace pt
