// common.hpp — what the torch operator files (python/src/torch/*.cpp) share.
//
// padmoe/_torch_ops.so registers padmoe's ops as native PyTorch operators
// (torch.ops.padmoe.*), each domain file with its schemas, kernels and autograd:
//   - every op's schema (TORCH_LIBRARY_FRAGMENT), so torch.compile traces them as
//     single graph nodes (their fake kernels are in padmoe/torch/);
//   - one kernel per op for the CPU and CUDA keys: argument conversion to
//     padmoe::TensorView, outputs from torch's allocator, padmoe's `_out`
//     form on the current CUDA stream, scratch memory from torch's caching
//     allocator (Options::scratch_alloc), padmoe::Error re-raised as
//     c10::ValueError / TypeError / NotImplementedError (Python: ValueError,
//     TypeError, NotImplementedError) with padmoe's message;
//   - the autograd formulas (Autograd key), written in C++: the backward of
//     each op is one call of its backward op through the dispatcher, so a
//     backward pass launches exactly the backward kernels, and compiled
//     backward graphs hold the backward ops.
// The C++ library and padmoe._C do not depend on these files or on torch.
//
// `check` (every op): 0 = no data checks on CUDA (no synchronization),
// 1 = checked mode, 2 = checked mode unless the current stream is capturing a
// CUDA graph. The CPU backend always checks everything.
//
// float64 rows (which padmoe's kernels do not take) run through ATen
// formulas in float64 inside the same operators, so that
// torch.autograd.gradcheck exercises the operators and their autograd.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "padmoe/error.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"

namespace padmoe_torch {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using OptInt = std::optional<int64_t>;
using padmoe::DType;
using padmoe::TensorView;
using torch::autograd::variable_list;

// --- errors -------------------------------------------------------------------

[[noreturn]] void rethrow(const padmoe::Error& e);
[[noreturn]] void value_error(const char* op, const char* arg, const std::string& what);
[[noreturn]] void type_error(const char* op, const char* arg, const std::string& what);

// Runs a padmoe call, translating its errors.
template <typename Fn>
void native(Fn&& fn) {
  try {
    fn();
  } catch (const padmoe::Error& e) {
    rethrow(e);
  }
}

// --- tensors -> views -----------------------------------------------------------

std::string shape_of(const Tensor& t);
// A dtype as Python spells it, without "torch." ("float32", "int16", "bool"), as padmoe's messages do.
std::string dtype_name(c10::ScalarType t);
TensorView view(const Tensor& t, const char* op, const char* arg);
std::optional<TensorView> opt_view(const OptTensor& t, const char* op, const char* arg);

// Rows: any row stride, but unit stride along the hidden dimension (else one copy).
Tensor rows_arg(const Tensor& t);
// Index inputs: any stride (one copy when not contiguous).
inline Tensor index_arg(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }
// Router weights / probs: any shape with one entry per row, any float dtype,
// any stride; read as float32 by padmoe (float64 is converted once).
OptTensor scale_arg(const OptTensor& w);
// Weight gradient output in the weights' dtype (float32 when padmoe cannot write that dtype).
Tensor wgrad_buffer(const Tensor& weights, int64_t n);
Tensor as_weights_dtype(const Tensor& g, const OptTensor& weights);
Tensor no_grad_placeholder(const Tensor& like, const OptTensor& weights);

// --- options: stream, checks, scratch -----------------------------------------

padmoe::Options options_for(const Tensor& like, int64_t check, bool zero_tail = false);

// --- host reads of small index tensors ---------------------------------------------

// A small index tensor's values on the host as int64 (CUDA: padmoe::copy on the current
// stream, which waits for it: the one synchronization of the drop-ins, as MegaBlocks and
// Megatron have; no ATen copy machinery on that path).
std::vector<int64_t> host_values(const Tensor& t_in, int64_t first, int64_t count);
// P = padded_bins[-1] on the host (CUDA: one synchronization, as MegaBlocks does).
int64_t host_last(const Tensor& t, const char* op, const char* arg);
// Rows of an output sized from data (P of the drop-ins): within int32, checked before allocating.
void check_rows_fit(const char* op, const char* arg, int64_t rows);
// P of pad_to_alignment (and its _scaled form) from padmoe's host read of the counts.
int64_t pad_rows(const char* op, const Tensor& h, const Tensor& tpe, int64_t alignment, int64_t check);

// --- float64 formulas (exact; for gradcheck) ---------------------------------------

inline bool is_f64(const Tensor& t) { return t.scalar_type() == at::kDouble; }

// float64 rows get padmoe's checks too: the op runs on float32 stand-ins of the same shape with
// no columns (nothing read or written, every index check made), then the float64 formula runs.
// Outputs whose rows the data sizes, from this many bytes up, are allocated only after the op's
// checks passed (below it the op's checks raise the same error after a small allocation).
constexpr int64_t kCheckBeforeBytes = int64_t{1} << 28;

TensorView shadow(const Tensor& t, int64_t rows = -1);
TensorView shadow_rows(int64_t rows, const Tensor& like);

// y[rows, H]: y[dest[a]] = x[a / K] * w[a]; other rows zero (dest < 0: dropped).
Tensor spread64(const Tensor& x, const Tensor& dest, int64_t k, const OptTensor& w, int64_t rows);
// out[t] = sum_k w[t*K+k] * y[dest[t*K+k]] (dest < 0 contributes zero).
Tensor reduce64(const Tensor& y, const Tensor& dest, int64_t k, const OptTensor& w);
// d[a] = <y[dest[a]], other[a / K]> (0 where dest < 0).
Tensor dots64(const Tensor& y, const Tensor& dest, int64_t k, const Tensor& other);

// --- autograd ---------------------------------------------------------------------
//
// Hand-written graph nodes (as torch's generated autograd code does, not
// torch::autograd::Function: a Function node costs several µs of host time
// per call). Each forward on the Autograd key calls the kernel below autograd,
// and when an input needs a gradient attaches one node whose apply() is one
// call of the backward operator through the dispatcher.

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using NodePtr = decltype(torch::autograd::Edge::function);  // intrusive_ptr in recent torch, shared_ptr before

template <typename T>
NodePtr new_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::shared_ptr<T>(new T());
  } else {
    return c10::make_intrusive<T>();
  }
}

