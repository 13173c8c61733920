// chunks_kernels.cuh — sort_chunks' device code: the chunk layout (one block scanning the R*E
// split sizes, in global or shared memory), its checked-mode validation, the row map, and the
// one-launch forms that lay the chunks out and move the rows in the same kernel. Included by
// chunks.cu, which picks the form and launches.
//
// Workspace layout (chunk_workspace_bytes(C)): a 64-byte header
//   [Key key | int64 real total | int64 P | ...]
// then int64 arrays src_excl[C] (by source chunk), pos_src[C], pos_size[C],
// pos_row[C] (by output position), group_incl[C], group_real[C] (by group;
// E <= C entries used) and int32 seen[C] (validation).
#pragma once

#include <cub/block/block_scan.cuh>

#include "cuda/common.cuh"

namespace padmoe {
namespace cuda {
namespace {

using Key = unsigned long long;
constexpr int kPosBits = 40;
constexpr Key kNone = ~Key{0};
constexpr int kScanThreads = 1024;

struct Layout {
  Key* key;
  int64_t* real_total;
  int64_t* padded_total;
  int64_t* src_excl;
  int64_t* pos_src;
  int64_t* pos_size;
  int64_t* pos_row;
  int64_t* group_incl;
  int64_t* group_real;
  int* seen;
};

__host__ __device__ Layout layout_of(void* workspace, int64_t c) {
  char* base = static_cast<char*>(workspace);
  Layout l;
  l.key = reinterpret_cast<Key*>(base);
  l.real_total = reinterpret_cast<int64_t*>(base + 8);
  l.padded_total = reinterpret_cast<int64_t*>(base + 16);
  int64_t* arrays = reinterpret_cast<int64_t*>(base + 64);
  l.src_excl = arrays;
  l.pos_src = arrays + c;
  l.pos_size = arrays + 2 * c;
  l.pos_row = arrays + 3 * c;
  l.group_incl = arrays + 4 * c;
  l.group_real = arrays + 5 * c;
  l.seen = reinterpret_cast<int*>(arrays + 6 * c);
  return l;
}

// The source chunk at output position j (-1: an out-of-range sorted_index entry).
__device__ __forceinline__ int64_t source_chunk(const IndexRef& sorted, int64_t j, int64_t c, int64_t ranks,
                                                int64_t groups) {
  if (sorted.data == nullptr) return (j % ranks) * groups + j / ranks;
  const int64_t s = load_index(sorted, j);
  return s >= 0 && s < c ? s : -1;
}

__device__ __forceinline__ int64_t clamped_size(const IndexRef& sizes, int64_t i, int64_t rows) {
  const int64_t n = load_index(sizes, i);
  return n < 0 ? 0 : (n > rows ? rows + 1 : n);
}

// The 64-bit layout's sums saturate at INT64_MAX: C unvalidated sizes of up to rows + 1 each can
// pass 2^63 when received has ~2^63 / C rows of no columns, and a wrapped total could pass
// validation with a wrong map. A saturated total exceeds received's rows (the host refuses 2^63 - 1
// rows) and is reported; without validation the map's writes stay within map_len.
constexpr long long kSumCap = 0x7fffffffffffffffLL;
__device__ __forceinline__ long long sat_add(long long a, long long b) {  // a, b >= 0
  const unsigned long long s = static_cast<unsigned long long>(a) + static_cast<unsigned long long>(b);
  return s < static_cast<unsigned long long>(kSumCap) ? static_cast<long long>(s) : kSumCap;
}
struct SatSum {
  __device__ long long operator()(long long a, long long b) const { return sat_add(a, b); }
};
__device__ __forceinline__ long long sat_round_up(long long x, long long m) {  // x >= 0, m >= 1
  return x > kSumCap - (m - 1) ? kSumCap : index::round_up(x, m);
}

// One block, each thread over a contiguous range of chunks / positions / groups:
// (1) exclusive scan of the sizes in source order; (2) in output order, with
// each position's source start and size; (3) over groups, padded; (4) each
// position's first padded row.
__global__ void __launch_bounds__(kScanThreads)
    chunk_layout_kernel(IndexRef sizes, IndexRef sorted, int64_t c, int64_t ranks, int64_t alignment, int64_t rows,
                        Layout l) {
  pdl_begin();
  using Scan = cub::BlockScan<long long, kScanThreads>;
  __shared__ typename Scan::TempStorage storage;
  const int64_t groups = c / ranks;
  const int64_t per = (c + kScanThreads - 1) / kScanThreads;
  const int64_t i0 = min(c, static_cast<int64_t>(threadIdx.x) * per), i1 = min(c, i0 + per);

  long long mine = 0, run = 0, total = 0;
  for (int64_t i = i0; i < i1; ++i) mine = sat_add(mine, clamped_size(sizes, i, rows));
  Scan(storage).ExclusiveScan(mine, run, 0LL, SatSum{}, total);
  for (int64_t i = i0; i < i1; ++i) {
    l.src_excl[i] = run;
    run = sat_add(run, clamped_size(sizes, i, rows));
  }
  if (threadIdx.x == 0) *l.real_total = total;
  __syncthreads();

  mine = 0;
  for (int64_t j = i0; j < i1; ++j) {
    const int64_t s = source_chunk(sorted, j, c, ranks, groups);
    const int64_t n = s < 0 ? 0 : clamped_size(sizes, s, rows);
    l.pos_src[j] = s < 0 ? 0 : l.src_excl[s];
    l.pos_size[j] = n;
    mine = sat_add(mine, n);
  }
  Scan(storage).ExclusiveScan(mine, run, 0LL, SatSum{});
  for (int64_t j = i0; j < i1; ++j) {
    l.pos_row[j] = run;  // exclusive real offset for now
    run = sat_add(run, l.pos_size[j]);
  }
  __syncthreads();

  // a group's real rows: from its first position's offset to its last's end (saturated, so >= 0)
  auto group_rows = [&](int64_t g) -> long long {
    const int64_t last = (g + 1) * ranks - 1;
    return sat_add(l.pos_row[last], l.pos_size[last]) - l.pos_row[g * ranks];
  };
  const int64_t gper = (groups + kScanThreads - 1) / kScanThreads;
  const int64_t g0 = min(groups, static_cast<int64_t>(threadIdx.x) * gper), g1 = min(groups, g0 + gper);
  mine = 0;
  for (int64_t g = g0; g < g1; ++g) mine = sat_add(mine, sat_round_up(group_rows(g), alignment));
  long long padded = 0;
  Scan(storage).ExclusiveScan(mine, padded, 0LL, SatSum{}, total);
  for (int64_t g = g0; g < g1; ++g) {
    padded = sat_add(padded, sat_round_up(group_rows(g), alignment));
    l.group_incl[g] = padded;
    l.group_real[g] = l.pos_row[g * ranks];
  }
  if (threadIdx.x == 0) *l.padded_total = total;
  __syncthreads();

  for (int64_t j = i0; j < i1; ++j) {
    const int64_t g = j / ranks;
    const int64_t pstart = g == 0 ? 0 : l.group_incl[g - 1];
    l.pos_row[j] = sat_add(pstart, l.pos_row[j] - l.group_real[g]);
  }
}

// The same layout with every array in shared memory (int32) for up to kBlock * kPer chunks whose
// sums fit in 32 bits (the host checks the bound), by one block of kBlock threads: the two inputs
// are read once, each phase reads what the one before left in shared memory. Used by
// chunk_layout_smem_kernel (one block for the whole op) and chunk_rows_kernel (every block its own copy).
template <int kBlock, int kPer>
struct LayoutSmem {
  static constexpr int kChunks = kBlock * kPer;
  using Scan = cub::BlockScan<int, kBlock>;
  typename Scan::TempStorage storage;
  int size[kChunks], excl[kChunks], row[kChunks], ginc[kChunks], greal[kChunks];
  int total;
};

// Thread t's positions j in [i0, i1) (i0 = t * per, per = ceil(c / kBlock) <= kPer). On return it
// holds prow[q] (position i0 + q's first padded row), psrc[q] (its source start) and n[q] (its
// size), and, for every chunk, s.excl (by source chunk) and, for every group, s.ginc (the padded
// inclusive end) and s.greal (the real start); returns P and sets *real_total.
template <int kBlock, int kPer>
__device__ int layout_in_smem(LayoutSmem<kBlock, kPer>& s, const IndexRef& sizes, const IndexRef& sorted, int c,
                              int ranks, int alignment, int64_t rows, int i0, int i1, int (&prow)[kPer],
                              int (&psrc)[kPer], int (&n)[kPer], int* real_total) {
  using Scan = typename LayoutSmem<kBlock, kPer>::Scan;
  const int groups = c / ranks;
  // both inputs first: the sizes in source order and the source chunk of each output position
  int size[kPer], src[kPer];
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int i = i0 + q;
    size[q] = i < i1 ? static_cast<int>(clamped_size(sizes, i, rows)) : 0;
    src[q] = i < i1 ? static_cast<int>(source_chunk(sorted, i, c, ranks, groups)) : -1;
  }
  // (1) exclusive scan of the sizes in source order
  int mine = 0, run = 0, total = 0;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    if (i0 + q < i1) s.size[i0 + q] = size[q];
    mine += size[q];
  }
  Scan(s.storage).ExclusiveSum(mine, run, total);
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    if (i0 + q < i1) s.excl[i0 + q] = run;
    run += size[q];
  }
  *real_total = total;
  __syncthreads();
  // (2) in output order: each position's size and exclusive real offset
  mine = 0;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    n[q] = src[q] < 0 ? 0 : s.size[src[q]];
    mine += n[q];
  }
  Scan(s.storage).ExclusiveSum(mine, run, total);
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    if (i0 + q < i1) s.row[i0 + q] = run;
    run += n[q];
  }
  if (threadIdx.x == 0) s.total = total;
  __syncthreads();
  // (3) over groups (ranks consecutive positions each), padded; a group's real rows run to the
  //     next group's first row (the positions are contiguous), the last group's to the total
  const int gper = (groups + kBlock - 1) / kBlock;
  const int g0 = min(groups, static_cast<int>(threadIdx.x) * gper), g1 = min(groups, g0 + gper);
  const int positions_total = s.total;
  mine = 0;
  for (int g = g0; g < g1; ++g) {
    const int end = g + 1 < groups ? s.row[(g + 1) * ranks] : positions_total;
    mine += round_up_32(end - s.row[g * ranks], alignment);
  }
  int padded = 0;
  Scan(s.storage).ExclusiveSum(mine, padded, total);
  for (int g = g0; g < g1; ++g) {
    const int real_start = s.row[g * ranks];
    const int end = g + 1 < groups ? s.row[(g + 1) * ranks] : positions_total;
    padded += round_up_32(end - real_start, alignment);
    s.ginc[g] = padded;
    s.greal[g] = real_start;
  }
  __syncthreads();
  // (4) each position's first padded row and source start
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int j = i0 + q;
    if (j >= i1) break;
    const int g = j / ranks;
    const int pstart = g == 0 ? 0 : s.ginc[g - 1];
    prow[q] = pstart + s.row[j] - s.greal[g];
    psrc[q] = src[q] < 0 ? 0 : s.excl[src[q]];
  }
  return total;
}

