// backend_types.hpp — the argument types the CPU and CUDA backends share (raw pointers and sizes;
// no CUDA header): a row matrix, a per-row scale, a per-assignment float output, scale rows moved
// with their data rows, and a plan's int32 arrays. The API layer builds them from checked views;
// cpu_backend.hpp and cuda_backend.hpp take them (the CUDA kernels by value).
#pragma once

#include <cstdint>
#include <optional>

#include "padmoe/config.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"

namespace padmoe {
namespace backend {

// A [rows, cols] row matrix with a byte row stride.
struct RowsRef {
  void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride_bytes = 0;
  DType dtype = DType::kFloat32;
  // CUDA only, set by the launchers (with_l2_prefetch): the grid's first l2_blocks blocks ask L2 for
  // every row (l2_bytes bytes each) before the kernel's wait; l2_bytes 0: not.
  uint32_t l2_bytes = 0;
  int32_t l2_blocks = 0;

  // Rows without columns hold no bytes and may have null data: their stride is taken as 0, so
  // row(r) is the data pointer itself (an offset from null would be undefined behaviour).
  static RowsRef of(const TensorView& t) {
    const int64_t stride = t.shape[1] == 0 ? 0 : t.strides[0] * static_cast<int64_t>(element_size(t.dtype));
    return RowsRef{t.data, t.shape[0], t.shape[1], stride, t.dtype};
  }
  char* row(int64_t r) const { return static_cast<char*>(data) + r * stride_bytes; }  // host
  int64_t row_bytes() const { return cols * static_cast<int64_t>(element_size(dtype)); }
};

// Optional per-row scale (router weights, probs): float32 or a row dtype; data null = 1.
struct Scale {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  static Scale of(const std::optional<TensorView>& t) { return t ? Scale{t->data, t->dtype} : Scale{}; }
  bool present() const { return data != nullptr; }
  float at(int64_t i) const;  // host (src/cpu/rows_cpu.cpp); 1 when absent
};

// Optional per-assignment float output (weight gradients): float32 or a row dtype; data null = skip.
struct FloatOut {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  void store(int64_t i, float v) const;  // host (src/cpu/rows_cpu.cpp)
};

// Optional scale rows moved with the data rows (the `_scaled` ops): src one contiguous row of
// `cols` entries per source row, dst one per output row, `elem` bytes an entry (4: float32, 1:
// E8M0); output rows that get zero data get `one` (the bits of a scale 1: 0x3f800000, or 127) in
// every entry of their scale row.
struct ScaleRows {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t cols = 0;
  int elem = 4;
  uint32_t one = 0;
  void copy(int64_t to, int64_t from) const;  // host: dst row `to` = src row `from`
  void fill_one(int64_t to) const;            // host: dst row `to` = scale 1
};

// Router probabilities moved with a plan's rows (mask_plan_out with probs): moved[r] = probs[a] for
// the assignment a in row r, 0 in the rows that hold none; elements of `bytes` bytes (2: float16 /
// bfloat16, 4: float32) copied as bits. probs null: nothing moved. nonzero (optional, float32 per
// assignment): 1 where the assignment has a row and its prob is nonzero (NaN included), else 0.
struct MovedProbs {
  const void* probs = nullptr;
  void* moved = nullptr;
  int bytes = 0;
  float* nonzero = nullptr;
};

// Whether a prob of `bytes` bytes (its bits, or the one at p) is nonzero as a number: any bit but
// the sign set (a NaN is nonzero, -0 is zero), for float32, float16 and bfloat16 alike.
PADMOE_HD bool prob_bits_nonzero(uint32_t bits, int bytes) {
  return (bits & (bytes == 4 ? 0x7fffffffu : 0x7fffu)) != 0u;
}
PADMOE_HD bool prob_nonzero(const void* p, int bytes) {
  return prob_bits_nonzero(bytes == 4 ? *static_cast<const uint32_t*>(p) : *static_cast<const uint16_t*>(p), bytes);
}

// The int32 arrays a make_plan writes: the plan's eight and the optional layouts (null when not
// asked for).
struct PlanArrays {
  int32_t* tokens_per_expert = nullptr;
  int32_t* bins = nullptr;
  int32_t* padded_tokens = nullptr;
  int32_t* padded_bins = nullptr;
  int32_t* indices = nullptr;
  int32_t* bin_ids = nullptr;
  int32_t* dest_rows = nullptr;
  int32_t* row_sources = nullptr;
  int32_t* row_experts = nullptr;
  int32_t* block_experts = nullptr;
  int64_t blocks = 0;  // block_experts' entries
  int32_t* padded_total = nullptr;

  static PlanArrays of(const PlanView& out, const PlanLayouts& layouts) {
    PlanArrays a;
    a.tokens_per_expert = out.tokens_per_expert.data_as<int32_t>();
    a.bins = out.bins.data_as<int32_t>();
    a.padded_tokens = out.padded_tokens_per_expert.data_as<int32_t>();
    a.padded_bins = out.padded_bins.data_as<int32_t>();
    a.indices = out.indices.data_as<int32_t>();
    a.bin_ids = out.bin_ids.data_as<int32_t>();
    a.dest_rows = out.dest_rows.data_as<int32_t>();
    a.row_sources = out.row_sources.data_as<int32_t>();
    a.row_experts = layouts.row_experts.data_as<int32_t>();
    a.block_experts = layouts.block_experts.data_as<int32_t>();
    a.blocks = layouts.block_experts.numel();
    a.padded_total = layouts.padded_total.data_as<int32_t>();
    return a;
  }
};

}  // namespace backend
}  // namespace padmoe
