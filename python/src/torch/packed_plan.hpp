// packed_plan.hpp — the packed plan: make_plan's eight int32 arrays back to back in one tensor,
//   [indices A | bin_ids A | tokens_per_expert E | bins E | padded_tokens_per_expert E |
//    padded_bins E | dest_rows A | row_sources rows],  A = T*K,
// rows = A + E*(alignment-1) (4*A + E*(alignment+3) entries), or E*C for a plan made with an
// expert capacity C (3*A + E*(C+4) entries). One allocation and one tensor to pass, save and hand
// over, where eight cost several µs of host time per op (padmoe.Plan exposes the arrays as views
// of it).
//
// plan_layout is the one C++ definition of that layout: the operators allocate plans and read
// them by it, and padmoe._torch_ops.packed_plan_layout returns it to Python, so that a test can
// check Python's own definition (padmoe/_plan.py) against it.
#pragma once

#include "common.hpp"

namespace padmoe_torch {

constexpr int kPlanFields = 8;
extern const char* const kPlanFieldNames[kPlanFields];  // "indices", ..., "row_sources"

struct PlanLayout {
  int64_t offset[kPlanFields] = {};
  int64_t length[kPlanFields] = {};
  int64_t total = 0;
  bool overflow = false;  // a length, an offset or the total does not fit int64 (the rest is then unset)
};

// The layout of a plan of a = T*K assignments and e experts: row_sources of a + e*(alignment-1)
// rows, or of e*C rows with an expert capacity C. The arguments are not checked (the callers do).
PlanLayout plan_layout(int64_t a, int64_t e, int64_t alignment, OptInt expert_capacity);

// A packed plan tensor with the sizes it was read with (packed_plan below).
struct PackedPlan {
  Tensor t;
  PlanLayout layout;
  int64_t a = 0, e = 0, cap = 0, tokens = 0;  // cap: row_sources' rows
  int k = 1, m = 1;
  int64_t offset(int field) const { return layout.offset[field]; }
  Tensor field(int i) const { return t.narrow(0, layout.offset[i], layout.length[i]); }  // an ATen view
  Tensor dest_rows() const { return field(6); }
  padmoe::PlanView view(const char* op) const;  // the eight arrays as padmoe's views of `t`
};

// Reads `plan` as the packed plan of make_plan (or make_plan_routed) for these sizes: A from its
// length, checked against the layout. alignment >= 1 always; with expert_capacity (>= 0) the plan
// has the capacity layout (the row ops do not read the alignment then).
PackedPlan packed_plan(const Tensor& plan, int64_t top_k, int64_t num_experts, int64_t alignment,
                       OptInt expert_capacity, const char* op);

}  // namespace padmoe_torch
