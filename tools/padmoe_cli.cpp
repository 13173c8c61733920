// padmoe_cli.cpp — the `padmoe` command-line tool.
//
//   padmoe check   run every op of ops.hpp on a workload and compare with the
//                  reference loops (src/reference): moves bitwise, sums within
//                  a stated float32 tolerance of a float64 reference.
//   padmoe bench   time every op (median wall clock) against the copy floor of
//                  SPEC section 7: min_bytes / memcpy bandwidth measured in the
//                  same run; also reports padmoe::copy's (streaming) bandwidth
//                  and each op's share of it (%copy). With --device cuda: CUDA
//                  events on one stream, cold L2, check_data=false, a caller
//                  workspace, and the floor is padmoe::copy's device->device
//                  bandwidth measured in the same run.
//   padmoe plan    print and validate the tile plan of SPEC section 6.
//   padmoe presets list the workload presets (src/workload).
//
// One table, `op_table()`, lists every op once: its name, how to run it into
// preallocated outputs, the bytes it must move and its reference. `check` and
// `bench` both walk that table. The run lambdas work on whichever device the
// Data buffers live on: with --device cuda the workload is built on the host,
// every input is staged with padmoe::copy and the outputs are allocated on the
// GPU; `check` copies each compared output back before comparing.
//
// Exit codes: 0 all good, 1 a check failed (or an op raised an error), 2 a
// usage error or a padmoe::Error outside the per-op runs (e.g. an unsupported
// device).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "padmoe/padmoe.hpp"
#include "reference/reference.hpp"
#include "workload/workload.hpp"

#if defined(PADMOE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

using namespace padmoe;
using Clock = std::chrono::steady_clock;

// ===========================================================================
// Command line
// ===========================================================================

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

const char* const kUsage = R"(usage: padmoe <command> [options]

commands:
  check     run every op on a workload and compare with the reference loops
  bench     time every op against the copy floor (SPEC section 7): memcpy on
            the CPU; padmoe::copy device->device with --device cuda
  plan      print and validate a tile plan (SPEC section 6)
  presets   list the workload presets
  help      this text

workload (check, bench):
  --preset NAME          a preset (see `padmoe presets`)
  --tokens T --experts E --top-k K --hidden H --alignment M
                         sizes; each overrides the preset's (default preset
                         mixtral-8x7b)
  --small                divide T by 8; implied when no preset and no size is given
  --dtype f32|f16|bf16   row dtype (default bf16)
  --device cpu|cuda[:N]  (default cpu; cuda needs a build with PADMOE_CUDA=ON)
  --seed S               router and data seed (default 0)
  --threads N            CPU worker threads, 0 = all (default 0)

bench:
  --warmup N             untimed runs per op (default 2; 5 on cuda)
  --iters N              timed runs per op; the median is reported (default 10;
                         50 on cuda, timed with CUDA events, cold L2)
  --no-reference         skip timing the single-threaded CPU reference loops
  --ops A,B,...          only these ops (names as printed, e.g. combine(w),make_plan)
  --json                 print one JSON object instead of the table

plan:
  --target cpu|ascend-a2|gpu (default cpu)
  --hidden H --dtype f32|f16|bf16 (default bf16)
  --op gather|scatter|wgrad (default: all three)
  --cores N              cores / programs (default: the target's)

exit status: 0 ok, 1 a check failed, 2 usage or setup error
)";

struct Args {
  std::string command;
  std::map<std::string, std::string> values;
  std::set<std::string> flags;

  bool has(const std::string& name) const { return values.count(name) != 0 || flags.count(name) != 0; }
  std::string get(const std::string& name, const std::string& fallback) const {
    auto it = values.find(name);
    return it == values.end() ? fallback : it->second;
  }
  int64_t get_int(const std::string& name, int64_t fallback) const {
    auto it = values.find(name);
    if (it == values.end()) return fallback;
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(it->second.c_str(), &end, 10);
    if (errno != 0 || end == it->second.c_str() || *end != '\0') {
      throw UsageError("--" + name + " expects an integer, got '" + it->second + "'");
    }
    return v;
  }
  // An int flag: out of the int range is a usage error, not a silent truncation.
  int get_int32(const std::string& name, int fallback) const {
    const int64_t v = get_int(name, fallback);
    if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
      throw UsageError("--" + name + " " + std::to_string(v) + " is out of range");
    }
    return static_cast<int>(v);
  }
};

const std::set<std::string> kValueOptions = {"preset",    "tokens", "experts", "top-k", "hidden",
                                             "alignment", "dtype",  "device",  "seed",  "threads",
                                             "warmup",    "iters",  "target",  "op",    "cores",
                                             "ops"};
const std::set<std::string> kFlagOptions = {"small", "json", "no-reference", "help"};

Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string tok = argv[i];
    if (tok == "-h") tok = "--help";
    if (tok.rfind("--", 0) != 0) {
      if (!args.command.empty()) throw UsageError("unexpected argument '" + tok + "'");
      args.command = tok;
      continue;
    }
    std::string name = tok.substr(2), value;
    bool has_value = false;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (kFlagOptions.count(name)) {
      if (has_value) throw UsageError("--" + name + " takes no value");
      args.flags.insert(name);
    } else if (kValueOptions.count(name)) {
      if (!has_value) {
        if (i + 1 >= argc) throw UsageError("--" + name + " needs a value");
        value = argv[++i];
      }
      args.values[name] = value;
    } else {
      throw UsageError("unknown option '--" + name + "'");
    }
  }
  return args;
}

DType parse_dtype(const std::string& s) {
  if (s == "f32" || s == "float32" || s == "fp32") return DType::kFloat32;
  if (s == "f16" || s == "float16" || s == "fp16" || s == "half") return DType::kFloat16;
  if (s == "bf16" || s == "bfloat16") return DType::kBFloat16;
  throw UsageError("--dtype expects f32, f16 or bf16, got '" + s + "'");
}

// Significand bits of a row dtype (p of the tolerance rule) and half its
// smallest subnormal (the absolute rounding error near zero).
int significand_bits(DType d) { return d == DType::kFloat16 ? 11 : d == DType::kBFloat16 ? 8 : 24; }
double half_min_subnormal(DType d) {
  return d == DType::kFloat16    ? std::ldexp(1.0, -25)
         : d == DType::kBFloat16 ? std::ldexp(1.0, -134)
                                 : std::ldexp(1.0, -150);
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

int hardware_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

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

#if defined(PADMOE_WITH_CUDA)

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw Error(ErrorKind::kRuntime, std::string(what) + " failed: " + cudaGetErrorString(err));
  }
}

cudaStream_t stream_of(const GpuContext& g) { return static_cast<cudaStream_t>(g.stream); }

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
[[noreturn]] void no_gpu() { throw Error(ErrorKind::kUnsupported, "padmoe was built without CUDA"); }
void gpu_memset(const GpuContext&, const Tensor&, int) { no_gpu(); }
void gpu_synchronize(const GpuContext&) { no_gpu(); }
std::vector<double> gpu_time_us(const GpuContext&, const std::function<void()>&, int, int,
                                const std::function<void()>&) {
  no_gpu();
}

#endif  // PADMOE_WITH_CUDA

// ===========================================================================
// Workload
// ===========================================================================

struct Workload {
  std::string label;  // what the header prints
  int64_t T = 0;
  int E = 0, K = 0;
  int64_t H = 0;
  int m = 1;
  DType dtype = DType::kBFloat16;
  Device device = Device::cpu();
  uint64_t seed = 0;
  int threads = 0;  // 0 = all
};

Workload parse_workload(const Args& args) {
  static const char* const kSizeFlags[] = {"tokens", "experts", "top-k", "hidden", "alignment"};
  bool sizes_given = false;
  for (const char* f : kSizeFlags) sizes_given = sizes_given || args.has(f);

  const std::string preset_name = args.get("preset", workload::default_preset_name());
  const workload::Preset* preset = workload::find_preset(preset_name);
  if (preset == nullptr) throw UsageError("unknown preset '" + preset_name + "' (see `padmoe presets`)");
  workload::Preset p = *preset;
  p.tokens = args.get_int("tokens", p.tokens);
  p.experts = args.get_int32("experts", p.experts);
  p.top_k = args.get_int32("top-k", p.top_k);
  p.hidden = args.get_int("hidden", p.hidden);
  p.alignment = args.get_int32("alignment", p.alignment);
  const bool implied_small = !args.has("preset") && !sizes_given;
  const bool small = args.has("small") || implied_small;
  if (small) p = workload::small(p);

  Workload w;
  w.label = sizes_given ? "custom (from " + preset_name + ")" : preset_name;
  if (small) w.label += implied_small ? " --small (default)" : " --small";
  w.T = p.tokens;
  w.E = p.experts;
  w.K = p.top_k;
  w.H = p.hidden;
  w.m = p.alignment;
  w.dtype = parse_dtype(args.get("dtype", "bf16"));
  w.seed = static_cast<uint64_t>(args.get_int("seed", 0));
  w.threads = static_cast<int>(args.get_int("threads", 0));
  const std::string dev = args.get("device", "cpu");
  if (dev == "cpu")
    w.device = Device::cpu();
  else if (dev == "cuda" || dev.rfind("cuda:", 0) == 0)
    w.device = Device::cuda(dev.size() > 5 ? std::atoi(dev.c_str() + 5) : 0);
  else
    throw UsageError("--device expects cpu or cuda, got '" + dev + "'");

  if (w.T < 0) throw UsageError("--tokens must be >= 0");
  if (w.E < 1) throw UsageError("--experts must be >= 1");
  if (w.K < 1 || w.K > w.E) throw UsageError("--top-k must be in [1, experts]");
  if (w.H < 0) throw UsageError("--hidden must be >= 0");
  if (w.m < 1) throw UsageError("--alignment must be >= 1");
  if (w.threads < 0) throw UsageError("--threads must be >= 0");
  // Sizes the library would reject, rejected before anything is allocated, in its words
  // (in 64 bits, no product that can overflow).
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (w.T > kMax / w.K) {
    throw Error(ErrorKind::kValue, "make_plan: top_experts: size overflow: " + std::to_string(w.T) + " x " +
                                       std::to_string(w.K) + " assignments do not fit the int32 index outputs");
  }
  const int64_t capacity = w.T * w.K + static_cast<int64_t>(w.E) * (w.m - 1);
  if (capacity > kMax) {
    throw Error(ErrorKind::kValue,
                "make_plan: capacity: size overflow: " + std::to_string(capacity) + " does not fit the int32 index outputs");
  }
  if (w.H > 0 && capacity > std::numeric_limits<int64_t>::max() / 8 / w.H) {
    throw Error(ErrorKind::kValue, "workload: hidden: size overflow: " + std::to_string(capacity) + " rows of " +
                                       std::to_string(w.H) + " elements");
  }
  return w;
}

// Everything the ops read and write, allocated once. Inputs in the padded
// layout ([P, H]) hold NaN in their padding rows, which no op may read.
struct Data {
  Workload w;
  Options opt;
  std::shared_ptr<GpuContext> gpu;  // --device cuda only; opt.stream is its stream
  int64_t A = 0, P = 0, R = 0, N = 0;  // assignments, padded rows, capacity, Megatron rows (= A)

  workload::Routing routing;
  Tensor top_experts;  // [T, K] int32
  Tensor weights;      // [A] float32 router weights, by assignment id
  Plan plan;           // the plan every op runs on

