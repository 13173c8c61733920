// memory.cu — allocation, copies and scratch memory of the CUDA backend.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>

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

// Programmatic dependent launch: on by default on devices of compute capability 9.0 and up;
// PADMOE_CUDA_PDL=0 (read once) or set_pdl(0) turns it off (measurements, tests).
namespace {
constexpr int kPdlDevices = 64;
std::atomic<int> g_pdl_forced{-1};      // -1: not set by set_pdl
std::atomic<int> g_pdl_cc[kPdlDevices];  // 0: not asked; 1: sm_90+; -1: older
}  // namespace

void set_pdl(int mode) { g_pdl_forced.store(mode < 0 ? -1 : (mode > 0 ? 1 : 0), std::memory_order_relaxed); }

bool pdl_enabled() {
  const int forced = g_pdl_forced.load(std::memory_order_relaxed);
  if (forced == 0) return false;
  static const bool env_on = [] {
    const char* v = std::getenv("PADMOE_CUDA_PDL");
    return v == nullptr || std::atoi(v) != 0;
  }();
  if (forced < 0 && !env_on) return false;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kPdlDevices) {
    cudaGetLastError();
    return false;
  }
  int cc = g_pdl_cc[dev].load(std::memory_order_relaxed);
  if (cc == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      cudaGetLastError();
      major = 0;
    }
    cc = major >= 9 ? 1 : -1;
    g_pdl_cc[dev].store(cc, std::memory_order_relaxed);
  }
  return cc > 0;
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
    if (ptr_ == nullptr) throw Error(ErrorKind::kRuntime, "scratch_alloc returned null for " + std::to_string(bytes) + " bytes");
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
