// plan.cpp — make_plan: check, size, dispatch to the backend.
#include <limits>
#include <memory>
#include <new>
#include <algorithm>
#include <string>
#include <vector>

#include "api/alloc.hpp"
#include "api/checks.hpp"
#include "cpu/cpu_backend.hpp"
#include "cuda/cuda_backend.hpp"
#include "padmoe/index_math.hpp"
#include "padmoe/ops.hpp"

namespace padmoe {

using detail::Checker;

PlanView Plan::view() const {
  PlanView v;
  v.indices = indices;
  v.bin_ids = bin_ids;
  v.tokens_per_expert = tokens_per_expert;
  v.bins = bins;
  v.padded_tokens_per_expert = padded_tokens_per_expert;
  v.padded_bins = padded_bins;
  v.dest_rows = dest_rows;
  v.row_sources = row_sources;
  v.num_tokens = num_tokens;
  v.top_k = top_k;
  v.num_experts = num_experts;
  v.alignment = alignment;
  return v;
}

namespace {

// The size helpers' arguments: T >= 0, K >= 1, E >= 0, m >= 1; returns A = T * K (checked).
int64_t helper_assignments(const Checker& c, int64_t num_tokens, int top_k, int num_experts, int alignment) {
  if (num_tokens < 0) c.value_error("num_tokens", "must be >= 0, got " + std::to_string(num_tokens));
  if (top_k < 1) c.value_error("top_k", "must be >= 1, got " + std::to_string(top_k));
  if (num_experts < 0) c.value_error("num_experts", "must be >= 0, got " + std::to_string(num_experts));
  c.alignment(alignment);
  return detail::checked_mul(c, "num_tokens", num_tokens, top_k);
}

// A + E * (m - 1), checked.
int64_t checked_padded_rows_bound(const Checker& c, int64_t assignments, int num_experts, int alignment) {
  return detail::checked_add(c, "num_experts", assignments,
                             detail::checked_mul(c, "num_experts", num_experts, int64_t{alignment} - 1));
}

}  // namespace

namespace {

// A plan's arrays on `device`, uninitialized, with `rows` row_sources (sizes already checked).
Plan allocate_plan(int64_t num_tokens, int top_k, int num_experts, int alignment, int64_t rows, Device device) {
  const int64_t a_count = num_tokens * top_k;
  const detail::NewTensor assignments(DType::kInt32, {a_count}), experts(DType::kInt32, {num_experts});
  // Plan's arrays in its order: indices, bin_ids, tokens_per_expert, bins, padded_tokens_per_expert,
  // padded_bins, dest_rows, row_sources
  Plan plan = detail::allocate_outputs<Plan>(
      device, {assignments, assignments, experts, experts, experts, experts, assignments, {DType::kInt32, {rows}}});
  plan.num_tokens = num_tokens;
  plan.top_k = top_k;
  plan.num_experts = num_experts;
  plan.alignment = alignment;
  return plan;
}

}  // namespace

Plan Plan::empty(int64_t num_tokens, int top_k, int num_experts, int alignment, Device device) {
  Checker c("Plan::empty");
  const int64_t a_count = helper_assignments(c, num_tokens, top_k, num_experts, alignment);
  detail::check_int32_extent(c, "num_tokens", a_count);
  const int64_t rows = checked_padded_rows_bound(c, a_count, num_experts, alignment);
  detail::check_int32_extent(c, "capacity", rows);
  return allocate_plan(num_tokens, top_k, num_experts, alignment, rows, device);
}

int64_t Plan::padded_rows_bound() const {
  // a plan of make_plan holds row_sources of the bound it was made for (E * C with a capacity)
  return row_sources.defined() ? row_sources.numel()
                               : padmoe::padded_rows_bound(num_tokens, top_k, num_experts, alignment);
}

int64_t padded_rows_bound(int64_t num_tokens, int top_k, int num_experts, int alignment) {
  Checker c("padded_rows_bound");
  return checked_padded_rows_bound(c, helper_assignments(c, num_tokens, top_k, num_experts, alignment), num_experts,
                                   alignment);
}

int64_t padded_rows(const PlanView& plan, const Options& options) {
  Checker c("padded_rows");
  if (plan.num_experts < 0) c.value_error("plan.num_experts", "must be >= 0, got " + std::to_string(plan.num_experts));
  c.int32_output(plan.padded_bins, "plan.padded_bins", plan.num_experts);
  detail::require_backend(c, plan.padded_bins.device);
  if (plan.num_experts == 0) return 0;
  int32_t p = 0;
  const int32_t* last = plan.padded_bins.data_as<const int32_t>() + plan.num_experts - 1;
  if (plan.padded_bins.device.is_cuda()) {
    cuda::copy_bytes(&p, Device::cpu(), last, plan.padded_bins.device, sizeof(p), options.stream);
  } else {
    p = *last;
  }
  return p;
}

size_t workspace_bound(int64_t num_tokens, int top_k, int num_experts, int alignment) {
  Checker c("workspace_bound");
  const int64_t a_count = helper_assignments(c, num_tokens, top_k, num_experts, alignment);
  const int64_t rows = checked_padded_rows_bound(c, a_count, num_experts, alignment);
  detail::check_int32_extent(c, "capacity", rows);  // the byte counts below stay far from overflow
  const size_t plan = cuda::plan_workspace_bytes(a_count, num_experts);
  const size_t checks = cuda::validate_workspace_bytes(std::max(a_count, rows));
  const size_t maps = static_cast<size_t>(std::max(a_count, rows)) * 4 + cuda::pad_workspace_bytes(num_experts);
  return std::max(plan, std::max(checks, maps));
}

int64_t padded_rows(const Plan& plan, const Options& options) { return padded_rows(plan.view(), options); }

namespace {

struct PlanShape {
  int64_t tokens;
  int top_k;
  int64_t padded_rows;
};

// Shapes, dtypes and sizes (no pass over the ids); padded_rows is the bound on P.
PlanShape check_top_experts_shape(const Checker& c, const TensorView& top_experts, int num_experts, int alignment) {
  if (top_experts.ndim != 2) c.value_error("top_experts", "expected a 2-D [tokens, top_k] tensor");
  if (!is_index(top_experts.dtype)) {
    c.fail(ErrorKind::kType, "top_experts",
           std::string("expected int32 or int64, got ") + dtype_name(top_experts.dtype));
  }
  if (!top_experts.is_contiguous()) c.value_error("top_experts", "expected a contiguous tensor");
  if (num_experts < 1) c.value_error("num_experts", "must be >= 1, got " + std::to_string(num_experts));
  c.alignment(alignment);
  const int64_t tokens = top_experts.shape[0];
  const int64_t k = top_experts.shape[1];
  if (tokens < 0) c.value_error("top_experts", "negative token count");
  if (k < 1 || k > (int64_t{1} << 30))
    c.value_error("top_k", "top_experts must have top_k >= 1 columns, got " + std::to_string(k));
  if (tokens > std::numeric_limits<int32_t>::max() / k) {  // before multiplying: no overflow
    c.value_error("top_experts", "size overflow: " + std::to_string(tokens) + " x " + std::to_string(k) +
                                     " assignments do not fit the int32 index outputs");
  }
  const int64_t a_count = tokens * k;
  if (top_experts.data == nullptr && a_count > 0) c.value_error("top_experts", "null data pointer");
  detail::check_int32_extent(c, "top_experts", a_count);
  detail::require_backend(c, top_experts.device);
  // P <= A + min(A, E) * (m - 1): at most min(A, E) segments are padded, each by at most m - 1 rows
  const int64_t min_ae = std::min<int64_t>(a_count, num_experts);
  return PlanShape{tokens, static_cast<int>(k), a_count + min_ae * (int64_t{alignment} - 1)};
}

// The allocating forms size row_sources by padded_rows_bound(): it must fit the int32 index outputs.
void check_capacity_fits(const Checker& c, const PlanShape& s, int num_experts, int alignment) {
  detail::check_int32_extent(c, "capacity", checked_padded_rows_bound(c, s.tokens * s.top_k, num_experts, alignment));
}

// PlanOptions resolved after checking: the id map, and the drop rules.
struct Routing {
  index::ExpertRemap remap;
  bool drop_invalid = false;
  int64_t capacity = -1;
  DropPolicy policy = DropPolicy::kPosition;
  TensorView probs;    // kProbs only
  TensorView dropped;  // optional output
  TensorView map;      // expert_map as given (unset: none)
  const char* probs_name = "plan_options.probs";  // in the overlap errors
  const char* map_name = "plan_options.expert_map";  // in errors (moe_align_block_size: "expert_map")
};

// An optional argument is unset when default-constructed (no data, 0-D).
bool is_set(const TensorView& t) { return !(t.data == nullptr && t.ndim == 0); }

// PlanOptions' shapes, dtypes, devices and sizes (no pass over data), for A assignments.
Routing check_plan_options(const Checker& c, const PlanOptions& po, int64_t a_count, int num_experts, int alignment,
                           Device device, const char* map_name = "plan_options.expert_map") {
  Routing r;
  r.map_name = map_name;
  const int64_t global = po.global_experts == 0 ? num_experts : po.global_experts;
  if (po.global_experts < 0)
    c.value_error("plan_options.global_experts", "must be >= 0, got " + std::to_string(po.global_experts));
  r.remap.global = global;
  r.remap.local_experts = num_experts;
  if (is_set(po.expert_map)) {
    c.index_vector(po.expert_map, map_name, global);
    c.same_device(po.expert_map, map_name, device);
    if (po.first_expert != 0) {
      c.value_error("plan_options.first_expert",
                    "must be 0 with an expert_map, got " + std::to_string(po.first_expert));
    }
    r.map = po.expert_map;
    r.remap.map = po.expert_map.data;
    r.remap.map_wide = po.expert_map.dtype == DType::kInt64;
  } else {
    if (po.first_expert < 0 || po.first_expert + static_cast<int64_t>(num_experts) > global) {
      c.value_error("plan_options.first_expert",
                    "the local experts [" + std::to_string(po.first_expert) + ", " +
                        std::to_string(po.first_expert + static_cast<int64_t>(num_experts)) +
                        ") must lie inside [0, global_experts = " + std::to_string(global) + ")");
    }
    r.remap.first = po.first_expert;
  }
  r.drop_invalid = po.drop_invalid;
  if (po.expert_capacity < -1)
    c.value_error("plan_options.expert_capacity",
                  "must be >= 0 (or -1: none), got " + std::to_string(po.expert_capacity));
  r.capacity = po.expert_capacity;
  if (r.capacity >= 0) {
    if (r.capacity % alignment != 0) {
      c.value_error("plan_options.expert_capacity", "alignment " + std::to_string(alignment) +
                                                        " must divide the capacity " + std::to_string(r.capacity));
    }
    if (r.capacity > std::numeric_limits<int32_t>::max() / num_experts) {
      c.value_error("plan_options.expert_capacity", "size overflow: " + std::to_string(num_experts) +
                                                        " experts x capacity " + std::to_string(r.capacity) +
                                                        " rows do not fit the int32 index outputs");
    }
  }
  r.policy = po.drop_policy;
  if (r.policy == DropPolicy::kProbs) {
    if (r.capacity < 0) c.value_error("plan_options.drop_policy", "the probs drop policy needs a capacity");
    if (!is_set(po.probs)) c.value_error("plan_options.probs", "the probs drop policy needs the router weights [T, K]");
  }
  if (is_set(po.probs)) {
    if (r.policy != DropPolicy::kProbs) c.value_error("plan_options.probs", "are read only by the probs drop policy");
    c.scale_vector(po.probs, "plan_options.probs", a_count, DType::kFloat32);
    c.same_device(po.probs, "plan_options.probs", device);
    r.probs = po.probs;
  }
  if (is_set(po.dropped)) {
    c.int32_output(po.dropped, "plan_options.dropped", 1);
    c.same_device(po.dropped, "plan_options.dropped", device);
    r.dropped = po.dropped;
  }
  return r;
}

Routing plain_routing(int num_experts) {
  Routing r;
  r.remap.global = num_experts;
  r.remap.local_experts = num_experts;
  return r;
}

// Shapes, dtypes, and every expert id valid (in [0, global) unless dropped; expert_map entries in
// [-1, E)); returns P (CUDA: its bound; the ids are checked on the device).
PlanShape check_top_experts(const Checker& c, const TensorView& top_experts, int num_experts, int alignment,
                            const Routing& r) {
  PlanShape shape = check_top_experts_shape(c, top_experts, num_experts, alignment);
  if (r.capacity >= 0) {
    shape.padded_rows = r.capacity * num_experts;  // fits int32: check_plan_options
  } else if (top_experts.device.is_cuda()) {
    detail::check_int32_extent(c, "capacity", shape.padded_rows);  // P is not known on the host: its bound
  }
  if (top_experts.device.is_cuda()) return shape;
  const int64_t k = shape.top_k, a_count = shape.tokens * k;
  const detail::IndexReader ids(top_experts);
  std::vector<int64_t> counts = detail::host_vector<int64_t>(c, "num_experts", num_experts, 0);
  for (int64_t a = 0; a < a_count; ++a) {
    const int64_t e = ids[a];
    if ((e < 0 || e >= r.remap.global) && !r.drop_invalid) {
      c.value_error("top_experts", "expert id " + std::to_string(e) + " at [" + std::to_string(a / k) + ", " +
                                       std::to_string(a % k) + "] is outside [0, " + std::to_string(r.remap.global) +
                                       ")");
    }
    const int64_t l = r.remap.local(e);
    if (l >= 0) ++counts[l];
  }
  // after the ids, in the order of CUDA's checked mode (lower violation code first)
  if (r.remap.map != nullptr) {
    const detail::IndexReader map(TensorView::contiguous(const_cast<void*>(r.remap.map),
                                                         r.remap.map_wide ? DType::kInt64 : DType::kInt32,
                                                         {r.remap.global}, top_experts.device));
    for (int64_t g = 0; g < r.remap.global; ++g) {
      if (map[g] < -1 || map[g] >= num_experts) {
        c.value_error(r.map_name, "entry " + std::to_string(g) + " is " + std::to_string(map[g]) + ", outside [-1, " +
                                      std::to_string(num_experts) + ")");
      }
    }
  }
  if (r.capacity >= 0) return shape;
  int64_t padded = 0;
  for (int64_t n : counts) padded += index::round_up(n, alignment);  // <= A + min(A, E) * (m - 1) < 2^62
  detail::check_int32_extent(c, "capacity", padded);
  return PlanShape{shape.tokens, shape.top_k, padded};
}

PlanShape check_top_experts(const Checker& c, const TensorView& top_experts, int num_experts, int alignment) {
  return check_top_experts(c, top_experts, num_experts, alignment, plain_routing(num_experts));
}

void check_plan_outputs(const Checker& c, const PlanView& out, const PlanShape& s, int num_experts, Device device) {
  const int64_t a_count = s.tokens * s.top_k;
  c.int32_output(out.indices, "out.indices", a_count);
  c.int32_output(out.bin_ids, "out.bin_ids", a_count);
  c.int32_output(out.tokens_per_expert, "out.tokens_per_expert", num_experts);
  c.int32_output(out.bins, "out.bins", num_experts);
  c.int32_output(out.padded_tokens_per_expert, "out.padded_tokens_per_expert", num_experts);
  c.int32_output(out.padded_bins, "out.padded_bins", num_experts);
  c.int32_output(out.dest_rows, "out.dest_rows", a_count);
  c.int32_output(out.row_sources, "out.row_sources", s.padded_rows, /*at_least=*/true);
  const TensorView* all[] = {
      &out.indices,     &out.bin_ids,   &out.tokens_per_expert, &out.bins, &out.padded_tokens_per_expert,
      &out.padded_bins, &out.dest_rows, &out.row_sources};
  for (const TensorView* t : all) c.same_device(*t, "out", device);
}


void check_layouts(const Checker& c, const PlanLayouts& l, const PlanView& out, int alignment, Device device) {
  const int64_t rows = out.row_sources.shape[0];
  const TensorView* given[] = {&l.row_experts, &l.block_experts, &l.padded_total};
  const char* names[] = {"layouts.row_experts", "layouts.block_experts", "layouts.padded_total"};
  const int64_t lens[] = {rows, index::ceil_div(rows, alignment), 1};
  for (int i = 0; i < 3; ++i) {
    if (!is_set(*given[i])) continue;
    c.int32_output(*given[i], names[i], lens[i]);
    c.same_device(*given[i], names[i], device);
  }
}

// The outputs (the plan, the given layouts, the dropped count) share no memory with each other or
// with the inputs (the ids, the expert map, the probs).
void check_plan_disjoint(const Checker& c, const TensorView& top_experts, const PlanView& out, const PlanLayouts& l,
                         const Routing& r) {
  const std::pair<const TensorView*, const char*> outs[] = {
      {&out.indices, "out.indices"},
      {&out.bin_ids, "out.bin_ids"},
      {&out.tokens_per_expert, "out.tokens_per_expert"},
      {&out.bins, "out.bins"},
      {&out.padded_tokens_per_expert, "out.padded_tokens_per_expert"},
      {&out.padded_bins, "out.padded_bins"},
      {&out.dest_rows, "out.dest_rows"},
      {&out.row_sources, "out.row_sources"},
      {&l.row_experts, "layouts.row_experts"},
      {&l.block_experts, "layouts.block_experts"},
      {&l.padded_total, "layouts.padded_total"},
      {&r.dropped, "plan_options.dropped"}};
  const std::pair<const TensorView*, const char*> ins[] = {
      {&top_experts, "top_experts"}, {&r.map, r.map_name}, {&r.probs, r.probs_name}};
  const size_t n = sizeof(outs) / sizeof(outs[0]);
  for (size_t i = 0; i < n; ++i) {
    for (const auto& in : ins) detail::check_disjoint(c, *outs[i].first, outs[i].second, *in.first, in.second);
    for (size_t j = 0; j < i; ++j) {
      detail::check_disjoint(c, *outs[i].first, outs[i].second, *outs[j].first, outs[j].second);
    }
  }
}

// CUDA checked mode: the ids (and an expert map) validated on the device, one synchronization.
void validate_ids_on_device(const Checker& c, const TensorView& top_experts, const PlanShape& s, int num_experts,
                            const Routing& r, const Options& options) {
  if (!top_experts.device.is_cuda() || !options.check_data || (r.remap.map == nullptr && r.drop_invalid)) return;
  const bool wide = top_experts.dtype == DType::kInt64;
  cuda::Scratch scratch(options, cuda::validate_workspace_bytes(0), top_experts.device.index);
  const cuda::IndexRef map{r.remap.map, r.remap.map_wide};
  const cuda::Violation v =
      cuda::validate_routing_ids(cuda::IndexRef{top_experts.data, wide}, s.tokens * s.top_k, r.remap.global,
                                 !r.drop_invalid, map, num_experts, scratch.get(), options.stream);
  if (v.code == cuda::kExpertMapOutOfRange) {
    detail::raise_violation(c, v, detail::ViolationNames{r.map_name, num_experts});
  }
  detail::raise_violation(c, v, detail::ViolationNames{"top_experts", r.remap.global, "out.row_sources", s.top_k});
}

// The backend's make_plan on checked arguments (CUDA: ids validated in checked mode).
void run_make_plan(const Checker& c, const TensorView& top_experts, const PlanShape& s, int num_experts, int alignment,
                   const PlanView& out, const Options& options, const PlanLayouts& layouts = {},
                   int32_t padding_source = -1, const Routing* routing = nullptr) {
  const Routing plain = plain_routing(num_experts);
  const Routing& r = routing != nullptr ? *routing : plain;
  const bool wide = top_experts.dtype == DType::kInt64;
  const int64_t a_count = s.tokens * s.top_k;
  const bool cuda_dev = top_experts.device.is_cuda();
  validate_ids_on_device(c, top_experts, s, num_experts, r, options);
  // With a capacity: the plain plan (alignment 1, every kept assignment) into scratch, then the
  // capacity pass writes `out` from it.
  const bool capped = r.capacity >= 0;
  std::vector<int32_t> host;
  std::unique_ptr<cuda::Scratch> dev;
  PlanView full = out;
  full.num_tokens = s.tokens;  // the checked sizes, never the caller's view fields
  full.top_k = s.top_k;
  full.num_experts = num_experts;
  full.alignment = alignment;
  if (capped) {
    const int64_t ints = 4 * a_count + 4 * static_cast<int64_t>(num_experts);
    int32_t* base = nullptr;
    if (cuda_dev) {
      Options own = options;  // Options::workspace serves make_plan's own scratch
      own.workspace = nullptr;
      own.workspace_bytes = 0;
      dev.reset(new cuda::Scratch(own, static_cast<size_t>(ints) * sizeof(int32_t), top_experts.device.index));
      base = static_cast<int32_t*>(dev->get());
    } else {
      host = detail::host_vector<int32_t>(c, "plan_options.expert_capacity", ints, 0);
      base = host.data();
    }
    auto slice = [&](int64_t offset, int64_t n) {
      return TensorView::contiguous(base + offset, DType::kInt32, {n}, top_experts.device);
    };
    full.indices = slice(0, a_count);
    full.bin_ids = slice(a_count, a_count);
    full.dest_rows = slice(2 * a_count, a_count);
    full.row_sources = slice(3 * a_count, a_count);
    full.tokens_per_expert = slice(4 * a_count, num_experts);
    full.bins = slice(4 * a_count + num_experts, num_experts);
    full.padded_tokens_per_expert = slice(4 * a_count + 2 * num_experts, num_experts);
    full.padded_bins = slice(4 * a_count + 3 * num_experts, num_experts);
    full.alignment = 1;
  }
  const int plan_alignment = capped ? 1 : alignment;
  const PlanLayouts plan_layouts = capped ? PlanLayouts{} : layouts;
  int32_t* dropped = r.dropped.data_as<int32_t>();
  if (!cuda_dev) {
    try {  // the backend's host scratch (counts and offsets of E entries a worker, the probs' keys)
      cpu::make_plan(top_experts.data, wide, s.tokens, s.top_k, num_experts, plan_alignment, full, plan_layouts,
                     capped ? -1 : padding_source, r.remap, options.num_threads);
      if (capped) {
        cpu::apply_capacity(full, a_count, num_experts, cpu::Scale{r.probs.data, r.probs.dtype}, r.capacity,
                            r.policy == DropPolicy::kProbs, alignment, out, layouts, padding_source, dropped,
                            options.num_threads);
      } else if (dropped != nullptr) {
        *dropped = 0;
      }
    } catch (const std::bad_alloc&) {
      c.fail(ErrorKind::kRuntime, "num_experts",
             "out of host memory for the plan's scratch (" + std::to_string(num_experts) + " experts)");
    }
    return;
  }
  const cuda::IndexRef ids{top_experts.data, wide};
  {
    cuda::Scratch scratch(options, cuda::plan_workspace_bytes(a_count, num_experts), top_experts.device.index);
    cuda::make_plan(ids, a_count, s.top_k, num_experts, plan_alignment, full, plan_layouts,
                    capped ? -1 : padding_source, r.remap, full.row_sources.shape[0], scratch.get(), options.stream);
  }
  if (capped) {
    cuda::apply_capacity(full, a_count, num_experts, cuda::ScaleArg{r.probs.data, r.probs.dtype}, r.capacity,
                         r.policy == DropPolicy::kProbs, alignment, out, layouts, padding_source,
                         out.row_sources.shape[0], dropped, options.stream);
  } else if (dropped != nullptr) {
    cuda::memset_async(dropped, 0, sizeof(int32_t), options.stream);
  }
}

}  // namespace

void make_plan_out(const TensorView& top_experts, int num_experts, int alignment, const PlanView& out,
                   const Options& options) {
  Checker c("make_plan");
  const PlanShape s = check_top_experts(c, top_experts, num_experts, alignment);
  check_plan_outputs(c, out, s, num_experts, top_experts.device);
  check_plan_disjoint(c, top_experts, out, {}, plain_routing(num_experts));
  run_make_plan(c, top_experts, s, num_experts, alignment, out, options);
}

void make_plan_out(const TensorView& top_experts, int num_experts, int alignment, const PlanView& out,
                   const PlanLayouts& layouts, const Options& options) {
  Checker c("make_plan");
  const PlanShape s = check_top_experts(c, top_experts, num_experts, alignment);
  check_plan_outputs(c, out, s, num_experts, top_experts.device);
  check_layouts(c, layouts, out, alignment, top_experts.device);
  check_plan_disjoint(c, top_experts, out, layouts, plain_routing(num_experts));
  run_make_plan(c, top_experts, s, num_experts, alignment, out, options, layouts);
}

int64_t plan_rows_bound(int64_t num_tokens, int top_k, int num_experts, int alignment, const PlanOptions& po) {
  Checker c("plan_rows_bound");
  const int64_t a_count = helper_assignments(c, num_tokens, top_k, num_experts, alignment);
  if (po.expert_capacity < -1) {
    c.value_error("plan_options.expert_capacity",
                  "must be >= 0 (or -1: none), got " + std::to_string(po.expert_capacity));
  }
  if (po.expert_capacity >= 0)
    return detail::checked_mul(c, "plan_options.expert_capacity", po.expert_capacity, num_experts);
  return checked_padded_rows_bound(c, a_count, num_experts, alignment);
}

void make_plan_out(const TensorView& top_experts, int num_experts, int alignment, const PlanView& out,
                   const PlanLayouts& layouts, const PlanOptions& plan_options, const Options& options) {
  Checker c("make_plan");
  const PlanShape shape = check_top_experts_shape(c, top_experts, num_experts, alignment);
  const Routing r =
      check_plan_options(c, plan_options, shape.tokens * shape.top_k, num_experts, alignment, top_experts.device);
  const PlanShape s = check_top_experts(c, top_experts, num_experts, alignment, r);
  check_plan_outputs(c, out, s, num_experts, top_experts.device);
  check_layouts(c, layouts, out, alignment, top_experts.device);
  check_plan_disjoint(c, top_experts, out, layouts, r);
  run_make_plan(c, top_experts, s, num_experts, alignment, out, options, layouts, -1, &r);
}

Plan make_plan(const TensorView& top_experts, int num_experts, int alignment, const PlanOptions& plan_options,
               const Options& options) {
  Checker c("make_plan");
  const PlanShape shape = check_top_experts_shape(c, top_experts, num_experts, alignment);
  const Routing r =
      check_plan_options(c, plan_options, shape.tokens * shape.top_k, num_experts, alignment, top_experts.device);
  if (r.capacity < 0) check_capacity_fits(c, shape, num_experts, alignment);  // sizes before the data
  const PlanShape s = check_top_experts(c, top_experts, num_experts, alignment, r);
  // E * C rows with a capacity (checked to fit int32 with the options), else the capacity bound
  const int64_t rows =
      r.capacity >= 0 ? r.capacity * num_experts : index::padded_rows_bound(s.tokens * s.top_k, num_experts, alignment);
  Plan plan = allocate_plan(s.tokens, s.top_k, num_experts, alignment, rows, top_experts.device);
  run_make_plan(c, top_experts, s, num_experts, alignment, plan.view(), options, {}, -1, &r);
  return plan;
}

namespace {

// make_plan_and_dispatch's rows against the ids' shape: x [T, H] (float8 only unweighted, as
// dispatch), weights [A] float32 / float16 / bfloat16, y [>= rows, H] of x's dtype; one device.
void check_plan_dispatch_rows(const Checker& c, const TensorView& x, const std::optional<TensorView>& weights,
                              const TensorView* y, int64_t y_rows, const PlanShape& s, Device device) {
  c.row_tensor(x, "x", s.tokens, -1, /*allow_fp8=*/!weights);
  c.same_device(x, "x", device);
  if (weights) {
    c.scale_vector(*weights, "weights", s.tokens * s.top_k, x.dtype);
    c.same_device(*weights, "weights", device);
  }
  if (y != nullptr) {
    c.row_output(*y, "y", y_rows, /*at_least=*/true, x.shape[1], x.dtype);
    c.same_device(*y, "y", device);
  }
}

// Both steps on checked arguments: make_plan's launch then dispatch's (whose own checks pass: the
// plan is valid by construction and y is large enough).
void run_plan_dispatch(const Checker& c, const TensorView& x, const TensorView& top_experts, const PlanShape& s,
                       int num_experts, int alignment, const PlanView& out, const std::optional<TensorView>& weights,
                       const TensorView& y, const Options& options) {
  run_make_plan(c, top_experts, s, num_experts, alignment, out, options);
  PlanView plan = out;
  plan.num_tokens = s.tokens;
  plan.top_k = s.top_k;
  plan.num_experts = num_experts;
  plan.alignment = alignment;
  Options o = options;
  o.check_data = false;  // CUDA: the ids were validated; the plan is make_plan's
  dispatch_out(x, plan, weights, y, o);
}

}  // namespace

void make_plan_and_dispatch_out(const TensorView& x, const TensorView& top_experts, int num_experts, int alignment,
                                const PlanView& out, const std::optional<TensorView>& weights, const TensorView& y,
                                const Options& options) {
  Checker c("make_plan_and_dispatch");
  const PlanShape s = check_top_experts(c, top_experts, num_experts, alignment);
  check_plan_outputs(c, out, s, num_experts, top_experts.device);
  check_plan_dispatch_rows(c, x, weights, &y, out.row_sources.shape[0], s, top_experts.device);
  Routing rows = plain_routing(num_experts);  // the plan's arrays apart from x and the weights too
  rows.map = x;
  rows.map_name = "x";
  if (weights) rows.probs = *weights;
  rows.probs_name = "weights";
  check_plan_disjoint(c, top_experts, out, {}, rows);
  const TensorView* plan_arrays[] = {
      &out.indices,     &out.bin_ids,   &out.tokens_per_expert, &out.bins, &out.padded_tokens_per_expert,
      &out.padded_bins, &out.dest_rows, &out.row_sources};
  for (const TensorView* a : plan_arrays) detail::check_disjoint(c, y, "y", *a, "out");
  detail::check_disjoint(c, y, "y", x, "x");
  detail::check_disjoint(c, y, "y", top_experts, "top_experts");
  if (weights) detail::check_disjoint(c, y, "y", *weights, "weights");
  run_plan_dispatch(c, x, top_experts, s, num_experts, alignment, out, weights, y, options);
}

PlannedRows make_plan_and_dispatch(const TensorView& x, const TensorView& top_experts, int num_experts, int alignment,
                                   const std::optional<TensorView>& weights, const Options& options) {
  Checker c("make_plan_and_dispatch");
  check_capacity_fits(c, check_top_experts_shape(c, top_experts, num_experts, alignment), num_experts, alignment);
  const PlanShape s = check_top_experts(c, top_experts, num_experts, alignment);
  check_plan_dispatch_rows(c, x, weights, nullptr, 0, s, top_experts.device);
  PlannedRows r;
  r.plan = Plan::empty(s.tokens, s.top_k, num_experts, alignment, top_experts.device);
  r.y = detail::allocate_outputs<Tensor>(
      x.device, {detail::rows_like(x, r.plan.padded_rows_bound())}, [&](const Tensor& y) {
        Options o = options;
        o.zero_tail = true;  // y has the bound's rows: those at or past P are zero
        run_plan_dispatch(c, x, top_experts, s, num_experts, alignment, r.plan.view(), weights, y, o);
      });
  return r;
}

int64_t aligned_rows_bound(int64_t assignments, int num_experts, int block_size, bool pad_sorted_ids) {
  Checker c("aligned_rows_bound");
  if (assignments < 0) c.value_error("assignments", "must be >= 0, got " + std::to_string(assignments));
  if (num_experts < 0) c.value_error("num_experts", "must be >= 0, got " + std::to_string(num_experts));
  if (block_size < 1) c.value_error("block_size", "must be >= 1, got " + std::to_string(block_size));
  const int64_t m = block_size;
  const int64_t padding = std::min<int64_t>(assignments, num_experts) * (m - 1);  // < 2^31 * 2^31
  const int64_t rows = detail::checked_add(c, "assignments", assignments, padding);
  return pad_sorted_ids ? detail::checked_round_up(c, "assignments", rows, m) : rows;
}

namespace {

// moe_align_block_size's inputs, checked (ids on the host for CPU tensors; on CUDA while the plan
// is made): the shape, and the routing of vLLM's expert_map (ignore_invalid_experts) when set.
struct AlignInputs {
  PlanShape s;
  Routing r;
};

AlignInputs align_inputs(const Checker& c, const TensorView& top_experts, int block_size, int num_experts,
                         const TensorView& expert_map) {
  if (block_size < 1) c.value_error("block_size", "must be >= 1, got " + std::to_string(block_size));
  // vLLM's kernel skips ids outside [0, E) (and, with a map, ids mapped to -1): such assignments get
  // no entry. The map itself is checked: [E] entries in [-1, E).
  const PlanShape shape = check_top_experts_shape(c, top_experts, num_experts, block_size);
  PlanOptions po;
  po.expert_map = expert_map;
  po.drop_invalid = true;
  const Routing r =
      check_plan_options(c, po, shape.tokens * shape.top_k, num_experts, block_size, top_experts.device, "expert_map");
  return {check_top_experts(c, top_experts, num_experts, block_size, r), r};
}

void run_align_blocks(const Checker& c, const TensorView& top_experts, int block_size, int num_experts,
                      const AlignInputs& in, const TensorView& sorted_token_ids, const TensorView& expert_ids,
                      const TensorView& num_tokens_post_padded, const Options& options);

// moe_align_block_size_out: the inputs, then the outputs checked, then the plan.
void align_blocks_out(const TensorView& top_experts, int block_size, int num_experts, const TensorView& expert_map,
                      const TensorView& sorted_token_ids, const TensorView& expert_ids,
                      const TensorView& num_tokens_post_padded, const Options& options) {
  Checker c("moe_align_block_size");
  const AlignInputs in = align_inputs(c, top_experts, block_size, num_experts, expert_map);
  const PlanShape& s = in.s;
  const int64_t a_count = s.tokens * s.top_k;
  const Device device = top_experts.device;
  c.int32_output(sorted_token_ids, "sorted_token_ids", aligned_rows_bound(a_count, num_experts, block_size),
                 /*at_least=*/true);
  const int64_t rows = sorted_token_ids.shape[0];
  c.int32_output(expert_ids, "expert_ids", index::ceil_div(rows, block_size));
  c.int32_output(num_tokens_post_padded, "num_tokens_post_padded", 1);
  c.same_device(sorted_token_ids, "sorted_token_ids", device);
  c.same_device(expert_ids, "expert_ids", device);
  c.same_device(num_tokens_post_padded, "num_tokens_post_padded", device);
  const std::pair<const TensorView*, const char*> outs[] = {{&sorted_token_ids, "sorted_token_ids"},
                                                            {&expert_ids, "expert_ids"},
                                                            {&num_tokens_post_padded, "num_tokens_post_padded"}};
  for (int i = 0; i < 3; ++i) {
    detail::check_disjoint(c, *outs[i].first, outs[i].second, top_experts, "top_experts");
    detail::check_disjoint(c, *outs[i].first, outs[i].second, expert_map, "expert_map");
    for (int j = 0; j < i; ++j)
      detail::check_disjoint(c, *outs[i].first, outs[i].second, *outs[j].first, outs[j].second);
  }
  run_align_blocks(c, top_experts, block_size, num_experts, in, sorted_token_ids, expert_ids, num_tokens_post_padded,
                   options);
}

// The plan into vLLM's outputs (checked); its other arrays are scratch.
void run_align_blocks(const Checker& c, const TensorView& top_experts, int block_size, int num_experts,
                      const AlignInputs& in, const TensorView& sorted_token_ids, const TensorView& expert_ids,
                      const TensorView& num_tokens_post_padded, const Options& options) {
  const PlanShape& s = in.s;
  const int64_t a_count = s.tokens * s.top_k;
  const Device device = top_experts.device;
  // The plan's other arrays are scratch: 3 of A entries, 4 of E.
  const int64_t ints = 3 * a_count + 4 * static_cast<int64_t>(num_experts);
  std::vector<int32_t> host;
  std::unique_ptr<cuda::Scratch> dev;
  int32_t* base = nullptr;
  if (device.is_cuda()) {
    Options own = options;  // Options::workspace goes to make_plan's own scratch: these arrays live beside it
    own.workspace = nullptr;
    own.workspace_bytes = 0;
    dev.reset(new cuda::Scratch(own, static_cast<size_t>(ints) * sizeof(int32_t), device.index));
    base = static_cast<int32_t*>(dev->get());
  } else {
    host = detail::host_vector<int32_t>(c, "top_experts", ints, 0);
    base = host.data();
  }
  auto slice = [&](int64_t offset, int64_t n) {
    return TensorView::contiguous(base + offset, DType::kInt32, {n}, device);
  };
  PlanView plan;
  plan.indices = slice(0, a_count);
  plan.bin_ids = slice(a_count, a_count);
  plan.dest_rows = slice(2 * a_count, a_count);
  plan.tokens_per_expert = slice(3 * a_count, num_experts);
  plan.bins = slice(3 * a_count + num_experts, num_experts);
  plan.padded_tokens_per_expert = slice(3 * a_count + 2 * num_experts, num_experts);
  plan.padded_bins = slice(3 * a_count + 3 * num_experts, num_experts);
  plan.row_sources = sorted_token_ids;  // the plan's row_sources are vLLM's sorted_token_ids
  plan.num_tokens = s.tokens;
  plan.top_k = s.top_k;
  plan.num_experts = num_experts;
  plan.alignment = block_size;
  PlanLayouts layouts;
  layouts.block_experts = expert_ids;
  layouts.padded_total = num_tokens_post_padded;
  // padding rows of sorted_token_ids hold the sentinel A (such a row_sources is no plan's: kept internal)
  run_make_plan(c, top_experts, s, num_experts, block_size, plan, options, layouts, static_cast<int32_t>(a_count),
                &in.r);
}

}  // namespace

void moe_align_block_size_out(const TensorView& top_experts, int block_size, int num_experts,
                              const TensorView& sorted_token_ids, const TensorView& expert_ids,
                              const TensorView& num_tokens_post_padded, const Options& options) {
  align_blocks_out(top_experts, block_size, num_experts, TensorView{}, sorted_token_ids, expert_ids,
                   num_tokens_post_padded, options);
}

void moe_align_block_size_out(const TensorView& top_experts, int block_size, int num_experts,
                              const TensorView& expert_map, const TensorView& sorted_token_ids,
                              const TensorView& expert_ids, const TensorView& num_tokens_post_padded,
                              const Options& options) {
  align_blocks_out(top_experts, block_size, num_experts, expert_map, sorted_token_ids, expert_ids,
                   num_tokens_post_padded, options);
}

AlignedBlocks moe_align_block_size(const TensorView& top_experts, int block_size, int num_experts, bool pad_sorted_ids,
                                   const Options& options) {
  return moe_align_block_size(top_experts, block_size, num_experts, TensorView{}, pad_sorted_ids, options);
}

AlignedBlocks moe_align_block_size(const TensorView& top_experts, int block_size, int num_experts,
                                   const TensorView& expert_map, bool pad_sorted_ids, const Options& options) {
  Checker c("moe_align_block_size");
  // every input checked before the outputs are allocated (on CUDA the ids are checked on the device)
  const AlignInputs in = align_inputs(c, top_experts, block_size, num_experts, expert_map);
  const int64_t rows = aligned_rows_bound(in.s.tokens * in.s.top_k, num_experts, block_size, pad_sorted_ids);
  detail::check_int32_extent(c, "sorted_token_ids", rows);
  return detail::allocate_outputs<AlignedBlocks>(
      top_experts.device,
      {{DType::kInt32, {rows}}, {DType::kInt32, {index::ceil_div(rows, block_size)}}, {DType::kInt32, {1}}},
      [&](const AlignedBlocks& r) {
        run_align_blocks(c, top_experts, block_size, num_experts, in, r.sorted_token_ids, r.expert_ids,
                         r.num_tokens_post_padded, options);
      });
}

Plan make_plan(const TensorView& top_experts, int num_experts, int alignment, const Options& options) {
  Checker c("make_plan");
  check_capacity_fits(c, check_top_experts_shape(c, top_experts, num_experts, alignment), num_experts, alignment);
  const PlanShape s = check_top_experts(c, top_experts, num_experts, alignment);
  Plan plan = Plan::empty(s.tokens, s.top_k, num_experts, alignment, top_experts.device);
  run_make_plan(c, top_experts, s, num_experts, alignment, plan.view(), options);
  return plan;
}

}  // namespace padmoe