  Tensor x, grad_out;        // [T, H]
  Tensor y, grad_y;          // [P, H], padding rows NaN
  Tensor tokens_per_expert;  // [E] int32 (the plan's)
  Tensor h, grad_unpadded;   // [N, H]: h = x rows in expert-sorted order
  Tensor padded, perm_map;   // [P, H] (padding NaN), [P] int32: h padded as pad_to_alignment does
  Tensor probs;              // [N] float32: probs[i] = weights[indices[i]]
  // sort_chunks: h read as an all-to-all's rank-major receive buffer of ep_ranks ranks
  // (8 when E divides by 8, else 1), chunk (r, e) = global expert r*(E/ep_ranks) + e.
  int ep_ranks = 1;
  int64_t Pc = 0;            // sort_chunks' padded rows (E/ep_ranks local experts)
  Tensor split_sizes;        // [ep_ranks, E/ep_ranks] int32: tokens_per_expert as chunks
  Tensor x8, x8_scales;      // [T, H] float8 e4m3 (x rounded) and [T, ceil(H/128)] float32 scales

  // Outputs, reused by every op (no allocation inside a timed run).
  Plan plan_out;         // row_sources has R entries
  Tensor out_rows_R;     // [R, H]: gather / dispatch / pad outputs
  Tensor out_rows_T;     // [T, H]: scatter / combine outputs
  Tensor out_rows_N;     // [N, H]: unpad outputs
  Tensor out_rows_R2;    // [R, H]: grad_y of combine_backward / padded_scatter_backward
  Tensor out_rows_P;     // [P, H]: unpad backward grad_padded (padded's shape exactly)
  Tensor out_f32_A;      // [A] float32: wgrad / grad_weights
  Tensor out_f32_N;      // [N] float32: unpad backward grad_probs
  Tensor out_map_R;      // [R] int32
  Tensor out_offsets_E;  // [E] int32
  Tensor out_row_experts_R, out_block_experts, out_total_1;  // make_plan's layouts: [R], [ceil(R/m)], [1]
  Tensor out_sorted_V, out_block_ids_V, out_post_1;          // moe_align_block_size: [V], [ceil(V/m)], [1]
  Tensor out_rows8_R, out_scales_R;  // [R, H] e4m3 and [R, ceil(H/128)] float32: dispatch(fp8+scales)
  Tensor out_e8m0_R;                 // [R, ceil(H/32)] uint8 E8M0: dispatch(quant-mxfp8)
  // make_plan with PlanOptions: rank 1's local experts of ep_ranks ([E/ep_ranks] plan), and an expert
  // capacity C = round_down(A / E, m) (capacity factor 1) with the probs drop policy (E*C <= R rows).
  Plan plan_ep;
  Tensor out_dropped_1;
  int64_t expert_capacity = 0;

  // Host float copies for the reference loops (filled only when needed).
  bool have_reference = false;
  ref::Plan ref_plan;
  std::vector<float> x_f, grad_out_f, y_f, grad_y_f, h_f, grad_unpadded_f, padded_f, probs_f;
  std::vector<float> x8_f, x8_scales_f;
  std::vector<int64_t> perm_map_ref, tokens_per_expert_ref;
  std::vector<int64_t> split_sizes_ref;
  std::vector<float> composite_f;  // the plan+dispatch+combine reference's intermediate rows

  // --device cuda: host copies of device outputs, made on demand by on_host().
  std::map<const void*, Tensor> host_mirrors;
};

uint64_t stream_seed(uint64_t seed, uint64_t stream) {
  uint64_t s = seed ^ (0x632be59bd9b4e019ull * (stream + 1));
  return workload::splitmix64(s);
}

int32_t* i32(const Tensor& t) { return t.data_as<int32_t>(); }

Tensor plan_tensor(const std::vector<int64_t>& v) {
  Tensor t = Tensor::empty(DType::kInt32, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) i32(t)[i] = static_cast<int32_t>(v[i]);
  return t;
}

std::vector<float> to_floats(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = numeric::load_as_float(t.data(), t.dtype(), i);
  return v;
}

Tensor random_rows(int64_t rows, int64_t H, DType dtype, uint64_t seed) {
  Tensor t = Tensor::empty(dtype, {rows, H});
  workload::fill_uniform(t.data(), dtype, rows * H, seed);
  return t;
}

void fill_nan_rows(const Tensor& t, const int32_t* row_sources, int64_t rows, int64_t H) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t r = 0; r < rows; ++r) {
    if (row_sources[r] >= 0) continue;
    for (int64_t c = 0; c < H; ++c) numeric::store_from_float(t.data(), t.dtype(), r * H + c, nan);
  }
}

// A copy of host tensor t on `dev` (padmoe::copy, synchronous host->device).
Tensor to_device(const Tensor& t, Device dev, const Options& opt) {
  if (!t.defined() || t.device() == dev) return t;
  Tensor out = Tensor::empty(t.dtype(), t.ndim(), t.view().shape, dev);
  padmoe::copy(t, out, opt);
  return out;
}

// The input tensors of Data (what the ops read).
std::vector<Tensor*> input_tensors(Data& d) {
  Plan& p = d.plan;
  return {&d.top_experts, &d.weights,     &p.indices,  &p.bin_ids,     &p.tokens_per_expert, &p.bins,
          &p.padded_tokens_per_expert,    &p.padded_bins, &p.dest_rows, &p.row_sources,       &d.x,
          &d.grad_out,    &d.y,          &d.grad_y,   &d.h,           &d.grad_unpadded,     &d.padded,
          &d.perm_map,    &d.probs,      &d.x8,       &d.x8_scales, &d.split_sizes};
}

// The output tensors of Data (what the ops write).
std::vector<Tensor*> output_tensors(Data& d) {
  Plan& p = d.plan_out;
  return {&p.indices,    &p.bin_ids,      &p.tokens_per_expert, &p.bins,       &p.padded_tokens_per_expert,
          &p.padded_bins, &p.dest_rows,    &p.row_sources,       &d.out_rows_R, &d.out_rows_R2,
          &d.out_rows_T, &d.out_rows_N,   &d.out_rows_P,        &d.out_f32_A,  &d.out_f32_N,
          &d.out_map_R,  &d.out_offsets_E, &d.out_row_experts_R, &d.out_block_experts, &d.out_total_1,
          &d.out_sorted_V, &d.out_block_ids_V, &d.out_post_1, &d.out_rows8_R, &d.out_scales_R, &d.out_e8m0_R,
          &d.plan_ep.indices, &d.plan_ep.bin_ids, &d.plan_ep.tokens_per_expert, &d.plan_ep.bins,
          &d.plan_ep.padded_tokens_per_expert, &d.plan_ep.padded_bins, &d.plan_ep.dest_rows, &d.plan_ep.row_sources,
          &d.out_dropped_1};
}

// Builds the workload, always on the host; with --device cuda every input is
// then staged to the GPU (padmoe::copy) and the outputs are allocated there.
// With `reference`, the plan the ops run on is the reference plan (so a
// make_plan bug cannot hide in the other checks) and the host float copies are
// made; otherwise the plan is the library's make_plan (run on the host).
Data build_data(const Workload& w, bool reference) {
  Data d;
  d.w = w;
  d.opt.num_threads = w.threads;
  if (w.device.is_cuda()) {
    d.gpu = open_gpu(w.device);  // throws (exit 2) in a build without CUDA or without a GPU
    d.opt.stream = d.gpu->stream;
  }
  const int64_t T = w.T, H = w.H;
  d.A = T * w.K;
  d.N = d.A;
  d.R = capacity_bound(T, w.K, w.E, w.m);

  d.routing = workload::random_router(T, w.E, w.K, stream_seed(w.seed, 0));
  d.top_experts = Tensor::empty(DType::kInt32, {T, w.K});
  std::copy(d.routing.top_experts.begin(), d.routing.top_experts.end(), i32(d.top_experts));
  d.weights = Tensor::empty(DType::kFloat32, {d.A});
  std::copy(d.routing.weights.begin(), d.routing.weights.end(), d.weights.data_as<float>());

  if (reference) {
    d.have_reference = true;
    std::vector<int64_t> te(d.routing.top_experts.begin(), d.routing.top_experts.end());
    d.ref_plan = ref::make_plan(te, T, w.K, w.E, w.m);
    const ref::Plan& rp = d.ref_plan;
    d.plan.indices = plan_tensor(rp.indices);
    d.plan.bin_ids = plan_tensor(rp.bin_ids);
    d.plan.tokens_per_expert = plan_tensor(rp.tokens_per_expert);
    d.plan.bins = plan_tensor(rp.bins);
    d.plan.padded_tokens_per_expert = plan_tensor(rp.padded_tokens_per_expert);
    d.plan.padded_bins = plan_tensor(rp.padded_bins);
    d.plan.dest_rows = plan_tensor(rp.dest_rows);
    d.plan.row_sources = plan_tensor(rp.row_sources);
    d.plan.num_tokens = T;
    d.plan.top_k = w.K;
    d.plan.num_experts = w.E;
    d.plan.alignment = w.m;
    d.P = rp.padded_rows;
  } else {
    d.plan = make_plan(d.top_experts, w.E, w.m, d.opt);
    d.P = padded_rows(d.plan, d.opt);
  }
  const int64_t A = d.A, P = d.P, R = d.R, N = d.N;
  const int32_t* indices = i32(d.plan.indices);
  const int32_t* dest_rows = i32(d.plan.dest_rows);
  const int32_t* row_sources = i32(d.plan.row_sources);

  d.x = random_rows(T, H, w.dtype, stream_seed(w.seed, 1));
  d.grad_out = random_rows(T, H, w.dtype, stream_seed(w.seed, 2));
  d.y = random_rows(P, H, w.dtype, stream_seed(w.seed, 3));
  d.grad_y = random_rows(P, H, w.dtype, stream_seed(w.seed, 4));
  fill_nan_rows(d.y, row_sources, P, H);
  fill_nan_rows(d.grad_y, row_sources, P, H);

  // Megatron inputs: h is what a dispatch without padding produces (x rows in
  // expert-sorted order); `padded` is h padded per the plan's segments.
  d.tokens_per_expert = d.plan.tokens_per_expert;
  d.ep_ranks = w.E % 8 == 0 ? 8 : 1;
  {
    const int64_t local = w.E / d.ep_ranks;
    d.split_sizes = Tensor::empty(DType::kInt32, {d.ep_ranks, local});
    std::copy(i32(d.tokens_per_expert), i32(d.tokens_per_expert) + w.E, i32(d.split_sizes));
    for (int64_t e = 0; e < local; ++e) {
      int64_t rows = 0;
      for (int64_t r = 0; r < d.ep_ranks; ++r) rows += i32(d.split_sizes)[r * local + e];
      d.Pc += (rows + w.m - 1) / w.m * w.m;
    }
  }
  const size_t es = element_size(w.dtype);
  d.h = Tensor::empty(w.dtype, {N, H});
  d.probs = Tensor::empty(DType::kFloat32, {N});
  d.padded = Tensor::empty(w.dtype, {P, H});
  d.perm_map = Tensor::empty(DType::kInt32, {P});
  std::fill(i32(d.perm_map), i32(d.perm_map) + P, -1);
  for (int64_t i = 0; i < A; ++i) {
    const int64_t a = indices[i];
    const int64_t row = dest_rows[a];
    std::memcpy(static_cast<char*>(d.h.data()) + i * H * es, static_cast<const char*>(d.x.data()) + (a / w.K) * H * es,
                H * es);
    std::memcpy(static_cast<char*>(d.padded.data()) + row * H * es, static_cast<const char*>(d.h.data()) + i * H * es,
                H * es);
    i32(d.perm_map)[row] = static_cast<int32_t>(i);
    d.probs.data_as<float>()[i] = d.weights.data_as<float>()[a];
  }
  fill_nan_rows(d.padded, row_sources, P, H);
  d.grad_unpadded = random_rows(N, H, w.dtype, stream_seed(w.seed, 5));
  // float8 e4m3 rows (x rounded) with DeepSeek-V3 blockwise scales [T, ceil(H/128)] in [0.5, 4).
  const int64_t blocks = (H + 127) / 128;
  d.x8 = Tensor::empty(DType::kFloat8E4M3, {T, H});
  for (int64_t i = 0; i < T * H; ++i)
    numeric::store_from_float(d.x8.data(), DType::kFloat8E4M3, i, numeric::load_as_float(d.x.data(), w.dtype, i));
  d.x8_scales = random_rows(T, blocks, DType::kFloat32, stream_seed(w.seed, 6));
  for (int64_t i = 0; i < T * blocks; ++i) {
    float& v = d.x8_scales.data_as<float>()[i];
    v = 0.5f + 1.75f * (v + 1.0f);
  }

  const Device dev = w.device;
  d.plan_out = Plan::empty(T, w.K, w.E, w.m, dev);
  d.out_rows_R = Tensor::empty(w.dtype, {R, H}, dev);
  d.out_rows_R2 = Tensor::empty(w.dtype, {R, H}, dev);
  d.out_rows_T = Tensor::empty(w.dtype, {T, H}, dev);
  d.out_rows_N = Tensor::empty(w.dtype, {N, H}, dev);
  d.out_rows_P = Tensor::empty(w.dtype, {P, H}, dev);
  d.out_f32_A = Tensor::empty(DType::kFloat32, {A}, dev);
  d.out_f32_N = Tensor::empty(DType::kFloat32, {N}, dev);
  d.out_map_R = Tensor::empty(DType::kInt32, {R}, dev);
  d.out_offsets_E = Tensor::empty(DType::kInt32, {w.E}, dev);
  d.out_row_experts_R = Tensor::empty(DType::kInt32, {R}, dev);
  d.out_block_experts = Tensor::empty(DType::kInt32, {(R + w.m - 1) / w.m}, dev);
  d.out_total_1 = Tensor::empty(DType::kInt32, {1}, dev);
  const int64_t V = aligned_rows_bound(A, w.E, w.m);
  d.out_sorted_V = Tensor::empty(DType::kInt32, {V}, dev);
  d.out_block_ids_V = Tensor::empty(DType::kInt32, {(V + w.m - 1) / w.m}, dev);
  d.out_post_1 = Tensor::empty(DType::kInt32, {1}, dev);
  d.out_rows8_R = Tensor::empty(DType::kFloat8E4M3, {R, H}, dev);
  d.out_scales_R = Tensor::empty(DType::kFloat32, {R, blocks}, dev);
  d.out_e8m0_R = Tensor::empty(DType::kUInt8, {R, (H + 31) / 32}, dev);
  d.plan_ep = Plan::empty(T, w.K, w.E / d.ep_ranks, w.m, dev);
  d.out_dropped_1 = Tensor::empty(DType::kInt32, {1}, dev);
  d.expert_capacity = A / w.E / w.m * w.m;

  if (reference) {
    d.x_f = to_floats(d.x);
    d.grad_out_f = to_floats(d.grad_out);
    d.y_f = to_floats(d.y);
    d.grad_y_f = to_floats(d.grad_y);
    d.h_f = to_floats(d.h);
    d.padded_f = to_floats(d.padded);
    d.grad_unpadded_f = to_floats(d.grad_unpadded);
    d.probs_f = to_floats(d.probs);
    d.x8_f = to_floats(d.x8);
    d.x8_scales_f = to_floats(d.x8_scales);
    d.perm_map_ref.assign(i32(d.perm_map), i32(d.perm_map) + P);
    d.tokens_per_expert_ref = d.ref_plan.tokens_per_expert;
    d.split_sizes_ref.assign(i32(d.split_sizes), i32(d.split_sizes) + w.E);
  }
  if (dev.is_cuda()) {  // stage every input (the host copies are dropped)
    for (Tensor* t : input_tensors(d)) *t = to_device(*t, dev, d.opt);
    d.tokens_per_expert = d.plan.tokens_per_expert;
  }
  return d;
}

