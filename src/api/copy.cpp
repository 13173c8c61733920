// copy.cpp — padmoe::copy: a byte copy between two contiguous tensors.
#include <string>

#include "api/checks.hpp"
#include "cpu/cpu_backend.hpp"
#include "cuda/cuda_backend.hpp"
#include "padmoe/ops.hpp"

namespace padmoe {

void copy(const TensorView& src, const TensorView& dst, const Options& options) {
  detail::Checker c("copy");
  if (src.dtype != dst.dtype) {
    c.fail(ErrorKind::kType, "dst",
           std::string("expected dtype ") + dtype_name(src.dtype) + ", got " + dtype_name(dst.dtype));
  }
  if (src.numel() != dst.numel()) {
    c.value_error("dst", "has " + std::to_string(dst.numel()) + " elements but src has " + std::to_string(src.numel()));
  }
  if (src.data == nullptr && src.numel() > 0) c.value_error("src", "null data pointer");
  if (dst.data == nullptr && dst.numel() > 0) c.value_error("dst", "null data pointer");
  if (!src.is_contiguous()) c.value_error("src", "expected a contiguous tensor");
  if (!dst.is_contiguous()) c.value_error("dst", "expected a contiguous tensor");
  detail::require_backend(c, src.device);
  detail::require_backend(c, dst.device);
  detail::check_disjoint(c, dst, "dst", src, "src");
  const int64_t bytes = src.numel() * static_cast<int64_t>(element_size(src.dtype));
  if (src.device.is_cuda() || dst.device.is_cuda()) {  // any direction, ordered on options.stream
    cuda::copy_bytes(dst.data, dst.device, src.data, src.device, static_cast<size_t>(bytes), options.stream);
    return;
  }
  cpu::copy_bytes(dst.data, src.data, bytes, options.num_threads);
}

}  // namespace padmoe
