// quant_kernels.cuh — the quantizing spread's device code (dispatch_quantized, quantize).
//
// One block of 256 threads per token row; each thread owns 8 consecutive
// columns per step of 2048 (so a warp covers 256 columns: whole 32- and
// 128-column scale blocks). The row is read once and quantized once per step
// (src/core/quant_math.hpp: the CPU backend computes the same bits): the
// amax of a scale block is an integer max over the bit patterns of |x|,
// reduced over the 4 (MXFP8) or 16 (per 128 columns) lanes that hold the
// block by xor shuffles (order-free: no atomics), then each lane's 8 codes
// and the block's scale (by the block's first lane) are stored to the
// token's K destination rows from registers. The codes come from the hardware's
// cvt.rn.satfinite (sm_89+), quant::fp8_saturate's bits on every non-NaN float32 (tested
// exhaustively on the GPU), and MXFP8's power-of-two division is a multiplication by 2^-X (the
// same rounding of the same real number). Per-row scales reduce the whole
// row first (a block reduction) and re-read it for the codes (L1/L2 hits).
// Extra blocks of the same launch zero the padding rows (scale 1).
// Included by quant.cu, which picks the instantiation and launches.
#pragma once

#include "core/quant_math.hpp"
#include "cuda/common.cuh"
#include "cuda/plan_view.cuh"
#include "cuda/quant_backend.hpp"