// The output view v as host memory: v itself on the CPU; for a device output,
// a host mirror of the whole tensor, refreshed by padmoe::copy (synchronous),
// with v's shape and strides.
TensorView on_host(Data& d, const TensorView& v) {
  if (!v.device.is_cuda() || v.data == nullptr) return v;
  for (Tensor* t : output_tensors(d)) {
    if (t->data() != v.data) continue;
    Tensor& host = d.host_mirrors[t->data()];
    if (!host.defined()) host = Tensor::empty(t->dtype(), t->ndim(), t->view().shape);
    padmoe::copy(*t, host, d.opt);
    TensorView h = v;
    h.data = host.data();
    h.device = Device::cpu();
    return h;
  }
  throw Error(ErrorKind::kRuntime, "check: no output tensor holds the device view being compared");
}

// ===========================================================================
// Expected results and their comparison
// ===========================================================================

enum class Cmp {
  kIndex,  // int32 output equal to the reference
  kMove,   // row output bitwise equal to the reference float rounded to the dtype
  kSum,    // within the tolerance rule of a float64 reference
};

struct Expect {
  std::string what;            // output name, for failure messages
  TensorView got;              // the library's output (1-D, or [rows, H])
  int64_t rows = 0, cols = 1;  // compared extent
  int64_t untouched_rows = 0;  // rows after `rows` that must keep the sentinel
  Cmp cmp = Cmp::kMove;
  std::vector<int64_t> index;                    // kIndex
  std::vector<float> move;                       // kMove
  std::vector<double> sum;                       // kSum
  int64_t terms = 0;                             // kSum: n
  std::function<std::vector<double>()> abs_sum;  // kSum: S per element (computed only by `check`)
};

Expect expect_index(std::string what, const TensorView& got, std::vector<int64_t> ref) {
  Expect e;
  e.what = std::move(what);
  e.got = got;
  e.rows = static_cast<int64_t>(ref.size());
  e.cmp = Cmp::kIndex;
  e.index = std::move(ref);
  return e;
}
Expect expect_move(std::string what, const TensorView& got, int64_t rows, int64_t cols, std::vector<float> ref) {
  Expect e;
  e.what = std::move(what);
  e.got = got;
  e.rows = rows;
  e.cols = cols;
  e.cmp = Cmp::kMove;
  e.move = std::move(ref);
  return e;
}
Expect expect_sum(std::string what, const TensorView& got, int64_t rows, int64_t cols, std::vector<double> ref,
                  int64_t terms, std::function<std::vector<double>()> abs_sum) {
  Expect e;
  e.what = std::move(what);
  e.got = got;
  e.rows = rows;
  e.cols = cols;
  e.cmp = Cmp::kSum;
  e.sum = std::move(ref);
  e.terms = terms;
  e.abs_sum = std::move(abs_sum);
  return e;
}

constexpr unsigned char kSentinel = 0x7f;

struct Outcome {
  double max_err = 0.0;
  double max_tol = 0.0;      // largest tolerance met (sums)
  double worst_ratio = 0.0;  // max err/tol over sums
  bool has_sums = false;
  int64_t rows = 0;
  bool ok = true;
  std::string failure;  // the first failure, in words
};

std::string num(double v) { return fmt("%.6g", v); }

void compare(const Expect& e, Outcome& out) {
  const TensorView& g = e.got;
  const size_t es = element_size(g.dtype);
  const int64_t row_stride = g.ndim >= 2 ? g.strides[0] : e.cols;
  auto fail = [&](const std::string& msg) {
    if (out.ok) out.failure = msg;
    out.ok = false;
  };
  const int64_t got_rows = g.ndim == 0 ? 0 : g.shape[0];
  if (got_rows < e.rows + e.untouched_rows || (g.ndim >= 2 && g.shape[1] != e.cols)) {
    fail(e.what + ": shape [" + std::to_string(got_rows) + (g.ndim >= 2 ? ", " + std::to_string(g.shape[1]) : "") +
         "], expected at least " + std::to_string(e.rows + e.untouched_rows) + " rows of " + std::to_string(e.cols));
    return;
  }
  std::vector<double> abs_sum;
  if (e.cmp == Cmp::kSum) {
    abs_sum = e.abs_sum();
    out.has_sums = true;
  }
  const double unit = std::ldexp(1.0, -24);
  const double rel = std::ldexp(1.0, -significand_bits(g.dtype));
  const double floor_abs = half_min_subnormal(g.dtype);
  for (int64_t r = 0; r < e.rows; ++r) {
    for (int64_t c = 0; c < e.cols; ++c) {
      const int64_t j = r * e.cols + c;
      const int64_t at = r * row_stride + c;
      auto where = [&] {
        return e.what + "[" + std::to_string(r) + (e.cols > 1 ? ", " + std::to_string(c) : "") + "]";
      };
      if (e.cmp == Cmp::kIndex) {
        const int64_t v = g.dtype == DType::kInt64 ? static_cast<const int64_t*>(g.data)[at]
                                                   : static_cast<const int32_t*>(g.data)[at];
        if (v != e.index[j]) {
          out.max_err = std::max(out.max_err, std::fabs(static_cast<double>(v - e.index[j])));
          fail(where() + " = " + std::to_string(v) + ", expected " + std::to_string(e.index[j]));
        }
      } else if (e.cmp == Cmp::kMove) {
        uint64_t want = 0;
        numeric::store_from_float(&want, g.dtype, 0, e.move[j]);
        const char* p = static_cast<const char*>(g.data) + at * es;
        if (std::memcmp(p, &want, es) != 0) {
          const double got = numeric::load_as_float(g.data, g.dtype, at);
          const double exp = numeric::load_as_float(&want, g.dtype, 0);
          const double err = std::isnan(got) || std::isnan(exp) ? INFINITY : std::fabs(got - exp);
          out.max_err = std::max(out.max_err, err == 0.0 ? std::numeric_limits<double>::denorm_min() : err);
          fail(where() + " = " + num(got) + ", expected " + num(exp) + " (not bitwise equal)");
        }
      } else {
        const double got = numeric::load_as_float(g.data, g.dtype, at);
        const double ref = e.sum[j];
        const double tol = 2.0 * static_cast<double>(e.terms) * unit * abs_sum[j] + rel * std::fabs(ref) + floor_abs;
        const double err = std::isnan(got) ? INFINITY : std::fabs(got - ref);
        out.max_err = std::max(out.max_err, err);
        out.max_tol = std::max(out.max_tol, tol);
        out.worst_ratio = std::max(out.worst_ratio, err / tol);
        if (!(err <= tol)) fail(where() + " = " + num(got) + ", expected " + num(ref) + " within " + num(tol));
      }
    }
  }
  // Rows past the compared extent (capacity rows past P) must be untouched.
  for (int64_t r = e.rows; r < e.rows + e.untouched_rows; ++r) {
    const unsigned char* p = static_cast<const unsigned char*>(g.data) + r * row_stride * es;
    for (int64_t b = 0; b < e.cols * static_cast<int64_t>(es); ++b) {
      if (p[b] != kSentinel) {
        fail(e.what + ": row " + std::to_string(r) + " (past P = " + std::to_string(e.rows) + ") was written");
        r = e.rows + e.untouched_rows;
        break;
      }
    }
  }
}

