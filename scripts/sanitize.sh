#!/usr/bin/env bash
# The CPU test suite built with AddressSanitizer and UndefinedBehaviorSanitizer (CUDA off),
# the second configuration of CI (.ci/run). Any sanitizer report fails the run.
# Usage: scripts/sanitize.sh [build-dir]     (default: build-asan)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
build=${1:-build-asan}
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPADMOE_CUDA=OFF -DPADMOE_BUILD_TESTS=ON \
  -DPADMOE_BUILD_CLI=ON -DPADMOE_BUILD_PYTHON=OFF "-DCMAKE_CXX_FLAGS=$flags" \
  "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined"
cmake --build "$build" -j "$(nproc)"
# install_and_find_package builds an unsanitized consumer against the library: not for this configuration.
ASAN_OPTIONS=abort_on_error=1:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir "$build" --output-on-failure --no-tests=error -j "$(nproc)" -E install_and_find_package
