// packed_plan.cpp — the packed plan's layout (plan_layout) and the reading of a packed plan
// tensor by it (packed_plan). See packed_plan.hpp.
#include "packed_plan.hpp"

#include <string>

namespace padmoe_torch {

const char* const kPlanFieldNames[kPlanFields] = {
    "indices",     "bin_ids",   "tokens_per_expert", "bins", "padded_tokens_per_expert",
    "padded_bins", "dest_rows", "row_sources"};

PlanLayout plan_layout(int64_t a, int64_t e, int64_t alignment, OptInt expert_capacity) {
  PlanLayout l;
  int64_t rows = 0;  // row_sources: E*C, or A + E*(alignment-1)
  if (expert_capacity) {
    l.overflow = __builtin_mul_overflow(e, *expert_capacity, &rows);
  } else {
    l.overflow = __builtin_mul_overflow(e, alignment - 1, &rows) || __builtin_add_overflow(rows, a, &rows);
  }
  if (l.overflow) return l;
  const int64_t lengths[kPlanFields] = {a, a, e, e, e, e, a, rows};
  int64_t o = 0;
  for (int i = 0; i < kPlanFields; ++i) {
    l.offset[i] = o;
    l.length[i] = lengths[i];
    if (__builtin_add_overflow(o, lengths[i], &o)) {
      l.overflow = true;
      return l;
    }
  }
  l.total = o;
  return l;
}

padmoe::PlanView PackedPlan::view(const char* op) const {
  padmoe::PlanView p;
  TensorView* fields[kPlanFields] = {
      &p.indices,     &p.bin_ids,   &p.tokens_per_expert, &p.bins, &p.padded_tokens_per_expert,
      &p.padded_bins, &p.dest_rows, &p.row_sources};
  const TensorView whole = padmoe_torch::view(t, op, "plan");
  for (int i = 0; i < kPlanFields; ++i) {
    TensorView v = whole;
    v.data = static_cast<int32_t*>(whole.data) + layout.offset[i];
    v.shape[0] = layout.length[i];
    v.strides[0] = 1;
    *fields[i] = v;
  }
  p.num_tokens = tokens;
  p.top_k = k;
  p.num_experts = static_cast<int>(e);
  p.alignment = m;
  return p;
}

PackedPlan packed_plan(const Tensor& plan, int64_t top_k, int64_t num_experts, int64_t alignment,
                       OptInt expert_capacity, const char* op) {
  if (top_k < 1) value_error(op, "top_k", "must be >= 1, got " + std::to_string(top_k));
  if (num_experts < 1) value_error(op, "num_experts", "must be >= 1, got " + std::to_string(num_experts));
  if (alignment < 1) value_error(op, "alignment", "must be >= 1, got " + std::to_string(alignment));
  if (expert_capacity && *expert_capacity < 0) {
    value_error(op, "expert_capacity", "must be >= 0 (or None), got " + std::to_string(*expert_capacity));
  }
  if (plan.scalar_type() != at::kInt || plan.dim() != 1 || !plan.is_contiguous()) {
    type_error(op, "plan",
               std::string("expected the packed plan of make_plan (a contiguous 1-D int32 tensor), got ") +
                   dtype_name(plan.scalar_type()) + " of shape " + shape_of(plan));
  }
  // The length is affine in A: fixed + per_a * A (per_a = 4, or 3 with a capacity).
  const PlanLayout fixed = plan_layout(0, num_experts, alignment, expert_capacity);
  const int64_t per_a = plan_layout(1, num_experts, alignment, expert_capacity).total - fixed.total;
  const int64_t rest = plan.numel() - fixed.total;
  if (fixed.overflow || rest < 0 || rest % (per_a * top_k) != 0) {
    const std::string sizes = std::to_string(plan.numel()) +
                              " entries is no packed plan for top_k=" + std::to_string(top_k) +
                              ", num_experts=" + std::to_string(num_experts);
    if (expert_capacity) {
      value_error(op, "plan",
                  sizes + ", expert_capacity=" + std::to_string(*expert_capacity) +
                      " (expected 3*T*K + E*(expert_capacity+4))");
    }
    value_error(op, "plan", sizes + ", alignment=" + std::to_string(alignment) + " (expected 4*T*K + E*(alignment+3))");
  }
  PackedPlan p;
  p.t = plan;
  p.k = static_cast<int>(top_k);
  p.e = num_experts;
  p.a = rest / per_a;
  p.tokens = p.a / top_k;
  p.layout = plan_layout(p.a, num_experts, alignment, expert_capacity);
  p.cap = p.layout.length[kPlanFields - 1];
  p.m = expert_capacity ? 1 : static_cast<int>(alignment);  // with a capacity the row ops do not read it
  return p;
}

}  // namespace padmoe_torch
