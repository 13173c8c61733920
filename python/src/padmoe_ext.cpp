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
#include "padmoe/tiling.hpp"

#ifndef PADMOE_VERSION
#define PADMOE_VERSION "unknown"
#endif

namespace nb = nanobind;

namespace {

using padmoe::DType;
using padmoe::Error;
using padmoe::ErrorKind;
using padmoe::TensorView;

using In = nb::ndarray<nb::ro>;      // a pure input (read-only arrays accepted)
using Out = nb::ndarray<>;           // an output (must be writable)
using OptIn = std::optional<In>;     // optional input: None = std::nullopt
using OptOut = std::optional<Out>;   // optional output: None = empty TensorView{}

[[noreturn]] void fail(ErrorKind kind, const char* op, const std::string& arg, const std::string& what) {
  throw Error(kind, std::string(op) + ": " + arg + ": " + what);
}

// DLPack type codes of the float8 formats (DLPack >= 1.1). Numeric so the
// module also builds with nanobind releases whose dtype_code enum predates them.
constexpr uint8_t kDLFloat8E4M3FN = 10;
constexpr uint8_t kDLFloat8E5M2 = 12;
constexpr uint8_t kDLFloat8E8M0FNU = 14;  // MXFP8 scales: read as their uint8 bytes

DType to_dtype(const nb::dlpack::dtype& dt, const char* op, const std::string& arg) {
  const auto code = dt.code;
  const auto bits = dt.bits;
  if (dt.lanes == 1) {
    if (code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float)) {
      if (bits == 32) return DType::kFloat32;
      if (bits == 16) return DType::kFloat16;
    } else if (code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && bits == 16) {
      return DType::kBFloat16;
    } else if (code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int)) {
      if (bits == 32) return DType::kInt32;
      if (bits == 64) return DType::kInt64;
    } else if (code == kDLFloat8E4M3FN && bits == 8) {
      return DType::kFloat8E4M3;
    } else if (code == kDLFloat8E5M2 && bits == 8) {
      return DType::kFloat8E5M2;
    } else if ((code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) || code == kDLFloat8E8M0FNU) && bits == 8) {
      return DType::kUInt8;  // E8M0 scale bytes (uint8, or float8_e8m0fnu)
    }
  }
  fail(ErrorKind::kType, op, arg,
       "unsupported dtype (DLPack code " + std::to_string(code) + ", " + std::to_string(bits) + " bits, " +
           std::to_string(dt.lanes) +
           " lanes); expected float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int32, int64 or uint8 (scales)");
}

padmoe::Device to_device(int type, int id, const char* op, const std::string& arg) {
  if (type == nb::device::cpu::value || type == nb::device::cuda_host::value) return padmoe::Device::cpu();
  if (type == nb::device::cuda::value) return padmoe::Device::cuda(id);
  fail(ErrorKind::kType, op, arg,
       "unsupported device (DLPack device type " + std::to_string(type) + "); expected CPU or CUDA");
}

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

// A uint8 array of float8 codes read as the float8 format `fp8` ("e4m3" /
// "e5m2"); "" keeps the view's dtype (dispatch_quantized / quantize outputs).
TensorView fp8_codes(TensorView v, const std::string& fp8, const char* op) {
  if (fp8.empty()) return v;
  if (fp8 != "e4m3" && fp8 != "e5m2")
    fail(ErrorKind::kValue, op, "fp8", "expected 'e4m3' or 'e5m2', got '" + fp8 + "'");
  if (v.dtype != DType::kUInt8) {
    fail(ErrorKind::kType, op, "y",
         std::string("fp8='") + fp8 + "' reads uint8 code bytes, got " + padmoe::dtype_name(v.dtype));
  }
  v.dtype = fp8 == "e4m3" ? DType::kFloat8E4M3 : DType::kFloat8E5M2;
  return v;
}

std::optional<TensorView> opt_view(const OptIn& a, const char* op, const char* arg) {
  if (!a) return std::nullopt;
  return to_view(*a, op, arg);
}

// An optional output: None -> an empty TensorView{} (the op skips it).
TensorView to_out_view(const OptOut& a, const char* op, const char* arg) {
  if (!a) return TensorView{};
  return to_view(*a, op, arg);
}