namespace padmoe {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kCols = 8;                     // columns per thread and step
constexpr int kStepCols = kThreads * kCols;  // columns per step
static_assert(kStepCols == policy::kQuantStepCols, "policy::quant_slices counts steps of kStepCols");
constexpr int kGroupK = 64;                  // destinations staged at a time
constexpr int kZeroRows = policy::kZeroRows;  // rows per zero block

enum Mode : int { kPerRowMode = 0, kBlock128Mode = 1, kMxMode = 2 };

template <int kMode>
struct ModeTraits {
  static constexpr int kBlockCols = kMode == kMxMode ? 32 : 128;
  static constexpr int kLanes = kBlockCols / kCols;  // lanes holding one scale block
};

// Columns [c0, c0 + 8) of a row as float (0 past `hidden`).
template <typename T>
__device__ __forceinline__ void load_cols(const char* row, int64_t c0, int64_t hidden, bool vec, float (&f)[kCols]) {
  using S = typename T::S;
  const S* s = reinterpret_cast<const S*>(row);
  if (vec && c0 + kCols <= hidden) {
    constexpr int kPer = 16 / static_cast<int>(sizeof(S));
#pragma unroll
    for (int v = 0; v < kCols / kPer; ++v) {
      const uint4 raw = *reinterpret_cast<const uint4*>(s + c0 + v * kPer);
      const S* e = reinterpret_cast<const S*>(&raw);
#pragma unroll
      for (int i = 0; i < kPer; ++i) f[v * kPer + i] = T::ld(e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kCols; ++i) f[i] = c0 + i < hidden ? T::ld(s[c0 + i]) : 0.0f;
  }
}

__device__ __forceinline__ void store_codes(char* row, int64_t c0, int64_t hidden, bool vec, uint32_t lo, uint32_t hi) {
  if (vec && c0 + kCols <= hidden) {
    *reinterpret_cast<uint2*>(row + c0) = make_uint2(lo, hi);
    return;
  }
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    const uint32_t word = i < 4 ? lo : hi;
    if (c0 + i < hidden) row[c0 + i] = static_cast<char>((word >> (8 * (i % 4))) & 0xffu);
  }
}

template <int kLanes>
__device__ __forceinline__ uint32_t lanes_max(uint32_t v) {
#pragma unroll
  for (int off = 1; off < kLanes; off <<= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Two float32 -> two fp8 codes (a in the low byte): cvt.rn.satfinite (sm_89 and later) rounds to
// nearest even and saturates to +-max, infinities too: quant::fp8_saturate for every non-NaN input.
__device__ __forceinline__ uint32_t fp8_hw_pair(float a, float b, bool e5m2) {
  unsigned short r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (e5m2) asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(b), "f"(a));
  else asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(b), "f"(a));
#else
  const quant::Fp8Format fmt = quant::fp8_format(e5m2);
  r = static_cast<unsigned short>(quant::fp8_saturate(a, fmt) | (quant::fp8_saturate(b, fmt) << 8));
#endif
  return r;
}

// Scale row r's entries c0, c0 + step, ... set to 1.
__device__ __forceinline__ void store_scale_one(const QuantScalesArg& sc, int64_t r, int c0, int step) {
  if (sc.layout == ScaleLayout::kMxE8M0) {
    uint8_t* d = static_cast<uint8_t*>(sc.data) + r * sc.cols;
    for (int64_t c = c0; c < sc.cols; c += step) d[c] = quant::kE8M0One;
  } else {
    uint32_t* d = static_cast<uint32_t*>(sc.data) + r * sc.cols;
    for (int64_t c = c0; c < sc.cols; c += step) d[c] = quant::kFloatOneBits;
  }
}

// Zero block: rows [first, first + nrows) of y (nrows <= kZeroRows) that are padding (below
// P, with zero_padding) or at or past P (zero_past_end): zero codes, scale 1. Up to
// kStageExperts experts, bins and padded_bins are staged in shared memory first (one round of
// loads; the padding search is otherwise a chain of dependent global loads a row).
constexpr int kStageExperts = 1024;
__device__ void zero_rows(const RowsArg& y, const QuantScalesArg& sc, const PaddingRef& pad, bool zero_padding,
                          bool zero_past_end, int64_t first, int nrows) {
  __shared__ bool s_zero[kZeroRows];
  __shared__ int32_t s_bins[kStageExperts], s_pbins[kStageExperts];  // plan values < 2^31
  const int E = pad.num_experts;
  const bool staged = E <= kStageExperts;
  if (staged) {
    for (int e = threadIdx.x; e < E; e += kThreads) {
      s_bins[e] = static_cast<int32_t>(load_index(pad.bins, e));
      s_pbins[e] = static_cast<int32_t>(load_index(pad.padded_bins, e));
    }
    __syncthreads();
  }
  const DevicePlan<const int32_t*> smem{s_bins, s_pbins, E};
  const DevicePlan<IndexRef> plan{pad.bins, pad.padded_bins, pad.num_experts};
  const int64_t padded = E > 0 ? (staged ? smem.padded_end(E - 1) : plan.padded_total()) : 0;
  if (threadIdx.x < kZeroRows) {
    const int64_t r = first + threadIdx.x;
    bool z = false;
    if (threadIdx.x < nrows && r < y.rows) {
      if (r >= padded) {
        z = zero_past_end;
      } else if (zero_padding && staged) {  // r's expert by a 32-bit search in shared memory
        z = smem.is_padding_row<int>(r);
      } else if (zero_padding) {
        z = plan.is_padding_row(r);
      }
    }
    s_zero[threadIdx.x] = z;
  }
  __syncthreads();
  const int64_t hidden = y.cols;
  const bool vec = reinterpret_cast<uintptr_t>(y.data) % 16 == 0 && y.stride_bytes % 16 == 0 && hidden % 16 == 0;
  const int64_t units = vec ? hidden / 16 : hidden;
  // row by row (a row's flag is the same in every thread): no division a store (a 64-bit division
  // and modulo a store over every row, zeroed or not, were 10% of mixtral-8x7b's samples and 31% of
  // decode's under ncu)
  for (int row = 0; row < nrows; ++row) {
    if (!s_zero[row]) continue;
    char* p = row_ptr(y, first + row);
    for (int64_t u = threadIdx.x; u < units; u += kThreads) {
      if (vec) reinterpret_cast<uint4*>(p)[u] = make_uint4(0, 0, 0, 0);
      else p[u] = 0;
    }
  }
  // the zeroed rows' scales (1): rows of at most 64 entries one thread a row (looped over the row),
  // longer rows over the block's threads row by row. Measured on the H200 (graph x
  // floor), one thread a row / row by row:
  // qwen3-30b-a3b (16 and 64 entries) quant-128 1.42 / 1.57, quant-mxfp8 1.47 / 1.59; mixtral-8x7b
  // (32 entries) quant-128 1.54 / 1.60; deepseek-v3 and decode MXFP8 (224 entries) 1.50 / 1.31 and
  // 18.5 / 12.2 us; a flattened (row, entry) loop was between the two everywhere.
  if (sc.cols <= 64) {
    if (threadIdx.x < static_cast<unsigned>(nrows) && s_zero[threadIdx.x])
      store_scale_one(sc, first + threadIdx.x, 0, 1);
  } else {
    for (int row = 0; row < nrows; ++row) {
      if (s_zero[row]) store_scale_one(sc, first + row, static_cast<int>(threadIdx.x), kThreads);
    }
  }
}

// One thread's kCols columns (in a run of lanes covering whole scale blocks: every lane of the
// warp calls it, for the shuffles) quantized: the codes packed 4 a word (lo: the first four),
// and the scale block's scale bits (float32 bits, or the E8M0 byte; per-row mode: unused).
template <int kMode>
__device__ __forceinline__ void quantize_cols(const float (&f)[kCols], const quant::Fp8Format& fmt, bool e5m2,
                                              float row_div, bool row_bad, uint32_t& lo, uint32_t& hi,
                                              uint32_t& scale_bits) {
  using M = ModeTraits<kMode>;
  float divisor = row_div;
  float inverse = 1.0f;  // MXFP8: 2^-X
  bool bad = row_bad;
  scale_bits = 0;
  if (kMode != kPerRowMode) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kCols; ++i) m = max(m, quant::abs_bits(f[i]));
    m = lanes_max<M::kLanes>(m);
    bad = quant::non_finite(m);
    if (kMode == kMxMode) {
      const int e = bad ? 0 : quant::mx_exponent(m, fmt);
      divisor = quant::pow2(e);
      inverse = quant::pow2(-e);
      scale_bits = bad ? quant::kE8M0NaN : static_cast<uint32_t>(e + 127);
    } else {
      divisor = quant::block_scale(m, fmt);
      scale_bits = quant::bits_of(divisor);
    }
  }
  float qv[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) qv[i] = kMode == kMxMode ? f[i] * inverse : quant::div_rn(f[i], divisor);
  uint32_t pairs[kCols / 2];
