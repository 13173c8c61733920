// plan_capacity.cuh — apply_capacity's kernel: a fixed capacity C a expert from a plan at
// alignment 1, keeping the first C or the C largest probs. Included by plan.cu.
#pragma once

#include "cuda/plan_common.cuh"

namespace padmoe {
namespace cuda {
namespace {


// Fixed capacity: block e < E takes expert e's sorted assignments of the full
// plan (alignment 1, every kept id) and keeps C of them, in order: the first
// C, or (by_probs) the C largest probs, found by an 8-bit radix select of the
// C-th largest key, ties to the lower assignment id. Every block also shares
// the grid-wide fills (dropped assignments of other experts, positions past
// the kept total, rows and blocks past P = E * C).
constexpr int kCapThreads = 1024;  // one block per expert: the whole block walks its segment

__device__ __forceinline__ uint32_t order_key(float f) {  // larger float, larger key (IEEE totalOrder)
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kCapThreads)
    plan_capacity_kernel(const int32_t* f_indices, const int32_t* f_counts, const int32_t* f_dest, int64_t assignments,
                         int num_experts, ScaleArg probs, int64_t cap, bool by_probs, int alignment,
                         int64_t row_capacity, backend::PlanArrays out, int32_t padding_source, int32_t* dropped) {
  pdl_begin();
  // the plan's arrays under their own names
  int32_t* const tokens_per_expert = out.tokens_per_expert;
  int32_t* const bins = out.bins;
  int32_t* const padded_tokens = out.padded_tokens;
  int32_t* const padded_bins = out.padded_bins;
  int32_t* const indices = out.indices;
  int32_t* const bin_ids = out.bin_ids;
  int32_t* const dest_rows = out.dest_rows;
  int32_t* const row_sources = out.row_sources;
  int32_t* const row_experts = out.row_experts;
  int32_t* const block_experts = out.block_experts;
  const int64_t blocks = out.blocks;
  int32_t* const padded_total_out = out.padded_total;
  using Scan = cub::BlockScan<int, kCapThreads>;
  using Reduce = cub::BlockReduce<long long, kCapThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } storage;
  __shared__ int s_hist[256];
  __shared__ long long s_sums[4];  // full start, kept start, kept total, dropped total
  __shared__ uint32_t s_select[2];  // digit found, still needed
  const int e = blockIdx.x;
  // Starts of this expert's segments (full and kept) and the kept / dropped totals.
  long long f_before = 0, k_before = 0, k_all = 0, d_all = 0;
  for (int x = threadIdx.x; x < num_experts; x += kCapThreads) {
    const long long n = f_counts[x], kept = n < cap ? n : cap;
    if (x < e) {
      f_before += n;
      k_before += kept;
    }
    k_all += kept;
    d_all += n - kept;
  }
  long long sums[4] = {f_before, k_before, k_all, d_all};
  for (int q = 0; q < 4; ++q) {
    const long long v = Reduce(storage.reduce).Sum(sums[q]);
    if (threadIdx.x == 0) s_sums[q] = v;
    __syncthreads();
  }
  const int64_t full_start = s_sums[0], kept_start = s_sums[1], kept_total = s_sums[2];
  const int64_t padded_total = static_cast<int64_t>(num_experts) * cap;

