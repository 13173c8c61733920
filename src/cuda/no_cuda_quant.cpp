// no_cuda_quant.cpp — dispatch_quantized's CUDA entry point in a build
// without CUDA (PADMOE_CUDA=OFF): never reached (require_backend rejects CUDA
// tensors first); throws in case it is.
#include "cuda/quant_backend.hpp"
#include "padmoe/error.hpp"

namespace padmoe {
namespace cuda {

void quantize_spread_rows(const RowsArg&, int, const int32_t*, const RowsArg&, const QuantScalesArg&, const PaddingRef&,
                          bool, bool, void*) {
  throw Error(ErrorKind::kUnsupported, "quantize_spread_rows: padmoe was built without CUDA (PADMOE_CUDA=OFF)");
}
int64_t fp8_convert_mismatches(bool, uint32_t*, int64_t*) {
  throw Error(ErrorKind::kUnsupported, "fp8_convert_mismatches: padmoe was built without CUDA (PADMOE_CUDA=OFF)");
}

}  // namespace cuda
}  // namespace padmoe
