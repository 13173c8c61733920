// workload.hpp — the one table of workload presets (shared by the CLI, the
// tests and the benchmarks) and a seeded, reproducible random router.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "padmoe/tensor.hpp"

namespace padmoe {
namespace workload {

struct Preset {
  std::string name;
  int64_t tokens;  // T
  int experts;     // E
  int top_k;       // K
  int64_t hidden;  // H
  int alignment;   // m
  std::string about;
};

// mixtral-8x7b, qwen3-30b-a3b, deepseek-v3 (T=16384, alignment 128), plus
// decode (T=256, E=256, K=8, H=7168, alignment 16) and awkward (small odd sizes).
const std::vector<Preset>& presets();
// nullptr when unknown.
const Preset* find_preset(const std::string& name);
// The preset used when none is given.
const char* default_preset_name();
// `--small`: the same model with T divided by 8 (at least 1).
Preset small(const Preset& preset);

// A seeded router: logits drawn from a standard normal (splitmix64 +
// Box-Muller, identical on every platform), softmax over E, top-k ids
// (distinct, in descending probability), weights = the top-k probabilities
// renormalised to sum 1.
struct Routing {
  int64_t tokens = 0;
  int top_k = 0;
  std::vector<int32_t> top_experts;  // [T*K]
  std::vector<float> weights;        // [T*K]
};
Routing random_router(int64_t tokens, int experts, int top_k, uint64_t seed);

// Fill n elements of `dtype` with values uniform in [-1, 1) rounded to dtype
// (seeded; identical on every platform).
void fill_uniform(void* data, DType dtype, int64_t n, uint64_t seed);

// splitmix64 step, exposed for tests that want their own streams.
uint64_t splitmix64(uint64_t& state);

}  // namespace workload
}  // namespace padmoe
