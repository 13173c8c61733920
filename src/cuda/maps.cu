// maps.cu — the index maps behind the row kernels: the inverse map of a
// sorted routing (dest_rows), pad's row map and offsets, unpad's inverse map.
#include <cub/block/block_scan.cuh>

#include <atomic>
#include <cstdlib>

#include "cuda/common.cuh"

namespace padmoe {
namespace cuda {
namespace {

__global__ void dest_rows_kernel(IndexRef indices, IndexRef bin_ids, IndexRef bins, IndexRef padded_bins,
                                 int64_t assignments, int32_t* dest_rows) {
  pdl_begin();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < assignments;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = load_index(bin_ids, i);
    dest_rows[load_index(indices, i)] = static_cast<int32_t>(sorted_padded_row(bins, padded_bins, e, i));
  }
}

// dest_rows with every expert's real and padded start staged in shared memory first (E <=
// kStageExperts): the loads of bins / padded_bins run beside each thread's first indices /
// bin_ids loads, one dependent round of global loads instead of two (a short kernel's latency
// at decode, where the MegaBlocks-argument reduces run ~1.8 µs behind the plan forms in a
// graph). Entries out of range (unchecked bad input only) write nothing.
constexpr int kStageExperts = 2048;
constexpr int kDestThreads = 256;
__global__ void __launch_bounds__(kDestThreads)
    dest_rows_staged_kernel(IndexRef indices, IndexRef bin_ids, IndexRef bins, IndexRef padded_bins, int num_experts,
                            int64_t assignments, int32_t* dest_rows) {
  pdl_begin();
  __shared__ int32_t s_start[kStageExperts + 1], s_pstart[kStageExperts + 1];  // exclusive starts of e
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kDestThreads;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kDestThreads + threadIdx.x;
  int64_t a = -1, e = -1;
  if (i < assignments) {  // the first item's loads, in flight with the stage's
    a = load_index(indices, i);
    e = load_index(bin_ids, i);
  }
  if (threadIdx.x == 0) s_start[0] = s_pstart[0] = 0;
  for (int x = threadIdx.x; x < num_experts; x += kDestThreads) {
    s_start[x + 1] = static_cast<int32_t>(load_index(bins, x));
    s_pstart[x + 1] = static_cast<int32_t>(load_index(padded_bins, x));
  }
  __syncthreads();
  while (i < assignments) {
    if (a >= 0 && a < assignments && e >= 0 && e < num_experts) {
      dest_rows[a] = static_cast<int32_t>(index::padded_row(i, s_start[e], s_pstart[e]));
    }
    i += stride;
    if (i < assignments) {
      a = load_index(indices, i);
      e = load_index(bin_ids, i);
    }
  }
}

constexpr int kScanThreads = 1024;

// One block: inclusive padded offsets and exclusive real offsets of the counts.
__global__ void __launch_bounds__(kScanThreads)
    pad_offsets_kernel(IndexRef counts, int num_experts, int alignment, int32_t* inclusive_offsets,
                       int32_t* real_excl, int32_t* padded_excl) {
  pdl_begin();
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage storage;
  const int per = (num_experts + kScanThreads - 1) / kScanThreads;
  const int e0 = min(num_experts, static_cast<int>(threadIdx.x) * per);
  const int e1 = min(num_experts, e0 + per);
  int my_real = 0, my_padded = 0;
  for (int e = e0; e < e1; ++e) {
    const int n = static_cast<int>(load_index(counts, e));
    my_real += n;
    my_padded += static_cast<int>(index::round_up(n, alignment));
  }
  int real = 0, padded = 0;
  Scan(storage).ExclusiveSum(my_real, real);
  __syncthreads();
  Scan(storage).ExclusiveSum(my_padded, padded);
  for (int e = e0; e < e1; ++e) {
    const int n = static_cast<int>(load_index(counts, e));
    real_excl[e] = real;
    padded_excl[e] = padded;
    real += n;
    padded += static_cast<int>(index::round_up(n, alignment));
    inclusive_offsets[e] = padded;
  }
}

// map[p]: expert e = first with inclusive_offsets[e] > p; the source row while
// inside e's count, else -1; -1 at or past P.
__global__ void pad_map_kernel(IndexRef counts, int num_experts, const int32_t* inclusive_offsets,
                               const int32_t* real_excl, const int32_t* padded_excl, int64_t map_len, int32_t* map) {
  pdl_begin();
  const int64_t padded = num_experts > 0 ? inclusive_offsets[num_experts - 1] : 0;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < map_len;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int32_t v = -1;
    if (p < padded) {
      const int64_t e = index::find_segment(inclusive_offsets, num_experts, p);
      const int64_t local = p - padded_excl[e];
      if (local < load_index(counts, e)) v = static_cast<int32_t>(real_excl[e] + local);
    }
    map[p] = v;
  }
}

// Both at once, for E <= kMapScanExperts: every block scans the counts itself (E loads and a
// block scan: cheaper than a one-block launch before the map's), block 0 writes
// inclusive_offsets, and each thread maps its entries from the scan in shared memory.
constexpr int kMapThreads = 256;
constexpr int kMapScanExperts = 4096;

__global__ void __launch_bounds__(kMapThreads)
    pad_map_scan_kernel(IndexRef counts, int num_experts, int alignment, int64_t map_len, int32_t* map,
                        int32_t* inclusive_offsets) {
  pdl_wait();  // no early trigger: the gather that follows should not share SMs with 32 KiB blocks
  using Scan = cub::BlockScan<int, kMapThreads>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int32_t s_incl[kMapScanExperts];  // padded inclusive offsets
  __shared__ int32_t s_real[kMapScanExperts];  // real exclusive offsets
  const int per = (num_experts + kMapThreads - 1) / kMapThreads;
  const int e0 = min(num_experts, static_cast<int>(threadIdx.x) * per);
  const int e1 = min(num_experts, e0 + per);
  int my_real = 0, my_padded = 0;
  for (int e = e0; e < e1; ++e) {
    const int n = static_cast<int>(load_index(counts, e));
    s_real[e] = n;  // the count for now
    my_real += n;
    my_padded += static_cast<int>(index::round_up(n, alignment));
  }
  int real = 0, padded = 0, real_total = 0;
  Scan(storage).ExclusiveSum(my_real, real, real_total);
  __syncthreads();
  Scan(storage).ExclusiveSum(my_padded, padded);
  for (int e = e0; e < e1; ++e) {
    const int n = s_real[e];
    s_real[e] = real;
    real += n;
    padded += static_cast<int>(index::round_up(n, alignment));
    s_incl[e] = padded;
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < num_experts; e += kMapThreads) inclusive_offsets[e] = s_incl[e];
  }
  const int64_t total = num_experts > 0 ? s_incl[num_experts - 1] : 0;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kMapThreads + threadIdx.x; p < map_len;
       p += static_cast<int64_t>(gridDim.x) * kMapThreads) {
    int32_t v = -1;
    if (p < total) {
      const int64_t e = index::find_segment(s_incl, num_experts, p);
      const int64_t local = p - index::segment_start(s_incl, e);
      const int64_t next = e + 1 < num_experts ? s_real[e + 1] : real_total;  // real exclusive end of e
      if (local < next - s_real[e]) v = static_cast<int32_t>(s_real[e] + local);
    }
    map[p] = v;
  }
}

