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

// n CUDA events, destroyed with the object.
struct Events {
  std::vector<cudaEvent_t> ev;
  explicit Events(size_t n) : ev(n, nullptr) {
    for (cudaEvent_t& e : ev) cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  ~Events() {
    for (cudaEvent_t e : ev) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
  // Microseconds between ev[2k] and ev[2k + 1], each divided by `per`.
  std::vector<double> pairs_us(int n, int per) const {
    std::vector<double> us;
    for (int k = 0; k < n; ++k) {
      float ms = 0.0f;
      cuda_check(cudaEventElapsedTime(&ms, ev[2 * k], ev[2 * k + 1]), "cudaEventElapsedTime");
      us.push_back(1e3 * static_cast<double>(ms) / per);
    }
    return us;
  }
};

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
    throw Error(ErrorKind::kRuntime, "--device " + name + ": no usable CUDA device (" + cudaGetErrorString(err) + ")");
  }
  if (device.index < 0 || device.index >= count) {
    throw Error(ErrorKind::kValue,
                "--device " + name + ": this machine has " + std::to_string(count) + " CUDA device(s)");
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
  Events events(2 * static_cast<size_t>(iters));
  for (int k = 0; k < warmup; ++k) fn();
  gpu_synchronize(g);
  for (int k = 0; k < iters; ++k) {
    if (flush) flush();
    cuda_check(cudaEventRecord(events.ev[2 * k], stream_of(g)), "cudaEventRecord");
    fn();
    cuda_check(cudaEventRecord(events.ev[2 * k + 1], stream_of(g)), "cudaEventRecord");
  }
  gpu_synchronize(g);
  return events.pairs_us(iters, 1);
}

GpuGraph::~GpuGraph() {
  if (exec != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
  if (graph != nullptr) cudaGraphDestroy(static_cast<cudaGraph_t>(graph));
}

// One run of fn captured into a graph. Global mode: while the stream captures,
// this thread may not make a potentially unsafe call (cudaMalloc, a
// synchronization, a synchronous copy), the same rule as torch.cuda.graph's
// default, so an op that would stall a serving loop fails here rather than
// being captured around. Every failure becomes GpuGraph::error: fn's exception
// (padmoe::Error names the CUDA call refused), else the capture status, else
// cudaStreamEndCapture's or cudaGraphInstantiate's error.
std::unique_ptr<GpuGraph> gpu_capture_graph(const GpuContext& g, const std::function<void()>& fn) {
  auto out = std::make_unique<GpuGraph>();
  const cudaStream_t s = stream_of(g);
  gpu_synchronize(g);  // earlier work done: an error of its own is not blamed on the capture
  const cudaError_t begin = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  if (begin != cudaSuccess) {
    cudaGetLastError();  // clear the error
    out->error = std::string("cudaStreamBeginCapture failed: ") + cudaGetErrorString(begin);
    return out;
  }
  std::string op_error;
  try {
    fn();
  } catch (const std::exception& e) {
    op_error = e.what();
  } catch (...) {
    op_error = "unknown exception";
  }
  // Invalidated by an unsafe call? Then cudaStreamEndCapture returns no graph;
  // it is called in every case, to take the stream out of capture mode.
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t query = cudaStreamIsCapturing(s, &status);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(s, &graph);
  out->graph = graph;
  cudaStreamCaptureStatus after = cudaStreamCaptureStatusNone;
  const cudaError_t query_after = cudaStreamIsCapturing(s, &after);
  if (query_after != cudaSuccess || after != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    const cudaError_t err = query_after != cudaSuccess ? query_after : end;
    throw Error(ErrorKind::kRuntime, std::string("the stream is still capturing after cudaStreamEndCapture (") +
                                         cudaGetErrorString(err) + ")");
  }
  std::string why;
  if (!op_error.empty()) {
    why = op_error;
    if (status == cudaStreamCaptureStatusInvalidated) why += " (capture invalidated)";
  } else if (query != cudaSuccess) {
    why = std::string("cudaStreamIsCapturing failed: ") + cudaGetErrorString(query);
  } else if (status != cudaStreamCaptureStatusActive) {
    why = std::string(
              "capture invalidated by an unsafe call inside the op (a host synchronization, cudaMalloc or a "
              "read back to the host): cudaStreamEndCapture: ") +
          cudaGetErrorString(end);
  } else if (end != cudaSuccess || graph == nullptr) {
    why = std::string("cudaStreamEndCapture failed: ") + cudaGetErrorString(end);
  }
  if (why.empty()) {
    const cudaError_t nodes = cudaGraphGetNodes(graph, nullptr, &out->nodes);
    if (nodes != cudaSuccess) {
      why = std::string("cudaGraphGetNodes failed: ") + cudaGetErrorString(nodes);
    } else if (out->nodes == 0) {
      why = "the capture holds no work (the op launched nothing on the stream)";
    }
  }
  if (why.empty()) {
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    if (inst == cudaSuccess) {
      out->exec = exec;
    } else {
      why = std::string("cudaGraphInstantiate failed: ") + cudaGetErrorString(inst);
    }
  }
  if (!why.empty()) {
    cudaGetLastError();  // clear the failed call's error, so the next op's launch checks do not see it
    out->error = "capture failed: " + why;
    gpu_synchronize(g);  // the stream is usable again (throws if not)
  }
  return out;
}

// Back-to-back replays: the stream is never drained between samples, so each
// sample sees the GPU as a serving loop does, launches queued behind the
// previous replay, with warm caches (no flush).
std::vector<double> gpu_graph_replay_us(const GpuContext& g, const GpuGraph& graph, int warmup, int iters,
                                        int replays) {
  if (graph.exec == nullptr) throw Error(ErrorKind::kRuntime, "no graph to replay: " + graph.error);
  const cudaStream_t s = stream_of(g);
  const cudaGraphExec_t exec = static_cast<cudaGraphExec_t>(graph.exec);
  Events events(2 * static_cast<size_t>(iters));
  cuda_check(cudaGraphUpload(exec, s), "cudaGraphUpload");
  for (int k = 0; k < warmup; ++k) cuda_check(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
  gpu_synchronize(g);
  for (int k = 0; k < iters; ++k) {
    cuda_check(cudaEventRecord(events.ev[2 * k], s), "cudaEventRecord");
    for (int r = 0; r < replays; ++r) cuda_check(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
    cuda_check(cudaEventRecord(events.ev[2 * k + 1], s), "cudaEventRecord");
  }
  gpu_synchronize(g);
  return events.pairs_us(iters, replays);
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
GpuGraph::~GpuGraph() = default;
std::unique_ptr<GpuGraph> gpu_capture_graph(const GpuContext&, const std::function<void()>&) { no_gpu(); }
std::vector<double> gpu_graph_replay_us(const GpuContext&, const GpuGraph&, int, int, int) { no_gpu(); }

#endif  // PADMOE_WITH_CUDA

}  // namespace cli
