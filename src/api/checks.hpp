// checks.hpp — argument checking (docs/spec.md §12), shared by every op.
//
// Every check runs before the op writes anything. Messages read
// "<op>: <argument>: <what was expected>, <first offending position>".
// Shape/dtype/device checks work on views only; the data checks read index
// data on the host (the CPU backend always runs them).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/cuda_backend.hpp"
#include "padmoe/error.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"

namespace padmoe {
namespace detail {

// Reads element i of an int32 or int64 tensor as int64.
struct IndexReader {
  const void* data = nullptr;
  bool wide = false;
  IndexReader() = default;
  explicit IndexReader(const TensorView& t) : data(t.data), wide(t.dtype == DType::kInt64) {}
  int64_t operator[](int64_t i) const {
    return wide ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
  }
};

// "[d0, d1, ...]" of a view's shape, for messages.
std::string shape_str(const TensorView& t);

class Checker {
 public:
  explicit Checker(const char* op) : op_(op) {}
  const char* op() const { return op_; }

  [[noreturn]] void fail(ErrorKind kind, const std::string& arg, const std::string& what) const;
  [[noreturn]] void value_error(const std::string& arg, const std::string& what) const {
    fail(ErrorKind::kValue, arg, what);
  }

  // [rows, cols] row tensor: float dtype (float8 only when allow_fp8), unit
  // column stride, row stride >= cols. rows/cols < 0 means "any".
  void row_tensor(const TensorView& t, const char* name, int64_t rows, int64_t cols, bool allow_fp8) const;
  // A row output: like row_tensor but rows is a minimum (capacity semantics)
  // when at_least is true, and dtype must equal `dtype`.
  void row_output(const TensorView& t, const char* name, int64_t rows, bool at_least, int64_t cols, DType dtype) const;
  // Contiguous 1-D int32/int64 tensor of `len` entries (len < 0: any).
  void index_vector(const TensorView& t, const char* name, int64_t len) const;
  // Contiguous int32 tensor with `len` entries (at least `len` when at_least).
  void int32_output(const TensorView& t, const char* name, int64_t len, bool at_least = false) const;
  // Router weights / probs: contiguous, `len` elements, float32, float16 or bfloat16 (any rows).
  void scale_vector(const TensorView& t, const char* name, int64_t len, DType row_dtype) const;
  // Optional float output of `len` elements: float32, float16 or bfloat16.
  void float_output(const TensorView& t, const char* name, int64_t len, DType row_dtype) const;
  void same_device(const TensorView& t, const char* name, Device device) const;
  void top_k(int top_k, int64_t assignments) const;
  void alignment(int alignment) const;

