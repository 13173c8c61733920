// cuda_backend.hpp — host-callable launchers of the CUDA backend.
//
// Raw device pointers, sizes and a stream (void*, a cudaStream_t) only: this
// header includes no CUDA header, so the API layer (plain C++) calls it. The
// API layer has checked shapes, dtypes and devices; the data-dependent
// properties are checked by the validate_* launchers (checked mode) or
// assumed (the unchecked fast path). Nothing here synchronizes with the host
// except the validate_* functions, which must report on the host.
//
// P (padded rows) is known on the device only: kernels read it from
// padded_bins[E-1] and are launched over a host-side row bound.
#pragma once

#include <cstddef>
#include <cstdint>

#include "padmoe/index_math.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"

namespace padmoe {
namespace cuda {

// An int32 or int64 device array.
struct IndexRef {
  const void* data = nullptr;
  bool wide = false;
  static IndexRef of(const TensorView& t) { return IndexRef{t.data, t.dtype == DType::kInt64}; }
};

// A [rows, cols] device row matrix with a byte row stride.
struct RowsArg {
  void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride_bytes = 0;
  DType dtype = DType::kFloat32;
  // Set by the launchers only (with_l2_prefetch, rows.cu): the grid's first l2_blocks blocks ask
  // L2 for every row (l2_bytes bytes each) before the kernel's pdl_wait; l2_bytes 0: not.
  uint32_t l2_bytes = 0;
  int32_t l2_blocks = 0;
  static RowsArg of(const TensorView& t) {
    return RowsArg{t.data, t.shape[0], t.shape[1], t.strides[0] * static_cast<int64_t>(element_size(t.dtype)),
                   t.dtype};
  }
};

// Optional per-row scale (weights / probs): float32 or a row dtype; data null = 1.
struct ScaleArg {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
};

// Optional scale rows moved with the data rows (the `_scaled` ops): src one
// contiguous row of `cols` entries per source row, dst one per output row,
// `elem` bytes an entry (4: float32, 1: E8M0); rows that get zero data get
// `one` (the bits of a scale 1) in every entry.
struct ScaleRowsArg {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t cols = 0;
  int elem = 4;
  uint32_t one = 0;
};

// Optional per-assignment float output: float32 or a row dtype; data null = skip.
struct FloatOutArg {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
};

// --- memory -----------------------------------------------------------------
void* device_alloc(size_t bytes, int device);  // cudaMalloc on `device`
void device_free(void* p);
// Byte copy between any two of host/device memory, ordered on `stream`. Host
// to/from device synchronizes the stream (the host buffer must be ready / read).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes, void* stream);
void memset_async(void* dst, int value, size_t bytes, void* stream);
void synchronize(void* stream);
int device_count();

// Scratch memory for one op: the caller's Options::workspace when it is large
// enough, else stream-ordered cudaMallocAsync / cudaFreeAsync (capturable in
// CUDA graphs; no cudaMalloc on the hot path after the pool warms up).
class Scratch {
 public:
  Scratch(const Options& options, size_t bytes, int device);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  void* stream_ = nullptr;
  bool owned_ = false;
  void (*free_)(void*, void*, void*) = nullptr;  // Options::scratch_free when scratch_alloc gave ptr_
  void* free_ctx_ = nullptr;
};

// --- plan ---------------------------------------------------------------------
constexpr int kPlanChunk = 2048;  // assignments sorted per block
// Workspace bytes make_plan needs for A assignments over E experts.
size_t plan_workspace_bytes(int64_t assignments, int num_experts);
// Stable counting sort by expert: one launch for E <= 512 (cooperative when
// it takes more than one block), two launches above or with
// PADMOE_CUDA_PLAN=split. Ids are mapped to the plan's
// experts by `remap`; one it maps to -1 (another rank's expert, an invalid id
// the caller drops, or any id outside [0, E) unchecked) is dropped: dest_rows
// -1, not counted, and positions past the kept count get indices = bin_ids = -1.
// out: int32 device arrays; row_sources has row_capacity entries (padding_source
// on padding rows and past P); the given layouts are written in the same launch.
void make_plan(IndexRef top_experts, int64_t assignments, int top_k, int num_experts, int alignment,
               const PlanView& out, const PlanLayouts& layouts, int32_t padding_source,
               const index::ExpertRemap& remap, int64_t row_capacity, void* workspace, void* stream);
// Which make_plan kernels run (tests, benchmarks; overrides PADMOE_CUDA_PLAN): -1 the
// two-launch split path, 0 the fused launch (default), N > 0 the fused launch on at
// most N blocks (several chunks a block).
void set_plan_kernel(int mode);
// How the fused plan finds equal keys in a warp (tests; overrides PADMOE_CUDA_PLAN_MATCH): -1 by
// the expert count (the default: a ballot a key bit for E >= 64, __match_any_sync below), 0 the
// match, 1 the ballot. Same results either way.
void set_plan_match(int mode);
// The small plan kernel for one chunk (A <= 2048; tests; overrides PADMOE_CUDA_PLAN_SMALL): 0 the
// fused kernel instead, 16, 32 or 64 its blocks, -1 the default (32).
void set_plan_small(int blocks);
// The fused plan's per-block counts (tests; overrides PADMOE_CUDA_PLAN_PACKED): -1 the default
// (16-bit pairs where a block's counts fit, up to 31 chunks a block, for E >= 64), 1 pairs
// wherever they fit, 0 one int an expert. Same results every way.
void set_plan_packed(int mode);
// Fixed capacity C (one launch): `out` (segments exactly C rows, P = E * C) and
// the given layouts from `full`, a plan of the same routing at alignment 1
// holding every kept assignment. Each expert keeps its first C sorted
// assignments, or with by_probs the C with the largest probs (ties: lower
// assignment id), in assignment order; *dropped (device, when not null) = the
// number dropped.
// The sizes are the checked arguments' (A, E): a PlanView's scalar fields are never read.
void apply_capacity(const PlanView& full, int64_t assignments, int num_experts, ScaleArg probs, int64_t capacity,
                    bool by_probs, int alignment, const PlanView& out, const PlanLayouts& layouts,
                    int32_t padding_source, int64_t row_capacity, int32_t* dropped, void* stream);

// --- routing ------------------------------------------------------------------
// dest_rows[indices[i]] = padded_start(e) + i - real_start(e), e = bin_ids[i] (entries with
// indices[i] outside [0, assignments) or e outside [0, num_experts) write nothing).
void build_dest_rows(IndexRef indices, IndexRef bin_ids, IndexRef bins, IndexRef padded_bins, int64_t assignments,
                     int num_experts, int32_t* dest_rows, void* stream);

// Where padding is: rows r < P of expert segment e with r - padded_start(e)
// >= count(e). bins / padded_bins are inclusive cumulative sums.
struct PaddingRef {
  IndexRef bins;
  IndexRef padded_bins;
  int num_experts = 0;
};

// --- row kernels ----------------------------------------------------------------
// At small T the reduce kernels (ops without dot products) split each row over
// several blocks so that about 4 blocks per multiprocessor run;
// PADMOE_CUDA_SLICE_BLOCKS=N sets that target (0: no slicing), and
// PADMOE_CUDA_SPREAD_SLICES=1 slices the spread kernels too (off by default:
// slower on the H200). set_slice_blocks overrides the target (tests,
// benchmarks; -1: back to the default); N > 0 there slices spreads as well.
void set_slice_blocks(int blocks);
// The spreads without dot products a warp a token, 4 or 8 16-byte units a lane and round (tests,
// benchmarks; overrides PADMOE_CUDA_SPREAD_WARP): 0 the block kernel, -1 back to the default (8 for
// rows of at most 8 KiB, K copies of at most 32 KiB and 16 tokens an SM or more; else the block
// kernel). The same bits every way.
void set_spread_warp(int units);
// Dot-product kernels (tests, benchmarks; overrides PADMOE_CUDA_DOTS): -1 chosen by shape (the
// default: row_dots and spreads with dots a warp an assignment; reduce with dots a block a
// token in the warp kernel's form for few tokens (under ~4 blocks an SM), a warp a token
// otherwise), 0 the block kernels everywhere; with the warp spreads and row_dots: 1 reduce's
// wide (2, 8) shape, 2 reduce a warp a token, 3 reduce a block a token in the warp form, 4 the
// same with two units a lane at a time (3's bits), each everywhere (the warp-form reduces for
// top_k <= 8; above, the block kernel).
void set_dot_kernels(int mode);
// row_dots (padded_scatter_wgrad) for top_k <= 8 (tests, benchmarks; overrides PADMOE_CUDA_ROW_DOTS):
// 0 a warp an assignment, 1 a block a token with every source row's unit loaded together; -1 back
// to the default (1 for top_k > 2, else 0). Above top_k 8, and under set_dot_kernels(0), the
// warp / block kernels as before.
void set_row_dots(int mode);
// The plain reduce's shape (tests, benchmarks; overrides PADMOE_CUDA_REDUCE_SHAPE): -1 chosen by
// shape (the default: for top_k <= 8 a block a token in the warp kernel's form, with two units a
// lane at a time below 2.5 tokens an SM and rows of 512 units or more, and below one token an SM
// the block kernel with 8 source rows loaded together (top_k > 2); above top_k 8 the block
// kernel), 0 the block kernel's (1, 4) shape everywhere, 1 (1, 8), 2 (2, 8), 3 (2, 4) for top_k >
// 2, 4 a block a token (6: two units a lane at a time) and 5 a warp a token in the warp kernel's
// form for top_k <= 8. Every shape gives the same bits.
void set_reduce_shape(int shape);
// Programmatic dependent launch (tests, benchmarks; overrides PADMOE_CUDA_PDL): 1 on (the
// default on sm_90 and up), 0 off, -1 back to the default. Every kernel waits for the one
// before it (griddepcontrol.wait) before its first memory access, so results do not change.
void set_pdl(int mode);
// Where the row kernels find assignment a's destination row: rows[a] (dest_rows, from a plan or
// built by build_dest_rows), or, with rows null, by a search of the sorted form (MegaBlocks'
// indices / bin_ids / bins / padded_bins): each block reads the whole of indices and bin_ids for
// its own assignments, which saves the build_dest_rows launch (and its scratch) where A is small
// (dest_search_fits). Entries of bad unchecked input (an assignment id or expert out of range)
// are skipped, as build_dest_rows skips them.
struct DestArg {
  const int32_t* rows = nullptr;
  IndexRef indices, bin_ids, bins, padded_bins;
  int num_experts = 0;
  int64_t assignments = 0;
  DestArg() = default;
  DestArg(const int32_t* dest_rows) : rows(dest_rows) {}  // NOLINT(google-explicit-constructor)
};
// Whether the row kernels may search the sorted form instead of a dest_rows array: A <= 4096,
// E <= 256, top_k <= 8 (PADMOE_CUDA_DEST_SEARCH=0, read once, or set_dest_search(0) turns it off;
// set_dest_search(-1) back to the default).
bool dest_search_fits(int64_t assignments, int num_experts, int top_k);
void set_dest_search(int mode);
// y[dest[a]] = x[a/K] * w(a) for dest >= 0; rows < P that are padding are zeroed,
// and rows in [P, y.rows) too when zero_past_end (allocating forms). When
// dots_with is given: dots[a] = <dots_with[dest[a]], x[a/K]> from the same read.
// zero_padding false: padding rows below P are left unwritten.
// scales: each row's scale row moves with it in the same block (zeroed rows
// get scale 1); without scales the kernels are the plain ones.
void spread_rows(const RowsArg& x, int top_k, const DestArg& dest, ScaleArg w, const RowsArg& y,
                 const PaddingRef& padding, bool zero_padding, bool zero_past_end, const RowsArg* dots_with,
                 FloatOutArg dots, void* stream, const ScaleRowsArg* scales = nullptr);

// out[t] = sum_{k ascending} w(t*K+k) * y[dest[t*K+k]], float32, dest < 0 skipped.
// When dots_with is given: dots[a] = <y[dest[a]], dots_with[a/K]> from the same reads of y.
void reduce_rows(const RowsArg& y, int top_k, const DestArg& dest, ScaleArg w, const RowsArg& out,
                 const RowsArg* dots_with, FloatOutArg dots, void* stream);

// out[a] = <y[dest[a]], g[a/K]> (0 where dest < 0).
void row_dots(const RowsArg& y, const RowsArg& g, int top_k, const DestArg& dest, int64_t assignments,
              FloatOutArg out, void* stream);

// out[r] = src[map[r]] * s(scale index) or zero for map[r] < 0, r < rows;
// rows at or past *row_limit (a device int32, e.g. P) are left untouched.
// skip_unmapped: rows with map < 0 are left unwritten instead of zeroed.
// scales: as for spread_rows.
// reads_all_rows: the caller knows every row of src is read (sort_chunks), so the rows may be asked
// into L2 while the kernel before the gather runs (l2_prefetch_mode).
void gather_rows(const RowsArg& src, IndexRef map, ScaleArg s, bool scale_by_source, const RowsArg& out, int64_t rows,
                 const int32_t* row_limit, void* stream, bool skip_unmapped = false,
                 const ScaleRowsArg* scales = nullptr, bool reads_all_rows = false);

// L2 prefetch before the wait: 0 off, 1 the default rule (PDL on and the rows at most 60% of the
// L2), 2 at every size. PADMOE_CUDA_PREFETCH=0|all (read once); set_l2_prefetch (tests: -1 the
// default).
int l2_prefetch_mode();
void set_l2_prefetch(int mode);

// Unpad's backward with dots, a warp a row: out[r] = src[map[r]] * s[map[r]] (zero for
// map[r] < 0), r < rows, and dots[map[r]] = <dots_with[r], src[map[r]]>; dots[n] = 0 for
// every n < dots_len no entry names (zeroed first, in the same stream).
void gather_rows_dots(const RowsArg& src, IndexRef map, ScaleArg s, const RowsArg& out, int64_t rows,
                      const RowsArg& dots_with, FloatOutArg dots, int64_t dots_len, void* stream);

// --- Megatron maps ----------------------------------------------------------------
// From counts[E]: inclusive_offsets[E] (padded inclusive cumsum) and
// map[p] for p < map_len: source row or -1 (padding, p >= P, and sources outside the `rows` rows of
// the input: bad unchecked counts).
// workspace: pad_workspace_bytes(E). One launch for E <= 4096 (each block scans the counts),
// two above (a one-block scan, then the map).
size_t pad_workspace_bytes(int num_experts);
void pad_map(IndexRef counts, int num_experts, int alignment, int64_t map_len, int64_t rows, int32_t* map,
             int32_t* inclusive_offsets, void* workspace, void* stream);
// inverse[n] = p for map[p] == n, else -1 (n < original_size).
void invert_map(IndexRef map, int64_t map_len, int64_t original_size, int32_t* inverse, void* stream);

// --- checked mode -------------------------------------------------------------------
// Each returns 0 when valid, else an error code (below) with the first
// offending position in *pos and details in *v1 / *v2 (read back on the host;
// these synchronize the stream).
enum ValidateCode : int {
  kOk = 0,
  kExpertOutOfRange = 1,       // pos: assignment, v1: id
  kBinsDecreasing = 2,         // pos: e
  kBinsTotal = 3,              // v1: bins[E-1]
  kPaddedDecreasing = 4,       // pos: e
  kPaddedTooSmall = 5,         // pos: e, v1: padded rows, v2: count
  kBinIdsInconsistent = 6,     // pos: i, v1: bin_ids[i]
  kIndexOutOfRange = 7,        // pos: i, v1: value
  kIndexRepeated = 8,          // v1: the (smallest) repeated id
  kCapacity = 9,               // v1: rows needed (P), v2: rows given
  kCountNegative = 10,         // pos: e, v1: count
  kCountTotal = 11,            // v1: sum, v2: rows
  kMapOutOfRange = 12,         // pos: p, v1: value
  kMapRepeated = 13,           // v1: the (smallest) repeated row
  kPlanDestRows = 14,          // pos: a, v1: dest row
  kPlanRowSources = 15,        // pos: row, v1: value
  kExpertMapOutOfRange = 16,   // pos: global id, v1: entry
};
struct Violation {
  int code = kOk;
  int64_t pos = 0, v1 = 0, v2 = 0;
};
size_t validate_workspace_bytes(int64_t entries);
Violation validate_top_experts(IndexRef ids, int64_t assignments, int num_experts, void* workspace, void* stream);
// make_plan's ids with PlanOptions in one launch: ids in [0, global) when check_ids; expert_map
// entries (map.data set: [global]) in [-1, num_experts).
Violation validate_routing_ids(IndexRef ids, int64_t assignments, int64_t global, bool check_ids, IndexRef map,
                               int num_experts, void* workspace, void* stream);
// bins/padded_bins/bin_ids/indices of A assignments, E experts; output_rows < 0 skips the capacity check.
Violation validate_sorted_routing(IndexRef indices, IndexRef bin_ids, IndexRef bins, IndexRef padded_bins,
                                  int64_t assignments, int num_experts, int64_t output_rows, void* workspace,
                                  void* stream);
Violation validate_plan(const PlanView& plan, int64_t output_rows, void* workspace, void* stream);
Violation validate_counts(IndexRef counts, int num_experts, int alignment, int64_t rows, int64_t output_rows,
                          void* workspace, void* stream);
Violation validate_map(IndexRef map, int64_t map_len, int64_t original_size, void* workspace, void* stream);

// --- chunk sort (sort_chunks) ------------------------------------------------------
// The layout of C = num_chunks chunks (src/cuda/chunks.cu): a single-block
// device scan of split_sizes (and sorted_index; data null = the expert-major
// order) into `workspace`, then the row map. Nothing but workspace is written
// before chunk_map. workspace: chunk_workspace_bytes(C), shared by the three.
inline size_t chunk_workspace_bytes(int64_t num_chunks) {
  return 256 + 56 * static_cast<size_t>(num_chunks > 0 ? num_chunks : 0);
}
// Sizes are clamped to [0, rows + 1] and out-of-range sorted_index entries read
// as empty chunks, so an unchecked bad input cannot overflow or read out of bounds.
// With map (the unchecked path: nothing is validated in between) it may also write the map and
// inclusive_offsets, chunk_map's values, in the same launch, and returns true; then chunk_map is
// not needed (the default for map_len <= 16384; PADMOE_CUDA_CHUNK_MAP=separate, set_chunk_map_fused:
// tests and measurements).
bool chunk_layout(IndexRef split_sizes, IndexRef sorted_index, int64_t num_chunks, int num_ranks, int alignment,
                  int64_t rows, void* workspace, void* stream, int64_t map_len = 0, int32_t* map = nullptr,
                  int32_t* inclusive_offsets = nullptr);
// -1 the environment's choice (on unless PADMOE_CUDA_CHUNK_MAP=separate), 0 off, 1 on.
void set_chunk_map_fused(int mode);
// sort_chunks in one launch (sort_chunk_rows) when it fits: 1 <= C <= 1024, the sums within 32
// bits, and by default received rows of at most the L2's size (small batches: decode); src: the
// received rows, out: padded (the map has as many entries as it has rows).
// PADMOE_CUDA_CHUNK_ROWS=0 | all (read once) or set_chunk_rows(0 off | 1 wherever it fits | 2 the
// default rule; -1 the environment's choice). Every block lays out the chunks
// itself, then writes its rows' map entries and moves its rows; block 0 writes inclusive_offsets.
// For unchecked sizes (or sizes checked on the host): bad entries get what the layout + gather
// path gives them.
bool chunk_rows_fit(int64_t num_chunks, int num_ranks, int alignment, const RowsArg& src, const RowsArg& out);
void set_chunk_rows(int mode);
// The one launch's rows moved one at a time (rows of at least 256 words; tests; overrides
// PADMOE_CUDA_CHUNK_ROWWISE): 1 on, 0 off, -1 the default (on). Same results every way.
void set_chunk_rowwise(int mode);
// The one launch with its layout in one block scan, for calls without sorted_index and at most 256
// chunks, rows of at least 256 words (tests; overrides PADMOE_CUDA_CHUNK_ONE_SCAN): 1 on, 0 off, -1
// the default (on). Same results every way.
void set_chunk_one_scan(int mode);
void sort_chunk_rows(const RowsArg& src, IndexRef split_sizes, IndexRef sorted_index, int64_t num_chunks,
                     int num_ranks, int alignment, const RowsArg& out, bool zero_tail, bool skip_unmapped,
                     int32_t* map, int32_t* inclusive_offsets, void* stream);
// Checked mode, after chunk_layout: split sizes in [0, rows], sorted_index a
// permutation, sum <= rows, P <= INT32_MAX, P <= output_rows (< 0: skipped).
// The lowest code, then the lowest position, is reported. Synchronizes.
enum ChunkValidateCode : int {
  kChunkCountNegative = 1,    // pos: chunk, v1: size
  kChunkCountTooLarge = 2,    // pos: chunk, v1: size (> rows)
  kChunkIndexOutOfRange = 3,  // pos: position, v1: value
  kChunkIndexRepeated = 4,    // pos = v1: the smallest repeated chunk
  kChunkCountTotal = 5,       // v1: sum, v2: rows
  kChunkOverflow = 6,         // v1: P
  kChunkCapacity = 7,         // v1: P, v2: output rows
};
Violation validate_chunks(IndexRef split_sizes, IndexRef sorted_index, int64_t num_chunks, int64_t rows,
                          int64_t output_rows, void* workspace, void* stream);
// From the layout: inclusive_offsets[C / num_ranks] and map[p] for p < map_len
// (source row, -1 for padding, for p >= P and for rows >= rows).
void chunk_map(const void* workspace, int64_t num_chunks, int num_ranks, int64_t rows, int64_t map_len, int32_t* map,
               int32_t* inclusive_offsets, void* stream);

}  // namespace cuda
}  // namespace padmoe
