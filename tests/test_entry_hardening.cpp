// test_entry_hardening.cpp — the routing options, the layouts and the size helpers as a hostile
// caller meets them: output views whose scalar fields disagree with their shapes, sizes whose sums
// or products pass 2^63 on legal empty views, host memory running out inside make_plan, and the
// bounds that decide whether a request fits the int32 index outputs. Each case failed (wrote out of
// bounds, overflowed, threw a non-padmoe exception or refused a valid request) before its fix.
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <limits>
#include <string>

#include "test_util.hpp"

namespace pt {
namespace {

constexpr int kValue = static_cast<int>(padmoe::ErrorKind::kValue);
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

// Poisoned output arrays for a plan of T*K assignments, E experts and R row_sources, with the
// view's scalar fields set by the caller.
struct OutPlan {
  Tensor indices, bin_ids, tpe, bins, ptpe, pbins, dest_rows, row_sources;
  padmoe::PlanView view;
  OutPlan(int64_t A, int E, int64_t R)
      : indices(poison_index(A)), bin_ids(poison_index(A)), tpe(poison_index(E)), bins(poison_index(E)),
        ptpe(poison_index(E)), pbins(poison_index(E)), dest_rows(poison_index(A)), row_sources(poison_index(R)) {
    view.indices = indices;
    view.bin_ids = bin_ids;
    view.tokens_per_expert = tpe;
    view.bins = bins;
    view.padded_tokens_per_expert = ptpe;
    view.padded_bins = pbins;
    view.dest_rows = dest_rows;
    view.row_sources = row_sources;
  }
};

// The fuzzer's case: a capacity plan over a local range of experts, into arrays sized for it.
TEST(EntryHardening, CapacityPlanReadsTheCheckedSizesNotTheViewFields) {
  const int64_t T = 4;
  const int K = 1, E = 10, m = 128;
  const std::vector<int64_t> te = {6, 7, 0, 1};
  ref::RoutingOptions r;
  r.global_experts = 17;
  r.first_expert = 6;
  r.expert_capacity = 384;
  const ref::RoutedPlan want = ref::make_plan(te, T, K, E, m, r);
  padmoe::PlanOptions o;
  o.global_experts = 17;
  o.first_expert = 6;
  o.expert_capacity = 384;
  const Tensor top = index_matrix(te, T, K, DType::kInt32);
  const int64_t R = int64_t{E} * 384;
  struct Fields {
    int64_t tokens;
    int top_k, experts, alignment;
  };
  // the defaults of a fresh PlanView, fields far larger than the buffers, and nonsense
  for (const Fields f : {Fields{0, 1, 0, 1}, Fields{T, K, 40, m}, Fields{1000, 7, 1 << 20, 3}, Fields{-5, -1, -3, 0}}) {
    SCOPED_TRACE("view fields T=" + std::to_string(f.tokens) + " E=" + std::to_string(f.experts));
    for (bool layouts : {false, true}) {
      OutPlan out(T * K, E, R);
      out.view.num_tokens = f.tokens;
      out.view.top_k = f.top_k;
      out.view.num_experts = f.experts;
      out.view.alignment = f.alignment;
      Tensor row_experts = poison_index(R), block_experts = poison_index(R / m), total = poison_index(1);
      padmoe::PlanLayouts l;
      if (layouts) {
        l.row_experts = row_experts;
        l.block_experts = block_experts;
        l.padded_total = total;
      }
      padmoe::make_plan_out(top, E, m, out.view, l, o);
      EXPECT_TRUE(plan_equals(out.view, want.plan));
      if (layouts) {
        std::vector<int64_t> rows(static_cast<size_t>(R), -1), blocks(static_cast<size_t>(R / m));
        for (int64_t row = 0; row < R; ++row) {
          if (want.plan.row_sources[row] >= 0) rows[row] = row / 384;
        }
        for (int64_t b = 0; b < R / m; ++b) blocks[b] = b * m / 384;
        EXPECT_TRUE(same_vec(row_experts, rows, "row_experts"));
        EXPECT_TRUE(same_vec(block_experts, blocks, "block_experts"));
        EXPECT_EQ(index_to_vec(total)[0], R);
      }
    }
  }
  // the probs drop policy on the same path
  ref::RoutingOptions rp = r;
  rp.expert_capacity = 128;
  rp.by_probs = true;
  rp.probs = {0.5f, 0.25f, 1.0f, 0.75f};
  const ref::RoutedPlan want_p = ref::make_plan(te, T, K, E, m, rp);
  o.expert_capacity = 128;
  o.drop_policy = padmoe::DropPolicy::kProbs;
  const Tensor probs = vec_from_float(rp.probs, DType::kFloat32);
  o.probs = probs;
  OutPlan out(T * K, E, int64_t{E} * 128);
  out.view.num_experts = 40;
  padmoe::make_plan_out(top, E, m, out.view, {}, o);
  EXPECT_TRUE(plan_equals(out.view, want_p.plan));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const padmoe::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Zero-column rows with null data are legal at any row count: every sum and rounding of their
// sizes is checked, never wrapped.
TEST(EntryHardening, SortChunksSizeSumsAreChecked) {
  const int64_t big = int64_t{1} << 62;
  const TensorView received = TensorView::contiguous(nullptr, DType::kFloat32, {big, 0});
  std::vector<int64_t> two = {big, big};  // each entry within the rows; the sum 2^63 is not
  const TensorView sizes = TensorView::contiguous(two.data(), DType::kInt64, {2});
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks_rows(received, sizes, 1, 1); },
                           {"sort_chunks: split_sizes: ", "size overflow"}, kValue));
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks(received, sizes, 2, 1); },
                           {"sort_chunks: split_sizes: ", "size overflow"}, kValue));
  // one chunk of 2^63 - 2 rows rounded up to 2^30
  const TensorView huge = TensorView::contiguous(nullptr, DType::kFloat32, {kI64Max - 1, 0});
  std::vector<int64_t> one = {kI64Max - 1};
  const TensorView sizes1 = TensorView::contiguous(one.data(), DType::kInt64, {1});
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks_rows(huge, sizes1, 1, 1 << 30); },
                           {"sort_chunks: split_sizes: ", "size overflow"}, kValue));
  // the bound helper
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks_rows_bound(kI64Max - 1, 4, 1, 1 << 30); },
                           {"sort_chunks_rows_bound", "size overflow"}, kValue));
  EXPECT_EQ(padmoe::sort_chunks_rows_bound(1000, 8, 2, 16), 1000 + 4 * 15);
}