std::vector<float> abs_of(const std::vector<float>& v) {
  std::vector<float> a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = std::fabs(v[i]);
  return a;
}

// ===========================================================================
// The op table
// ===========================================================================

struct Dims {
  double T, H, A, P, R, N, E, s, m;
  double Pc;  // sort_chunks' padded rows
};

struct OpCase {
  std::string name;
  std::string bytes_rule;  // the footer's formula
  std::function<double(const Dims&)> min_bytes;
  std::function<void(Data&)> run;                       // the library call, into d's outputs
  std::function<std::vector<Expect>(Data&)> reference;  // the reference loops and the outputs to compare
};

std::vector<OpCase> op_table() {
  using W = std::optional<TensorView>;
  std::vector<OpCase> ops;

  // Byte formulas of SPEC section 7 and their extension to the other ops.
  const std::string kGatherRule = "(T*H + P*H)*s";
  auto gather_bytes = [](const Dims& d) { return (d.T * d.H + d.P * d.H) * d.s; };
  const std::string kScatterRule = "(A*H + T*H)*s";
  auto scatter_bytes = [](const Dims& d) { return (d.A * d.H + d.T * d.H) * d.s; };
  // grad_out read once, y's A real rows read, grad_y's P rows written.
  const std::string kScatterBwdRule = "(T*H + A*H + P*H)*s";
  auto scatter_bwd_bytes = [](const Dims& d) { return (d.T * d.H + d.A * d.H + d.P * d.H) * d.s; };
  // grad_y's A real rows read, x read once (for grad_weights), grad_x written.
  const std::string kGatherBwdRule = "(A*H + 2*T*H)*s";
  auto gather_bwd_bytes = [](const Dims& d) { return (d.A * d.H + 2 * d.T * d.H) * d.s; };

  // The expected values shared by several ops.
  auto gather_ref = [](Data& d, const std::vector<float>& rows, bool weighted) {
    return ref::padded_gather(rows, d.w.H, d.ref_plan, weighted ? &d.routing.weights : nullptr);
  };
  auto scatter_expect = [](Data& d, const std::string& what, const TensorView& got, const std::vector<float>* rows,
                           bool weighted) {
    auto ref = ref::padded_scatter(*rows, d.w.H, d.ref_plan, weighted ? &d.routing.weights : nullptr);
    return expect_sum(what, got, d.w.T, d.w.H, std::move(ref), d.w.K, [&d, rows, weighted] {
      const std::vector<float> abs_w = abs_of(d.routing.weights);
      return ref::padded_scatter(abs_of(*rows), d.w.H, d.ref_plan, weighted ? &abs_w : nullptr);
    });
  };
  auto wgrad_expect = [](Data& d, const std::string& what, const TensorView& got, const std::vector<float>* rows,
                         const std::vector<float>* grad) {
    auto ref = ref::padded_scatter_wgrad(*rows, *grad, d.w.H, d.ref_plan);
    return expect_sum(what, got, d.A, 1, std::move(ref), d.w.H, [&d, rows, grad] {
      return ref::padded_scatter_wgrad(abs_of(*rows), abs_of(*grad), d.w.H, d.ref_plan);
    });
  };
  auto rows_P = [](Data& d, const std::string& what, const TensorView& got, std::vector<float> ref) {
    Expect e = expect_move(what, got, d.P, d.w.H, std::move(ref));
    e.untouched_rows = std::max<int64_t>(0, got.shape[0] - d.P);
    return e;
  };

  ops.push_back(
      {"make_plan", "A*4 + (3*A + 4*E + R)*4 (top_experts read, plan written; R = capacity)",
       [](const Dims& d) { return d.A * 4 + (3 * d.A + 4 * d.E + d.R) * 4; },
       [](Data& d) { make_plan_out(d.top_experts, d.w.E, d.w.m, d.plan_out.view(), d.opt); },
       [](Data& d) {
         ref::Plan rp = ref::make_plan(std::vector<int64_t>(d.routing.top_experts.begin(), d.routing.top_experts.end()),
                                       d.w.T, d.w.K, d.w.E, d.w.m);
         const Plan& o = d.plan_out;
         return std::vector<Expect>{
             expect_index("indices", o.indices, rp.indices),
             expect_index("bin_ids", o.bin_ids, rp.bin_ids),
             expect_index("tokens_per_expert", o.tokens_per_expert, rp.tokens_per_expert),
             expect_index("bins", o.bins, rp.bins),
             expect_index("padded_tokens_per_expert", o.padded_tokens_per_expert, rp.padded_tokens_per_expert),
             expect_index("padded_bins", o.padded_bins, rp.padded_bins),
             expect_index("dest_rows", o.dest_rows, rp.dest_rows),
             expect_index("row_sources", o.row_sources, rp.row_sources)};
       }});

  // The layouts other kernels consume, from make_plan's own pass (DeepGEMM rows, vLLM blocks, P), and vLLM's
  // moe_align_block_size: the references are written from those projects' definitions.
  ops.push_back(
      {"make_plan+layouts", "make_plan + (R + R/m + 1)*4 (row_experts, block_experts, P written)",
       [](const Dims& d) { return d.A * 4 + (3 * d.A + 4 * d.E + d.R) * 4 + (d.R + d.R / d.m + 1) * 4; },
       [](Data& d) {
         PlanLayouts l;
         l.row_experts = d.out_row_experts_R;
         l.block_experts = d.out_block_experts;
         l.padded_total = d.out_total_1;
         make_plan_out(d.top_experts, d.w.E, d.w.m, d.plan_out.view(), l, d.opt);
       },
       [](Data& d) {
         const std::vector<int64_t> te(d.routing.top_experts.begin(), d.routing.top_experts.end());
         return std::vector<Expect>{
             expect_index("row_sources", d.plan_out.row_sources, d.ref_plan.row_sources),
             expect_index("row_experts", d.out_row_experts_R, ref::row_experts(te, d.w.E, d.w.m, d.R)),
             expect_index("block_experts", d.out_block_experts, ref::block_experts(te, d.w.E, d.w.m, d.R)),
             expect_index("padded_total", d.out_total_1, {d.ref_plan.padded_rows})};
       }});
  ops.push_back(
      {"moe_align_block_size", "A*4 + (3*A + 4*E)*4 + (V + V/m + 1)*4 (ids read; plan scratch and vLLM's outputs written; V = A + min(A,E)*(m-1))",
       [](const Dims& d) {
         const double v = d.A + std::min(d.A, d.E) * (d.m - 1);
         return d.A * 4 + (3 * d.A + 4 * d.E) * 4 + (v + v / d.m + 1) * 4;
       },
       [](Data& d) {
         moe_align_block_size_out(d.top_experts, d.w.m, d.w.E, d.out_sorted_V, d.out_block_ids_V, d.out_post_1, d.opt);
       },
       [](Data& d) {
         const std::vector<int64_t> te(d.routing.top_experts.begin(), d.routing.top_experts.end());
         ref::AlignedBlocks r = ref::moe_align_block_size(te, d.w.m, d.w.E, false);
         return std::vector<Expect>{expect_index("sorted_token_ids", d.out_sorted_V, std::move(r.sorted_token_ids)),
                                    expect_index("expert_ids", d.out_block_ids_V, std::move(r.expert_ids)),
                                    expect_index("num_tokens_post_padded", d.out_post_1, {r.num_tokens_post_padded})};
       }});

  // make_plan with PlanOptions (expert parallelism; a capacity with the probs drop policy), against
  // ref::make_plan(..., RoutingOptions).
  auto ep_options = [](const Data& d) {
    PlanOptions po;
    po.global_experts = d.w.E;
    po.first_expert = d.ep_ranks > 1 ? d.w.E / d.ep_ranks : 0;  // rank 1's experts (rank 0's with one rank)
    return po;
  };
  ops.push_back(
      {"make_plan(ep)", "A*4 + (3*A + 4*E/r + R)*4 (ids read, rank 1's plan of E/r local experts written; r = 8 ranks)",
       [](const Dims& d) { return d.A * 4 + (3 * d.A + 4 * d.E / 8 + d.R) * 4; },
       [ep_options](Data& d) {
         make_plan_out(d.top_experts, d.w.E / d.ep_ranks, d.w.m, d.plan_ep.view(), PlanLayouts{}, ep_options(d), d.opt);
       },
       [ep_options](Data& d) {
         ref::RoutingOptions r;
         r.global_experts = d.w.E;
         r.first_expert = ep_options(d).first_expert;
         const ref::RoutedPlan rp = ref::make_plan(
             std::vector<int64_t>(d.routing.top_experts.begin(), d.routing.top_experts.end()), d.w.T, d.w.K,
             d.w.E / d.ep_ranks, d.w.m, r);
         std::vector<int64_t> rows = rp.plan.row_sources;
         rows.resize(static_cast<size_t>(d.plan_ep.row_sources.numel()), -1);
         const Plan& o = d.plan_ep;
         return std::vector<Expect>{expect_index("indices", o.indices, rp.plan.indices),
                                    expect_index("bins", o.bins, rp.plan.bins),
                                    expect_index("padded_bins", o.padded_bins, rp.plan.padded_bins),
                                    expect_index("dest_rows", o.dest_rows, rp.plan.dest_rows),
                                    expect_index("row_sources", o.row_sources, std::move(rows))};
       }});
  ops.push_back(
      {"make_plan(capacity)",
       "A*4 + A*4 + (3*A + 4*E + E*C)*4 (ids and probs read, plan written; C = round_down(A/E, m), largest probs kept)",
       [](const Dims& d) { return 8 * d.A + (3 * d.A + 4 * d.E + d.E * std::floor(d.A / d.E / d.m) * d.m) * 4; },
       [](Data& d) {
         PlanOptions po;
         po.expert_capacity = d.expert_capacity;
         po.drop_policy = DropPolicy::kProbs;
         po.probs = d.weights;
         po.dropped = d.out_dropped_1;
         make_plan_out(d.top_experts, d.w.E, d.w.m, d.plan_out.view(), PlanLayouts{}, po, d.opt);
       },
       [](Data& d) {
         ref::RoutingOptions r;
         r.expert_capacity = d.expert_capacity;
         r.by_probs = true;
         r.probs = d.routing.weights;
         const ref::RoutedPlan rp = ref::make_plan(
             std::vector<int64_t>(d.routing.top_experts.begin(), d.routing.top_experts.end()), d.w.T, d.w.K, d.w.E,
             d.w.m, r);
         std::vector<int64_t> rows = rp.plan.row_sources;
         rows.resize(static_cast<size_t>(d.plan_out.row_sources.numel()), -1);
         const Plan& o = d.plan_out;
         return std::vector<Expect>{expect_index("indices", o.indices, rp.plan.indices),
                                    expect_index("bins", o.bins, rp.plan.bins),
                                    expect_index("padded_bins", o.padded_bins, rp.plan.padded_bins),
                                    expect_index("dest_rows", o.dest_rows, rp.plan.dest_rows),
                                    expect_index("row_sources", o.row_sources, std::move(rows)),
                                    expect_index("dropped", d.out_dropped_1, {rp.dropped})};
       }});

  for (bool weighted : {false, true}) {
    ops.push_back(
        {weighted ? "padded_gather(w)" : "padded_gather", kGatherRule, gather_bytes,
         [weighted](Data& d) {
           const Plan& p = d.plan;
           padded_gather_out(d.x, p.indices, p.bin_ids, p.bins, p.padded_bins, d.w.K, weighted ? W(d.weights) : W(),
                             d.out_rows_R, d.opt);
         },
         [=](Data& d) { return std::vector<Expect>{rows_P(d, "y", d.out_rows_R, gather_ref(d, d.x_f, weighted))}; }});
  }
  for (bool weighted : {false, true}) {
    ops.push_back(
        {weighted ? "padded_scatter(w)" : "padded_scatter", kScatterRule, scatter_bytes,
         [weighted](Data& d) {
           const Plan& p = d.plan;
           padded_scatter_out(d.y, p.indices, p.bin_ids, weighted ? W(d.weights) : W(), p.bins, p.padded_bins, d.w.K,
                              d.out_rows_T, d.opt);
         },
         [=](Data& d) { return std::vector<Expect>{scatter_expect(d, "out", d.out_rows_T, &d.y_f, weighted)}; }});
  }
  ops.push_back(
      {"padded_scatter_wgrad", kScatterRule, scatter_bytes,
       [](Data& d) {
         const Plan& p = d.plan;
         padded_scatter_wgrad_out(d.y, d.grad_out, p.indices, p.bin_ids, p.bins, p.padded_bins, d.w.K, d.out_f32_A,
                                  d.opt);
       },
       [=](Data& d) { return std::vector<Expect>{wgrad_expect(d, "wgrad", d.out_f32_A, &d.y_f, &d.grad_out_f)}; }});
  // Backward ops: without weights only the row gradient exists.
  // d/dx of y[row(a)] = w(a) x[a/K] is sum_k w(a) grad_y[row(a)]: the weighted scatter.
  auto gather_bwd_expect = [=](Data& d, bool weighted) {
    std::vector<Expect> e{scatter_expect(d, "grad_x", d.out_rows_T, &d.grad_y_f, weighted)};
    if (weighted) e.push_back(wgrad_expect(d, "grad_weights", d.out_f32_A, &d.grad_y_f, &d.x_f));
    return e;
  };
  // Without weights, an empty grad_weights view skips the weight gradient.
  auto grad_w_out = [](Data& d, bool weighted) { return weighted ? d.out_f32_A.view() : TensorView{}; };
  auto scatter_bwd_expect = [=](Data& d, const TensorView& grad_y, const TensorView& grad_weights, bool weighted) {
    std::vector<Expect> e{rows_P(d, "grad_y", grad_y, gather_ref(d, d.grad_out_f, weighted))};
    if (weighted) e.push_back(wgrad_expect(d, "grad_weights", grad_weights, &d.y_f, &d.grad_out_f));
    return e;
  };
  for (bool weighted : {false, true}) {
    ops.push_back({weighted ? "padded_gather_backward(w)" : "padded_gather_backward",
                   weighted ? kGatherBwdRule : kScatterRule, weighted ? gather_bwd_bytes : scatter_bytes,
                   [=](Data& d) {
                     const Plan& p = d.plan;
                     padded_gather_backward_out(d.grad_y, d.x, p.indices, p.bin_ids, p.bins, p.padded_bins, d.w.K,
                                                weighted ? W(d.weights) : W(), d.out_rows_T, grad_w_out(d, weighted),
                                                d.opt);
                   },
                   [=](Data& d) { return gather_bwd_expect(d, weighted); }});
  }
  for (bool weighted : {false, true}) {
    ops.push_back(
        {weighted ? "padded_scatter_backward(w)" : "padded_scatter_backward", weighted ? kScatterBwdRule : kGatherRule,
         weighted ? scatter_bwd_bytes : gather_bytes,
         [=](Data& d) {
           const Plan& p = d.plan;
           padded_scatter_backward_out(d.grad_out, d.y, p.indices, p.bin_ids, weighted ? W(d.weights) : W(), p.bins,
                                       p.padded_bins, d.w.K, d.out_rows_R2, grad_w_out(d, weighted), d.opt);
         },
         [=](Data& d) { return scatter_bwd_expect(d, d.out_rows_R2, d.out_f32_A, weighted); }});
  }
  for (bool weighted : {false, true}) {
    ops.push_back(
        {weighted ? "dispatch(w)" : "dispatch", kGatherRule, gather_bytes,
         [weighted](Data& d) { dispatch_out(d.x, d.plan.view(), weighted ? W(d.weights) : W(), d.out_rows_R, d.opt); },
         [=](Data& d) { return std::vector<Expect>{rows_P(d, "y", d.out_rows_R, gather_ref(d, d.x_f, weighted))}; }});
  }
  // dispatch with Options::zero_padding = false: padding rows left unwritten (item 7); real rows checked
  // against the reference, padding rows compared to what the buffer held before the call.
  ops.push_back(
      {"dispatch(no-pad)", "(T*H + A*H)*s (padding rows not written)",
       [](const Dims& d) { return (d.T * d.H + d.A * d.H) * d.s; },
       [](Data& d) {
         Options o = d.opt;
         o.zero_padding = false;
         dispatch_out(d.x, d.plan.view(), W(), d.out_rows_R, o);
       },
       [=](Data& d) {
         // Again into a buffer filled with 3.0 (exact in every row format): real rows as the reference,
         // padding rows and rows past P still 3.0.
         const int64_t H = d.w.H, R = d.out_rows_R.view().shape[0];
         Tensor fill = Tensor::empty(d.w.dtype, {R, H});
         for (int64_t i = 0; i < R * H; ++i) numeric::store_from_float(fill.data(), d.w.dtype, i, 3.0f);
         padmoe::copy(fill, d.out_rows_R, d.opt);
         Options o = d.opt;
         o.zero_padding = false;
         dispatch_out(d.x, d.plan.view(), W(), d.out_rows_R, o);
         std::vector<float> ref = gather_ref(d, d.x_f, false);
         ref.resize(static_cast<size_t>(R * H), 3.0f);
         for (int64_t r = 0; r < d.P; ++r) {
           if (d.ref_plan.row_sources[static_cast<size_t>(r)] >= 0) continue;
           std::fill(ref.begin() + r * H, ref.begin() + (r + 1) * H, 3.0f);
         }
         return std::vector<Expect>{expect_move("y", d.out_rows_R, R, H, std::move(ref))};
       }});
  // float8 e4m3 rows moved with their [T, ceil(H/128)] float32 scales in the same pass (issue 11 item 1):
  // rows and scale rows both checked against the reference (padding rows: zero data, scale 1.0).
  ops.push_back(
      {"dispatch(fp8+scales)", "(T*H + P*H)*1 + (T + P)*ceil(H/128)*4 (e4m3 rows, float32 scales)",
       [](const Dims& d) { return (d.T * d.H + d.P * d.H) * 1.0 + (d.T + d.P) * std::ceil(d.H / 128.0) * 4.0; },
       [](Data& d) { dispatch_scaled_out(d.x8, d.plan.view(), d.x8_scales, d.out_rows8_R, d.out_scales_R, d.opt); },
       [=](Data& d) {
         const int64_t blocks = d.x8_scales.size(1);
         const std::vector<int64_t> sources = ref::spread_sources(d.ref_plan);
         std::vector<float> scales(static_cast<size_t>(d.P * blocks), 1.0f);
         for (int64_t r = 0; r < d.P; ++r) {
           const int64_t t = sources[static_cast<size_t>(r)];
           for (int64_t c = 0; c < blocks && t >= 0; ++c) scales[r * blocks + c] = d.x8_scales_f[t * blocks + c];
         }
         Expect s = expect_move("y_scales", d.out_scales_R, d.P, blocks, std::move(scales));
         s.untouched_rows = std::max<int64_t>(0, d.R - d.P);
         return std::vector<Expect>{rows_P(d, "y", d.out_rows8_R, gather_ref(d, d.x8_f, false)), std::move(s)};
       }});
  // The fused quantizing dispatch (issue 11 item 2): x (the workload's dtype) quantized once per token to
  // e4m3 with DeepSeek-V3 1x128 float32 scales or MXFP8 E8M0 scales, written to its K rows; codes and
  // scales both checked bitwise against the reference quantizer (padding rows: zero codes, scale 1).
  for (bool mx : {false, true}) {
    ops.push_back(
        {mx ? "dispatch(quant-mxfp8)" : "dispatch(quant-128)",
         mx ? "T*H*s + P*H*1 + P*ceil(H/32)*1 (e4m3 codes, E8M0 scales written)"
            : "T*H*s + P*H*1 + P*ceil(H/128)*4 (e4m3 codes, float32 scales written)",
         [mx](const Dims& d) {
           return d.T * d.H * d.s + d.P * d.H * 1.0 + d.P * (mx ? std::ceil(d.H / 32.0) : std::ceil(d.H / 128.0) * 4.0);
         },
         [mx](Data& d) {
           dispatch_quantized_out(d.x, d.plan.view(), d.out_rows8_R, mx ? d.out_e8m0_R : d.out_scales_R, d.opt);
         },
         [=](Data& d) {
           const ref::QuantRows q = ref::dispatch_quantized(
               d.x_f, d.w.H, d.ref_plan, mx ? ref::QuantLayout::kMxE8M0 : ref::QuantLayout::kBlock128, false);
           std::vector<float> codes(q.rows.size()), scales(static_cast<size_t>(d.P * q.cols));
           for (size_t i = 0; i < codes.size(); ++i) codes[i] = ref::fp8_value(q.rows[i], false);
           for (size_t i = 0; i < scales.size(); ++i) {
             if (mx) scales[i] = static_cast<float>(q.scales[i]);
             else std::memcpy(&scales[i], q.scales.data() + 4 * i, 4);
           }
           Expect s = expect_move("y_scales", mx ? d.out_e8m0_R : d.out_scales_R, d.P, q.cols, std::move(scales));
           s.untouched_rows = std::max<int64_t>(0, d.R - d.P);
           return std::vector<Expect>{rows_P(d, "y", d.out_rows8_R, std::move(codes)), std::move(s)};
         }});
  }
  ops.push_back({"combine(w)", kScatterRule, scatter_bytes,
                 [](Data& d) { combine_out(d.y, d.plan.view(), W(d.weights), d.out_rows_T, d.opt); },
                 [=](Data& d) { return std::vector<Expect>{scatter_expect(d, "out", d.out_rows_T, &d.y_f, true)}; }});
  for (bool weighted : {false, true}) {
    ops.push_back({weighted ? "combine_backward(w)" : "combine_backward", weighted ? kScatterBwdRule : kGatherRule,
                   weighted ? scatter_bwd_bytes : gather_bytes,
                   [=](Data& d) {
                     combine_backward_out(d.grad_out, d.y, d.plan.view(), weighted ? W(d.weights) : W(), d.out_rows_R2,
                                          grad_w_out(d, weighted), d.opt);
                   },
                   [=](Data& d) { return scatter_bwd_expect(d, d.out_rows_R2, d.out_f32_A, weighted); }});
  }
  for (bool weighted : {false, true}) {
    ops.push_back({weighted ? "dispatch_backward(w)" : "dispatch_backward", weighted ? kGatherBwdRule : kScatterRule,
                   weighted ? gather_bwd_bytes : scatter_bytes,
                   [=](Data& d) {
                     dispatch_backward_out(d.grad_y, d.x, d.plan.view(), weighted ? W(d.weights) : W(), d.out_rows_T,
                                           grad_w_out(d, weighted), d.opt);
                   },
                   [=](Data& d) { return gather_bwd_expect(d, weighted); }});
  }

  ops.push_back(
      {"pad_to_alignment", "(N*H + P*H)*s (N = A expert-grouped rows)",
       [](const Dims& d) { return (d.N * d.H + d.P * d.H) * d.s; },
       [](Data& d) {
         pad_to_alignment_out(d.h, d.tokens_per_expert, d.w.m, d.out_rows_R, d.out_map_R, d.out_offsets_E, d.opt);
       },
       [=](Data& d) {
         ref::PadResult r = ref::pad_to_alignment(d.h_f, d.w.H, d.tokens_per_expert_ref, d.w.m);
         std::vector<int64_t> map = r.permutation_map;
         map.resize(static_cast<size_t>(d.R), -1);  // entries past P are set to -1
         return std::vector<Expect>{rows_P(d, "padded", d.out_rows_R, std::move(r.padded)),
                                    expect_index("permutation_map", d.out_map_R, std::move(map)),
                                    expect_index("inclusive_offsets", d.out_offsets_E, std::move(r.inclusive_offsets))};
       }});
  for (bool with_probs : {false, true}) {
    ops.push_back(
        {with_probs ? "unpad_from_alignment(probs)" : "unpad_from_alignment",
         "(N*H + N*H)*s (real rows read, N rows written)", [](const Dims& d) { return 2 * d.N * d.H * d.s; },
         [with_probs](Data& d) {
           unpad_from_alignment_out(d.padded, d.perm_map, with_probs ? W(d.probs) : W(), d.out_rows_N, d.opt);
         },
         [=](Data& d) {
           return std::vector<Expect>{expect_move(
               "out", d.out_rows_N, d.N, d.w.H,
               ref::unpad_from_alignment(d.padded_f, d.w.H, d.perm_map_ref, d.N, with_probs ? &d.probs_f : nullptr))};
         }});
  }
  ops.push_back({"unpad_from_alignment_backward(probs)", "(2*N*H + P*H)*s (grad_out, real padded rows, grad_padded)",
                 [](const Dims& d) { return (2 * d.N * d.H + d.P * d.H) * d.s; },
                 [](Data& d) {
                   unpad_from_alignment_backward_out(d.grad_unpadded, d.padded, d.perm_map, W(d.probs), d.out_rows_P,
                                                     d.out_f32_N, d.opt);
                 },
                 [=](Data& d) {
                   ref::UnpadGrads g = ref::unpad_from_alignment_backward(d.grad_unpadded_f, d.padded_f, d.w.H,
                                                                          d.perm_map_ref, &d.probs_f);
                   return std::vector<Expect>{
                       expect_move("grad_padded", d.out_rows_P, d.P, d.w.H, std::move(g.grad_padded)),
                       expect_sum("grad_probs", d.out_f32_N, d.N, 1, std::move(g.grad_probs), d.w.H, [&d] {
                         return ref::unpad_from_alignment_backward(abs_of(d.grad_unpadded_f), abs_of(d.padded_f), d.w.H,
                                                                   d.perm_map_ref, &d.probs_f)
                             .grad_probs;
                       })};
                 }});

  // The chunk sort after an expert-parallel all-to-all (ops.hpp section 5): h as the rank-major
  // receive buffer of ep_ranks ranks, into the expert-major padded layout of E/ep_ranks experts.
  auto local_offsets = [](Data& d) {
    TensorView v = d.out_offsets_E.view();
    v.shape[0] = d.w.E / d.ep_ranks;
    return v;
  };
  ops.push_back(
      {"sort_chunks", "(N*H + Pc*H)*s (N = A rank-major rows of 8 ranks, Pc = its padded rows)",
       [](const Dims& d) { return (d.N * d.H + d.Pc * d.H) * d.s; },
       [=](Data& d) {
         sort_chunks_out(d.h, d.split_sizes, d.ep_ranks, d.w.m, std::nullopt, d.out_rows_R, d.out_map_R,
                         local_offsets(d), d.opt);
       },
       [=](Data& d) {
         ref::PadResult r = ref::sort_chunks(d.h_f, d.w.H, d.split_sizes_ref, d.ep_ranks, d.w.m, nullptr);
         std::vector<int64_t> map = r.permutation_map;
         map.resize(static_cast<size_t>(d.R), -1);  // entries past P are set to -1
         Expect rows = expect_move("padded", d.out_rows_R, r.padded_rows, d.w.H, std::move(r.padded));
         rows.untouched_rows = std::max<int64_t>(0, d.out_rows_R.view().shape[0] - r.padded_rows);
         return std::vector<Expect>{std::move(rows), expect_index("permutation_map", d.out_map_R, std::move(map)),
                                    expect_index("inclusive_offsets", local_offsets(d),
                                                 std::move(r.inclusive_offsets))};
       }});

  // The decode question: route and move a small batch end to end. make_plan
  // into the output plan, an unweighted dispatch on it, then the weighted
  // combine of the dispatched rows (standing in for the expert outputs), back
  // to back; on a GPU nothing synchronizes between them.
  ops.push_back(
      {"plan+dispatch+combine", "make_plan + (T*H + P*H)*s + (A*H + T*H)*s (the three rules summed)",
       [=](const Dims& d) { return d.A * 4 + (3 * d.A + 4 * d.E + d.R) * 4 + gather_bytes(d) + scatter_bytes(d); },
       [](Data& d) {
         make_plan_out(d.top_experts, d.w.E, d.w.m, d.plan_out.view(), d.opt);
         const PlanView plan = d.plan_out.view();
         dispatch_out(d.x, plan, W(), d.out_rows_R, d.opt);
         combine_out(d.out_rows_R, plan, W(d.weights), d.out_rows_T, d.opt);
       },
       [=](Data& d) {
         d.composite_f = gather_ref(d, d.x_f, false);  // exact: an unweighted move
         return std::vector<Expect>{scatter_expect(d, "out", d.out_rows_T, &d.composite_f, true)};
       }});
  return ops;
}