// After layout_in_smem (every thread's reads of s done: a barrier first): the positions' first rows,
// source starts and sizes over s.size, s.ginc and s.greal, for chunk_source_row.
template <int kBlock, int kPer>
__device__ void positions_to_smem(LayoutSmem<kBlock, kPer>& s, int i0, int i1, const int (&prow)[kPer],
                                  const int (&psrc)[kPer], const int (&n)[kPer]) {
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int j = i0 + q;
    if (j >= i1) break;
    s.size[j] = prow[q];
    s.ginc[j] = psrc[q];
    s.greal[j] = n[q];
  }
  __syncthreads();
}

// map[p] as chunk_map_kernel forms it, from positions_to_smem's arrays: the source row of padded row p, or
// -1 (padding, at or past P, or a source past `rows`).
template <int kBlock, int kPer>
__device__ int32_t chunk_source_row(const LayoutSmem<kBlock, kPer>& s, int c, int padded_total, int64_t rows,
                                    int64_t p) {
  if (p >= padded_total) return -1;
  int lo = 0, hi = c;  // first position with pos_row > p
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (s.size[mid] > p) hi = mid;
    else lo = mid + 1;
  }
  if (lo == 0) return -1;
  const int j = lo - 1, local = static_cast<int>(p - s.size[j]);
  const int64_t from = static_cast<int64_t>(s.ginc[j]) + local;
  return local < s.greal[j] && from < rows ? static_cast<int32_t>(from) : -1;
}

