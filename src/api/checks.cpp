// checks.cpp — docs/spec.md §12, in one place.
#include "api/checks.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "cpu/thread_pool.hpp"
#include "padmoe/index_math.hpp"

namespace padmoe {
namespace detail {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

std::string shape_str(const TensorView& t) {
  std::string s = "[";
  for (int d = 0; d < t.ndim; ++d) s += (d ? ", " : "") + str(t.shape[d]);
  return s + "]";
}

void Checker::fail(ErrorKind kind, const std::string& arg, const std::string& what) const {
  throw Error(kind, std::string(op_) + ": " + arg + ": " + what);
}

void Checker::same_device(const TensorView& t, const char* name, Device device) const {
  if (t.device != device) {
    fail(ErrorKind::kType, name,
         "expected a tensor on " + device_name(device) + ", got one on " + device_name(t.device));
  }
}

void Checker::row_tensor(const TensorView& t, const char* name, int64_t rows, int64_t cols, bool allow_fp8) const {
  if (t.ndim != 2) value_error(name, "expected a 2-D [rows, hidden] tensor, got shape " + shape_str(t));
  if (!is_floating(t.dtype) || (is_float8(t.dtype) && !allow_fp8)) {
    fail(ErrorKind::kType, name,
         std::string(allow_fp8 ? "expected float32, float16, bfloat16 or float8"
                               : "expected float32, float16 or bfloat16") +
             ", got " + dtype_name(t.dtype) +
             (is_float8(t.dtype) ? " (float8 rows are for move-only ops: no weights)" : ""));
  }
  if (rows >= 0 && t.shape[0] != rows) {
    value_error(name, "expected " + str(rows) + " rows, got shape " + shape_str(t));
  }
  if (cols >= 0 && t.shape[1] != cols) {
    value_error(name, "expected " + str(cols) + " columns (hidden size), got shape " + shape_str(t));
  }
  if (t.shape[0] < 0 || t.shape[1] < 0) value_error(name, "negative size in shape " + shape_str(t));
  if (t.shape[1] > 1 && t.strides[1] != 1) {
    value_error(name, "expected unit stride along the hidden dimension, got stride " + str(t.strides[1]));
  }
  if (t.shape[0] > 1 && t.strides[0] < t.shape[1]) {
    value_error(name, "row stride " + str(t.strides[0]) + " is smaller than the row length " + str(t.shape[1]));
  }
  if (t.data == nullptr && t.shape[0] > 0 && t.shape[1] > 0) value_error(name, "null data pointer");
}

void Checker::row_output(const TensorView& t, const char* name, int64_t rows, bool at_least, int64_t cols,
                         DType dtype) const {
  row_tensor(t, name, -1, cols, /*allow_fp8=*/true);
  if (t.dtype != dtype) {
    fail(ErrorKind::kType, name,
         std::string("expected dtype ") + dtype_name(dtype) + " (the input's), got " + dtype_name(t.dtype));
  }
  if (at_least ? t.shape[0] < rows : t.shape[0] != rows) {
    value_error(name, std::string("output capacity: needs ") + (at_least ? "at least " : "") + str(rows) +
                          " rows, got shape " + shape_str(t));
  }
}

void Checker::index_vector(const TensorView& t, const char* name, int64_t len) const {
  if (t.ndim != 1) value_error(name, "expected a 1-D tensor, got shape " + shape_str(t));
  if (!is_index(t.dtype)) {
    fail(ErrorKind::kType, name, std::string("expected int32 or int64, got ") + dtype_name(t.dtype));
  }
  if (t.shape[0] < 0) value_error(name, "negative length " + str(t.shape[0]));
  if (len >= 0 && t.shape[0] != len) value_error(name, "expected " + str(len) + " entries, got " + str(t.shape[0]));
  if (t.shape[0] > 1 && t.strides[0] != 1)
    value_error(name, "expected a contiguous tensor, got stride " + str(t.strides[0]));
  if (t.data == nullptr && t.shape[0] > 0) value_error(name, "null data pointer");
}

void Checker::int32_output(const TensorView& t, const char* name, int64_t len, bool at_least) const {
  if (t.ndim != 1) value_error(name, "expected a 1-D tensor, got shape " + shape_str(t));
  if (t.dtype != DType::kInt32) fail(ErrorKind::kType, name, std::string("expected int32, got ") + dtype_name(t.dtype));
  if (t.shape[0] < 0) value_error(name, "negative length " + str(t.shape[0]));
  if (at_least ? t.shape[0] < len : t.shape[0] != len) {
    value_error(name, std::string("output capacity: needs ") + (at_least ? "at least " : "") + str(len) +
                          " entries, got " + str(t.shape[0]));
  }
  if (t.shape[0] > 1 && t.strides[0] != 1)
    value_error(name, "expected a contiguous tensor, got stride " + str(t.strides[0]));
  if (t.data == nullptr && t.shape[0] > 0) value_error(name, "null data pointer");
}

void Checker::scale_vector(const TensorView& t, const char* name, int64_t len, DType row_dtype) const {
  // Router weights and probs may be of any 16/32-bit float dtype, whatever the rows' dtype (under
  // bf16 autocast routers emit bf16 weights beside float32 rows); they are read as float32.
  (void)row_dtype;
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat16 && t.dtype != DType::kBFloat16) {
    fail(ErrorKind::kType, name, std::string("expected float32, float16 or bfloat16, got ") + dtype_name(t.dtype));
  }
  if (t.numel() != len)
    value_error(name, "expected " + str(len) + " elements (one per row), got shape " + shape_str(t));
  if (!t.is_contiguous()) value_error(name, "expected a contiguous tensor");
  if (t.data == nullptr && len > 0) value_error(name, "null data pointer");
}

void Checker::float_output(const TensorView& t, const char* name, int64_t len, DType row_dtype) const {
  (void)row_dtype;  // weight gradients are written in the weights' dtype, any of the three
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat16 && t.dtype != DType::kBFloat16) {
    fail(ErrorKind::kType, name, std::string("expected float32, float16 or bfloat16, got ") + dtype_name(t.dtype));
  }
  if (t.numel() != len) value_error(name, "expected " + str(len) + " elements, got shape " + shape_str(t));
  if (!t.is_contiguous()) value_error(name, "expected a contiguous tensor");
  if (t.data == nullptr && len > 0) value_error(name, "null data pointer");
}