TEST(EntryHardening, PadToAlignmentSizeSumsAreChecked) {
  const int64_t big = int64_t{1} << 62;
  const TensorView h = TensorView::contiguous(nullptr, DType::kFloat32, {big, 0});
  std::vector<int64_t> two = {big, big};
  const TensorView counts = TensorView::contiguous(two.data(), DType::kInt64, {2});
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_rows(h, counts, 1); },
                           {"pad_to_alignment: tokens_per_expert: ", "size overflow"}, kValue));
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment(h, counts, 1); },
                           {"pad_to_alignment: tokens_per_expert: ", "size overflow"}, kValue));
  const TensorView huge = TensorView::contiguous(nullptr, DType::kFloat32, {kI64Max - 1, 0});
  std::vector<int64_t> one = {kI64Max - 1};
  const TensorView counts1 = TensorView::contiguous(one.data(), DType::kInt64, {1});
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_rows(huge, counts1, 1 << 30); },
                           {"pad_to_alignment: tokens_per_expert: ", "size overflow"}, kValue));
}

TEST(EntryHardening, SizeHelpersReportOverflowInsteadOfAWrongBound) {
  const int64_t big = int64_t{1} << 62;
  EXPECT_TRUE(
      throws_error([&] { padmoe::padded_rows_bound(big, 4, 1, 1); }, {"padded_rows_bound", "size overflow"}, kValue));
  EXPECT_TRUE(throws_error([&] { padmoe::padded_rows_bound(-1, 1, 1, 1); }, {"padded_rows_bound: num_tokens"}, kValue));
  EXPECT_TRUE(throws_error([&] { padmoe::padded_rows_bound(1, 1, 1, 0); }, {"padded_rows_bound: alignment"}, kValue));
  EXPECT_EQ(padmoe::padded_rows_bound(big / 4, 4, 2, 3), big + 4);
  padmoe::PlanOptions po;
  po.expert_capacity = big;
  EXPECT_TRUE(
      throws_error([&] { padmoe::plan_rows_bound(1, 1, 4, 1, po); }, {"plan_rows_bound", "size overflow"}, kValue));
  po.expert_capacity = -2;
  EXPECT_TRUE(throws_error([&] { padmoe::plan_rows_bound(1, 1, 4, 1, po); },
                           {"plan_rows_bound: plan_options.expert_capacity"}, kValue));
  po.expert_capacity = 64;
  EXPECT_EQ(padmoe::plan_rows_bound(1, 1, 4, 1, po), 256);
  EXPECT_TRUE(throws_error([&] { padmoe::aligned_rows_bound(kI64Max - 5, 8, 16); },
                           {"aligned_rows_bound", "size overflow"}, kValue));
  EXPECT_TRUE(throws_error([&] { padmoe::aligned_rows_bound(kI64Max - 20, 1, 16, true); },
                           {"aligned_rows_bound", "size overflow"}, kValue));
  EXPECT_TRUE(
      throws_error([&] { padmoe::aligned_rows_bound(-1, 8, 16); }, {"aligned_rows_bound: assignments"}, kValue));
  EXPECT_EQ(padmoe::aligned_rows_bound(big, 8, 1 << 30), big + 8 * ((int64_t{1} << 30) - 1));
  EXPECT_EQ(padmoe::aligned_rows_bound(3, 8, 16, true), 48);  // 3 + 3 * 15, rounded up to 16
  EXPECT_TRUE(
      throws_error([&] { padmoe::workspace_bound(big, 4, 1, 1); }, {"workspace_bound", "size overflow"}, kValue));
  EXPECT_TRUE(throws_error([&] { padmoe::Plan::empty(big, 4, 1, 1); }, {"Plan::empty", "size overflow"}, kValue));
  EXPECT_TRUE(throws_error([&] { padmoe::Plan::empty(4, 0, 1, 1); }, {"Plan::empty: top_k"}, kValue));
}