// ===========================================================================
// Shared printing
// ===========================================================================

Dims dims_of(const Data& d) {
  return Dims{static_cast<double>(d.w.T), static_cast<double>(d.w.H),
              static_cast<double>(d.A),   static_cast<double>(d.P),
              static_cast<double>(d.R),   static_cast<double>(d.N),
              static_cast<double>(d.w.E), static_cast<double>(element_size(d.w.dtype)),
              static_cast<double>(d.w.m), static_cast<double>(d.Pc)};
}

int used_threads(const Workload& w) { return w.threads > 0 ? w.threads : hardware_threads(); }

void print_header(const char* command, const Data& d) {
  const Workload& w = d.w;
  std::printf("padmoe %s: workload %s\n", command, w.label.c_str());
  std::printf("  T=%" PRId64 " E=%d K=%d H=%" PRId64 " m=%d  A=%" PRId64 " P=%" PRId64 " capacity=%" PRId64
              "  dtype %s  device %s  seed %" PRIu64 "\n",
              w.T, w.E, w.K, w.H, w.m, d.A, d.P, d.R, dtype_name(w.dtype), device_name(w.device).c_str(), w.seed);
  if (d.gpu)
    std::printf("  card %s (%s)  %s\n\n", d.gpu->card.c_str(), device_name(w.device).c_str(), utc_now().c_str());
  else
    std::printf("  threads %d (machine: %d hardware threads)  %s\n\n", used_threads(w), hardware_threads(),
                utc_now().c_str());
}

