// cuda_fixture.hpp — what the GPU test suite's files share. The suite is padmoe_cuda_tests, not
// registered with ctest (CI has no GPU): scripts run it on the GPU machine. Without a CUDA device
// every test skips (REQUIRE_GPU). Its files, one a domain:
//   test_cuda_every_op.cpp   CpuVsGpu: every op on CPU and GPU from the same inputs over a list of
//                            workloads; Determinism: every op twice, bitwise equal
//   test_cuda_rows.cpp       dispatch / combine, padded_gather / padded_scatter and their backward:
//                            each kernel family's choices, row slices, the sorted routing's two
//                            forms, zero_padding / zero_tail, a DeepSeek-V3-like step
//   test_cuda_plan.cpp       make_plan's kernel paths and PlanOptions, make_plan_and_dispatch
//   test_cuda_layouts.cpp    make_plan's layouts, moe_align_block_size, batched_moe_align_block_size
//   test_cuda_mask_plan.cpp  mask_plan (TransformerEngine's mask map)
//   test_cuda_index_plan.cpp index_plan (TransformerEngine's index map without a number of experts)
//   test_cuda_padding.cpp    pad_to_alignment / unpad_from_alignment
//   test_cuda_chunks.cpp     sort_chunks / unsort_chunks
//   test_cuda_quant.cpp      the `_scaled` ops (rows moved with their scales), dispatch_quantized,
//                            quantize
//   test_cuda_checked.cpp    checked mode: bad data raises padmoe::Error and writes nothing
//   test_cuda_launch.cpp     ops chained on one stream: CUDA graph capture, PDL, the L2 prefetch
// Here: the device helpers (copies to and from the GPU, poison-filled GPU buffers, byte
// comparisons, GPU plan and layout buffers), the kernel overrides, and the CPU-vs-GPU workloads
// (defined in test_cuda_every_op.cpp; test_cuda_rows.cpp reruns them under each kernel choice).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <atomic>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <thread>

#include "core/kernel_overrides.hpp"
#include "core/kernel_policy.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/quant_backend.hpp"
#include "test_util.hpp"
#include "workload/workload.hpp"