void Checker::top_k(int top_k, int64_t assignments) const {
  if (top_k < 1) value_error("top_k", "must be >= 1, got " + str(top_k));
  if (assignments % top_k != 0) {
    value_error("top_k", "the " + str(assignments) + " assignments are not a multiple of top_k = " + str(top_k));
  }
}

void Checker::alignment(int alignment) const {
  if (alignment < 1) value_error("alignment", "must be >= 1, got " + str(alignment));
}

void check_int32_extent(const Checker& c, const char* what, int64_t value) {
  if (value > std::numeric_limits<int32_t>::max()) {
    c.value_error(what, "size overflow: " + str(value) + " does not fit the int32 index outputs");
  }
}

bool plan_outputs(const Checker& c, const TensorView& counts, int64_t counts_len, const TensorView& dest_rows,
                  const TensorView& row_sources, const TensorView& indices, const TensorView& bin_ids,
                  int64_t assignments, Device device) {
  c.int32_output(counts, "counts", counts_len);
  c.int32_output(dest_rows, "dest_rows", assignments);
  c.int32_output(row_sources, "row_sources", 0, /*at_least=*/true);
  c.same_device(counts, "counts", device);
  c.same_device(dest_rows, "dest_rows", device);
  c.same_device(row_sources, "row_sources", device);
  const bool sorted = indices.data != nullptr || bin_ids.data != nullptr;
  if (sorted) {
    c.int32_output(indices, "indices", assignments);
    c.int32_output(bin_ids, "bin_ids", assignments);
    c.same_device(indices, "indices", device);
    c.same_device(bin_ids, "bin_ids", device);
  }
  return sorted;
}