// Large workloads take a while: say what runs now (stderr, so stdout stays a table).
void progress(const char* command, size_t i, size_t n, const std::string& name) {
  std::fprintf(stderr, "[%zu/%zu] %s %s...\n", i + 1, n, command, name.c_str());
}

void fill_sentinel(const Data& d, const Tensor& t) {
  if (!t.defined()) return;
  if (t.device().is_cuda())
    gpu_memset(*d.gpu, t, kSentinel);  // ordered on the ops' stream
  else
    std::memset(t.data(), kSentinel, static_cast<size_t>(t.numel()) * element_size(t.dtype()));
}

void fill_outputs_with_sentinel(Data& d) {
  for (const Tensor* t : output_tensors(d)) fill_sentinel(d, *t);
}

// ===========================================================================
// padmoe check
// ===========================================================================

// --ops: a comma-separated list of op names (all ops when absent).
bool op_selected(const Args& args, const std::string& name) {
  if (!args.has("ops")) return true;
  const std::string list = "," + args.get("ops", "") + ",";
  return list.find("," + name + ",") != std::string::npos;
}

int cmd_check(const Args& args) {
  const Workload w = parse_workload(args);
  Data d = build_data(w, /*reference=*/true);
  print_header("check", d);
  const std::vector<OpCase> ops = op_table();
  const bool large = static_cast<double>(d.R) * static_cast<double>(w.H) > (1 << 26);

  std::printf("%-38s %12s  %-30s %12s  %s\n", "op", "max abs err", "tolerance / exact", "rows checked", "result");
  int failures = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const OpCase& op = ops[i];
    if (!op_selected(args, op.name)) continue;
    if (large) progress("check", i, ops.size(), op.name);
    Outcome out;
    try {
      fill_outputs_with_sentinel(d);
      op.run(d);
      std::vector<Expect> expects = op.reference(d);
      for (Expect& e : expects) {
        e.got = on_host(d, e.got);  // --device cuda: the whole output, copied back
        compare(e, out);
      }
      out.rows = expects.empty() ? 0 : expects.front().rows;
    } catch (const Error& e) {
      out.ok = false;
      out.failure = std::string("raised padmoe::Error: ") + e.what();
    }
    const std::string tol =
        out.has_sums ? "<= " + num(out.max_tol) + " (err/tol " + fmt("%.3g", out.worst_ratio) + ")" : "exact";
    std::printf("%-38s %12s  %-30s %12" PRId64 "  %s\n", op.name.c_str(), num(out.max_err).c_str(), tol.c_str(),
                out.rows, out.ok ? "PASS" : "FAIL");
    if (!out.ok) {
      std::printf("    first failure: %s\n", out.failure.c_str());
      ++failures;
    }
    std::fflush(stdout);
  }
  const int p = significand_bits(w.dtype);
  std::printf(
      "\nmoves (gather, dispatch, grad_y, pad, unpad, grad_padded): bitwise equal to the reference float\n"
      "  rounded to %s; capacity rows past P must keep their previous contents.\n"
      "sums (scatter, combine, wgrad, grad_x, grad_weights, grad_probs), against a float64 reference:\n"
      "  |got - ref| <= 2*n*2^-24*S + 2^-p*|ref| + 2^-%d (half the smallest %s subnormal),\n"
      "  n = terms summed, S = sum of |terms|, p = 24/11/8 for f32/f16/bf16 (here %d).\n"
      "inputs in padded layout hold NaN in their padding rows (no op may read them); the gather\n"
      "backward grad_x is checked against the weighted scatter (d/dx of w*x).\n",
      dtype_name(w.dtype), -static_cast<int>(std::ilogb(half_min_subnormal(w.dtype))), dtype_name(w.dtype), p);
  if (d.gpu) {
    std::printf(
        "%s: workload built on the host, inputs staged with padmoe::copy, outputs (capacity-sized where padded)\n"
        "  pre-filled with the sentinel on the device, ops in checked mode (check_data=true) on one stream,\n"
        "  each compared output copied back whole.\n",
        device_name(w.device).c_str());
  }
  if (failures == 0)
    std::printf("%zu ops: all PASS\n", ops.size());
  else
    std::printf("%zu ops: %d FAIL\n", ops.size(), failures);
  return failures == 0 ? 0 : 1;
}

