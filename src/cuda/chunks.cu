// chunks.cu — sort_chunks' dispatch on the GPU: the chunk layout (one block scanning the R*E split
// sizes on the device, in shared memory where the chunks and the sums fit), its checked-mode
// validation and the row map, or the whole op in one launch where the received rows fit the L2
// (policy::chunk_rows_one_launch; the form: policy::chunk_rows_form). Otherwise the rows move with
// gather_rows (rows.cu) over the map, so the op is a few small launches plus one row pass, with no
// host synchronization unless checked mode reports. The kernels and the workspace layout:
// chunks_kernels.cuh.
#include <algorithm>
#include <optional>
#include <type_traits>

#include "cuda/chunks_kernels.cuh"

namespace padmoe {
namespace cuda {
namespace {

int64_t read_index(IndexRef r, int64_t i, cudaStream_t s) {
  int64_t v = 0;
  int32_t n = 0;
  if (r.wide)
    PADMOE_CUDA_CHECK(cudaMemcpyAsync(&v, static_cast<const int64_t*>(r.data) + i, 8, cudaMemcpyDeviceToHost, s));
  else PADMOE_CUDA_CHECK(cudaMemcpyAsync(&n, static_cast<const int32_t*>(r.data) + i, 4, cudaMemcpyDeviceToHost, s));
  PADMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return r.wide ? v : n;
}

// Whether every sum of the layout fits in 32 bits (the shared-memory layouts' int32 arrays): at
// most C * (rows + 1) real rows (sizes are clamped at rows + 1), plus alignment - 1 a group.
bool layout_sums_fit_32(int64_t num_chunks, int64_t groups, int alignment, int64_t rows) {
  // Each factor below 2^31 first, so that the bound itself cannot overflow (received of 2^62 rows
  // without columns made (rows + 1) * C wrap to a small number and chose the 32-bit layout).
  constexpr int64_t kMax = 2147483647LL;
  if (rows >= kMax || num_chunks >= kMax) return false;
  return (rows + 1) * num_chunks + groups * alignment < kMax;
}

// The layout block writes the map too (one launch fewer) up to policy::kChunkFusedMapRows map rows
// (a block of 1024 threads, a binary search in shared memory per entry).
constexpr int64_t kFusedMapRows = policy::kChunkFusedMapRows;
bool fused_chunk_map(int64_t map_len) {
  return overrides().chunk_map_fused.value_or(policy::chunk_map_fused(map_len)) && map_len <= kFusedMapRows;
}

// Rows a block moves at a time, and the blocks that fit on the device at once.
int chunk_rows_per_block(int words) {
  const int per = kRowThreads * kRowUnits / (words > 0 ? words : 1);
  return per < 1 ? 1 : (per > kRowMaxRows ? kRowMaxRows : per);
}
// The blocks of kKernel that fit at once on the current device (each lays the chunks out once, then
// strides over the rows): its blocks a multiprocessor, counted once per kernel, times the
// device's multiprocessors.
template <auto kKernel>
int chunk_rows_resident() {
  static const int per_sm = [] {
    int n = 4;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kRowThreads, 0) != cudaSuccess) {
      cudaGetLastError();
      n = 4;
    }
    return std::max(1, n);
  }();
  return std::max(1, sm_count()) * per_sm;
}

template <typename W>
void launch_chunk_rows(const RowsArg& src, IndexRef sizes, IndexRef sorted, int c, int ranks, int alignment,
                       const RowsArg& out, bool zero_tail, bool skip_unmapped, int32_t* map, int32_t* inclusive_offsets,
                       cudaStream_t s) {
  const int64_t row_bytes = out.cols * static_cast<int64_t>(element_size(out.dtype));
  const int words = static_cast<int>(row_bytes / static_cast<int64_t>(sizeof(W)));
  const int per_block = chunk_rows_per_block(words);
  // the form (policy::chunk_rows_form), and the blocks of it that fit at once (each lays the chunks
  // out once, then strides over the rows)
  const bool sorted_index = sorted.data != nullptr;
  const policy::ChunkRowsForm form = overrides().chunk_rows_form.has_value()
                                         ? policy::chunk_rows_fit(*overrides().chunk_rows_form, sorted_index, c, words)
                                         : policy::chunk_rows_form(sorted_index, c, words);
  if (form == policy::ChunkRowsForm::kOneScan) {
    // one row a block a round: as many blocks as rows, up to 8 times those that fit at once
    const int64_t most = static_cast<int64_t>(chunk_rows_resident<chunk_rows_one_scan_kernel<W>>()) * 8;
    const int64_t p_bound = index::padded_rows_bound(src.rows, c / ranks, alignment);  // P with valid sizes
    const int64_t rows = zero_tail ? out.rows : std::min(out.rows, p_bound);
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, most)));
    const RowsArg from = with_l2_prefetch(src, std::is_same<W, uint4>::value, grid);
    launch_kernel("chunk_rows_one_scan_kernel", chunk_rows_one_scan_kernel<W>, grid, kRowThreads, 0, s, from, sizes, c,
                  ranks, alignment, out, words, zero_tail, skip_unmapped, map, inclusive_offsets);
    return;
  }
  const bool rowwise = form == policy::ChunkRowsForm::kRowwise;
  auto* kernel = rowwise ? chunk_rows_rowwise_kernel<W> : chunk_rows_kernel<W>;
  const int resident =
      rowwise ? chunk_rows_resident<chunk_rows_rowwise_kernel<W>>() : chunk_rows_resident<chunk_rows_kernel<W>>();
  const int64_t row_groups = index::ceil_div(out.rows, per_block);
  const int grid =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(row_groups, static_cast<int64_t>(resident))));
  // every row of src is read once: the first blocks ask L2 for them before the wait
  const RowsArg from =
      with_l2_prefetch(src, std::is_same<W, uint4>::value, std::min(grid, resident / 2 > 0 ? resident / 2 : 1));
  launch_kernel("chunk_rows_kernel", kernel, grid, kRowThreads, 0, s, from, sizes, sorted, c, ranks, alignment, out,
                words, per_block, zero_tail, skip_unmapped, map, inclusive_offsets);
}

}  // namespace