namespace {

// The bytes a view addresses, as `rows` runs of `row_bytes` bytes, `stride` bytes apart, from `lo`.
struct Span {
  intptr_t lo = 0;
  int64_t rows = 0, row_bytes = 0, stride = 0;
  intptr_t hi() const { return lo + static_cast<intptr_t>((rows - 1) * stride + row_bytes); }
};

Span span_of(const TensorView& t) {
  Span s;
  if (t.data == nullptr || t.numel() == 0) return s;
  const int64_t e = static_cast<int64_t>(element_size(t.dtype));
  s.lo = reinterpret_cast<intptr_t>(t.data);
  if (t.ndim == 2 && (t.shape[1] <= 1 || t.strides[1] == 1) && t.strides[0] >= t.shape[1]) {
    s.rows = t.shape[0];
    s.row_bytes = t.shape[1] * e;
    s.stride = t.strides[0] * e;
    return s;
  }
  int64_t last = 0;  // any other layout: one run up to its last element
  for (int d = 0; d < t.ndim; ++d) last += (t.shape[d] - 1) * (t.strides[d] < 0 ? -t.strides[d] : t.strides[d]);
  s.rows = 1;
  s.row_bytes = (last + 1) * e;
  s.stride = s.row_bytes;
  return s;
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0)) ? 1 : 0); }

bool spans_overlap(const Span& a, const Span& b) {
  if (a.rows == 0 || b.rows == 0 || a.hi() <= b.lo || b.hi() <= a.lo) return false;
  if (a.rows > 1 && b.rows > 1 && a.stride != b.stride) return true;  // runs of two strides: the ranges decide
  const int64_t s = a.rows > 1 ? a.stride : b.rows > 1 ? b.stride : 0;
  if (s == 0 || a.row_bytes > s || b.row_bytes > s) return true;
  // rows i of a and j of b meet iff -b.row_bytes < d + (j - i) * s < a.row_bytes, d = b.lo - a.lo
  const int64_t d = static_cast<int64_t>(b.lo - a.lo);
  const int64_t k_lo = -floor_div(d + b.row_bytes - 1, s);  // smallest k with d + k*s > -b.row_bytes
  const int64_t k_hi = floor_div(a.row_bytes - 1 - d, s);   // largest k with d + k*s < a.row_bytes
  return std::max(k_lo, -(a.rows - 1)) <= std::min(k_hi, b.rows - 1);
}

}  // namespace

void check_disjoint(const Checker& c, const TensorView& out, const char* name, const TensorView& other,
                    const char* other_name) {
  if (spans_overlap(span_of(out), span_of(other))) {
    c.value_error(
        name, std::string("shares memory with ") + other_name + ": outputs must not overlap the inputs or each other");
  }
}

void check_disjoint_all(const Checker& c, std::initializer_list<Named> outputs, std::initializer_list<Named> inputs) {
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    if (o->view == nullptr) continue;
    for (const Named& in : inputs) {
      if (in.view != nullptr) check_disjoint(c, *o->view, o->name, *in.view, in.name);
    }
    for (auto p = outputs.begin(); p != o; ++p) {
      if (p->view != nullptr) check_disjoint(c, *o->view, o->name, *p->view, p->name);
    }
  }
}

int64_t checked_add(const Checker& c, const char* what, int64_t a, int64_t b) {
  if (a > std::numeric_limits<int64_t>::max() - b) {
    c.value_error(what, "size overflow: " + str(a) + " + " + str(b) + " does not fit 64 bits");
  }
  return a + b;
}

int64_t checked_mul(const Checker& c, const char* what, int64_t a, int64_t b) {
  if (b != 0 && a > std::numeric_limits<int64_t>::max() / b) {
    c.value_error(what, "size overflow: " + str(a) + " x " + str(b) + " does not fit 64 bits");
  }
  return a * b;
}

int64_t checked_round_up(const Checker& c, const char* what, int64_t x, int64_t m) {
  const int64_t q = x / m + (x % m != 0 ? 1 : 0);  // ceil(x / m) without forming x + m - 1
  return checked_mul(c, what, q, m);
}

void require_backend(const Checker& c, Device device) {
#if !defined(PADMOE_WITH_CUDA)
  if (device.is_cuda()) {
    c.fail(ErrorKind::kUnsupported, "device",
           "tensors are on " + device_name(device) + " but padmoe was built without CUDA (PADMOE_CUDA=OFF)");
  }
#else
  (void)c;
  (void)device;
#endif
}

