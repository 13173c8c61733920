// common.cpp — the CLI's shared helpers (common.hpp).
#include "common.hpp"

#include "core/kernel_overrides.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <ctime>
#include <thread>

namespace cli {

DType parse_dtype(const std::string& s) {
  if (s == "f32" || s == "float32" || s == "fp32") return DType::kFloat32;
  if (s == "f16" || s == "float16" || s == "fp16" || s == "half") return DType::kFloat16;
  if (s == "bf16" || s == "bfloat16") return DType::kBFloat16;
  throw UsageError("--dtype expects f32, f16 or bf16, got '" + s + "'");
}

// Significand bits of a row dtype (p of the tolerance rule) and half its
// smallest subnormal (the absolute rounding error near zero).
int significand_bits(DType d) { return d == DType::kFloat16 ? 11 : d == DType::kBFloat16 ? 8 : 24; }
double half_min_subnormal(DType d) {
  return d == DType::kFloat16    ? std::ldexp(1.0, -25)
         : d == DType::kBFloat16 ? std::ldexp(1.0, -134)
                                 : std::ldexp(1.0, -150);
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

int hardware_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string apply_variants(const Args& args) {
  const std::string all = args.get("variant", "");
  if (all.empty()) return all;
  if (all == "help") {
    std::printf("--variant keys: %s\n", padmoe::detail::variant_keys().c_str());
    std::exit(0);
  }
  padmoe::detail::KernelOverrides o = padmoe::detail::kernel_overrides();
  size_t start = 0;
  while (start <= all.size()) {
    const size_t comma = all.find(',', start);
    const std::string pair = all.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t eq = pair.find('=');
    if (eq == std::string::npos) throw UsageError("--variant expects KEY=VALUE, got '" + pair + "'");
    std::string error;
    if (!padmoe::detail::set_kernel_variant(o, pair.substr(0, eq), pair.substr(eq + 1), &error))
      throw UsageError(error);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  padmoe::detail::kernel_overrides() = o;
  return all;
}

}  // namespace cli
