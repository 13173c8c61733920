// padmoe/tensor.hpp — a small non-owning tensor view and an owning tensor.
//
// TensorView is what every op takes: pointer, dtype, shape, strides (in
// elements) and device. padmoe never takes ownership of a view. Row tensors
// ([rows, H]) may have any row stride >= H but unit column stride; index
// tensors must be contiguous. Tensor owns a buffer allocated by padmoe (the
// allocating op overloads return these) and converts to a view.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

namespace padmoe {

enum class DType : int8_t {
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat8E4M3,  // move-only ops
  kFloat8E5M2,  // move-only ops
  kInt32,
  kInt64,
  kUInt8,       // scale bytes only (MXFP8 E8M0 shared exponents), never rows
};

size_t element_size(DType dtype);
const char* dtype_name(DType dtype);  // "float32", "bfloat16", ...
bool is_floating(DType dtype);        // a row dtype: float32/16, bfloat16, float8
bool is_float8(DType dtype);
bool is_index(DType dtype);           // int32 or int64

enum class DeviceType : int8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  static Device cpu() { return Device{DeviceType::kCPU, 0}; }
  static Device cuda(int index = 0) { return Device{DeviceType::kCUDA, index}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};
std::string device_name(Device device);  // "cpu", "cuda:0"

constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t strides[kMaxDims] = {0, 0, 0, 0};  // in elements
  Device device{};

  // A contiguous (row-major) view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::cpu());
  // A 2-D view of `rows` rows of `cols` elements, `row_stride` elements apart.
  static TensorView matrix(void* data, DType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                           Device device = Device::cpu());

  int64_t size(int dim) const { return shape[dim]; }
  int64_t stride(int dim) const { return strides[dim]; }
  int64_t numel() const;
  bool is_contiguous() const;  // row-major without gaps; any view of no elements
  size_t element_bytes() const { return element_size(dtype); }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data);
  }
};

// An owning tensor: a contiguous buffer padmoe allocated (64-byte aligned on
// the CPU), shared by copies of this object.
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(DType dtype, std::initializer_list<int64_t> shape, Device device = Device::cpu());
  static Tensor empty(DType dtype, int ndim, const int64_t* shape, Device device = Device::cpu());

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: a Tensor is usable wherever a view is
  bool defined() const { return storage_ != nullptr; }
  void* data() const { return view_.data; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(view_.data);
  }
  DType dtype() const { return view_.dtype; }
  int ndim() const { return view_.ndim; }
  int64_t size(int dim) const { return view_.shape[dim]; }
  int64_t numel() const { return view_.numel(); }
  Device device() const { return view_.device; }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

}  // namespace padmoe
