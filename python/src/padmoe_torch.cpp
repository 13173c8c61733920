// padmoe_torch.cpp — padmoe's ops as native PyTorch operators (torch.ops.padmoe.*).
//
// Built by `pip install .` when torch is importable at build time, as the
// shared library padmoe/_torch_ops.so (loaded by padmoe.torch through
// torch.ops.load_library). It registers, with the torch dispatcher:
//   - every op's schema (TORCH_LIBRARY), so torch.compile traces them as
//     single graph nodes (their fake kernels are in padmoe/torch/__init__.py);
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
// The C++ library and padmoe._C do not depend on this file or on torch.
//
// `check` (every op): 0 = no data checks on CUDA (no synchronization),
// 1 = checked mode, 2 = checked mode unless the current stream is capturing a
// CUDA graph. The CPU backend always checks everything.
//
// float64 rows (which padmoe's kernels do not take) run through ATen
// formulas in float64 inside the same operators, so that
// torch.autograd.gradcheck exercises the operators and their autograd.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <pybind11/pybind11.h>

#ifdef PADMOE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <array>
#include <limits>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "padmoe/error.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using padmoe::DType;
using padmoe::TensorView;
using torch::autograd::variable_list;

// --- errors -------------------------------------------------------------------

[[noreturn]] void rethrow(const padmoe::Error& e) {
  const c10::SourceLocation here{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
  switch (e.kind()) {
    case padmoe::ErrorKind::kValue: throw c10::ValueError(here, e.what());
    case padmoe::ErrorKind::kType: throw c10::TypeError(here, e.what());
    case padmoe::ErrorKind::kUnsupported: throw c10::NotImplementedError(here, e.what());
    default: throw c10::Error(here, e.what());
  }
}

[[noreturn]] void value_error(const char* op, const char* arg, const std::string& what) {
  throw c10::ValueError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::string(op) + ": " + arg + ": " + what);
}
[[noreturn]] void type_error(const char* op, const char* arg, const std::string& what) {
  throw c10::TypeError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::string(op) + ": " + arg + ": " + what);
}

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

std::string shape_of(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

DType dtype_of(const Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat8_e4m3fn: return DType::kFloat8E4M3;
    case at::kFloat8_e5m2: return DType::kFloat8E5M2;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kByte: return DType::kUInt8;  // E8M0 scale bytes (the `_scaled` ops)
    default:
      type_error(op, arg, std::string("unsupported dtype ") + c10::toString(t.scalar_type()) +
                              "; expected float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int32 or int64");
  }
}

TensorView view(const Tensor& t, const char* op, const char* arg) {
  if (!t.defined()) return TensorView{};
  if (t.dim() > padmoe::kMaxDims) {
    value_error(op, arg, "expected at most " + std::to_string(padmoe::kMaxDims) + " dims, got shape " + shape_of(t));
  }
  TensorView v;
  v.data = t.data_ptr();
  v.dtype = dtype_of(t, op, arg);
  v.ndim = static_cast<int>(t.dim());
  int64_t stride = 1;
  const bool empty = t.numel() == 0;
  for (int d = v.ndim; d-- > 0;) {  // empty tensors: row-major strides (torch's may be anything)
    v.shape[d] = t.size(d);
    v.strides[d] = empty ? stride : t.stride(d);
    stride *= std::max<int64_t>(t.size(d), 1);
  }
  if (t.is_cuda()) v.device = padmoe::Device::cuda(t.get_device());
  else if (t.is_cpu()) v.device = padmoe::Device::cpu();
  else type_error(op, arg, "unsupported device " + t.device().str() + "; expected CPU or CUDA");
  return v;
}

std::optional<TensorView> opt_view(const OptTensor& t, const char* op, const char* arg) {
  if (!t || !t->defined()) return std::nullopt;
  return view(*t, op, arg);
}

// Rows: any row stride, but unit stride along the hidden dimension (else one copy).
Tensor rows_arg(const Tensor& t) {
  if (t.dim() == 2 && t.size(1) > 1 && t.stride(1) != 1) return t.contiguous();
  if (t.dim() == 2 && t.size(0) > 1 && t.stride(0) < t.size(1)) return t.contiguous();  // e.g. expanded
  return t;
}

// Index inputs: any stride (one copy when not contiguous).
Tensor index_arg(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// Router weights / probs: any shape with one entry per row, any float dtype,
// any stride; read as float32 by padmoe (float64 is converted once).
OptTensor scale_arg(const OptTensor& w) {
  if (!w || !w->defined()) return std::nullopt;
  Tensor t = *w;
  if (t.dim() != 1) t = t.reshape({-1});
  if (t.scalar_type() == at::kDouble) t = t.to(at::kFloat);
  return t.is_contiguous() ? t : t.contiguous();
}

// Weight gradient output in the weights' dtype (float32 when padmoe cannot write that dtype).
Tensor wgrad_buffer(const Tensor& weights, int64_t n) {
  const auto st = weights.scalar_type();
  const bool direct = st == at::kFloat || st == at::kHalf || st == at::kBFloat16;
  return at::empty({n}, weights.options().dtype(direct ? st : at::kFloat));
}

Tensor as_weights_dtype(const Tensor& g, const OptTensor& weights) {
  return g.scalar_type() == weights->scalar_type() ? g : g.to(weights->scalar_type());
}

Tensor no_grad_placeholder(const Tensor& like, const OptTensor& weights) {
  return at::empty({0}, like.options().dtype(weights && weights->defined() ? weights->scalar_type() : like.scalar_type()));
}

// --- options: stream, checks, scratch -----------------------------------------

#ifdef PADMOE_TORCH_CUDA
void* torch_scratch_alloc(size_t bytes, void* stream, void*) {
  return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream));
}
void torch_scratch_free(void* ptr, void*, void*) { c10::cuda::CUDACachingAllocator::raw_delete(ptr); }
#endif

padmoe::Options options_for(const Tensor& like, int64_t check, bool zero_tail = false) {
  padmoe::Options o;
  o.zero_tail = zero_tail;
  o.check_data = check != 0;
  if (like.is_cuda()) {
#ifdef PADMOE_TORCH_CUDA
    cudaStream_t s = c10::cuda::getCurrentCUDAStream(like.get_device()).stream();
    o.stream = s;
    o.scratch_alloc = torch_scratch_alloc;
    o.scratch_free = torch_scratch_free;
    if (check == 2) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (cudaStreamIsCapturing(s, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
        o.check_data = false;
      }
    }
#else
    throw c10::NotImplementedError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                   "padmoe.torch was built without CUDA support; rebuild padmoe with nvcc on the PATH");
#endif
  }
  return o;
}

// --- plan -----------------------------------------------------------------------

// The static path's plan is one int32 tensor, the eight arrays back to back:
//   [indices A | bin_ids A | tokens_per_expert E | bins E | padded_tokens_per_expert E |
//    padded_bins E | dest_rows A | row_sources capacity],  A = T*K, capacity = A + E*(m-1),
// 4*A + E*(m+3) entries. One allocation and one tensor to pass, save and hand over, where eight
// cost several µs of host time per op (padmoe.Plan exposes the arrays as views of it).
constexpr int kPlanFields = 8;

int64_t packed_length(int64_t a, int64_t e, int64_t m) { return 4 * a + e * (m + 3); }

struct PackedPlan {
  Tensor t;
  int64_t a = 0, e = 0, cap = 0, tokens = 0;
  int k = 1, m = 1;
  int64_t offset(int field) const {
    const int64_t sizes[kPlanFields] = {a, a, e, e, e, e, a, cap};
    int64_t o = 0;
    for (int i = 0; i < field; ++i) o += sizes[i];
    return o;
  }
  Tensor field(int i) const {  // an ATen view (only the float64 formulas need one)
    const int64_t sizes[kPlanFields] = {a, a, e, e, e, e, a, cap};
    return t.narrow(0, offset(i), sizes[i]);
  }
  Tensor dest_rows() const { return field(6); }
  padmoe::PlanView view(const char* op) const {
    padmoe::PlanView p;
    TensorView* fields[kPlanFields] = {&p.indices, &p.bin_ids, &p.tokens_per_expert, &p.bins,
                                       &p.padded_tokens_per_expert, &p.padded_bins, &p.dest_rows, &p.row_sources};
    const int64_t sizes[kPlanFields] = {a, a, e, e, e, e, a, cap};
    const TensorView whole = ::view(t, op, "plan");
    int64_t o = 0;
    for (int i = 0; i < kPlanFields; ++i) {
      TensorView v = whole;
      v.data = static_cast<int32_t*>(whole.data) + o;
      v.shape[0] = sizes[i];
      v.strides[0] = 1;
      *fields[i] = v;
      o += sizes[i];
    }
    p.num_tokens = tokens;
    p.top_k = k;
    p.num_experts = static_cast<int>(e);
    p.alignment = m;
    return p;
  }
};

PackedPlan packed_plan(const Tensor& plan, int64_t top_k, int64_t num_experts, int64_t alignment, const char* op) {
  if (top_k < 1) value_error(op, "top_k", "must be >= 1, got " + std::to_string(top_k));
  if (num_experts < 1) value_error(op, "num_experts", "must be >= 1, got " + std::to_string(num_experts));
  if (plan.scalar_type() != at::kInt || plan.dim() != 1 || !plan.is_contiguous()) {
    type_error(op, "plan", std::string("expected the packed plan of make_plan (a contiguous 1-D int32 tensor), got ") +
                               c10::toString(plan.scalar_type()) + " of shape " + shape_of(plan));
  }
  PackedPlan p;
  p.t = plan;
  p.k = static_cast<int>(top_k);
  p.e = num_experts;
  if (alignment <= 0) {  // a plan with an expert capacity C = -alignment: row_sources of E*C rows
    const int64_t c = -alignment;
    const int64_t rest = plan.numel() - num_experts * (c + 4);
    if (rest < 0 || rest % (3 * top_k) != 0) {
      value_error(op, "plan", std::to_string(plan.numel()) + " entries is no packed plan for top_k=" +
                                  std::to_string(top_k) + ", num_experts=" + std::to_string(num_experts) +
                                  ", expert_capacity=" + std::to_string(c) + " (expected 3*T*K + E*(capacity+4))");
    }
    p.m = 1;  // the row ops do not read it
    p.a = rest / 3;
    p.tokens = p.a / top_k;
    p.cap = num_experts * c;
    return p;
  }
  const int64_t rest = plan.numel() - num_experts * (alignment + 3);
  if (rest < 0 || rest % (4 * top_k) != 0) {
    value_error(op, "plan", std::to_string(plan.numel()) + " entries is no packed plan for top_k=" +
                                std::to_string(top_k) + ", num_experts=" + std::to_string(num_experts) +
                                ", alignment=" + std::to_string(alignment) + " (expected 4*T*K + E*(alignment+3))");
  }
  p.m = static_cast<int>(alignment);
  p.a = rest / 4;
  p.tokens = p.a / top_k;
  p.cap = p.a + num_experts * (alignment - 1);
  return p;
}

// A small index tensor's values on the host as int64 (CUDA: padmoe::copy on the current
// stream, which waits for it: the one synchronization of the drop-ins, as MegaBlocks and
// Megatron have; no ATen copy machinery on that path).
std::vector<int64_t> host_values(const Tensor& t_in, int64_t first, int64_t count) {
  const Tensor t = t_in.is_contiguous() ? t_in : t_in.contiguous();
  std::vector<int64_t> out(static_cast<size_t>(count));
  const bool wide = t.scalar_type() == at::kLong;
  const size_t es = wide ? 8 : 4;
  if (!t.is_cuda()) {
    for (int64_t i = 0; i < count; ++i) {
      out[i] = wide ? t.data_ptr<int64_t>()[first + i] : t.data_ptr<int32_t>()[first + i];
    }
    return out;
  }
  std::vector<unsigned char> bytes(static_cast<size_t>(count) * es);
  TensorView src = view(t, "host_values", "t");
  src.data = static_cast<unsigned char*>(src.data) + first * es;
  src.ndim = 1;
  src.shape[0] = count;
  src.strides[0] = 1;
  TensorView dst = src;
  dst.data = bytes.data();
  dst.device = padmoe::Device::cpu();
  padmoe::Options o = options_for(t, 0);
  native([&] { padmoe::copy(src, dst, o); });
  for (int64_t i = 0; i < count; ++i) {
    if (wide) {
      int64_t v;
      std::memcpy(&v, bytes.data() + i * 8, 8);
      out[i] = v;
    } else {
      int32_t v;
      std::memcpy(&v, bytes.data() + i * 4, 4);
      out[i] = v;
    }
  }
  return out;
}

