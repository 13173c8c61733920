// test_padding.cpp — pad_to_alignment / unpad_from_alignment (and its
// backward) against the reference and Megatron's own cases.
#include <tuple>

#include "test_util.hpp"

namespace pt {
namespace {

// h rows tagged with their row id so misrouting shows: h[n][c] = n + c / 64 (exact in f32).
std::vector<float> tagged_rows(int64_t N, int64_t H, DType dt) {
  std::vector<float> v(static_cast<size_t>(N * H));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < H; ++c)
      v[static_cast<size_t>(n * H + c)] = num::round_to(dt, static_cast<float>(n) + c / 64.0f);
  return v;
}

TEST(Megatron, Counts342Alignment8) {
  const std::vector<int64_t> counts = {3, 4, 2};
  const int64_t N = 9, H = 4;
  const std::vector<float> hf = tagged_rows(N, H, DType::kFloat32);
  const Tensor h = rows_from_float(hf, DType::kFloat32, N, H);
  const padmoe::PadResult r = padmoe::pad_to_alignment(h, index_tensor(counts, DType::kInt64), 8);
  ASSERT_EQ(r.padded.size(0), 24);
  ASSERT_EQ(r.padded.size(1), H);
  EXPECT_EQ(index_to_vec(r.inclusive_offsets), (std::vector<int64_t>{8, 16, 24}));
  std::vector<int64_t> map(24, -1);
  for (int j = 0; j < 3; ++j) map[static_cast<size_t>(j)] = j;
  for (int j = 0; j < 4; ++j) map[static_cast<size_t>(8 + j)] = 3 + j;
  for (int j = 0; j < 2; ++j) map[static_cast<size_t>(16 + j)] = 7 + j;
  EXPECT_EQ(index_to_vec(r.permutation_map), map);
  EXPECT_EQ(r.permutation_map.dtype(), DType::kInt32);
  const ref::PadResult want = ref::pad_to_alignment(hf, H, counts, 8);
  EXPECT_EQ(want.permutation_map, map);
  EXPECT_TRUE(rows_bitwise(r.padded, want.padded, 24));
  // padding rows bitwise zero
  for (int64_t p = 0; p < 24; ++p)
    if (map[static_cast<size_t>(p)] < 0) EXPECT_TRUE(bytes_are(r.padded, p, p + 1, 0x00)) << "row " << p;
}

// P for a caller that allocates the outputs itself (padmoe.torch): the op's value, and the op's
// errors before anything is sized from the counts.
TEST(Megatron, PadRowsIsTheOpsPAfterItsChecks) {
  const int64_t N = 9, H = 4;
  const Tensor h = rows_from_float(tagged_rows(N, H, DType::kFloat32), DType::kFloat32, N, H);
  EXPECT_EQ(padmoe::pad_to_alignment_rows(h, index_tensor({3, 4, 2}, DType::kInt64), 8), 24);
  EXPECT_EQ(padmoe::pad_to_alignment_rows(h, index_tensor({0, 5, 0}, DType::kInt32), 8), 8);
  EXPECT_EQ(padmoe::pad_to_alignment_rows(h, index_tensor({3, 4, 2}, DType::kInt32), 1), 9);
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_rows(h, index_tensor({1, -2}, DType::kInt32), 4); },
                           {"pad_to_alignment: tokens_per_expert: entry 1 is negative (-2)"}));
  EXPECT_TRUE(
      throws_error([&] { padmoe::pad_to_alignment_rows(h, index_tensor({2147483647}, DType::kInt32), 1); },
                   {"pad_to_alignment: tokens_per_expert: entry 0 (2147483647) exceeds the 9 rows of hidden_states"}));
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_rows(h, index_tensor({5, 5}, DType::kInt64), 2); },
                           {"tokens_per_expert: sums to 10 but hidden_states has 9 rows"}));
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_rows(h, index_tensor({3, 4}, DType::kInt32), 0); },
                           {"alignment: must be >= 1"}));
}

