// main.cpp — the `padmoe` command-line tool: arguments, usage, dispatch.
//
//   padmoe check   run every op of ops.hpp on a workload and compare with the
//                  reference loops (src/reference): moves bitwise, sums within
//                  a stated float32 tolerance of a float64 reference.
//   padmoe bench   time every op (median wall clock) against the copy floor of
//                  docs/spec.md §16: min_bytes / memcpy bandwidth measured in the
//                  same run; also reports padmoe::copy's (streaming) bandwidth
//                  and each op's share of it (%copy). With --device cuda: CUDA
//                  events on one stream, cold L2, check_data=false, a caller
//                  workspace, and the floor is padmoe::copy's device->device
//                  bandwidth measured in the same run; each op is also
//                  captured once into a CUDA graph and its warm back-to-back
//                  replays timed (`graph us`, `graph/floor`), and 20 calls
//                  captured into one graph (`in-graph us`; --no-graph skips both).
//   padmoe tiles   print and validate the tile configuration of docs/spec.md §15
//                  (`padmoe plan`: its deprecated name).
//   padmoe presets list the workload presets (src/workload).
//
// One table, `op_table()`, lists every op once: its name, how to run it into
// preallocated outputs, the bytes it must move and its reference. `check` and
// `bench` both walk that table. The run lambdas work on whichever device the
// Data buffers live on: with --device cuda the workload is built on the host,
// every input is staged with padmoe::copy and the outputs are allocated on the
// GPU; `check` copies each compared output back before comparing.
//
// Exit codes: 0 all good, 1 a check failed (or an op raised an error), 2 a
// usage error or a padmoe::Error outside the per-op runs (e.g. an unsupported
// device).
//
// Files (tools/cli): main.cpp arguments, usage text and dispatch; common.* the
// parsed arguments and small helpers; gpu.* the --device cuda helpers;
// workload_data.* the workload and its buffers (Data); report.* comparison,
// shared printing and JSON; ops_table.* the op table; check.cpp, bench.cpp,
// tiles.cpp, presets.cpp one command each.
#include <cstdio>
#include <exception>
#include <set>
#include <string>

#include "commands.hpp"
#include "common.hpp"

namespace {

using namespace cli;

const char* const kUsage = R"(usage: padmoe <command> [options]

commands:
  check     run every op on a workload and compare with the reference loops
  bench     time every op against the copy floor (docs/spec.md §16): memcpy on
            the CPU; padmoe::copy device->device with --device cuda
  tiles     print and validate a tile configuration (docs/spec.md §15)
  presets   list the workload presets
  help      this text

workload (check, bench):
  --preset NAME          a preset (see `padmoe presets`)
  --tokens T --experts E --top-k K --hidden H --alignment M
                         sizes; each overrides the preset's (default preset
                         mixtral-8x7b)
  --small                divide T by 8; implied when no preset and no size is given
  --dtype f32|f16|bf16   row dtype (default bf16)
  --device cpu|cuda[:N]  (default cpu; cuda needs a build with PADMOE_CUDA=ON)
  --seed S               router and data seed (default 0)
  --threads N            CPU worker threads, 0 = all (default 0)

bench:
  --warmup N             untimed runs per op (default 2; 5 on cuda)
  --iters N              timed runs per op; the median is reported (default 10;
                         50 on cuda, timed with CUDA events, cold L2)
  --no-reference         skip timing the single-threaded CPU reference loops
  --no-graph             cuda: skip the CUDA-graph replay columns (graph us, in-graph us)
  --ops A,B,...          only these ops (names as printed, e.g. combine(w),make_plan)
  --json                 print one JSON object instead of the table
  --variant KEY=VALUE    (check, bench) force one kernel choice for A/B timing, in place
                         of the kernel policy's; repeat it or join pairs with ',' (e.g.
                         --variant reduce=block-wide,pdl=off). Keys: `padmoe bench
                         --variant help`

tiles:
  --target cpu|ascend-a2|gpu (default cpu)
  --hidden H --dtype f32|f16|bf16 (default bf16)
  --op gather|scatter|wgrad (default: all three)
  --cores N              cores / programs (default: the target's)

exit status: 0 ok, 1 a check failed, 2 usage or setup error
)";

const std::set<std::string> kValueOptions = {"preset", "tokens", "experts", "top-k",   "hidden", "alignment",
                                             "dtype",  "device", "seed",    "threads", "warmup", "iters",
                                             "target", "op",     "cores",   "ops",     "variant"};
const std::set<std::string> kFlagOptions = {"small", "json", "no-reference", "no-graph", "help"};

Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string tok = argv[i];
    if (tok == "-h") tok = "--help";
    if (tok.rfind("--", 0) != 0) {
      if (!args.command.empty()) throw UsageError("unexpected argument '" + tok + "'");
      args.command = tok;
      continue;
    }
    std::string name = tok.substr(2), value;
    bool has_value = false;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (kFlagOptions.count(name)) {
      if (has_value) throw UsageError("--" + name + " takes no value");
      args.flags.insert(name);
    } else if (kValueOptions.count(name)) {
      if (!has_value) {
        if (i + 1 >= argc) throw UsageError("--" + name + " needs a value");
        value = argv[++i];
      }
      if (name == "variant" && args.values.count(name)) value = args.values[name] + "," + value;  // repeated
      args.values[name] = value;
    } else {
      throw UsageError("unknown option '--" + name + "'");
    }
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse_args(argc, argv);
    if (args.has("help") || args.command.empty() || args.command == "help") {
      const bool asked = args.has("help") || args.command == "help";
      std::fputs(kUsage, asked ? stdout : stderr);
      return asked ? 0 : 2;
    }
    if (args.command == "check") return cmd_check(args);
    if (args.command == "bench") return cmd_bench(args);
    if (args.command == "tiles") return cmd_tiles(args);
    if (args.command == "plan") {  // deprecated name of tiles (removed in the next release)
      std::fputs("padmoe: `padmoe plan` is deprecated: use `padmoe tiles`\n", stderr);
      return cmd_tiles(args);
    }
    if (args.command == "presets") return cmd_presets();
    throw UsageError("unknown command '" + args.command + "'");
  } catch (const UsageError& e) {
    std::fprintf(stderr, "padmoe: error: %s\n(see `padmoe --help`)\n", e.what());
    return 2;
  } catch (const Error& e) {
    std::fprintf(stderr, "padmoe: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "padmoe: error: %s\n", e.what());
    return 2;
  }
}
