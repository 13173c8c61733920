// padmoe_ext.cpp — the native module padmoe._C (nanobind).
//
// Binds the `_out` forms of padmoe's ops (they never allocate outputs) with
// the argument order of padmoe/ops.hpp. Arrays cross by DLPack as
// nb::ndarray (numpy arrays, torch tensors, anything with __dlpack__ or the
// buffer protocol; CPU or CUDA) and become padmoe::TensorViews without a copy:
// pointer (byte offset included), dtype, shape, strides in elements, device.
// Pure inputs are nb::ndarray<nb::ro> so read-only numpy arrays are accepted;
// outputs must be writable. Optional C++ arguments (std::optional<TensorView>,
// or an empty TensorView{} meaning "skip") are Python None. A plan is any
// Python object with the eight array attributes of padmoe::PlanView and the
// ints num_tokens, top_k, num_experts, alignment.
//
// Every op takes the keyword-only options stream (a cudaStream_t as an int,
// 0 = legacy default stream), check_data, num_threads, workspace (a CUDA
// buffer, e.g. uint8, passed as Options::workspace / workspace_bytes) and
// zero_tail (Options::zero_tail: ops that spread rows into a padded output
// also zero its rows at or past P; the other ops ignore it). The GIL
// is released around every kernel call. padmoe::Error becomes ValueError,
// TypeError, NotImplementedError or RuntimeError by its kind, with the C++
// message unchanged.
//
// The bindings are split by domain under ext/ (plan_ops.cpp, layouts_ops.cpp, rows_ops.cpp,
// padding_ops.cpp, chunks_ops.cpp, scaled_ops.cpp, utility_ops.cpp), each adding its functions
// with one bind_<domain>(module); ext/common.hpp holds what they share.
#include <exception>

#include "ext/common.hpp"

#ifndef PADMOE_VERSION
#define PADMOE_VERSION "unknown"
#endif

namespace {

using padmoe::Error;
using padmoe::ErrorKind;

void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    PyObject* type = PyExc_RuntimeError;
    switch (e.kind()) {
      case ErrorKind::kValue: type = PyExc_ValueError; break;
      case ErrorKind::kType: type = PyExc_TypeError; break;
      case ErrorKind::kUnsupported: type = PyExc_NotImplementedError; break;
      case ErrorKind::kRuntime: type = PyExc_RuntimeError; break;
    }
    PyErr_SetString(type, e.what());
  }
}

bool has_cuda() {
#ifdef PADMOE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() =
      "padmoe's native ops (the C++ `_out` forms: they fill caller-owned outputs and allocate nothing). "
      "Use the functions of the `padmoe` package, which allocate outputs for you.";
  m.attr("__version__") = PADMOE_VERSION;
  nb::register_exception_translator(translate_error);

  m.def("has_cuda", &has_cuda, "Whether the CUDA backend was compiled in.");

  padmoe_ext::bind_plan(m);
  padmoe_ext::bind_utilities(m);
  padmoe_ext::bind_layouts(m);
  padmoe_ext::bind_rows(m);
  padmoe_ext::bind_padding(m);
  padmoe_ext::bind_chunks(m);
  padmoe_ext::bind_scaled(m);
}