  if (e < num_experts) {
    const int32_t* seg = f_indices + full_start;
    const int64_t n = f_counts[e];
    const int64_t kept = n < cap ? n : cap;
    if (threadIdx.x == 0) {
      tokens_per_expert[e] = static_cast<int32_t>(kept);
      bins[e] = static_cast<int32_t>(kept_start + kept);
      padded_tokens[e] = static_cast<int32_t>(cap);
      padded_bins[e] = static_cast<int32_t>((e + 1) * cap);
    }
    const bool select = by_probs && n > cap;
    uint32_t threshold = 0, equal_kept = 0;
    if (select) {
      uint32_t prefix = 0, mask = 0, need = static_cast<uint32_t>(cap);
      for (int shift = 24; shift >= 0 && need > 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += kCapThreads) s_hist[d] = 0;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < n; i += kCapThreads) {
          const uint32_t k = order_key(load_scale(probs, seg[i]));
          if ((k & mask) == prefix) atomicAdd(&s_hist[(k >> shift) & 255u], 1);  // integer counts: exact
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          uint32_t above = 0;
          int d = 255;
          for (; d > 0; --d) {
            if (above + static_cast<uint32_t>(s_hist[d]) >= need) break;
            above += static_cast<uint32_t>(s_hist[d]);
          }
          s_select[0] = static_cast<uint32_t>(d);
          s_select[1] = need - above;
        }
        __syncthreads();
        prefix |= s_select[0] << shift;
        mask |= 255u << shift;
        need = s_select[1];
        __syncthreads();
      }
      threshold = prefix;
      equal_kept = need;  // cap == 0: need 0 from the start, nothing kept
      if (cap == 0) threshold = 0xffffffffu;
    }
    // Keep pass in assignment order: rank among the kept by two block scans a round.
    int64_t kept_run = 0, equal_run = 0;
    for (int64_t base = 0; base < n; base += kCapThreads) {
      const int64_t i = base + threadIdx.x;
      const bool in = i < n;
      const int32_t a = in ? seg[i] : -1;
      bool keep = in && i < cap;
      if (select) {
        const uint32_t k = in ? order_key(load_scale(probs, a)) : 0;
        const int eq = in && k == threshold && cap > 0;
        int eq_excl = 0, eq_total = 0;
        Scan(storage.scan).ExclusiveSum(eq, eq_excl, eq_total);
        __syncthreads();
        keep = in && cap > 0 && (k > threshold || (eq && equal_run + eq_excl < static_cast<int64_t>(equal_kept)));
        equal_run += eq_total;
      }
      int r_excl = 0, r_total = 0;
      Scan(storage.scan).ExclusiveSum(keep ? 1 : 0, r_excl, r_total);
      __syncthreads();
      if (in) {
        if (keep) {
          const int64_t r = kept_run + r_excl;
          const int64_t pos = kept_start + r, row = e * cap + r;
          indices[pos] = a;
          bin_ids[pos] = e;
          dest_rows[a] = static_cast<int32_t>(row);
          row_sources[row] = a;
          if (row_experts != nullptr) row_experts[row] = e;
        } else {
          dest_rows[a] = -1;
        }
      }
      kept_run += r_total;
    }
    for (int64_t row = e * cap + kept + threadIdx.x; row < (e + 1) * cap; row += kCapThreads) {
      row_sources[row] = padding_source;
      if (row_experts != nullptr) row_experts[row] = -1;
    }
    if (block_experts != nullptr) {  // segments are whole blocks: alignment divides C
      for (int64_t b = e * cap / alignment + threadIdx.x; b < (e + 1) * cap / alignment; b += kCapThreads) {
        block_experts[b] = e;
      }
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (padded_total_out != nullptr) *padded_total_out = static_cast<int32_t>(padded_total);
    if (dropped != nullptr) *dropped = static_cast<int32_t>(s_sums[3]);
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCapThreads;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kCapThreads + threadIdx.x;
  for (int64_t a = start; a < assignments; a += stride) {
    if (f_dest[a] < 0) dest_rows[a] = -1;  // dropped before the capacity (not a local expert's)
    if (a >= kept_total) {
      indices[a] = -1;
      bin_ids[a] = -1;
    }
  }
  for (int64_t r = padded_total + start; r < row_capacity; r += stride) {
    row_sources[r] = padding_source;
    if (row_experts != nullptr) row_experts[r] = -1;
  }
  if (block_experts != nullptr) {
    for (int64_t b = padded_total / alignment + start; b < blocks; b += stride) {
      block_experts[b] = -1;
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace padmoe