void raise_violation(const Checker& c, const cuda::Violation& v, const ViolationNames& names) {
  using namespace cuda;
  switch (v.code) {
    case kOk: return;
    case kExpertOutOfRange:
      c.value_error(names.ids,
                    "expert id " + str(v.v1) + " at " +
                        (names.top_k > 0 ? "[" + str(v.pos / names.top_k) + ", " + str(v.pos % names.top_k) + "]"
                                         : "position " + str(v.pos)) +
                        " is outside [0, " + str(names.limit) + ")");
    case kBinsDecreasing:
      c.value_error("bins", "must be nondecreasing: bins[" + str(v.pos) + "] = " + str(v.v1) + " < bins[" +
                                str(v.pos - 1) + "] = " + str(v.v2));
    case kBinsTotal:
      c.value_error("bins", "bins[E-1] = " + str(v.v1) + " must equal the number of assignments " + str(names.limit));
    case kPaddedDecreasing:
      c.value_error("padded_bins", "must be nondecreasing: padded_bins[" + str(v.pos) + "] = " + str(v.v1) +
                                       " < padded_bins[" + str(v.pos - 1) + "] = " + str(v.v2));
    case kPaddedTooSmall:
      c.value_error("padded_bins", "segment of expert " + str(v.pos) + " holds " + str(v.v1) +
                                       " rows but the expert has " + str(v.v2) + " assignments");
    case kBinIdsInconsistent:
      c.value_error("bin_ids",
                    "position " + str(v.pos) + " holds expert " + str(v.v1) + ", which bins do not place there");
    case kIndexOutOfRange:
      c.value_error("indices", "position " + str(v.pos) + " holds assignment id " + str(v.v1) + ", outside [0, " +
                                   str(names.limit) + ")");
    case kIndexRepeated:
      c.value_error("indices", "must be a permutation of [0, " + str(names.limit) + "): assignment id " + str(v.pos) +
                                   " appears more than once");
    case kCapacity:
      c.value_error(names.output, "output capacity: needs at least " + str(v.v1) + " rows, got " + str(v.v2));
    case kCountNegative: c.value_error("tokens_per_expert", "entry " + str(v.pos) + " is negative (" + str(v.v1) + ")");
    case kCountTotal:
      c.value_error("tokens_per_expert", "sums to " + str(v.v1) + " but hidden_states has " + str(v.v2) + " rows");
    case kMapOutOfRange:
      c.value_error("permutation_map",
                    "entry " + str(v.pos) + " is " + str(v.v1) + ", outside [-1, " + str(names.limit) + ")");
    case kMapRepeated: c.value_error("permutation_map", "row " + str(v.v1) + " is named by more than one entry");
    case kPlanDestRows:
      c.value_error("plan.dest_rows",
                    "assignment " + str(v.pos) + " maps to row " + str(v.v1) + ", which row_sources does not map back");
    case kPlanRowSources:
      c.value_error("plan.row_sources", "row " + str(v.pos) + " names assignment " + str(v.v1) +
                                            " whose dest_rows entry does not point back to it");
    case kExpertMapOutOfRange:
      c.value_error(names.ids, "entry " + str(v.pos) + " is " + str(v.v1) + ", outside [-1, " + str(names.limit) + ")");
    default: c.value_error("input", "failed validation (code " + str(v.code) + ")");
  }
}

void check_sorted_shapes(const Checker& c, const TensorView& indices, const TensorView& bin_ids, const TensorView& bins,
                         const TensorView& padded_bins, int top_k) {
  c.index_vector(indices, "indices", -1);
  const int64_t a_count = indices.shape[0];
  c.index_vector(bin_ids, "bin_ids", a_count);
  c.index_vector(bins, "bins", -1);
  c.index_vector(padded_bins, "padded_bins", bins.shape[0]);
  c.top_k(top_k, a_count);
  c.same_device(bin_ids, "bin_ids", indices.device);
  c.same_device(bins, "bins", indices.device);
  c.same_device(padded_bins, "padded_bins", indices.device);
  check_int32_extent(c, "indices", a_count);
  if (bins.shape[0] == 0 && a_count > 0) c.value_error("bins", "no experts but " + str(a_count) + " assignments");
}