// P = padded_bins[-1] on the host (CUDA: one synchronization, as MegaBlocks does).
int64_t host_last(const Tensor& t, const char* op, const char* arg) {
  if (t.dim() != 1 || t.numel() == 0) return 0;
  if (t.scalar_type() != at::kInt && t.scalar_type() != at::kLong) return 0;  // padmoe reports the dtype
  return std::max<int64_t>(host_values(t, t.numel() - 1, 1)[0], 0);
}

// Rows of an output sized from data (P of the drop-ins): within int32, checked before allocating.
void check_rows_fit(const char* op, const char* arg, int64_t rows) {
  if (rows > std::numeric_limits<int32_t>::max()) {
    value_error(op, arg, "size overflow: " + std::to_string(rows) + " padded rows do not fit the int32 index outputs");
  }
}

// --- float64 formulas (exact; for gradcheck) ---------------------------------------

bool is_f64(const Tensor& t) { return t.scalar_type() == at::kDouble; }

// float64 rows get padmoe's checks too: the op runs on float32 stand-ins of the same shape with
// no columns (nothing read or written, every index check made), then the float64 formula runs.
// Outputs whose rows the data sizes, from this many bytes up, are allocated only after the op's
// checks passed (below it the op's checks raise the same error after a small allocation).
constexpr int64_t kCheckBeforeBytes = int64_t{1} << 28;

TensorView shadow(const Tensor& t, int64_t rows = -1) {
  TensorView v;
  v.data = nullptr;
  v.dtype = DType::kFloat32;
  v.ndim = static_cast<int>(std::min<int64_t>(t.dim(), padmoe::kMaxDims));
  for (int d = 0; d < v.ndim; ++d) v.shape[d] = t.size(d);
  if (v.ndim == 2) {
    if (rows >= 0) v.shape[0] = rows;
    v.shape[1] = 0;
    v.strides[0] = 0;
    v.strides[1] = 1;
  }
  if (t.is_cuda()) v.device = padmoe::Device::cuda(t.get_device());
  return v;
}
TensorView shadow_rows(int64_t rows, const Tensor& like) { return shadow(like.dim() == 2 ? like : like.reshape({-1, 1}), rows); }

Tensor w64(const OptTensor& w, int64_t n, const Tensor& like) {
  if (!w || !w->defined()) return at::ones({n}, like.options());
  return w->reshape({-1}).to(like.scalar_type());
}

// y[rows, H]: y[dest[a]] = x[a / K] * w[a]; other rows zero (dest < 0: dropped).
Tensor spread64(const Tensor& x, const Tensor& dest, int64_t k, const OptTensor& w, int64_t rows) {
  const int64_t a = dest.numel();
  Tensor src = x.repeat_interleave(k, 0) * w64(w, a, x).unsqueeze(1);
  Tensor y = at::zeros({rows, x.size(1)}, x.options());
  Tensor keep = dest.ge(0);
  y.index_put_({dest.masked_select(keep).to(at::kLong)}, src.index({keep}));
  return y;
}

// out[t] = sum_k w[t*K+k] * y[dest[t*K+k]] (dest < 0 contributes zero).
Tensor reduce64(const Tensor& y, const Tensor& dest, int64_t k, const OptTensor& w) {
  const int64_t a = dest.numel();
  Tensor keep = dest.ge(0).to(y.scalar_type()).unsqueeze(1);
  Tensor g = y.index_select(0, dest.clamp_min(0).to(at::kLong)) * keep * w64(w, a, y).unsqueeze(1);
  return g.view({a / k, k, y.size(1)}).sum(1);
}

// d[a] = <y[dest[a]], other[a / K]> (0 where dest < 0).
Tensor dots64(const Tensor& y, const Tensor& dest, int64_t k, const Tensor& other) {
  Tensor keep = dest.ge(0).to(y.scalar_type());
  Tensor g = y.index_select(0, dest.clamp_min(0).to(at::kLong));
  return (g * other.repeat_interleave(k, 0)).sum(-1) * keep;
}

// dest_rows from the sorted (MegaBlocks) form: dest[indices[i]] = padded_start(e) + i - real_start(e).
Tensor dest_of(const Tensor& indices, const Tensor& bin_ids, const Tensor& bins, const Tensor& padded_bins) {
  const int64_t a = indices.numel();
  Tensor e = bin_ids.to(at::kLong);
  Tensor zero = at::zeros({1}, bins.options().dtype(at::kLong));
  Tensor real_start = at::cat({zero, bins.to(at::kLong).narrow(0, 0, std::max<int64_t>(bins.numel() - 1, 0))});
  Tensor pad_start = at::cat({zero, padded_bins.to(at::kLong).narrow(0, 0, std::max<int64_t>(padded_bins.numel() - 1, 0))});
  Tensor rows = pad_start.index_select(0, e) + at::arange(a, e.options()) - real_start.index_select(0, e);
  Tensor dest = at::empty({a}, indices.options().dtype(at::kInt));
  dest.index_put_({indices.to(at::kLong)}, rows.to(at::kInt));
  return dest;
}

// --- the operators (CPU and CUDA kernels) ---------------------------------------

// make_plan's sizes before any allocation (in 64 bits, no product that can overflow): E and m
// >= 1 and within int32, A and capacity = A + E*(m-1) (capacity_bound) within the int32 outputs.
void check_plan_sizes(const char* op, int64_t t, int64_t k, int64_t num_experts, int64_t alignment) {
  if (num_experts < 1) value_error(op, "num_experts", "must be >= 1, got " + std::to_string(num_experts));
  if (alignment < 1) value_error(op, "alignment", "must be >= 1, got " + std::to_string(alignment));
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (num_experts > kMax) value_error(op, "num_experts", "size overflow: " + std::to_string(num_experts) + " does not fit int32");
  if (alignment > kMax) value_error(op, "alignment", "size overflow: " + std::to_string(alignment) + " does not fit int32");
  if (k >= 1 && t > kMax / k) {
    value_error(op, "top_experts", "size overflow: " + std::to_string(t) + " x " + std::to_string(k) +
                                       " assignments do not fit the int32 index outputs");
  }
  const int64_t a = std::max<int64_t>(t * k, 0);
  const int64_t cap = a + num_experts * (alignment - 1);  // capacity_bound, at most 2^31 * 2^31
  if (cap > kMax) {
    value_error(op, "capacity", "size overflow: " + std::to_string(cap) + " does not fit the int32 index outputs");
  }
}

// make_plan's CUDA scratch (workspace_bound bytes) from the caching allocator in one call (not
// through scratch_alloc); undefined on the CPU. use_workspace hands it to the op's Options.
Tensor plan_workspace(const Tensor& top, int64_t t, int64_t k, int64_t e, int64_t alignment) {
  if (!top.is_cuda()) return Tensor();
  size_t bytes = 0;
  native([&] {
    try {
      bytes = padmoe::workspace_bound(t, static_cast<int>(std::max<int64_t>(k, 1)), static_cast<int>(e),
                                      static_cast<int>(alignment));
    } catch (const padmoe::Error&) {
      bytes = 0;  // sizes the op rejects: it names them in its own words
    }
  });
  return bytes > 0 ? at::empty({static_cast<int64_t>(bytes)}, top.options().dtype(at::kByte)) : Tensor();
}
void use_workspace(padmoe::Options& o, const Tensor& workspace) {
  if (!workspace.defined()) return;
  o.workspace = workspace.data_ptr();
  o.workspace_bytes = static_cast<size_t>(workspace.numel());
}

Tensor make_plan_kernel(const Tensor& top_experts_in, int64_t num_experts, int64_t alignment, int64_t check,
                             const OptTensor& weights) {
  const char* op = "make_plan";
  if (top_experts_in.dim() != 2) value_error(op, "top_experts", "expected [T, K], got shape " + shape_of(top_experts_in));
  const int64_t t = top_experts_in.size(0), k = top_experts_in.size(1);
  if (weights && weights->defined()) {  // checked here, not first at combine after the expert GEMMs
    const Tensor& w = *weights;
    if (!at::isFloatingType(w.scalar_type()) || w.scalar_type() == at::kFloat8_e4m3fn ||
        w.scalar_type() == at::kFloat8_e5m2) {
      type_error(op, "weights", std::string("expected a float dtype, got ") + c10::toString(w.scalar_type()));
    }
    if (w.numel() != t * k) {
      value_error(op, "weights", "expected " + std::to_string(t * k) + " elements ([T, K] = [" + std::to_string(t) +
                                     ", " + std::to_string(k) + "]), got shape " + shape_of(w));
    }
    if (w.device() != top_experts_in.device()) {
      type_error(op, "weights", "expected a tensor on " + top_experts_in.device().str() + ", got one on " + w.device().str());
    }
  }
  Tensor top = index_arg(top_experts_in);
  check_plan_sizes(op, t, k, num_experts, alignment);
  const int64_t a = std::max<int64_t>(t * k, 0), e = num_experts;
  c10::OptionalDeviceGuard guard(top.device());
  Tensor out = at::empty({packed_length(a, e, alignment)}, top.options().dtype(at::kInt));
  const Tensor workspace = plan_workspace(top, t, k, e, alignment);
  // The eight arrays as views of `out` (k = 0 columns: padmoe's make_plan reports top_k itself).
  const padmoe::PlanView pv = packed_plan(out, std::max<int64_t>(k, 1), e, alignment, op).view(op);
  padmoe::Options o = options_for(top, check);
  use_workspace(o, workspace);
  native([&] { padmoe::make_plan_out(view(top, op, "top_experts"), static_cast<int>(num_experts), static_cast<int>(alignment), pv, o); });
  return out;
}

// make_plan with PlanOptions (expert parallelism, invalid ids, an expert capacity): the packed plan
// and the [1] int32 dropped count. With a capacity C the packed plan holds E*C row_sources and the
// row ops take alignment = -C for it (packed_plan above).
std::tuple<Tensor, Tensor> make_plan_routed_kernel(const Tensor& top_experts_in, int64_t num_experts, int64_t alignment,
                                                   const OptTensor& expert_map, int64_t first_expert,
                                                   int64_t global_experts, bool drop_invalid, int64_t expert_capacity,
                                                   bool by_probs, const OptTensor& probs, int64_t check) {
  const char* op = "make_plan";
  if (top_experts_in.dim() != 2) value_error(op, "top_experts", "expected [T, K], got shape " + shape_of(top_experts_in));
  const int64_t t = top_experts_in.size(0), k = top_experts_in.size(1);
  Tensor top = index_arg(top_experts_in);
  if (num_experts < 1) value_error(op, "num_experts", "must be >= 1, got " + std::to_string(num_experts));
  if (alignment < 1) value_error(op, "alignment", "must be >= 1, got " + std::to_string(alignment));
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (num_experts > kMax) value_error(op, "num_experts", "size overflow: " + std::to_string(num_experts) + " does not fit int32");
  if (alignment > kMax) value_error(op, "alignment", "size overflow: " + std::to_string(alignment) + " does not fit int32");
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"first_expert", first_expert}, {"global_experts", global_experts}}) {
    if (v < std::numeric_limits<int32_t>::min() || v > kMax) value_error(op, name, "does not fit int32: " + std::to_string(v));
  }
  if (k >= 1 && t > kMax / k) {
    value_error(op, "top_experts", "size overflow: " + std::to_string(t) + " x " + std::to_string(k) +
                                       " assignments do not fit the int32 index outputs");
  }
  if (expert_capacity < -1) value_error(op, "expert_capacity", "must be >= 0 (or None), got " + std::to_string(expert_capacity));
  const int64_t a = std::max<int64_t>(t * k, 0), e = num_experts;
  if (expert_capacity >= 0 && expert_capacity > kMax / e) {
    value_error(op, "expert_capacity", "size overflow: " + std::to_string(e) + " experts x capacity " +
                                           std::to_string(expert_capacity) + " rows do not fit the int32 index outputs");
  }
  const int64_t cap = expert_capacity >= 0 ? e * expert_capacity : a + e * (alignment - 1);
  if (cap > kMax) value_error(op, "capacity", "size overflow: " + std::to_string(cap) + " does not fit the int32 index outputs");
  c10::OptionalDeviceGuard guard(top.device());
  Tensor out = at::empty({3 * a + 4 * e + cap}, top.options().dtype(at::kInt));
  Tensor dropped = at::empty({1}, top.options().dtype(at::kInt));
  const Tensor workspace = plan_workspace(top, t, k, e, alignment);
  const padmoe::PlanView pv =
      packed_plan(out, std::max<int64_t>(k, 1), e, expert_capacity >= 0 ? -expert_capacity : alignment, op).view(op);
  padmoe::PlanView pvm = pv;
  pvm.alignment = static_cast<int>(alignment);
  padmoe::Options o = options_for(top, check);
  use_workspace(o, workspace);
  Tensor map = expert_map && expert_map->defined() ? index_arg(*expert_map) : Tensor();
  OptTensor pr;  // ranked as float32 (float64 router weights are rounded once)
  if (probs && probs->defined()) {
    pr = probs->scalar_type() == at::kDouble ? probs->to(at::kFloat) : probs->contiguous();
  }
  padmoe::PlanOptions po;
  if (map.defined()) po.expert_map = view(map, op, "expert_map");
  po.first_expert = static_cast<int>(first_expert);
  po.global_experts = static_cast<int>(global_experts);
  po.drop_invalid = drop_invalid;
  po.expert_capacity = expert_capacity;
  po.drop_policy = by_probs ? padmoe::DropPolicy::kProbs : padmoe::DropPolicy::kPosition;
  if (pr) po.probs = view(*pr, op, "probs");
  po.dropped = view(dropped, op, "dropped");
  native([&] {
    padmoe::make_plan_out(view(top, op, "top_experts"), static_cast<int>(num_experts), static_cast<int>(alignment), pvm,
                          padmoe::PlanLayouts{}, po, o);
  });
  return {out, dropped};
}