bool chunk_rows_fit(int64_t num_chunks, int num_ranks, int alignment, const RowsArg& src, const RowsArg& out) {
  const int64_t rows = src.rows, out_rows = out.rows;
  const int64_t row_bytes = out.cols * static_cast<int64_t>(element_size(out.dtype));
  const std::optional<bool>& forced = overrides().chunk_rows;
  if ((forced.has_value() && !*forced) || num_chunks < 1 || num_chunks > kRowChunks || num_ranks < 1) return false;
  const int64_t groups = num_chunks / num_ranks;
  if (!layout_sums_fit_32(num_chunks, groups, alignment, rows) || out_rows >= 2147483647LL) return false;
  // received rows of at most the L2's size (policy::chunk_rows_one_launch), or wherever it fits when forced
  return forced.has_value() || policy::chunk_rows_one_launch(rows, row_bytes, device_policy());
}

void sort_chunk_rows(const RowsArg& src, IndexRef split_sizes, IndexRef sorted_index, int64_t num_chunks, int num_ranks,
                     int alignment, const RowsArg& out, bool zero_tail, bool skip_unmapped, int32_t* map,
                     int32_t* inclusive_offsets, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const int c = static_cast<int>(num_chunks);
  const bool vec = rows_vectorizable(src) && rows_vectorizable(out);
  const size_t e = element_size(out.dtype);
  auto go = [&](auto word) {
    using W = decltype(word);
    launch_chunk_rows<W>(src, split_sizes, sorted_index, c, num_ranks, alignment, out, zero_tail, skip_unmapped, map,
                         inclusive_offsets, s);
  };
  if (vec) go(uint4{});
  else if (e == 1) go(uint8_t{});
  else if (e == 2) go(uint16_t{});
  else if (e == 4) go(uint32_t{});
  else go(uint64_t{});
}