constexpr int kSmemChunks = 2048;
constexpr int kSmemPer = kSmemChunks / kScanThreads;  // chunks a thread
// One block for the whole op (decode, C = 8 ranks * 256 experts: the global-memory kernel took
// 9 us on the H200). map != nullptr (chunk_layout's fused map, map_len <= kFusedMapRows): the
// block also writes inclusive_offsets and map[p] for p < map_len, chunk_map's values, and leaves
// the workspace arrays unwritten (only the header); one launch instead of two.
__global__ void __launch_bounds__(kScanThreads)
    chunk_layout_smem_kernel(IndexRef sizes, IndexRef sorted, int c, int ranks, int alignment, int64_t rows, Layout l,
                             int map_len, int32_t* map, int32_t* inclusive_offsets) {
  pdl_begin();
  __shared__ LayoutSmem<kScanThreads, kSmemPer> s;
  const int groups = c / ranks;
  const int per = (c + kScanThreads - 1) / kScanThreads;  // <= kSmemPer
  const int i0 = min(c, static_cast<int>(threadIdx.x) * per), i1 = min(c, i0 + per);
  int prow[kSmemPer], psrc[kSmemPer], n[kSmemPer], real = 0;
  const int padded_total = layout_in_smem(s, sizes, sorted, c, ranks, alignment, rows, i0, i1, prow, psrc, n, &real);
  if (threadIdx.x == 0) {
    *l.real_total = real;
    *l.padded_total = padded_total;
  }
  for (int g = static_cast<int>(threadIdx.x); g < groups; g += kScanThreads) {
    if (map != nullptr) {
      inclusive_offsets[g] = s.ginc[g];
    } else {
      l.group_incl[g] = s.ginc[g];
      l.group_real[g] = s.greal[g];
    }
  }
  if (map == nullptr) {  // the workspace arrays, for chunk_map
#pragma unroll
    for (int q = 0; q < kSmemPer; ++q) {
      const int j = i0 + q;
      if (j >= i1) break;
      l.pos_row[j] = prow[q];
      l.pos_src[j] = psrc[q];
      l.pos_size[j] = n[q];
      l.src_excl[j] = s.excl[j];
    }
    return;
  }
  positions_to_smem(s, i0, i1, prow, psrc, n);
  for (int p = static_cast<int>(threadIdx.x); p < map_len; p += kScanThreads) {
    map[p] = chunk_source_row(s, c, padded_total, rows, p);
  }
}

