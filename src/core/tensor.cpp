// tensor.cpp — dtype facts, TensorView helpers and CPU allocation of Tensor.
#include <limits>
#include <cstdlib>
#include <new>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cuda/cuda_backend.hpp"
#include "padmoe/error.hpp"
#include "padmoe/tensor.hpp"

namespace padmoe {

size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
    case DType::kFloat8E5M2: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

bool is_float8(DType dtype) { return dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2; }
bool is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16 || is_float8(dtype);
}
bool is_index(DType dtype) { return dtype == DType::kInt32 || dtype == DType::kInt64; }

std::string device_name(Device device) {
  return device.is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(device.index);
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  if (shape.size() > static_cast<size_t>(kMaxDims)) throw Error(ErrorKind::kValue, "TensorView: more than 4 dims");
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) v.shape[d++] = s;
  // Row-major strides, in wrapping arithmetic: a shape whose product overflows (which every op
  // rejects by its sizes) must not be undefined behaviour here.
  uint64_t stride = 1;
  for (d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = static_cast<int64_t>(stride);
    stride *= static_cast<uint64_t>(v.shape[d]);
  }
  return v;
}

TensorView TensorView::matrix(void* data, DType dtype, int64_t rows, int64_t cols, int64_t row_stride, Device device) {
  TensorView v = contiguous(data, dtype, {rows, cols}, device);
  v.strides[0] = row_stride;
  return v;
}

int64_t TensorView::numel() const {
  // Saturates at INT64_MAX (no overflow, which would be undefined) for shapes no op accepts.
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] <= 0) return shape[d] == 0 ? 0 : n * shape[d];
    if (n > std::numeric_limits<int64_t>::max() / shape[d]) return std::numeric_limits<int64_t>::max();
    n *= shape[d];
  }
  return n;
}

bool TensorView::is_contiguous() const {
  // No elements: contiguous whatever the strides (as torch and numpy say; torch.empty(6, 0) has
  // strides (1, 1)), since nothing is read or written through them.
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] == 0) return true;
  }
  uint64_t stride = 1;  // wrapping arithmetic: no undefined behaviour for absurd shapes
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != static_cast<int64_t>(stride)) return false;
    stride *= static_cast<uint64_t>(shape[d]);
  }
  return true;
}

Tensor Tensor::empty(DType dtype, std::initializer_list<int64_t> shape, Device device) {
  int64_t dims[kMaxDims];
  int n = 0;
  for (int64_t s : shape) {
    if (n == kMaxDims) throw Error(ErrorKind::kValue, "Tensor::empty: more than 4 dims");
    dims[n++] = s;
  }
  return empty(dtype, n, dims, device);
}

Tensor Tensor::empty(DType dtype, int ndim, const int64_t* shape, Device device) {
  if (ndim < 0 || ndim > kMaxDims) throw Error(ErrorKind::kValue, "Tensor::empty: ndim must be in [0, 4]");
  int64_t numel = 1;
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] < 0) throw Error(ErrorKind::kValue, "Tensor::empty: negative size in dim " + std::to_string(d));
    if (shape[d] > 0 && numel > std::numeric_limits<int64_t>::max() / 8 / shape[d]) {
      throw Error(ErrorKind::kValue, "Tensor::empty: size overflow in dim " + std::to_string(d));
    }
    numel *= shape[d];
  }
  const size_t bytes = static_cast<size_t>(numel) * element_size(dtype);
  Tensor t;
  t.view_.dtype = dtype;
  t.view_.device = device;
  t.view_.ndim = ndim;
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    t.view_.shape[d] = shape[d];
    t.view_.strides[d] = stride;
    stride *= shape[d];
  }
  if (device.is_cuda()) {
#if defined(PADMOE_WITH_CUDA)
    void* p = cuda::device_alloc(bytes, device.index);
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { cuda::device_free(q); });
    t.view_.data = p;
    return t;
#else
    throw Error(ErrorKind::kUnsupported,
                "Tensor::empty: cannot allocate on " + device_name(device) + ": padmoe was built without CUDA");
#endif
  }
  // 64-byte aligned (aligned_alloc wants a whole number of alignments). Large
  // buffers are 2 MiB aligned and asked to use transparent huge pages: the
  // row kernels touch rows all over them, and 4 KiB pages cost a TLB miss
  // every few rows.
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t align = bytes >= 2 * kHuge ? kHuge : 64;
  const size_t alloc = ((bytes + align - 1) / align) * align + align;
  void* p = std::aligned_alloc(align, alloc);
  if (p == nullptr)
    throw Error(ErrorKind::kRuntime, "Tensor::empty: out of memory (" + std::to_string(bytes) + " bytes)");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (align == kHuge) (void)madvise(p, alloc, MADV_HUGEPAGE);  // advice only; failure is harmless
#endif
  t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  t.view_.data = p;
  return t;
}

}  // namespace padmoe