// An output with more rows than P: rows at or past P untouched by default, zeroed under
// Options::zero_tail (as a spread's), the map's entries there -1 either way.
TEST(Megatron, RowsPastPZeroedOnlyWithZeroTail) {
  const int64_t N = 5, H = 4, R = 12;  // counts {2, 3}, alignment 4: P = 8
  const std::vector<float> hf = tagged_rows(N, H, DType::kFloat32);
  const Tensor h = rows_from_float(hf, DType::kFloat32, N, H);
  const ref::PadResult want = ref::pad_to_alignment(hf, H, {2, 3}, 4);
  for (bool tail : {false, true}) {
    Tensor padded = poison_rows(DType::kFloat32, R, H), map = poison_index(R), offs = poison_index(2);
    padmoe::Options o;
    o.zero_tail = tail;
    padmoe::pad_to_alignment_out(h, index_tensor({2, 3}, DType::kInt32), 4, padded, map, offs, o);
    EXPECT_TRUE(rows_bitwise(padded, want.padded, 8)) << "zero_tail " << tail;
    EXPECT_TRUE(bytes_are(padded, 8, R, tail ? 0x00 : kPoison)) << "zero_tail " << tail;
    const std::vector<int64_t> m = index_to_vec(map);
    for (int64_t p = 8; p < R; ++p) EXPECT_EQ(m[static_cast<size_t>(p)], -1) << "row " << p;
  }
}

TEST(Megatron, Counts050GivesEightRows) {
  const std::vector<int64_t> counts = {0, 5, 0};
  const int64_t N = 5, H = 3;
  const Tensor h = rows_from_float(tagged_rows(N, H, DType::kBFloat16), DType::kBFloat16, N, H);
  const padmoe::PadResult r = padmoe::pad_to_alignment(h, index_tensor(counts, DType::kInt32), 8);
  ASSERT_EQ(r.padded.size(0), 8);
  const std::vector<int64_t> map = index_to_vec(r.permutation_map);
  EXPECT_EQ(map, (std::vector<int64_t>{0, 1, 2, 3, 4, -1, -1, -1}));
  EXPECT_EQ(index_to_vec(r.inclusive_offsets), (std::vector<int64_t>{0, 8, 8}));
  EXPECT_TRUE(bytes_are(r.padded, 5, 8, 0x00));
  EXPECT_TRUE(rows_bitwise(r.padded, tagged_rows(N, H, DType::kBFloat16), 5));
}

TEST(Megatron, EmptyInput) {
  const Tensor h = Tensor::empty(DType::kFloat32, {0, 16});
  const padmoe::PadResult r = padmoe::pad_to_alignment(h, index_tensor({0, 0, 0, 0}, DType::kInt64), 8);
  EXPECT_EQ(r.padded.size(0), 0);
  EXPECT_EQ(r.permutation_map.numel(), 0);
  EXPECT_EQ(index_to_vec(r.inclusive_offsets), (std::vector<int64_t>{0, 0, 0, 0}));
  const Tensor out = padmoe::unpad_from_alignment(r.padded, r.permutation_map, 0);
  EXPECT_EQ(out.size(0), 0);
  EXPECT_EQ(out.size(1), 16);
  // N = 0 rows out of a padded buffer that holds only padding
  const Tensor pad = filled(DType::kFloat32, {4, 16}, 0);
  const Tensor out2 = padmoe::unpad_from_alignment(pad, index_tensor({-1, -1, -1, -1}, DType::kInt32), 0);
  EXPECT_EQ(out2.size(0), 0);
}

using PadParam = std::tuple<int, DType, DType>;  // alignment, row dtype, count dtype
class PadUnpad : public ::testing::TestWithParam<PadParam> {};

