// commands.hpp — the `padmoe` commands, one file each; main.cpp dispatches to them.
#pragma once

#include "common.hpp"

namespace cli {

int cmd_check(const Args& args);    // check.cpp
int cmd_bench(const Args& args);    // bench.cpp
int cmd_tiles(const Args& args);    // tiles.cpp
int cmd_presets();                  // presets.cpp

}  // namespace cli
