// rows.cu — the row ops' dispatch: for each launcher of cuda_backend.hpp's row kernels (spread,
// reduce, row_dots, gather by map) the kernel policy (core/kernel_policy.hpp) picks the kernel
// from the sizes and the device, a test's or `padmoe bench --variant`'s override
// (core/kernel_overrides.hpp) replaces the pick where one is set, and the instantiation for the
// row dtype is launched. The kernels: spread_kernels.cuh, reduce_kernels.cuh, gather_kernels.cuh,
// built on row_io.cuh.
#include <algorithm>
#include <type_traits>

#include "cuda/gather_kernels.cuh"
#include "cuda/reduce_kernels.cuh"
#include "cuda/row_io.cuh"
#include "cuda/spread_kernels.cuh"

namespace padmoe {
namespace cuda {

// Kernel tags: each carries one kernel template, so pick() instantiates it for the row dtype.
template <typename T, bool kVec>
struct SpreadTag {
  static constexpr auto fn = spread_kernel<T, kVec, false>;
};
template <typename T, bool kVec>
struct ScaledSpreadTag {
  static constexpr auto fn = spread_kernel<T, kVec, true>;
};
template <bool kScales>
struct SearchSpread {
  template <typename T, bool kVec>
  struct Tag {
    static constexpr auto fn = spread_kernel<T, kVec, kScales, true>;
  };
};
template <bool kSearch>
struct SpreadDotsWarp {
  template <typename T, bool kVec>
  struct Tag {
    static constexpr auto fn = spread_dots_warp_kernel<T, kVec, kSearch>;
  };
};
template <typename T, bool kVec>
struct SpreadDotsToken {
  static constexpr auto fn = spread_dots_token_kernel<T, kVec>;
};
template <bool kScales>
struct SpreadWarp {
  template <typename T, bool kVec>
  struct Tag {
    static constexpr auto fn = spread_warp_kernel<T, kVec, kScales>;
  };
};
// reduce_kernel at (units a thread, source rows loaded together).
template <int kUnits, int kBatch, bool kDots>
struct ReduceShape {
  template <typename T, bool kVec>
  struct Tag {
    static constexpr auto fn = reduce_kernel<T, kVec, kDots, kUnits, kBatch>;
  };
};
template <int kMaxK, int kUnits, int kSplit, bool kDots = true, bool kOut = true, bool kSearch = false>
struct ReduceToken {
  template <typename T, bool kVec>
  struct Tag {
    static constexpr auto fn = reduce_token_kernel<T, kVec, kMaxK, kUnits, kSplit, kDots, kOut, kSearch>;
  };
};
template <typename T, bool kVec>
struct RowDotsWarpTag {
  static constexpr auto fn = row_dots_warp_kernel<T, kVec>;
};
template <typename T, bool kVec>
struct GatherTag {
  static constexpr auto fn = gather_kernel<T, kVec, false>;
};
template <typename T, bool kVec>
struct ScaledGatherTag {
  static constexpr auto fn = gather_kernel<T, kVec, true>;
};
template <typename T, bool kVec>
struct GatherDotsWarpTag {
  static constexpr auto fn = gather_dots_warp_kernel<T, kVec>;
};

namespace {

constexpr int kMaxK = policy::kWarpReduceMaxK;  // the token kernels' largest top_k
constexpr int kBlockWarps = kThreads / 32;

// The plain reduce's slicing target: the policy's (about 4 blocks an SM), or the override's.
int64_t reduce_slice_target(const policy::Device& d) {
  const int forced = overrides().reduce_slice_blocks;
  return forced >= 0 ? forced : policy::few_tokens_blocks(d);
}

}  // namespace

bool dest_search_fits(int64_t assignments, int num_experts, int top_k) {
  return overrides().dest_search.value_or(true) && policy::dest_search_fits(assignments, num_experts, top_k);
}

void spread_rows(const RowsArg& x, int top_k, const DestArg& dest, ScaleArg w, const RowsArg& y,
                 const PaddingRef& padding, bool zero_padding, bool zero_past_end, const RowsArg* dots_with,
                 FloatOutArg dots, void* stream, const ScaleRowsArg* scales) {
  const policy::Device dev = device_policy();
  const int64_t tokens = x.rows;
  // Rows a zero block clears: 32, or about 56 KiB of rows at small T (spreads the padding over more
  // blocks, so that no multiprocessor holds much more than its share of the writes).
  const int zero_rows = policy::zero_rows_per_block(tokens, y.cols * static_cast<int64_t>(element_size(y.dtype)), dev);
  const int64_t zero_blocks = zero_padding || zero_past_end ? index::ceil_div(y.rows, zero_rows) : 0;
  const bool vec =
      rows_vectorizable(x) && rows_vectorizable(y) && (dots_with == nullptr || rows_vectorizable(*dots_with));
  const int64_t units = vec ? y.cols * static_cast<int64_t>(element_size(y.dtype)) / 16 : y.cols;
  const int64_t blocks = tokens + zero_blocks;
  const bool scale_cols = scales != nullptr && scales->cols > 0;  // per-row scales move even when H = 0
  if (blocks == 0 || (y.cols == 0 && dots.data == nullptr && !scale_cols)) return;  // H = 0 still writes zero dots
  const RowsArg with = dots_with != nullptr ? *dots_with : RowsArg{};
  const ScaleRowsArg sc = scales != nullptr ? *scales : ScaleRowsArg{};
  if (dots.data != nullptr && dest.rows != nullptr && policy::spread_dots_by_token(top_k)) {  // a block a token
    auto token_launch = [&](auto tag) {
      using Tag = decltype(tag);
      launch_kernel("spread_dots_token_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream),
                    x, top_k, dest.rows, w, y, padding, zero_padding, zero_past_end, with, dots, zero_rows);
    };
    pick<SpreadDotsToken>(x.dtype, vec, token_launch);
    return;
  }
  if (dots.data != nullptr) {  // with dots (never with scales): a warp an assignment
    const int64_t assignment_blocks = index::ceil_div(tokens * top_k, kBlockWarps);
    if (assignment_blocks + zero_blocks == 0) return;  // top_k 0 (never through the API)
    auto warp_launch = [&](auto tag) {
      using Tag = decltype(tag);
      launch_kernel("spread_dots_warp_kernel", Tag::fn, static_cast<unsigned>(assignment_blocks + zero_blocks),
                    kThreads, 0, as_stream(stream), x, top_k, dest, w, y, padding, zero_padding, zero_past_end, with,
                    dots, assignment_blocks, zero_rows);
    };
    if (dest.rows == nullptr) pick<SpreadDotsWarp<true>::Tag>(x.dtype, vec, warp_launch);
    else pick<SpreadDotsWarp<false>::Tag>(x.dtype, vec, warp_launch);
    return;
  }
  auto launch = [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("spread_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream), x, top_k,
                  dest, w, y, padding, zero_padding, zero_past_end, sc, zero_rows);
  };
  if (dest.rows == nullptr) {  // the search form: the block kernel
    if (scales != nullptr) pick<SearchSpread<true>::Tag>(x.dtype, vec, launch);
    else pick<SearchSpread<false>::Tag>(x.dtype, vec, launch);
    return;
  }
  const policy::SpreadKernel kernel = overrides().spread.value_or(policy::spread_kernel(tokens, units, top_k, dev));
  if (kernel == policy::SpreadKernel::kWarp) {  // a warp a token
    const int64_t token_blocks = index::ceil_div(tokens, kBlockWarps);
    if (token_blocks + zero_blocks == 0) return;
    auto warp_launch = [&](auto tag) {
      using Tag = decltype(tag);
      launch_kernel("spread_warp_kernel", Tag::fn, static_cast<unsigned>(token_blocks + zero_blocks), kThreads, 0,
                    as_stream(stream), x, top_k, dest.rows, w, y, padding, zero_padding, zero_past_end, sc,
                    token_blocks, zero_rows);
    };
    if (scales != nullptr) pick<SpreadWarp<true>::Tag>(x.dtype, vec, warp_launch);
    else pick<SpreadWarp<false>::Tag>(x.dtype, vec, warp_launch);
    return;
  }
  if (scales != nullptr) pick<ScaledSpreadTag>(x.dtype, vec, launch);
  else pick<SpreadTag>(x.dtype, vec, launch);
}

namespace {

// reduce_token_kernel a warp a token (kTokenWarp) or a block a token, with dots or without;
// top-2 has its own shape (two units a lane and batch: six loads in flight), top-8 one unit (nine).
template <bool kD>
void launch_token_reduce(const RowsArg& y, int top_k, const DestArg& dest, ScaleArg w, const RowsArg& out,
                         const RowsArg& g, FloatOutArg dots, bool vec, bool warp_a_token, bool two_units,
                         cudaStream_t stream) {
  const int64_t blocks = warp_a_token ? index::ceil_div(out.rows, kBlockWarps) : out.rows;
  auto launch = [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("reduce_token_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0, stream, y, top_k, dest, w,
                  out, g, dots);
  };
  if (warp_a_token && top_k <= 2) pick<ReduceToken<2, 2, 1, kD>::template Tag>(y.dtype, vec, launch);
  else if (warp_a_token) pick<ReduceToken<kMaxK, 1, 1, kD>::template Tag>(y.dtype, vec, launch);
  else if (top_k <= 2) pick<ReduceToken<2, 2, kBlockWarps, kD>::template Tag>(y.dtype, vec, launch);
  else if (two_units) pick<ReduceToken<kMaxK, 2, kBlockWarps, kD>::template Tag>(y.dtype, vec, launch);
  else pick<ReduceToken<kMaxK, 1, kBlockWarps, kD>::template Tag>(y.dtype, vec, launch);
}

// The search form (top_k <= 8): a block a token, two units a lane in the two-units window.
void launch_search_reduce(const RowsArg& y, int top_k, const DestArg& dest, ScaleArg w, const RowsArg& out,
                          const RowsArg& g, FloatOutArg dots, bool vec, bool two, cudaStream_t stream) {
  auto launch = [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("reduce_token_kernel", Tag::fn, static_cast<unsigned>(out.rows), kThreads, 0, stream, y, top_k, dest,
                  w, out, g, dots);
  };
  const bool with_dots = dots.data != nullptr;
  if (with_dots && two) pick<ReduceToken<kMaxK, 2, kBlockWarps, true, true, true>::Tag>(y.dtype, vec, launch);
  else if (with_dots) pick<ReduceToken<kMaxK, 1, kBlockWarps, true, true, true>::Tag>(y.dtype, vec, launch);
  else if (two) pick<ReduceToken<kMaxK, 2, kBlockWarps, false, true, true>::Tag>(y.dtype, vec, launch);
  else pick<ReduceToken<kMaxK, 1, kBlockWarps, false, true, true>::Tag>(y.dtype, vec, launch);
}

}  // namespace

void reduce_rows(const RowsArg& y, int top_k, const DestArg& dest, ScaleArg w, const RowsArg& out,
                 const RowsArg* dots_with, FloatOutArg dots, void* stream) {
  if (out.rows == 0 || (out.cols == 0 && dots.data == nullptr)) return;  // H = 0 still writes zero dots
  using policy::ReduceDotsKernel;
  using policy::ReduceKernel;
  const policy::Device dev = device_policy();
  const cudaStream_t s = as_stream(stream);
  const RowsArg g = dots_with != nullptr ? *dots_with : RowsArg{};
  const bool vec = rows_vectorizable(y) && rows_vectorizable(out) && (dots_with == nullptr || rows_vectorizable(g));
  const int64_t units = vec ? out.cols * static_cast<int64_t>(element_size(out.dtype)) / 16 : out.cols;
  if (dest.rows == nullptr) {
    launch_search_reduce(y, top_k, dest, w, out, g, dots, vec, policy::two_units_window(out.rows, units, dev), s);
    return;
  }
  auto block_launch = [&](auto tag, int slices, int64_t slice_units) {
    using Tag = decltype(tag);
    launch_kernel("reduce_kernel", Tag::fn, static_cast<unsigned>(out.rows * slices), kThreads, 0, s, y, top_k,
                  dest.rows, w, out, g, dots, slices, slice_units);
  };
  if (dots.data != nullptr) {
    const ReduceDotsKernel pick_dots = policy::reduce_dots_fit(
        overrides().reduce_dots.value_or(policy::reduce_dots_kernel(out.rows, top_k, units, dev)), out.rows, top_k,
        dev);
    switch (pick_dots) {
      case ReduceDotsKernel::kTokenWarp:
      case ReduceDotsKernel::kTokenBlock:
      case ReduceDotsKernel::kTokenBlockTwoUnits:
        launch_token_reduce<true>(y, top_k, dest, w, out, g, dots, vec, pick_dots == ReduceDotsKernel::kTokenWarp,
                                  pick_dots == ReduceDotsKernel::kTokenBlockTwoUnits, s);
        return;
      case ReduceDotsKernel::kBlockWide:  // 16 loads in flight a thread instead of 4 (few tokens)
        pick<ReduceShape<2, 8, true>::Tag>(y.dtype, vec, [&](auto tag) { block_launch(tag, 1, units); });
        return;
      case ReduceDotsKernel::kBlock:
        pick<ReduceShape<1, 4, true>::Tag>(y.dtype, vec, [&](auto tag) { block_launch(tag, 1, units); });
        return;
    }
    return;
  }
  const ReduceKernel kernel = policy::plain_reduce_fit(
      overrides().reduce.value_or(policy::plain_reduce_kernel(out.rows, top_k, units, dev)), top_k);
  if (kernel == ReduceKernel::kTokenBlock || kernel == ReduceKernel::kTokenBlockTwoUnits) {
    launch_token_reduce<false>(y, top_k, dest, w, out, g, dots, vec, false, kernel == ReduceKernel::kTokenBlockTwoUnits,
                               s);
    return;
  }
  const policy::Slicing sl =
      policy::reduce_slicing(out.rows, units, policy::reduce_slice_granule(top_k), false, reduce_slice_target(dev));
  auto sliced = [&](auto tag) { block_launch(tag, sl.slices, sl.slice_units); };
  if (top_k <= 2) pick<ReduceShape<2, 2, false>::Tag>(y.dtype, vec, sliced);
  else if (kernel == ReduceKernel::kBlockWide) pick<ReduceShape<1, 8, false>::Tag>(y.dtype, vec, sliced);
  else pick<ReduceShape<1, 4, false>::Tag>(y.dtype, vec, sliced);
}

void row_dots(const RowsArg& y, const RowsArg& g, int top_k, const DestArg& dest, int64_t assignments, FloatOutArg out,
              void* stream) {
  const int64_t tokens = assignments / top_k;
  if (tokens == 0) return;
  const bool vec = rows_vectorizable(y) && rows_vectorizable(g);
  const bool search = dest.rows == nullptr;  // the search form (top_k <= 8): a block a token
  const policy::RowDotsKernel kernel =
      search ? policy::RowDotsKernel::kTokenBlock
             : policy::row_dots_fit(overrides().row_dots.value_or(policy::row_dots_kernel(top_k)), top_k);
  if (kernel == policy::RowDotsKernel::kTokenBlock) {  // `shape` carries the rows and width, no data
    const RowsArg shape{nullptr, tokens, g.cols, 0, g.dtype};
    auto launch = [&](auto tag) {
      using Tag = decltype(tag);
      launch_kernel("reduce_token_kernel", Tag::fn, static_cast<unsigned>(tokens), kThreads, 0, as_stream(stream), y,
                    top_k, dest, ScaleArg{}, shape, g, out);
    };
    if (search) pick<ReduceToken<kMaxK, 1, kBlockWarps, true, false, true>::Tag>(y.dtype, vec, launch);
    else pick<ReduceToken<kMaxK, 1, kBlockWarps, true, false>::Tag>(y.dtype, vec, launch);
    return;
  }
  const int64_t blocks = index::ceil_div(assignments, kBlockWarps);
  pick<RowDotsWarpTag>(y.dtype, vec, [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("row_dots_warp_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream), y, g,
                  top_k, dest.rows, assignments, out);
  });
}

void gather_rows(const RowsArg& src, IndexRef map, ScaleArg s, bool scale_by_source, const RowsArg& out, int64_t rows,
                 const int32_t* row_limit, void* stream, bool skip_unmapped, const ScaleRowsArg* scales,
                 bool reads_all_rows) {
  const bool scale_cols = scales != nullptr && scales->cols > 0;  // per-row scales move even when H = 0
  if (rows == 0 || (out.cols == 0 && !scale_cols)) return;
  const bool vec = rows_vectorizable(src) && rows_vectorizable(out);
  RowsArg limited = out;
  limited.rows = rows;
  const int64_t units = vec ? out.cols * static_cast<int64_t>(element_size(out.dtype)) / 16 : out.cols;
  int64_t per_block = kChunkUnits / (units > 0 ? units : 1);
  per_block = per_block < 1 ? 1 : (per_block > kMaxMapRows ? kMaxMapRows : per_block);
  const int64_t blocks = index::ceil_div(rows, per_block);
  const ScaleRowsArg sc = scales != nullptr ? *scales : ScaleRowsArg{};
  // every row of src read: the grid's first blocks (at most two an SM, all placed at once) ask L2
  // for all of them before the wait
  const int share = static_cast<int>(std::min<int64_t>(blocks, 2 * static_cast<int64_t>(sm_count())));
  const RowsArg from = reads_all_rows ? with_l2_prefetch(src, vec, share) : src;
  auto launch = [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("gather_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream), from, map, s,
                  scale_by_source, limited, row_limit, static_cast<int>(per_block), skip_unmapped, sc);
  };
  if (scales != nullptr) pick<ScaledGatherTag>(out.dtype, vec, launch);
  else pick<GatherTag>(out.dtype, vec, launch);
}

void gather_rows_dots(const RowsArg& src, IndexRef map, ScaleArg s, const RowsArg& out, int64_t rows,
                      const RowsArg& dots_with, FloatOutArg dots, int64_t dots_len, void* stream) {
  if (dots_len > 0) {
    launch_kernel("fill_dots_kernel", fill_dots_kernel, grid_for(dots_len, 256, 4096), 256, 0, as_stream(stream), dots,
                  dots_len);
  }
  if (rows == 0) return;
  const bool vec = rows_vectorizable(src) && rows_vectorizable(out) && rows_vectorizable(dots_with);
  const int64_t blocks = index::ceil_div(rows, kBlockWarps);
  pick<GatherDotsWarpTag>(out.dtype, vec, [&](auto tag) {
    using Tag = decltype(tag);
    launch_kernel("gather_dots_warp_kernel", Tag::fn, static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream),
                  src, map, s, out, rows, dots_with, dots);
  });
}

}  // namespace cuda
}  // namespace padmoe
