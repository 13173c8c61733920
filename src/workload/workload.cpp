// workload.cpp — the preset table and the seeded router of workload.hpp.
//
// Reproducibility: every random number comes from splitmix64, converted to
// doubles with exact integer arithmetic; the only libm calls are log, cos,
// sin and exp on doubles in the router (Box-Muller and softmax). Those are
// correctly rounded or within an ulp on every mainstream libm, far below the
// gaps that decide a top-k choice, so the same seed gives the same routing
// everywhere. No <random> distributions are used (their output is
// implementation-defined).
#include "workload/workload.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "padmoe/numeric.hpp"

namespace padmoe {
namespace workload {

const std::vector<Preset>& presets() {
  static const std::vector<Preset> kPresets = {
      {"mixtral-8x7b", 16384, 8, 2, 4096, 128, "Mixtral 8x7B: 8 experts, top-2, hidden 4096"},
      {"qwen3-30b-a3b", 16384, 128, 8, 2048, 128, "Qwen3-30B-A3B: 128 experts, top-8, hidden 2048"},
      {"deepseek-v3", 16384, 256, 8, 7168, 128, "DeepSeek-V3: 256 routed experts, top-8, hidden 7168"},
      {"decode", 256, 256, 8, 7168, 16, "DeepSeek-V3-shaped decode step: 256 tokens, alignment 16"},
      {"awkward", 1000, 7, 3, 33, 8, "odd sizes: 7 experts, top-3, hidden 33, alignment 8"},
  };
  return kPresets;
}

const Preset* find_preset(const std::string& name) {
  for (const Preset& p : presets()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

const char* default_preset_name() { return "mixtral-8x7b"; }

Preset small(const Preset& preset) {
  Preset p = preset;
  p.tokens = std::max<int64_t>(1, preset.tokens / 8);
  return p;
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

namespace {

// Uniform in [0, 1) with 53 random bits (exact conversion).
double uniform01(uint64_t& state) { return static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53; }

// Standard normals by Box-Muller; each pair of uniforms gives two values.
class NormalStream {
 public:
  explicit NormalStream(uint64_t seed) : state_(seed) {}
  double next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - uniform01(state_);  // (0, 1]: log is finite
    const double u2 = uniform01(state_);
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double theta = 6.283185307179586476925286766559 * u2;
    spare_ = r * std::sin(theta);
    has_spare_ = true;
    return r * std::cos(theta);
  }

 private:
  uint64_t state_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

}  // namespace

Routing random_router(int64_t tokens, int experts, int top_k, uint64_t seed) {
  if (tokens < 0) throw std::invalid_argument("random_router: tokens must be >= 0");
  if (experts < 1) throw std::invalid_argument("random_router: experts must be >= 1");
  if (top_k < 1 || top_k > experts) throw std::invalid_argument("random_router: top_k must be in [1, experts]");

  Routing r;
  r.tokens = tokens;
  r.top_k = top_k;
  r.top_experts.resize(static_cast<size_t>(tokens) * top_k);
  r.weights.resize(static_cast<size_t>(tokens) * top_k);

  NormalStream normal(seed);
  std::vector<double> prob(experts);
  std::vector<char> taken(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    // Softmax over the logits (max-shifted).
    double max_logit = -INFINITY;
    for (int e = 0; e < experts; ++e) {
      prob[e] = normal.next();
      max_logit = std::max(max_logit, prob[e]);
    }
    double total = 0.0;
    for (int e = 0; e < experts; ++e) {
      prob[e] = std::exp(prob[e] - max_logit);
      total += prob[e];
    }
    for (int e = 0; e < experts; ++e) prob[e] /= total;

    // Top-k by descending probability, ties to the lower id (K passes: K <= E is small).
    std::fill(taken.begin(), taken.end(), 0);
    double picked_sum = 0.0;
    const size_t row = static_cast<size_t>(t) * top_k;
    for (int k = 0; k < top_k; ++k) {
      int best = -1;
      for (int e = 0; e < experts; ++e) {
        if (!taken[e] && (best < 0 || prob[e] > prob[best])) best = e;
      }
      taken[best] = 1;
      r.top_experts[row + k] = best;
      picked_sum += prob[best];
    }
    for (int k = 0; k < top_k; ++k) {
      r.weights[row + k] = static_cast<float>(prob[r.top_experts[row + k]] / picked_sum);
    }
  }
  return r;
}

void fill_uniform(void* data, DType dtype, int64_t n, uint64_t seed) {
  uint64_t state = seed;
  for (int64_t i = 0; i < n; ++i) {
    // 24 random bits: -1 + j * 2^-23, exact in float.
    const float v = static_cast<float>(static_cast<int64_t>(splitmix64(state) >> 40) - (int64_t{1} << 23)) * 0x1.0p-23f;
    numeric::store_from_float(data, dtype, i, v);
  }
}

}  // namespace workload
}  // namespace padmoe