#pragma unroll
  for (int i = 0; i < kCols / 2; ++i) pairs[i] = fp8_hw_pair(qv[2 * i], qv[2 * i + 1], e5m2);
  lo = bad ? 0x7f7f7f7fu : pairs[0] | (pairs[1] << 16);
  hi = bad ? 0x7f7f7f7fu : pairs[2] | (pairs[3] << 16);
}

// The quotients are converted by the hardware's cvt.rn.satfinite (fp8_hw_pair), and MXFP8's
// division by its power of two is a multiplication by the inverse (exact: both are the rounding of
// the same real x * 2^-X): the codes of quant::quantize_element, bit for bit
// (fp8_convert_mismatches checks every float32 pattern). Against quantize_element's software
// conversion: dispatch(quant-128) mixtral-8x7b 3.18x -> 1.68x the floor.
// Within 32 registers (8 blocks an SM: full occupancy). Measured on the H200 against
// 38 registers (6 blocks an SM): dispatch(quant-128) mixtral-8x7b 1.68x -> 1.53x the floor,
// qwen3-30b-a3b 1.48x -> 1.41x, deepseek-v3 1.29x -> 1.30x. Loading the first step before the
// destinations are staged (so that the two loads overlap) was slower: 1.93x at 48 registers,
// 1.65x capped at 32.
// The sliced form with 1x128 block scales: registers for 6 blocks an SM (40) instead of 8 (32,
// where the sliced form spills 8-16 bytes; policy::quant_loose).
template <typename T, int kMode, bool kSliced>
__global__ void __launch_bounds__(kThreads, kSliced&& kMode == kBlock128Mode ? 6 : 8)
    quant_spread_kernel(RowsArg x, int top_k, const int32_t* __restrict__ dest, RowsArg y, QuantScalesArg sc,
                        PaddingRef pad, bool zero_padding, bool zero_past_end, bool vec_in, bool vec_out,
                        int zero_rows_each, int slices) {
  pdl_begin();
  // kSliced (small T, block scales): block (t, j) of the first T * slices quantizes steps j,
  // j + slices, ... of token t's row; otherwise a block a token (slices unused: this form's code is
  // the one measured within 32 registers above)
  const int64_t token_blocks = kSliced ? x.rows * slices : x.rows;
  if (blockIdx.x >= token_blocks) {
    zero_rows(y, sc, pad, zero_padding, zero_past_end,
              (static_cast<int64_t>(blockIdx.x) - token_blocks) * zero_rows_each, zero_rows_each);
    return;
  }
  using M = ModeTraits<kMode>;
  __shared__ int64_t s_dest[kGroupK];
  __shared__ uint32_t s_warp[kThreads / 32];
  const quant::Fp8Format fmt = quant::fp8_format(sc.e5m2);
  const int64_t t = kSliced ? static_cast<int>(blockIdx.x) / slices : blockIdx.x, hidden = x.cols;
  const int64_t first_step = kSliced ? static_cast<int64_t>(static_cast<int>(blockIdx.x) % slices) * kStepCols : 0;
  const int64_t step_cols = kSliced ? static_cast<int64_t>(kStepCols) * slices : kStepCols;
  const char* src = row_ptr(x, t);
  const int lane = threadIdx.x % 32;

  float row_div = 1.0f;  // per-row mode: the row's scale
  bool row_bad = false;
  if (kMode == kPerRowMode) {
    uint32_t m = 0;
    for (int64_t base = 0; base < hidden; base += kStepCols) {
      float f[kCols];
      load_cols<T>(src, base + threadIdx.x * kCols, hidden, vec_in, f);
#pragma unroll
      for (int i = 0; i < kCols; ++i) m = max(m, quant::abs_bits(f[i]));
    }
    m = lanes_max<32>(m);
    if (lane == 0) s_warp[threadIdx.x / 32] = m;
    __syncthreads();
    m = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) m = max(m, s_warp[w]);
    row_bad = quant::non_finite(m);
    row_div = quant::block_scale(m, fmt);
  }

  for (int k0 = 0; k0 < top_k; k0 += kGroupK) {
    const int nk = top_k - k0 < kGroupK ? top_k - k0 : kGroupK;
    __syncthreads();  // the previous group is done with s_dest
    for (int q = threadIdx.x; q < nk; q += kThreads) {
      int64_t r =
          dest == nullptr ? t : static_cast<int64_t>(plan_rows(dest).dest_row(index::assignment_id(t, k0 + q, top_k)));
      s_dest[q] = (r < 0 || r >= y.rows) ? -1 : r;  // outside y: only with unchecked bad input
    }
    __syncthreads();
    if (kMode == kPerRowMode && threadIdx.x < nk && s_dest[threadIdx.x] >= 0) {
      static_cast<float*>(sc.data)[s_dest[threadIdx.x]] = row_div;
    }
    for (int64_t base = first_step; base < hidden; base += step_cols) {  // every lane runs the step's shuffles
      const int64_t c0 = base + threadIdx.x * kCols;
      float f[kCols];
      load_cols<T>(src, c0, hidden, vec_in, f);
      uint32_t lo, hi, scale_bits;
      quantize_cols<kMode>(f, fmt, sc.e5m2, row_div, row_bad, lo, hi, scale_bits);
      if (c0 >= hidden) continue;  // no shuffles below in this step (a next step's run in every lane)
      const bool leader = kMode != kPerRowMode && lane % M::kLanes == 0;
      const int64_t scol = c0 / M::kBlockCols;
      for (int q = 0; q < nk; ++q) {
        const int64_t r = s_dest[q];
        if (r < 0) continue;
        store_codes(row_ptr(y, r), c0, hidden, vec_out, lo, hi);
        if (leader) {
          if (kMode == kMxMode) static_cast<uint8_t*>(sc.data)[r * sc.cols + scol] = static_cast<uint8_t>(scale_bits);
          else static_cast<uint32_t*>(sc.data)[r * sc.cols + scol] = scale_bits;
        }
      }
    }
  }
}