// ===========================================================================
// padmoe bench
// ===========================================================================

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

template <typename Fn>
void run_on_threads(int threads, Fn fn) {
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(fn, t);
  fn(0);
  for (std::thread& th : pool) th.join();
}

// Copy bandwidths of this machine on one pair of 512 MiB buffers, bytes
// counted as read + written, median of 7 runs each:
//   memcpy: glibc memcpy split into one contiguous chunk per thread (the
//           floor of SPEC section 7 and %memcpy);
//   copy:   padmoe::copy on the same buffers and thread count (streaming
//           stores past 64 MiB), after one untimed run that starts its
//           worker threads (%copy).
struct CopyBandwidth {
  double memcpy_gbps = 0;
  double copy_gbps = 0;
};

CopyBandwidth measure_copy_bandwidth(int threads) {
  const size_t bytes = size_t{512} << 20;
  // Allocated like every padmoe buffer (Tensor::empty), so both sides of the
  // ratio see the same pages.
  const Tensor src_t = Tensor::empty(DType::kFloat8E4M3, {static_cast<int64_t>(bytes)});
  const Tensor dst_t = Tensor::empty(DType::kFloat8E4M3, {static_cast<int64_t>(bytes)});
  struct Buf { char* p; char* get() const { return p; } };
  const Buf src{static_cast<char*>(src_t.data())}, dst{static_cast<char*>(dst_t.data())};
  auto chunk = [&](int t, size_t* off, size_t* len) {
    const size_t per = (bytes / threads + 63) / 64 * 64;
    *off = std::min(bytes, per * t);
    *len = std::min(bytes - *off, per);
  };
  run_on_threads(threads, [&](int t) {  // first touch by the copying thread
    size_t off, len;
    chunk(t, &off, &len);
    std::memset(src.get() + off, t + 1, len);
    std::memset(dst.get() + off, 0, len);
  });
  std::vector<double> seconds;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = Clock::now();
    run_on_threads(threads, [&](int t) {
      size_t off, len;
      chunk(t, &off, &len);
      std::memcpy(dst.get() + off, src.get() + off, len);
    });
    seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  CopyBandwidth bw;
  bw.memcpy_gbps = 2.0 * static_cast<double>(bytes) / median(seconds) / 1e9;

  Options opt;
  opt.num_threads = threads;
  padmoe::copy(src_t, dst_t, opt);  // untimed: starts padmoe's worker threads
  seconds.clear();
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = Clock::now();
    padmoe::copy(src_t, dst_t, opt);
    seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  bw.copy_gbps = 2.0 * static_cast<double>(bytes) / median(seconds) / 1e9;
  return bw;
}

struct BenchRecord {
  std::string name;
  double us = 0, min_bytes = 0, gbps = 0, floor_us = 0, copy_us = 0, ref_us = -1;
  std::string error;
};

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20)
      o += ' ';
    else
      o += c;
  }
  return o;
}

std::string json_num(double v) { return std::isfinite(v) ? fmt("%.6g", v) : "null"; }

// --device cuda: the floor. padmoe::copy of a 1 GiB buffer device->device on
// the ops' stream, timed with CUDA events (cold L2 like every op), bytes
// counted as read + written, median of 10 after one untimed copy.
constexpr int64_t kGpuCopyBytes = int64_t{1} << 30;
constexpr int kGpuCopyReps = 10;
constexpr int64_t kL2FlushBytes = int64_t{256} << 20;

// Cold L2 without dirty lines: a read-only pass over 256 MiB of scratch rows
// (padmoe's own wgrad: 1024 rows x 128 KiB of y and of grad, 1024 floats
// written) evicts the previous run's data and leaves L2 holding clean lines,
// so no write-back of a flush lands inside the next timed run (a memset flush
// would leave up to the whole L2 dirty: ~12 us of write-back at 4.2 TB/s,
// which dominated decode-sized ops).
struct L2Flush {
  static constexpr int64_t kRows = 1024;
  static constexpr int64_t kCols = kL2FlushBytes / 2 / kRows / 2;  // bf16 elements per row
  Tensor y, grad, indices, bin_ids, bins, padded_bins, out;
  Options opt;
  L2Flush(const Data& d, const GpuContext& g) {
    const Device dev = d.w.device;
    y = Tensor::empty(DType::kBFloat16, {kRows, kCols}, dev);
    grad = Tensor::empty(DType::kBFloat16, {kRows, kCols}, dev);
    out = Tensor::empty(DType::kFloat32, {kRows}, dev);
    gpu_memset(g, y, 0);
    gpu_memset(g, grad, 0);
    std::vector<int32_t> ids(kRows), zeros(kRows, 0);
    for (int64_t i = 0; i < kRows; ++i) ids[i] = static_cast<int32_t>(i);
    const int32_t total = static_cast<int32_t>(kRows);
    auto staged = [&](const int32_t* host, int64_t n) {
      Tensor t = Tensor::empty(DType::kInt32, {n}, dev);
      padmoe::copy(TensorView::contiguous(const_cast<int32_t*>(host), DType::kInt32, {n}), t, d.opt);
      return t;
    };
    indices = staged(ids.data(), kRows);
    bin_ids = staged(zeros.data(), kRows);
    bins = staged(&total, 1);
    padded_bins = staged(&total, 1);
    opt = d.opt;
    opt.check_data = false;
  }
  void operator()() const { padded_scatter_wgrad_out(y, grad, indices, bin_ids, bins, padded_bins, 1, out, opt); }
};

double measure_gpu_copy_gbps(Data& d, const std::function<void()>& flush) {
  const Tensor src = Tensor::empty(DType::kFloat8E4M3, {kGpuCopyBytes}, d.w.device);
  const Tensor dst = Tensor::empty(DType::kFloat8E4M3, {kGpuCopyBytes}, d.w.device);
  gpu_memset(*d.gpu, src, 1);
  gpu_memset(*d.gpu, dst, 0);
  const std::vector<double> us =
      gpu_time_us(*d.gpu, [&] { padmoe::copy(src, dst, d.opt); }, 1, kGpuCopyReps, flush);
  const double t = median(us);
  return t > 0 ? 2.0 * static_cast<double>(kGpuCopyBytes) / (t * 1e-6) / 1e9 : 0.0;
}