TEST_P(PadUnpad, MatchesReferenceAndRoundTrips) {
  int m;
  DType dt, cdt;
  std::tie(m, dt, cdt) = GetParam();
  Rng rng(static_cast<uint64_t>(m) * 7 + static_cast<uint64_t>(dt));
  const int E = 12;
  std::vector<int64_t> counts(E);
  for (int e = 0; e < E; ++e) counts[static_cast<size_t>(e)] = rng.below(5) == 0 ? 0 : rng.below(3 * m + 3);
  counts[3] = m;      // exactly on the multiple
  counts[4] = m + 1;  // one over
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  const int64_t extra = 7;  // rows of h past sum(counts): ignored
  const int64_t N = total + extra, H = 19;
  std::vector<float> hf = random_values(N * H, dt, rng);
  Tensor h = rows_from_float(hf, dt, N, H);
  // the ignored rows are NaN: if they were copied, the bitwise comparison fails
  std::memset(static_cast<unsigned char*>(h.data()) + total * H * esize(dt), kPoison,
              static_cast<size_t>(extra * H) * esize(dt));
  const ref::PadResult want = ref::pad_to_alignment(hf, H, counts, m);
  const int64_t P = want.padded_rows;

  const padmoe::PadResult r = padmoe::pad_to_alignment(h, index_tensor(counts, cdt), m);
  ASSERT_EQ(r.padded.size(0), P);
  EXPECT_TRUE(rows_bitwise(r.padded, want.padded, P));
  EXPECT_EQ(index_to_vec(r.permutation_map), want.permutation_map);
  EXPECT_EQ(index_to_vec(r.inclusive_offsets), want.inclusive_offsets);

  // _out into larger buffers: rows past P untouched, map past P = -1.
  Tensor padded = poison_rows(dt, P + 4, H);
  Tensor map = poison_index(P + 4);
  Tensor offs = poison_index(E);
  padmoe::pad_to_alignment_out(h, index_tensor(counts, cdt), m, padded, map, offs);
  EXPECT_TRUE(rows_bitwise(padded, want.padded, P));
  EXPECT_TRUE(bytes_are(padded, P, P + 4, kPoison)) << "pad_to_alignment_out wrote past P";
  std::vector<int64_t> wmap = want.permutation_map;
  wmap.resize(static_cast<size_t>(P + 4), -1);
  EXPECT_EQ(index_to_vec(map), wmap);
  EXPECT_EQ(index_to_vec(offs), want.inclusive_offsets);

  // unpad without probs: exact round trip of the first `total` rows.
  const Tensor back = padmoe::unpad_from_alignment(r.padded, r.permutation_map, total);
  ASSERT_EQ(back.size(0), total);
  EXPECT_TRUE(rows_bitwise(back, hf, total)) << "pad -> unpad round trip";
  // unpad into N rows: rows no entry names are zero.
  Tensor outN = poison_rows(dt, N, H);
  padmoe::unpad_from_alignment_out(r.padded, r.permutation_map, std::nullopt, outN);
  EXPECT_TRUE(rows_bitwise(outN, hf, total));
  EXPECT_TRUE(bytes_are(outN, total, N, 0x00)) << "rows no map entry names must be zero";

  // unpad with probs (float32 and row dtype): out[n] = padded[p] * probs[n], bitwise.
  for (DType pdt : {DType::kFloat32, dt}) {
    const std::vector<float> probs = random_values(N, pdt, rng, 0.0, 1.0);
    const Tensor pt_ = vec_from_float(probs, pdt);
    const std::vector<float> wantp = ref::unpad_from_alignment(want.padded, H, want.permutation_map, N, &probs);
    Tensor o = poison_rows(dt, N, H);
    padmoe::unpad_from_alignment_out(r.padded, r.permutation_map, pt_.view(), o);
    EXPECT_TRUE(rows_bitwise(o, wantp, N)) << "unpad with probs";
    const Tensor o2 = padmoe::unpad_from_alignment(r.padded, r.permutation_map, N, pt_.view());
    EXPECT_TRUE(same_bytes(o, o2));

    // backward with probs
    const std::vector<float> gof = random_values(N * H, dt, rng);
    const Tensor go = rows_from_float(gof, dt, N, H);
    const ref::UnpadGrads g = ref::unpad_from_alignment_backward(gof, want.padded, H, want.permutation_map, &probs);
    const ref::UnpadGrads ga =
        ref::unpad_from_alignment_backward(abs_of(gof), abs_of(want.padded), H, want.permutation_map, &probs);
    const padmoe::RowGrads lg = padmoe::unpad_from_alignment_backward(go, r.padded, r.permutation_map, pt_.view());
    ASSERT_EQ(lg.grad_rows.size(0), P);
    EXPECT_TRUE(rows_bitwise(lg.grad_rows, g.grad_padded, P)) << "grad_padded";
    for (int64_t p = 0; p < P; ++p)
      if (want.permutation_map[static_cast<size_t>(p)] < 0)
        EXPECT_TRUE(bytes_are(lg.grad_rows, p, p + 1, 0x00)) << "grad_padded padding row " << p;
    ASSERT_TRUE(lg.grad_weights.defined());
    ASSERT_EQ(lg.grad_weights.numel(), N);
    EXPECT_TRUE(sums_close(lg.grad_weights, g.grad_probs, ga.grad_probs, H, N)) << "grad_probs";
  }
  // backward without probs: grad_padded = grad_out[map[p]], no probs grad.
  {
    const std::vector<float> gof = random_values(N * H, dt, rng);
    const Tensor go = rows_from_float(gof, dt, N, H);
    const ref::UnpadGrads g = ref::unpad_from_alignment_backward(gof, want.padded, H, want.permutation_map, nullptr);
    const padmoe::RowGrads lg = padmoe::unpad_from_alignment_backward(go, r.padded, r.permutation_map);
    EXPECT_TRUE(rows_bitwise(lg.grad_rows, g.grad_padded, P));
    EXPECT_FALSE(lg.grad_weights.defined());
    // pad's backward is unpad(grad, map, N): check it equals the reference unpad.
    const std::vector<float> gpf = random_values(P * H, dt, rng);
    const Tensor gp = rows_from_float(gpf, dt, P, H);
    const Tensor gh = padmoe::unpad_from_alignment(gp, r.permutation_map, N);
    EXPECT_TRUE(rows_bitwise(gh, ref::unpad_from_alignment(gpf, H, want.permutation_map, N, nullptr), N));
  }
}

