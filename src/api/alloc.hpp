// alloc.hpp — the allocating form of every op (ops.hpp): its outputs are new contiguous
// tensors on the input's device, made after the op's checks, then written by the step its _out
// form ends with. One helper, so that every op sizes, places and fills its outputs alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <utility>

#include "padmoe/error.hpp"
#include "padmoe/tensor.hpp"

namespace padmoe {
namespace detail {

// One output of an allocating form: `dtype` and `shape`, or none (an output the call does not
// produce, e.g. grad_weights without weights: an undefined Tensor).
struct NewTensor {
  bool wanted = false;
  DType dtype = DType::kFloat32;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};

  NewTensor() = default;
  NewTensor(DType type, std::initializer_list<int64_t> dims) : wanted(true), dtype(type) {
    for (int64_t d : dims) {
      if (ndim == kMaxDims) throw Error(ErrorKind::kValue, "Tensor::empty: more than 4 dims");  // as Tensor::empty
      shape[ndim++] = d;
    }
  }
};

// `rows` rows of `like`'s dtype and of its dimensions after the first: a row tensor [rows, H]
// like its input's rows, a scale tensor [rows] or [rows, C] like its input scales.
inline NewTensor rows_like(const TensorView& like, int64_t rows) {
  NewTensor t;
  t.wanted = true;
  t.dtype = like.dtype;
  t.ndim = like.ndim;
  t.shape[0] = rows;
  for (int d = 1; d < like.ndim; ++d) t.shape[d] = like.shape[d];
  return t;
}

// The gradient of an optional 1-D input (router weights, probs): `n` entries of its dtype, or
// none when the input was not given.
inline NewTensor grad_like(const std::optional<TensorView>& input, int64_t n) {
  return input ? NewTensor(input->dtype, {n}) : NewTensor();
}

// allocate_outputs' body: one Tensor::empty per output, I = 0 .. N-1.
template <class Result, size_t N, size_t... I>
Result allocate_each(Device device, const NewTensor (&outputs)[N], std::index_sequence<I...>) {
  // braced initialization: allocated in the order listed
  return Result{
      (outputs[I].wanted ? Tensor::empty(outputs[I].dtype, outputs[I].ndim, outputs[I].shape, device) : Tensor())...};
}

// The outputs of an allocating form as `Result` (a Tensor, or the op's result struct whose
// first members are its outputs in the order listed): a new tensor on `device` for each of
// `outputs`. Called after the op's checks, so that a bad argument raises its error with nothing
// allocated; only the checks its run step makes itself (a whole _out form as the run step, a
// device-side validation) come after.
template <class Result, size_t N>
Result allocate_outputs(Device device, const NewTensor (&outputs)[N]) {
  return allocate_each<Result>(device, outputs, std::make_index_sequence<N>());
}

// The same, then `run(result)`: the _out form's last step (the kernels, on checked
// arguments) writes the new outputs; returns them.
template <class Result, size_t N, class Run>
Result allocate_outputs(Device device, const NewTensor (&outputs)[N], Run&& run) {
  Result result = allocate_outputs<Result>(device, outputs);
  run(std::as_const(result));
  return result;
}

}  // namespace detail
}  // namespace padmoe