padmoe::Options make_options(uintptr_t stream, bool check_data, int num_threads, const OptOut& workspace,
                             bool zero_tail, bool zero_padding, const char* op) {
  padmoe::Options o;
  o.zero_padding = zero_padding;
  o.stream = reinterpret_cast<void*>(stream);
  o.check_data = check_data;
  o.num_threads = num_threads;
  o.zero_tail = zero_tail;
  if (workspace) {
    const Out& w = *workspace;
    if (w.device_type() != nb::device::cuda::value) {
      fail(ErrorKind::kType, op, "workspace", "expected a CUDA buffer");
    }
    bool contiguous = true;
    int64_t expect = 1;
    for (size_t d = w.ndim(); d-- > 0;) {
      if (w.shape(d) != 1 && w.stride(d) != expect) contiguous = false;
      expect *= static_cast<int64_t>(w.shape(d));
    }
    if (!contiguous) fail(ErrorKind::kValue, op, "workspace", "expected a contiguous buffer");
    o.workspace = w.size() == 0 ? nullptr : w.data();
    o.workspace_bytes = o.workspace == nullptr ? 0 : w.nbytes();
  }
  return o;
}

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

// The keyword-only options every op takes, in this order.
#define PADMOE_OPTIONS                                                                            \
  nb::kw_only(), nb::arg("stream") = 0, nb::arg("check_data") = true, nb::arg("num_threads") = 0, \
                 nb::arg("workspace").none() = nb::none(), nb::arg("zero_tail") = false,          \
                 nb::arg("zero_padding") = true
#define PADMOE_OPTION_PARAMS \
  uintptr_t stream, bool check_data, int num_threads, const OptOut &workspace, bool zero_tail, bool zero_padding
#define PADMOE_OPTS(op) make_options(stream, check_data, num_threads, workspace, zero_tail, zero_padding, op)

