// test_chunks.cpp — sort_chunks (ops.hpp section 5: the chunk sort after an
// expert-parallel all-to-all) against the reference loops, TE's
// moe_sort_chunks_by_index semantics written out here, the inverse
// (unsort_chunks = unpad_from_alignment), capacity semantics and bad input.
#include <numeric>
#include <tuple>

#include "test_util.hpp"

namespace pt {
namespace {

using padmoe::Options;
using padmoe::PadResult;

// Received rows tagged with their row id so misrouting shows: h[n][c] = n + c / 8 (exact in every
// format for small n; float8 rounds, and the reference rounds the same values the same way).
std::vector<float> tagged(int64_t N, int64_t H, DType dt) {
  std::vector<float> v(static_cast<size_t>(N * H));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < H; ++c)
      v[static_cast<size_t>(n * H + c)] = num::round_to(dt, static_cast<float>(n) + c / 8.0f);
  return v;
}

int64_t sum_of(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

// TE's moe_sort_chunks_by_index, from its definition: split rows [0, sum) into chunks of
// split_sizes, concatenate chunks sorted_index[0], sorted_index[1], ...
std::vector<float> te_sort_chunks(const std::vector<float>& h, int64_t H, const std::vector<int64_t>& sizes,
                                  const std::vector<int64_t>& sorted_index) {
  std::vector<int64_t> first(sizes.size(), 0);
  for (size_t c = 1; c < sizes.size(); ++c) first[c] = first[c - 1] + sizes[c - 1];
  std::vector<float> out;
  for (int64_t c : sorted_index)
    out.insert(out.end(), h.begin() + first[static_cast<size_t>(c)] * H,
               h.begin() + (first[static_cast<size_t>(c)] + sizes[static_cast<size_t>(c)]) * H);
  return out;
}

std::vector<int64_t> random_sizes(int64_t C, int m, Rng& rng) {
  std::vector<int64_t> s(static_cast<size_t>(C));
  for (auto& n : s) n = rng.below(4) == 0 ? 0 : rng.below(2 * m + 5);
  return s;
}

std::vector<int64_t> random_permutation(int64_t C, Rng& rng) {
  std::vector<int64_t> p(static_cast<size_t>(C));
  std::iota(p.begin(), p.end(), int64_t{0});
  for (int64_t i = C - 1; i > 0; --i) std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(rng.below(i + 1))]);
  return p;
}

