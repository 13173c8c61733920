// gpu.cpp — the CLI's GPU helpers (gpu.hpp); in a build without CUDA they
// throw padmoe::Error.
#include "gpu.hpp"

#if defined(PADMOE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace cli {

#if defined(PADMOE_WITH_CUDA)

namespace {

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw Error(ErrorKind::kRuntime, std::string(what) + " failed: " + cudaGetErrorString(err));
  }
}

cudaStream_t stream_of(const GpuContext& g) { return static_cast<cudaStream_t>(g.stream); }

}  // namespace

GpuContext::~GpuContext() {
  if (stream != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

std::shared_ptr<GpuContext> open_gpu(Device device) {
  const std::string name = device_name(device);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the error
    throw Error(ErrorKind::kRuntime,
                "--device " + name + ": no usable CUDA device (" + cudaGetErrorString(err) + ")");
  }
  if (device.index < 0 || device.index >= count) {
    throw Error(ErrorKind::kValue, "--device " + name + ": this machine has " + std::to_string(count) +
                                       " CUDA device(s)");
  }
  // The library launches on the current device: make it the one asked for.
  cuda_check(cudaSetDevice(device.index), "cudaSetDevice");
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, device.index), "cudaGetDeviceProperties");
  auto g = std::make_shared<GpuContext>();
  g->device = device;
  g->card = prop.name;
  cudaStream_t s = nullptr;
  cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  g->stream = s;
  return g;
}

// value into every byte of t (a device tensor), ordered on the stream.
void gpu_memset(const GpuContext& g, const Tensor& t, int value) {
  const size_t bytes = static_cast<size_t>(t.numel()) * element_size(t.dtype());
  if (bytes > 0) cuda_check(cudaMemsetAsync(t.data(), value, bytes, stream_of(g)), "cudaMemsetAsync");
}

void gpu_synchronize(const GpuContext& g) { cuda_check(cudaStreamSynchronize(stream_of(g)), "cudaStreamSynchronize"); }

// Microseconds of each of `iters` runs of fn on the stream, timed with a pair
// of CUDA events around the call; before each timed run (outside the events)
// `flush` runs, so the run starts with a cold L2.
std::vector<double> gpu_time_us(const GpuContext& g, const std::function<void()>& fn, int warmup, int iters,
                                const std::function<void()>& flush) {
  struct Events {
    std::vector<cudaEvent_t> ev;
    explicit Events(size_t n) : ev(n, nullptr) {
      for (cudaEvent_t& e : ev) cuda_check(cudaEventCreate(&e), "cudaEventCreate");
    }
    ~Events() {
      for (cudaEvent_t e : ev) {
        if (e != nullptr) cudaEventDestroy(e);
      }
    }
  } events(2 * static_cast<size_t>(iters));
  for (int k = 0; k < warmup; ++k) fn();
  gpu_synchronize(g);
  for (int k = 0; k < iters; ++k) {
    if (flush) flush();
    cuda_check(cudaEventRecord(events.ev[2 * k], stream_of(g)), "cudaEventRecord");
    fn();
    cuda_check(cudaEventRecord(events.ev[2 * k + 1], stream_of(g)), "cudaEventRecord");
  }
  gpu_synchronize(g);
  std::vector<double> us;
  for (int k = 0; k < iters; ++k) {
    float ms = 0.0f;
    cuda_check(cudaEventElapsedTime(&ms, events.ev[2 * k], events.ev[2 * k + 1]), "cudaEventElapsedTime");
    us.push_back(1e3 * static_cast<double>(ms));
  }
  return us;
}

#else  // !PADMOE_WITH_CUDA

GpuContext::~GpuContext() = default;

std::shared_ptr<GpuContext> open_gpu(Device device) {
  throw Error(ErrorKind::kUnsupported, "--device " + device_name(device) +
                                           ": this padmoe was built without CUDA (reconfigure with -DPADMOE_CUDA=ON)");
}
namespace {
[[noreturn]] void no_gpu() { throw Error(ErrorKind::kUnsupported, "padmoe was built without CUDA"); }
}  // namespace
void gpu_memset(const GpuContext&, const Tensor&, int) { no_gpu(); }
void gpu_synchronize(const GpuContext&) { no_gpu(); }
std::vector<double> gpu_time_us(const GpuContext&, const std::function<void()>&, int, int,
                                const std::function<void()>&) {
  no_gpu();
}

#endif  // PADMOE_WITH_CUDA

}  // namespace cli
