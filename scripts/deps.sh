#!/usr/bin/env bash
# Installs padmoe's build dependencies when they are missing (Debian/Ubuntu):
# a C++17 compiler, CMake >= 3.25, Ninja and GoogleTest. nvcc is optional:
# when present, the CUDA sources are compiled too.
set -euo pipefail

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v g++ >/dev/null 2>&1 || need+=(g++)
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then need+=(libgtest-dev); fi

if [ ${#need[@]} -gt 0 ]; then
  echo "padmoe: installing ${need[*]}" >&2
  sudo_cmd=""
  if [ "$(id -u)" != "0" ]; then sudo_cmd="sudo"; fi
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
fi

# CMake must be >= 3.25.
ver=$(cmake --version | head -n1 | awk '{print $3}')
if [ "$(printf '%s\n' 3.25 "$ver" | sort -V | head -n1)" != "3.25" ]; then
  echo "padmoe: CMake $ver is older than 3.25; installing a newer one from PyPI" >&2
  python3 -m pip install -q "cmake>=3.25"
fi

# The sanitizer job (scripts/sanitize.sh, PADMOE_DEPS_CLANG=1): clang with its sanitizer runtimes.
# Debian ships them with clang; Ubuntu in libclang-rt-<version>-dev.
if [ "${PADMOE_DEPS_CLANG:-0}" = "1" ]; then
  probe_dir=$(mktemp -d)
  echo 'int main() { return 0; }' >"$probe_dir/p.cpp"
  links() { clang++ -fsanitize=address,undefined "$probe_dir/p.cpp" -o "$probe_dir/p" >/dev/null 2>&1; }
  if ! command -v clang++ >/dev/null 2>&1 || ! links; then
    echo "padmoe: installing clang and its sanitizer runtimes" >&2
    sudo_cmd=""
    if [ "$(id -u)" != "0" ]; then sudo_cmd="sudo"; fi
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq clang >/dev/null
    if ! links; then
      major=$(clang++ --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n1)
      DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "libclang-rt-$major-dev" >/dev/null
    fi
    links || { echo "padmoe: clang++ cannot link -fsanitize=address,undefined" >&2; rm -rf "$probe_dir"; exit 1; }
  fi
  rm -rf "$probe_dir"
fi