int cmd_bench(const Args& args) {
  const Workload w = parse_workload(args);
  const bool on_gpu = w.device.is_cuda();
  const int warmup = static_cast<int>(args.get_int("warmup", on_gpu ? 5 : 2));
  const int iters = static_cast<int>(args.get_int("iters", on_gpu ? 50 : 10));
  const bool with_reference = !args.has("no-reference");
  const bool json = args.has("json");
  if (warmup < 0 || iters < 1) throw UsageError("--warmup must be >= 0 and --iters >= 1");

  Data d = build_data(w, with_reference);
  const Dims dims = dims_of(d);
  const std::vector<OpCase> ops = op_table();
  const int threads = used_threads(w);

  // The floor: memcpy on the CPU; padmoe::copy device->device on a GPU.
  double memcpy_gbps = 0, copy_gbps = 0, floor_gbps = 0;
  std::function<void()> flush;  // GPU only
  Tensor workspace;
  size_t workspace_bytes = 0;
  if (on_gpu) {
    // The sync-free fast path, a caller workspace (no allocation is timed), and
    // a scratch buffer whose overwrite before each timed run evicts L2.
    d.opt.check_data = false;
    workspace_bytes = workspace_bound(w.T, w.K, w.E, w.m);
    workspace = Tensor::empty(DType::kFloat8E4M3, {std::max<int64_t>(1, static_cast<int64_t>(workspace_bytes))},
                              w.device);
    d.opt.workspace = workspace.data();
    d.opt.workspace_bytes = workspace_bytes;
    flush = L2Flush(d, *d.gpu);
    std::fprintf(stderr, "[copy] measuring padmoe::copy device->device bandwidth on %s (%s)...\n",
                 device_name(w.device).c_str(), d.gpu->card.c_str());
    copy_gbps = floor_gbps = measure_gpu_copy_gbps(d, flush);
  } else {
    std::fprintf(stderr, "[memcpy] measuring memcpy and padmoe::copy bandwidth on %d threads...\n", threads);
    const CopyBandwidth bw = measure_copy_bandwidth(threads);
    memcpy_gbps = floor_gbps = bw.memcpy_gbps;
    copy_gbps = bw.copy_gbps;
  }

  std::vector<BenchRecord> records;
  for (size_t i = 0; i < ops.size(); ++i) {
    const OpCase& op = ops[i];
    if (!op_selected(args, op.name)) continue;
    progress("bench", i, ops.size(), op.name);
    BenchRecord r;
    r.name = op.name;
    r.min_bytes = op.min_bytes(dims);
    r.floor_us = r.min_bytes / (floor_gbps * 1e9) * 1e6;
    r.copy_us = r.min_bytes / (copy_gbps * 1e9) * 1e6;  // the same bytes at padmoe::copy's bandwidth
    try {
      std::vector<double> us;
      if (on_gpu) {
        us = gpu_time_us(*d.gpu, [&] { op.run(d); }, warmup, iters, flush);
      } else {
        for (int k = 0; k < warmup; ++k) op.run(d);
        for (int k = 0; k < iters; ++k) {
          const auto t0 = Clock::now();
          op.run(d);
          us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        }
      }
      r.us = median(us);
      r.gbps = r.us > 0 ? r.min_bytes / (r.us * 1e-6) / 1e9 : 0.0;
      if (with_reference) {
        const auto t0 = Clock::now();
        const std::vector<Expect> discarded = op.reference(d);
        r.ref_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      }
    } catch (const Error& e) {
      r.error = e.what();
    }
    records.push_back(r);
  }

  int errors = 0;
  for (const BenchRecord& r : records) errors += r.error.empty() ? 0 : 1;

  const std::string timing_words =
      on_gpu ? "CUDA events around each call on one stream; cold L2 (a read-only pass over 256 MiB before each timed "
               "run, outside the timed region, leaving no dirty lines); check_data=false (the sync-free fast path); caller workspace "
               "(padmoe::workspace_bound)"
             : "steady_clock wall time";
  if (json) {
    std::printf("{\"command\": \"bench\", \"date\": \"%s\", \"device\": \"%s\", \"card\": %s,\n"
                " \"workload\": {\"label\": \"%s\", \"tokens\": %" PRId64
                ", \"experts\": %d, \"top_k\": %d, \"hidden\": %" PRId64
                ", \"alignment\": %d, \"assignments\": %" PRId64 ", \"padded_rows\": %" PRId64
                ", \"capacity\": %" PRId64
                ", \"dtype\": \"%s\", \"device\": \"%s\", "
                "\"seed\": %" PRIu64 "},\n",
                utc_now().c_str(), device_name(w.device).c_str(),
                on_gpu ? ("\"" + json_escape(d.gpu->card) + "\"").c_str() : "null", json_escape(w.label).c_str(), w.T,
                w.E, w.K, w.H, w.m, d.A, d.P, d.R, dtype_name(w.dtype), device_name(w.device).c_str(), w.seed);
    if (on_gpu) {
      std::printf(
          " \"timing\": \"%s\", \"cold_l2\": true, \"l2_flush_bytes\": %" PRId64
          ", \"check_data\": false, \"workspace_bytes\": %zu, \"warmup\": %d, \"iters\": %d,\n"
          " \"floor\": \"padmoe::copy device->device\", \"copy_bytes\": %" PRId64
          ", \"copy_reps\": %d, \"copy_gbps\": %s, \"copy_tbps\": %s, \"memcpy_gbps\": null,\n"
          " \"ops\": [\n",
          json_escape(timing_words).c_str(), kL2FlushBytes, workspace_bytes, warmup, iters, kGpuCopyBytes,
          kGpuCopyReps, json_num(copy_gbps).c_str(), json_num(copy_gbps / 1e3).c_str());
    } else {
      std::printf(
          " \"timing\": \"%s\", \"threads\": %d, \"hardware_threads\": %d, \"warmup\": %d, \"iters\": %d,"
          " \"floor\": \"memcpy\", \"memcpy_gbps\": %s, \"copy_gbps\": %s, \"copy_tbps\": %s,\n"
          " \"ops\": [\n",
          json_escape(timing_words).c_str(), threads, hardware_threads(), warmup, iters, json_num(memcpy_gbps).c_str(),
          json_num(copy_gbps).c_str(), json_num(copy_gbps / 1e3).c_str());
    }
    for (size_t i = 0; i < records.size(); ++i) {
      const BenchRecord& r = records[i];
      const bool ok = r.error.empty();
      std::printf(
          "  {\"name\": \"%s\", \"us\": %s, \"gbps\": %s, \"tbps\": %s, \"min_bytes\": %.0f, \"floor_us\": %s, "
          "\"time_over_floor\": %s, \"pct_memcpy\": %s, \"pct_copy\": %s, \"reference_us\": %s, "
          "\"error\": %s}%s\n",
          r.name.c_str(), ok ? json_num(r.us).c_str() : "null", ok ? json_num(r.gbps).c_str() : "null",
          ok ? json_num(r.gbps / 1e3).c_str() : "null", r.min_bytes, json_num(r.floor_us).c_str(),
          ok ? json_num(r.us / r.floor_us).c_str() : "null",
          ok && !on_gpu ? json_num(100.0 * r.floor_us / r.us).c_str() : "null",
          ok ? json_num(100.0 * r.copy_us / r.us).c_str() : "null",
          r.ref_us >= 0 ? json_num(r.ref_us).c_str() : "null",
          ok ? "null" : ("\"" + json_escape(r.error) + "\"").c_str(), i + 1 < records.size() ? "," : "");
    }
    std::printf(" ]}\n");
    return errors == 0 ? 0 : 1;
  }

  print_header("bench", d);
  if (on_gpu) {
    std::printf("device copy (the floor): %.3f TB/s (padmoe::copy device->device, 1 GiB, read + write bytes, CUDA "
                "events, median of %d)\n",
                copy_gbps / 1e3, kGpuCopyReps);
    std::printf(
        "timing: median of %d runs after %d warm-up runs; CUDA events around each call on one stream;\n"
        "  cold L2: a read-only pass over 256 MiB of scratch (padmoe wgrad) before each timed run, outside the "
        "timed region, so L2 holds clean lines;\n"
        "  check_data=false (the sync-free fast path); caller workspace of %zu bytes (padmoe::workspace_bound), so "
        "no allocation is timed\n\n",
        iters, warmup, workspace_bytes);
    std::printf("%-38s %10s %8s %10s %10s %9s %12s\n", "op", "us", "TB/s", "floor us", "time/floor", "%copy",
                with_reference ? "reference us" : "");
    for (const BenchRecord& r : records) {
      if (!r.error.empty()) {
        std::printf("%-38s error: %s\n", r.name.c_str(), r.error.c_str());
        continue;
      }
      std::printf("%-38s %10.1f %8.3f %10.1f %10.2f %8.1f%% %12s\n", r.name.c_str(), r.us, r.gbps / 1e3, r.floor_us,
                  r.us / r.floor_us, 100.0 * r.copy_us / r.us, r.ref_us >= 0 ? fmt("%.0f", r.ref_us).c_str() : "");
    }
    std::printf(
        "\nfloor us = min_bytes / device copy bandwidth; %%copy = floor / time; TB/s = min_bytes / time.\n"
        "min_bytes (s = %zu bytes per element; A = T*K, P = padded rows, N = A, R = capacity):\n",
        element_size(w.dtype));
  } else {
    std::printf("memcpy: %.1f GB/s (512 MiB, %d threads, read + write bytes, median of 7)\n", memcpy_gbps, threads);
    std::printf(
        "streaming copy: %.1f GB/s (padmoe::copy)  same buffers, threads and bytes as memcpy, median of 7 after 1 "
        "warm-up\n",
        copy_gbps);
    std::printf("timing: median of %d runs after %d warm-up runs, steady_clock wall time\n\n", iters, warmup);
    std::printf("%-38s %10s %8s %10s %10s %9s %9s %12s\n", "op", "us", "GB/s", "floor us", "time/floor", "%memcpy",
                "%copy", with_reference ? "reference us" : "");
    for (const BenchRecord& r : records) {
      if (!r.error.empty()) {
        std::printf("%-38s error: %s\n", r.name.c_str(), r.error.c_str());
        continue;
      }
      std::printf("%-38s %10.1f %8.1f %10.1f %10.2f %8.1f%% %8.1f%% %12s\n", r.name.c_str(), r.us, r.gbps, r.floor_us,
                  r.us / r.floor_us, 100.0 * r.floor_us / r.us, 100.0 * r.copy_us / r.us,
                  r.ref_us >= 0 ? fmt("%.0f", r.ref_us).c_str() : "");
    }
    std::printf(
        "\nfloor us = min_bytes / memcpy bandwidth; %%memcpy = floor / time; GB/s = min_bytes / time.\n"
        "streaming copy: padmoe::copy on the memcpy buffers (non-temporal stores past 64 MiB); a second ceiling, "
        "not the floor.\n"
        "%%copy = (min_bytes / streaming copy bandwidth) / time: the op's speed as a share of padmoe::copy's.\n"
        "min_bytes (s = %zu bytes per element; A = T*K, P = padded rows, N = A, R = capacity):\n",
        element_size(w.dtype));
  }
  std::vector<std::string> seen;
  for (const OpCase& op : ops) {
    if (std::find(seen.begin(), seen.end(), op.bytes_rule) != seen.end()) continue;
    seen.push_back(op.bytes_rule);
    std::string users;
    for (const OpCase& o : ops) {
      if (o.bytes_rule == op.bytes_rule) users += (users.empty() ? "" : ", ") + o.name;
    }
    std::printf("  %-58s %s\n", op.bytes_rule.c_str(), users.c_str());
  }
  if (with_reference) std::printf("reference us: the single-threaded CPU reference loops (src/reference), run once.\n");
  return errors == 0 ? 0 : 1;
}

// ===========================================================================
// padmoe plan / presets
// ===========================================================================

int cmd_plan(const Args& args) {
  const std::string target_name = args.get("target", "cpu");
  TileTarget target;
  if (!parse_tile_target(target_name, &target))
    throw UsageError("--target expects cpu, ascend-a2 or gpu, got '" + target_name + "'");
  if (!args.has("hidden")) throw UsageError("plan needs --hidden H");
  const int64_t hidden = args.get_int("hidden", 0);
  if (hidden < 1) throw UsageError("--hidden must be >= 1");
  const DType dtype = parse_dtype(args.get("dtype", "bf16"));
  const int cores = static_cast<int>(args.get_int("cores", 0));
  if (cores < 0) throw UsageError("--cores must be >= 0");

  std::vector<TileOp> tile_ops;
  const std::string op_name = args.get("op", "all");
  if (op_name == "gather")
    tile_ops = {TileOp::kGather};
  else if (op_name == "scatter")
    tile_ops = {TileOp::kScatter};
  else if (op_name == "wgrad")
    tile_ops = {TileOp::kWgrad};
  else if (op_name == "all")
    tile_ops = {TileOp::kGather, TileOp::kScatter, TileOp::kWgrad};
  else
    throw UsageError("--op expects gather, scatter or wgrad, got '" + op_name + "'");

  const TargetInfo info = target_info(target, cores);
  std::printf("target %s: %d cores x %d program(s), buffer %" PRId64 " B per program, %" PRId64
              " B reserved, %d buffer(s)\n",
              tile_target_name(info.target), info.cores, info.programs_per_core, info.buffer_total_bytes,
              info.reserve_bytes, info.buffers);
  int invalid = 0;
  for (TileOp op : tile_ops) {
    const TileConfig c = plan_tiles(info, op, hidden, dtype);
    std::printf("\n%s, hidden %" PRId64 ", %s:\n", tile_op_name(op), hidden, dtype_name(dtype));
    std::printf("  TileConfig{programs=%d, sub_block_rows=%d, block_x=%d, buffer_bytes=%" PRId64 ", buffers=%d}\n",
                c.programs, c.sub_block_rows, c.block_x, c.buffer_bytes, c.buffers);
    const int64_t used = tile_buffer_bytes(op, c, dtype);
    std::printf("  tile_buffer_bytes %" PRId64 " <= buffer_bytes %" PRId64 "? %s\n", used, c.buffer_bytes,
                used <= c.buffer_bytes ? "yes" : "NO");
    std::istringstream description(describe_tile_config(op, c, hidden, dtype));
    for (std::string line; std::getline(description, line);) {
      if (!line.empty()) std::printf("  | %s\n", line.c_str());
    }
    try {
      validate_tile_config(op, c, hidden, dtype);
      std::printf("  valid: yes\n");
    } catch (const Error& e) {
      std::printf("  valid: NO: %s\n", e.what());
      ++invalid;
    }
  }
  return invalid == 0 ? 0 : 1;
}

int cmd_presets() {
  std::printf("%-15s %7s %5s %3s %6s %4s  %s\n", "preset", "T", "E", "K", "H", "m", "about");
  for (const workload::Preset& p : workload::presets()) {
    std::printf("%-15s %7" PRId64 " %5d %3d %6" PRId64 " %4d  %s%s\n", p.name.c_str(), p.tokens, p.experts, p.top_k,
                p.hidden, p.alignment, p.about.c_str(), p.name == workload::default_preset_name() ? " (default)" : "");
  }
  std::printf(
      "\n--small divides T by 8; with no --preset and no size flags, check and bench use\n"
      "%s --small.\n",
      workload::default_preset_name());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse_args(argc, argv);
    if (args.has("help") || args.command.empty() || args.command == "help") {
      const bool asked = args.has("help") || args.command == "help";
      std::fputs(kUsage, asked ? stdout : stderr);
      return asked ? 0 : 2;
    }
    if (args.command == "check") return cmd_check(args);
    if (args.command == "bench") return cmd_bench(args);
    if (args.command == "plan") return cmd_plan(args);
    if (args.command == "presets") return cmd_presets();
    throw UsageError("unknown command '" + args.command + "'");
  } catch (const UsageError& e) {
    std::fprintf(stderr, "padmoe: error: %s\n(see `padmoe --help`)\n", e.what());
    return 2;
  } catch (const Error& e) {
    std::fprintf(stderr, "padmoe: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "padmoe: error: %s\n", e.what());
    return 2;
  }
}