Tensor dispatch_kernel(const Tensor& x_in, const Tensor& plan, const OptTensor& weights, int64_t top_k,
                       int64_t num_experts, int64_t alignment, int64_t check, bool zero_padding) {
  const char* op = "dispatch";
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, op);
  if (is_f64(x_in)) {
    OptTensor w = scale_arg(weights);
    native([&] { padmoe::dispatch_out(shadow(x_in), pp.view(op), opt_view(w, op, "weights"), shadow_rows(pp.cap, x_in), options_for(x_in, check)); });
    return spread64(x_in, pp.dest_rows(), top_k, weights, pp.cap);
  }
  Tensor x = rows_arg(x_in);
  OptTensor w = scale_arg(weights);
  Tensor y = at::empty({pp.cap, x.dim() == 2 ? x.size(1) : 0}, x.options());
  c10::OptionalDeviceGuard guard(x.device());
  const padmoe::PlanView pv = pp.view(op);
  padmoe::Options o = options_for(x, check, /*zero_tail=*/zero_padding);
  o.zero_padding = zero_padding;  // false: padding rows (and the rows past P) left unwritten
  native([&] { padmoe::dispatch_out(view(x, op, "x"), pv, opt_view(w, op, "weights"), view(y, op, "y"), o); });
  return y;
}

// make_plan then dispatch in one call (padmoe::make_plan_and_dispatch_out: make_plan's launch then
// dispatch's): (y [capacity, H], the packed plan), make_plan's plan and dispatch's y bit for
// bit. Every check (make_plan's on top_experts, dispatch's on x and weights) runs before anything
// is written. CUDA scratch: one caching-allocator tensor of workspace_bound bytes, as make_plan's.
std::tuple<Tensor, Tensor> make_plan_and_dispatch_kernel(const Tensor& x_in, const Tensor& top_experts_in,
                                                         int64_t num_experts, int64_t alignment,
                                                         const OptTensor& weights, int64_t check, bool zero_padding) {
  const char* op = "make_plan_and_dispatch";
  if (top_experts_in.dim() != 2) value_error(op, "top_experts", "expected [T, K], got shape " + shape_of(top_experts_in));
  const int64_t t = top_experts_in.size(0), k = top_experts_in.size(1);
  check_plan_sizes(op, t, k, num_experts, alignment);
  const int64_t a = std::max<int64_t>(t * k, 0), e = num_experts;
  Tensor top = index_arg(top_experts_in);
  const bool f64 = is_f64(x_in);
  Tensor x = f64 ? x_in : rows_arg(x_in);
  OptTensor w = scale_arg(weights);
  c10::OptionalDeviceGuard guard(top.device());
  Tensor plan = at::empty({packed_length(a, e, alignment)}, top.options().dtype(at::kInt));
  const Tensor workspace = plan_workspace(top, t, k, e, alignment);
  // k = 0 columns: padmoe reports top_k itself
  const PackedPlan pp = packed_plan(plan, std::max<int64_t>(k, 1), e, alignment, op);
  const padmoe::PlanView pv = pp.view(op);
  // the views in the order padmoe checks them (top_experts, x, weights, y): the first bad one is reported
  const TensorView vt = view(top, op, "top_experts");
  const TensorView vx = f64 ? shadow(x) : view(x, op, "x");
  const std::optional<TensorView> vw = opt_view(w, op, "weights");
  Tensor y = f64 ? Tensor() : at::empty({pp.cap, x.dim() == 2 ? x.size(1) : 0}, x.options());
  const TensorView vy = f64 ? shadow_rows(pp.cap, x) : view(y, op, "y");
  padmoe::Options o = options_for(top, check, /*zero_tail=*/zero_padding || f64);
  o.zero_padding = zero_padding || f64;  // false: padding rows (and the rows past P) left unwritten
  use_workspace(o, workspace);
  native([&] {
    padmoe::make_plan_and_dispatch_out(vx, vt, static_cast<int>(num_experts), static_cast<int>(alignment), pv, vw, vy,
                                       o);
  });
  if (f64) y = spread64(x_in, pp.dest_rows(), pp.k, weights, pp.cap);
  return {y, plan};
}

Tensor combine_kernel(const Tensor& y_in, const Tensor& plan, const OptTensor& weights, int64_t top_k,
                      int64_t num_experts, int64_t alignment, int64_t check) {
  const char* op = "combine";
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, op);
  if (is_f64(y_in)) {
    OptTensor w = scale_arg(weights);
    native([&] { padmoe::combine_out(shadow(y_in), pp.view(op), opt_view(w, op, "weights"), shadow_rows(pp.tokens, y_in), options_for(y_in, check)); });
    return reduce64(y_in, pp.dest_rows(), top_k, weights);
  }
  Tensor y = rows_arg(y_in);
  OptTensor w = scale_arg(weights);
  Tensor out = at::empty({pp.tokens, y.dim() == 2 ? y.size(1) : 0}, y.options());
  c10::OptionalDeviceGuard guard(y.device());
  const padmoe::PlanView pv = pp.view(op);
  const padmoe::Options o = options_for(y, check);
  native([&] { padmoe::combine_out(view(y, op, "y"), pv, opt_view(w, op, "weights"), view(out, op, "out"), o); });
  return out;
}

// y (combine's input) is needed only for the weight gradient; without it
// (None) grad_y has `rows` rows (-1: the plan's capacity) of grad_out's dtype.
std::tuple<Tensor, Tensor> combine_backward_kernel(const Tensor& grad_out_in, const OptTensor& y_in, const Tensor& plan,
                                                   const OptTensor& weights, int64_t top_k, int64_t num_experts,
                                                   int64_t alignment, bool need_wgrad, int64_t check, int64_t rows) {
  const char* op = "combine_backward";
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, op);
  const bool have_y = y_in && y_in->defined();
  const bool want_w = need_wgrad && weights && weights->defined();
  if (want_w && !have_y) value_error(op, "y", "needed for the weight gradient");
  if (rows < 0) rows = have_y && y_in->dim() >= 1 ? y_in->size(0) : pp.cap;
  if (is_f64(grad_out_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::combine_backward_out(shadow(grad_out_in), have_y ? shadow(*y_in) : shadow_rows(rows, grad_out_in), pp.view(op),
                                   opt_view(w, op, "weights"), shadow_rows(rows, grad_out_in), TensorView{},
                                   options_for(grad_out_in, check));
    });
    Tensor gy = spread64(grad_out_in, pp.dest_rows(), top_k, weights, rows);
    Tensor gw = want_w ? dots64(*y_in, pp.dest_rows(), top_k, grad_out_in).to(weights->scalar_type())
                       : no_grad_placeholder(grad_out_in, weights);
    return {gy, gw};
  }
  Tensor grad_out = rows_arg(grad_out_in);
  OptTensor w = scale_arg(weights);
  const int64_t cols = grad_out.dim() == 2 ? grad_out.size(1) : 0;
  Tensor gy = at::empty({rows, cols}, have_y ? y_in->options() : grad_out.options());
  Tensor y = have_y ? rows_arg(*y_in) : gy;  // without the weight gradient y gives only its shape and dtype
  Tensor gw = want_w ? wgrad_buffer(*weights, pp.a) : Tensor();
  c10::OptionalDeviceGuard guard(grad_out.device());
  const padmoe::PlanView pv = pp.view(op);
  const padmoe::Options o = options_for(grad_out, check, /*zero_tail=*/true);
  native([&] {
    padmoe::combine_backward_out(view(grad_out, op, "grad_out"), view(y, op, "y"), pv, opt_view(w, op, "weights"),
                                 view(gy, op, "grad_y"), want_w ? view(gw, op, "grad_weights") : TensorView{}, o);
  });
  return {gy, want_w ? as_weights_dtype(gw, weights) : no_grad_placeholder(grad_out, weights)};
}

// x (dispatch's input) is needed only for the weight gradient; without it
// (None) grad_x is [T, H] of grad_y's dtype.
std::tuple<Tensor, Tensor> dispatch_backward_kernel(const Tensor& grad_y_in, const OptTensor& x_in, const Tensor& plan,
                                                    const OptTensor& weights, int64_t top_k, int64_t num_experts,
                                                    int64_t alignment, bool need_wgrad, int64_t check) {
  const char* op = "dispatch_backward";
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, op);
  const bool have_x = x_in && x_in->defined();
  const bool want_w = need_wgrad && weights && weights->defined();
  if (want_w && !have_x) value_error(op, "x", "needed for the weight gradient");
  if (is_f64(grad_y_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::dispatch_backward_out(shadow(grad_y_in), have_x ? shadow(*x_in) : shadow_rows(pp.tokens, grad_y_in),
                                    pp.view(op), opt_view(w, op, "weights"),
                                    have_x ? shadow(*x_in) : shadow_rows(pp.tokens, grad_y_in), TensorView{},
                                    options_for(grad_y_in, check));
    });
    Tensor gx = reduce64(grad_y_in, pp.dest_rows(), top_k, weights);
    Tensor gw = want_w ? dots64(grad_y_in, pp.dest_rows(), top_k, *x_in).to(weights->scalar_type())
                       : no_grad_placeholder(grad_y_in, weights);
    return {gx, gw};
  }
  Tensor grad_y = rows_arg(grad_y_in);
  OptTensor w = scale_arg(weights);
  Tensor gx = have_x ? at::empty(x_in->sizes(), x_in->options())
                     : at::empty({pp.tokens, grad_y.dim() == 2 ? grad_y.size(1) : 0}, grad_y.options());
  Tensor x = have_x ? rows_arg(*x_in) : gx;  // without the weight gradient x gives only its shape and dtype
  Tensor gw = want_w ? wgrad_buffer(*weights, pp.a) : Tensor();
  c10::OptionalDeviceGuard guard(grad_y.device());
  const padmoe::PlanView pv = pp.view(op);
  const padmoe::Options o = options_for(grad_y, check);
  native([&] {
    padmoe::dispatch_backward_out(view(grad_y, op, "grad_y"), view(x, op, "x"), pv, opt_view(w, op, "weights"),
                                  view(gx, op, "grad_x"), want_w ? view(gw, op, "grad_weights") : TensorView{}, o);
  });
  return {gx, want_w ? as_weights_dtype(gw, weights) : no_grad_placeholder(grad_y, weights)};
}

