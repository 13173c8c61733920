// quant.cu — the quantizing spread's dispatch (dispatch_quantized, quantize): the kernel policy
// (policy::quant_slices, policy::quant_zero_rows) sizes the grid (token blocks, then the blocks that
// zero the padding rows), and quant_spread_kernel is launched for the row dtype, the scale layout
// and the sliced or whole-row form; also the exhaustive check of the fp8 conversion for the tests.
// The kernels: quant_kernels.cuh.
#include <algorithm>
#include <memory>
#include <type_traits>

#include "cuda/quant_kernels.cuh"

namespace padmoe {
namespace cuda {
namespace {

template <typename T, int kMode, bool kSliced>
struct QuantTag {
  static constexpr auto fn = quant_spread_kernel<T, kMode, kSliced>;
};

}  // namespace

int64_t fp8_convert_mismatches(bool e5m2, uint32_t* first_bits, int64_t* compared) {
  const char* what = "fp8_convert_mismatches";
  struct Free {
    void operator()(void* p) const { cudaFree(p); }
  };
  void* raw = nullptr;  // [mismatches, patterns compared] (64-bit), then the first mismatch's bits
  check_cuda(cudaMalloc(&raw, 3 * sizeof(unsigned long long)), what);
  const std::unique_ptr<void, Free> buffer(raw);  // freed on every exit, a throw included
  unsigned long long* d_counts = static_cast<unsigned long long*>(raw);
  unsigned* d_first = reinterpret_cast<unsigned*>(d_counts + 2);
  check_cuda(cudaMemset(d_counts, 0, 2 * sizeof(unsigned long long)), what);
  check_cuda(cudaMemset(d_first, 0xff, sizeof(unsigned)), what);
  launch_kernel("fp8_convert_check_kernel", fp8_convert_check_kernel, 1024u, 256, 0, cudaStream_t{}, e5m2, d_counts,
                d_first, d_counts + 1);
  unsigned long long counts[2] = {0, 0};
  unsigned first = 0;
  check_cuda(cudaMemcpy(counts, d_counts, sizeof(counts), cudaMemcpyDeviceToHost), what);
  check_cuda(cudaMemcpy(&first, d_first, sizeof(first), cudaMemcpyDeviceToHost), what);
  if (first_bits != nullptr) *first_bits = first;
  if (compared != nullptr) *compared = static_cast<int64_t>(counts[1]);
  return static_cast<int64_t>(counts[0]);
}

void quantize_spread_rows(const RowsArg& x, int top_k, const int32_t* dest, const RowsArg& y,
                          const QuantScalesArg& scales, const PaddingRef& padding, bool zero_padding,
                          bool zero_past_end, void* stream) {
  const int64_t tokens = x.rows;
  const bool identity = dest == nullptr;
  // Rows a zero block clears and a token row's blocks: policy::quant_zero_rows, policy::quant_slices.
  const policy::Device dev = device_policy();
  const policy::QuantScaleKind kind = scales.layout == ScaleLayout::kPerRow   ? policy::QuantScaleKind::kPerRow
                                      : scales.layout == ScaleLayout::kMxE8M0 ? policy::QuantScaleKind::kMx
                                                                              : policy::QuantScaleKind::kBlock128;
  const int zero_each = policy::quant_zero_rows(tokens, y.cols, kind, dev);  // y: 1-byte codes
  const int64_t zero_blocks = !identity && (zero_padding || zero_past_end) ? index::ceil_div(y.rows, zero_each) : 0;
  const int slices = policy::quant_slices(tokens, x.cols, kind == policy::QuantScaleKind::kPerRow, dev);
  const int64_t blocks = tokens * slices + zero_blocks;
  if (blocks == 0) return;
  if (x.cols == 0 && scales.layout != ScaleLayout::kPerRow) return;  // no columns, no scale columns: nothing to write
  const bool vec_in = reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.stride_bytes % 16 == 0;
  const bool vec_out = reinterpret_cast<uintptr_t>(y.data) % 8 == 0 && y.stride_bytes % 8 == 0;
  auto launch = [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("quant_spread_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream), x,
                  top_k, dest, y, scales, padding, zero_padding, zero_past_end, vec_in, vec_out, zero_each, slices);
  };
  with_traits(x.dtype, [&](auto traits) {
    using T = decltype(traits);
    auto by_mode = [&](auto mode) {
      constexpr int kM = decltype(mode)::value;
      if constexpr (kM != kPerRowMode) {  // per-row scales: never sliced
        if (slices > 1) {
          launch(QuantTag<T, kM, true>{});
          return;
        }
      }
      launch(QuantTag<T, kM, false>{});
    };
    switch (scales.layout) {
      case ScaleLayout::kPerRow: by_mode(std::integral_constant<int, kPerRowMode>{}); break;
      case ScaleLayout::kBlock128: by_mode(std::integral_constant<int, kBlock128Mode>{}); break;
      case ScaleLayout::kMxE8M0: by_mode(std::integral_constant<int, kMxMode>{}); break;
    }
  });
}

}  // namespace cuda
}  // namespace padmoe