NB_MODULE(_C, m) {
  m.doc() =
      "padmoe's native ops (the C++ `_out` forms: they fill caller-owned outputs and allocate nothing). "
      "Use the functions of the `padmoe` package, which allocate outputs for you.";
  m.attr("__version__") = PADMOE_VERSION;
  nb::register_exception_translator(translate_error);

  m.def("has_cuda", &has_cuda, "Whether the CUDA backend was compiled in.");
  m.def(
      "capacity_bound",
      [](int64_t num_tokens, int top_k, int num_experts, int alignment) {
        return padmoe::padded_rows_bound(num_tokens, top_k, num_experts, alignment);
      },
      nb::arg("num_tokens"), nb::arg("top_k"), nb::arg("num_experts"), nb::arg("alignment"),
      "Host-side bound on P: num_tokens*top_k + num_experts*(alignment-1).");
  m.def(
      "workspace_bound",
      [](int64_t num_tokens, int top_k, int num_experts, int alignment) {
        return static_cast<uint64_t>(padmoe::workspace_bound(num_tokens, top_k, num_experts, alignment));
      },
      nb::arg("num_tokens"), nb::arg("top_k"), nb::arg("num_experts"), nb::arg("alignment"),
      "Device scratch bytes that suffice for every op on this routing.");

  m.def(
      "plan_tiles",
      [](const std::string& target, const std::string& op, int64_t hidden, const std::string& dtype, int cores) {
        const char* name = "tile_config";
        padmoe::TileTarget t = padmoe::TileTarget::kCpu;
        if (!padmoe::parse_tile_target(target, &t))
          fail(ErrorKind::kValue, name, "target", "expected 'cpu', 'ascend-a2' or 'gpu', got '" + target + "'");
        padmoe::TileOp o = padmoe::TileOp::kGather;
        if (op == "scatter") o = padmoe::TileOp::kScatter;
        else if (op == "wgrad") o = padmoe::TileOp::kWgrad;
        else if (op != "gather")
          fail(ErrorKind::kValue, name, "op", "expected 'gather', 'scatter' or 'wgrad', got '" + op + "'");
        DType d = DType::kFloat32;
        if (dtype == "float16") d = DType::kFloat16;
        else if (dtype == "bfloat16") d = DType::kBFloat16;
        else if (dtype != "float32")
          fail(ErrorKind::kType, name, "dtype", "expected 'float32', 'float16' or 'bfloat16', got '" + dtype + "'");
        if (hidden < 0) fail(ErrorKind::kValue, name, "hidden", "must be >= 0, got " + std::to_string(hidden));
        if (cores < 0) fail(ErrorKind::kValue, name, "cores", "must be >= 0, got " + std::to_string(cores));
        const padmoe::TileConfig c = padmoe::tile_config(padmoe::target_info(t, cores), o, hidden, d);
        nb::dict r;
        r["programs"] = c.programs;
        r["sub_block_rows"] = c.sub_block_rows;
        r["block_x"] = c.block_x;
        r["buffer_bytes"] = c.buffer_bytes;
        r["buffers"] = c.buffers;
        r["describe"] = padmoe::describe_tile_config(o, c, hidden, d);
        return r;
      },
      nb::arg("target"), nb::arg("op"), nb::arg("hidden"), nb::arg("dtype"), nb::arg("cores") = 0,
      "The tile planner's TileConfig (docs/spec.md §15) as a dict, for target 'cpu', 'ascend-a2' or 'gpu', op "
      "'gather' / 'scatter' / 'wgrad', hidden size and row dtype; cores = 0: the target's default (CPU threads; "
      "48 vector cores; 132 SMs).");
  m.def(
      "padded_rows",
      [](nb::handle plan, uintptr_t stream) {
        PlanArg<In> p;
        read_plan(plan, "padded_rows", "plan", p);
        padmoe::Options o;
        o.stream = reinterpret_cast<void*>(stream);
        nb::gil_scoped_release release;
        return padmoe::padded_rows(p.view, o);
      },
      nb::arg("plan"), nb::kw_only(), nb::arg("stream") = 0,
      "P = plan.padded_bins[E-1], read on the host (on CUDA: synchronizes the stream).");

  m.def(
      "make_plan_out",
      [](const In& top_experts, int num_experts, int alignment, nb::handle out, const OptOut& row_experts,
         const OptOut& block_experts, const OptOut& padded_total, const OptIn& expert_map, int first_expert,
         int global_experts, bool drop_invalid, int64_t expert_capacity, const std::string& drop_policy,
         const OptIn& probs, const OptOut& dropped, PADMOE_OPTION_PARAMS) {
        const char* op = "make_plan";
        const TensorView te = to_view(top_experts, op, "top_experts");
        PlanArg<Out> p;
        read_plan(out, op, "out", p);
        padmoe::PlanLayouts l;  // the layouts other kernels consume, each optional (None: not written)
        l.row_experts = to_out_view(row_experts, op, "layouts.row_experts");
        l.block_experts = to_out_view(block_experts, op, "layouts.block_experts");
        l.padded_total = to_out_view(padded_total, op, "layouts.padded_total");
        padmoe::PlanOptions po;  // expert parallelism, invalid ids, capacity (ops.hpp)
        if (expert_map) po.expert_map = to_view(*expert_map, op, "expert_map");
        po.first_expert = first_expert;
        po.global_experts = global_experts;
        po.drop_invalid = drop_invalid;
        po.expert_capacity = expert_capacity;
        if (drop_policy == "probs") {
          po.drop_policy = padmoe::DropPolicy::kProbs;
        } else if (drop_policy != "position") {
          throw padmoe::Error(padmoe::ErrorKind::kValue, std::string(op) +
                                                             ": drop_policy: expected 'position' or "
                                                             "'probs', got '" +
                                                             drop_policy + "'");
        }
        if (probs) po.probs = to_view(*probs, op, "probs");
        po.dropped = to_out_view(dropped, op, "dropped");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::make_plan_out(te, num_experts, alignment, p.view, l, po, o);
      },
      nb::arg("top_experts"), nb::arg("num_experts"), nb::arg("alignment"), nb::arg("out"),
      nb::arg("row_experts").none() = nb::none(), nb::arg("block_experts").none() = nb::none(),
      nb::arg("padded_total").none() = nb::none(), nb::arg("expert_map").none() = nb::none(),
      nb::arg("first_expert") = 0, nb::arg("global_experts") = 0, nb::arg("drop_invalid") = false,
      nb::arg("expert_capacity") = -1, nb::arg("drop_policy") = "position", nb::arg("probs").none() = nb::none(),
      nb::arg("dropped").none() = nb::none(), PADMOE_OPTIONS);
  m.def(
      "plan_rows_bound",
      [](int64_t num_tokens, int top_k, int num_experts, int alignment, int64_t expert_capacity) {
        padmoe::PlanOptions po;
        po.expert_capacity = expert_capacity;
        return padmoe::plan_rows_bound(num_tokens, top_k, num_experts, alignment, po);
      },
      nb::arg("num_tokens"), nb::arg("top_k"), nb::arg("num_experts"), nb::arg("alignment"),
      nb::arg("expert_capacity") = -1,
      "Rows of row_sources a plan needs: num_experts * expert_capacity with a capacity, else padded_rows_bound.");

  m.def(
      "moe_align_block_size_out",
      [](const In& top_experts, int block_size, int num_experts, const Out& sorted_token_ids, const Out& expert_ids,
         const Out& num_tokens_post_padded, const OptIn& expert_map, PADMOE_OPTION_PARAMS) {
        const char* op = "moe_align_block_size";
        const TensorView te = to_view(top_experts, op, "topk_ids");
        const TensorView vs = to_view(sorted_token_ids, op, "sorted_token_ids"),
                         ve = to_view(expert_ids, op, "expert_ids"),
                         vn = to_view(num_tokens_post_padded, op, "num_tokens_post_padded");
        const TensorView vm = expert_map ? to_view(*expert_map, op, "expert_map") : TensorView{};
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::moe_align_block_size_out(te, block_size, num_experts, vm, vs, ve, vn, o);
      },
      nb::arg("topk_ids"), nb::arg("block_size"), nb::arg("num_experts"), nb::arg("sorted_token_ids"),
      nb::arg("expert_ids"), nb::arg("num_tokens_post_padded"), nb::arg("expert_map").none() = nb::none(),
      PADMOE_OPTIONS);

  m.def(
      "aligned_rows_bound",
      [](int64_t assignments, int num_experts, int block_size, bool pad_sorted_ids) {
        return padmoe::aligned_rows_bound(assignments, num_experts, block_size, pad_sorted_ids);
      },
      nb::arg("assignments"), nb::arg("num_experts"), nb::arg("block_size"), nb::arg("pad_sorted_ids") = false,
      "A + min(A, E) * (block_size - 1) (rounded up to block_size when pad_sorted_ids): vLLM's "
      "max_num_tokens_padded, a bound on P.");

  // --- MegaBlocks family -----------------------------------------------------

  m.def(
      "padded_gather_out",
      [](const In& x, const In& indices, const In& bin_ids, const In& bins, const In& padded_bins, int top_k,
         const OptIn& weights, const Out& y, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_gather";
        const TensorView vx = to_view(x, op, "x"), vi = to_view(indices, op, "indices"),
                         vb = to_view(bin_ids, op, "bin_ids"), vbins = to_view(bins, op, "bins"),
                         vp = to_view(padded_bins, op, "padded_bins"), vy = to_view(y, op, "y");
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_gather_out(vx, vi, vb, vbins, vp, top_k, vw, vy, o);
      },
      nb::arg("x"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("bins"), nb::arg("padded_bins"), nb::arg("top_k"),
      nb::arg("weights").none(), nb::arg("y"), PADMOE_OPTIONS);

  m.def(
      "padded_scatter_out",
      [](const In& y, const In& indices, const In& bin_ids, const OptIn& weights, const In& bins, const In& padded_bins,
         int top_k, const Out& out, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_scatter";
        const TensorView vy = to_view(y, op, "y"), vi = to_view(indices, op, "indices"),
                         vb = to_view(bin_ids, op, "bin_ids"), vbins = to_view(bins, op, "bins"),
                         vp = to_view(padded_bins, op, "padded_bins"), vo = to_view(out, op, "out");
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_scatter_out(vy, vi, vb, vw, vbins, vp, top_k, vo, o);
      },
      nb::arg("y"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("weights").none(), nb::arg("bins"),
      nb::arg("padded_bins"), nb::arg("top_k"), nb::arg("out"), PADMOE_OPTIONS);

  m.def(
      "padded_scatter_wgrad_out",
      [](const In& y, const In& grad, const In& indices, const In& bin_ids, const In& bins, const In& padded_bins,
         int top_k, const Out& wgrad, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_scatter_wgrad";
        const TensorView vy = to_view(y, op, "y"), vg = to_view(grad, op, "grad"), vi = to_view(indices, op, "indices"),
                         vb = to_view(bin_ids, op, "bin_ids"), vbins = to_view(bins, op, "bins"),
                         vp = to_view(padded_bins, op, "padded_bins"), vw = to_view(wgrad, op, "wgrad");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_scatter_wgrad_out(vy, vg, vi, vb, vbins, vp, top_k, vw, o);
      },
      nb::arg("y"), nb::arg("grad"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("bins"), nb::arg("padded_bins"),
      nb::arg("top_k"), nb::arg("wgrad"), PADMOE_OPTIONS);

  m.def(
      "padded_gather_backward_out",
      [](const In& grad_y, const In& x, const In& indices, const In& bin_ids, const In& bins, const In& padded_bins,
         int top_k, const OptIn& weights, const Out& grad_x, const OptOut& grad_weights, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_gather_backward";
        const TensorView vgy = to_view(grad_y, op, "grad_y"), vx = to_view(x, op, "x"),
                         vi = to_view(indices, op, "indices"), vb = to_view(bin_ids, op, "bin_ids"),
                         vbins = to_view(bins, op, "bins"), vp = to_view(padded_bins, op, "padded_bins"),
                         vgx = to_view(grad_x, op, "grad_x"), vgw = to_out_view(grad_weights, op, "grad_weights");
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_gather_backward_out(vgy, vx, vi, vb, vbins, vp, top_k, vw, vgx, vgw, o);
      },
      nb::arg("grad_y"), nb::arg("x"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("bins"), nb::arg("padded_bins"),
      nb::arg("top_k"), nb::arg("weights").none(), nb::arg("grad_x"), nb::arg("grad_weights").none(), PADMOE_OPTIONS);

  m.def(
      "padded_scatter_backward_out",
      [](const In& grad_out, const In& y, const In& indices, const In& bin_ids, const OptIn& weights, const In& bins,
         const In& padded_bins, int top_k, const Out& grad_y, const OptOut& grad_weights, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_scatter_backward";
        const TensorView vgo = to_view(grad_out, op, "grad_out"), vy = to_view(y, op, "y"),
                         vi = to_view(indices, op, "indices"), vb = to_view(bin_ids, op, "bin_ids"),
                         vbins = to_view(bins, op, "bins"), vp = to_view(padded_bins, op, "padded_bins"),
                         vgy = to_view(grad_y, op, "grad_y"), vgw = to_out_view(grad_weights, op, "grad_weights");
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_scatter_backward_out(vgo, vy, vi, vb, vw, vbins, vp, top_k, vgy, vgw, o);
      },
      nb::arg("grad_out"), nb::arg("y"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("weights").none(),
      nb::arg("bins"), nb::arg("padded_bins"), nb::arg("top_k"), nb::arg("grad_y"), nb::arg("grad_weights").none(),
      PADMOE_OPTIONS);

  // --- fused plan forms ------------------------------------------------------

  m.def(
      "dispatch_out",
      [](const In& x, nb::handle plan, const OptIn& weights, const Out& y, PADMOE_OPTION_PARAMS) {
        const char* op = "dispatch";
        const TensorView vx = to_view(x, op, "x"), vy = to_view(y, op, "y");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::dispatch_out(vx, p.view, vw, vy, o);
      },
      nb::arg("x"), nb::arg("plan"), nb::arg("weights").none(), nb::arg("y"), PADMOE_OPTIONS);

  // make_plan into `out` (a plan object, as make_plan_out's) and dispatch into y, in one call;
  // every check runs before anything is written.
  m.def(
      "make_plan_and_dispatch_out",
      [](const In& x, const In& top_experts, int num_experts, int alignment, nb::handle out, const OptIn& weights,
         const Out& y, PADMOE_OPTION_PARAMS) {
        const char* op = "make_plan_and_dispatch";
        const TensorView vx = to_view(x, op, "x"), te = to_view(top_experts, op, "top_experts"),
                         vy = to_view(y, op, "y");
        PlanArg<Out> p;
        read_plan(out, op, "out", p);
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::make_plan_and_dispatch_out(vx, te, num_experts, alignment, p.view, vw, vy, o);
      },
      nb::arg("x"), nb::arg("top_experts"), nb::arg("num_experts"), nb::arg("alignment"), nb::arg("out"),
      nb::arg("weights").none(), nb::arg("y"), PADMOE_OPTIONS);

  m.def(
      "combine_out",
      [](const In& y, nb::handle plan, const OptIn& weights, const Out& out, PADMOE_OPTION_PARAMS) {
        const char* op = "combine";
        const TensorView vy = to_view(y, op, "y"), vo = to_view(out, op, "out");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::combine_out(vy, p.view, vw, vo, o);
      },
      nb::arg("y"), nb::arg("plan"), nb::arg("weights").none(), nb::arg("out"), PADMOE_OPTIONS);

  m.def(
      "combine_backward_out",
      [](const In& grad_out, const In& y, nb::handle plan, const OptIn& weights, const Out& grad_y,
         const OptOut& grad_weights, PADMOE_OPTION_PARAMS) {
        const char* op = "combine_backward";
        const TensorView vgo = to_view(grad_out, op, "grad_out"), vy = to_view(y, op, "y"),
                         vgy = to_view(grad_y, op, "grad_y"), vgw = to_out_view(grad_weights, op, "grad_weights");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::combine_backward_out(vgo, vy, p.view, vw, vgy, vgw, o);
      },
      nb::arg("grad_out"), nb::arg("y"), nb::arg("plan"), nb::arg("weights").none(), nb::arg("grad_y"),
      nb::arg("grad_weights").none(), PADMOE_OPTIONS);

  m.def(
      "dispatch_backward_out",
      [](const In& grad_y, const In& x, nb::handle plan, const OptIn& weights, const Out& grad_x,
         const OptOut& grad_weights, PADMOE_OPTION_PARAMS) {
        const char* op = "dispatch_backward";
        const TensorView vgy = to_view(grad_y, op, "grad_y"), vx = to_view(x, op, "x"),
                         vgx = to_view(grad_x, op, "grad_x"), vgw = to_out_view(grad_weights, op, "grad_weights");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::dispatch_backward_out(vgy, vx, p.view, vw, vgx, vgw, o);
      },
      nb::arg("grad_y"), nb::arg("x"), nb::arg("plan"), nb::arg("weights").none(), nb::arg("grad_x"),
      nb::arg("grad_weights").none(), PADMOE_OPTIONS);

  // --- Megatron family -------------------------------------------------------

  m.def(
      "pad_to_alignment_out",
      [](const In& hidden_states, const In& tokens_per_expert, int alignment, const Out& padded,
         const Out& permutation_map, const Out& inclusive_offsets, PADMOE_OPTION_PARAMS) {
        const char* op = "pad_to_alignment";
        const TensorView vh = to_view(hidden_states, op, "hidden_states"),
                         vt = to_view(tokens_per_expert, op, "tokens_per_expert"), vp = to_view(padded, op, "padded"),
                         vm = to_view(permutation_map, op, "permutation_map"),
                         vo = to_view(inclusive_offsets, op, "inclusive_offsets");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::pad_to_alignment_out(vh, vt, alignment, vp, vm, vo, o);
      },
      nb::arg("hidden_states"), nb::arg("tokens_per_expert"), nb::arg("alignment"), nb::arg("padded"),
      nb::arg("permutation_map"), nb::arg("inclusive_offsets"), PADMOE_OPTIONS);

  m.def(
      "pad_to_alignment_rows",
      [](const In& hidden_states, const In& tokens_per_expert, int alignment, PADMOE_OPTION_PARAMS) {
        const char* op = "pad_to_alignment";
        const TensorView vh = to_view(hidden_states, op, "hidden_states"),
                         vt = to_view(tokens_per_expert, op, "tokens_per_expert");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        return padmoe::pad_to_alignment_rows(vh, vt, alignment, o);
      },
      nb::arg("hidden_states"), nb::arg("tokens_per_expert"), nb::arg("alignment"), PADMOE_OPTIONS,
      "P for these inputs, after pad_to_alignment's checks (CUDA: one synchronization).");

  m.def(
      "unpad_from_alignment_out",
      [](const In& padded, const In& permutation_map, const OptIn& probs, const Out& out, PADMOE_OPTION_PARAMS) {
        const char* op = "unpad_from_alignment";
        const TensorView vp = to_view(padded, op, "padded_output"),
                         vm = to_view(permutation_map, op, "permutation_map"), vo = to_view(out, op, "out");
        const auto vpr = opt_view(probs, op, "probs");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::unpad_from_alignment_out(vp, vm, vpr, vo, o);
      },
      nb::arg("padded"), nb::arg("permutation_map"), nb::arg("probs").none(), nb::arg("out"), PADMOE_OPTIONS);

  m.def(
      "unpad_from_alignment_backward_out",
      [](const In& grad_out, const In& padded, const In& permutation_map, const OptIn& probs, const Out& grad_padded,
         const OptOut& grad_probs, PADMOE_OPTION_PARAMS) {
        const char* op = "unpad_from_alignment_backward";
        const TensorView vgo = to_view(grad_out, op, "grad_out"), vp = to_view(padded, op, "padded_output"),
                         vm = to_view(permutation_map, op, "permutation_map"),
                         vgp = to_view(grad_padded, op, "grad_padded"),
                         vgpr = to_out_view(grad_probs, op, "grad_probs");
        const auto vpr = opt_view(probs, op, "probs");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::unpad_from_alignment_backward_out(vgo, vp, vm, vpr, vgp, vgpr, o);
      },
      nb::arg("grad_out"), nb::arg("padded"), nb::arg("permutation_map"), nb::arg("probs").none(),
      nb::arg("grad_padded"), nb::arg("grad_probs").none(), PADMOE_OPTIONS);

  // --- expert parallelism: chunk sort --------------------------------------------

  m.def(
      "sort_chunks_out",
      [](const In& received, const In& split_sizes, int num_ranks, int alignment, const OptIn& sorted_index,
         const Out& padded, const Out& permutation_map, const Out& inclusive_offsets, PADMOE_OPTION_PARAMS) {
        const char* op = "sort_chunks";
        const TensorView vr = to_view(received, op, "received"), vs = to_view(split_sizes, op, "split_sizes"),
                         vp = to_view(padded, op, "padded"), vm = to_view(permutation_map, op, "permutation_map"),
                         vo = to_view(inclusive_offsets, op, "inclusive_offsets");
        const auto vsi = opt_view(sorted_index, op, "sorted_index");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::sort_chunks_out(vr, vs, num_ranks, alignment, vsi, vp, vm, vo, o);
      },
      nb::arg("received"), nb::arg("split_sizes"), nb::arg("num_ranks"), nb::arg("alignment"),
      nb::arg("sorted_index").none(), nb::arg("padded"), nb::arg("permutation_map"), nb::arg("inclusive_offsets"),
      PADMOE_OPTIONS);
  m.def(
      "sort_chunks_rows",
      [](const In& received, const In& split_sizes, int num_ranks, int alignment, const OptIn& sorted_index,
         PADMOE_OPTION_PARAMS) {
        const char* op = "sort_chunks";
        const TensorView vr = to_view(received, op, "received"), vs = to_view(split_sizes, op, "split_sizes");
        const auto vsi = opt_view(sorted_index, op, "sorted_index");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        return padmoe::sort_chunks_rows(vr, vs, num_ranks, alignment, vsi, o);
      },
      nb::arg("received"), nb::arg("split_sizes"), nb::arg("num_ranks"), nb::arg("alignment"),
      nb::arg("sorted_index").none(), PADMOE_OPTIONS,
      "P for these inputs, after sort_chunks' checks (CUDA: one synchronization).");
  m.def(
      "sort_chunks_capacity",
      [](int64_t received_rows, int64_t num_chunks, int num_ranks, int alignment) {
        return padmoe::sort_chunks_rows_bound(received_rows, num_chunks, num_ranks, alignment);
      },
      nb::arg("received_rows"), nb::arg("num_chunks"), nb::arg("num_ranks"), nb::arg("alignment"),
      "Host-side bound on sort_chunks' P: received_rows + (num_chunks / num_ranks) * (alignment - 1).");

  // --- rows moved with their scales (ops.hpp section 4) -----------------------

  m.def(
      "dispatch_scaled_out",
      [](const In& x, nb::handle plan, const In& x_scales, const Out& y, const Out& y_scales, PADMOE_OPTION_PARAMS) {
        const char* op = "dispatch";
        const TensorView vx = to_view(x, op, "x"), vxs = to_view(x_scales, op, "x_scales"), vy = to_view(y, op, "y"),
                         vys = to_view(y_scales, op, "y_scales");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::dispatch_scaled_out(vx, p.view, vxs, vy, vys, o);
      },
      nb::arg("x"), nb::arg("plan"), nb::arg("x_scales"), nb::arg("y"), nb::arg("y_scales"), PADMOE_OPTIONS);

  m.def(
      "padded_gather_scaled_out",
      [](const In& x, const In& indices, const In& bin_ids, const In& bins, const In& padded_bins, int top_k,
         const In& x_scales, const Out& y, const Out& y_scales, PADMOE_OPTION_PARAMS) {
        const char* op = "padded_gather";
        const TensorView vx = to_view(x, op, "x"), vi = to_view(indices, op, "indices"),
                         vb = to_view(bin_ids, op, "bin_ids"), vbins = to_view(bins, op, "bins"),
                         vp = to_view(padded_bins, op, "padded_bins"), vxs = to_view(x_scales, op, "x_scales"),
                         vy = to_view(y, op, "y"), vys = to_view(y_scales, op, "y_scales");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::padded_gather_scaled_out(vx, vi, vb, vbins, vp, top_k, vxs, vy, vys, o);
      },
      nb::arg("x"), nb::arg("indices"), nb::arg("bin_ids"), nb::arg("bins"), nb::arg("padded_bins"), nb::arg("top_k"),
      nb::arg("x_scales"), nb::arg("y"), nb::arg("y_scales"), PADMOE_OPTIONS);

  m.def(
      "pad_to_alignment_scaled_out",
      [](const In& hidden_states, const In& tokens_per_expert, int alignment, const In& hidden_scales,
         const Out& padded, const Out& padded_scales, const Out& permutation_map, const Out& inclusive_offsets,
         PADMOE_OPTION_PARAMS) {
        const char* op = "pad_to_alignment";
        const TensorView vh = to_view(hidden_states, op, "hidden_states"),
                         vt = to_view(tokens_per_expert, op, "tokens_per_expert"),
                         vhs = to_view(hidden_scales, op, "hidden_scales"), vp = to_view(padded, op, "padded"),
                         vps = to_view(padded_scales, op, "padded_scales"),
                         vm = to_view(permutation_map, op, "permutation_map"),
                         vo = to_view(inclusive_offsets, op, "inclusive_offsets");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::pad_to_alignment_scaled_out(vh, vt, alignment, vhs, vp, vps, vm, vo, o);
      },
      nb::arg("hidden_states"), nb::arg("tokens_per_expert"), nb::arg("alignment"), nb::arg("hidden_scales"),
      nb::arg("padded"), nb::arg("padded_scales"), nb::arg("permutation_map"), nb::arg("inclusive_offsets"),
      PADMOE_OPTIONS);

  m.def(
      "unpad_from_alignment_scaled_out",
      [](const In& padded, const In& permutation_map, const In& padded_scales, const Out& out, const Out& out_scales,
         PADMOE_OPTION_PARAMS) {
        const char* op = "unpad_from_alignment";
        const TensorView vp = to_view(padded, op, "padded_output"),
                         vm = to_view(permutation_map, op, "permutation_map"),
                         vps = to_view(padded_scales, op, "padded_scales"), vo = to_view(out, op, "out"),
                         vos = to_view(out_scales, op, "out_scales");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::unpad_from_alignment_scaled_out(vp, vm, vps, vo, vos, o);
      },
      nb::arg("padded"), nb::arg("permutation_map"), nb::arg("padded_scales"), nb::arg("out"), nb::arg("out_scales"),
      PADMOE_OPTIONS);

  // --- fused quantizing dispatch (ops.hpp section 4) ----------------------------
  // `fp8` ("e4m3" / "e5m2") reads a uint8 y as float8 codes of that format
  // (numpy has no float8 dtype); "" takes y's own dtype (torch float8 tensors).
  m.def(
      "dispatch_quantized_out",
      [](const In& x, nb::handle plan, const Out& y, const Out& y_scales, const std::string& fp8,
         PADMOE_OPTION_PARAMS) {
        const char* op = "dispatch_quantized";
        const TensorView vx = to_view(x, op, "x"), vy = fp8_codes(to_view(y, op, "y"), fp8, op),
                         vys = to_view(y_scales, op, "y_scales");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::dispatch_quantized_out(vx, p.view, vy, vys, o);
      },
      nb::arg("x"), nb::arg("plan"), nb::arg("y"), nb::arg("y_scales"), nb::arg("fp8") = "", PADMOE_OPTIONS);

  m.def(
      "quantize_out",
      [](const In& x, const Out& y, const Out& y_scales, const std::string& fp8, PADMOE_OPTION_PARAMS) {
        const char* op = "quantize";
        const TensorView vx = to_view(x, op, "x"), vy = fp8_codes(to_view(y, op, "y"), fp8, op),
                         vys = to_view(y_scales, op, "y_scales");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::quantize_out(vx, vy, vys, o);
      },
      nb::arg("x"), nb::arg("y"), nb::arg("y_scales"), nb::arg("fp8") = "", PADMOE_OPTIONS);

  // --- utilities ---------------------------------------------------------------

  m.def(
      "copy",
      [](const In& src, const Out& dst, PADMOE_OPTION_PARAMS) {
        const char* op = "copy";
        const TensorView vs = to_view(src, op, "src"), vd = to_view(dst, op, "dst");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::copy(vs, vd, o);
      },
      nb::arg("src"), nb::arg("dst"), PADMOE_OPTIONS);
}