// MegaBlocks drop-ins --------------------------------------------------------------

Tensor padded_gather_kernel(const Tensor& x_in, const Tensor& indices_in, const Tensor& bin_ids_in,
                            const Tensor& bins_in, const Tensor& padded_bins_in, int64_t top_k,
                            const OptTensor& weights, int64_t check, bool zero_padding) {
  const char* op = "padded_gather";
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  const int64_t p = host_last(padded_bins, op, "padded_bins");
  check_rows_fit(op, "padded_bins", p);
  const bool f64 = is_f64(x_in);
  Tensor x = f64 ? x_in : rows_arg(x_in);
  OptTensor w = scale_arg(weights);
  c10::OptionalDeviceGuard guard(x.device());
  padmoe::Options o = options_for(x, check);
  o.zero_padding = zero_padding || f64;  // float64 rows are moved by torch below (padding zero)
  const int64_t cols = x.dim() == 2 ? x.size(1) : 0;
  if (!f64 && p * std::max<int64_t>(cols, 1) * static_cast<int64_t>(x.element_size()) >= kCheckBeforeBytes) {
    // P comes from the data: a large output only after the op's checks passed on column-less
    // stand-ins (a bad bins[0] beside padded_bins[-1] = 2^31 - 1 is the op's ValueError, not an
    // out-of-memory error); the op proper then skips the device validation
    native([&] {
      padmoe::padded_gather_out(shadow(x), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
                                view(bins, op, "bins"), view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
                                opt_view(w, op, "weights"), shadow_rows(p, x), o);
    });
    o.check_data = false;
  }
  Tensor y = f64 ? Tensor() : at::empty({p, cols}, x.options());
  native([&] {
    padmoe::padded_gather_out(f64 ? shadow(x) : view(x, op, "x"), view(indices, op, "indices"),
                              view(bin_ids, op, "bin_ids"), view(bins, op, "bins"),
                              view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
                              opt_view(w, op, "weights"), f64 ? shadow_rows(p, x) : view(y, op, "y"), o);
  });
  if (f64) return spread64(x_in, dest_of(indices, bin_ids, bins, padded_bins), top_k, weights, p);
  return y;
}

std::tuple<Tensor, Tensor> padded_gather_backward_kernel(const Tensor& grad_y_in, const Tensor& x_in,
                                                         const Tensor& indices_in, const Tensor& bin_ids_in,
                                                         const Tensor& bins_in, const Tensor& padded_bins_in,
                                                         int64_t top_k, const OptTensor& weights, bool need_wgrad,
                                                         int64_t check) {
  const char* op = "padded_gather_backward";
  const bool want_w = need_wgrad && weights && weights->defined();
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  if (is_f64(x_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::padded_gather_backward_out(shadow(grad_y_in), shadow(x_in), view(indices, op, "indices"),
                                         view(bin_ids, op, "bin_ids"), view(bins, op, "bins"),
                                         view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
                                         opt_view(w, op, "weights"), shadow(x_in), TensorView{}, options_for(x_in, check));
    });
    Tensor dest = dest_of(indices, bin_ids, bins, padded_bins);
    Tensor gx = reduce64(grad_y_in, dest, top_k, weights);
    Tensor gw = want_w ? dots64(grad_y_in, dest, top_k, x_in).to(weights->scalar_type()) : no_grad_placeholder(x_in, weights);
    return {gx, gw};
  }
  Tensor grad_y = rows_arg(grad_y_in), x = rows_arg(x_in);
  OptTensor w = scale_arg(weights);
  Tensor gx = at::empty(x.sizes(), x.options());
  Tensor gw = want_w ? wgrad_buffer(*weights, indices.numel()) : Tensor();
  c10::OptionalDeviceGuard guard(x.device());
  const padmoe::Options o = options_for(x, check);
  native([&] {
    padmoe::padded_gather_backward_out(view(grad_y, op, "grad_y"), view(x, op, "x"), view(indices, op, "indices"),
                                       view(bin_ids, op, "bin_ids"), view(bins, op, "bins"),
                                       view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
                                       opt_view(w, op, "weights"), view(gx, op, "grad_x"),
                                       want_w ? view(gw, op, "grad_weights") : TensorView{}, o);
  });
  return {gx, want_w ? as_weights_dtype(gw, weights) : no_grad_placeholder(x, weights)};
}

Tensor padded_scatter_kernel(const Tensor& y_in, const Tensor& indices_in, const Tensor& bin_ids_in,
                             const OptTensor& weights, const Tensor& bins_in, const Tensor& padded_bins_in,
                             int64_t top_k, int64_t check) {
  const char* op = "padded_scatter";
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  if (is_f64(y_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::padded_scatter_out(shadow(y_in), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
                                 opt_view(w, op, "weights"), view(bins, op, "bins"), view(padded_bins, op, "padded_bins"),
                                 static_cast<int>(top_k), shadow_rows(top_k >= 1 ? indices.numel() / top_k : 0, y_in),
                                 options_for(y_in, check));
    });
    return reduce64(y_in, dest_of(indices, bin_ids, bins, padded_bins), top_k, weights);
  }
  Tensor y = rows_arg(y_in);
  OptTensor w = scale_arg(weights);
  const int64_t tokens = top_k >= 1 ? indices.numel() / top_k : 0;
  Tensor out = at::empty({tokens, y.dim() == 2 ? y.size(1) : 0}, y.options());
  c10::OptionalDeviceGuard guard(y.device());
  const padmoe::Options o = options_for(y, check);
  native([&] {
    padmoe::padded_scatter_out(view(y, op, "y"), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
                               opt_view(w, op, "weights"), view(bins, op, "bins"),
                               view(padded_bins, op, "padded_bins"), static_cast<int>(top_k), view(out, op, "out"), o);
  });
  return out;
}

std::tuple<Tensor, Tensor> padded_scatter_backward_kernel(const Tensor& grad_out_in, const Tensor& y_in,
                                                          const Tensor& indices_in, const Tensor& bin_ids_in,
                                                          const OptTensor& weights, const Tensor& bins_in,
                                                          const Tensor& padded_bins_in, int64_t top_k,
                                                          bool need_wgrad, int64_t check) {
  const char* op = "padded_scatter_backward";
  const bool want_w = need_wgrad && weights && weights->defined();
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  if (is_f64(y_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::padded_scatter_backward_out(shadow(grad_out_in), shadow(y_in), view(indices, op, "indices"),
                                          view(bin_ids, op, "bin_ids"), opt_view(w, op, "weights"),
                                          view(bins, op, "bins"), view(padded_bins, op, "padded_bins"),
                                          static_cast<int>(top_k), shadow(y_in), TensorView{}, options_for(y_in, check));
    });
    Tensor dest = dest_of(indices, bin_ids, bins, padded_bins);
    Tensor gy = spread64(grad_out_in, dest, top_k, weights, y_in.size(0));
    Tensor gw = want_w ? dots64(y_in, dest, top_k, grad_out_in).to(weights->scalar_type()) : no_grad_placeholder(y_in, weights);
    return {gy, gw};
  }
  Tensor grad_out = rows_arg(grad_out_in), y = rows_arg(y_in);
  OptTensor w = scale_arg(weights);
  Tensor gy = at::empty(y.sizes(), y.options());
  Tensor gw = want_w ? wgrad_buffer(*weights, indices.numel()) : Tensor();
  c10::OptionalDeviceGuard guard(y.device());
  const padmoe::Options o = options_for(y, check, /*zero_tail=*/true);
  native([&] {
    padmoe::padded_scatter_backward_out(view(grad_out, op, "grad_out"), view(y, op, "y"), view(indices, op, "indices"),
                                        view(bin_ids, op, "bin_ids"), opt_view(w, op, "weights"), view(bins, op, "bins"),
                                        view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
                                        view(gy, op, "grad_y"), want_w ? view(gw, op, "grad_weights") : TensorView{}, o);
  });
  return {gy, want_w ? as_weights_dtype(gw, weights) : no_grad_placeholder(y, weights)};
}

Tensor padded_scatter_wgrad_kernel(const Tensor& y_in, const Tensor& grad_in, const Tensor& indices_in,
                                   const Tensor& bin_ids_in, const Tensor& bins_in, const Tensor& padded_bins_in,
                                   int64_t top_k, int64_t check) {
  const char* op = "padded_scatter_wgrad";
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  if (is_f64(y_in)) {
    native([&] {
      padmoe::padded_scatter_wgrad_out(shadow(y_in), shadow(grad_in), view(indices, op, "indices"),
                                       view(bin_ids, op, "bin_ids"), view(bins, op, "bins"),
                                       view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
                                       TensorView::contiguous(nullptr, DType::kFloat32, {indices.numel()}),
                                       options_for(y_in, check));
    });
    return dots64(y_in, dest_of(indices, bin_ids, bins, padded_bins), top_k, grad_in);
  }
  Tensor y = rows_arg(y_in), grad = rows_arg(grad_in);
  Tensor out = at::empty({indices.numel()}, y.options());
  c10::OptionalDeviceGuard guard(y.device());
  const padmoe::Options o = options_for(y, check);
  native([&] {
    padmoe::padded_scatter_wgrad_out(view(y, op, "y"), view(grad, op, "grad"), view(indices, op, "indices"),
                                     view(bin_ids, op, "bin_ids"), view(bins, op, "bins"),
                                     view(padded_bins, op, "padded_bins"), static_cast<int>(top_k),
                                     view(out, op, "wgrad"), o);
  });
  return out;
}

// vLLM's moe_align_block_size ---------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor> moe_align_kernel(const Tensor& ids_in, int64_t block_size, int64_t num_experts,
                                                    bool pad_sorted_ids, int64_t check, const OptTensor& map_in) {
  const char* op = "moe_align_block_size";
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (block_size < 1 || block_size > kMax) value_error(op, "block_size", "must be in [1, 2^31), got " + std::to_string(block_size));
  if (num_experts < 1 || num_experts > kMax) value_error(op, "num_experts", "must be in [1, 2^31), got " + std::to_string(num_experts));
  if (ids_in.dim() != 2) value_error(op, "topk_ids", "expected [T, K], got shape " + shape_of(ids_in));
  Tensor ids = index_arg(ids_in);
  const int64_t a = ids.numel();
  if (a > kMax) value_error(op, "topk_ids", "size overflow: " + std::to_string(a) + " assignments do not fit int32");
  const int64_t r = padmoe::aligned_rows_bound(a, static_cast<int>(num_experts), static_cast<int>(block_size), pad_sorted_ids);
  check_rows_fit(op, "sorted_token_ids", r);
  const auto int32 = ids.options().dtype(at::kInt);
  Tensor sorted = at::empty({r}, int32);
  Tensor experts = at::empty({(r + block_size - 1) / block_size}, int32);
  Tensor post = at::empty({1}, int32);
  c10::OptionalDeviceGuard guard(ids.device());
  const padmoe::Options o = options_for(ids, check);
  // vLLM's ignore_invalid_experts=True: assignments of experts mapped to -1 get no entry
  Tensor map;
  if (map_in && map_in->defined()) map = index_arg(*map_in);
  native([&] {
    padmoe::moe_align_block_size_out(view(ids, op, "topk_ids"), static_cast<int>(block_size), static_cast<int>(num_experts),
                                     map.defined() ? view(map, op, "expert_map") : padmoe::TensorView{},
                                     view(sorted, op, "sorted_token_ids"), view(experts, op, "expert_ids"),
                                     view(post, op, "num_tokens_post_padded"), o);
  });
  return {sorted, experts, post};
}

// Megatron drop-ins ------------------------------------------------------------------

// P from padmoe's host read of the counts (CUDA: one synchronization), after the checks the op
// makes before it allocates, in its words: counts from bad data must not size the outputs (a count
// of 2^31 - 1 once asked for a 137 GB tensor before the op's own check). float64 rows: their
// float32 stand-in of no columns (shadow).
int64_t pad_rows(const char* op, const Tensor& h, const Tensor& tpe, int64_t alignment, int64_t check) {
  int64_t p = 0;
  native([&] {
    p = padmoe::pad_to_alignment_rows(is_f64(h) ? shadow(h) : view(h, op, "hidden_states"),
                                      view(tpe, op, "tokens_per_expert"), static_cast<int>(alignment),
                                      options_for(h, check));
  });
  return p;
}