// Every float32 bit pattern but the NaNs (a quotient of a finite block is never NaN), in
// fp8_hw_pair against quant::fp8_saturate: the mismatches counted, the smallest pattern kept.
__global__ void fp8_convert_check_kernel(bool e5m2, unsigned long long* count, unsigned* first,
                                         unsigned long long* compared) {
  pdl_begin();
  const quant::Fp8Format fmt = quant::fp8_format(e5m2);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x * 2;
  unsigned long long bad = 0, seen = 0;
  unsigned least = 0xffffffffu;
  for (uint64_t u = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 2; u < (uint64_t{1} << 32);
       u += stride) {
    const float a = quant::float_of(static_cast<uint32_t>(u)), b = quant::float_of(static_cast<uint32_t>(u + 1));
    const uint32_t hw = fp8_hw_pair(a, b, e5m2);
    const bool na = (static_cast<uint32_t>(u) & 0x7fffffffu) > quant::kFloatInfBits;
    const bool nb = (static_cast<uint32_t>(u + 1) & 0x7fffffffu) > quant::kFloatInfBits;
    seen += (na ? 0 : 1) + (nb ? 0 : 1);
    if (!na && (hw & 0xffu) != quant::fp8_saturate(a, fmt)) {
      ++bad;
      least = min(least, static_cast<unsigned>(u));
    }
    if (!nb && (hw >> 8) != quant::fp8_saturate(b, fmt)) {
      ++bad;
      least = min(least, static_cast<unsigned>(u + 1));
    }
  }
  atomicAdd(compared, seen);  // integer atomics: a test's counters, not a result
  if (bad != 0) {
    atomicAdd(count, bad);
    atomicMin(first, least);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace padmoe
