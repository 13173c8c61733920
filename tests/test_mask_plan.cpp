// test_mask_plan.cpp — mask_plan_out (a plan from a routing mask, TransformerEngine's mask map)
// against a reference written from its definition: the routed pairs sorted by (expert, token),
// each expert's run padded to the alignment, destinations at or past `rows` dropped; TE's
// row_id_map spelled out per token. Sizes, one_bin, cuts, empty maps and bad arguments.
#include <algorithm>
#include <tuple>

#include "test_util.hpp"

namespace pt {
namespace {

struct MaskRef {
  std::vector<int64_t> counts, dest, sources, row_id_map, indices, bin_ids;
};

MaskRef mask_reference(const std::vector<uint8_t>& map, int64_t T, int64_t E, int alignment, int64_t rows, bool one_bin,
                       int64_t sources_len) {
  std::vector<std::tuple<int64_t, int64_t>> pairs;  // (e, t) of every routed pair
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e)
      if (map[static_cast<size_t>(t * E + e)]) pairs.emplace_back(e, t);
  std::sort(pairs.begin(), pairs.end());
  std::vector<int64_t> n(static_cast<size_t>(E), 0);
  for (const auto& p : pairs) ++n[static_cast<size_t>(std::get<0>(p))];
  std::vector<int64_t> pstart(static_cast<size_t>(E)), ustart(static_cast<size_t>(E));
  MaskRef r;
  r.counts.assign(static_cast<size_t>(one_bin ? 4 : 4 * E), 0);
  int64_t u = 0, p = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t padded = (n[e] + alignment - 1) / alignment * alignment;
    ustart[e] = u;
    pstart[e] = p;
    if (!one_bin)
      r.counts[e] = n[e], r.counts[E + e] = u + n[e], r.counts[2 * E + e] = padded, r.counts[3 * E + e] = p + padded;
    u += n[e];
    p += padded;
  }
  if (one_bin) r.counts = {std::min(u, rows), std::min(u, rows), rows, rows};
  r.dest.assign(static_cast<size_t>(T * E), -1);
  r.sources.assign(static_cast<size_t>(sources_len), -1);
  r.indices.assign(static_cast<size_t>(T * E), -1);
  r.bin_ids.assign(static_cast<size_t>(T * E), -1);
  std::vector<int64_t> seen(static_cast<size_t>(E), 0);
  size_t position = 0;  // the kept pairs, in (expert, token) order
  for (const auto& pr : pairs) {
    const int64_t e = std::get<0>(pr), t = std::get<1>(pr);
    const int64_t d = pstart[e] + seen[e]++;
    if (d >= rows) continue;
    r.indices[position] = t * E + e;
    r.bin_ids[position++] = e;
    r.dest[static_cast<size_t>(t * E + e)] = d;
    if (d < sources_len) r.sources[static_cast<size_t>(d)] = t * E + e;
  }
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> rws, exps;
    for (int64_t e = E - 1; e >= 0; --e) {
      const int64_t d = r.dest[static_cast<size_t>(t * E + e)];
      if (d >= 0) rws.push_back(d - (pstart[e] - ustart[e])), exps.push_back(e);
    }
    const int64_t k = static_cast<int64_t>(rws.size());
    rws.resize(static_cast<size_t>(E), -1);
    exps.resize(static_cast<size_t>(E), -1);
    r.row_id_map.insert(r.row_id_map.end(), rws.begin(), rws.end());
    r.row_id_map.insert(r.row_id_map.end(), exps.begin(), exps.end());
    r.row_id_map.push_back(k);
  }
  return r;
}

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
        Case{6, 0, 0.5, 4, false, 1.0}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " align=" + std::to_string(c.alignment) +
                 (c.one_bin ? " one_bin" : "") + " cut=" + std::to_string(c.cut));
    const std::vector<uint8_t> map = random_mask(c.T, c.E, c.density, rng);
    int64_t routed = 0;
    for (uint8_t b : map) routed += b != 0;
    int64_t padded_total = 0;
    {
      const MaskRef full = mask_reference(map, c.T, c.E, c.alignment, INT32_MAX, false, 0);
      padded_total = c.E > 0 ? full.counts[static_cast<size_t>(4 * c.E - 1)] : 0;
    }
    const int64_t rows = static_cast<int64_t>((c.one_bin ? routed : padded_total) * c.cut);
    const int64_t bins = c.one_bin ? 1 : c.E;
    const int64_t sources_len = c.one_bin ? rows : (c.E > 0 ? (rows + c.E - 1) / c.E * c.E : 0);
    const MaskRef want = mask_reference(map, c.T, c.E, c.alignment, rows, c.one_bin, sources_len);
    const Tensor m = byte_matrix(map, c.T, c.E);
    Tensor counts = poison_index(4 * bins), dest = poison_index(c.T * c.E), sources = poison_index(sources_len);
    Tensor rim = filled(DType::kInt32, {c.T, 2 * c.E + 1}, kIndexPoison);
    Tensor indices = poison_index(c.T * c.E), bin_ids = poison_index(c.T * c.E);
    padmoe::mask_plan_out(m, c.alignment, rows, c.one_bin, counts, dest, sources, rim, indices, bin_ids);
    EXPECT_EQ(index_to_vec(counts), want.counts);
    EXPECT_EQ(index_to_vec(dest), want.dest);
    EXPECT_EQ(index_to_vec(sources), want.sources);
    EXPECT_EQ(index_to_vec(rim), want.row_id_map);
    EXPECT_EQ(index_to_vec(indices), want.indices);
    EXPECT_EQ(index_to_vec(bin_ids), want.bin_ids);
    // without the row_id_map and the sorted order: the same plan
    Tensor dest2 = poison_index(c.T * c.E);
    padmoe::mask_plan_out(m, c.alignment, rows, c.one_bin, counts, dest2, sources, padmoe::TensorView{});
    EXPECT_EQ(index_to_vec(dest2), want.dest);
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
  // nothing was written by a call that raised
  EXPECT_TRUE(all_bytes_are(counts, kIndexPoison));
  EXPECT_TRUE(all_bytes_are(rim, kIndexPoison));
  const Tensor huge = Tensor::empty(DType::kUInt8, {1, 1});
  padmoe::TensorView big = huge.view();
  big.shape[0] = int64_t{1} << 20;
  big.shape[1] = int64_t{1} << 12;
  big.strides[0] = big.shape[1];
  EXPECT_TRUE(throws_error([&] { padmoe::mask_plan_out(big, 1, 4, false, counts, dest, sources, rim); },
                           {"mask_plan: routing_map"}, value));
}

}  // namespace
}  // namespace pt