// A plan never needs more rows than A + min(A, E) * (m - 1), nor E * C with a capacity: a request
// within that fits, whatever A + E * (m - 1) (the allocating make_plan's size) would be.
TEST(EntryHardening, BoundsAdmitWhatFits) {
  // vLLM's buffer bound: one assignment, block 2^24, 256 experts -> 2^24 rows
  const int bs = 1 << 24, E = 256;
  const std::vector<int64_t> te = {200};
  const Tensor top = index_matrix(te, 1, 1, DType::kInt32);
  const padmoe::AlignedBlocks got = padmoe::moe_align_block_size(top, bs, E);
  const ref::AlignedBlocks want = ref::moe_align_block_size(te, bs, E, false);
  EXPECT_EQ(got.sorted_token_ids.view().numel(), int64_t{bs});
  EXPECT_TRUE(same_vec(got.sorted_token_ids, want.sorted_token_ids, "sorted_token_ids"));
  EXPECT_TRUE(same_vec(got.expert_ids, want.expert_ids, "expert_ids"));
  EXPECT_EQ(index_to_vec(got.num_tokens_post_padded)[0], want.num_tokens_post_padded);
  // the same sizes through make_plan_out (CPU: row_sources of P entries)
  OutPlan out(1, E, bs);
  padmoe::make_plan_out(top, E, bs, out.view);
  EXPECT_EQ(index_to_vec(out.pbins)[E - 1], bs);
  EXPECT_EQ(index_to_vec(out.dest_rows)[0], 0);
  // the allocating make_plan still sizes row_sources by A + E * (m - 1): past int32, refused
  EXPECT_TRUE(throws_error([&] { padmoe::make_plan(top, E, bs); }, {"make_plan: capacity", "size overflow"}, kValue));

  // a capacity-0 plan at alignment 2^30: P = 0, every assignment dropped
  const std::vector<int64_t> te2 = {0, 1, 2, 3, 1, 0};
  const Tensor top2 = index_matrix(te2, 3, 2, DType::kInt64);
  padmoe::PlanOptions o;
  o.expert_capacity = 0;
  Tensor dropped = poison_index(1);
  o.dropped = dropped;
  const padmoe::Plan plan = padmoe::make_plan(top2, 4, 1 << 30, o);
  ref::RoutingOptions r;
  r.expert_capacity = 0;
  const ref::RoutedPlan want2 = ref::make_plan(te2, 3, 2, 4, 1 << 30, r);
  EXPECT_EQ(plan.padded_rows_bound(), 0);
  EXPECT_TRUE(plan_equals(plan.view(), want2.plan));
  EXPECT_EQ(index_to_vec(dropped)[0], 6);
}

