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

#include "core/backend_types.hpp"
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

// The argument types shared with the CPU backend (core/backend_types.hpp): a [rows, cols] device
// row matrix with a byte row stride, an optional per-row scale (data null = 1), scale rows moved
// with the data rows (the `_scaled` ops), an optional per-assignment float output (data null =
// skip). The kernels take them by value.
using RowsArg = backend::RowsRef;
using ScaleArg = backend::Scale;
using ScaleRowsArg = backend::ScaleRows;
using FloatOutArg = backend::FloatOut;

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
// it takes more than one block), two launches above (policy::plan_path). Ids are mapped to the plan's
// experts by `remap`; one it maps to -1 (another rank's expert, an invalid id
// the caller drops, or any id outside [0, E) unchecked) is dropped: dest_rows
// -1, not counted, and positions past the kept count get indices = bin_ids = -1.
// out: int32 device arrays; row_sources has row_capacity entries (padding_source
// on padding rows and past P); the given layouts are written in the same launch.
void make_plan(IndexRef top_experts, int64_t assignments, int top_k, int num_experts, int alignment,
               const PlanView& out, const PlanLayouts& layouts, int32_t padding_source, const index::ExpertRemap& remap,
               int64_t row_capacity, void* workspace, void* stream);
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
// Whether the row kernels may search the sorted form instead of a dest_rows array:
// policy::dest_search_fits (A <= 4096, E <= 256, top_k <= 8) unless KernelOverrides::dest_search
// is false.
bool dest_search_fits(int64_t assignments, int num_experts, int top_k);
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
void row_dots(const RowsArg& y, const RowsArg& g, int top_k, const DestArg& dest, int64_t assignments, FloatOutArg out,
              void* stream);

// out[r] = src[map[r]] * s(scale index) or zero for map[r] < 0, r < rows;
// rows at or past *row_limit (a device int32, e.g. P) are left untouched.
// skip_unmapped: rows with map < 0 are left unwritten instead of zeroed.
// scales: as for spread_rows.
// reads_all_rows: the caller knows every row of src is read (sort_chunks), so the rows may be asked
// into L2 while the kernel before the gather runs (policy::l2_prefetch).
void gather_rows(const RowsArg& src, IndexRef map, ScaleArg s, bool scale_by_source, const RowsArg& out, int64_t rows,
                 const int32_t* row_limit, void* stream, bool skip_unmapped = false,
                 const ScaleRowsArg* scales = nullptr, bool reads_all_rows = false);

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

// --- vLLM's batched layout (batched_moe_align_block_size) -----------------------------
// sorted_ids[entries], block_ids[entries / block_size] and *post from the counts, each read as
// clamped into [0, max_tokens] (unchecked bad counts then give a valid layout, never a write past
// the outputs); entries = round_up(max_tokens, block_size) * num_experts (< 2^31). One launch for
// E <= 4096 (every block scans the counts in shared memory); two above (a one-block scan into
// workspace, then the layout). entries == 0: *post = 0 only (num_experts may then pass 2^31).
size_t batched_align_workspace_bytes(int64_t num_experts);
void batched_align_blocks(IndexRef counts, int64_t num_experts, int max_tokens, int block_size, int64_t entries,
                          int32_t* sorted_ids, int32_t* block_ids, int32_t* post, void* workspace, void* stream);

// --- a plan from a routing mask (mask_plan; src/cuda/mask_plan.cu) --------------------
// mask_plan_out's outputs from map [T, E] bytes (sizes checked: T * E, rows and the padded total
// below 2^31, E at most kMaskPlanMaxExperts): three launches, no host synchronization. The
// workspace holds the per-chunk counts (mask_plan_workspace_bytes); indices / bin_ids (both or
// neither) and row_id_map may be null.
constexpr int64_t kMaskPlanMaxExperts = 8192;  // the place kernel's 16 bytes of shared memory an expert
size_t mask_plan_workspace_bytes(int64_t tokens, int64_t num_experts);
void mask_plan(const uint8_t* map, int64_t tokens, int num_experts, int alignment, int64_t rows, bool one_bin,
               int32_t* counts, int32_t* dest_rows, int32_t* row_sources, int64_t sources_len, int32_t* indices,
               int32_t* bin_ids, int32_t* row_id_map, const backend::MovedProbs& probs, void* workspace, void* stream);

// --- a plan from an index map of unbounded ids (index_plan; src/cuda/index_plan.cu) ---------
// index_plan_out's outputs from ids [A] (sizes checked: A and rows below 2^31). Up to
// kIndexPlanBlockSort assignments: one launch, a block's radix sort (no workspace); more: the
// assignment ids, cub's device radix sort of the ids as uint32 keys, the placement (workspace:
// index_plan_workspace_bytes, passed back as workspace_bytes: cub's scratch is the rest, so its size
// is asked for once a call). indices / bin_ids (both or neither) may be null.
constexpr int64_t kIndexPlanBlockSort = 4096;  // 512 threads x 8 keys
size_t index_plan_workspace_bytes(int64_t assignments);
void index_plan(const int32_t* ids, int64_t assignments, int64_t rows, int32_t* counts, int32_t* dest_rows,
                int32_t* row_sources, int64_t sources_len, int32_t* indices, int32_t* bin_ids, void* workspace,
                size_t workspace_bytes, void* stream);

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
  kCountOutOfRange = 17,       // pos: e, v1: count (outside [0, limit])
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
// Every count in [0, limit] (kCountOutOfRange at the first one outside); workspace: validate_workspace_bytes(0).
Violation validate_count_range(IndexRef counts, int64_t num_experts, int64_t limit, void* workspace, void* stream);

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
// not needed (policy::chunk_map_fused: map_len <= 16384).
bool chunk_layout(IndexRef split_sizes, IndexRef sorted_index, int64_t num_chunks, int num_ranks, int alignment,
                  int64_t rows, void* workspace, void* stream, int64_t map_len = 0, int32_t* map = nullptr,
                  int32_t* inclusive_offsets = nullptr);
// sort_chunks in one launch (sort_chunk_rows) when it fits: 1 <= C <= 1024, the sums within 32
// bits, and received rows of at most the L2's size (policy::chunk_rows_one_launch: small batches,
// decode); src: the received rows, out: padded (the map has as many entries as it has rows).
// The kernel's form: policy::chunk_rows_form. Every block lays out the chunks
// itself, then writes its rows' map entries and moves its rows; block 0 writes inclusive_offsets.
// For unchecked sizes (or sizes checked on the host): bad entries get what the layout + gather
// path gives them.
bool chunk_rows_fit(int64_t num_chunks, int num_ranks, int alignment, const RowsArg& src, const RowsArg& out);
void sort_chunk_rows(const RowsArg& src, IndexRef split_sizes, IndexRef sorted_index, int64_t num_chunks, int num_ranks,
                     int alignment, const RowsArg& out, bool zero_tail, bool skip_unmapped, int32_t* map,
                     int32_t* inclusive_offsets, void* stream);
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
