// common.hpp — what the binding files of padmoe._C share (padmoe_ext.cpp describes the module):
// the array types In / Out / OptIn / OptOut, the zero-copy view of an array (to_view), a plan read
// from a Python object's attributes (read_plan), the keyword-only options every op takes
// (PADMOE_OPTIONS / PADMOE_OPTION_PARAMS / PADMOE_OPTS) and one bind_<domain> per binding file.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "padmoe/error.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"

namespace nb = nanobind;

namespace padmoe_ext {

using padmoe::DType;
using padmoe::Error;
using padmoe::ErrorKind;
using padmoe::TensorView;

using In = nb::ndarray<nb::ro>;      // a pure input (read-only arrays accepted)
using Out = nb::ndarray<>;           // an output (must be writable)
using OptIn = std::optional<In>;     // optional input: None = std::nullopt
using OptOut = std::optional<Out>;   // optional output: None = empty TensorView{}

[[noreturn]] void fail(ErrorKind kind, const char* op, const std::string& arg, const std::string& what);

DType to_dtype(const nb::dlpack::dtype& dt, const char* op, const std::string& arg);

padmoe::Device to_device(int type, int id, const char* op, const std::string& arg);

// A zero-copy view of an nb::ndarray (any flavour).
template <typename Array>
TensorView to_view(const Array& a, const char* op, const std::string& arg) {
  const size_t ndim = a.ndim();
  if (ndim > static_cast<size_t>(padmoe::kMaxDims)) {
    fail(ErrorKind::kValue, op, arg,
         "expected at most " + std::to_string(padmoe::kMaxDims) + " dims, got " + std::to_string(ndim));
  }
  TensorView v;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.dtype = to_dtype(a.dtype(), op, arg);
  v.ndim = static_cast<int>(ndim);
  bool empty = false;
  for (size_t d = 0; d < ndim; ++d) {
    v.shape[d] = static_cast<int64_t>(a.shape(d));
    v.strides[d] = a.stride(d);
    empty = empty || v.shape[d] == 0;
  }
  if (empty) {  // no elements: strides are meaningless (numpy 2 reports 0); use row-major ones
    int64_t stride = 1;
    for (size_t d = ndim; d-- > 0;) {
      v.strides[d] = stride;
      stride *= std::max<int64_t>(v.shape[d], 1);
    }
  }
  v.device = to_device(a.device_type(), a.device_id(), op, arg);
  return v;
}

std::optional<TensorView> opt_view(const OptIn& a, const char* op, const char* arg);

// An optional output: None -> an empty TensorView{} (the op skips it).
TensorView to_out_view(const OptOut& a, const char* op, const char* arg);

padmoe::Options make_options(uintptr_t stream, bool check_data, int num_threads, const OptOut& workspace,
                             bool zero_tail, bool zero_padding, const char* op);

// A plan read from a Python object's attributes. Holds the arrays so the
// views stay valid while the GIL is released.
template <typename Array>
struct PlanArg {
  Array arrays[8];
  padmoe::PlanView view;
};

constexpr const char* kPlanFields[8] = {
    "indices",     "bin_ids",   "tokens_per_expert", "bins", "padded_tokens_per_expert",
    "padded_bins", "dest_rows", "row_sources"};

template <typename Int>
Int plan_int(nb::handle plan, const char* field, const char* op, const char* prefix) {
  const std::string arg = std::string(prefix) + "." + field;
  if (!nb::hasattr(plan, field))
    fail(ErrorKind::kType, op, prefix, std::string("expected a plan object with an attribute '") + field + "'");
  nb::object value = nb::getattr(plan, field);
  int64_t out = 0;
  if (!nb::try_cast<int64_t>(value, out, /*convert=*/false)) {
    fail(ErrorKind::kType, op, arg, "expected an int");
  }
  if (out < static_cast<int64_t>(std::numeric_limits<Int>::min()) ||
      out > static_cast<int64_t>(std::numeric_limits<Int>::max())) {
    fail(ErrorKind::kValue, op, arg, "value " + std::to_string(out) + " is out of range");
  }
  return static_cast<Int>(out);
}

template <typename Array>
void read_plan(nb::handle plan, const char* op, const char* prefix, PlanArg<Array>& out) {
  TensorView* views[8] = {&out.view.indices,
                          &out.view.bin_ids,
                          &out.view.tokens_per_expert,
                          &out.view.bins,
                          &out.view.padded_tokens_per_expert,
                          &out.view.padded_bins,
                          &out.view.dest_rows,
                          &out.view.row_sources};
  for (int i = 0; i < 8; ++i) {
    const char* field = kPlanFields[i];
    const std::string arg = std::string(prefix) + "." + field;
    if (!nb::hasattr(plan, field)) {
      fail(ErrorKind::kType, op, prefix, std::string("expected a plan object with an array attribute '") + field + "'");
    }
    nb::object value = nb::getattr(plan, field);
    if (!nb::try_cast<Array>(value, out.arrays[i])) {
      fail(ErrorKind::kType, op, arg,
           std::string("expected a ") + (std::is_same<Array, Out>::value ? "writable " : "") +
               "array (numpy, torch, DLPack), got " + nb::type_name(value.type()).c_str());
    }
    *views[i] = to_view(out.arrays[i], op, arg);
  }
  out.view.num_tokens = plan_int<int64_t>(plan, "num_tokens", op, prefix);
  out.view.top_k = plan_int<int>(plan, "top_k", op, prefix);
  out.view.num_experts = plan_int<int>(plan, "num_experts", op, prefix);
  out.view.alignment = plan_int<int>(plan, "alignment", op, prefix);
}

// The bindings, one function per file, each adding its functions to the module.
void bind_plan(nb::module_& m);       // plan_ops.cpp: make_plan, its bounds, dispatch / combine on a plan
void bind_layouts(nb::module_& m);    // layouts_ops.cpp: vLLM's moe_align_block_size
void bind_rows(nb::module_& m);       // rows_ops.cpp: MegaBlocks' padded_gather / padded_scatter family
void bind_padding(nb::module_& m);    // padding_ops.cpp: Megatron's pad_to_alignment / unpad_from_alignment
void bind_chunks(nb::module_& m);     // chunks_ops.cpp: the expert-parallel chunk sort
void bind_scaled(nb::module_& m);     // scaled_ops.cpp: rows moved with their scales, quantizing dispatch
void bind_utilities(nb::module_& m);  // utility_ops.cpp: the tile planner, copy

}  // namespace padmoe_ext

// The keyword-only options every op takes, in this order.
#define PADMOE_OPTIONS                                                                            \
  nb::kw_only(), nb::arg("stream") = 0, nb::arg("check_data") = true, nb::arg("num_threads") = 0, \
                 nb::arg("workspace").none() = nb::none(), nb::arg("zero_tail") = false,          \
                 nb::arg("zero_padding") = true
#define PADMOE_OPTION_PARAMS \
  uintptr_t stream, bool check_data, int num_threads, const OptOut &workspace, bool zero_tail, bool zero_padding
#define PADMOE_OPTS(op) make_options(stream, check_data, num_threads, workspace, zero_tail, zero_padding, op)
