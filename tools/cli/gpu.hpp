// gpu.hpp — the CLI's GPU helpers (--device cuda).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common.hpp"

namespace cli {

// ===========================================================================
// The GPU (--device cuda)
// ===========================================================================
//
// Everything the CLI does on a GPU besides the padmoe calls: select the card,
// one stream for every op and copy, a device memset (sentinel fill, L2 flush),
// CUDA-event timing, and CUDA graphs (capture once, time the replays). In a
// build without CUDA, open_gpu() throws padmoe::Error (exit 2) before anything
// else runs, and the other helpers are unreachable.

struct GpuContext {
  Device device = Device::cpu();
  std::string card;       // cudaDeviceProp::name
  void* stream = nullptr;  // cudaStream_t, for Options::stream
  GpuContext() = default;
  GpuContext(const GpuContext&) = delete;
  GpuContext& operator=(const GpuContext&) = delete;
  ~GpuContext();
};

// The card `device` names, made current, with a new non-blocking stream.
std::shared_ptr<GpuContext> open_gpu(Device device);
// value into every byte of t (a device tensor), ordered on the stream.
void gpu_memset(const GpuContext& g, const Tensor& t, int value);
void gpu_synchronize(const GpuContext& g);
// Microseconds of each of `iters` runs of fn on the stream (CUDA events); `flush`
// runs before each timed run, outside the events.
std::vector<double> gpu_time_us(const GpuContext& g, const std::function<void()>& fn, int warmup, int iters,
                                const std::function<void()>& flush);

// ---------------------------------------------------------------------------
// CUDA graphs (bench's `graph us` column)
// ---------------------------------------------------------------------------

// What fn launched on the stream, captured once into a CUDA graph and
// instantiated; or, when that failed, why (`error`, and no exec).
struct GpuGraph {
  void* graph = nullptr;  // cudaGraph_t
  void* exec = nullptr;   // cudaGraphExec_t; null when the capture failed
  size_t nodes = 0;       // nodes of the captured graph
  std::string error;      // why there is no exec (empty when there is one)
  GpuGraph() = default;
  GpuGraph(const GpuGraph&) = delete;
  GpuGraph& operator=(const GpuGraph&) = delete;
  ~GpuGraph();
};

// One run of fn captured on the stream (cudaStreamCaptureModeGlobal), then
// instantiated. A capture that fails (fn throws, or it synchronizes the host,
// allocates with cudaMalloc or reads back to the host, which invalidates the
// capture; fn launches nothing; instantiation fails) is returned as
// GpuGraph::error, not thrown: the capture is always ended and the error state
// cleared, so the stream stays usable. Throws padmoe::Error only when the
// stream is not usable (an earlier asynchronous error, or it cannot be brought
// back out of capture mode).
std::unique_ptr<GpuGraph> gpu_capture_graph(const GpuContext& g, const std::function<void()>& fn);
// Microseconds per replay of graph (which must have an exec): `warmup` untimed
// replays, then `iters` samples, each a pair of CUDA events around `replays`
// back-to-back cudaGraphLaunch calls divided by `replays`; no L2 flush (warm
// caches, as a serving loop replays its step).
std::vector<double> gpu_graph_replay_us(const GpuContext& g, const GpuGraph& graph, int warmup, int iters, int replays);

}  // namespace cli