TEST(EntryHardening, QuantizedDispatchOfColumnlessRowsWithNullData) {
  // x [2, 0] with null data (legal: no elements); the sanitizer job catches pointer arithmetic on null
  const padmoe::Plan plan = padmoe::make_plan(index_matrix({0, 1, 1, 0}, 2, 2, DType::kInt32), 2, 2);
  const int64_t R = plan.padded_rows_bound();
  // rows of no columns a row stride apart (a column slice of nothing): null + t * stride is UB
  const TensorView x = TensorView::matrix(nullptr, DType::kBFloat16, 2, 0, 64);
  const TensorView y = TensorView::contiguous(nullptr, DType::kFloat8E4M3, {R, 0});
  padmoe::Options opt;
  opt.zero_tail = true;
  Tensor per_row = filled(DType::kFloat32, {R}, kPoison);
  padmoe::dispatch_quantized_out(x, plan.view(), y, per_row, opt);
  // a row with no elements has amax 0: scale 1 on every row (real, padding and past P)
  for (float s : vec_to_float(per_row)) EXPECT_EQ(s, 1.0f);
  // per 128 columns: no columns, no scales
  padmoe::dispatch_quantized_out(x, plan.view(), y, TensorView::contiguous(nullptr, DType::kFloat32, {R, 0}), opt);
  const padmoe::ScaledRows q = padmoe::dispatch_quantized(x, plan.view(), padmoe::ScaleLayout::kPerRow);
  for (float s : vec_to_float(q.scales)) EXPECT_EQ(s, 1.0f);
}

