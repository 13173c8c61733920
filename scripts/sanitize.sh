#!/usr/bin/env bash
# The CPU test suite built with clang's AddressSanitizer and UndefinedBehaviorSanitizer (CUDA off),
# the second configuration of CI (.ci/run). clang, not g++: its UBSan also checks pointer arithmetic
# on null and pointer overflow. Any sanitizer report fails the run; the suite includes the bounded
# fuzzer (fuzz_plan_options).
# Usage: scripts/sanitize.sh [build-dir]     (default: build-asan)
set -euo pipefail
cd "$(dirname "$0")/.."
PADMOE_DEPS_CLANG=1 bash scripts/deps.sh
build=${1:-build-asan}
checks="address,undefined,float-divide-by-zero"
flags="-fsanitize=$checks -fno-sanitize-recover=all -fno-omit-frame-pointer"
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPADMOE_CUDA=OFF \
  -DPADMOE_BUILD_TESTS=ON -DPADMOE_BUILD_CLI=ON -DPADMOE_BUILD_PYTHON=OFF "-DCMAKE_CXX_FLAGS=$flags" \
  "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=$checks" "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=$checks"
cmake --build "$build" -j "$(nproc)"
# install_and_find_package builds an unsanitized consumer against the library: not for this configuration.
ASAN_OPTIONS=abort_on_error=1:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir "$build" --output-on-failure --no-tests=error -j "$(nproc)" -E install_and_find_package