TEST(SortChunks, HandWorkedTwoRanksTwoExperts) {
  // split_sizes [[2, 1], [0, 3]]: chunk (r0,e0) rows 0-1, (r0,e1) row 2, (r1,e0) none, (r1,e1) rows 3-5;
  // row 6 is past the sum and ignored.
  const int64_t N = 7, H = 3;
  const std::vector<float> hf = tagged(N, H, DType::kFloat32);
  const Tensor h = rows_from_float(hf, DType::kFloat32, N, H);
  const Tensor sizes = index_matrix({2, 1, 0, 3}, 2, 2, DType::kInt32);
  const PadResult r = padmoe::sort_chunks(h, sizes, 2, 4);
  ASSERT_EQ(r.padded.size(0), 8);
  EXPECT_EQ(index_to_vec(r.permutation_map), (std::vector<int64_t>{0, 1, -1, -1, 2, 3, 4, 5}));
  EXPECT_EQ(index_to_vec(r.inclusive_offsets), (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(r.permutation_map.dtype(), DType::kInt32);
  std::vector<float> want(8 * H, 0.0f);
  const int64_t src[8] = {0, 1, -1, -1, 2, 3, 4, 5};
  for (int64_t p = 0; p < 8; ++p)
    for (int64_t c = 0; c < H; ++c)
      if (src[p] >= 0) want[static_cast<size_t>(p * H + c)] = hf[static_cast<size_t>(src[p] * H + c)];
  EXPECT_TRUE(rows_bitwise(r.padded, want, 8));
  EXPECT_TRUE(bytes_are(r.padded, 2, 4, 0x00));
  // the reference agrees with the hand-worked layout
  const ref::PadResult rr = ref::sort_chunks(hf, H, {2, 1, 0, 3}, 2, 4, nullptr);
  EXPECT_EQ(rr.permutation_map, (std::vector<int64_t>{0, 1, -1, -1, 2, 3, 4, 5}));
  EXPECT_EQ(rr.inclusive_offsets, (std::vector<int64_t>{4, 8}));
  EXPECT_TRUE(rows_bitwise(r.padded, rr.padded, 8));
}

// (R, E, alignment, row dtype, size dtype, 2-D split_sizes)
using ChunkParam = std::tuple<int, int, int, DType, DType, bool>;
class SortChunksGrid : public ::testing::TestWithParam<ChunkParam> {};

TEST_P(SortChunksGrid, MatchesReferenceAndRoundTrips) {
  int R, E, m;
  DType dt, sdt;
  bool two_d;
  std::tie(R, E, m, dt, sdt, two_d) = GetParam();
  Rng rng(static_cast<uint64_t>(R * 131 + E * 17 + m) * 3 + static_cast<uint64_t>(dt) + (two_d ? 1000 : 0));
  const int64_t C = static_cast<int64_t>(R) * E, H = 24;
  std::vector<int64_t> sizes = random_sizes(C, m, rng);
  sizes[0] = 0;                                       // an empty first chunk
  if (C > 1) sizes[static_cast<size_t>(C - 1)] = m;   // exactly on a multiple
  const int64_t sum = sum_of(sizes), N = sum + 5;     // 5 rows past the sum, ignored
  const std::vector<float> hf = random_values(N * H, dt, rng);
  const Tensor h = rows_from_float(hf, dt, N, H);
  const Tensor st = two_d ? index_matrix(sizes, R, E, sdt) : index_tensor(sizes, sdt);

  const ref::PadResult want = ref::sort_chunks(hf, H, sizes, R, m, nullptr);
  const PadResult r = padmoe::sort_chunks(h, st, R, m);
  ASSERT_EQ(r.padded.size(0), want.padded_rows);
  EXPECT_EQ(padmoe::sort_chunks_rows(h, st, R, m), want.padded_rows);  // P for a caller that allocates
  EXPECT_EQ(index_to_vec(r.permutation_map), want.permutation_map);
  EXPECT_EQ(index_to_vec(r.inclusive_offsets), want.inclusive_offsets);
  EXPECT_TRUE(rows_bitwise(r.padded, want.padded, want.padded_rows));
  for (int64_t p = 0; p < want.padded_rows; ++p)
    if (want.permutation_map[static_cast<size_t>(p)] < 0) ASSERT_TRUE(bytes_are(r.padded, p, p + 1, 0x00)) << p;

  // _out into a larger poisoned buffer: the same rows, rows past P untouched, map -1 past P.
  const int64_t cap = padmoe::sort_chunks_rows_bound(N, C, R, m);
  ASSERT_GE(cap, want.padded_rows);
  Tensor padded = poison_rows(dt, cap + 3, H);
  Tensor map = poison_index(cap + 3);
  Tensor offs = poison_index(E);
  Options o;
  o.num_threads = 3;
  padmoe::sort_chunks_out(h, st, R, m, std::nullopt, padded, map, offs, o);
  std::vector<int64_t> map_want = want.permutation_map;
  map_want.resize(static_cast<size_t>(cap + 3), -1);
  EXPECT_EQ(index_to_vec(map), map_want);
  EXPECT_EQ(index_to_vec(offs), want.inclusive_offsets);
  EXPECT_TRUE(rows_bitwise(padded, want.padded, want.padded_rows));
  EXPECT_TRUE(bytes_are(padded, want.padded_rows, cap + 3, kPoison));

  // The way back: unsort_chunks (= unpad_from_alignment) restores rows [0, sum) and zeroes the rest.
  const Tensor back = padmoe::unsort_chunks(r.padded, r.permutation_map, N);
  std::vector<float> back_want(hf.begin(), hf.begin() + sum * H);
  back_want.resize(static_cast<size_t>(N * H), 0.0f);
  EXPECT_TRUE(rows_bitwise(back, back_want, N));
  EXPECT_TRUE(rows_bitwise(back, ref::unpad_from_alignment(want.padded, H, want.permutation_map, N, nullptr), N));
  if (!padmoe::is_float8(dt)) {  // with probs (rank-major rows): out[n] = received[n] * probs[n]
    const std::vector<float> probs = random_values(N, DType::kFloat32, rng, 0.0, 1.0);
    const Tensor pr = vec_from_float(probs, DType::kFloat32);
    const Tensor bp = padmoe::unsort_chunks(r.padded, r.permutation_map, N, pr.view());
    EXPECT_TRUE(rows_bitwise(bp, ref::unpad_from_alignment(want.padded, H, want.permutation_map, N, &probs), N));
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, SortChunksGrid,
                         ::testing::Values(ChunkParam{8, 4, 16, DType::kBFloat16, DType::kInt32, true},
                                           ChunkParam{8, 4, 16, DType::kBFloat16, DType::kInt64, false},
                                           ChunkParam{1, 6, 4, DType::kFloat32, DType::kInt64,
                                                      true},    // R = 1: pad_to_alignment
                                           ChunkParam{5, 1, 4, DType::kFloat16, DType::kInt32, true},  // E_local = 1
                                           ChunkParam{1, 1, 1, DType::kFloat32, DType::kInt32, false},
                                           ChunkParam{4, 8, 1, DType::kFloat32, DType::kInt32, false},  // no padding
                                           ChunkParam{3, 5, 4, DType::kFloat8E4M3, DType::kInt64, true},
                                           ChunkParam{2, 7, 16, DType::kFloat8E5M2, DType::kInt32, false},
                                           ChunkParam{16, 16, 16, DType::kBFloat16, DType::kInt32, true},
                                           ChunkParam{2, 3, 16, DType::kFloat16, DType::kInt64, false}));

TEST(SortChunks, OneRankIsPadToAlignment) {
  Rng rng(5);
  const std::vector<int64_t> sizes = {3, 0, 7, 1, 16};
  const int64_t N = sum_of(sizes) + 2, H = 8;
  const Tensor h = rows_from_float(random_values(N * H, DType::kBFloat16, rng), DType::kBFloat16, N, H);
  const Tensor st = index_tensor(sizes, DType::kInt64);
  const PadResult a = padmoe::sort_chunks(h, st, 1, 16);
  const PadResult b = padmoe::pad_to_alignment(h, st, 16);
  EXPECT_TRUE(same_bytes(a.padded, b.padded));
  EXPECT_TRUE(same_bytes(a.permutation_map, b.permutation_map));
  EXPECT_TRUE(same_bytes(a.inclusive_offsets, b.inclusive_offsets));
}

TEST(SortChunks, SortedIndexIsTransformerEngineSemantics) {
  Rng rng(11);
  const int R = 4, E = 6;
  const int64_t C = R * E, H = 5;
  for (int trial = 0; trial < 4; ++trial) {
    const std::vector<int64_t> sizes = random_sizes(C, 4, rng);
    const std::vector<int64_t> perm = random_permutation(C, rng);
    const int64_t N = sum_of(sizes) + trial;
    const std::vector<float> hf = random_values(N * H, DType::kFloat32, rng);
    const Tensor h = rows_from_float(hf, DType::kFloat32, N, H);
    const std::vector<float> te = te_sort_chunks(hf, H, sizes, perm);
    for (DType idt : {DType::kInt32, DType::kInt64}) {
      const Tensor si = index_tensor(perm, idt);
      // alignment 1: TE's output for every grouping R that divides C (the offsets differ only)
      for (int ranks : {1, 2, 4, 24}) {
        const PadResult r = padmoe::sort_chunks(h, index_tensor(sizes, DType::kInt64), ranks, 1, si.view());
        ASSERT_EQ(r.padded.size(0), sum_of(sizes));
        EXPECT_TRUE(rows_bitwise(r.padded, te, sum_of(sizes))) << "ranks " << ranks;
        // offsets: group g's rows end at the sum of the sizes of chunks perm[0 .. (g+1)*ranks)
        std::vector<int64_t> offs;
        int64_t run = 0;
        for (int64_t j = 0; j < C; ++j) {
          run += sizes[static_cast<size_t>(perm[static_cast<size_t>(j)])];
          if ((j + 1) % ranks == 0) offs.push_back(run);
        }
        EXPECT_EQ(index_to_vec(r.inclusive_offsets), offs);
      }
      // alignment 8 with a sorted_index: the reference's padded grouping
      const ref::PadResult want = ref::sort_chunks(hf, H, sizes, R, 8, &perm);
      const PadResult r = padmoe::sort_chunks(h, index_tensor(sizes, DType::kInt32), R, 8, si.view());
      EXPECT_EQ(index_to_vec(r.permutation_map), want.permutation_map);
      EXPECT_EQ(index_to_vec(r.inclusive_offsets), want.inclusive_offsets);
      EXPECT_TRUE(rows_bitwise(r.padded, want.padded, want.padded_rows));
    }
    // The expert-major order given explicitly equals the default; Megatron's
    // sort_input_by_local_experts = arange(C).reshape(R, E).T.ravel().
    std::vector<int64_t> expert_major;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < R; ++r) expert_major.push_back(r * E + e);
    const Tensor em = index_tensor(expert_major, DType::kInt64);
    const PadResult a = padmoe::sort_chunks(h, index_tensor(sizes, DType::kInt32), R, 4);
    const PadResult b = padmoe::sort_chunks(h, index_tensor(sizes, DType::kInt32), R, 4, em.view());
    EXPECT_TRUE(same_bytes(a.padded, b.padded));
    EXPECT_TRUE(same_bytes(a.permutation_map, b.permutation_map));
    EXPECT_TRUE(same_bytes(a.inclusive_offsets, b.inclusive_offsets));
    // ... and with alignment 1 it is TE's sort by Megatron's index
    const PadResult c1 = padmoe::sort_chunks(h, index_tensor(sizes, DType::kInt32), R, 1);
    EXPECT_TRUE(rows_bitwise(c1.padded, te_sort_chunks(hf, H, sizes, expert_major), sum_of(sizes)));
    // The way back in TE's form: sorting the expert-major chunks by Megatron's
    // restore_output_by_local_experts = arange(C).reshape(E, R).T.ravel() over the
    // transposed sizes gives the received rows; unsort_chunks does it from the map.
    std::vector<int64_t> sizes_t, restore;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < R; ++r) sizes_t.push_back(sizes[static_cast<size_t>(r * E + e)]);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t e = 0; e < E; ++e) restore.push_back(e * R + r);
    const std::vector<float> sorted_rows = te_sort_chunks(hf, H, sizes, expert_major);
    const std::vector<float> restored = te_sort_chunks(sorted_rows, H, sizes_t, restore);
    const Tensor back = padmoe::unsort_chunks(a.padded, a.permutation_map, N);
    EXPECT_TRUE(rows_bitwise(back, restored, sum_of(sizes)));
    EXPECT_TRUE(bytes_are(back, sum_of(sizes), N, 0x00));
  }
}