std::tuple<Tensor, Tensor, Tensor> pad_kernel(const Tensor& h_in, const Tensor& tpe_in, int64_t alignment,
                                              int64_t check, bool zero_padding) {
  const char* op = "pad_to_alignment";
  Tensor tpe = index_arg(tpe_in);
  Tensor h = is_f64(h_in) ? h_in : rows_arg(h_in);
  const int64_t p = pad_rows(op, h, tpe, alignment, check);
  const int64_t e = tpe.dim() == 1 ? tpe.numel() : 0;
  Tensor map = at::empty({p}, h.options().dtype(at::kInt));
  Tensor offs = at::empty({e}, h.options().dtype(at::kInt));
  if (is_f64(h)) {  // the map and offsets from padmoe on float32 rows of no columns, then an exact move
    Tensor none = at::empty({h.size(0), 0}, h.options().dtype(at::kFloat));
    Tensor pn = at::empty({p, 0}, none.options());
    c10::OptionalDeviceGuard guard(h.device());
    const padmoe::Options o = options_for(h, check);
    native([&] {
      padmoe::pad_to_alignment_out(view(none, op, "hidden_states"), view(tpe, op, "tokens_per_expert"),
                                   static_cast<int>(alignment), view(pn, op, "padded"), view(map, op, "permutation_map"),
                                   view(offs, op, "inclusive_offsets"), o);
    });
    Tensor keep = map.ge(0).to(h.scalar_type()).unsqueeze(1);
    Tensor padded = h.index_select(0, map.clamp_min(0).to(at::kLong)) * keep;
    return {padded, map, offs};
  }
  Tensor padded = at::empty({p, h.dim() == 2 ? h.size(1) : 0}, h.options());
  c10::OptionalDeviceGuard guard(h.device());
  padmoe::Options o = options_for(h, check);
  o.zero_padding = zero_padding;
  native([&] {
    padmoe::pad_to_alignment_out(view(h, op, "hidden_states"), view(tpe, op, "tokens_per_expert"),
                                 static_cast<int>(alignment), view(padded, op, "padded"),
                                 view(map, op, "permutation_map"), view(offs, op, "inclusive_offsets"), o);
  });
  return {padded, map, offs};
}

Tensor unpad_kernel(const Tensor& padded_in, const Tensor& map_in, int64_t original_size, const OptTensor& probs,
                    int64_t check) {
  const char* op = "unpad_from_alignment";
  if (original_size < 0) value_error(op, "original_size", "must be >= 0, got " + std::to_string(original_size));
  Tensor map = index_arg(map_in);
  if (is_f64(padded_in)) {
    OptTensor pr = scale_arg(probs);
    native([&] {
      padmoe::unpad_from_alignment_out(shadow(padded_in), view(map, op, "permutation_map"), opt_view(pr, op, "probs"),
                                       shadow_rows(original_size, padded_in), options_for(padded_in, check));
    });
    Tensor out = at::zeros({original_size, padded_in.size(1)}, padded_in.options());
    Tensor src = at::nonzero(map.ge(0)).squeeze(1);
    Tensor dst = map.to(at::kLong).index_select(0, src);
    Tensor rows = padded_in.index_select(0, src);
    if (probs && probs->defined()) rows = rows * probs->reshape({-1}).to(rows.scalar_type()).index_select(0, dst).unsqueeze(1);
    out.index_put_({dst}, rows);
    return out;
  }
  Tensor padded = rows_arg(padded_in);
  OptTensor pr = scale_arg(probs);
  Tensor out = at::empty({original_size, padded.dim() == 2 ? padded.size(1) : 0}, padded.options());
  c10::OptionalDeviceGuard guard(padded.device());
  const padmoe::Options o = options_for(padded, check);
  native([&] {
    padmoe::unpad_from_alignment_out(view(padded, op, "padded"), view(map, op, "permutation_map"),
                                     opt_view(pr, op, "probs"), view(out, op, "out"), o);
  });
  return out;
}

std::tuple<Tensor, Tensor> unpad_backward_kernel(const Tensor& grad_out_in, const Tensor& padded_in,
                                                 const Tensor& map_in, const OptTensor& probs, bool need_pgrad,
                                                 int64_t check) {
  const char* op = "unpad_from_alignment_backward";
  const bool want_p = need_pgrad && probs && probs->defined();
  Tensor map = index_arg(map_in);
  const int64_t n = grad_out_in.dim() >= 1 ? grad_out_in.size(0) : 0;
  if (is_f64(padded_in)) {
    OptTensor pr = scale_arg(probs);
    native([&] {
      padmoe::unpad_from_alignment_backward_out(shadow(grad_out_in), shadow(padded_in), view(map, op, "permutation_map"),
                                                opt_view(pr, op, "probs"), shadow(padded_in), TensorView{},
                                                options_for(padded_in, check));
    });
    Tensor src = at::nonzero(map.ge(0)).squeeze(1);
    Tensor dst = map.to(at::kLong).index_select(0, src);
    Tensor g = grad_out_in.index_select(0, dst);
    Tensor gp = at::zeros_like(padded_in);
    if (probs && probs->defined()) {
      gp.index_put_({src}, g * probs->reshape({-1}).to(g.scalar_type()).index_select(0, dst).unsqueeze(1));
    } else {
      gp.index_put_({src}, g);
    }
    if (!want_p) return {gp, no_grad_placeholder(padded_in, probs)};
    Tensor gpr = at::zeros({n}, g.options());
    gpr.index_put_({dst}, (padded_in.index_select(0, src) * g).sum(-1));
    return {gp, gpr.to(probs->scalar_type())};
  }
  Tensor grad_out = rows_arg(grad_out_in), padded = rows_arg(padded_in);
  OptTensor pr = scale_arg(probs);
  Tensor gp = at::empty(padded.sizes(), padded.options());
  Tensor gpr = want_p ? wgrad_buffer(*probs, n) : Tensor();
  c10::OptionalDeviceGuard guard(padded.device());
  const padmoe::Options o = options_for(padded, check);
  native([&] {
    padmoe::unpad_from_alignment_backward_out(view(grad_out, op, "grad_out"), view(padded, op, "padded"),
                                              view(map, op, "permutation_map"), opt_view(pr, op, "probs"),
                                              view(gp, op, "grad_padded"),
                                              want_p ? view(gpr, op, "grad_probs") : TensorView{}, o);
  });
  return {gp, want_p ? as_weights_dtype(gpr, probs) : no_grad_placeholder(padded, probs)};
}

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
int64_t backward_check(int64_t check) { return check == 0 ? 0 : 2; }

bool wants_grad(const OptTensor& t) { return t && t->defined() && t->requires_grad(); }
OptTensor optional_of(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// Does this call record a graph node? (grad mode on and a differentiable input that needs it)
bool recording(const Tensor& rows, const OptTensor& scale) {
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

Tensor shaped_as(const Tensor& g, c10::IntArrayRef shape) { return g.sizes() == shape ? g : g.view(shape); }

// Static path: dispatch / combine on a plan. Edges: (rows, weights).
struct PlanOpBackward : Node {
  bool is_combine = false;
  Tensor plan;  // the packed int32 plan of make_plan: never differentiable
  Saved rows;   // dispatch's x / combine's y, saved only for the weight gradient
  Saved weights;
  std::vector<int64_t> weight_shape;
  int64_t top_k = 1, num_experts = 1, alignment = 1, check = 0, row_count = 0;
  bool need_w = false;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(2);
    Tensor r = rows.get(), w = weights.get();
    Tensor g_rows, g_w;
    if (is_combine) {
      static auto op = handle<decltype(combine_backward_kernel)>("padmoe::combine_backward");
      std::tie(g_rows, g_w) = op.call(grads[0], optional_of(r), plan, optional_of(w), top_k, num_experts, alignment,
                                      need_w, check, row_count);
    } else {
      static auto op = handle<decltype(dispatch_backward_kernel)>("padmoe::dispatch_backward");
      std::tie(g_rows, g_w) = op.call(grads[0], optional_of(r), plan, optional_of(w), top_k, num_experts, alignment,
                                      need_w, check);
    }
    return {g_rows, need_w ? shaped_as(g_w, weight_shape) : Tensor()};
  }
  void release_variables() override {
    rows.release();
    weights.release();
    plan = Tensor();
  }
  std::string name() const override { return is_combine ? "padmoe::CombineBackward" : "padmoe::DispatchBackward"; }
};

// Attaches the PlanOpBackward node of dispatch / combine on `plan` to their output `out`.
void record_plan_op(bool is_combine, const Tensor& out, const Tensor& rows, const Tensor& plan,
                    const OptTensor& weights, int64_t top_k, int64_t num_experts, int64_t alignment, int64_t check) {
  NodePtr node = new_node<PlanOpBackward>();
  auto* n = static_cast<PlanOpBackward*>(node.get());
  n->set_next_edges(torch::autograd::collect_next_edges(rows, weights));
  n->is_combine = is_combine;
  n->plan = plan;
  n->need_w = wants_grad(weights);
  if (n->need_w) {
    n->rows.save(rows);
    n->weight_shape = weights->sizes().vec();
  }
  if (weights) n->weights.save(*weights);
  n->top_k = top_k;
  n->num_experts = num_experts;
  n->alignment = alignment;
  n->check = backward_check(check);
  n->row_count = rows.dim() >= 1 ? rows.size(0) : 0;
  torch::autograd::set_history(out, node);
}

Tensor plan_op_autograd(bool is_combine, const Tensor& rows, const Tensor& plan, const OptTensor& weights,
                        int64_t top_k, int64_t num_experts, int64_t alignment, int64_t check,
                        bool zero_padding = true) {
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    if (is_combine) {
      static auto op = handle<decltype(combine_kernel)>("padmoe::combine");
      out = op.call(rows, plan, weights, top_k, num_experts, alignment, check);
    } else {
      static auto op = handle<decltype(dispatch_kernel)>("padmoe::dispatch");
      out = op.call(rows, plan, weights, top_k, num_experts, alignment, check, zero_padding);
    }
  }
  if (recording(rows, weights)) record_plan_op(is_combine, out, rows, plan, weights, top_k, num_experts, alignment, check);
  return out;
}

Tensor dispatch_autograd(const Tensor& x, const Tensor& plan, const OptTensor& weights, int64_t top_k,
                         int64_t num_experts, int64_t alignment, int64_t check, bool zero_padding) {
  return plan_op_autograd(false, x, plan, weights, top_k, num_experts, alignment, check, zero_padding);
}
Tensor combine_autograd(const Tensor& y, const Tensor& plan, const OptTensor& weights, int64_t top_k,
                        int64_t num_experts, int64_t alignment, int64_t check) {
  return plan_op_autograd(true, y, plan, weights, top_k, num_experts, alignment, check);
}

// make_plan_and_dispatch: y differentiable wrt x and weights exactly as dispatch's (the same node:
// its backward is dispatch_backward on the returned plan); the plan output never is.
std::tuple<Tensor, Tensor> make_plan_and_dispatch_autograd(const Tensor& x, const Tensor& top_experts,
                                                           int64_t num_experts, int64_t alignment,
                                                           const OptTensor& weights, int64_t check, bool zero_padding) {
  std::tuple<Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(make_plan_and_dispatch_kernel)>("padmoe::make_plan_and_dispatch");
    out = op.call(x, top_experts, num_experts, alignment, weights, check, zero_padding);
  }
  if (recording(x, weights)) {
    record_plan_op(false, std::get<0>(out), x, std::get<1>(out), weights, top_experts.size(1), num_experts, alignment,
                   check);
  }
  return out;
}