RoutingMap check_sorted_routing(const Checker& c, const TensorView& indices, const TensorView& bin_ids,
                                const TensorView& bins, const TensorView& padded_bins, int top_k, int num_threads) {
  check_sorted_shapes(c, indices, bin_ids, bins, padded_bins, top_k);
  const int64_t a_count = indices.shape[0];
  const int64_t experts = bins.shape[0];
  const IndexReader idx(indices), bid(bin_ids), bn(bins), pb(padded_bins);

  // bins: nondecreasing, ending at A; padded segments hold their counts.
  int64_t prev = 0, pprev = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t b = bn[e], p = pb[e];
    if (b < prev) {
      c.value_error("bins", "must be nondecreasing: bins[" + str(e) + "] = " + str(b) + " < bins[" + str(e - 1) +
                                "] = " + str(prev));
    }
    if (p < pprev) {
      c.value_error("padded_bins", "must be nondecreasing: padded_bins[" + str(e) + "] = " + str(p) +
                                       " < padded_bins[" + str(e - 1) + "] = " + str(pprev));
    }
    if (p - pprev < b - prev) {
      c.value_error("padded_bins", "segment of expert " + str(e) + " holds " + str(p - pprev) +
                                       " rows but the expert has " + str(b - prev) + " assignments");
    }
    prev = b;
    pprev = p;
  }
  if (experts > 0 && prev != a_count) {
    c.value_error("bins", "bins[E-1] = " + str(prev) + " must equal the number of assignments " + str(a_count));
  }
  const int64_t padded = pprev;
  check_int32_extent(c, "padded_bins", padded);

  // bin_ids consistent with bins.
  for (int64_t e = 0, i = 0; e < experts; ++e) {
    for (const int64_t end = bn[e]; i < end; ++i) {
      if (bid[i] != e) {
        c.value_error("bin_ids",
                      "position " + str(i) + " holds expert " + str(bid[i]) + " but bins place it in expert " + str(e));
      }
    }
  }

  // indices: a permutation of [0, A). first_pos[a] = 1 + the sorted position holding a.
  RoutingMap map;
  map.assignments = a_count;
  map.padded_rows = padded;
  map.top_k = top_k;
  std::vector<int32_t> first_pos = host_vector<int32_t>(c, "indices", a_count, 0);
  for (int64_t i = 0; i < a_count; ++i) {
    const int64_t a = idx[i];
    if (a < 0 || a >= a_count) {
      c.value_error("indices",
                    "position " + str(i) + " holds assignment id " + str(a) + ", outside [0, " + str(a_count) + ")");
    }
    if (first_pos[a] != 0) {
      c.value_error("indices", "must be a permutation of [0, " + str(a_count) + "): assignment id " + str(a) +
                                   " appears at positions " + str(first_pos[a] - 1) + " and " + str(i));
    }
    first_pos[a] = static_cast<int32_t>(i + 1);
  }

  // Inverse map, docs/spec.md §15 partition: worker w owns sorted positions
  // [w*B, min((w+1)*B, A)) and writes their rows, and the padding rows of its
  // share of the experts. Every entry is written once.
  map.dest_rows = host_vector<int32_t>(c, "indices", a_count);
  map.row_sources = host_vector<int32_t>(c, "padded_bins", padded);
  const int workers =
      static_cast<int>(std::min<int64_t>(cpu::resolve_threads(num_threads), std::max<int64_t>(1, a_count / 4096)));
  cpu::parallel_run(workers, [&](int w) {
    const index::Range r = index::work_range(w, workers, a_count);
    int64_t e = -1, real_start = 0, padded_start = 0;
    for (int64_t i = r.begin; i < r.end; ++i) {
      if (bid[i] != e) {
        e = bid[i];
        real_start = e == 0 ? 0 : bn[e - 1];
        padded_start = e == 0 ? 0 : pb[e - 1];
      }
      const int64_t row = index::padded_row(i, real_start, padded_start);
      const int64_t a = idx[i];
      map.dest_rows[a] = static_cast<int32_t>(row);
      map.row_sources[row] = static_cast<int32_t>(a);
    }
    const index::Range er = index::work_range(w, workers, experts);
    for (int64_t x = er.begin; x < er.end; ++x) {
      const int64_t count = bn[x] - (x == 0 ? 0 : bn[x - 1]);
      for (int64_t p = (x == 0 ? 0 : pb[x - 1]) + count; p < pb[x]; ++p) map.row_sources[p] = -1;
    }
  });
  return map;
}