// Outputs that share memory with an input or with each other are refused before anything is
// written; column slices of one buffer side by side share no byte and are accepted.
TEST(EntryHardening, AliasedOutputsAreRefusedDisjointSlicesAccepted) {
  const int64_t T = 6, H = 8;
  const int K = 2, E = 3, m = 4;
  const std::vector<int64_t> te = {0, 1, 2, 1, 0, 2, 1, 1, 2, 0, 0, 2};
  const Tensor top = index_matrix(te, T, K, DType::kInt32);
  const padmoe::Plan plan = padmoe::make_plan(top, E, m);
  const int64_t R = plan.padded_rows_bound();
  // make_plan_out: out.indices on the ids, bin_ids on indices, a layout on row_sources
  {
    OutPlan out(T * K, E, R);
    padmoe::PlanView v = out.view;
    v.indices = TensorView::contiguous(top.data_as<int32_t>(), DType::kInt32, {T * K});
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(top, E, m, v); },
                             {"make_plan: out.indices: shares memory with top_experts"}, kValue));
    v = out.view;
    v.bin_ids = out.view.indices;
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(top, E, m, v); },
                             {"make_plan: out.bin_ids: shares memory with out.indices"}, kValue));
    padmoe::PlanLayouts l;
    l.row_experts = out.view.row_sources;
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(top, E, m, out.view, l); },
                             {"make_plan: layouts.row_experts: shares memory with out.row_sources"}, kValue));
    Tensor map = index_tensor({0, 1, 2}, DType::kInt32);
    padmoe::PlanOptions po;
    po.expert_map = map;
    po.dropped = TensorView::contiguous(map.data_as<int32_t>() + 1, DType::kInt32, {1});
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(top, E, m, out.view, {}, po); },
                             {"make_plan: plan_options.dropped: shares memory with plan_options.expert_map"}, kValue));
    const Tensor* all[] = {&out.indices, &out.bin_ids, &out.tpe,       &out.bins,
                           &out.ptpe,    &out.pbins,   &out.dest_rows, &out.row_sources};
    for (const Tensor* t : all) EXPECT_TRUE(all_bytes_are(*t, kIndexPoison));
  }
  // moe_align_block_size_out: expert_ids inside sorted_token_ids
  {
    const int64_t rows = padmoe::aligned_rows_bound(T * K, E, m);
    Tensor sorted = poison_index(rows + (rows + m - 1) / m), total = poison_index(1);
    const TensorView head = TensorView::contiguous(sorted.data_as<int32_t>(), DType::kInt32, {rows});
    const TensorView blocks =
        TensorView::contiguous(sorted.data_as<int32_t>() + rows - 1, DType::kInt32, {(rows + m - 1) / m});
    EXPECT_TRUE(throws_error([&] { padmoe::moe_align_block_size_out(top, m, E, head, blocks, total); },
                             {"moe_align_block_size: expert_ids: shares memory with sorted_token_ids"}, kValue));
    EXPECT_TRUE(all_bytes_are(sorted, kIndexPoison));
  }
  // dispatch in place (y over x) and combine into a plan array are refused
  Rng rng(5);
  Tensor buf = rows_from_float(random_values(R * 2 * H, DType::kFloat32, rng), DType::kFloat32, R, 2 * H);
  const Tensor before = rows_from_float(rows_to_float(buf), DType::kFloat32, R, 2 * H);
  const TensorView x_in = TensorView::matrix(buf.data_as<float>(), DType::kFloat32, T, H, 2 * H);
  const TensorView y_on_x = TensorView::matrix(buf.data_as<float>() + 2 * H * (T - 1), DType::kFloat32, R, H, 2 * H);
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_out(x_in, plan.view(), std::nullopt, y_on_x); },
                           {"dispatch: y: shares memory with x"}, kValue));
  const TensorView out_on_plan =
      TensorView::matrix(const_cast<int32_t*>(plan.dest_rows.data_as<int32_t>()), DType::kFloat32, T, 1, 1);
  Tensor y1 = padmoe::dispatch(TensorView::matrix(buf.data_as<float>(), DType::kFloat32, T, 1, 2 * H), plan.view());
  EXPECT_TRUE(throws_error([&] { padmoe::combine_out(y1, plan.view(), std::nullopt, out_on_plan); },
                           {"combine: out: shares memory with plan"}, kValue));
  EXPECT_TRUE(same_bytes(buf, before));
  // weight gradients over the weights; pad_to_alignment's map over its counts (the counts are the
  // map's first entries); sort_chunks' offsets
  // inside its sizes; a copy onto itself shifted by one element
  Tensor w = vec_from_float(random_values(T * K, DType::kFloat32, rng, 0, 1), DType::kFloat32);
  const Tensor w_before = vec_from_float(vec_to_float(w), DType::kFloat32);
  Tensor y2 = padmoe::dispatch(x_in, plan.view(), TensorView(w));
  Tensor out2 = padmoe::combine(y2, plan.view(), TensorView(w));
  Tensor gy = poison_rows(DType::kFloat32, y2.size(0), H);
  EXPECT_TRUE(throws_error([&] { padmoe::combine_backward_out(out2, y2, plan.view(), TensorView(w), gy, w); },
                           {"combine_backward: grad_weights: shares memory with weights"}, kValue));
  EXPECT_TRUE(same_bytes(w, w_before));
  std::vector<int64_t> counts = {4, 0, 2};
  const Tensor h = rows_from_float(random_values(6 * H, DType::kFloat32, rng), DType::kFloat32, 6, H);
  const int64_t P = padmoe::pad_to_alignment_rows(h, index_tensor(counts, DType::kInt32), 4);
  Tensor padded = poison_rows(DType::kFloat32, P, H), offs = poison_index(3);
  Tensor big_tpe = index_tensor(std::vector<int64_t>(static_cast<size_t>(P), 0), DType::kInt32);
  std::copy(counts.begin(), counts.end(), big_tpe.data_as<int32_t>());
  const TensorView counts_view = TensorView::contiguous(big_tpe.data_as<int32_t>(), DType::kInt32, {3});
  const TensorView map_view = TensorView::contiguous(big_tpe.data_as<int32_t>(), DType::kInt32, {P});
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_out(h, counts_view, 4, padded, map_view, offs); },
                           {"pad_to_alignment: permutation_map: shares memory with tokens_per_expert"}, kValue));
  EXPECT_TRUE(all_bytes_are(padded, kPoison));
  std::vector<int64_t> split = {2, 1, 1, 2};
  Tensor sizes = index_tensor(split, DType::kInt32);
  Tensor sorted_rows = poison_rows(DType::kFloat32, padmoe::sort_chunks_rows_bound(6, 4, 2, 4), H);
  Tensor smap = poison_index(sorted_rows.size(0));
  const TensorView offs_on_sizes = TensorView::contiguous(sizes.data_as<int32_t>() + 2, DType::kInt32, {2});
  EXPECT_TRUE(
      throws_error([&] { padmoe::sort_chunks_out(h, sizes, 2, 4, std::nullopt, sorted_rows, smap, offs_on_sizes); },
                   {"sort_chunks: inclusive_offsets: shares memory with split_sizes"}, kValue));
  EXPECT_TRUE(all_bytes_are(sorted_rows, kPoison));
  std::vector<int64_t> seq = {1, 2, 3, 4, 5};
  Tensor line = index_tensor(seq, DType::kInt32);
  const TensorView head = TensorView::contiguous(line.data_as<int32_t>(), DType::kInt32, {4});
  const TensorView tail = TensorView::contiguous(line.data_as<int32_t>() + 1, DType::kInt32, {4});
  EXPECT_TRUE(throws_error([&] { padmoe::copy(head, tail); }, {"copy: dst: shares memory with src"}, kValue));
  EXPECT_EQ(index_to_vec(line), seq);
  // x in columns [0, H), y in columns [H, 2H) of the same rows: disjoint, accepted, the same as apart
  const TensorView y_beside = TensorView::matrix(buf.data_as<float>() + H, DType::kFloat32, R, H, 2 * H);
  padmoe::Options o;
  o.zero_tail = true;
  padmoe::dispatch_out(x_in, plan.view(), std::nullopt, y_beside, o);
  const Tensor x_copy = rows_from_float(rows_to_float(x_in), DType::kFloat32, T, H);
  Tensor apart = poison_rows(DType::kFloat32, R, H);
  padmoe::dispatch_out(x_copy, plan.view(), std::nullopt, apart, o);
  EXPECT_EQ(rows_to_float(y_beside), rows_to_float(apart));
}