// The whole of sort_chunks in one launch for C <= kRowChunks: every block lays out the chunks
// itself (C sizes from L2, three block scans), then writes map[p] for its rows and moves them
// (rows_per_block consecutive output rows, over a grid-stride loop; block 0 writes
// inclusive_offsets). No layout launch ahead of the row pass: at decode that launch and its wait
// were most of sort_chunks' time above the row pass. W: the word rows move in (uint4 for 16-byte
// rows, else the element's size). Rows at or past P: zeroed when zero_tail (their map is -1), else
// untouched; padding rows below P: zeroed, or left unwritten when skip_unmapped.
constexpr int kRowThreads = policy::kChunkRowThreads;
constexpr int kRowPer = 4;
constexpr int kRowChunks = kRowThreads * kRowPer;
constexpr int kRowUnits = 4;  // words a thread in flight
constexpr int kRowMaxRows = 8;
// Grid-wide (blocks of kRowThreads): map[p] = -1 for p in [first, rows), thread by thread. The rows
// past `limit` of both one-launch forms: with zero_tail off only their map entries are written, not
// a round of the row pass for each (decode: 5888 capacity rows, 2272 of them below P; the
// row-by-row form 21.3 -> 20.6 us in one graph on an H200).
__device__ __forceinline__ void unmap_tail(int32_t* map, int64_t first, int64_t rows) {
  for (int64_t p = first + static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x; p < rows;
       p += static_cast<int64_t>(gridDim.x) * kRowThreads) {
    map[p] = -1;
  }
}
// Block-wide: row `to` = row `in` (zero when from < 0), word u by thread u mod kRowThreads, kRowUnits
// words in flight a thread (the row-by-row and one-scan forms' row move).
template <typename W>
__device__ __forceinline__ void move_row(const W* in, W* to, int32_t from, int words) {
  for (int u0 = 0; u0 < words; u0 += kRowThreads * kRowUnits) {
    W v[kRowUnits];
#pragma unroll
    for (int k = 0; k < kRowUnits; ++k) {
      const int u = u0 + k * kRowThreads + static_cast<int>(threadIdx.x);
      if (u < words) {
        if (from >= 0) v[k] = in[u];
        else memset(&v[k], 0, sizeof(W));
      }
    }
#pragma unroll
    for (int k = 0; k < kRowUnits; ++k) {
      const int u = u0 + k * kRowThreads + static_cast<int>(threadIdx.x);
      if (u < words) to[u] = v[k];
    }
  }
}

