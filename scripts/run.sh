#!/usr/bin/env bash
# The main job: installs what it needs, builds padmoe, then runs every op on
# the default workload against the reference (`padmoe check`) and times them
# (`padmoe bench`). Extra arguments go to both, e.g.
#   scripts/run.sh --preset deepseek-v3 --small
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
build=build
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPADMOE_BUILD_TESTS=OFF -DPADMOE_BUILD_CLI=ON >/dev/null
cmake --build "$build" -j "$(nproc)" --target padmoe_cli
"$build/padmoe" check "$@"
"$build/padmoe" bench "$@"