TEST(SortChunks, OptionsZeroTailAndZeroPadding) {
  Rng rng(3);
  const int R = 2, E = 3, m = 8;
  const std::vector<int64_t> sizes = {1, 0, 5, 2, 0, 4};
  const int64_t N = 14, H = 16;
  const std::vector<float> hf = random_values(N * H, DType::kBFloat16, rng);
  const Tensor h = rows_from_float(hf, DType::kBFloat16, N, H);
  const Tensor st = index_tensor(sizes, DType::kInt32);
  const ref::PadResult want = ref::sort_chunks(hf, H, sizes, R, m, nullptr);
  const int64_t cap = padmoe::sort_chunks_rows_bound(N, 6, R, m);
  {  // zero_tail: rows at or past P zeroed too
    Tensor padded = poison_rows(DType::kBFloat16, cap, H);
    Tensor map = poison_index(cap), offs = poison_index(E);
    Options o;
    o.zero_tail = true;
    padmoe::sort_chunks_out(h, st, R, m, std::nullopt, padded, map, offs, o);
    std::vector<float> full = want.padded;
    full.resize(static_cast<size_t>(cap * H), 0.0f);
    EXPECT_TRUE(rows_bitwise(padded, full, cap));
    EXPECT_TRUE(bytes_are(padded, want.padded_rows, cap, 0x00));
  }
  {  // zero_padding = false: padding rows and rows past P left as they were
    Tensor padded = poison_rows(DType::kBFloat16, cap, H);
    Tensor map = poison_index(cap), offs = poison_index(E);
    Options o;
    o.zero_padding = false;
    padmoe::sort_chunks_out(h, st, R, m, std::nullopt, padded, map, offs, o);
    for (int64_t p = 0; p < cap; ++p) {
      const int64_t src = p < want.padded_rows ? want.permutation_map[static_cast<size_t>(p)] : -1;
      if (src < 0) {
        EXPECT_TRUE(bytes_are(padded, p, p + 1, kPoison)) << p;
      } else {
        EXPECT_TRUE(
            rows_bitwise(padded, std::vector<float>(hf.begin() + src * H, hf.begin() + (src + 1) * H), 1, 0, -1, p));
      }
    }
  }
}

