// memory.cu — allocation, copies and scratch memory of the CUDA backend.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>

#include "cuda/common.cuh"

namespace padmoe {
namespace cuda {

void* device_alloc(size_t bytes, int device) {
  int previous = 0;
  PADMOE_CUDA_CHECK(cudaGetDevice(&previous));
  if (previous != device) PADMOE_CUDA_CHECK(cudaSetDevice(device));
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes > 0 ? bytes : 1);
  if (previous != device) cudaSetDevice(previous);
  check_cuda(err, "cudaMalloc");
  return p;
}

void device_free(void* p) {
  if (p != nullptr) cudaFree(p);
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes, void* stream) {
  if (bytes == 0) return;
  cudaMemcpyKind kind = cudaMemcpyDefault;
  if (dst_device.is_cuda() && src_device.is_cuda()) kind = cudaMemcpyDeviceToDevice;
  else if (dst_device.is_cuda()) kind = cudaMemcpyHostToDevice;
  else if (src_device.is_cuda()) kind = cudaMemcpyDeviceToHost;
  else kind = cudaMemcpyHostToHost;
  PADMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, as_stream(stream)));
  if (kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToHost) {
    PADMOE_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  }
}

void memset_async(void* dst, int value, size_t bytes, void* stream) {
  if (bytes > 0) PADMOE_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, as_stream(stream)));
}

// The attributes the backend reads of a device, asked once a device (kInfoDevices of them; past
// that, or where the runtime cannot answer, the defaults: an H200's 132 multiprocessors and 50 MiB
// of L2, no programmatic serialization, no cooperative launch). Per device, so that a process
// driving GPUs of different kinds plans each launch for the GPU it runs on.
namespace {
constexpr int kInfoDevices = 64;
struct DeviceAttributes {
  std::once_flag once;
  int sms = 132;
  int64_t l2_bytes = int64_t{50} << 20;
  bool sm90 = false;
  std::atomic<bool> cooperative{false};  // cleared by cooperative_launch_refused
};
DeviceAttributes g_devices[kInfoDevices];
DeviceAttributes g_unknown;  // the defaults, for no current device or one past kInfoDevices

// The current device's attributes (g_unknown where it cannot be asked).
DeviceAttributes& current_device() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kInfoDevices) {
    cudaGetLastError();
    return g_unknown;
  }
  DeviceAttributes& d = g_devices[dev];
  std::call_once(d.once, [&d, dev] {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0) d.sms = v;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrL2CacheSize, dev) == cudaSuccess && v > 0) d.l2_bytes = v;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess) d.sm90 = v >= 9;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrCooperativeLaunch, dev) == cudaSuccess) {
      d.cooperative.store(v != 0, std::memory_order_relaxed);
    }
    cudaGetLastError();
  });
  return d;
}

// Programmatic dependent launch: on devices of compute capability 9.0 and up (every kernel waits
// for the one before it before its first memory access, so results do not change);
// KernelOverrides::pdl false turns it off (tests, `padmoe bench --variant pdl=off`).
bool pdl_on(const DeviceAttributes& d) { return d.sm90 && detail::kernel_overrides().pdl.value_or(true); }
}  // namespace

bool pdl_enabled() { return pdl_on(current_device()); }

int sm_count() { return current_device().sms; }

int64_t l2_cache_bytes() { return current_device().l2_bytes; }

policy::Device device_policy() {
  const DeviceAttributes& d = current_device();
  return policy::Device{d.sms, d.l2_bytes, pdl_on(d)};
}

bool cooperative_launch_supported() { return current_device().cooperative.load(std::memory_order_relaxed); }

void cooperative_launch_refused() { current_device().cooperative.store(false, std::memory_order_relaxed); }

RowsArg with_l2_prefetch(const RowsArg& r, bool vec, int blocks) {
  RowsArg out = r;
  out.l2_bytes = 0;
  out.l2_blocks = 0;
  const int64_t row_bytes = r.cols * static_cast<int64_t>(element_size(r.dtype));
  const std::optional<bool>& forced = overrides().l2_prefetch;
  if ((forced.has_value() && !*forced) || !vec || r.data == nullptr || r.rows <= 0 || row_bytes <= 0 ||
      row_bytes % 16 != 0 || row_bytes > (int64_t{1} << 30)) {
    return out;
  }
  if (!forced.has_value() && !policy::l2_prefetch(r.rows, row_bytes, device_policy())) return out;
  out.l2_bytes = static_cast<uint32_t>(row_bytes);
  out.l2_blocks = blocks;
  return out;
}

void synchronize(void* stream) { PADMOE_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream))); }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

namespace {

// padmoe's own stream-ordered pool per device for scratch memory, which keeps
// what is freed (release threshold: no limit). The device's default pool
// returns freed memory to the system at every synchronization, so that each
// op called between synchronizations (checked mode, the allocating forms)
// paid for mapping fresh memory again: 100+ us a call.
cudaMemPool_t scratch_pool(int device) {
  constexpr int kMaxDevices = 64;
  static cudaMemPool_t pools[kMaxDevices] = {};
  static std::mutex mutex;
  if (device < 0 || device >= kMaxDevices) throw Error(ErrorKind::kValue, "CUDA device index out of range");
  std::lock_guard<std::mutex> lock(mutex);
  if (pools[device] == nullptr) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    PADMOE_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
    uint64_t keep = UINT64_MAX;
    PADMOE_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    pools[device] = pool;
  }
  return pools[device];
}

}  // namespace

Scratch::Scratch(const Options& options, size_t bytes, int device) : stream_(options.stream) {
  if (bytes == 0) return;
  if (options.workspace != nullptr && options.workspace_bytes >= bytes) {
    ptr_ = options.workspace;
    return;
  }
  owned_ = true;
  if (options.scratch_alloc != nullptr && options.scratch_free != nullptr) {
    ptr_ = options.scratch_alloc(bytes, stream_, options.scratch_ctx);
    if (ptr_ == nullptr)
      throw Error(ErrorKind::kRuntime, "scratch_alloc returned null for " + std::to_string(bytes) + " bytes");
    free_ = options.scratch_free;
    free_ctx_ = options.scratch_ctx;
    return;
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  PADMOE_CUDA_CHECK(cudaStreamIsCapturing(as_stream(stream_), &capture));
  if (capture != cudaStreamCaptureStatusNone) {  // inside a graph: a graph memory node
    PADMOE_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, as_stream(stream_)));
    return;
  }
  PADMOE_CUDA_CHECK(cudaMallocFromPoolAsync(&ptr_, bytes, scratch_pool(device), as_stream(stream_)));
}

Scratch::~Scratch() {
  if (!owned_) return;
  if (free_ != nullptr) free_(ptr_, stream_, free_ctx_);
  else cudaFreeAsync(ptr_, as_stream(stream_));
}

}  // namespace cuda
}  // namespace padmoe