__global__ void fill_kernel(int32_t* out, int64_t n, int32_t value) {
  pdl_begin();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = value;
  }
}

__global__ void invert_kernel(IndexRef map, int64_t map_len, int64_t original_size, int32_t* inverse) {
  pdl_begin();
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < map_len;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = load_index(map, p);
    if (n >= 0 && n < original_size) inverse[n] = static_cast<int32_t>(p);
  }
}

// Whether build_dest_rows stages the expert starts (dest_rows_staged_kernel): 0 off (the
// default, until measured), 1 on for E <= kStageExperts. PADMOE_CUDA_DEST_STAGE (read once) or
// set_dest_stage (tests; -1 back to the environment's choice).
std::atomic<int> g_dest_stage{-2};
int dest_stage() {
  const int set = g_dest_stage.load(std::memory_order_relaxed);
  if (set != -2) return set;
  static const int env = [] {
    const char* v = std::getenv("PADMOE_CUDA_DEST_STAGE");
    return v != nullptr && std::atoi(v) == 1 ? 1 : 0;
  }();
  return env;
}

}  // namespace

void set_dest_stage(int mode) { g_dest_stage.store(mode < 0 || mode > 1 ? -2 : mode, std::memory_order_relaxed); }

void build_dest_rows(IndexRef indices, IndexRef bin_ids, IndexRef bins, IndexRef padded_bins, int64_t assignments,
                     int num_experts, int32_t* dest_rows, void* stream) {
  if (assignments == 0) return;
  if (dest_stage() == 1 && num_experts >= 1 && num_experts <= kStageExperts) {
    launch_kernel("dest_rows_staged_kernel", dest_rows_staged_kernel, grid_for(assignments, kDestThreads, 4096),
        kDestThreads, 0, as_stream(stream), indices, bin_ids, bins, padded_bins, num_experts, assignments, dest_rows);
    return;
  }
  launch_kernel("dest_rows_kernel", dest_rows_kernel, grid_for(assignments, 256, 4096), 256, 0, as_stream(stream),
      indices, bin_ids, bins, padded_bins, assignments, dest_rows);
}

void pad_map(IndexRef counts, int num_experts, int alignment, int64_t map_len, int32_t* map,
             int32_t* inclusive_offsets, void* workspace, void* stream) {
  const cudaStream_t s = as_stream(stream);
  int32_t* real_excl = static_cast<int32_t*>(workspace);
  int32_t* padded_excl = real_excl + num_experts;
  if (num_experts > 0 && num_experts <= kMapScanExperts && map_len > 0) {  // one launch
    launch_kernel("pad_map_scan_kernel", pad_map_scan_kernel, grid_for(map_len, kMapThreads, 4096), kMapThreads, 0, s,
        counts, num_experts, alignment, map_len, map, inclusive_offsets);
    return;
  }
  if (num_experts > 0) {
    launch_kernel("pad_offsets_kernel", pad_offsets_kernel, 1, kScanThreads, 0, s, counts, num_experts, alignment,
        inclusive_offsets, real_excl, padded_excl);
  }
  if (map_len > 0) {
    launch_kernel("pad_map_kernel", pad_map_kernel, grid_for(map_len, 256, 4096), 256, 0, s, counts, num_experts,
        inclusive_offsets, real_excl, padded_excl, map_len, map);
  }
}

void invert_map(IndexRef map, int64_t map_len, int64_t original_size, int32_t* inverse, void* stream) {
  const cudaStream_t s = as_stream(stream);
  if (original_size > 0) {
    launch_kernel("fill_kernel", fill_kernel, grid_for(original_size, 256, 4096), 256, 0, s, inverse, original_size,
        -1);
  }
  if (map_len > 0) {
    launch_kernel("invert_kernel", invert_kernel, grid_for(map_len, 256, 4096), 256, 0, s, map, map_len, original_size,
        inverse);
  }
}

}  // namespace cuda
}  // namespace padmoe
