// bench.cpp — `padmoe bench`: every op of the op table timed against the copy
// floor (memcpy on the CPU; padmoe::copy device->device with --device cuda).
// With --device cuda each op is also captured once into a CUDA graph and its
// warm back-to-back replays timed (the `graph us` column; --no-graph skips it).
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "commands.hpp"
#include "gpu.hpp"
#include "ops_table.hpp"
#include "report.hpp"
#include "workload_data.hpp"

namespace cli {
namespace {

using Clock = std::chrono::steady_clock;

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
//           floor of docs/spec.md §16 and %memcpy);
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
  struct Buf {
    char* p;
    char* get() const { return p; }
  };
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
  double graph_us = -1;     // --device cuda: per graph replay; -1 when not captured
  size_t graph_nodes = 0;   // nodes of its graph
  double in_graph_us = -1;  // --device cuda: per call, kGraphInner calls captured in one graph; -1 when not
  std::string graph_error;  // why not (the capture's error)
};

// --device cuda: the floor. padmoe::copy of a 1 GiB buffer device->device on
// the ops' stream, timed with CUDA events (cold L2 like every op), bytes
// counted as read + written, median of 10 after one untimed copy.
constexpr int64_t kGpuCopyBytes = int64_t{1} << 30;
constexpr int kGpuCopyReps = 10;
constexpr int64_t kL2FlushBytes = int64_t{256} << 20;

// --device cuda, `graph us`: each op captured once into a CUDA graph; a timed
// sample is CUDA events around kGraphReplays back-to-back cudaGraphLaunch
// calls, divided by kGraphReplays; median of --iters samples after --warmup
// replays. No L2 flush: a serving loop replays its decode step with warm caches.
constexpr int kGraphReplays = 10;
// `in-graph us`: kGraphInner calls of the op captured into one graph, a sample is CUDA events around
// one replay divided by kGraphInner (median of max(3, iters / 5) samples): the op inside a larger
// captured step, with no graph launch of its own per call, as a serving loop replays its step.
constexpr int kGraphInner = 20;

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
  const std::vector<double> us = gpu_time_us(*d.gpu, [&] { padmoe::copy(src, dst, d.opt); }, 1, kGpuCopyReps, flush);
  const double t = median(us);
  return t > 0 ? 2.0 * static_cast<double>(kGpuCopyBytes) / (t * 1e-6) / 1e9 : 0.0;
}

}  // namespace

