// copy.cpp — padmoe::copy: a byte copy between two contiguous tensors.
#include <string>

#include "api/checks.hpp"
#include "cpu/cpu_backend.hpp"
#include "padmoe/ops.hpp"

namespace padmoe {

void copy(const TensorView& src, const TensorView& dst, const Options& options) {
  detail::Checker c("copy");
  if (src.dtype != dst.dtype) {
    c.fail(ErrorKind::kType, "dst", std::string("expected dtype ") + dtype_name(src.dtype) + ", got " +
                                        dtype_name(dst.dtype));
  }
  if (src.numel() != dst.numel()) {
    c.value_error("dst", "has " + std::to_string(dst.numel()) + " elements but src has " + std::to_string(src.numel()));
  }
  if (!src.is_contiguous()) c.value_error("src", "expected a contiguous tensor");
  if (!dst.is_contiguous()) c.value_error("dst", "expected a contiguous tensor");
  c.same_device(dst, "dst", src.device);
  detail::require_backend(c, src.device);
  cpu::copy_bytes(dst.data, src.data, src.numel() * static_cast<int64_t>(element_size(src.dtype)),
                  options.num_threads);
}

}  // namespace padmoe
