// fast_path.cpp — padmoe/_torch_ops.so as the Python module padmoe._torch_ops.
//
// Its functions take the operators' arguments positionally and call the
// operators through the dispatcher, unboxed: every dispatch key (autograd,
// torch dispatch modes, tensor subclasses' __torch_dispatch__) applies as for
// torch.ops.padmoe.*, but the Python argument layer of torch.ops (schema
// matching, IValue boxing: about 1 µs an op) is skipped. Anything they do not
// take as it is (a tensor subclass, a torch function mode, a non-int, a wrong
// argument count) is passed to the OpOverload, torch.ops.padmoe.<op>.default,
// which padmoe.torch registers with _set_fallback, so the result is always
// what torch.ops would give.
//
// packed_plan_layout(num_tokens, top_k, num_experts, alignment, expert_capacity=None): the packed
// plan's layout by packed_plan.hpp's definition, a tuple of 8 (name, offset, length).
#include <ATen/PythonTorchFunctionTLS.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common.hpp"
#include "kernels.hpp"
#include "packed_plan.hpp"

namespace padmoe_torch {
namespace {

enum PyOp {
  kPyMakePlan,
  kPyDispatch,
  kPyCombine,
  kPyPaddedGather,
  kPyPaddedScatter,
  kPyPaddedScatterWgrad,
  kPyPad,
  kPyUnpad,
  kPyMakePlanAndDispatch,
  kPyOpCount
};
PyObject* g_fallback[kPyOpCount] = {};

PyObject* fallback(PyOp op, PyObject* const* args, Py_ssize_t nargs) {
  if (g_fallback[op] == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "padmoe._torch_ops: fallback operator not registered");
    return nullptr;
  }
  return PyObject_Vectorcall(g_fallback[op], args, static_cast<size_t>(nargs), nullptr);
}

// Argument readers: false = "not taken here, use the fallback".
bool arg_tensor(PyObject* o, Tensor& out) {
  if (!THPVariable_CheckExact(o)) return false;
  out = THPVariable_Unpack(o);
  return true;
}
bool arg_opt_tensor(PyObject* o, OptTensor& out) {
  if (o == Py_None) {
    out = std::nullopt;
    return true;
  }
  if (!THPVariable_CheckExact(o)) return false;
  out = THPVariable_Unpack(o);
  return true;
}
bool arg_int(PyObject* o, int64_t& out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (out == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}
bool plain_call() { return !at::impl::torch_function_mode_enabled(); }

bool read_arg(PyObject* o, Tensor& t) { return arg_tensor(o, t); }
bool read_arg(PyObject* o, OptTensor& t) { return arg_opt_tensor(o, t); }
bool read_arg(PyObject* o, int64_t& v) { return arg_int(o, v); }
bool read_arg(PyObject* o, OptInt& v) {  // int?: None or an int
  if (o == Py_None) {
    v = std::nullopt;
    return true;
  }
  int64_t i = 0;
  if (!arg_int(o, i)) return false;
  v = i;
  return true;
}
bool read_arg(PyObject* o, bool& v) {
  if (o != Py_True && o != Py_False) return false;
  v = o == Py_True;
  return true;
}

PyObject* wrap_result(Tensor t) { return THPVariable_Wrap(std::move(t)); }
template <size_t N>
PyObject* wrap_tuple(Tensor (&parts)[N]) {
  PyObject* seq = PyTuple_New(static_cast<Py_ssize_t>(N));
  if (seq == nullptr) return nullptr;
  for (size_t i = 0; i < N; ++i) {
    PyObject* v = THPVariable_Wrap(std::move(parts[i]));
    if (v == nullptr) {
      Py_DECREF(seq);
      return nullptr;
    }
    PyTuple_SET_ITEM(seq, static_cast<Py_ssize_t>(i), v);
  }
  return seq;
}
PyObject* wrap_result(std::tuple<Tensor, Tensor> t) {
  Tensor parts[2] = {std::get<0>(t), std::get<1>(t)};
  return wrap_tuple(parts);
}
PyObject* wrap_result(std::tuple<Tensor, Tensor, Tensor> t) {
  Tensor parts[3] = {std::get<0>(t), std::get<1>(t), std::get<2>(t)};
  return wrap_tuple(parts);
}

// The operator each entry point calls ("padmoe::<name>"), by PyOp.
constexpr const char* kPyOpNames[kPyOpCount] = {"make_plan",
                                                "dispatch",
                                                "combine",
                                                "padded_gather",
                                                "padded_scatter",
                                                "padded_scatter_wgrad",
                                                "pad_to_alignment",
                                                "unpad_from_alignment",
                                                "make_plan_and_dispatch"};

// One entry point per operator, made from the kernel's signature: the
// arguments positionally, each read as the kernel takes it (Tensor, optional
// Tensor, int, optional int, bool), the operator called through the dispatcher with the GIL released.
template <PyOp kOp, typename Fn>
struct PyEntry;
template <PyOp kOp, typename R, typename... A>
struct PyEntry<kOp, R(A...)> {
  using Values = std::tuple<std::decay_t<A>...>;
  template <size_t... I>
  static bool read_all(Values& values, PyObject* const* args, std::index_sequence<I...>) {
    return (read_arg(args[I], std::get<I>(values)) && ...);
  }
  static PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    Values values;
    if (nargs != static_cast<Py_ssize_t>(sizeof...(A)) || !plain_call() ||
        !read_all(values, args, std::index_sequence_for<A...>{})) {
      return fallback(kOp, args, nargs);
    }
    R out;
    {
      pybind11::gil_scoped_release no_gil;
      static auto op = handle<R(A...)>((std::string("padmoe::") + kPyOpNames[kOp]).c_str());
      out = std::apply([](const auto&... v) { return op.call(v...); }, values);
    }
    return wrap_result(std::move(out));
    END_HANDLE_TH_ERRORS
  }
};

// _set_fallback(index, callable): the OpOverload an entry hands unusual calls to.
PyObject* py_set_fallback(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyLong_Check(args[0]) || !PyCallable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "_set_fallback(index, callable)");
    return nullptr;
  }
  const long i = PyLong_AsLong(args[0]);
  if (i < 0 || i >= kPyOpCount) {
    PyErr_SetString(PyExc_ValueError, "_set_fallback: index out of range");
    return nullptr;
  }
  Py_INCREF(args[1]);
  Py_XSETREF(g_fallback[i], args[1]);
  Py_RETURN_NONE;
}

