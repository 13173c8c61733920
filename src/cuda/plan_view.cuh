// plan_view.cuh — the plan's arrays as the kernels read them, under docs/spec.md §3's names:
// dest_row(a), row_source(r), and expert e's segments (real_start / real_end / count,
// padded_start / padded_end, P = padded_total(), the padded row of a sorted position, the expert
// whose padded segment holds a row). The offset expressions (e == 0 ? 0 : bins[e-1], ...) are
// written here once, so that a kernel names what it reads.
//
// The accessors are inline and index in the width the caller passes: a kernel that reads the plan
// through DevicePlan loads the same entries, with the same widths, as the expressions written out
// by hand. Included by the kernel headers that read a plan (row_io.cuh, quant_kernels.cuh) and by
// maps.cu and validate.cu; make_plan's kernels write the arrays and keep their own names for them
// (plan_common.cuh).
#pragma once

#include "cuda/common.cuh"

namespace padmoe {
namespace cuda {

// A plan array staged in shared memory when the block staged it (the zero blocks stage bins and
// padded_bins up to a number of experts), else read from global memory; one flag for the block.
struct StagedIndex {
  const int32_t* staged = nullptr;  // int32: plan values are below 2^31
  IndexRef global;
  bool use_staged = false;
};

// Entry i of a plan array, whatever holds it: int32 (a plan's own arrays, or their copies in
// shared memory; the entry as int32, the index in the caller's width), an IndexRef (int32 or int64:
// the MegaBlocks forms' bins / padded_bins), or a StagedIndex (as int64).
template <typename I>
__device__ __forceinline__ int32_t plan_entry(const int32_t* p, I i) {
  return p[i];
}
__device__ __forceinline__ int64_t plan_entry(const IndexRef& r, int64_t i) { return load_index(r, i); }
__device__ __forceinline__ int64_t plan_entry(const StagedIndex& s, int64_t i) {
  return s.use_staged ? s.staged[i] : load_index(s.global, i);
}

// The arrays a kernel reads of a plan; those it does not read are left empty. Ref: const int32_t*,
// IndexRef or StagedIndex (plan_entry). Built in the kernel from its arguments, so the arguments
// and what the compiler knows of them (__restrict__) are those of the raw arrays: the segments by
// aggregate initialization in place, DevicePlan<Ref>{bins, padded_bins, num_experts} (a copy out of
// a helper's return value can keep the compiler from seeing num_experts as the value it was given,
// and the search loops around it then compile differently), dest_rows alone by plan_rows.
template <typename Ref>
struct DevicePlan {
  Ref bins;         // [E]: incl(count), real_end(e)
  Ref padded_bins;  // [E]: incl(padded count), padded_end(e); padded_bins[E-1] = P
  int num_experts;
  Ref dest_rows;    // [A]: the padded row of assignment a; -1: dropped
  Ref row_sources;  // [R]: the assignment padded row r holds; -1: a padding row, or at or past P

  template <typename I>
  __device__ __forceinline__ auto dest_row(I a) const {
    return plan_entry(dest_rows, a);
  }
  template <typename I>
  __device__ __forceinline__ auto row_source(I r) const {
    return plan_entry(row_sources, r);
  }
  // Expert e's sorted positions [real_start(e), real_end(e)) and padded rows
  // [padded_start(e), padded_end(e)); its rows from padded_start(e) + count(e) on are padding.
  template <typename I>
  __device__ __forceinline__ auto real_start(I e) const {
    return e == 0 ? 0 : plan_entry(bins, e - 1);
  }
  template <typename I>
  __device__ __forceinline__ auto real_end(I e) const {
    return plan_entry(bins, e);
  }
  template <typename I>
  __device__ __forceinline__ auto count(I e) const {
    return real_end(e) - real_start(e);
  }
  template <typename I>
  __device__ __forceinline__ auto padded_start(I e) const {
    return e == 0 ? 0 : plan_entry(padded_bins, e - 1);
  }
  template <typename I>
  __device__ __forceinline__ auto padded_end(I e) const {
    return plan_entry(padded_bins, e);
  }
  // P (0 without experts), as int64 whatever holds it.
  __device__ __forceinline__ int64_t padded_total() const {
    return num_experts > 0 ? static_cast<int64_t>(padded_end(num_experts - 1)) : 0;
  }
  // The padded row of sorted position i of expert e: index::padded_row(i, real_start(e),
  // padded_start(e)), its loads in that order.
  template <typename E, typename I>
  __device__ __forceinline__ auto padded_row(E e, I i) const {
    const auto real = real_start(e);
    return padded_start(e) + (i - real);
  }
  // The expert whose padded segment holds row r: the first e with padded_end(e) > r (num_experts
  // when r >= P), by a binary search in I (the caller's width).
  template <typename I = int64_t, typename R>
  __device__ __forceinline__ I padded_segment(R r) const {
    I lo = 0, hi = num_experts;
    while (lo < hi) {
      const I mid = (lo + hi) / 2;
      if (padded_end(mid) > r) hi = mid;
      else lo = mid + 1;
    }
    return lo;
  }
  // Whether row r (< P) is a padding row.
  template <typename I = int64_t, typename R>
  __device__ __forceinline__ bool is_padding_row(R r) const {
    const I e = padded_segment<I>(r);
    const auto pstart = padded_start(e);
    const auto n = count(e);
    return r - pstart >= n;
  }
};

// A plan's dest_rows (and row_sources) alone.
__device__ __forceinline__ DevicePlan<const int32_t*> plan_rows(const int32_t* dest_rows,
                                                                const int32_t* row_sources = nullptr) {
  return DevicePlan<const int32_t*>{nullptr, nullptr, 0, dest_rows, row_sources};
}

}  // namespace cuda
}  // namespace padmoe
