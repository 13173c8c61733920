// test_index_plan.cpp — index_plan_out (a plan from an index map of unbounded ids,
// TransformerEngine's index map without a number of experts) against ref::index_plan, written from
// its definition (each assignment's position counted pair by pair), and against make_plan where
// the ids are bounded. Ids of every sign and size, cuts, spare rows, empty maps and bad arguments.
#include "test_util.hpp"

namespace pt {
namespace {

// Ids of one of four kinds: small (as routers write), small with -1 (TE's unrouted slots), any
// int32 (negatives sort after every non-negative id), or a few repeated large values.
std::vector<int32_t> random_ids(int64_t n, int kind, Rng& rng) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) {
    switch (kind) {
      case 0: x = static_cast<int32_t>(rng.below(8)); break;
      case 1: x = rng.below(5) == 0 ? -1 : static_cast<int32_t>(rng.below(300)); break;
      case 2: x = static_cast<int32_t>(static_cast<uint32_t>(rng.next())); break;
      default: {
        const int32_t values[] = {INT32_MAX, INT32_MIN, -2, 65536, 1 << 24, 0};
        x = values[rng.below(6)];
      }
    }
  }
  return v;
}

Tensor id_matrix(const std::vector<int32_t>& v, int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty(DType::kInt32, {rows, cols});
  for (size_t i = 0; i < v.size(); ++i) t.data_as<int32_t>()[i] = v[i];
  return t;
}

TEST(IndexPlan, MatchesReference) {
  struct Case {
    int64_t T, K;
    int kind;
    double cut;  // rows as a fraction of T * K (1: all; > 1: spare rows)
  };
  Rng rng(53);
  for (const Case c : {Case{1, 1, 0, 1.0}, Case{37, 2, 0, 1.0}, Case{37, 2, 1, 0.6}, Case{37, 2, 2, 1.5},
                       Case{100, 8, 3, 1.0}, Case{256, 8, 1, 1.0}, Case{256, 8, 2, 0.3}, Case{513, 8, 2, 1.0},
                       Case{700, 6, 1, 1.2}, Case{0, 8, 0, 1.0}, Case{5, 0, 0, 1.0}, Case{3, 4, 0, 0.0}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) + " kind=" + std::to_string(c.kind) +
                 " cut=" + std::to_string(c.cut));
    const int64_t a = c.T * c.K;
    const std::vector<int32_t> ids = random_ids(a, c.kind, rng);
    const int64_t rows = static_cast<int64_t>(a * c.cut);
    const ref::IndexPlan want = ref::index_plan(ids, rows, rows);
    const Tensor m = id_matrix(ids, c.T, c.K);
    Tensor counts = poison_index(4), dest = poison_index(a), sources = poison_index(rows);
    Tensor indices = poison_index(a), bin_ids = poison_index(a);
    padmoe::index_plan_out(m, rows, counts, dest, sources, indices, bin_ids);
    EXPECT_EQ(index_to_vec(counts), want.counts);
    EXPECT_EQ(index_to_vec(dest), want.dest_rows);
    EXPECT_EQ(index_to_vec(sources), want.row_sources);
    EXPECT_EQ(index_to_vec(indices), want.indices);
    EXPECT_EQ(index_to_vec(bin_ids), want.bin_ids);
    // without the sorted order, and a row_sources shorter than rows: the same entries, cut
    const int64_t short_len = rows / 2;
    const ref::IndexPlan cut = ref::index_plan(ids, rows, short_len);
    Tensor dest2 = poison_index(a), sources2 = poison_index(short_len);
    padmoe::index_plan_out(m, rows, counts, dest2, sources2);
    EXPECT_EQ(index_to_vec(dest2), want.dest_rows);
    EXPECT_EQ(index_to_vec(sources2), cut.row_sources);
  }
}

// Ids in [0, E): the order is make_plan's at alignment 1 (its sorted positions are the rows).
TEST(IndexPlan, BoundedIdsAreMakePlansOrder) {
  Rng rng(7);
  const int64_t T = 300, K = 4;
  const int E = 16;
  std::vector<int64_t> ids64(static_cast<size_t>(T * K));
  std::vector<int32_t> ids(ids64.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(ids64[i] = rng.below(E));
  const padmoe::Plan plan = padmoe::make_plan(index_matrix(ids64, T, K, DType::kInt32), E, 1);
  Tensor counts = poison_index(4), dest = poison_index(T * K), sources = poison_index(T * K);
  padmoe::index_plan_out(id_matrix(ids, T, K), T * K, counts, dest, sources);
  EXPECT_EQ(index_to_vec(dest), index_to_vec(plan.dest_rows));
  EXPECT_EQ(index_to_vec(sources), index_to_vec(plan.row_sources));
}

TEST(IndexPlan, BadArguments) {
  const Tensor m = id_matrix({1, 0, -1, 3, 2, 2}, 3, 2);
  Tensor counts = poison_index(4), dest = poison_index(6), sources = poison_index(6);
  const int value = static_cast<int>(padmoe::ErrorKind::kValue), type = static_cast<int>(padmoe::ErrorKind::kType);
  EXPECT_TRUE(throws_error([&] { padmoe::index_plan_out(m, -1, counts, dest, sources); },
                           {"index_plan: rows: must be >= 0, got -1"}, value));
  const Tensor wide = index_matrix({1, 0, 0, 1, 1, 1}, 3, 2, DType::kInt64);
  EXPECT_TRUE(throws_error([&] { padmoe::index_plan_out(wide, 6, counts, dest, sources); },
                           {"index_plan: top_experts: expected int32"}, type));
  const Tensor flat = poison_index(6);
  EXPECT_TRUE(throws_error([&] { padmoe::index_plan_out(flat, 6, counts, dest, sources); },
                           {"index_plan: top_experts: expected a 2-D"}, value));
  Tensor short_dest = poison_index(5), short_counts = poison_index(3);
  EXPECT_TRUE(throws_error([&] { padmoe::index_plan_out(m, 6, counts, short_dest, sources); },
                           {"index_plan: dest_rows"}, value));
  EXPECT_TRUE(
      throws_error([&] { padmoe::index_plan_out(m, 6, short_counts, dest, sources); }, {"index_plan: counts"}, value));
  EXPECT_TRUE(
      throws_error([&] { padmoe::index_plan_out(m, 6, counts, dest, dest); }, {"index_plan: ", "shares memory with"}));
  Tensor short_indices = poison_index(5), bin_ids = poison_index(6);
  EXPECT_TRUE(throws_error([&] { padmoe::index_plan_out(m, 6, counts, dest, sources, short_indices, bin_ids); },
                           {"index_plan: indices"}, value));
  // nothing was written by a call that raised
  EXPECT_TRUE(all_bytes_are(counts, kIndexPoison));
  EXPECT_TRUE(all_bytes_are(dest, kIndexPoison));
  EXPECT_TRUE(all_bytes_are(sources, kIndexPoison));
  // 2^32 entries: past int32, refused on its shape before any is read (no memory behind it)
  const padmoe::TensorView big =
      padmoe::TensorView::contiguous(nullptr, DType::kInt32, {int64_t{1} << 20, int64_t{1} << 12});
  EXPECT_TRUE(
      throws_error([&] { padmoe::index_plan_out(big, 4, counts, dest, sources); }, {"index_plan: top_experts"}, value));
  EXPECT_TRUE(throws_error([&] { padmoe::index_plan_out(m, int64_t{1} << 31, counts, dest, sources); },
                           {"index_plan: rows"}, value));
}

}  // namespace
}  // namespace pt