// packed_plan_layout(num_tokens, top_k, num_experts, alignment, expert_capacity=None):
// ((name, offset, length), ...) for the eight arrays, by plan_layout. Ints only (TypeError
// otherwise); sizes out of range are a ValueError.
PyObject* py_packed_plan_layout(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr const char* kArgs[5] = {"num_tokens", "top_k", "num_experts", "alignment", "expert_capacity"};
  constexpr int64_t kMin[5] = {0, 1, 1, 1, 0};
  if (nargs != 4 && nargs != 5) {
    PyErr_SetString(
        PyExc_TypeError,
        "packed_plan_layout(num_tokens, top_k, num_experts, alignment, expert_capacity=None): 4 or 5 arguments");
    return nullptr;
  }
  int64_t v[5] = {};
  bool none_capacity = nargs == 4;
  for (int i = 0; i < nargs; ++i) {
    if (i == 4 && args[i] == Py_None) {
      none_capacity = true;
      continue;
    }
    if (!PyLong_Check(args[i]) || PyBool_Check(args[i])) {
      PyErr_Format(PyExc_TypeError, "packed_plan_layout: %s: expected an int%s, got %s", kArgs[i],
                   i == 4 ? " or None" : "", Py_TYPE(args[i])->tp_name);
      return nullptr;
    }
    int overflow = 0;
    v[i] = PyLong_AsLongLongAndOverflow(args[i], &overflow);
    if (v[i] == -1 && PyErr_Occurred()) return nullptr;
    if (overflow != 0) {
      PyErr_Format(PyExc_ValueError, "packed_plan_layout: %s: size overflow: does not fit 64 bits", kArgs[i]);
      return nullptr;
    }
    if (v[i] < kMin[i]) {
      PyErr_Format(PyExc_ValueError, "packed_plan_layout: %s: must be >= %lld, got %lld", kArgs[i],
                   static_cast<long long>(kMin[i]), static_cast<long long>(v[i]));
      return nullptr;
    }
  }
  int64_t a = 0;
  PlanLayout l;
  if (__builtin_mul_overflow(v[0], v[1], &a)) {
    l.overflow = true;
  } else {
    l = plan_layout(a, v[2], v[3], none_capacity ? std::nullopt : OptInt(v[4]));
  }
  if (l.overflow) {
    PyErr_SetString(PyExc_ValueError, "packed_plan_layout: size overflow: the plan's length does not fit 64 bits");
    return nullptr;
  }
  PyObject* out = PyTuple_New(kPlanFields);
  if (out == nullptr) return nullptr;
  for (int i = 0; i < kPlanFields; ++i) {
    PyObject* field = Py_BuildValue("(sLL)", kPlanFieldNames[i], static_cast<long long>(l.offset[i]),
                                    static_cast<long long>(l.length[i]));
    if (field == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, i, field);
  }
  return out;
}