#if defined(__SANITIZE_ADDRESS__)
#define PADMOE_ENTRY_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PADMOE_ENTRY_ASAN 1
#endif
#endif

int64_t vm_size_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoll(line.substr(7)) * 1024;  // kB
  }
  return -1;
}

TEST(EntryHardening, OutOfHostMemoryInsideMakePlanIsAPadmoeError) {
#if defined(PADMOE_ENTRY_ASAN)
  GTEST_SKIP() << "an address-space limit and AddressSanitizer's shadow memory do not mix";
#else
  // E = 2^26 experts: the checks' counts take 512 MiB and pass; the plan's own counts and offsets
  // then need 1 GiB together. Under an address-space limit between the two (in a forked child),
  // that is ErrorKind::kRuntime, not std::bad_alloc escaping the library.
  const int E = 1 << 26;
  OutPlan out(1, E, 1);
  const Tensor top = index_matrix({5}, 1, 1, DType::kInt32);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const int64_t now = vm_size_bytes();
    if (now < 0) _exit(3);
    rlimit lim{};
    lim.rlim_cur = lim.rlim_max = static_cast<rlim_t>(now + (int64_t{768} << 20));
    if (setrlimit(RLIMIT_AS, &lim) != 0) _exit(3);
    try {
      padmoe::make_plan_out(top, E, 1, out.view);
    } catch (const padmoe::Error& e) {
      const std::string msg = e.what();
      // the plan's own scratch failed (the checks' counts fit under the limit)
      _exit(e.kind() == padmoe::ErrorKind::kRuntime && msg.find("make_plan: num_experts") != std::string::npos &&
                    msg.find("plan's scratch") != std::string::npos
                ? 0
                : 1);
    } catch (...) {
      _exit(2);
    }
    _exit(4);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: wrong error kind, 2: a non-padmoe exception, 3: setup, 4: no error";
#endif
}

