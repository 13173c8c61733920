// utility_ops.cpp — padmoe._C's utilities: tile_config (the tile planner's TileConfig as a dict) and
// copy.
#include "common.hpp"
#include "padmoe/tiling.hpp"

namespace padmoe_ext {

void bind_utilities(nb::module_& m) {
  m.def(
      "tile_config",
      [](const std::string& target, const std::string& op, int64_t hidden, const std::string& dtype, int cores) {
        const char* name = "tile_config";
        padmoe::TileTarget t = padmoe::TileTarget::kCpu;
        if (!padmoe::parse_tile_target(target, &t))
          fail(ErrorKind::kValue, name, "target", "expected 'cpu', 'ascend-a2' or 'gpu', got '" + target + "'");
        padmoe::TileOp o = padmoe::TileOp::kGather;
        if (op == "scatter") o = padmoe::TileOp::kScatter;
        else if (op == "wgrad") o = padmoe::TileOp::kWgrad;
        else if (op != "gather")
          fail(ErrorKind::kValue, name, "op", "expected 'gather', 'scatter' or 'wgrad', got '" + op + "'");
        DType d = DType::kFloat32;
        if (dtype == "float16") d = DType::kFloat16;
        else if (dtype == "bfloat16") d = DType::kBFloat16;
        else if (dtype != "float32")
          fail(ErrorKind::kType, name, "dtype", "expected 'float32', 'float16' or 'bfloat16', got '" + dtype + "'");
        if (hidden < 0) fail(ErrorKind::kValue, name, "hidden", "must be >= 0, got " + std::to_string(hidden));
        if (cores < 0) fail(ErrorKind::kValue, name, "cores", "must be >= 0, got " + std::to_string(cores));
        const padmoe::TileConfig c = padmoe::tile_config(padmoe::target_info(t, cores), o, hidden, d);
        nb::dict r;
        r["programs"] = c.programs;
        r["sub_block_rows"] = c.sub_block_rows;
        r["block_x"] = c.block_x;
        r["buffer_bytes"] = c.buffer_bytes;
        r["buffers"] = c.buffers;
        r["describe"] = padmoe::describe_tile_config(o, c, hidden, d);
        return r;
      },
      nb::arg("target"), nb::arg("op"), nb::arg("hidden"), nb::arg("dtype"), nb::arg("cores") = 0,
      "The tile planner's TileConfig (docs/spec.md §15) as a dict, for target 'cpu', 'ascend-a2' or 'gpu', op "
      "'gather' / 'scatter' / 'wgrad', hidden size and row dtype; cores = 0: the target's default (CPU threads; "
      "48 vector cores; 132 SMs).");
  // --- utilities ---------------------------------------------------------------

  m.def(
      "copy",
      [](const In& src, const Out& dst, PADMOE_OPTION_PARAMS) {
        const char* op = "copy";
        const TensorView vs = to_view(src, op, "src"), vd = to_view(dst, op, "dst");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::copy(vs, vd, o);
      },
      nb::arg("src"), nb::arg("dst"), PADMOE_OPTIONS);
}

}  // namespace padmoe_ext