// MegaBlocks drop-ins: padded_gather (x, ..., weights) and padded_scatter (y, ..., weights). Edges: (rows, weights).
struct SortedOpBackward : Node {
  bool is_scatter = false;
  Saved rows, weights;
  Tensor indices, bin_ids, bins, padded_bins;
  std::vector<int64_t> weight_shape;
  int64_t top_k = 1, check = 0;
  bool need_w = false;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(2);
    Tensor r = rows.get(), w = weights.get();
    Tensor g_rows, g_w;
    if (is_scatter) {
      static auto op = handle<decltype(padded_scatter_backward_kernel)>("padmoe::padded_scatter_backward");
      std::tie(g_rows, g_w) = op.call(grads[0], r, indices, bin_ids, optional_of(w), bins, padded_bins, top_k, need_w,
                                      check);
    } else {
      static auto op = handle<decltype(padded_gather_backward_kernel)>("padmoe::padded_gather_backward");
      std::tie(g_rows, g_w) = op.call(grads[0], r, indices, bin_ids, bins, padded_bins, top_k, optional_of(w), need_w,
                                      check);
    }
    return {g_rows, need_w ? shaped_as(g_w, weight_shape) : Tensor()};
  }
  void release_variables() override {
    rows.release();
    weights.release();
  }
  std::string name() const override {
    return is_scatter ? "padmoe::PaddedScatterBackward" : "padmoe::PaddedGatherBackward";
  }
};

void attach_sorted(bool is_scatter, const Tensor& out, const Tensor& rows, const Tensor& indices,
                   const Tensor& bin_ids, const Tensor& bins, const Tensor& padded_bins, const OptTensor& weights,
                   int64_t top_k, int64_t check) {
  NodePtr node = new_node<SortedOpBackward>();
  auto* n = static_cast<SortedOpBackward*>(node.get());
  n->set_next_edges(torch::autograd::collect_next_edges(rows, weights));
  n->is_scatter = is_scatter;
  n->rows.save(rows);
  if (weights) n->weights.save(*weights);
  n->indices = indices;
  n->bin_ids = bin_ids;
  n->bins = bins;
  n->padded_bins = padded_bins;
  n->need_w = wants_grad(weights);
  if (n->need_w) n->weight_shape = weights->sizes().vec();
  n->top_k = top_k;
  n->check = backward_check(check);
  torch::autograd::set_history(out, node);
}

Tensor padded_gather_autograd(const Tensor& x, const Tensor& indices, const Tensor& bin_ids, const Tensor& bins,
                              const Tensor& padded_bins, int64_t top_k, const OptTensor& weights, int64_t check,
                              bool zero_padding) {
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(padded_gather_kernel)>("padmoe::padded_gather");
    out = op.call(x, indices, bin_ids, bins, padded_bins, top_k, weights, check, zero_padding);
  }
  if (recording(x, weights)) attach_sorted(false, out, x, indices, bin_ids, bins, padded_bins, weights, top_k, check);
  return out;
}
Tensor padded_scatter_autograd(const Tensor& y, const Tensor& indices, const Tensor& bin_ids, const OptTensor& weights,
                               const Tensor& bins, const Tensor& padded_bins, int64_t top_k, int64_t check) {
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(padded_scatter_kernel)>("padmoe::padded_scatter");
    out = op.call(y, indices, bin_ids, weights, bins, padded_bins, top_k, check);
  }
  if (recording(y, weights)) attach_sorted(true, out, y, indices, bin_ids, bins, padded_bins, weights, top_k, check);
  return out;
}

// Megatron drop-ins. pad: edge (hidden_states); its backward is unpad of the gradient.
struct PadBackward : Node {
  Tensor permutation_map;
  int64_t rows = 0, check = 0;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(1);
    static auto op = handle<decltype(unpad_kernel)>("padmoe::unpad_from_alignment");
    return {op.call(grads[0], permutation_map, rows, std::nullopt, check)};
  }
  void release_variables() override { permutation_map = Tensor(); }
  std::string name() const override { return "padmoe::PadToAlignmentBackward"; }
};

std::tuple<Tensor, Tensor, Tensor> pad_autograd(const Tensor& h, const Tensor& tpe, int64_t alignment, int64_t check,
                                                bool zero_padding) {
  std::tuple<Tensor, Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(pad_kernel)>("padmoe::pad_to_alignment");
    out = op.call(h, tpe, alignment, check, zero_padding);
  }
  if (recording(h, std::nullopt)) {
    NodePtr node = new_node<PadBackward>();
    auto* n = static_cast<PadBackward*>(node.get());
    n->set_next_edges(torch::autograd::collect_next_edges(h));
    n->permutation_map = std::get<1>(out);
    n->rows = h.dim() >= 1 ? h.size(0) : 0;
    n->check = backward_check(check);
    torch::autograd::set_history(std::get<0>(out), node);  // the map and offsets are integers: no history
  }
  return out;
}

// unpad: edges (padded_output, probs).
struct UnpadBackward : Node {
  Saved padded, probs;
  Tensor permutation_map;
  std::vector<int64_t> probs_shape;
  int64_t check = 0;
  bool need_p = false;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(2);
    static auto op = handle<decltype(unpad_backward_kernel)>("padmoe::unpad_from_alignment_backward");
    Tensor p = padded.get(), pr = probs.get();
    auto [gp, gpr] = op.call(grads[0], p, permutation_map, optional_of(pr), need_p, check);
    return {gp, need_p ? shaped_as(gpr, probs_shape) : Tensor()};
  }
  void release_variables() override {
    padded.release();
    probs.release();
    permutation_map = Tensor();
  }
  std::string name() const override { return "padmoe::UnpadFromAlignmentBackward"; }
};

Tensor unpad_autograd(const Tensor& padded, const Tensor& map, int64_t original_size, const OptTensor& probs,
                      int64_t check) {
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(unpad_kernel)>("padmoe::unpad_from_alignment");
    out = op.call(padded, map, original_size, probs, check);
  }
  if (recording(padded, probs)) {
    NodePtr node = new_node<UnpadBackward>();
    auto* n = static_cast<UnpadBackward*>(node.get());
    n->set_next_edges(torch::autograd::collect_next_edges(padded, probs));
    n->padded.save(padded);
    if (probs) n->probs.save(*probs);
    n->permutation_map = map;
    n->need_p = wants_grad(probs);
    if (n->need_p) n->probs_shape = probs->sizes().vec();
    n->check = backward_check(check);
    torch::autograd::set_history(out, node);
  }
  return out;
}

// Expert-parallel chunk sort (ops.hpp section 5) ------------------------------------------
//
// sort_chunks(received, split_sizes, num_ranks, alignment, sorted_index, check, zero_padding, rows):
// rows < 0 allocates exactly P rows (read on the host: one synchronization on CUDA, like the
// Megatron drop-ins); rows >= 0 allocates that many (>= P, e.g. sort_chunks_capacity) with the rows
// past P zeroed (zero_tail): static shapes, no synchronization with check=0. Its backward is
// unpad_from_alignment(grad, permutation_map, N) (the unsort), the inverse move.

std::tuple<Tensor, Tensor, Tensor> sort_chunks_kernel(const Tensor& received_in, const Tensor& sizes_in,
                                                      int64_t num_ranks, int64_t alignment,
                                                      const OptTensor& sorted_in, int64_t check, bool zero_padding,
                                                      int64_t rows) {
  const char* op = "sort_chunks";
  Tensor sizes = index_arg(sizes_in);
  OptTensor sorted = sorted_in && sorted_in->defined() ? OptTensor(index_arg(*sorted_in)) : std::nullopt;
  if (num_ranks < 1) value_error(op, "num_ranks", "must be >= 1, got " + std::to_string(num_ranks));
  Tensor h = is_f64(received_in) ? received_in : rows_arg(received_in);
  // P from padmoe's host read of the sizes (CUDA: one synchronization), after the checks the op
  // makes before it allocates: sizes from bad data must not size the outputs
  int64_t p = rows;
  if (rows >= 0) {
    check_rows_fit(op, "rows", rows);
  } else {
    native([&] {
      p = padmoe::sort_chunks_rows(is_f64(h) ? shadow(h) : view(h, op, "received"), view(sizes, op, "split_sizes"),
                                   static_cast<int>(num_ranks), static_cast<int>(alignment),
                                   opt_view(sorted, op, "sorted_index"), options_for(h, check));
    });
  }
  const int64_t e = sizes.numel() / num_ranks;
  Tensor map = at::empty({p}, h.options().dtype(at::kInt));
  Tensor offs = at::empty({e}, h.options().dtype(at::kInt));
  c10::OptionalDeviceGuard guard(h.device());
  padmoe::Options o = options_for(h, check, /*zero_tail=*/rows >= 0);
  if (is_f64(h)) {  // the map and offsets from padmoe on float32 rows of no columns, then an exact move
    Tensor none = at::empty({h.size(0), 0}, h.options().dtype(at::kFloat));
    Tensor pn = at::empty({p, 0}, none.options());
    native([&] {
      padmoe::sort_chunks_out(view(none, op, "received"), view(sizes, op, "split_sizes"), static_cast<int>(num_ranks),
                              static_cast<int>(alignment), opt_view(sorted, op, "sorted_index"), view(pn, op, "padded"),
                              view(map, op, "permutation_map"), view(offs, op, "inclusive_offsets"), o);
    });
    Tensor keep = map.ge(0).to(h.scalar_type()).unsqueeze(1);
    Tensor padded = h.index_select(0, map.clamp_min(0).to(at::kLong)) * keep;
    return {padded, map, offs};
  }
  Tensor padded = at::empty({p, h.dim() == 2 ? h.size(1) : 0}, h.options());
  o.zero_padding = zero_padding;
  native([&] {
    padmoe::sort_chunks_out(view(h, op, "received"), view(sizes, op, "split_sizes"), static_cast<int>(num_ranks),
                            static_cast<int>(alignment), opt_view(sorted, op, "sorted_index"), view(padded, op, "padded"),
                            view(map, op, "permutation_map"), view(offs, op, "inclusive_offsets"), o);
  });
  return {padded, map, offs};
}

// Edge (received); the backward is the unsort of the gradient (PadBackward's formula).
struct SortChunksBackward : PadBackward {
  std::string name() const override { return "padmoe::SortChunksBackward"; }
};

std::tuple<Tensor, Tensor, Tensor> sort_chunks_autograd(const Tensor& received, const Tensor& sizes, int64_t num_ranks,
                                                        int64_t alignment, const OptTensor& sorted, int64_t check,
                                                        bool zero_padding, int64_t rows) {
  std::tuple<Tensor, Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(sort_chunks_kernel)>("padmoe::sort_chunks");
    out = op.call(received, sizes, num_ranks, alignment, sorted, check, zero_padding, rows);
  }
  if (recording(received, std::nullopt)) {
    NodePtr node = new_node<SortChunksBackward>();
    auto* n = static_cast<SortChunksBackward*>(node.get());
    n->set_next_edges(torch::autograd::collect_next_edges(received));
    n->permutation_map = std::get<1>(out);
    n->rows = received.dim() >= 1 ? received.size(0) : 0;
    n->check = backward_check(check);
    torch::autograd::set_history(std::get<0>(out), node);
  }
  return out;
}

std::tuple<Tensor, Tensor> make_plan_routed_autograd(const Tensor& top_experts, int64_t num_experts, int64_t alignment,
                                                     const OptTensor& expert_map, int64_t first_expert,
                                                     int64_t global_experts, bool drop_invalid, int64_t expert_capacity,
                                                     bool by_probs, const OptTensor& probs, int64_t check) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(make_plan_routed_kernel)>("padmoe::make_plan_routed");
  return op.call(top_experts, num_experts, alignment, expert_map, first_expert, global_experts, drop_invalid,
                 expert_capacity, by_probs, probs, check);
}

// Integer outputs only: never differentiable.
Tensor make_plan_autograd(const Tensor& top_experts, int64_t num_experts, int64_t alignment, int64_t check,
                          const OptTensor& weights) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(make_plan_kernel)>("padmoe::make_plan");
  return op.call(top_experts, num_experts, alignment, check, weights);
}

}  // namespace

// --- registration ---------------------------------------------------------------------