// kRowwise (chunk_rows_rowwise_kernel, for rows of at least kRowThreads words; policy::chunk_rows_form
// chooses): the block's rows moved one at a time, word u by thread u mod kRowThreads, kRowUnits
// words in flight a thread, with no division: the flattened (row, word) loop divides by `words`
// twice a word (14% of the samples of decode's sort_chunks under ncu).
template <typename W, bool kRowwise>
__device__ __forceinline__ void chunk_rows_body(const RowsArg& src, IndexRef sizes, IndexRef sorted, int c, int ranks,
                                                int alignment, const RowsArg& out, int words, int rows_per_block,
                                                bool zero_tail, bool skip_unmapped, int32_t* map,
                                                int32_t* inclusive_offsets) {
  __shared__ LayoutSmem<kRowThreads, kRowPer> s;
  __shared__ int32_t s_from[kRowMaxRows];
  const int groups = c / ranks;
  const int per = (c + kRowThreads - 1) / kRowThreads;  // <= kRowPer
  const int i0 = min(c, static_cast<int>(threadIdx.x) * per), i1 = min(c, i0 + per);
  int prow[kRowPer], psrc[kRowPer], n[kRowPer], real = 0;
  const int padded_total =
      layout_in_smem(s, sizes, sorted, c, ranks, alignment, src.rows, i0, i1, prow, psrc, n, &real);
  if (blockIdx.x == 0) {
    for (int g = static_cast<int>(threadIdx.x); g < groups; g += kRowThreads) inclusive_offsets[g] = s.ginc[g];
  }
  positions_to_smem(s, i0, i1, prow, psrc, n);
  const int64_t limit = zero_tail ? out.rows : (padded_total < out.rows ? padded_total : out.rows);
  unmap_tail(map, limit, out.rows);
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block; r0 < limit;
       r0 += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int nrows = limit - r0 < rows_per_block ? static_cast<int>(limit - r0) : rows_per_block;
    __syncthreads();  // s_from of the previous round read
    if (threadIdx.x < static_cast<unsigned>(nrows)) {
      const int64_t p = r0 + threadIdx.x;
      const int32_t from = chunk_source_row(s, c, padded_total, src.rows, p);
      map[p] = from;
      s_from[threadIdx.x] = from;
    }
    __syncthreads();
    if constexpr (kRowwise) {
      for (int row = 0; row < nrows; ++row) {
        const int32_t from = s_from[row];
        if (skip_unmapped && from < 0) continue;
        const W* in = reinterpret_cast<const W*>(row_ptr(src, from < 0 ? 0 : from));
        move_row(in, reinterpret_cast<W*>(row_ptr(out, r0 + row)), from, words);
      }
      continue;
    }
    const int total_words = nrows * words;
    for (int base = 0; base < total_words; base += kRowThreads * kRowUnits) {
      W v[kRowUnits];
#pragma unroll
      for (int k = 0; k < kRowUnits; ++k) {
        const int i = base + k * kRowThreads + static_cast<int>(threadIdx.x);
        if (i < total_words) {
          const int row = i / words;
          const int32_t from = s_from[row];
          if (from >= 0) v[k] = reinterpret_cast<const W*>(row_ptr(src, from))[i - row * words];
          else memset(&v[k], 0, sizeof(W));
        }
      }
#pragma unroll
      for (int k = 0; k < kRowUnits; ++k) {
        const int i = base + k * kRowThreads + static_cast<int>(threadIdx.x);
        if (i < total_words) {
          const int row = i / words;
          if (skip_unmapped && s_from[row] < 0) continue;
          reinterpret_cast<W*>(row_ptr(out, r0 + row))[i - row * words] = v[k];
        }
      }
    }
  }
}

