// maps.cu — the index maps behind the row kernels: the inverse map of a
// sorted routing (dest_rows), pad's row map and offsets, unpad's inverse map.
#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"
#include "cuda/plan_view.cuh"

namespace padmoe {
namespace cuda {
namespace {

// An entry whose assignment id or expert is out of range (unchecked bad input only) writes nothing:
// no write outside dest_rows, no read outside bins / padded_bins.
__global__ void dest_rows_kernel(IndexRef indices, IndexRef bin_ids, IndexRef bins, IndexRef padded_bins,
                                 int num_experts, int64_t assignments, int32_t* dest_rows) {
  pdl_begin();
  const DevicePlan<IndexRef> plan{bins, padded_bins, num_experts};
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < assignments;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t a = load_index(indices, i), e = load_index(bin_ids, i);
    if (a >= 0 && a < assignments && e >= 0 && e < num_experts) {
      dest_rows[a] = static_cast<int32_t>(plan.padded_row(e, i));
    }
  }
}

constexpr int kScanThreads = 1024;

// One block: inclusive padded offsets and exclusive real offsets of the counts.
__global__ void __launch_bounds__(kScanThreads)
    pad_offsets_kernel(IndexRef counts, int num_experts, int alignment, int32_t* inclusive_offsets, int32_t* real_excl,
                       int32_t* padded_excl) {
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
// inside e's count, else -1; -1 at or past P, and for a source row outside [0, rows) (bad
// unchecked counts only: the gather then reads nothing past the input).
__global__ void pad_map_kernel(IndexRef counts, int num_experts, const int32_t* inclusive_offsets,
                               const int32_t* real_excl, const int32_t* padded_excl, int64_t map_len, int64_t rows,
                               int32_t* map) {
  pdl_begin();
  const int64_t padded = num_experts > 0 ? inclusive_offsets[num_experts - 1] : 0;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < map_len;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int32_t v = -1;
    if (p < padded) {
      const int64_t e = index::find_segment(inclusive_offsets, num_experts, p);
      const int64_t local = p - padded_excl[e];
      const int64_t from = real_excl[e] + local;
      if (local < load_index(counts, e) && from >= 0 && from < rows) v = static_cast<int32_t>(from);
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
    pad_map_scan_kernel(IndexRef counts, int num_experts, int alignment, int64_t map_len, int64_t rows, int32_t* map,
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
      const int64_t from = s_real[e] + local;
      if (local < next - s_real[e] && from >= 0 && from < rows) v = static_cast<int32_t>(from);
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

}  // namespace

void build_dest_rows(IndexRef indices, IndexRef bin_ids, IndexRef bins, IndexRef padded_bins, int64_t assignments,
                     int num_experts, int32_t* dest_rows, void* stream) {
  if (assignments == 0) return;
  launch_kernel("dest_rows_kernel", dest_rows_kernel, grid_for(assignments, 256, 4096), 256, 0, as_stream(stream),
                indices, bin_ids, bins, padded_bins, num_experts, assignments, dest_rows);
}

void pad_map(IndexRef counts, int num_experts, int alignment, int64_t map_len, int64_t rows, int32_t* map,
             int32_t* inclusive_offsets, void* workspace, void* stream) {
  const cudaStream_t s = as_stream(stream);
  int32_t* real_excl = static_cast<int32_t*>(workspace);
  int32_t* padded_excl = real_excl + num_experts;
  if (num_experts > 0 && num_experts <= kMapScanExperts && map_len > 0) {  // one launch
    launch_kernel("pad_map_scan_kernel", pad_map_scan_kernel, grid_for(map_len, kMapThreads, 4096), kMapThreads, 0, s,
                  counts, num_experts, alignment, map_len, rows, map, inclusive_offsets);
    return;
  }
  if (num_experts > 0) {
    launch_kernel("pad_offsets_kernel", pad_offsets_kernel, 1, kScanThreads, 0, s, counts, num_experts, alignment,
                  inclusive_offsets, real_excl, padded_excl);
  }
  if (map_len > 0) {
    launch_kernel("pad_map_kernel", pad_map_kernel, grid_for(map_len, 256, 4096), 256, 0, s, counts, num_experts,
                  inclusive_offsets, real_excl, padded_excl, map_len, rows, map);
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
