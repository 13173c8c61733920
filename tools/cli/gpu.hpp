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
// one stream for every op and copy, a device memset (sentinel fill, L2 flush)
// and CUDA-event timing. In a build without CUDA, open_gpu() throws
// padmoe::Error (exit 2) before anything else runs, and the other helpers are
// unreachable.

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

}  // namespace cli