int64_t plan_assignments(const Checker& c, const PlanView& plan) {
  if (plan.top_k < 1) c.value_error("plan.top_k", "must be >= 1, got " + str(plan.top_k));
  if (plan.num_experts < 0) c.value_error("plan.num_experts", "must be >= 0, got " + str(plan.num_experts));
  if (plan.num_tokens < 0) c.value_error("plan.num_tokens", "must be >= 0, got " + str(plan.num_tokens));
  if (plan.num_tokens > std::numeric_limits<int32_t>::max() / plan.top_k) {  // before multiplying: no overflow
    c.value_error("plan.num_tokens", "size overflow: num_tokens " + str(plan.num_tokens) + " x top_k " +
                                         str(plan.top_k) + " does not fit the int32 index outputs");
  }
  return plan.num_tokens * plan.top_k;
}

void check_plan_fields(const Checker& c, const PlanView& plan, Device device) {
  const int64_t a_count = plan_assignments(c, plan);
  const int64_t experts = plan.num_experts;
  c.int32_output(plan.indices, "plan.indices", a_count);
  c.int32_output(plan.bin_ids, "plan.bin_ids", a_count);
  c.int32_output(plan.tokens_per_expert, "plan.tokens_per_expert", experts);
  c.int32_output(plan.bins, "plan.bins", experts);
  c.int32_output(plan.padded_tokens_per_expert, "plan.padded_tokens_per_expert", experts);
  c.int32_output(plan.padded_bins, "plan.padded_bins", experts);
  c.int32_output(plan.dest_rows, "plan.dest_rows", a_count);
  c.int32_output(plan.row_sources, "plan.row_sources", 0, /*at_least=*/true);
  const std::pair<const TensorView*, const char*> all[] = {
      {&plan.indices, "plan.indices"},
      {&plan.bin_ids, "plan.bin_ids"},
      {&plan.tokens_per_expert, "plan.tokens_per_expert"},
      {&plan.bins, "plan.bins"},
      {&plan.padded_tokens_per_expert, "plan.padded_tokens_per_expert"},
      {&plan.padded_bins, "plan.padded_bins"},
      {&plan.dest_rows, "plan.dest_rows"},
      {&plan.row_sources, "plan.row_sources"}};
  for (const auto& f : all) c.same_device(*f.first, f.second, device);
}

int64_t check_plan(const Checker& c, const PlanView& plan, Device device) {
  check_plan_fields(c, plan, device);
  const int64_t a_count = plan.num_tokens * plan.top_k;
  const int64_t experts = plan.num_experts;
  const int32_t* dest = plan.dest_rows.data_as<const int32_t>();
  const int32_t* src = plan.row_sources.data_as<const int32_t>();
  const int64_t padded = experts > 0 ? plan.padded_bins.data_as<const int32_t>()[experts - 1] : 0;
  if (padded < 0 || padded > plan.row_sources.shape[0]) {
    c.value_error("plan.padded_bins", "padded_bins[E-1] = " + str(padded) + " but row_sources has " +
                                          str(plan.row_sources.shape[0]) + " entries");
  }
  for (int64_t a = 0; a < a_count; ++a) {
    const int64_t r = dest[a];
    if (r < -1 || r >= padded) {
      c.value_error("plan.dest_rows",
                    "assignment " + str(a) + " maps to row " + str(r) + ", outside [-1, " + str(padded) + ")");
    }
    if (r >= 0 && src[r] != a) {
      c.value_error("plan.dest_rows", "assignment " + str(a) + " maps to row " + str(r) + " but row_sources[" + str(r) +
                                          "] = " + str(src[r]));
    }
  }
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t a = src[r];
    if (a < -1 || a >= a_count || (a >= 0 && dest[a] != r)) {
      c.value_error("plan.row_sources", "row " + str(r) + " names assignment " + str(a) +
                                            " whose dest_rows entry does not point back to it");
    }
  }
  return padded;
}

}  // namespace detail
}  // namespace padmoe