template <typename W>
__global__ void __launch_bounds__(kRowThreads)
    chunk_rows_kernel(RowsArg src, IndexRef sizes, IndexRef sorted, int c, int ranks, int alignment, RowsArg out,
                      int words, int rows_per_block, bool zero_tail, bool skip_unmapped, int32_t* map,
                      int32_t* inclusive_offsets) {
  pdl_begin(l2_share(src));
  chunk_rows_body<W, false>(src, sizes, sorted, c, ranks, alignment, out, words, rows_per_block, zero_tail,
                            skip_unmapped, map, inclusive_offsets);
}
template <typename W>
__global__ void __launch_bounds__(kRowThreads, 6)  // 6: 40 registers, as chunk_rows_kernel
    chunk_rows_rowwise_kernel(RowsArg src, IndexRef sizes, IndexRef sorted, int c, int ranks, int alignment,
                              RowsArg out, int words, int rows_per_block, bool zero_tail, bool skip_unmapped,
                              int32_t* map, int32_t* inclusive_offsets) {
  pdl_begin(l2_share(src));
  chunk_rows_body<W, true>(src, sizes, sorted, c, ranks, alignment, out, words, rows_per_block, zero_tail,
                           skip_unmapped, map, inclusive_offsets);
}

// The one launch without sorted_index for C <= kRowThreads chunks and rows of at least kRowThreads
// words, with the layout in one block scan: thread t puts chunk t's size in shared memory and, for
// group t, sums its R sizes there (the within-group starts to shared memory, the group's padded
// size); one scan of the two packed into 64 bits (each sum fits in 32: layout_sums_fit_32) gives
// every chunk's source start and every group's first padded row. Then one output row a block a
// round, every thread finding its source itself (two binary searches in shared memory) with no
// barrier; rows past P with zero_tail off get their map entry only. The default where it applies
// (policy::chunk_rows_form): measured on the H200, decode
// sort_chunks 20.6 -> 18.3-18.4 us in one graph, 22.9 -> 21.2 eager (chunk_rows_rowwise_kernel
// with the same tail rule); the bandwidth pattern of a scan in every block ahead of one row a
// block ran at 16.5 us against 16.2 with no scan.
template <typename W>
__global__ void __launch_bounds__(kRowThreads)
    chunk_rows_one_scan_kernel(RowsArg src, IndexRef sizes, int c, int ranks, int alignment, RowsArg out, int words,
                               bool zero_tail, bool skip_unmapped, int32_t* map, int32_t* inclusive_offsets) {
  pdl_begin(l2_share(src));
  using Scan = cub::BlockScan<unsigned long long, kRowThreads>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int s_size[kRowThreads], s_excl[kRowThreads], s_inner[kRowThreads], s_pstart[kRowThreads];
  const int t = static_cast<int>(threadIdx.x), groups = c / ranks;
  const int mine = t < c ? static_cast<int>(clamped_size(sizes, t, src.rows)) : 0;
  if (t < c) s_size[t] = mine;
  __syncthreads();
  int padded = 0;
  if (t < groups) {  // from shared memory: a loop over global loads would wait on each in turn
    int run = 0;
    for (int r = 0; r < ranks; ++r) {
      const int i = r * groups + t;
      s_inner[i] = run;
      run += s_size[i];
    }
    padded = round_up_32(run, alignment);
  }
  const unsigned long long packed = (static_cast<unsigned long long>(padded) << 32) | static_cast<unsigned>(mine);
  unsigned long long excl = 0, total = 0;
  Scan(storage).ExclusiveSum(packed, excl, total);
  if (t < c) s_excl[t] = static_cast<int>(excl & 0xffffffffu);
  if (t < groups) s_pstart[t] = static_cast<int>(excl >> 32);
  const int padded_total = static_cast<int>(total >> 32);
  __syncthreads();
  if (blockIdx.x == 0 && t < groups) inclusive_offsets[t] = s_pstart[t] + padded;
  const int64_t limit = zero_tail ? out.rows : (padded_total < out.rows ? padded_total : out.rows);
  unmap_tail(map, limit, out.rows);
  for (int64_t p = blockIdx.x; p < limit; p += gridDim.x) {
    int32_t from = -1;
    if (p < padded_total) {
      int lo = 0, hi = groups;  // the last group starting at or before p
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (s_pstart[mid] <= p) lo = mid;
        else hi = mid;
      }
      const int g = lo, local = static_cast<int>(p) - s_pstart[g];
      int rlo = 0, rhi = ranks;  // the last rank of group g whose rows start at or before local
      while (rhi - rlo > 1) {
        const int mid = (rlo + rhi) / 2;
        if (s_inner[mid * groups + g] <= local) rlo = mid;
        else rhi = mid;
      }
      const int i = rlo * groups + g, off = local - s_inner[i];
      if (off < s_size[i] && static_cast<int64_t>(s_excl[i]) + off < src.rows) from = s_excl[i] + off;
    }
    if (t == 0) map[p] = from;
    if (skip_unmapped && from < 0) continue;
    const W* in = reinterpret_cast<const W*>(row_ptr(src, from < 0 ? 0 : from));
    move_row(in, reinterpret_cast<W*>(row_ptr(out, p)), from, words);
  }
}

