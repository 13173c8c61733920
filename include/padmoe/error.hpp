// padmoe/error.hpp — the one exception type padmoe throws.
//
// Every argument error is raised before the op writes anything. Messages
// name the op, the argument, what was expected and the first offending
// position, e.g.
//   "padded_gather: padded_bins: segment of expert 3 holds 5 rows but the
//    expert has 7 assignments"
// The kind lets bindings map errors onto their language (kValue ->
// ValueError, kType -> TypeError).
#pragma once

#include <stdexcept>
#include <string>

namespace padmoe {

enum class ErrorKind {
  kValue,        // a value or shape is wrong (bad expert id, short buffer, ...)
  kType,         // a dtype or device is wrong
  kUnsupported,  // valid request this build cannot serve (e.g. CUDA without PADMOE_CUDA)
  kRuntime,      // the backend failed (allocation, CUDA error)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace padmoe
