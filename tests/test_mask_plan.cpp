// test_mask_plan.cpp — mask_plan_out (a plan from a routing mask, TransformerEngine's mask map)
// against ref::mask_plan, written from its definition (the routed pairs sorted by (expert, token),
// each expert's run padded to the alignment, destinations at or past `rows` dropped, TE's
// row_id_map spelled out per token), and against make_plan of the ids where(map, e, -1) with
// drop_invalid. Sizes, one_bin, cuts, empty maps and bad arguments.
#include <algorithm>
#include <tuple>

#include "test_util.hpp"

namespace pt {
namespace {

Tensor byte_matrix(const std::vector<uint8_t>& v, int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty(DType::kUInt8, {rows, cols});
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size());
  return t;
}

// A mask with about `density` of its pairs set, some rows empty and some full; byte values other
// than 1 count as routed too.
std::vector<uint8_t> random_mask(int64_t T, int64_t E, double density, Rng& rng) {
  std::vector<uint8_t> m(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t kind = rng.below(10);
    for (int64_t e = 0; e < E; ++e) {
      const bool set = kind == 0 ? false : (kind == 1 ? true : rng.uniform(0.0, 1.0) < density);
      m[static_cast<size_t>(t * E + e)] = set ? static_cast<uint8_t>(1 + rng.below(3)) : 0;
    }
  }
  return m;
}

TEST(MaskPlan, MatchesReference) {
  struct Case {
    int64_t T, E;
    double density;
    int alignment;
    bool one_bin;
    double cut;  // rows as a fraction of the routed total (1: all; > 1: spare rows)
  };
  Rng rng(41);
  for (const Case c :
       {Case{1, 1, 1.0, 1, true, 1.0}, Case{37, 8, 0.25, 1, true, 1.0}, Case{37, 8, 0.25, 1, true, 0.6},
        Case{37, 8, 0.25, 1, true, 1.5}, Case{100, 8, 0.25, 16, false, 1.0}, Case{100, 8, 0.25, 128, false, 1.0},
        Case{64, 33, 0.1, 4, false, 0.7}, Case{257, 256, 0.03, 16, false, 1.0}, Case{300, 5, 0.5, 1, false, 1.0},
        Case{50, 70, 0.0, 8, false, 1.0}, Case{0, 8, 0.5, 16, false, 1.0}, Case{6, 0, 0.5, 1, true, 1.0},
        Case{6, 0, 0.5, 4, false, 1.0}, Case{3000, 64, 0.1, 16, false, 1.0}, Case{2500, 160, 0.05, 1, true, 0.8},
        Case{2100, 128, 0.06, 128, false, 0.9}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " align=" + std::to_string(c.alignment) +
                 (c.one_bin ? " one_bin" : "") + " cut=" + std::to_string(c.cut));
    const std::vector<uint8_t> map = random_mask(c.T, c.E, c.density, rng);
    int64_t routed = 0;
    for (uint8_t b : map) routed += b != 0;
    int64_t padded_total = 0;
    {
      const ref::MaskPlan full = ref::mask_plan(map, c.T, c.E, c.alignment, INT32_MAX, false, 0);
      padded_total = c.E > 0 ? full.counts[static_cast<size_t>(4 * c.E - 1)] : 0;
    }
    const int64_t rows = static_cast<int64_t>((c.one_bin ? routed : padded_total) * c.cut);
    const int64_t bins = c.one_bin ? 1 : c.E;
    const int64_t sources_len = c.one_bin ? rows : (c.E > 0 ? (rows + c.E - 1) / c.E * c.E : 0);
    const ref::MaskPlan want = ref::mask_plan(map, c.T, c.E, c.alignment, rows, c.one_bin, sources_len);
    const Tensor m = byte_matrix(map, c.T, c.E);
    Tensor counts = poison_index(4 * bins), dest = poison_index(c.T * c.E), sources = poison_index(sources_len);
    for (int threads : {1, 3}) {  // the maps past 2^17 pairs take several workers at 3
      SCOPED_TRACE("threads=" + std::to_string(threads));
      padmoe::Options o;
      o.num_threads = threads;
      Tensor rim = filled(DType::kInt32, {c.T, 2 * c.E + 1}, kIndexPoison);
      Tensor indices = poison_index(c.T * c.E), bin_ids = poison_index(c.T * c.E);
      counts = poison_index(4 * bins), dest = poison_index(c.T * c.E), sources = poison_index(sources_len);
      padmoe::mask_plan_out(m, c.alignment, rows, c.one_bin, counts, dest, sources, rim, indices, bin_ids, o);
      EXPECT_EQ(index_to_vec(counts), want.counts);
      EXPECT_EQ(index_to_vec(dest), want.dest_rows);
      EXPECT_EQ(index_to_vec(sources), want.row_sources);
      EXPECT_EQ(index_to_vec(rim), want.row_id_map);
      EXPECT_EQ(index_to_vec(indices), want.indices);
      EXPECT_EQ(index_to_vec(bin_ids), want.bin_ids);
    }
    // without the row_id_map and the sorted order: the same plan
    Tensor dest2 = poison_index(c.T * c.E);
    padmoe::mask_plan_out(m, c.alignment, rows, c.one_bin, counts, dest2, sources, padmoe::TensorView{});
    EXPECT_EQ(index_to_vec(dest2), want.dest_rows);
    // with probs (NaN where unrouted: never read), float32, float16 and bfloat16: moved_probs[r]
    // holds the probability of the assignment in row r, bit for bit, +0 in the rows that hold none;
    // probs_nonzero[a] is 1 where a has a row and a nonzero prob (some routed probs are +0 or -0,
    // some NaN: nonzero), else 0
    for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      SCOPED_TRACE(padmoe::dtype_name(dt));
      std::vector<float> pv(static_cast<size_t>(c.T * c.E));
      for (size_t i = 0; i < pv.size(); ++i) {
        const int64_t kind = rng.below(12);
        const float p = kind == 0   ? 0.0f
                        : kind == 1 ? -0.0f
                        : kind == 2 ? NAN
                                    : static_cast<float>(rng.uniform(0.0, 1.0));
        pv[i] = num::round_to(dt, map[i] != 0 ? p : NAN);
      }
      const Tensor probs = rows_from_float(pv, dt, c.T, c.E);
      Tensor moved = filled(dt, {sources_len}, 0x7f), nonzero = filled(DType::kFloat32, {c.T * c.E}, 0x7f);
      Tensor dest3 = poison_index(c.T * c.E), sources3 = poison_index(sources_len);
      padmoe::mask_plan_out(m, c.alignment, rows, c.one_bin, counts, dest3, sources3, padmoe::TensorView{}, {}, {},
                            probs, moved, nonzero);
      EXPECT_EQ(index_to_vec(sources3), want.row_sources);
      const std::vector<float> got = vec_to_float(moved);
      for (int64_t r = 0; r < sources_len; ++r) {
        const int64_t a = want.row_sources[static_cast<size_t>(r)];
        const float g = got[static_cast<size_t>(r)];
        if (a < 0) {
          ASSERT_TRUE(g == 0.0f && !std::signbit(g)) << "row " << r;
          continue;
        }
        const float expect = pv[static_cast<size_t>(a)];
        ASSERT_TRUE(std::isnan(expect) ? std::isnan(g) : g == expect && std::signbit(g) == std::signbit(expect))
            << "row " << r;
      }
      const std::vector<float> flags = vec_to_float(nonzero);
      for (int64_t a = 0; a < c.T * c.E; ++a) {
        const float p = pv[static_cast<size_t>(a)];
        const bool live = want.dest_rows[static_cast<size_t>(a)] >= 0 && (std::isnan(p) || p != 0.0f);
        ASSERT_EQ(flags[static_cast<size_t>(a)], live ? 1.0f : 0.0f) << "pair " << a;
      }
    }
  }
}