bool chunk_layout(IndexRef split_sizes, IndexRef sorted_index, int64_t num_chunks, int num_ranks, int alignment,
                  int64_t rows, void* workspace, void* stream, int64_t map_len, int32_t* map,
                  int32_t* inclusive_offsets) {
  const cudaStream_t s = as_stream(stream);
  const Layout l = layout_of(workspace, num_chunks);
  if (num_chunks == 0) {  // no chunks: P = 0
    PADMOE_CUDA_CHECK(cudaMemsetAsync(workspace, 0, 64, s));
    return false;
  }
  // shared memory when the chunks fit and every sum (at most C * (rows + 1) real rows, plus
  // alignment - 1 a group) fits in 32 bits
  const int64_t groups = num_chunks / num_ranks;
  const bool small = num_chunks <= kSmemChunks && layout_sums_fit_32(num_chunks, groups, alignment, rows);
  if (small) {
    const bool fuse = map != nullptr && fused_chunk_map(map_len);
    launch_kernel("chunk_layout_smem_kernel", chunk_layout_smem_kernel, 1, kScanThreads, 0, s, split_sizes,
                  sorted_index, static_cast<int>(num_chunks), num_ranks, alignment, rows, l,
                  static_cast<int>(fuse ? map_len : 0), fuse ? map : nullptr, fuse ? inclusive_offsets : nullptr);
    return fuse;
  }
  launch_kernel("chunk_layout_kernel", chunk_layout_kernel, 1, kScanThreads, 0, s, split_sizes, sorted_index,
                num_chunks, num_ranks, alignment, rows, l);
  return false;
}

Violation validate_chunks(IndexRef split_sizes, IndexRef sorted_index, int64_t num_chunks, int64_t rows,
                          int64_t output_rows, void* workspace, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const Layout l = layout_of(workspace, num_chunks);
  PADMOE_CUDA_CHECK(cudaMemsetAsync(l.key, 0xff, sizeof(Key), s));
  if (num_chunks > 0) {
    PADMOE_CUDA_CHECK(cudaMemsetAsync(l.seen, 0, static_cast<size_t>(num_chunks) * 4, s));
    launch_kernel("validate_chunks_kernel", validate_chunks_kernel, grid_for(num_chunks, 256, 1024), 256, 0, s,
                  split_sizes, sorted_index, num_chunks, rows, l);
  }
  int64_t header[3] = {0, 0, 0};
  PADMOE_CUDA_CHECK(cudaMemcpyAsync(header, workspace, sizeof(header), cudaMemcpyDeviceToHost, s));
  PADMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  Key key = static_cast<Key>(header[0]);
  Violation v;
  if (key != kNone) {
    v.code = static_cast<int>(key >> kPosBits);
    v.pos = static_cast<int64_t>(key & ((Key{1} << kPosBits) - 1));
    if (v.code == kChunkCountNegative || v.code == kChunkCountTooLarge) v.v1 = read_index(split_sizes, v.pos, s);
    if (v.code == kChunkCountTooLarge) v.v2 = rows;
    if (v.code == kChunkIndexOutOfRange) v.v1 = read_index(sorted_index, v.pos, s);
    if (v.code == kChunkIndexRepeated) v.v1 = v.pos;
    return v;
  }
  const int64_t real = header[1], padded = header[2];
  if (real > rows) return Violation{kChunkCountTotal, 0, real, rows};
  if (padded > 2147483647LL) return Violation{kChunkOverflow, 0, padded, 0};
  if (output_rows >= 0 && padded > output_rows) return Violation{kChunkCapacity, 0, padded, output_rows};
  return v;
}

void chunk_map(const void* workspace, int64_t num_chunks, int num_ranks, int64_t rows, int64_t map_len, int32_t* map,
               int32_t* inclusive_offsets, void* stream) {
  const int64_t groups = num_ranks > 0 ? num_chunks / num_ranks : 0;
  const int64_t work = map_len > groups ? map_len : groups;
  if (work == 0) return;
  const Layout l = layout_of(const_cast<void*>(workspace), num_chunks);
  launch_kernel("chunk_map_kernel", chunk_map_kernel, grid_for(work, 256, 4096), 256, 0, as_stream(stream), l,
                num_chunks, groups, rows, map_len, map, inclusive_offsets);
}

}  // namespace cuda
}  // namespace padmoe
