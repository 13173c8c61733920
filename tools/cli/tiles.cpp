// tiles.cpp — `padmoe tiles`: print and validate the tile configuration of docs/spec.md §15.
#include <cinttypes>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"

namespace cli {

int cmd_tiles(const Args& args) {
  const std::string target_name = args.get("target", "cpu");
  TileTarget target;
  if (!parse_tile_target(target_name, &target))
    throw UsageError("--target expects cpu, ascend-a2 or gpu, got '" + target_name + "'");
  if (!args.has("hidden")) throw UsageError("tiles needs --hidden H");
  const int64_t hidden = args.get_int("hidden", 0);
  if (hidden < 1) throw UsageError("--hidden must be >= 1");
  const DType dtype = parse_dtype(args.get("dtype", "bf16"));
  const int cores = static_cast<int>(args.get_int("cores", 0));
  if (cores < 0) throw UsageError("--cores must be >= 0");

  std::vector<TileOp> tile_ops;
  const std::string op_name = args.get("op", "all");
  if (op_name == "gather") tile_ops = {TileOp::kGather};
  else if (op_name == "scatter") tile_ops = {TileOp::kScatter};
  else if (op_name == "wgrad") tile_ops = {TileOp::kWgrad};
  else if (op_name == "all") tile_ops = {TileOp::kGather, TileOp::kScatter, TileOp::kWgrad};
  else throw UsageError("--op expects gather, scatter or wgrad, got '" + op_name + "'");

  const TargetInfo info = target_info(target, cores);
  std::printf("target %s: %d cores x %d program(s), buffer %" PRId64 " B per program, %" PRId64
              " B reserved, %d buffer(s)\n",
              tile_target_name(info.target), info.cores, info.programs_per_core, info.buffer_total_bytes,
              info.reserve_bytes, info.buffers);
  int invalid = 0;
  for (TileOp op : tile_ops) {
    const TileConfig c = tile_config(info, op, hidden, dtype);
    std::printf("\n%s, hidden %" PRId64 ", %s:\n", tile_op_name(op), hidden, dtype_name(dtype));
    std::printf("  TileConfig{programs=%d, sub_block_rows=%d, block_x=%d, buffer_bytes=%" PRId64 ", buffers=%d}\n",
                c.programs, c.sub_block_rows, c.block_x, c.buffer_bytes, c.buffers);
    const int64_t used = tile_buffer_bytes(op, c, dtype);
    std::printf("  tile_buffer_bytes %" PRId64 " <= buffer_bytes %" PRId64 "? %s\n", used, c.buffer_bytes,
                used <= c.buffer_bytes ? "yes" : "NO");
    std::istringstream description(describe_tile_config(op, c, hidden, dtype));
    for (std::string line; std::getline(description, line);) {
      if (!line.empty()) std::printf("  | %s\n", line.c_str());
    }
    try {
      validate_tile_config(op, c, hidden, dtype);
      std::printf("  valid: yes\n");
    } catch (const Error& e) {
      std::printf("  valid: NO: %s\n", e.what());
      ++invalid;
    }
  }
  return invalid == 0 ? 0 : 1;
}

}  // namespace cli
