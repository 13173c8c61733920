// tiling.cpp — the tile planner of docs/spec.md §15 and its rules.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>

#include "padmoe/error.hpp"
#include "padmoe/index_math.hpp"
#include "padmoe/tiling.hpp"

namespace padmoe {
namespace {

constexpr int64_t kKiB = 1024;
constexpr int64_t kTransferBytes = 32;  // DMA / vector granule the Ascend design aligns BLOCK_X to
constexpr int kMaxSubBlockRows = 256;
// GPU target (measured on an H200 with padmoe.triton: bench/results/triton.md)
constexpr int kGpuProgramsPerSm = 32;
constexpr int64_t kGpuProgramBytes = 24 * kKiB;  // a program's register-file share for its tiles
constexpr int64_t kGpuMaxBlockX[3] = {1024, 2048, 2048};  // gather, scatter, wgrad

struct OpShape {
  int row_slices;   // row slices of block_x elements per sub-block row
  int index_bytes;  // index / weight bytes per sub-block row
  int f32_temps;    // float32 temporaries of block_x elements per stage
};

OpShape op_shape(TileOp op) {
  switch (op) {
    case TileOp::kGather: return {1, 8, 1};
    case TileOp::kScatter: return {1, 8, 2};
    case TileOp::kWgrad: return {2, 8, 1};
  }
  return {1, 8, 1};
}

int64_t max_block_x(TileTarget target, TileOp op) {
  if (target == TileTarget::kAscendA2) {
    switch (op) {
      case TileOp::kGather: return 20000;
      case TileOp::kScatter: return 6144;
      case TileOp::kWgrad: return 5120;
    }
  }
  if (target == TileTarget::kGpu) {
    switch (op) {
      case TileOp::kGather: return kGpuMaxBlockX[0];
      case TileOp::kScatter: return kGpuMaxBlockX[1];
      case TileOp::kWgrad: return kGpuMaxBlockX[2];
    }
  }
  switch (op) {
    case TileOp::kGather: return 16384;
    case TileOp::kScatter: return 64;  // K source rows stream side by side; measured best on x86-64
    case TileOp::kWgrad: return 4096;
  }
  return 4096;
}

int64_t stage_bytes(TileOp op, int64_t rows, int64_t block_x, int64_t elem) {
  const OpShape s = op_shape(op);
  return rows * (s.row_slices * block_x * elem + s.index_bytes) + s.f32_temps * block_x * 4;
}

int64_t cpu_l2_bytes() {
#ifdef _SC_LEVEL2_CACHE_SIZE
  static const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // read once
  if (l2 > 0) return l2;
#endif
  return 1024 * kKiB;
}

}  // namespace

const char* tile_target_name(TileTarget target) {
  switch (target) {
    case TileTarget::kAscendA2: return "ascend-a2";
    case TileTarget::kGpu: return "gpu";
    case TileTarget::kCpu: return "cpu";
  }
  return "cpu";
}

bool parse_tile_target(const std::string& name, TileTarget* target) {
  if (name == "cpu") *target = TileTarget::kCpu;
  else if (name == "ascend-a2" || name == "ascend") *target = TileTarget::kAscendA2;
  else if (name == "gpu") *target = TileTarget::kGpu;
  else return false;
  return true;
}

const char* tile_op_name(TileOp op) {
  switch (op) {
    case TileOp::kGather: return "gather";
    case TileOp::kScatter: return "scatter";
    case TileOp::kWgrad: return "wgrad";
  }
  return "unknown";
}

TargetInfo target_info(TileTarget target, int cores) {
  TargetInfo info;
  info.target = target;
  if (target == TileTarget::kAscendA2) {
    info.cores = cores > 0 ? cores : 48;
    info.buffer_total_bytes = 192 * kKiB;
    info.reserve_bytes = 16 * kKiB;
    info.buffers = 2;
  } else if (target == TileTarget::kGpu) {
    info.cores = cores > 0 ? cores : 132;  // H200
    info.programs_per_core = kGpuProgramsPerSm;
    info.buffer_total_bytes = kGpuProgramBytes;
    info.reserve_bytes = 0;
    info.buffers = 1;
  } else {
    static const unsigned hw = std::thread::hardware_concurrency();  // sysfs reads: once
    info.cores = cores > 0 ? cores : static_cast<int>(hw > 0 ? hw : 1);
    // Half of the per-core L2 for the tiles: the other half streams.
    info.buffer_total_bytes = cpu_l2_bytes();
    info.reserve_bytes = info.buffer_total_bytes / 2;
    info.buffers = 1;
  }
  return info;
}

int64_t tile_buffer_bytes(TileOp op, const TileConfig& config, DType dtype) {
  return config.buffers *
         stage_bytes(op, config.sub_block_rows, config.block_x, static_cast<int64_t>(element_size(dtype)));
}

TileConfig tile_config(const TargetInfo& target, TileOp op, int64_t hidden, DType dtype) {
  const int64_t elem = static_cast<int64_t>(element_size(dtype));
  const int64_t align = kTransferBytes / elem;  // elements per 32 bytes
  TileConfig c;
  c.programs = std::max(1, target.cores) * std::max(1, target.programs_per_core);
  c.buffers = std::max(1, target.buffers);
  c.buffer_bytes = target.buffer_total_bytes - target.reserve_bytes;
  const int64_t per_stage = c.buffer_bytes / c.buffers;

  int64_t block_x = index::round_up(std::max<int64_t>(1, std::min(hidden, max_block_x(target.target, op))), align);
  while (block_x > align && stage_bytes(op, 1, block_x, elem) > per_stage) block_x -= align;
  c.block_x = static_cast<int>(block_x);

  int64_t rows = 1;
  if (!(op == TileOp::kWgrad && hidden > block_x)) {
    const OpShape s = op_shape(op);
    const int64_t fixed = s.f32_temps * block_x * 4;
    const int64_t per_row = s.row_slices * block_x * elem + s.index_bytes;
    rows = std::max<int64_t>(1, std::min<int64_t>(kMaxSubBlockRows, (per_stage - fixed) / per_row));
  }
  c.sub_block_rows = static_cast<int>(rows);
  validate_tile_config(op, c, hidden, dtype);
  return c;
}

void validate_tile_config(TileOp op, const TileConfig& c, int64_t hidden, DType dtype) {
  const int64_t elem = static_cast<int64_t>(element_size(dtype));
  auto fail = [&](const std::string& what) {
    throw Error(ErrorKind::kValue, std::string("tile config (") + tile_op_name(op) + ", H=" + std::to_string(hidden) +
                                       ", " + dtype_name(dtype) + "): " + what);
  };
  if (c.programs < 1) fail("programs must be >= 1, got " + std::to_string(c.programs));
  if (c.buffers < 1) fail("buffers must be >= 1, got " + std::to_string(c.buffers));
  if (c.block_x < 1) fail("block_x must be >= 1, got " + std::to_string(c.block_x));
  if (c.sub_block_rows < 1) fail("sub_block_rows must be >= 1, got " + std::to_string(c.sub_block_rows));
  if ((c.block_x * elem) % kTransferBytes != 0) {
    fail("block_x * element_size = " + std::to_string(c.block_x * elem) + " bytes is not a multiple of 32 bytes");
  }
  const int64_t used = tile_buffer_bytes(op, c, dtype);
  if (used > c.buffer_bytes) {
    fail("buffers need " + std::to_string(used) + " bytes but the budget is " + std::to_string(c.buffer_bytes) +
         " bytes");
  }
  if (op == TileOp::kWgrad && hidden > c.block_x && c.sub_block_rows != 1) {
    fail("wgrad accumulates across column tiles (H=" + std::to_string(hidden) + " > block_x=" +
         std::to_string(c.block_x) + ") so sub_block_rows must be 1, got " + std::to_string(c.sub_block_rows));
  }
}

std::string describe_tile_config(TileOp op, const TileConfig& c, int64_t hidden, DType dtype) {
  // snprintf, not iostreams: an ostringstream's integer insertion crashed inside padmoe._C on the
  // H200 machine (Ubuntu 24.04, g++ 13, python3.12: a broken num_put facet in the extension).
  const int64_t elem = static_cast<int64_t>(element_size(dtype));
  const int64_t used = tile_buffer_bytes(op, c, dtype);
  const double pct = c.buffer_bytes > 0 ? 100.0 * static_cast<double>(used) / static_cast<double>(c.buffer_bytes) : 0.0;
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "op              %s\n"
                "hidden (H)      %lld x %s (%lld B)\n"
                "programs        %d  (each owns sorted positions [pid*B, min((pid+1)*B, A)), B = ceil(A/%d))\n"
                "sub_block_rows  %d\n"
                "block_x         %d elements = %lld B (multiple of 32 B), %lld column tile(s) per row\n"
                "buffers         %d%s\n"
                "buffer budget   %lld of %lld bytes used (%.1f%%)\n",
                tile_op_name(op), static_cast<long long>(hidden), dtype_name(dtype), static_cast<long long>(elem),
                c.programs, c.programs, c.sub_block_rows, c.block_x, static_cast<long long>(c.block_x * elem),
                static_cast<long long>(index::num_column_tiles(hidden, c.block_x)), c.buffers,
                c.buffers > 1 ? " (multi-buffered)" : "", static_cast<long long>(used),
                static_cast<long long>(c.buffer_bytes), pct);
  return std::string(buf);
}

}  // namespace padmoe