namespace pt {

// Kernel choices are forced through the internal overrides (default: the policy decides).
namespace pol = padmoe::policy;
using padmoe::detail::KernelOverrides;
using padmoe::detail::ScopedKernelOverrides;
inline KernelOverrides& kernel_overrides() { return padmoe::detail::kernel_overrides(); }

// ---------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------
inline bool gpu_available() {
  static const int n = [] {
    int c = 0;
    if (cudaGetDeviceCount(&c) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return c;
  }();
  return n > 0;
}

#define REQUIRE_GPU()                                                                      \
  do {                                                                                     \
    if (!gpu_available()) GTEST_SKIP() << "no CUDA device: padmoe_cuda_tests needs a GPU"; \
  } while (0)

inline const padmoe::Device kGpu = padmoe::Device::cuda(0);

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define CUDA_OK(expr) cuda_ok((expr), #expr)

inline size_t nbytes(const TensorView& t) { return static_cast<size_t>(t.numel()) * esize(t.dtype); }

inline Tensor to_gpu(const TensorView& h) {
  Tensor d = Tensor::empty(h.dtype, h.ndim, h.shape, kGpu);
  padmoe::copy(h, d);
  return d;
}
inline Tensor to_cpu(const TensorView& d) {
  Tensor h = Tensor::empty(d.dtype, d.ndim, d.shape);
  padmoe::copy(d, h);
  return h;
}
inline Tensor gpu_filled(DType dt, std::initializer_list<int64_t> shape, unsigned char byte) {
  Tensor d = Tensor::empty(dt, shape, kGpu);
  if (d.numel() > 0) CUDA_OK(cudaMemset(d.data(), byte, nbytes(d)));
  return d;
}
inline Tensor gpu_poison_rows(DType dt, int64_t rows, int64_t cols) { return gpu_filled(dt, {rows, cols}, kPoison); }
inline Tensor gpu_poison_index(int64_t n) { return gpu_filled(DType::kInt32, {n}, kIndexPoison); }

// Rows [r0, r1) of two contiguous host row tensors (or entries of vectors) byte-equal.
inline ::testing::AssertionResult rows_same(const TensorView& a, const TensorView& b, int64_t r0, int64_t r1) {
  if (a.dtype != b.dtype) return ::testing::AssertionFailure() << "dtypes differ";
  const int64_t ca = a.ndim == 1 ? 1 : a.shape[1], cb = b.ndim == 1 ? 1 : b.shape[1];
  if (ca != cb) return ::testing::AssertionFailure() << "column counts differ";
  if (a.shape[0] < r1 || b.shape[0] < r1) return ::testing::AssertionFailure() << "too few rows";
  const size_t row = static_cast<size_t>(ca) * esize(a.dtype);
  for (int64_t r = r0; r < r1; ++r) {
    const auto* pa = static_cast<const unsigned char*>(a.data) + r * row;
    const auto* pb = static_cast<const unsigned char*>(b.data) + r * row;
    if (row > 0 && std::memcmp(pa, pb, row) != 0) {
      for (size_t i = 0; i < row; ++i)
        if (pa[i] != pb[i])
          return ::testing::AssertionFailure() << "first difference at row " << r << " byte " << i << ": 0x" << std::hex
                                               << int(pa[i]) << " vs 0x" << int(pb[i]);
    }
  }
  return ::testing::AssertionSuccess();
}
inline ::testing::AssertionResult all_same(const TensorView& a, const TensorView& b) {
  if (a.numel() != b.numel() || a.shape[0] != b.shape[0])
    return ::testing::AssertionFailure() << "shapes differ: " << a.shape[0] << " vs " << b.shape[0] << " rows";
  return rows_same(a, b, 0, a.shape[0]);
}

inline std::vector<float> ones(int64_t n) { return std::vector<float>(static_cast<size_t>(n), 1.0f); }

// Capacity-sized int32 plan buffers on the GPU, filled with the index poison (row_sources:
// `rows` entries when given).
struct GpuPlan {
  Tensor indices, bin_ids, tpe, bins, ptpe, padded_bins, dest_rows, row_sources;
  padmoe::PlanView view;
};
inline GpuPlan gpu_plan_buffers(int64_t T, int K, int E, int m, int64_t rows = -1) {
  GpuPlan g;
  const int64_t A = T * K, cap = rows >= 0 ? rows : padmoe::padded_rows_bound(T, K, E, m);
  g.indices = gpu_poison_index(A);
  g.bin_ids = gpu_poison_index(A);
  g.tpe = gpu_poison_index(E);
  g.bins = gpu_poison_index(E);
  g.ptpe = gpu_poison_index(E);
  g.padded_bins = gpu_poison_index(E);
  g.dest_rows = gpu_poison_index(A);
  g.row_sources = gpu_poison_index(cap);
  g.view.indices = g.indices;
  g.view.bin_ids = g.bin_ids;
  g.view.tokens_per_expert = g.tpe;
  g.view.bins = g.bins;
  g.view.padded_tokens_per_expert = g.ptpe;
  g.view.padded_bins = g.padded_bins;
  g.view.dest_rows = g.dest_rows;
  g.view.row_sources = g.row_sources;
  g.view.num_tokens = T;
  g.view.top_k = K;
  g.view.num_experts = E;
  g.view.alignment = m;
  return g;
}

// make_plan's layouts for R rows at alignment m on the GPU (row_experts, block_experts,
// padded_total), filled with the index poison.
struct GpuLayouts {
  Tensor row_experts, block_experts, padded_total;
  padmoe::PlanLayouts view;
};
inline GpuLayouts gpu_layout_buffers(int64_t R, int m) {
  GpuLayouts l;
  l.row_experts = gpu_poison_index(R);
  l.block_experts = gpu_poison_index((R + m - 1) / m);
  l.padded_total = gpu_poison_index(1);
  l.view.row_experts = l.row_experts;
  l.view.block_experts = l.block_experts;
  l.view.padded_total = l.padded_total;
  return l;
}

// Every field of a GPU plan view equals the CPU plan (bitwise) and the reference.
inline void expect_plan_equal(const padmoe::PlanView& g, const padmoe::Plan& c, const ref::Plan& p, const char* what) {
  SCOPED_TRACE(what);
  const std::pair<const TensorView*, const Tensor*> fields[] = {
      {&g.indices, &c.indices},
      {&g.bin_ids, &c.bin_ids},
      {&g.tokens_per_expert, &c.tokens_per_expert},
      {&g.bins, &c.bins},
      {&g.padded_tokens_per_expert, &c.padded_tokens_per_expert},
      {&g.padded_bins, &c.padded_bins},
      {&g.dest_rows, &c.dest_rows},
      {&g.row_sources, &c.row_sources}};
  const char* names[] = {"indices",     "bin_ids",   "tokens_per_expert", "bins", "padded_tokens_per_expert",
                         "padded_bins", "dest_rows", "row_sources"};
  const std::vector<int64_t>* refs[] = {
      &p.indices,     &p.bin_ids,   &p.tokens_per_expert, &p.bins, &p.padded_tokens_per_expert,
      &p.padded_bins, &p.dest_rows, &p.row_sources};
  for (int i = 0; i < 8; ++i) {
    const Tensor h = to_cpu(*fields[i].first);
    EXPECT_TRUE(all_same(h, *fields[i].second)) << "plan." << names[i] << ": GPU vs CPU";
    EXPECT_EQ(index_to_vec(h), *refs[i]) << "plan." << names[i] << ": GPU vs reference";
  }
}

// A move into a capacity-sized, poisoned GPU buffer: rows [0, P) equal the
// reference and the CPU result bitwise (padding rows zero), rows past P poison.
inline void expect_move(const char* what, const TensorView& gpu_dev, const TensorView& cpu,
                        const std::vector<float>& want, int64_t P) {
  const Tensor g = to_cpu(gpu_dev);
  EXPECT_TRUE(rows_bitwise(g, want, P)) << what << ": GPU vs reference";
  EXPECT_TRUE(rows_same(g, cpu, 0, P)) << what << ": GPU vs CPU";
  EXPECT_TRUE(bytes_are(g, P, g.size(0), kPoison)) << what << ": GPU wrote at or past P";
}

inline ::testing::AssertionResult gpu_sums(const TensorView& gpu_dev, const std::vector<double>& want,
                                           const std::vector<double>& abs, int64_t n_terms, int64_t rows) {
  return sums_close(to_cpu(gpu_dev), want, abs, n_terms, rows);
}

// The CPU-vs-GPU comparison of every op (test_cuda_every_op.cpp): a workload, the (row, index,
// weight) dtypes it runs with, and the list of workloads.
struct Workload {
  std::string name;
  int64_t T;
  int E, K;
  int64_t H;
  int m;
  Dist dist = Dist::kUniform;
  std::vector<int64_t> counts;  // explicit per-expert counts (sum T*K) instead of dist
  int combos = 0;               // 0: all six (dtype, index) combinations; 1: bf16/int32 only; 2: f16/int64 only
};

struct Combo {
  DType dtype, idx, wdtype;
};
std::vector<Combo> combos_of(int which);
void run_cpu_vs_gpu(const Workload& wl, const Combo& cb, uint64_t seed);
std::vector<Workload> workloads();

// A poison-filled host scale tensor of layout l for `rows` rows of H columns (the quantizing
// dispatch's outputs; test_cuda_quant.cpp, test_cuda_launch.cpp).
inline Tensor quant_poison_scales(padmoe::ScaleLayout l, int64_t rows, int64_t H) {
  if (l == padmoe::ScaleLayout::kPerRow) return filled(DType::kFloat32, {rows}, kPoison);
  return filled(l == padmoe::ScaleLayout::kMxE8M0 ? DType::kUInt8 : DType::kFloat32,
                {rows, padmoe::scale_columns(l, H)}, kPoison);
}

}  // namespace pt
