// rng.hpp — the seeded RNG (splitmix64) of padmoe's tests and fuzzers, independent of the
// workload library and of GoogleTest.
#pragma once

#include <cstdint>

namespace pt {

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t below(int64_t n) { return n <= 0 ? 0 : static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  // uniform in [lo, hi)
  double uniform(double lo = -1.0, double hi = 1.0) {
    return lo + (hi - lo) * (static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0));
  }
};

}  // namespace pt