TEST(MaskPlan, BadArguments) {
  const Tensor m = byte_matrix({1, 0, 0, 1, 1, 1}, 3, 2);
  Tensor counts = poison_index(8), dest = poison_index(6), sources = poison_index(8);
  Tensor rim = filled(DType::kInt32, {3, 5}, kIndexPoison);
  const int value = static_cast<int>(padmoe::ErrorKind::kValue), type = static_cast<int>(padmoe::ErrorKind::kType);
  EXPECT_TRUE(throws_error([&] { padmoe::mask_plan_out(m, 0, 4, false, counts, dest, sources, rim); },
                           {"mask_plan: alignment"}, value));
  EXPECT_TRUE(throws_error([&] { padmoe::mask_plan_out(m, 1, -1, false, counts, dest, sources, rim); },
                           {"mask_plan: rows: must be >= 0, got -1"}, value));
  EXPECT_TRUE(throws_error([&] { padmoe::mask_plan_out(m, 4, 4, true, counts, dest, sources, rim); },
                           {"mask_plan: alignment: one_bin needs alignment 1"}, value));
  const Tensor ints = index_matrix({1, 0, 0, 1, 1, 1}, 3, 2, DType::kInt32);
  EXPECT_TRUE(throws_error([&] { padmoe::mask_plan_out(ints, 1, 4, false, counts, dest, sources, rim); },
                           {"mask_plan: routing_map: expected uint8"}, type));
  Tensor short_dest = poison_index(5);
  EXPECT_TRUE(throws_error([&] { padmoe::mask_plan_out(m, 1, 4, false, counts, short_dest, sources, rim); },
                           {"mask_plan: dest_rows"}, value));
  Tensor wrong_map = filled(DType::kInt32, {3, 4}, kIndexPoison);
  EXPECT_TRUE(throws_error([&] { padmoe::mask_plan_out(m, 1, 4, false, counts, dest, sources, wrong_map); },
                           {"mask_plan: row_id_map: expected a contiguous int32 [3, 5] tensor"}, value));
  EXPECT_TRUE(throws_error([&] { padmoe::mask_plan_out(m, 1, 4, false, counts, dest, dest, rim); },
                           {"mask_plan: ", "shares memory with"}));
  Tensor short_indices = poison_index(5), bin_ids = poison_index(6);
  EXPECT_TRUE(
      throws_error([&] { padmoe::mask_plan_out(m, 1, 4, false, counts, dest, sources, rim, short_indices, bin_ids); },
                   {"mask_plan: indices"}, value));
  const Tensor probs = filled(DType::kFloat32, {3, 2}, 0x3f), half_probs = filled(DType::kFloat16, {3, 2}, 0x3c);
  Tensor moved = filled(DType::kFloat32, {8}, 0x7f), short_moved = filled(DType::kFloat32, {7}, 0x7f);
  const Tensor int_probs = filled(DType::kInt32, {3, 2}, 0), wide_probs = filled(DType::kFloat32, {3, 3}, 0x3f);
  EXPECT_TRUE(
      throws_error([&] { padmoe::mask_plan_out(m, 1, 4, false, counts, dest, sources, rim, {}, {}, int_probs, moved); },
                   {"mask_plan: probs: expected float32, float16 or bfloat16"}, type));
  EXPECT_TRUE(throws_error(
      [&] { padmoe::mask_plan_out(m, 1, 4, false, counts, dest, sources, rim, {}, {}, wide_probs, moved); },
      {"mask_plan: probs: expected a contiguous [3, 2] tensor"}, value));
  EXPECT_TRUE(throws_error(
      [&] { padmoe::mask_plan_out(m, 1, 4, false, counts, dest, sources, rim, {}, {}, probs, short_moved); },
      {"mask_plan: moved_probs"}, value));
  EXPECT_TRUE(throws_error(
      [&] { padmoe::mask_plan_out(m, 1, 4, false, counts, dest, sources, rim, {}, {}, half_probs, moved); },
      {"mask_plan: moved_probs"}, value));
  Tensor nonzero = filled(DType::kFloat32, {6}, 0x7f), short_nonzero = filled(DType::kFloat32, {5}, 0x7f);
  EXPECT_TRUE(
      throws_error([&] { padmoe::mask_plan_out(m, 1, 4, false, counts, dest, sources, rim, {}, {}, {}, {}, nonzero); },
                   {"mask_plan: probs_nonzero: needs probs"}, value));
  EXPECT_TRUE(throws_error(
      [&] { padmoe::mask_plan_out(m, 1, 4, false, counts, dest, sources, rim, {}, {}, probs, moved, short_nonzero); },
      {"mask_plan: probs_nonzero: expected a contiguous float32 [6] tensor"}, value));
  const Tensor int_nonzero = filled(DType::kInt32, {6}, 0x7f);
  EXPECT_TRUE(throws_error(
      [&] { padmoe::mask_plan_out(m, 1, 4, false, counts, dest, sources, rim, {}, {}, probs, moved, int_nonzero); },
      {"mask_plan: probs_nonzero: expected a contiguous float32 [6] tensor"}, value));
  EXPECT_TRUE(all_bytes_are(moved, 0x7f));
  EXPECT_TRUE(all_bytes_are(nonzero, 0x7f));
  EXPECT_TRUE(all_bytes_are(short_nonzero, 0x7f));
  // nothing was written by a call that raised
  EXPECT_TRUE(all_bytes_are(counts, kIndexPoison));
  EXPECT_TRUE(all_bytes_are(rim, kIndexPoison));
  // 2^32 entries: past int32, refused on its shape before any is read (no memory behind it)
  const padmoe::TensorView big =
      padmoe::TensorView::contiguous(nullptr, DType::kUInt8, {int64_t{1} << 20, int64_t{1} << 12});
  EXPECT_TRUE(throws_error([&] { padmoe::mask_plan_out(big, 1, 4, false, counts, dest, sources, rim); },
                           {"mask_plan: routing_map"}, value));
}

}  // namespace
}  // namespace pt
