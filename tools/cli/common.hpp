// common.hpp — what every part of the `padmoe` CLI shares: the parsed command
// line (Args), its usage error, and small formatting helpers.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>

#include "padmoe/padmoe.hpp"

namespace cli {

using namespace padmoe;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Args {
  std::string command;
  std::map<std::string, std::string> values;
  std::set<std::string> flags;

  bool has(const std::string& name) const { return values.count(name) != 0 || flags.count(name) != 0; }
  std::string get(const std::string& name, const std::string& fallback) const {
    auto it = values.find(name);
    return it == values.end() ? fallback : it->second;
  }
  int64_t get_int(const std::string& name, int64_t fallback) const {
    auto it = values.find(name);
    if (it == values.end()) return fallback;
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(it->second.c_str(), &end, 10);
    if (errno != 0 || end == it->second.c_str() || *end != '\0') {
      throw UsageError("--" + name + " expects an integer, got '" + it->second + "'");
    }
    return v;
  }
  // An int flag: out of the int range is a usage error, not a silent truncation.
  int get_int32(const std::string& name, int fallback) const {
    const int64_t v = get_int(name, fallback);
    if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
      throw UsageError("--" + name + " " + std::to_string(v) + " is out of range");
    }
    return static_cast<int>(v);
  }
};

DType parse_dtype(const std::string& s);

// Significand bits of a row dtype (p of the tolerance rule) and half its
// smallest subnormal (the absolute rounding error near zero).
int significand_bits(DType d);
double half_min_subnormal(DType d);

// --variant KEY=VALUE[,KEY=VALUE...]: the kernel overrides (src/core/kernel_overrides.hpp) for
// this process; "help" prints the keys and exits. Returns the pairs as given ("" when none).
std::string apply_variants(const Args& args);

std::string utc_now();
int hardware_threads();
std::string fmt(const char* f, double v);

}  // namespace cli