// A fixed capacity by position: the probs policy's key slices do not exist (their vector is empty),
// and no offset from its null data may be formed (clang's UBSan: pointer arithmetic on null).
TEST(EntryHardening, CapacityByPositionFormsNoKeyPointer) {
  const Tensor ids = index_tensor({0, 1}, DType::kInt32);
  const TensorView top = TensorView::contiguous(ids.data(), DType::kInt32, {2, 1});
  padmoe::PlanOptions o;
  o.expert_capacity = 1;
  const padmoe::Plan plan = padmoe::make_plan(top, 2, 1, o);
  const int32_t* dest = plan.view().dest_rows.data_as<const int32_t>();
  const int32_t* src = plan.view().row_sources.data_as<const int32_t>();
  EXPECT_EQ(dest[0], 0);  // token 0 -> expert 0's one slot, token 1 -> expert 1's
  EXPECT_EQ(dest[1], 1);
  EXPECT_EQ(src[0], 0);
  EXPECT_EQ(src[1], 1);
}

// Rows without columns may have null data (the failure model): the row moves form no offset from it.
TEST(EntryHardening, RowMovesOfRowsWithoutColumns) {
  const TensorView empty18 = TensorView::matrix(nullptr, DType::kFloat32, 18, 0, 7);  // a stride, no bytes
  std::vector<int64_t> rows(18, -1);  // padded row r of the first 3 holds token 2 - r; the rest padding
  rows[0] = 2;
  rows[1] = 1;
  rows[2] = 0;
  const Tensor map = index_tensor(rows, DType::kInt32);
  const Tensor out = padmoe::unpad_from_alignment(empty18, map, 3);
  EXPECT_EQ(out.size(0), 3);
  EXPECT_EQ(out.size(1), 0);
  const Tensor ids = index_tensor({0, 1, 1, 0, 0, 1, 1, 0}, DType::kInt32);
  const padmoe::Plan plan = padmoe::make_plan(TensorView::contiguous(ids.data(), DType::kInt32, {4, 2}), 2, 4);
  const TensorView empty4 = TensorView::matrix(nullptr, DType::kBFloat16, 4, 0, 5);
  const Tensor y = padmoe::dispatch(empty4, plan.view());
  EXPECT_EQ(y.size(0), 8);  // P: 4 assignments an expert, aligned to 4
  EXPECT_EQ(y.size(1), 0);
  const Tensor back = padmoe::combine(y, plan.view());
  EXPECT_EQ(back.size(0), 4);
  EXPECT_EQ(back.size(1), 0);
}

// A 2-D split_sizes view whose shape's product passes 2^63: the count is checked before it is formed.
TEST(EntryHardening, SortChunksSizesShapeProductIsChecked) {
  const TensorView received = TensorView::contiguous(nullptr, DType::kFloat32, {4, 0});
  std::vector<int32_t> one = {1};
  TensorView sizes = TensorView::contiguous(one.data(), DType::kInt32, {1});
  sizes.ndim = 2;
  sizes.shape[0] = 2;
  sizes.shape[1] = int64_t{1} << 62;
  sizes.strides[0] = int64_t{1} << 62;
  sizes.strides[1] = 1;
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks(received, sizes, 2, 1); },
                           {"sort_chunks: split_sizes: ", "size overflow"}, kValue));
  // received of 2^63 - 1 rows (the device sums of sizes saturate there) is refused by name
  const TensorView most = TensorView::contiguous(nullptr, DType::kFloat32, {kI64Max, 0});
  std::vector<int64_t> two = {1, 1};
  EXPECT_TRUE(
      throws_error([&] { padmoe::sort_chunks(most, TensorView::contiguous(two.data(), DType::kInt64, {2}), 1, 1); },
                   {"sort_chunks: received: ", "2^63 - 1 rows"}, kValue));
}

}  // namespace
}  // namespace pt