TEST(SortChunks, DeterministicAcrossThreadCounts) {
  Rng rng(21);
  const int R = 8, E = 16, m = 16;
  const std::vector<int64_t> sizes = random_sizes(R * E, 64, rng);
  const int64_t N = sum_of(sizes), H = 40;
  const Tensor h = rows_from_float(random_values(N * H, DType::kFloat32, rng), DType::kFloat32, N, H);
  const Tensor st = index_tensor(sizes, DType::kInt32);
  Options one;
  one.num_threads = 1;
  const PadResult a = padmoe::sort_chunks(h, st, R, m, std::nullopt, one);
  for (int threads : {2, 7, 0}) {
    Options o;
    o.num_threads = threads;
    const PadResult b = padmoe::sort_chunks(h, st, R, m, std::nullopt, o);
    EXPECT_TRUE(same_bytes(a.padded, b.padded)) << threads;
    EXPECT_TRUE(same_bytes(a.permutation_map, b.permutation_map)) << threads;
  }
  const ref::PadResult want = ref::sort_chunks(rows_to_float(h), H, sizes, R, m, nullptr);
  EXPECT_EQ(index_to_vec(a.permutation_map), want.permutation_map);
}

TEST(SortChunks, EmptyInputs) {
  // no chunks at all
  const Tensor h0 = Tensor::empty(DType::kFloat32, {0, 8});
  const PadResult r0 = padmoe::sort_chunks(h0, index_tensor({}, DType::kInt32), 4, 16);
  EXPECT_EQ(r0.padded.size(0), 0);
  EXPECT_EQ(r0.inclusive_offsets.numel(), 0);
  // every chunk empty, rows present but past the sum
  const Tensor h = rows_from_float(tagged(3, 8, DType::kFloat32), DType::kFloat32, 3, 8);
  const PadResult r = padmoe::sort_chunks(h, index_matrix({0, 0, 0, 0, 0, 0}, 2, 3, DType::kInt64), 2, 16);
  EXPECT_EQ(r.padded.size(0), 0);
  EXPECT_EQ(index_to_vec(r.inclusive_offsets), (std::vector<int64_t>{0, 0, 0}));
  const Tensor back = padmoe::unsort_chunks(r.padded, r.permutation_map, 3);
  EXPECT_TRUE(all_bytes_are(back, 0x00));
  // H = 0
  const Tensor hz = Tensor::empty(DType::kBFloat16, {5, 0});
  const PadResult rz = padmoe::sort_chunks(hz, index_tensor({2, 3}, DType::kInt32), 2, 4);
  EXPECT_EQ(rz.padded.size(0), 8);
  EXPECT_EQ(rz.padded.size(1), 0);
  EXPECT_EQ(index_to_vec(rz.permutation_map), (std::vector<int64_t>{0, 1, 2, 3, 4, -1, -1, -1}));
}