__device__ __forceinline__ void report(Key* key, int code, int64_t pos) {
  atomicMin(key, (static_cast<Key>(code) << kPosBits) | static_cast<Key>(pos));
}

__global__ void validate_chunks_kernel(IndexRef sizes, IndexRef sorted, int64_t c, int64_t rows, Layout l) {
  pdl_begin();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < c;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = load_index(sizes, i);
    if (n < 0) report(l.key, kChunkCountNegative, i);
    else if (n > rows) report(l.key, kChunkCountTooLarge, i);
    if (sorted.data != nullptr) {
      const int64_t s = load_index(sorted, i);
      if (s < 0 || s >= c) report(l.key, kChunkIndexOutOfRange, i);
      else if (atomicExch(l.seen + s, 1) != 0) report(l.key, kChunkIndexRepeated, s);
    }
  }
}

// map[p]: the last position whose first row is <= p holds p when p is inside
// its size, else p is padding; -1 at or past P. Also inclusive_offsets.
__global__ void chunk_map_kernel(Layout l, int64_t c, int64_t groups, int64_t rows, int64_t map_len, int32_t* map,
                                 int32_t* inclusive_offsets) {
  pdl_begin();
  const int64_t padded = *l.padded_total;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < map_len || p < groups;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (p < groups) inclusive_offsets[p] = static_cast<int32_t>(l.group_incl[p]);
    if (p >= map_len) continue;
    int32_t v = -1;
    if (p < padded) {
      int64_t lo = 0, hi = c;  // first position with pos_row > p
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (l.pos_row[mid] > p) hi = mid;
        else lo = mid + 1;
      }
      if (lo > 0) {
        const int64_t j = lo - 1, local = p - l.pos_row[j];
        const int64_t src = l.pos_src[j] + local;
        if (local < l.pos_size[j] && src < rows) v = static_cast<int32_t>(src);
      }
    }
    map[p] = v;
  }
}

}  // namespace
}  // namespace cuda
}  // namespace padmoe