int cmd_bench(const Args& args) {
  const std::string variants = apply_variants(args);
  const Workload w = parse_workload(args);
  const bool on_gpu = w.device.is_cuda();
  const int warmup = static_cast<int>(args.get_int("warmup", on_gpu ? 5 : 2));
  const int iters = static_cast<int>(args.get_int("iters", on_gpu ? 50 : 10));
  const bool with_reference = !args.has("no-reference");
  const bool json = args.has("json");
  const bool with_graph = on_gpu && !args.has("no-graph");  // the graph column exists on a GPU only
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
    workspace =
        Tensor::empty(DType::kFloat8E4M3, {std::max<int64_t>(1, static_cast<int64_t>(workspace_bytes))}, w.device);
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
    // The same call captured once and replayed; a capture that fails is this
    // column's `-` and its reason, never the op's error.
    if (with_graph && r.error.empty()) {
      try {
        const std::unique_ptr<GpuGraph> graph = gpu_capture_graph(*d.gpu, [&] { op.run(d); });
        r.graph_nodes = graph->nodes;
        if (graph->exec != nullptr) {
          r.graph_us = median(gpu_graph_replay_us(*d.gpu, *graph, warmup, iters, kGraphReplays));
          const std::unique_ptr<GpuGraph> many = gpu_capture_graph(*d.gpu, [&] {
            for (int k = 0; k < kGraphInner; ++k) op.run(d);
          });
          if (many->exec != nullptr) {
            r.in_graph_us = median(gpu_graph_replay_us(*d.gpu, *many, 1, std::max(3, iters / 5), 1)) / kGraphInner;
          }
        } else {
          r.graph_error = graph->error;
        }
      } catch (const Error& e) {
        r.graph_error = e.what();
      }
    }
    records.push_back(r);
  }

  int errors = 0;
  for (const BenchRecord& r : records) errors += r.error.empty() ? 0 : 1;

  const std::string timing_words =
      on_gpu ? "CUDA events around each call on one stream; cold L2 (a read-only pass over 256 MiB before each timed "
               "run, outside the timed region, leaving no dirty lines); check_data=false (the sync-free fast path); "
               "caller workspace "
               "(padmoe::workspace_bound)"
             : "steady_clock wall time";
  const std::string graph_words =
      "each op captured once into a CUDA graph (cudaStreamCaptureModeGlobal; plan+dispatch+combine: one graph of its "
      "three launches, plan+dispatch and dispatch+combine of their two); per replay: CUDA events around " +
      std::to_string(kGraphReplays) + " back-to-back cudaGraphLaunch calls / " + std::to_string(kGraphReplays) +
      ", median of iters samples after warmup replays; warm L2 (no flush), as a serving loop replays a decode step; "
      "in_graph_us: " +
      std::to_string(kGraphInner) + " calls captured in one graph, one replay / " + std::to_string(kGraphInner) +
      " per sample, median of max(3, iters / 5) samples";
  if (json) {
    std::printf(
        "{\"command\": \"bench\", \"date\": \"%s\", \"device\": \"%s\", \"card\": %s,\n"
        " \"workload\": {\"label\": \"%s\", \"tokens\": %" PRId64
        ", \"experts\": %d, \"top_k\": %d, \"hidden\": %" PRId64 ", \"alignment\": %d, \"assignments\": %" PRId64
        ", \"padded_rows\": %" PRId64 ", \"capacity\": %" PRId64
        ", \"dtype\": \"%s\", \"device\": \"%s\", "
        "\"seed\": %" PRIu64 "},\n \"variant\": \"%s\",\n",
        utc_now().c_str(), device_name(w.device).c_str(),
        on_gpu ? ("\"" + json_escape(d.gpu->card) + "\"").c_str() : "null", json_escape(w.label).c_str(), w.T, w.E, w.K,
        w.H, w.m, d.A, d.P, d.R, dtype_name(w.dtype), device_name(w.device).c_str(), w.seed,
        json_escape(variants).c_str());
    if (on_gpu) {
      std::printf(" \"timing\": \"%s\", \"cold_l2\": true, \"l2_flush_bytes\": %" PRId64
                  ", \"check_data\": false, \"workspace_bytes\": %zu, \"warmup\": %d, \"iters\": %d,\n"
                  " \"floor\": \"padmoe::copy device->device\", \"copy_bytes\": %" PRId64
                  ", \"copy_reps\": %d, \"copy_gbps\": %s, \"copy_tbps\": %s, \"memcpy_gbps\": null,\n",
                  json_escape(timing_words).c_str(), kL2FlushBytes, workspace_bytes, warmup, iters, kGpuCopyBytes,
                  kGpuCopyReps, json_num(copy_gbps).c_str(), json_num(copy_gbps / 1e3).c_str());
      if (with_graph) {
        std::printf(" \"graph_timing\": \"%s\", \"graph_replays\": %d,\n", json_escape(graph_words).c_str(),
                    kGraphReplays);
      }
      std::printf(" \"ops\": [\n");
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
      const bool graphed = r.graph_us >= 0;
      // --device cuda without --no-graph only (else nothing: the output as before the column).
      const std::string graph_json =
          with_graph
              ? "\"graph_us\": " + (graphed ? json_num(r.graph_us) : std::string("null")) +
                    ", \"graph_over_floor\": " + (graphed ? json_num(r.graph_us / r.floor_us) : std::string("null")) +
                    ", \"graph_nodes\": " + (graphed ? std::to_string(r.graph_nodes) : std::string("null")) +
                    ", \"in_graph_us\": " + (r.in_graph_us >= 0 ? json_num(r.in_graph_us) : std::string("null")) +
                    ", \"in_graph_over_floor\": " +
                    (r.in_graph_us >= 0 ? json_num(r.in_graph_us / r.floor_us) : std::string("null")) +
                    ", \"graph_error\": " +
                    (r.graph_error.empty() ? std::string("null") : "\"" + json_escape(r.graph_error) + "\"") + ", "
              : std::string();
      std::printf(
          "  {\"name\": \"%s\", \"us\": %s, \"gbps\": %s, \"tbps\": %s, \"min_bytes\": %.0f, \"floor_us\": %s, "
          "\"time_over_floor\": %s, \"pct_memcpy\": %s, \"pct_copy\": %s, \"reference_us\": %s, "
          "%s\"error\": %s}%s\n",
          r.name.c_str(), ok ? json_num(r.us).c_str() : "null", ok ? json_num(r.gbps).c_str() : "null",
          ok ? json_num(r.gbps / 1e3).c_str() : "null", r.min_bytes, json_num(r.floor_us).c_str(),
          ok ? json_num(r.us / r.floor_us).c_str() : "null",
          ok && !on_gpu ? json_num(100.0 * r.floor_us / r.us).c_str() : "null",
          ok ? json_num(100.0 * r.copy_us / r.us).c_str() : "null", r.ref_us >= 0 ? json_num(r.ref_us).c_str() : "null",
          graph_json.c_str(), ok ? "null" : ("\"" + json_escape(r.error) + "\"").c_str(),
          i + 1 < records.size() ? "," : "");
    }
    std::printf(" ]}\n");
    return errors == 0 ? 0 : 1;
  }

  print_header("bench", d);
  if (!variants.empty()) std::printf("variant: %s (kernel choices forced)\n", variants.c_str());
  if (on_gpu) {
    std::printf(
        "device copy (the floor): %.3f TB/s (padmoe::copy device->device, 1 GiB, read + write bytes, CUDA "
        "events, median of %d)\n",
        copy_gbps / 1e3, kGpuCopyReps);
    std::printf(
        "timing: median of %d runs after %d warm-up runs; CUDA events around each call on one stream;\n"
        "  cold L2: a read-only pass over 256 MiB of scratch (padmoe wgrad) before each timed run, outside the "
        "timed region, so L2 holds clean lines;\n"
        "  check_data=false (the sync-free fast path); caller workspace of %zu bytes (padmoe::workspace_bound), so "
        "no allocation is timed\n",
        iters, warmup, workspace_bytes);
    if (with_graph) {
      std::printf(
          "graph: each op captured once into a CUDA graph; per replay = CUDA events around %d back-to-back "
          "cudaGraphLaunch calls / %d,\n"
          "  median of %d such samples after %d warm-up replays; warm L2 (no flush), as a serving loop replays a "
          "decode step\n",
          kGraphReplays, kGraphReplays, iters, warmup);
    }
    std::printf("\n");
    if (with_graph) {
      std::printf("%-38s %10s %8s %10s %10s %9s %10s %11s %12s %14s %12s\n", "op", "us", "TB/s", "floor us",
                  "time/floor", "%copy", "graph us", "graph/floor", "in-graph us", "in-graph/floor",
                  with_reference ? "reference us" : "");
    } else {
      std::printf("%-38s %10s %8s %10s %10s %9s %12s\n", "op", "us", "TB/s", "floor us", "time/floor", "%copy",
                  with_reference ? "reference us" : "");
    }
    for (const BenchRecord& r : records) {
      if (!r.error.empty()) {
        std::printf("%-38s error: %s\n", r.name.c_str(), r.error.c_str());
        continue;
      }
      std::printf("%-38s %10.1f %8.3f %10.1f %10.2f %8.1f%% ", r.name.c_str(), r.us, r.gbps / 1e3, r.floor_us,
                  r.us / r.floor_us, 100.0 * r.copy_us / r.us);
      if (with_graph) {
        const bool graphed = r.graph_us >= 0;
        const bool inner = r.in_graph_us >= 0;
        std::printf("%10s %11s %12s %14s ", graphed ? fmt("%.1f", r.graph_us).c_str() : "-",
                    graphed ? fmt("%.2f", r.graph_us / r.floor_us).c_str() : "-",
                    inner ? fmt("%.1f", r.in_graph_us).c_str() : "-",
                    inner ? fmt("%.2f", r.in_graph_us / r.floor_us).c_str() : "-");
      }
      std::printf("%12s\n", r.ref_us >= 0 ? fmt("%.0f", r.ref_us).c_str() : "");
    }
    std::printf("\nfloor us = min_bytes / device copy bandwidth; %%copy = floor / time; TB/s = min_bytes / time.\n");
    if (with_graph) {
      std::printf(
          "graph us = time per replay of the op captured once in a CUDA graph (cudaStreamCaptureModeGlobal), %d "
          "replays back to back per\n"
          "  sample, warm L2 (no flush): a serving loop's step, one cudaGraphLaunch and none of padmoe's host code; "
          "plan+dispatch+combine\n"
          "  is one graph of its three launches (the decode step's routing), plan+dispatch and dispatch+combine one "
          "of\n"
          "  their two. graph/floor = graph us / floor us (below 1 where the bytes stay in L2).\n"
          "in-graph us = per call with %d calls captured in one graph and replayed once (median of max(3, iters / 5)): "
          "the op inside a\n"
          "  larger captured step, without a graph launch of its own (as a serving loop's captured step runs "
          "it).\n"
          "  - = not capturable (the op synchronizes the host, allocates or reads back to the host): the capture's "
          "error below.\n",
          kGraphReplays, kGraphInner);
      bool header = false;
      for (const BenchRecord& r : records) {
        if (!r.error.empty() || r.graph_error.empty()) continue;
        if (!header) std::printf("not captured (graph us -), the capture's error:\n");
        header = true;
        std::printf("  %-36s %s\n", r.name.c_str(), r.graph_error.c_str());
      }
    }
    std::printf("min_bytes (s = %zu bytes per element; A = T*K, P = padded rows, N = A, R = capacity):\n",
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

}  // namespace cli