// Every bad input is a named error and writes nothing.
TEST(SortChunks, BadInputNamedAndNothingWritten) {
  const int64_t N = 10, H = 4;
  const Tensor h = rows_from_float(tagged(N, H, DType::kFloat32), DType::kFloat32, N, H);
  const Tensor good = index_matrix({1, 2, 0, 3, 1, 1}, 2, 3, DType::kInt32);  // R = 2, E = 3
  Tensor padded = poison_rows(DType::kFloat32, 64, H);
  Tensor map = poison_index(64), offs = poison_index(3);
  auto untouched = [&] {
    return all_bytes_are(padded, kPoison) && all_bytes_are(map, kIndexPoison) && all_bytes_are(offs, kIndexPoison);
  };
  using SI = std::optional<TensorView>;
  auto run = [&](const TensorView& hh, const TensorView& s, int R, int m, SI si, const TensorView& p,
                 const TensorView& mp,
                 const TensorView& o) { return [=] { padmoe::sort_chunks_out(hh, s, R, m, si, p, mp, o); }; };
  struct Case {
    const char* what;
    std::function<void()> f;
    std::vector<std::string> needles;
  };
  const Tensor bad_h = Tensor::empty(DType::kInt32, {N, H});
  const Tensor flat_h = Tensor::empty(DType::kFloat32, {N});
  const Tensor float_sizes = Tensor::empty(DType::kFloat32, {6});
  const Tensor sizes_3x2 = index_matrix({1, 2, 0, 3, 1, 1}, 3, 2, DType::kInt32);
  const Tensor sizes_5 = index_tensor({1, 1, 1, 1, 1}, DType::kInt32);
  const Tensor neg = index_matrix({1, -1, 0, -2, 1, 1}, 2, 3, DType::kInt64);
  const Tensor huge = index_matrix({1, 2, 11, 3, 1, 1}, 2, 3, DType::kInt32);
  const Tensor total = index_matrix({1, 2, 4, 3, 1, 1}, 2, 3, DType::kInt32);
  const Tensor perm_short = index_tensor({0, 1, 2}, DType::kInt32);
  const Tensor perm_oor = index_tensor({0, 1, 9, 3, -1, 5}, DType::kInt64);
  const Tensor perm_rep = index_tensor({0, 4, 2, 4, 1, 2}, DType::kInt32);
  const Tensor small = poison_rows(DType::kFloat32, 11, H);  // P = 12 here (alignment 4: 4 + 4 + 4)
  const Tensor small_map = poison_index(11);
  const Tensor wide = poison_rows(DType::kFloat32, 64, H + 1);
  const Tensor bf = poison_rows(DType::kBFloat16, 64, H);
  const Tensor map_short = poison_index(63);
  const Tensor map_i64 = filled(DType::kInt64, {64}, kIndexPoison);
  const Tensor offs_2 = poison_index(2);
  const std::vector<Case> cases = {
      {"received 1-D", run(flat_h, good, 2, 4, {}, padded, map, offs), {"sort_chunks: received:", "2-D"}},
      {"received int", run(bad_h, good, 2, 4, {}, padded, map, offs), {"received:", "float32"}},
      {"sizes float", run(h, float_sizes, 2, 4, {}, padded, map, offs), {"split_sizes:", "int32 or int64"}},
      {"sizes 2-D rows", run(h, sizes_3x2, 2, 4, {}, padded, map, offs), {"split_sizes:", "num_ranks = 2"}},
      {"num_ranks 0", run(h, good, 0, 4, {}, padded, map, offs), {"num_ranks: must be >= 1"}},
      {"C % R", run(h, sizes_5, 2, 4, {}, padded, map, offs), {"num_ranks:", "5 chunks", "not a multiple"}},
      {"alignment 0", run(h, good, 2, 0, {}, padded, map, offs), {"alignment: must be >= 1"}},
      {"negative", run(h, neg, 2, 4, {}, padded, map, offs), {"split_sizes: entry [0, 1] is negative (-1)"}},
      {"too large", run(h, huge, 2, 4, {}, padded, map, offs), {"split_sizes: entry [0, 2] (11) exceeds the 10 rows"}},
      {"sum", run(h, total, 2, 4, {}, padded, map, offs), {"split_sizes: sums to 12 but received has 10 rows"}},
      {"sorted short", run(h, good, 2, 4, perm_short.view(), padded, map, offs), {"sorted_index:", "6 entries"}},
      {"sorted oor",
       run(h, good, 2, 4, perm_oor.view(), padded, map, offs),
       {"sorted_index: position 2 holds chunk 9, outside [0, 6)"}},
      {"sorted repeat",
       run(h, good, 2, 4, perm_rep.view(), padded, map, offs),
       {"sorted_index: must be a permutation of [0, 6): chunk 2 appears more than once"}},
      {"capacity", run(h, good, 2, 4, {}, small, small_map, offs), {"padded: output capacity", "at least 12 rows"}},
      {"padded cols", run(h, good, 2, 4, {}, wide, map, offs), {"padded:", "columns"}},
      {"padded dtype", run(h, good, 2, 4, {}, bf, map, offs), {"padded:", "dtype"}},
      {"map length", run(h, good, 2, 4, {}, padded, map_short, offs), {"permutation_map:", "64"}},
      {"map dtype", run(h, good, 2, 4, {}, padded, map_i64, offs), {"permutation_map:", "int32"}},
      {"offsets length", run(h, good, 2, 4, {}, padded, map, offs_2), {"inclusive_offsets:", "3"}},
  };
  for (const Case& c : cases) {
    EXPECT_TRUE(throws_error(c.f, c.needles)) << c.what;
    EXPECT_TRUE(untouched()) << c.what;
  }
  // The allocating form, and sort_chunks_rows (P for a caller that allocates), report the same errors.
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks(h, neg, 2, 4); }, {"entry [0, 1] is negative"}));
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks_rows(h, neg, 2, 4); },
                           {"sort_chunks: split_sizes: entry [0, 1] is negative"}));
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks_rows(h, huge, 2, 4); },
                           {"split_sizes: entry [0, 2] (11) exceeds the 10 rows"}));
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks_rows(h, total, 2, 4); },
                           {"split_sizes: sums to 12 but received has 10 rows"}));
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks_rows(h, good, 2, 4, perm_rep.view()); }, {"chunk 2 appears"}));
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks(h, good, 2, 4, perm_rep.view()); }, {"chunk 2 appears"}));
  // A good call afterwards works (the buffers were really untouched and usable).
  padmoe::sort_chunks_out(h, good, 2, 4, std::nullopt, padded, map, offs);
  EXPECT_EQ(index_to_vec(offs), (std::vector<int64_t>{4, 8, 12}));
}

TEST(SortChunks, Int32Overflow) {
  // H = 0 rows need no storage: 2^31 + 8 received rows, one chunk of 2^31 rows -> P overflows int32.
  TensorView h = TensorView::matrix(nullptr, DType::kFloat32, (int64_t{1} << 31) + 8, 0, 0);
  const Tensor sizes = index_tensor({int64_t{1} << 31}, DType::kInt64);
  EXPECT_TRUE(throws_error([&] { padmoe::sort_chunks(h, sizes, 1, 1); }, {"sort_chunks: split_sizes: size overflow"}));
}

}  // namespace
}  // namespace pt