 private:
  const char* op_;
};

// Routing inputs of the MegaBlocks ops after checking: the inverse map the
// CPU kernels run on, built with docs/spec.md §15's partition.
struct RoutingMap {
  std::vector<int32_t> dest_rows;    // [A] padded row of each assignment
  std::vector<int32_t> row_sources;  // [P] assignment of each padded row, -1 padding
  int64_t assignments = 0;           // A
  int64_t padded_rows = 0;           // P
  int top_k = 1;
};

// Checks (indices, bin_ids, bins, padded_bins, top_k) as docs/spec.md §12 says
// and builds the RoutingMap: bins nondecreasing with bins[E-1] == A; every
// padded segment at least its real count; bin_ids consistent with bins;
// indices a permutation of [0, A).
RoutingMap check_sorted_routing(const Checker& c, const TensorView& indices, const TensorView& bin_ids,
                                const TensorView& bins, const TensorView& padded_bins, int top_k, int num_threads);

// Shapes, dtypes and devices of (indices, bin_ids, bins, padded_bins, top_k).
void check_sorted_shapes(const Checker& c, const TensorView& indices, const TensorView& bin_ids, const TensorView& bins,
                         const TensorView& padded_bins, int top_k);

// A PlanView's A = num_tokens * top_k after checking num_tokens >= 0,
// top_k >= 1, num_experts >= 0 and that A fits int32 (no overflow).
int64_t plan_assignments(const Checker& c, const PlanView& plan);
// Shapes (all eight arrays, as both backends require them), int32, one device.
void check_plan_fields(const Checker& c, const PlanView& plan, Device device);
// Checks a PlanView (check_plan_fields, and that dest_rows and row_sources
// are inverse to each other within [0, P)); returns P.
int64_t check_plan(const Checker& c, const PlanView& plan, Device device);

// Every device-dependent op calls this: the CPU backend always exists; CUDA
// tensors need a build with PADMOE_CUDA.
void require_backend(const Checker& c, Device device);

// Raises the error a device-side validation found (checked mode), in the
// CPU backend's words. `ids` names the checked id argument, `limit` the bound
// of its values (E, A or N), `output` the output argument of a capacity check.
struct ViolationNames {
  const char* ids = "top_experts";
  int64_t limit = 0;
  const char* output = "out";
  int top_k = 0;  // > 0: ids is [T, top_k] and positions print as [t, k] (as the CPU's checks do)
};
void raise_violation(const Checker& c, const cuda::Violation& v, const ViolationNames& names);

// Host memory for a check (maps, counts) of n entries: out of memory is a
// padmoe::Error of kind kRuntime naming `what`, not a std::bad_alloc.
template <class T>
std::vector<T> host_vector(const Checker& c, const char* what, int64_t n, T init = T()) {
  try {
    return std::vector<T>(static_cast<size_t>(n > 0 ? n : 0), init);
  } catch (const std::bad_alloc&) {
  } catch (const std::length_error&) {
  }
  c.fail(ErrorKind::kRuntime, what, "out of host memory for " + std::to_string(n) + " entries");
}

// Size-overflow guard: padded rows and assignment ids must fit int32 outputs.
void check_int32_extent(const Checker& c, const char* what, int64_t value);

// The int32 outputs of the plans of TransformerEngine's maps (mask_plan, index_plan), all on
// `device`: counts [counts_len], dest_rows [assignments], row_sources [any length], and indices /
// bin_ids [assignments] when either is set (then both). Returns whether indices / bin_ids are set.
bool plan_outputs(const Checker& c, const TensorView& counts, int64_t counts_len, const TensorView& dest_rows,
                  const TensorView& row_sources, const TensorView& indices, const TensorView& bin_ids,
                  int64_t assignments, Device device);

// Outputs never share memory with the op's inputs or with each other: an aliased call would
// read what it had already written, in an order that depends on the backend and its threads.
// Raises "<op>: <name>: shares memory with <other>" when any byte `out` addresses is one that
// `other` addresses (row views of one stride exactly, row by row: column slices of one buffer
// side by side do not overlap). Unset and empty views overlap nothing.
void check_disjoint(const Checker& c, const TensorView& out, const char* name, const TensorView& other,
                    const char* other_name);

// An op's argument for check_disjoint_all: its view (null: absent) and its name.
struct Named {
  const TensorView* view;
  const char* name;
};
inline Named named(const TensorView& t, const char* name) { return Named{&t, name}; }
inline Named named(const std::optional<TensorView>& t, const char* name) { return Named{t ? &*t : nullptr, name}; }
// check_disjoint for every output against every input and every other output, in the order given.
void check_disjoint_all(const Checker& c, std::initializer_list<Named> outputs, std::initializer_list<Named> inputs);

// Size arithmetic on non-negative int64 operands, checked: the exact result, or the error
// "<op>: <what>: size overflow: ..." (an unchecked sum or product of legal sizes, e.g. rows of
// zero columns, can pass 2^63 and wrap).
int64_t checked_add(const Checker& c, const char* what, int64_t a, int64_t b);
int64_t checked_mul(const Checker& c, const char* what, int64_t a, int64_t b);
// The smallest multiple of m (>= 1) at least x (>= 0).
int64_t checked_round_up(const Checker& c, const char* what, int64_t x, int64_t m);

}  // namespace detail
}  // namespace padmoe
