// common.cpp — the helpers common.hpp declares: arrays to padmoe::TensorViews, the options.
#include "common.hpp"

namespace padmoe_ext {

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

}  // namespace padmoe_ext