TORCH_LIBRARY(padmoe, m) {
  m.def("make_plan(Tensor top_experts, int num_experts, int alignment, int check=2, Tensor? weights=None) -> Tensor");
  m.def("make_plan_routed(Tensor top_experts, int num_experts, int alignment, Tensor? expert_map, int first_expert, "
        "int global_experts, bool drop_invalid, int expert_capacity, bool by_probs, Tensor? probs, int check=2) "
        "-> (Tensor, Tensor)");
  m.def("dispatch(Tensor x, Tensor plan, Tensor? weights, int top_k, int num_experts, int alignment, int check=2, "
        "bool zero_padding=True) "
        "-> Tensor");
  m.def("dispatch_backward(Tensor grad_y, Tensor? x, Tensor plan, Tensor? weights, int top_k, int num_experts, "
        "int alignment, bool need_wgrad, int check=2) -> (Tensor, Tensor)");
  m.def("make_plan_and_dispatch(Tensor x, Tensor top_experts, int num_experts, int alignment, Tensor? weights=None, "
        "int check=2, bool zero_padding=True) -> (Tensor, Tensor)");
  m.def("combine(Tensor y, Tensor plan, Tensor? weights, int top_k, int num_experts, int alignment, int check=2) "
        "-> Tensor");
  m.def("combine_backward(Tensor grad_out, Tensor? y, Tensor plan, Tensor? weights, int top_k, int num_experts, "
        "int alignment, bool need_wgrad, int check=2, int rows=-1) -> (Tensor, Tensor)");
  m.def("padded_gather(Tensor x, Tensor indices, Tensor bin_ids, Tensor bins, Tensor padded_bins, int top_k, "
        "Tensor? weights=None, int check=2, bool zero_padding=True) -> Tensor");
  m.def("padded_gather_backward(Tensor grad_y, Tensor x, Tensor indices, Tensor bin_ids, Tensor bins, "
        "Tensor padded_bins, int top_k, Tensor? weights, bool need_wgrad, int check=2) -> (Tensor, Tensor)");
  m.def("padded_scatter(Tensor y, Tensor indices, Tensor bin_ids, Tensor? weights, Tensor bins, Tensor padded_bins, "
        "int top_k, int check=2) -> Tensor");
  m.def("padded_scatter_backward(Tensor grad_out, Tensor y, Tensor indices, Tensor bin_ids, Tensor? weights, "
        "Tensor bins, Tensor padded_bins, int top_k, bool need_wgrad, int check=2) -> (Tensor, Tensor)");
  m.def("padded_scatter_wgrad(Tensor y, Tensor grad, Tensor indices, Tensor bin_ids, Tensor bins, "
        "Tensor padded_bins, int top_k, int check=2) -> Tensor");
  m.def("pad_to_alignment(Tensor hidden_states, Tensor tokens_per_expert, int alignment, int check=2, "
        "bool zero_padding=True) -> (Tensor, Tensor, Tensor)");
  m.def("unpad_from_alignment(Tensor padded_output, Tensor permutation_map, int original_size, Tensor? probs=None, "
        "int check=2) -> Tensor");
  m.def("unpad_from_alignment_backward(Tensor grad_out, Tensor padded_output, Tensor permutation_map, Tensor? probs, "
        "bool need_pgrad, int check=2) -> (Tensor, Tensor)");
  m.def("moe_align_block_size(Tensor topk_ids, int block_size, int num_experts, bool pad_sorted_ids=False, "
        "int check=2, Tensor? expert_map=None) -> (Tensor, Tensor, Tensor)");
  m.def("sort_chunks(Tensor received, Tensor split_sizes, int num_ranks, int alignment, Tensor? sorted_index=None, "
        "int check=2, bool zero_padding=True, int rows=-1) -> (Tensor, Tensor, Tensor)");
}

#define PADMOE_TORCH_KERNELS(m)                                                   \
  m.impl("make_plan", make_plan_kernel);                                          \
  m.impl("make_plan_routed", make_plan_routed_kernel);                            \
  m.impl("dispatch", dispatch_kernel);                                            \
  m.impl("dispatch_backward", dispatch_backward_kernel);                          \
  m.impl("make_plan_and_dispatch", make_plan_and_dispatch_kernel);                \
  m.impl("combine", combine_kernel);                                              \
  m.impl("combine_backward", combine_backward_kernel);                            \
  m.impl("padded_gather", padded_gather_kernel);                                  \
  m.impl("padded_gather_backward", padded_gather_backward_kernel);                \
  m.impl("padded_scatter", padded_scatter_kernel);                                \
  m.impl("padded_scatter_backward", padded_scatter_backward_kernel);              \
  m.impl("padded_scatter_wgrad", padded_scatter_wgrad_kernel);                    \
  m.impl("pad_to_alignment", pad_kernel);                                         \
  m.impl("unpad_from_alignment", unpad_kernel);                                   \
  m.impl("unpad_from_alignment_backward", unpad_backward_kernel);                 \
  m.impl("moe_align_block_size", moe_align_kernel);                               \
  m.impl("sort_chunks", sort_chunks_kernel)

TORCH_LIBRARY_IMPL(padmoe, CPU, m) { PADMOE_TORCH_KERNELS(m); }
#ifdef PADMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(padmoe, CUDA, m) { PADMOE_TORCH_KERNELS(m); }
#endif

TORCH_LIBRARY_IMPL(padmoe, Autograd, m) {
  m.impl("make_plan", make_plan_autograd);
  m.impl("make_plan_routed", make_plan_routed_autograd);
  m.impl("dispatch", dispatch_autograd);
  m.impl("make_plan_and_dispatch", make_plan_and_dispatch_autograd);
  m.impl("combine", combine_autograd);
  m.impl("padded_gather", padded_gather_autograd);
  m.impl("padded_scatter", padded_scatter_autograd);
  m.impl("pad_to_alignment", pad_autograd);
  m.impl("unpad_from_alignment", unpad_autograd);
  m.impl("sort_chunks", sort_chunks_autograd);
}

// --- Python entry points ------------------------------------------------------------
//
// padmoe/_torch_ops.so is also the Python module padmoe._torch_ops. Its
// functions take the operators' arguments positionally and call the
// operators through the dispatcher, unboxed: every dispatch key (autograd,
// torch dispatch modes, tensor subclasses' __torch_dispatch__) applies as for
// torch.ops.padmoe.*, but the Python argument layer of torch.ops (schema
// matching, IValue boxing: about 1 µs an op) is skipped. Anything they do not
// take as it is (a tensor subclass, a torch function mode, a non-int, a wrong
// argument count) is passed to the OpOverload, torch.ops.padmoe.<op>.default,
// which padmoe.torch registers with _set_fallback, so the result is always
// what torch.ops would give.

namespace {

enum PyOp { kPyMakePlan, kPyDispatch, kPyCombine, kPyPaddedGather, kPyPaddedScatter, kPyPaddedScatterWgrad,
            kPyPad, kPyUnpad, kPyMakePlanAndDispatch, kPyOpCount };
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
constexpr const char* kPyOpNames[kPyOpCount] = {"make_plan", "dispatch", "combine", "padded_gather",
                                                "padded_scatter", "padded_scatter_wgrad", "pad_to_alignment",
                                                "unpad_from_alignment", "make_plan_and_dispatch"};

// One entry point per operator, made from the kernel's signature: the
// arguments positionally, each read as the kernel takes it (Tensor, optional
// Tensor, int), the operator called through the dispatcher with the GIL released.
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

#define PADMOE_PY_FN(name, fn) \
  { name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fn)), METH_FASTCALL, nullptr }

PyMethodDef g_methods[] = {
    PADMOE_PY_FN("make_plan", (PyEntry<kPyMakePlan, decltype(make_plan_kernel)>::call)),
    PADMOE_PY_FN("dispatch", (PyEntry<kPyDispatch, decltype(dispatch_kernel)>::call)),
    PADMOE_PY_FN("combine", (PyEntry<kPyCombine, decltype(combine_kernel)>::call)),
    PADMOE_PY_FN("padded_gather", (PyEntry<kPyPaddedGather, decltype(padded_gather_kernel)>::call)),
    PADMOE_PY_FN("padded_scatter", (PyEntry<kPyPaddedScatter, decltype(padded_scatter_kernel)>::call)),
    PADMOE_PY_FN("padded_scatter_wgrad",
                 (PyEntry<kPyPaddedScatterWgrad, decltype(padded_scatter_wgrad_kernel)>::call)),
    PADMOE_PY_FN("pad_to_alignment", (PyEntry<kPyPad, decltype(pad_kernel)>::call)),
    PADMOE_PY_FN("unpad_from_alignment", (PyEntry<kPyUnpad, decltype(unpad_kernel)>::call)),
    PADMOE_PY_FN("make_plan_and_dispatch",
                 (PyEntry<kPyMakePlanAndDispatch, decltype(make_plan_and_dispatch_kernel)>::call)),
    PADMOE_PY_FN("_set_fallback", py_set_fallback),
    {nullptr, nullptr, 0, nullptr},
};
#undef PADMOE_PY_FN

PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "_torch_ops",
                        "padmoe's native torch operators (torch.ops.padmoe.*) and their Python entry points", -1,
                        g_methods};

}  // namespace

// The fallback indices, in the order padmoe.torch registers them.
PyMODINIT_FUNC PyInit__torch_ops() {
  PyObject* m = PyModule_Create(&g_module);
  if (m == nullptr) return nullptr;
  PyObject* order = PyTuple_New(kPyOpCount);
  for (int i = 0; i < kPyOpCount; ++i) PyTuple_SET_ITEM(order, i, PyUnicode_FromString(kPyOpNames[i]));
  PyModule_AddObject(m, "FALLBACK_ORDER", order);
  return m;
}

// --- rows moved with their scales (ops.hpp section 4) -----------------------------------
//
// dispatch_scaled / padded_gather_scaled / pad_to_alignment_scaled / unpad_from_alignment_scaled:
// the move-only ops with a scale tensor moved alongside in the same pass (float32 per row or per
// 128 columns, MXFP8 E8M0 as uint8 or float8_e8m0fnu). Not differentiable: quantized rows and
// their scales carry no gradient (an input that requires one is a clear error, not a silent
// detach). Registered in their own fragment; padmoe.torch calls the OpOverloads.

