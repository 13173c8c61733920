// presets.cpp — `padmoe presets`: list the workload presets (src/workload).
#include <cinttypes>
#include <cstdio>

#include "commands.hpp"
#include "workload/workload.hpp"

namespace cli {

int cmd_presets() {
  std::printf("%-15s %7s %5s %3s %6s %4s  %s\n", "preset", "T", "E", "K", "H", "m", "about");
  for (const workload::Preset& p : workload::presets()) {
    std::printf("%-15s %7" PRId64 " %5d %3d %6" PRId64 " %4d  %s%s\n", p.name.c_str(), p.tokens, p.experts, p.top_k,
                p.hidden, p.alignment, p.about.c_str(), p.name == workload::default_preset_name() ? " (default)" : "");
  }
  std::printf(
      "\n--small divides T by 8; with no --preset and no size flags, check and bench use\n"
      "%s --small.\n",
      workload::default_preset_name());
  return 0;
}

}  // namespace cli
