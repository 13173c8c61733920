// padmoe/tiling.hpp — the tile planner of docs/spec.md §15 (the Ascend design, kept).
//
// A program (an NPU vector core, a CPU thread) owns the contiguous range of
// sorted positions [pid*B, min((pid+1)*B, A)), B = ceil(A / programs), and
// steps `sub_block_rows` rows and `block_x` columns at a time through an
// on-chip buffer (the Ascend Unified Buffer; on a CPU, its per-core L2).
//
// Rules, enforced by validate_tile_config and tested:
//   1. block_x * element_size is a multiple of 32 bytes (a tail tile of a
//      row may be shorter); block_x >= 1, sub_block_rows >= 1, programs >= 1.
//   2. the buffer budget tile_buffer_bytes(op, config, dtype) =
//        buffers * (rows * (row_slices * block_x * s + index_bytes)
//                   + f32_temps * block_x * 4)
//      stays within buffer_bytes, with per op:
//        gather:  row_slices 1 (x slice), index 8 (token, dest row), f32 temps 1 (weighted row)
//        scatter: row_slices 1 (y slice), index 8 (assignment, weight), f32 temps 2 (accumulator, row)
//        wgrad:   row_slices 2 (y and grad slices), index 8, f32 temps 1 (products)
//   3. wgrad accumulates across column tiles, so sub_block_rows == 1 when H > block_x.
#pragma once

#include <cstdint>
#include <string>

#include "padmoe/tensor.hpp"

namespace padmoe {

enum class TileTarget { kCpu, kAscendA2, kGpu };
enum class TileOp { kGather, kScatter, kWgrad };

const char* tile_target_name(TileTarget target);  // "cpu", "ascend-a2", "gpu"
// "cpu" / "ascend-a2" / "ascend" / "gpu" -> target; false when the name is none of them.
bool parse_tile_target(const std::string& name, TileTarget* target);
const char* tile_op_name(TileOp op);              // "gather", "scatter", "wgrad"

struct TileConfig {
  int programs = 1;        // parallel programs (vector cores / threads)
  int sub_block_rows = 1;  // rows per step (SUB_BLOCK_SIZE)
  int block_x = 1;         // columns per step (BLOCK_X), elements
  int64_t buffer_bytes = 0;  // on-chip budget for the op's buffers (UB minus reserve; CPU: L2 share)
  int buffers = 1;         // 2 = double-buffered
};

// What a target offers. Ascend A2: 48 vector cores (pass the count queried
// at run time when it differs), 192 KiB UB with 16 KiB kept in reserve,
// double-buffered. CPU: its hardware threads and per-core L2 size, single-buffered.
// GPU (padmoe.triton's kernels on an NVIDIA GPU): its SMs (132 on an H200
// unless the count queried at run time is passed), several programs resident
// per SM, each with a register-file share as its buffer, single-buffered (the
// other resident programs hide the latency).
struct TargetInfo {
  TileTarget target = TileTarget::kCpu;
  int cores = 1;
  int programs_per_core = 1;       // programs = cores * programs_per_core
  int64_t buffer_total_bytes = 0;  // UB / L2 per core
  int64_t reserve_bytes = 0;
  int buffers = 1;
};
// cores == 0: the target's default (Ascend A2: 48; CPU: hardware threads).
TargetInfo target_info(TileTarget target, int cores = 0);

// Bytes the op's buffers take under `config` (rule 2's left-hand side).
int64_t tile_buffer_bytes(TileOp op, const TileConfig& config, DType dtype);

// The planner: block_x = round_up(min(H, max_block_x(op)), 32 bytes), shrunk
// in 32-byte steps until one row fits; sub_block_rows = the most rows that
// fit the budget (capped at 256; 1 for wgrad when H > block_x).
// max_block_x: Ascend gather 20000 / scatter 6144 / wgrad 5120 (the
// Triton-Ascend tutorial's); CPU 16384 / 64 / 4096.
TileConfig tile_config(const TargetInfo& target, TileOp op, int64_t hidden, DType dtype);
// Deprecated name of tile_config (removed in the next release).
[[deprecated("use tile_config")]] inline TileConfig plan_tiles(const TargetInfo& target, TileOp op, int64_t hidden,
                                                               DType dtype) {
  return tile_config(target, op, hidden, dtype);
}

// Throws padmoe::Error (kValue) naming the first rule `config` breaks.
void validate_tile_config(TileOp op, const TileConfig& config, int64_t hidden, DType dtype);

// A one-paragraph human description (used by `padmoe tiles`).
std::string describe_tile_config(TileOp op, const TileConfig& config, int64_t hidden, DType dtype);

}  // namespace padmoe