#define PADMOE_PY_FN(name, fn) \
  {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fn)), METH_FASTCALL, nullptr}

PyMethodDef g_methods[] = {
    PADMOE_PY_FN("make_plan", (PyEntry<kPyMakePlan, decltype(make_plan_kernel)>::call)),
    PADMOE_PY_FN("dispatch", (PyEntry<kPyDispatch, decltype(dispatch_kernel)>::call)),
    PADMOE_PY_FN("combine", (PyEntry<kPyCombine, decltype(combine_kernel)>::call)),
    PADMOE_PY_FN("padded_gather", (PyEntry<kPyPaddedGather, decltype(padded_gather_kernel)>::call)),
    PADMOE_PY_FN("padded_scatter", (PyEntry<kPyPaddedScatter, decltype(padded_scatter_kernel)>::call)),
    PADMOE_PY_FN("padded_scatter_wgrad", (PyEntry<kPyPaddedScatterWgrad, decltype(padded_scatter_wgrad_kernel)>::call)),
    PADMOE_PY_FN("pad_to_alignment", (PyEntry<kPyPad, decltype(pad_kernel)>::call)),
    PADMOE_PY_FN("unpad_from_alignment", (PyEntry<kPyUnpad, decltype(unpad_kernel)>::call)),
    PADMOE_PY_FN("make_plan_and_dispatch",
                 (PyEntry<kPyMakePlanAndDispatch, decltype(make_plan_and_dispatch_kernel)>::call)),
    PADMOE_PY_FN("packed_plan_layout", py_packed_plan_layout),
    PADMOE_PY_FN("_set_fallback", py_set_fallback),
    {nullptr, nullptr, 0, nullptr},
};
#undef PADMOE_PY_FN

PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "_torch_ops",
                        "padmoe's native torch operators (torch.ops.padmoe.*) and their Python entry points", -1,
                        g_methods};

}  // namespace
}  // namespace padmoe_torch

// The fallback indices, in the order padmoe.torch registers them.
PyMODINIT_FUNC PyInit__torch_ops() {
  using namespace padmoe_torch;
  PyObject* m = PyModule_Create(&g_module);
  if (m == nullptr) return nullptr;
  PyObject* order = PyTuple_New(kPyOpCount);
  for (int i = 0; i < kPyOpCount; ++i) PyTuple_SET_ITEM(order, i, PyUnicode_FromString(kPyOpNames[i]));
  PyModule_AddObject(m, "FALLBACK_ORDER", order);
  return m;
}