namespace {

bool is_e8m0(const Tensor& t) { return std::strcmp(c10::toString(t.scalar_type()), "Float8_e8m0fnu") == 0; }

// A scale tensor as padmoe takes it: float8_e8m0fnu as its uint8 bytes (same memory).
TensorView scales_view(const Tensor& t, const char* op, const char* arg) {
  return view(is_e8m0(t) ? t.view(at::kByte) : t, op, arg);
}

// Scale inputs: any stride (one copy when not contiguous; padmoe wants them row-major).
Tensor scales_arg(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// Output scales shaped like `s` (its dims after the first) with `rows` rows.
Tensor scales_like(const Tensor& s, int64_t rows) {
  std::vector<int64_t> sizes = s.sizes().vec();
  if (sizes.empty()) sizes.push_back(rows);
  else sizes[0] = rows;
  return at::empty(sizes, s.options());
}

std::tuple<Tensor, Tensor> dispatch_scaled_kernel(const Tensor& x_in, const Tensor& plan, const Tensor& x_scales,
                                                  int64_t top_k, int64_t num_experts, int64_t alignment,
                                                  int64_t check, bool zero_padding) {
  const char* op = "dispatch";
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, op);
  Tensor x = rows_arg(x_in), xs = scales_arg(x_scales);
  Tensor y = at::empty({pp.cap, x.dim() == 2 ? x.size(1) : 0}, x.options());
  Tensor ys = scales_like(xs, pp.cap);
  c10::OptionalDeviceGuard guard(x.device());
  const padmoe::PlanView pv = pp.view(op);
  padmoe::Options o = options_for(x, check, /*zero_tail=*/zero_padding);
  o.zero_padding = zero_padding;  // false: padding rows (and the rows past P) left unwritten
  native([&] {
    padmoe::dispatch_scaled_out(view(x, op, "x"), pv, scales_view(xs, op, "x_scales"), view(y, op, "y"),
                                scales_view(ys, op, "y_scales"), o);
  });
  return {y, ys};
}

std::tuple<Tensor, Tensor> padded_gather_scaled_kernel(const Tensor& x_in, const Tensor& indices_in,
                                                       const Tensor& bin_ids_in, const Tensor& bins_in,
                                                       const Tensor& padded_bins_in, int64_t top_k,
                                                       const Tensor& x_scales, int64_t check, bool zero_padding) {
  const char* op = "padded_gather";
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  const int64_t p = host_last(padded_bins, op, "padded_bins");
  check_rows_fit(op, "padded_bins", p);
  Tensor x = rows_arg(x_in), xs = scales_arg(x_scales);
  Tensor y = at::empty({p, x.dim() == 2 ? x.size(1) : 0}, x.options());
  Tensor ys = scales_like(xs, p);
  c10::OptionalDeviceGuard guard(x.device());
  padmoe::Options o = options_for(x, check);
  o.zero_padding = zero_padding;
  native([&] {
    padmoe::padded_gather_scaled_out(view(x, op, "x"), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
                                     view(bins, op, "bins"), view(padded_bins, op, "padded_bins"),
                                     static_cast<int>(top_k), scales_view(xs, op, "x_scales"), view(y, op, "y"),
                                     scales_view(ys, op, "y_scales"), o);
  });
  return {y, ys};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> pad_scaled_kernel(const Tensor& h_in, const Tensor& tpe_in,
                                                             int64_t alignment, const Tensor& h_scales,
                                                             int64_t check, bool zero_padding) {
  const char* op = "pad_to_alignment";
  Tensor tpe = index_arg(tpe_in);
  Tensor h = rows_arg(h_in), hs = scales_arg(h_scales);
  const int64_t p = pad_rows(op, h, tpe, alignment, check);
  const int64_t e = tpe.dim() == 1 ? tpe.numel() : 0;
  Tensor padded = at::empty({p, h.dim() == 2 ? h.size(1) : 0}, h.options());
  Tensor ps = scales_like(hs, p);
  Tensor map = at::empty({p}, h.options().dtype(at::kInt));
  Tensor offs = at::empty({e}, h.options().dtype(at::kInt));
  c10::OptionalDeviceGuard guard(h.device());
  padmoe::Options o = options_for(h, check);
  o.zero_padding = zero_padding;
  native([&] {
    padmoe::pad_to_alignment_scaled_out(view(h, op, "hidden_states"), view(tpe, op, "tokens_per_expert"),
                                        static_cast<int>(alignment), scales_view(hs, op, "hidden_scales"),
                                        view(padded, op, "padded"), scales_view(ps, op, "padded_scales"),
                                        view(map, op, "permutation_map"), view(offs, op, "inclusive_offsets"), o);
  });
  return {padded, ps, map, offs};
}

std::tuple<Tensor, Tensor> unpad_scaled_kernel(const Tensor& padded_in, const Tensor& map_in, int64_t original_size,
                                               const Tensor& padded_scales, int64_t check) {
  const char* op = "unpad_from_alignment";
  if (original_size < 0) value_error(op, "original_size", "must be >= 0, got " + std::to_string(original_size));
  Tensor map = index_arg(map_in);
  Tensor padded = rows_arg(padded_in), ps = scales_arg(padded_scales);
  Tensor out = at::empty({original_size, padded.dim() == 2 ? padded.size(1) : 0}, padded.options());
  Tensor os = scales_like(ps, original_size);
  c10::OptionalDeviceGuard guard(padded.device());
  const padmoe::Options o = options_for(padded, check);
  native([&] {
    padmoe::unpad_from_alignment_scaled_out(view(padded, op, "padded"), view(map, op, "permutation_map"),
                                            scales_view(ps, op, "padded_scales"), view(out, op, "out"),
                                            scales_view(os, op, "out_scales"), o);
  });
  return {out, os};
}

// Autograd key: no graph node; an input that needs a gradient is an error.
void no_grad_for_scaled(const char* op, const Tensor& rows, const Tensor& scales) {
  if (at::GradMode::is_enabled() && (rows.requires_grad() || scales.requires_grad())) {
    throw c10::NotImplementedError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                   std::string(op) + ": rows moved with their scales are not differentiable "
                                                     "(quantized rows carry no gradient); detach the inputs or "
                                                     "use the op without scales");
  }
}

std::tuple<Tensor, Tensor> dispatch_scaled_autograd(const Tensor& x, const Tensor& plan, const Tensor& x_scales,
                                                    int64_t top_k, int64_t num_experts, int64_t alignment,
                                                    int64_t check, bool zero_padding) {
  no_grad_for_scaled("dispatch", x, x_scales);
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(dispatch_scaled_kernel)>("padmoe::dispatch_scaled");
  return op.call(x, plan, x_scales, top_k, num_experts, alignment, check, zero_padding);
}
std::tuple<Tensor, Tensor> padded_gather_scaled_autograd(const Tensor& x, const Tensor& indices, const Tensor& bin_ids,
                                                         const Tensor& bins, const Tensor& padded_bins, int64_t top_k,
                                                         const Tensor& x_scales, int64_t check, bool zero_padding) {
  no_grad_for_scaled("padded_gather", x, x_scales);
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(padded_gather_scaled_kernel)>("padmoe::padded_gather_scaled");
  return op.call(x, indices, bin_ids, bins, padded_bins, top_k, x_scales, check, zero_padding);
}
std::tuple<Tensor, Tensor, Tensor, Tensor> pad_scaled_autograd(const Tensor& h, const Tensor& tpe, int64_t alignment,
                                                               const Tensor& h_scales, int64_t check,
                                                               bool zero_padding) {
  no_grad_for_scaled("pad_to_alignment", h, h_scales);
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(pad_scaled_kernel)>("padmoe::pad_to_alignment_scaled");
  return op.call(h, tpe, alignment, h_scales, check, zero_padding);
}
std::tuple<Tensor, Tensor> unpad_scaled_autograd(const Tensor& padded, const Tensor& map, int64_t original_size,
                                                 const Tensor& padded_scales, int64_t check) {
  no_grad_for_scaled("unpad_from_alignment", padded, padded_scales);
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(unpad_scaled_kernel)>("padmoe::unpad_from_alignment_scaled");
  return op.call(padded, map, original_size, padded_scales, check);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(padmoe, m) {
  m.def("dispatch_scaled(Tensor x, Tensor plan, Tensor x_scales, int top_k, int num_experts, int alignment, "
        "int check=2, bool zero_padding=True) -> (Tensor, Tensor)");
  m.def("padded_gather_scaled(Tensor x, Tensor indices, Tensor bin_ids, Tensor bins, Tensor padded_bins, int top_k, "
        "Tensor x_scales, int check=2, bool zero_padding=True) -> (Tensor, Tensor)");
  m.def("pad_to_alignment_scaled(Tensor hidden_states, Tensor tokens_per_expert, int alignment, "
        "Tensor hidden_scales, int check=2, bool zero_padding=True) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("unpad_from_alignment_scaled(Tensor padded_output, Tensor permutation_map, int original_size, "
        "Tensor padded_scales, int check=2) -> (Tensor, Tensor)");
}

#define PADMOE_TORCH_SCALED_KERNELS(m)                            \
  m.impl("dispatch_scaled", dispatch_scaled_kernel);              \
  m.impl("padded_gather_scaled", padded_gather_scaled_kernel);    \
  m.impl("pad_to_alignment_scaled", pad_scaled_kernel);           \
  m.impl("unpad_from_alignment_scaled", unpad_scaled_kernel)

TORCH_LIBRARY_IMPL(padmoe, CPU, m) { PADMOE_TORCH_SCALED_KERNELS(m); }
#ifdef PADMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(padmoe, CUDA, m) { PADMOE_TORCH_SCALED_KERNELS(m); }
#endif
TORCH_LIBRARY_IMPL(padmoe, Autograd, m) {
  m.impl("dispatch_scaled", dispatch_scaled_autograd);
  m.impl("padded_gather_scaled", padded_gather_scaled_autograd);
  m.impl("pad_to_alignment_scaled", pad_scaled_autograd);
  m.impl("unpad_from_alignment_scaled", unpad_scaled_autograd);
}
#undef PADMOE_TORCH_SCALED_KERNELS

// --- fused quantizing dispatch (ops.hpp section 4) ----------------------------------------
//
// dispatch_quantized: bfloat16 / float16 / float32 rows in, float8 rows (dtype) plus scales out
// (scale_layout "block128": float32 [cap, ceil(H/128)]; "mxfp8": uint8 E8M0 [cap, ceil(H/32)],
// view as torch.float8_e8m0fnu for the decoded 2^X; "row": float32 [cap]), capacity rows like
// dispatch_scaled (padding rows and rows past P: zero codes, scale 1, unless zero_padding=False).
// Not differentiable: an x that requires a gradient under grad mode is an error.

namespace {

padmoe::ScaleLayout quant_layout(const std::string& s, const char* op) {
  if (s == "block128") return padmoe::ScaleLayout::kBlock128;
  if (s == "mxfp8") return padmoe::ScaleLayout::kMxE8M0;
  if (s == "row") return padmoe::ScaleLayout::kPerRow;
  value_error(op, "scale_layout", "expected 'block128', 'mxfp8' or 'row', got '" + s + "'");
}

Tensor quant_scales_out(padmoe::ScaleLayout l, int64_t rows, int64_t hidden, const Tensor& like) {
  const int64_t cols = padmoe::scale_columns(l, hidden);
  if (l == padmoe::ScaleLayout::kPerRow) return at::empty({rows}, like.options().dtype(at::kFloat));
  if (l == padmoe::ScaleLayout::kMxE8M0) return at::empty({rows, cols}, like.options().dtype(at::kByte));
  return at::empty({rows, cols}, like.options().dtype(at::kFloat));
}

std::tuple<Tensor, Tensor> dispatch_quantized_kernel(const Tensor& x_in, const Tensor& plan, int64_t top_k,
                                                     int64_t num_experts, int64_t alignment,
                                                     c10::string_view scale_layout, at::ScalarType dtype,
                                                     int64_t check, bool zero_padding) {
  const char* op = "dispatch_quantized";
  const padmoe::ScaleLayout l = quant_layout(std::string(scale_layout), op);
  if (dtype != at::kFloat8_e4m3fn && dtype != at::kFloat8_e5m2) {
    type_error(op, "dtype", std::string("expected torch.float8_e4m3fn or torch.float8_e5m2, got ") + c10::toString(dtype));
  }
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, op);
  Tensor x = rows_arg(x_in);
  const int64_t hidden = x.dim() == 2 ? x.size(1) : 0;
  Tensor y = at::empty({pp.cap, hidden}, x.options().dtype(dtype));
  Tensor ys = quant_scales_out(l, pp.cap, hidden, x);
  c10::OptionalDeviceGuard guard(x.device());
  const padmoe::PlanView pv = pp.view(op);
  padmoe::Options o = options_for(x, check, /*zero_tail=*/zero_padding);
  o.zero_padding = zero_padding;
  native([&] { padmoe::dispatch_quantized_out(view(x, op, "x"), pv, view(y, op, "y"), view(ys, op, "y_scales"), o); });
  return {y, ys};
}

std::tuple<Tensor, Tensor> dispatch_quantized_autograd(const Tensor& x, const Tensor& plan, int64_t top_k,
                                                       int64_t num_experts, int64_t alignment,
                                                       c10::string_view scale_layout, at::ScalarType dtype,
                                                       int64_t check, bool zero_padding) {
  if (at::GradMode::is_enabled() && x.requires_grad()) {
    throw c10::NotImplementedError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                   "dispatch_quantized: not differentiable (float8 rows carry no gradient); "
                                   "detach x, or dispatch the 16-bit rows and quantize in the expert");
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(dispatch_quantized_kernel)>("padmoe::dispatch_quantized");
  return op.call(x, plan, top_k, num_experts, alignment, scale_layout, dtype, check, zero_padding);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(padmoe, m) {
  m.def("dispatch_quantized(Tensor x, Tensor plan, int top_k, int num_experts, int alignment, str scale_layout, "
        "ScalarType dtype, int check=2, bool zero_padding=True) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(padmoe, CPU, m) { m.impl("dispatch_quantized", dispatch_quantized_kernel); }
#ifdef PADMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(padmoe, CUDA, m) { m.impl("dispatch_quantized", dispatch_quantized_kernel); }
#endif
TORCH_LIBRARY_IMPL(padmoe, Autograd, m) { m.impl("dispatch_quantized", dispatch_quantized_autograd); }
