#!/usr/bin/env bash
# The whole test suite: installs what it needs, builds the library, the CLI,
# the tests and (when nvcc is on PATH) the CUDA sources, then runs ctest.
# Usage: scripts/test.sh [build-dir]     (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
build=${1:-build}
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
cuda=OFF
if command -v nvcc >/dev/null 2>&1; then cuda=ON; fi
if [ "${PADMOE_REQUIRE_CUDA:-0}" = "1" ] && [ "$cuda" = "OFF" ]; then
  echo "padmoe: PADMOE_REQUIRE_CUDA=1 but nvcc was not found" >&2
  exit 1
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPADMOE_CUDA=$cuda -DPADMOE_BUILD_TESTS=ON -DPADMOE_BUILD_CLI=ON
cmake --build "$build" -j "$(nproc)"
ctest --test-dir "$build" --output-on-failure --no-tests=error -j "$(nproc)"
# The Python package and its tests (scripts/pytest.sh: a virtualenv, pip install ., pytest).
if [ "${PADMOE_SKIP_PYTHON:-0}" != "1" ]; then bash scripts/pytest.sh; fi