INSTANTIATE_TEST_SUITE_P(All, PadUnpad,
                         ::testing::Combine(::testing::Values(1, 8, 16, 128),
                                            ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values(DType::kInt32, DType::kInt64)),
                         [](const ::testing::TestParamInfo<PadParam>& i) {
                           return "m" + std::to_string(std::get<0>(i.param)) + "_" + dname(std::get<1>(i.param)) + "_" +
                                  dname(std::get<2>(i.param));
                         });

TEST(Megatron, Float8PadUnpadMoveOnly) {
  for (DType dt : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    const std::vector<int64_t> counts = {5, 0, 9, 16};
    const int64_t N = 30, H = 33;
    Rng rng(3);
    const std::vector<float> hf = random_values(N * H, dt, rng, -8, 8);
    const Tensor h = rows_from_float(hf, dt, N, H);
    const ref::PadResult want = ref::pad_to_alignment(hf, H, counts, 16);
    const padmoe::PadResult r = padmoe::pad_to_alignment(h, index_tensor(counts, DType::kInt32), 16);
    ASSERT_EQ(r.padded.size(0), want.padded_rows);
    EXPECT_TRUE(rows_bitwise(r.padded, want.padded, want.padded_rows));
    const Tensor back = padmoe::unpad_from_alignment(r.padded, r.permutation_map, 30);
    EXPECT_TRUE(rows_bitwise(back, hf, 30));
  }
}

TEST(Megatron, UnpadArbitraryPermutation) {
  // A caller-built map (not from pad): entries -1 or distinct rows, any order.
  const int64_t P = 10, N = 6, H = 5;
  const std::vector<int64_t> map = {4, -1, 0, 5, -1, -1, 2, 1, -1, -1};  // row 3 is named by nobody
  Rng rng(8);
  const std::vector<float> pf = random_values(P * H, DType::kFloat32, rng);
  const std::vector<float> probs = random_values(N, DType::kFloat32, rng, 0, 1);
  Tensor padded = rows_from_float(pf, DType::kFloat32, P, H);
  // padding rows of padded are NaN: never read
  for (int64_t p = 0; p < P; ++p)
    if (map[static_cast<size_t>(p)] < 0)
      std::memset(static_cast<unsigned char*>(padded.data()) + p * H * 4, kPoison, H * 4);
  const Tensor mt = index_tensor(map, DType::kInt32);
  const Tensor probs_t = vec_from_float(probs, DType::kFloat32);
  const Tensor out = padmoe::unpad_from_alignment(padded, mt, N, probs_t.view());
  EXPECT_TRUE(rows_bitwise(out, ref::unpad_from_alignment(pf, H, map, N, &probs), N));
  EXPECT_TRUE(bytes_are(out, 3, 4, 0x00));
}

}  // namespace
}  // namespace pt