template <typename Fn>
c10::TypedOperatorHandle<Fn> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// Backward check mode: off when the forward was unchecked, else checked unless capturing.
inline int64_t backward_check(int64_t check) { return check == 0 ? 0 : 2; }

inline bool wants_grad(const OptTensor& t) { return t && t->defined() && t->requires_grad(); }
inline OptTensor optional_of(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// Does this call record a graph node? (grad mode on and a differentiable input that needs it)
inline bool recording(const Tensor& rows, const OptTensor& scale) {
  return at::GradMode::is_enabled() && (rows.requires_grad() || wants_grad(scale));
}

// A saved tensor: SavedVariable (version-checked) when defined, else empty.
struct Saved {
  SavedVariable var;
  bool present = false;
  void save(const Tensor& t) {
    if (t.defined()) {
      var = SavedVariable(t, /*is_output=*/false);
      present = true;
    }
  }
  Tensor get() const { return present ? var.unpack() : Tensor(); }
  void release() {
    if (present) var.reset_data();
  }
};

inline Tensor shaped_as(const Tensor& g, c10::IntArrayRef shape) { return g.sizes() == shape ? g : g.view(shape); }

// The backward of pad_to_alignment and of sort_chunks: unpad_from_alignment of the gradient
// (the inverse move). Edge (the padded op's rows); apply() is in padding_ops.cpp.
struct PadBackward : Node {
  Tensor permutation_map;
  int64_t rows = 0, check = 0;
  variable_list apply(variable_list&& grads) override;
  void release_variables() override { permutation_map = Tensor(); }
  std::string name() const override { return "padmoe::PadToAlignmentBackward"; }
};

}  // namespace padmoe_torch
