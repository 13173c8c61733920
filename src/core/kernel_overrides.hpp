// kernel_overrides.hpp — forcing a kernel choice, for tests and for `padmoe bench --variant`.
// Internal: not part of the public API (include/padmoe), no environment variable behind it.
//
// Every field left unset (the default) lets the policy (src/core/kernel_policy.hpp) decide. A set
// field forces that choice where it runs (the policy's *_fit rules), for every call after it; the
// structure is read at each launch, so set it while no op is running (tests, a benchmark's setup).
#pragma once

#include <optional>
#include <string>

#include "core/kernel_policy.hpp"

namespace padmoe {
namespace detail {

struct KernelOverrides {
  // make_plan
  std::optional<policy::PlanPath> plan_path;    // kSmall only where one chunk fits
  int plan_fused_blocks = 0;                    // > 0: the fused grid at most this many blocks
  std::optional<policy::PlanMatch> plan_match;
  std::optional<policy::PlanCounts> plan_counts;  // kPairs only where a block's counts fit

  // row kernels
  std::optional<policy::SpreadKernel> spread;
  std::optional<policy::ReduceKernel> reduce;
  std::optional<policy::ReduceDotsKernel> reduce_dots;
  std::optional<policy::RowDotsKernel> row_dots;
  int reduce_slice_blocks = -1;         // >= 0: the plain reduce's slicing target (0: no slicing)
  std::optional<bool> dest_search;      // false: always build_dest_rows; true: where it fits
  std::optional<bool> l2_prefetch;      // true: at every size, false: never
  std::optional<bool> pdl;              // programmatic dependent launch (on where the device has it)

  // mask_plan
  std::optional<bool> mask_one_launch;  // count and place in one launch where it fits (default) or two
  // sort_chunks
  std::optional<bool> chunk_map_fused;  // the layout launch writes the map (where map_len fits)
  std::optional<bool> chunk_rows;       // the one launch: true wherever it fits, false never
  std::optional<policy::ChunkRowsForm> chunk_rows_form;

  // CPU backend
  std::optional<bool> cpu_avx2;  // false: the portable loops (true: AVX2 where the CPU has it)
};

// The process's overrides (all unset at start).
KernelOverrides& kernel_overrides();

// Sets one field from `padmoe bench --variant KEY=VALUE`; false (with *error) for an unknown key
// or value. variant_keys() lists the keys and values.
bool set_kernel_variant(KernelOverrides& o, const std::string& key, const std::string& value, std::string* error);
std::string variant_keys();

// Sets the overrides for a scope, then restores the previous ones (tests).
class ScopedKernelOverrides {
 public:
  explicit ScopedKernelOverrides(const KernelOverrides& o) : saved_(kernel_overrides()) { kernel_overrides() = o; }
  ~ScopedKernelOverrides() { kernel_overrides() = saved_; }
  ScopedKernelOverrides(const ScopedKernelOverrides&) = delete;
  ScopedKernelOverrides& operator=(const ScopedKernelOverrides&) = delete;

 private:
  KernelOverrides saved_;
};

}  // namespace detail
}  // namespace padmoe
