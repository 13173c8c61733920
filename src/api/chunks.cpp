// chunks.cpp — ops.hpp section 5: sort_chunks, the chunk sort after an
// expert-parallel all-to-all (rank-major received rows -> expert-major
// padded rows), with pad_to_alignment's outputs.
//
// Like pad_to_alignment it runs output-row-driven over a row map
// (permutation_map[p] = source row or -1): the map is built from the chunk
// layout (CPU: on the host plus a parallel map pass; CUDA: a one-block
// device scan and a map kernel), then gather_rows moves every output row
// once, zeroing padding rows in the same pass. The inverse is
// unpad_from_alignment over the same map (ops.hpp).
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "api/alloc.hpp"
#include "api/checks.hpp"
#include "cpu/cpu_backend.hpp"
#include "cuda/cuda_backend.hpp"
#include "padmoe/index_math.hpp"
#include "padmoe/ops.hpp"

namespace padmoe {
namespace {

using detail::Checker;
using detail::IndexReader;

std::string str(int64_t v) { return std::to_string(v); }

// The chunk grid: C chunks, R ranks, E = C / R groups.
struct ChunkGrid {
  int64_t chunks = 0;
  int64_t ranks = 1;
  int64_t groups = 0;
  // "[r, e]" of source chunk i (split_sizes' row-major position).
  std::string at(int64_t i) const {
    return groups > 0 ? "[" + str(i / groups) + ", " + str(i % groups) + "]" : "[" + str(i) + "]";
  }
};

// The layout of the padded output, known on the host (CPU; CUDA allocating form).
struct ChunkLayout {
  bool known = false;
  std::vector<int64_t> row_begin, src_begin, size;  // by output position
  std::vector<int64_t> offsets;                     // [E] padded inclusive cumsum
  int64_t padded_rows = -1;                         // P (-1: on the device only)
};

// split_sizes as a 1-D view of its C entries: [C], or [R, E] row-major (contiguous).
TensorView flat_sizes(const Checker& c, const TensorView& split_sizes, int num_ranks) {
  if (num_ranks < 1) c.value_error("num_ranks", "must be >= 1, got " + str(num_ranks));
  if (split_sizes.ndim != 1 && split_sizes.ndim != 2) {
    c.value_error("split_sizes", "expected a 1-D [R*E] or 2-D [R, E] tensor, got " + str(split_sizes.ndim) + " dims");
  }
  if (split_sizes.ndim == 1) return split_sizes;
  const int64_t rows = split_sizes.shape[0], cols = split_sizes.shape[1];
  if (rows != num_ranks) {
    c.value_error("split_sizes", "expected [num_ranks = " + str(num_ranks) + ", E] entries, got shape [" + str(rows) +
                                     ", " + str(cols) + "]");
  }
  if (rows < 0 || cols < 0) c.value_error("split_sizes", "negative size in its shape");
  if ((cols > 1 && split_sizes.strides[1] != 1) || (rows > 1 && split_sizes.strides[0] != cols)) {
    c.value_error("split_sizes", "expected a contiguous (row-major) tensor");
  }
  TensorView flat = split_sizes;
  flat.ndim = 1;
  flat.shape[0] = detail::checked_mul(c, "split_sizes", rows, cols);
  flat.strides[0] = 1;
  flat.shape[1] = flat.strides[1] = 0;
  return flat;
}

// Shapes, dtypes, devices and the scalar arguments; returns the grid and
// split_sizes as a 1-D view (`sizes`).
ChunkGrid check_chunk_shapes(const Checker& c, const TensorView& received, const TensorView& split_sizes, int num_ranks,
                             int alignment, const std::optional<TensorView>& sorted_index, TensorView& sizes) {
  c.row_tensor(received, "received", -1, -1, /*allow_fp8=*/true);
  // The CUDA layout's sums saturate at 2^63 - 1 (src/cuda/chunks.cu), which must exceed the rows
  // for a saturated sum to be reported: received (only possible with no columns) stays below it.
  if (received.shape[0] == std::numeric_limits<int64_t>::max()) {
    c.value_error("received", "has 2^63 - 1 rows; at most 2^63 - 2 are supported");
  }
  sizes = flat_sizes(c, split_sizes, num_ranks);
  c.index_vector(sizes, "split_sizes", -1);
  c.same_device(sizes, "split_sizes", received.device);
  c.alignment(alignment);
  ChunkGrid g;
  g.chunks = sizes.shape[0];
  g.ranks = num_ranks;
  if (g.chunks % num_ranks != 0) {
    c.value_error("num_ranks", "the " + str(g.chunks) +
                                   " chunks of split_sizes are not a multiple of num_ranks = " + str(num_ranks));
  }
  g.groups = g.chunks / num_ranks;
  if (sorted_index) {
    c.index_vector(*sorted_index, "sorted_index", g.chunks);
    c.same_device(*sorted_index, "sorted_index", received.device);
  }
  detail::require_backend(c, received.device);
  return g;
}

// The data checks of ops.hpp section 5 and the layout, on host memory, in the
// order the CUDA validation reports them (lowest code, then lowest position).
ChunkLayout host_layout(const Checker& c, const ChunkGrid& g, int64_t rows, const IndexReader& sizes,
                        const IndexReader* sorted, int alignment) {
  const int64_t C = g.chunks, R = g.ranks, E = g.groups;
  for (int64_t i = 0; i < C; ++i) {
    if (sizes[i] < 0) c.value_error("split_sizes", "entry " + g.at(i) + " is negative (" + str(sizes[i]) + ")");
  }
  for (int64_t i = 0; i < C; ++i) {
    if (sizes[i] > rows) {
      c.value_error("split_sizes",
                    "entry " + g.at(i) + " (" + str(sizes[i]) + ") exceeds the " + str(rows) + " rows of received");
    }
  }
  std::vector<int64_t> order = detail::host_vector<int64_t>(c, "sorted_index", C);
  if (sorted != nullptr) {
    for (int64_t j = 0; j < C; ++j) {
      const int64_t s = (*sorted)[j];
      if (s < 0 || s >= C) {
        c.value_error("sorted_index",
                      "position " + str(j) + " holds chunk " + str(s) + ", outside [0, " + str(C) + ")");
      }
      order[j] = s;
    }
    std::vector<char> seen = detail::host_vector<char>(c, "sorted_index", C, 0);
    int64_t repeated = C;
    for (int64_t j = 0; j < C; ++j) {
      if (seen[order[j]]) repeated = std::min(repeated, order[j]);
      seen[order[j]] = 1;
    }
    if (repeated < C) {
      c.value_error("sorted_index",
                    "must be a permutation of [0, " + str(C) + "): chunk " + str(repeated) + " appears more than once");
    }
  } else {
    for (int64_t j = 0; j < C; ++j) order[j] = (j % R) * E + j / R;
  }
  std::vector<int64_t> src_excl = detail::host_vector<int64_t>(c, "split_sizes", C);
  int64_t total = 0;
  for (int64_t i = 0; i < C; ++i) {
    src_excl[i] = total;
    total = detail::checked_add(c, "split_sizes", total, sizes[i]);  // entries <= rows, but rows may be ~2^63
  }
  if (total > rows) {
    c.value_error("split_sizes", "sums to " + str(total) + " but received has " + str(rows) + " rows");
  }
  ChunkLayout l;
  l.known = true;
  l.row_begin = detail::host_vector<int64_t>(c, "split_sizes", C);
  l.src_begin = detail::host_vector<int64_t>(c, "split_sizes", C);
  l.size = detail::host_vector<int64_t>(c, "split_sizes", C);
  l.offsets = detail::host_vector<int64_t>(c, "split_sizes", E);
  int64_t row = 0;
  for (int64_t grp = 0; grp < E; ++grp) {
    const int64_t start = row;
    for (int64_t j = grp * R; j < (grp + 1) * R; ++j) {
      l.row_begin[j] = row;
      l.src_begin[j] = src_excl[order[j]];
      l.size[j] = sizes[order[j]];
      row += l.size[j];  // <= the sum of the sizes, checked above
    }
    row = detail::checked_add(c, "split_sizes", start,
                              detail::checked_round_up(c, "split_sizes", row - start, alignment));
    l.offsets[grp] = row;
  }
  l.padded_rows = row;
  detail::check_int32_extent(c, "split_sizes", l.padded_rows);
  return l;
}

// The device validation's report, in host_layout's words.
void raise_chunk_violation(const Checker& c, const ChunkGrid& g, const cuda::Violation& v) {
  switch (v.code) {
    case cuda::kOk: return;
    case cuda::kChunkCountNegative:
      c.value_error("split_sizes", "entry " + g.at(v.pos) + " is negative (" + str(v.v1) + ")");
    case cuda::kChunkCountTooLarge:
      c.value_error("split_sizes",
                    "entry " + g.at(v.pos) + " (" + str(v.v1) + ") exceeds the " + str(v.v2) + " rows of received");
    case cuda::kChunkIndexOutOfRange:
      c.value_error("sorted_index",
                    "position " + str(v.pos) + " holds chunk " + str(v.v1) + ", outside [0, " + str(g.chunks) + ")");
    case cuda::kChunkIndexRepeated:
      c.value_error("sorted_index", "must be a permutation of [0, " + str(g.chunks) + "): chunk " + str(v.v1) +
                                        " appears more than once");
    case cuda::kChunkCountTotal:
      // the device's sum saturates at 2^63 - 1 (src/cuda/chunks.cu): a total there is a lower bound
      c.value_error("split_sizes",
                    std::string(v.v1 == std::numeric_limits<int64_t>::max() ? "sums to at least " : "sums to ") +
                        str(v.v1) + " but received has " + str(v.v2) + " rows");
    case cuda::kChunkOverflow: detail::check_int32_extent(c, "split_sizes", v.v1); return;
    case cuda::kChunkCapacity:
      c.value_error("padded", "output capacity: needs at least " + str(v.v1) + " rows, got " + str(v.v2));
    default: c.value_error("split_sizes", "failed validation (code " + str(v.code) + ")");
  }
}

// The layout on the host: read in place on the CPU; on CUDA copied to the
// host (one synchronization) when `read_device` (allocating form), else left
// to the device (P unknown here).
ChunkLayout chunk_inputs(const Checker& c, const ChunkGrid& g, const TensorView& received, const TensorView& sizes,
                         const std::optional<TensorView>& sorted_index, int alignment, const Options& options,
                         bool read_device) {
  const int64_t rows = received.shape[0];
  if (!received.device.is_cuda()) {
    const IndexReader sorted = sorted_index ? IndexReader(*sorted_index) : IndexReader();
    return host_layout(c, g, rows, IndexReader(sizes), sorted_index ? &sorted : nullptr, alignment);
  }
  if (!read_device) return ChunkLayout{};
  auto to_host = [&](const TensorView& t, std::vector<char>& raw) {
    raw.resize(static_cast<size_t>(t.shape[0]) * element_size(t.dtype));
    cuda::copy_bytes(raw.data(), Device::cpu(), t.data, t.device, raw.size(), options.stream);
    TensorView h = t;
    h.data = raw.data();
    h.device = Device::cpu();
    return h;
  };
  std::vector<char> raw_sizes, raw_sorted;
  const TensorView hs = to_host(sizes, raw_sizes);
  std::optional<TensorView> hsorted;
  if (sorted_index) hsorted = to_host(*sorted_index, raw_sorted);
  const IndexReader sorted = hsorted ? IndexReader(*hsorted) : IndexReader();
  return host_layout(c, g, rows, IndexReader(hs), hsorted ? &sorted : nullptr, alignment);
}

void run_sort(const Checker& c, const ChunkGrid& g, const ChunkLayout& l, const TensorView& received,
              const TensorView& sizes, int alignment, const std::optional<TensorView>& sorted_index,
              const TensorView& padded, const TensorView& permutation_map, const TensorView& inclusive_offsets,
              const Options& options) {
  int32_t* map = permutation_map.data_as<int32_t>();
  int32_t* offs = inclusive_offsets.data_as<int32_t>();
  const int64_t map_len = permutation_map.shape[0];
  if (received.device.is_cuda()) {
    const cuda::IndexRef s = cuda::IndexRef::of(sizes);
    const cuda::IndexRef order = sorted_index ? cuda::IndexRef::of(*sorted_index) : cuda::IndexRef{};
    // Unvalidated sizes go through the layout, the checks, then the map: nothing but the scratch is
    // written before the checks pass. Otherwise the layout may write the map itself.
    const bool validate = options.check_data && !l.known;  // sizes not yet seen on the host
    const cuda::RowsArg src = cuda::RowsArg::of(received), dst = cuda::RowsArg::of(padded);
    if (!validate && map_len == padded.shape[0] &&
        cuda::chunk_rows_fit(g.chunks, static_cast<int>(g.ranks), alignment, src, dst)) {
      // one launch: the layout, the map and the rows
      cuda::sort_chunk_rows(src, s, order, g.chunks, static_cast<int>(g.ranks), alignment, dst, options.zero_tail,
                            /*skip_unmapped=*/!options.zero_padding, map, offs, options.stream);
      return;
    }
    cuda::Scratch scratch(options, cuda::chunk_workspace_bytes(g.chunks), received.device.index);
    const bool mapped =
        cuda::chunk_layout(s, order, g.chunks, static_cast<int>(g.ranks), alignment, received.shape[0], scratch.get(),
                           options.stream, validate ? 0 : map_len, validate ? nullptr : map, validate ? nullptr : offs);
    if (validate) {
      raise_chunk_violation(
          c, g,
          cuda::validate_chunks(s, order, g.chunks, received.shape[0], padded.shape[0], scratch.get(), options.stream));
    }
    if (!mapped) {
      cuda::chunk_map(scratch.get(), g.chunks, static_cast<int>(g.ranks), received.shape[0], map_len, map, offs,
                      options.stream);
    }
    // Rows at or past P (device-side inclusive_offsets[E-1]) untouched unless zero_tail (their map is -1).
    const int32_t* limit = options.zero_tail || g.groups == 0 ? nullptr : offs + g.groups - 1;
    if (g.groups > 0 || options.zero_tail) {  // no groups and no zero_tail: P = 0, nothing to write
      cuda::gather_rows(cuda::RowsArg::of(received), cuda::IndexRef{map, false}, cuda::ScaleArg{}, false,
                        cuda::RowsArg::of(padded), padded.shape[0], limit, options.stream,
                        /*skip_unmapped=*/!options.zero_padding, nullptr, /*reads_all_rows=*/true);
    }
    return;
  }
  for (int64_t e = 0; e < g.groups; ++e) offs[e] = static_cast<int32_t>(l.offsets[e]);
  cpu::chunk_map(l.row_begin.data(), l.src_begin.data(), l.size.data(), g.chunks, l.padded_rows, map, map_len,
                 options.num_threads);
  const int64_t rows = options.zero_tail ? padded.shape[0] : l.padded_rows;
  cpu::gather_rows(cpu::RowsRef::of(received), map, cpu::Scale{}, false, cpu::RowsRef::of(padded), rows,
                   options.num_threads, /*skip_unmapped=*/!options.zero_padding);
}

}  // namespace

void sort_chunks_out(const TensorView& received, const TensorView& split_sizes, int num_ranks, int alignment,
                     const std::optional<TensorView>& sorted_index, const TensorView& padded,
                     const TensorView& permutation_map, const TensorView& inclusive_offsets, const Options& options) {
  Checker c("sort_chunks");
  TensorView sizes;
  const ChunkGrid g = check_chunk_shapes(c, received, split_sizes, num_ranks, alignment, sorted_index, sizes);
  c.row_tensor(padded, "padded", -1, received.shape[1], /*allow_fp8=*/true);
  c.int32_output(permutation_map, "permutation_map", padded.shape[0]);
  c.int32_output(inclusive_offsets, "inclusive_offsets", g.groups);
  c.same_device(padded, "padded", received.device);
  c.same_device(permutation_map, "permutation_map", received.device);
  c.same_device(inclusive_offsets, "inclusive_offsets", received.device);
  detail::check_disjoint_all(c,
                             {detail::named(padded, "padded"), detail::named(permutation_map, "permutation_map"),
                              detail::named(inclusive_offsets, "inclusive_offsets")},
                             {detail::named(received, "received"), detail::named(split_sizes, "split_sizes"),
                              detail::named(sorted_index, "sorted_index")});
  const ChunkLayout l = chunk_inputs(c, g, received, sizes, sorted_index, alignment, options, false);
  if (l.known && padded.shape[0] < l.padded_rows) {  // in the device validation's words
    c.value_error("padded",
                  "output capacity: needs at least " + str(l.padded_rows) + " rows, got " + str(padded.shape[0]));
  }
  c.row_output(padded, "padded", std::max<int64_t>(l.padded_rows, 0), /*at_least=*/true, received.shape[1],
               received.dtype);
  run_sort(c, g, l, received, sizes, alignment, sorted_index, padded, permutation_map, inclusive_offsets, options);
}

PadResult sort_chunks(const TensorView& received, const TensorView& split_sizes, int num_ranks, int alignment,
                      const std::optional<TensorView>& sorted_index, const Options& options) {
  Checker c("sort_chunks");
  TensorView sizes;
  const ChunkGrid g = check_chunk_shapes(c, received, split_sizes, num_ranks, alignment, sorted_index, sizes);
  const ChunkLayout l = chunk_inputs(c, g, received, sizes, sorted_index, alignment, options, true);
  return detail::allocate_outputs<PadResult>(
      received.device,
      {detail::rows_like(received, l.padded_rows), {DType::kInt32, {l.padded_rows}}, {DType::kInt32, {g.groups}}},
      [&](const PadResult& r) {
        run_sort(c, g, l, received, sizes, alignment, sorted_index, r.padded, r.permutation_map, r.inclusive_offsets,
                 options);
      });
}

int64_t sort_chunks_rows(const TensorView& received, const TensorView& split_sizes, int num_ranks, int alignment,
                         const std::optional<TensorView>& sorted_index, const Options& options) {
  Checker c("sort_chunks");
  TensorView sizes;
  const ChunkGrid g = check_chunk_shapes(c, received, split_sizes, num_ranks, alignment, sorted_index, sizes);
  return chunk_inputs(c, g, received, sizes, sorted_index, alignment, options, true).padded_rows;
}

int64_t sort_chunks_rows_bound(int64_t received_rows, int64_t num_chunks, int num_ranks, int alignment) {
  Checker c("sort_chunks_rows_bound");
  if (received_rows < 0) c.value_error("received_rows", "must be >= 0, got " + str(received_rows));
  if (num_chunks < 0) c.value_error("num_chunks", "must be >= 0, got " + str(num_chunks));
  if (num_ranks < 1) c.value_error("num_ranks", "must be >= 1, got " + str(num_ranks));
  c.alignment(alignment);
  const int64_t groups = num_chunks / num_ranks;
  return detail::checked_add(c, "received_rows", received_rows,
                             detail::checked_mul(c, "num_chunks", groups, int64_t{alignment} - 1));
}

size_t sort_chunks_workspace_bytes(int64_t num_chunks) { return cuda::chunk_workspace_bytes(num_chunks); }

}  // namespace padmoe
