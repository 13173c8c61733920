// common.cpp — the helpers the torch operator files share (common.hpp), and the one
// TORCH_LIBRARY(padmoe) block.
#include "common.hpp"

#ifdef PADMOE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cctype>
#include <cstring>
#include <limits>

namespace padmoe_torch {

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
  throw c10::ValueError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                        std::string(op) + ": " + arg + ": " + what);
}
[[noreturn]] void type_error(const char* op, const char* arg, const std::string& what) {
  throw c10::TypeError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                       std::string(op) + ": " + arg + ": " + what);
}

// --- tensors -> views -----------------------------------------------------------

std::string shape_of(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case at::kBool: return "bool";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    default: {  // the float8 and unsigned kinds: c10's name, lower case (Float8_e4m3fn -> float8_e4m3fn)
      std::string s = c10::toString(t);
      for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return s;
    }
  }
}

namespace {

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
      type_error(op, arg,
                 "unsupported dtype " + dtype_name(t.scalar_type()) +
                     "; expected float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int32 or int64");
  }
}

}  // namespace

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
  return at::empty({0},
                   like.options().dtype(weights && weights->defined() ? weights->scalar_type() : like.scalar_type()));
}

// --- options: stream, checks, scratch -----------------------------------------

#ifdef PADMOE_TORCH_CUDA
static void* torch_scratch_alloc(size_t bytes, void* stream, void*) {
  return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream));
}
static void torch_scratch_free(void* ptr, void*, void*) { c10::cuda::CUDACachingAllocator::raw_delete(ptr); }
#endif

padmoe::Options options_for(const Tensor& like, int64_t check, bool zero_tail) {
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

// --- host reads of small index tensors ---------------------------------------------

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

// --- float64 formulas (exact; for gradcheck) ---------------------------------------

TensorView shadow(const Tensor& t, int64_t rows) {
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
TensorView shadow_rows(int64_t rows, const Tensor& like) {
  return shadow(like.dim() == 2 ? like : like.reshape({-1, 1}), rows);
}

static Tensor w64(const OptTensor& w, int64_t n, const Tensor& like) {
  if (!w || !w->defined()) return at::ones({n}, like.options());
  return w->reshape({-1}).to(like.scalar_type());
}

// y[rows, H]: y[dest[a]] = x[a / K] * w[a] (+ 0: a zero product is +0.0); other rows zero
// (dest < 0: dropped). Unweighted, the rows are copied as they are.
Tensor spread64(const Tensor& x, const Tensor& dest, int64_t k, const OptTensor& w, int64_t rows) {
  const int64_t a = dest.numel();
  Tensor src = x.repeat_interleave(k, 0);
  if (w && w->defined()) src = src * w64(w, a, x).unsqueeze(1) + 0.0;
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

}  // namespace padmoe_torch

// The one TORCH_LIBRARY block of the namespace: it claims torch.ops.padmoe for this library (a
// second TORCH_LIBRARY(padmoe) elsewhere is an error at load). The schemas are defined by each
// domain file's TORCH_LIBRARY_FRAGMENT, beside their kernels and autograd.
TORCH_LIBRARY(padmoe, m) {}
