// fuzz_plan.cpp — a bounded-time fuzzer of the plans: make_plan's routing options (expert map,
// local range, invalid ids, capacity, drop policy, dropped count), its layouts,
// moe_align_block_size, mask_plan (row_id_map, one_bin, moved probabilities) and index_plan, as a
// hostile caller would call them: random sizes and options, some valid and some not, output
// buffers exact, larger or one entry short, output views whose scalar fields hold anything.
//
// Every valid call must equal the reference (src/reference, written from the contract) bit for bit,
// layouts included; every invalid call must throw padmoe::Error and leave every output untouched.
// Run under AddressSanitizer + UBSan by CI's sanitizer job (ctest fuzz_plan_options).
//
// Usage: padmoe_fuzz_plan [--seconds S] [--seed N] [--iterations N]
//   stops at the first of S seconds (default 20) or N iterations; exit 0 when every case passed,
//   1 with the failing case printed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "padmoe/error.hpp"
#include "padmoe/numeric.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"
#include "reference/reference.hpp"
#include "rng.hpp"

namespace {

using padmoe::DType;
using padmoe::Tensor;
using padmoe::TensorView;
namespace ref = padmoe::ref;

constexpr unsigned char kPoisonByte = 0x5A;  // every byte of an output before the call

// A chance in percent, and one of a list, from the tests' seeded RNG.
bool chance(pt::Rng& rng, int percent) { return rng.below(100) < percent; }
template <class T>
T pick(pt::Rng& rng, std::initializer_list<T> v) {
  return *(v.begin() + rng.below(static_cast<int64_t>(v.size())));
}

std::string describe_ids(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size() && i < 64; ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + (v.size() > 64 ? ",...]" : "]");
}

// The bytes of a tensor (none for an unset one), to compare moved probabilities bit for bit.
std::vector<unsigned char> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const unsigned char*>(t.view().data);
  const size_t n = static_cast<size_t>(t.view().numel()) * padmoe::element_size(t.view().dtype);
  return p == nullptr ? std::vector<unsigned char>() : std::vector<unsigned char>(p, p + n);
}

// An output buffer of `dtype` and `shape` with every byte the poison.
Tensor poisoned_as(DType dtype, std::initializer_list<int64_t> shape) {
  Tensor t = Tensor::empty(dtype, shape);
  std::memset(t.view().data, kPoisonByte, static_cast<size_t>(t.view().numel()) * padmoe::element_size(dtype));
  return t;
}

// An int32 output buffer filled with the poison.
Tensor poisoned(int64_t n) { return poisoned_as(DType::kInt32, {n}); }

std::vector<int64_t> read(const Tensor& t) {
  const int32_t* p = t.data_as<const int32_t>();
  return std::vector<int64_t>(p, p + t.view().numel());
}

// Every byte still the poison (an unset tensor: nothing to check).
bool untouched(const Tensor& t) {
  for (unsigned char b : bytes_of(t)) {
    if (b != kPoisonByte) return false;
  }
  return true;
}

Tensor index_tensor(const std::vector<int64_t>& v, DType dtype, std::initializer_list<int64_t> shape) {
  Tensor t = Tensor::empty(dtype, shape);
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kInt64) t.data_as<int64_t>()[i] = v[i];
    else t.data_as<int32_t>()[i] = static_cast<int32_t>(v[i]);
  }
  return t;
}

struct Failure {
  std::string what;
};

[[noreturn]] void fail(const std::string& what) { throw Failure{what}; }

void expect_equal(const std::vector<int64_t>& got, const std::vector<int64_t>& want, const char* name) {
  if (got.size() != want.size())
    fail(std::string(name) + ": size " + std::to_string(got.size()) + " vs " + std::to_string(want.size()));
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      fail(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(got[i]) + ", want " +
           std::to_string(want[i]));
    }
  }
}

// The expected layouts of a reference plan over R rows at alignment m.
std::vector<int64_t> want_row_experts(const ref::Plan& p, int64_t R) {
  std::vector<int64_t> rows(static_cast<size_t>(R), -1);
  int64_t e = 0;
  for (int64_t row = 0; row < std::min(R, p.padded_rows); ++row) {
    while (p.padded_bins[e] <= row) ++e;
    if (p.row_sources[row] >= 0) rows[row] = e;
  }
  return rows;
}

std::vector<int64_t> want_block_experts(const ref::Plan& p, int64_t blocks, int m, int64_t past_end) {
  std::vector<int64_t> out(static_cast<size_t>(blocks), past_end);
  for (int64_t b = 0; b < blocks && b * m < p.padded_rows; ++b) {
    int64_t e = 0;
    while (p.padded_bins[e] <= b * m) ++e;
    out[b] = e;
  }
  return out;
}

struct Stats {
  int64_t valid = 0, invalid = 0;
};

// One make_plan_out (or allocating make_plan) call with random options.
void plan_case(pt::Rng& rng, Stats& st, std::string& log) {
  const bool big = chance(rng, 2);  // sometimes several CPU workers
  const int64_t T = big ? 8192 + rng.below(8192) : rng.below(chance(rng, 20) ? 2000 : 40);
  const int K = static_cast<int>(1 + rng.below(big ? 4 : 8));
  const int E = static_cast<int>(1 + rng.below(chance(rng, 10) ? 300 : 12));
  const int m = pick<int>(rng, {1, 1, 2, 3, 4, 8, 16, 128});
  const int64_t A = T * K;
  const int extra = static_cast<int>(rng.below(3) == 0 ? 0 : rng.below(20));
  const int G = chance(rng, 20) ? 0 : E + extra;  // 0: E
  const int64_t Gv = G == 0 ? E : G;
  ref::RoutingOptions r;
  padmoe::PlanOptions po;
  bool valid = true;
  r.global_experts = G;
  po.global_experts = G;
  if (chance(rng, 3)) {
    po.global_experts = -1 - static_cast<int>(rng.below(3));
    valid = false;
  }
  // local experts: a map, a range, or the identity
  std::vector<int64_t> map;
  const int how = static_cast<int>(rng.below(3));
  DType map_dtype = chance(rng, 50) ? DType::kInt32 : DType::kInt64;
  if (how == 0) {
    map.assign(static_cast<size_t>(Gv), -1);
    for (int e = 0; e < E; ++e) {
      if (chance(rng, 85)) map[rng.below(Gv)] = e;
    }
    if (chance(rng, 5)) {
      map[rng.below(Gv)] = pick<int64_t>(rng, {int64_t{E}, -2, int64_t{E} + 7, int64_t{1} << 33});
      valid = false;
      if (map_dtype == DType::kInt32) map_dtype = DType::kInt64;  // the value must survive the dtype
    }
    r.expert_map = map;
    if (chance(rng, 3)) {
      po.first_expert = 1;
      valid = false;
    }
  } else if (how == 1) {
    const int64_t first = rng.below(Gv - E + 1);
    r.first_expert = static_cast<int>(first);
    po.first_expert = static_cast<int>(first);
    if (chance(rng, 4)) {
      po.first_expert = chance(rng, 50) ? -1 : static_cast<int>(Gv - E + 1);
      valid = false;
    }
  }
  // ids: valid, or some outside [0, G) (dropped with drop_invalid)
  r.drop_invalid = po.drop_invalid = chance(rng, 25);
  std::vector<int64_t> ids(static_cast<size_t>(A));
  const bool stray = chance(rng, 10);
  for (auto& id : ids) id = stray && chance(rng, 5) ? pick<int64_t>(rng, {-1, Gv, Gv + 3, -100}) : rng.below(Gv);
  bool any_stray = false;
  for (int64_t id : ids) any_stray |= id < 0 || id >= Gv;
  if (any_stray && !r.drop_invalid) valid = false;
  // capacity and drop policy
  std::vector<float> probs;
  bool with_probs = false;
  if (chance(rng, 45)) {
    int64_t C = m * rng.below(chance(rng, 10) ? 3 : 12);
    if (chance(rng, 4) && m > 1) C += 1;  // alignment must divide it
    if (chance(rng, 2)) C = -2 - rng.below(5);
    if (C < -1 || (C >= 0 && C % m != 0)) valid = false;
    r.expert_capacity = po.expert_capacity = C;
    if (chance(rng, 40)) {
      r.by_probs = with_probs = true;
      po.drop_policy = padmoe::DropPolicy::kProbs;
      probs.resize(static_cast<size_t>(A));
      for (auto& p : probs)
        p = chance(rng, 30) ? static_cast<float>(rng.below(4)) / 4.0f
                            : static_cast<float>(rng.below(1 << 20)) / (1 << 20);
      r.probs = probs;
    }
  } else if (chance(rng, 3)) {
    po.drop_policy = padmoe::DropPolicy::kProbs;  // no capacity: an error
    valid = false;
    with_probs = true;
    probs.assign(static_cast<size_t>(A), 0.5f);
  }
  Tensor probs_t, map_t, dropped = poisoned(1);
  if (with_probs) {
    probs_t = Tensor::empty(DType::kFloat32, {A});
    std::copy(probs.begin(), probs.end(), probs_t.data_as<float>());
    po.probs = probs_t;
  }
  if (!map.empty()) {
    std::vector<int64_t> m2 = map;
    if (chance(rng, 3)) {  // a short map
      m2.pop_back();
      valid = false;
    }
    map_t = index_tensor(m2, map_dtype, {static_cast<int64_t>(m2.size())});
    po.expert_map = map_t;
  }
  const bool want_dropped = chance(rng, 50);
  if (want_dropped) po.dropped = dropped;
  const DType id_dtype = chance(rng, 50) ? DType::kInt32 : DType::kInt64;
  const Tensor top = index_tensor(ids, id_dtype, {T, K});

  log = "make_plan T=" + std::to_string(T) + " K=" + std::to_string(K) + " E=" + std::to_string(E) +
        " m=" + std::to_string(m) + " G=" + std::to_string(po.global_experts) +
        " first=" + std::to_string(po.first_expert) + " map=" + (map.empty() ? "none" : describe_ids(map)) +
        " drop_invalid=" + std::to_string(po.drop_invalid) + " C=" + std::to_string(po.expert_capacity) +
        " probs=" + std::to_string(with_probs) + " ids=" + describe_ids(ids);

  ref::RoutedPlan want;
  if (valid) want = ref::make_plan(ids, T, K, E, m, r);
  const bool capped = po.expert_capacity >= 0;
  // the rows row_sources needs: E * C, or P (CPU)
  const int64_t need = valid ? (capped ? want.plan.capacity : want.plan.padded_rows) : A + int64_t{E} * (m - 1);
  if (chance(rng, 25)) {  // the allocating form
    try {
      const padmoe::Plan got = padmoe::make_plan(top, E, m, po);
      if (!valid) fail("an invalid call returned a plan");
      expect_equal(read(got.indices), want.plan.indices, "indices");
      expect_equal(read(got.bin_ids), want.plan.bin_ids, "bin_ids");
      expect_equal(read(got.tokens_per_expert), want.plan.tokens_per_expert, "tokens_per_expert");
      expect_equal(read(got.bins), want.plan.bins, "bins");
      expect_equal(read(got.padded_tokens_per_expert), want.plan.padded_tokens_per_expert, "padded_tokens_per_expert");
      expect_equal(read(got.padded_bins), want.plan.padded_bins, "padded_bins");
      expect_equal(read(got.dest_rows), want.plan.dest_rows, "dest_rows");
      expect_equal(read(got.row_sources), want.plan.row_sources, "row_sources");
      if (want_dropped) expect_equal(read(dropped), {want.dropped}, "dropped");
    } catch (const padmoe::Error& e) {
      if (valid) fail(std::string("a valid call threw: ") + e.what());
      if (!untouched(dropped)) fail("an invalid call wrote dropped");
    }
    (valid ? st.valid : st.invalid) += 1;
    return;
  }
  int64_t R = need + (chance(rng, 50) ? 0 : rng.below(2 * m + 3));
  bool short_rows = false;
  if (need > 0 && chance(rng, 4)) {
    R = need - 1;
    short_rows = true;
  }
  Tensor indices = poisoned(A), bin_ids = poisoned(A), dest = poisoned(A), rows = poisoned(R);
  Tensor tpe = poisoned(E), bins = poisoned(E), ptpe = poisoned(E), pbins = poisoned(E);
  padmoe::PlanView out;
  out.indices = indices;
  out.bin_ids = bin_ids;
  out.tokens_per_expert = tpe;
  out.bins = bins;
  out.padded_tokens_per_expert = ptpe;
  out.padded_bins = pbins;
  out.dest_rows = dest;
  out.row_sources = rows;
  // the view's scalar fields are the caller's: make_plan_out never reads them
  out.num_tokens = pick<int64_t>(rng, {0, T, T + 1000, -7, int64_t{1} << 40});
  out.top_k = pick<int>(rng, {0, 1, K, 64, -1});
  out.num_experts = pick<int>(rng, {0, E, 4 * E + 30, 1 << 20, -3});
  out.alignment = pick<int>(rng, {0, 1, m, 1 << 30});
  padmoe::PlanLayouts layouts;
  const int64_t blocks = (R + m - 1) / m;
  Tensor row_experts = poisoned(R), block_experts = poisoned(blocks), total = poisoned(1);
  const bool with_rows = chance(rng, 50), with_blocks = chance(rng, 50), with_total = chance(rng, 50);
  if (with_rows) layouts.row_experts = row_experts;
  if (with_blocks) layouts.block_experts = block_experts;
  if (with_total) layouts.padded_total = total;
  padmoe::Options opt;
  opt.num_threads = static_cast<int>(rng.below(4));
  const bool expect_ok = valid && !short_rows;
  try {
    padmoe::make_plan_out(top, E, m, out, layouts, po, opt);
    if (!expect_ok) fail(short_rows ? "a short row_sources was accepted" : "an invalid call returned");
    ref::Plan p = want.plan;
    p.row_sources.resize(static_cast<size_t>(R), -1);
    expect_equal(read(indices), p.indices, "indices");
    expect_equal(read(bin_ids), p.bin_ids, "bin_ids");
    expect_equal(read(tpe), p.tokens_per_expert, "tokens_per_expert");
    expect_equal(read(bins), p.bins, "bins");
    expect_equal(read(ptpe), p.padded_tokens_per_expert, "padded_tokens_per_expert");
    expect_equal(read(pbins), p.padded_bins, "padded_bins");
    expect_equal(read(dest), p.dest_rows, "dest_rows");
    expect_equal(read(rows), p.row_sources, "row_sources");
    if (want_dropped) expect_equal(read(dropped), {want.dropped}, "dropped");
    if (with_rows) expect_equal(read(row_experts), want_row_experts(p, R), "row_experts");
    if (with_blocks) expect_equal(read(block_experts), want_block_experts(p, blocks, m, -1), "block_experts");
    if (with_total) expect_equal(read(total), {p.padded_rows}, "padded_total");
  } catch (const padmoe::Error& e) {
    if (expect_ok) fail(std::string("a valid call threw: ") + e.what());
    const Tensor* all[] = {&indices, &bin_ids, &dest,        &rows,          &tpe,   &bins,
                           &ptpe,    &pbins,   &row_experts, &block_experts, &total, &dropped};
    for (const Tensor* t : all) {
      if (!untouched(*t)) fail(std::string("an invalid call wrote an output before failing: ") + e.what());
    }
  }
  (expect_ok ? st.valid : st.invalid) += 1;
}

// One moe_align_block_size call (vLLM's contract), with and without expert_map.
void align_case(pt::Rng& rng, Stats& st, std::string& log) {
  const int64_t T = rng.below(chance(rng, 20) ? 600 : 30);
  const int K = static_cast<int>(1 + rng.below(8));
  const int E = static_cast<int>(1 + rng.below(chance(rng, 10) ? 300 : 16));
  const int bs = pick<int>(rng, {1, 2, 3, 16, 64, 128});
  const int64_t A = T * K;
  bool valid = true;
  std::vector<int64_t> ids(static_cast<size_t>(A));
  // ids outside [0, E) are skipped, as vLLM's kernel does: never an error
  for (auto& id : ids) id = chance(rng, 3) ? pick<int64_t>(rng, {-2, -1, int64_t{E}, int64_t{E} + 7}) : rng.below(E);
  std::vector<int64_t> map;
  if (chance(rng, 40)) {
    map.assign(static_cast<size_t>(E), -1);
    for (int e = 0; e < E; ++e) {
      if (chance(rng, 60)) map[e] = rng.below(E);
    }
    if (chance(rng, 5)) {
      map[rng.below(E)] = pick<int64_t>(rng, {int64_t{E}, -2});
      valid = false;
    }
  }
  const bool pad = chance(rng, 50);
  log = "moe_align_block_size T=" + std::to_string(T) + " K=" + std::to_string(K) + " E=" + std::to_string(E) +
        " bs=" + std::to_string(bs) + " pad=" + std::to_string(pad) +
        " map=" + (map.empty() ? "none" : describe_ids(map)) + " ids=" + describe_ids(ids);
  const Tensor top = index_tensor(ids, chance(rng, 50) ? DType::kInt32 : DType::kInt64, {T, K});
  Tensor map_t;
  if (!map.empty()) map_t = index_tensor(map, DType::kInt64, {E});
  const TensorView map_v = map.empty() ? TensorView{} : map_t.view();
  const int64_t R = padmoe::aligned_rows_bound(A, E, bs, pad);
  Tensor sorted = poisoned(R), experts = poisoned((R + bs - 1) / bs), total = poisoned(1);
  try {
    padmoe::moe_align_block_size_out(top, bs, E, map_v, sorted, experts, total);
    if (!valid) fail("an invalid call returned");
    const ref::AlignedBlocks want = ref::moe_align_block_size(ids, bs, E, pad, map.empty() ? nullptr : &map);
    expect_equal(read(sorted), want.sorted_token_ids, "sorted_token_ids");
    expect_equal(read(experts), want.expert_ids, "expert_ids");
    expect_equal(read(total), {want.num_tokens_post_padded}, "num_tokens_post_padded");
  } catch (const padmoe::Error& e) {
    if (valid) fail(std::string("a valid call threw: ") + e.what());
    if (!untouched(sorted) || !untouched(experts) || !untouched(total)) {
      fail(std::string("an invalid call wrote an output before failing: ") + e.what());
    }
  }
  (valid ? st.valid : st.invalid) += 1;
}

// The optional sorted-order pair and row_id_map: a request or not, sometimes malformed.
struct SortedOutputs {
  Tensor indices, bin_ids;
  bool asked = false, valid = true;
};
SortedOutputs sorted_outputs(pt::Rng& rng, int64_t A) {
  SortedOutputs o;
  if (chance(rng, 50)) return o;
  o.asked = true;
  o.indices = poisoned(A);
  o.bin_ids = poisoned(A);
  if (chance(rng, 4)) {  // one of the pair short, or only one of the pair
    if (chance(rng, 50)) o.indices = poisoned(A + (A > 0 && chance(rng, 50) ? -1 : 1));
    else o.bin_ids = Tensor();
    o.valid = false;
  }
  return o;
}

// One mask_plan_out call (TransformerEngine's mask map): a random uint8 mask, alignment, cut,
// one_bin, row_id_map, sorted order and moved probabilities, some arguments malformed.
void mask_case(pt::Rng& rng, Stats& st, std::string& log) {
  const bool big = chance(rng, 2);  // past 2^17 pairs: several CPU workers
  const int64_t T = big ? 2048 + rng.below(2048) : rng.below(chance(rng, 20) ? 400 : 30);
  const int64_t E = big ? 64 + rng.below(64) : rng.below(chance(rng, 10) ? 300 : 12);
  int m = pick<int>(rng, {1, 1, 1, 2, 3, 4, 8, 16, 128});
  bool valid = true;
  const bool one_bin = chance(rng, 30) && (m == 1 || chance(rng, 10));
  if (one_bin && m != 1) valid = false;
  if (chance(rng, 2)) {
    m = pick<int>(rng, {0, -1, -128});
    valid = false;
  }
  const int density = static_cast<int>(rng.below(101));
  std::vector<uint8_t> map(static_cast<size_t>(T * E));
  for (auto& b : map) b = chance(rng, density) ? static_cast<uint8_t>(1 + rng.below(255)) : 0;
  const int64_t A = T * E;
  // the rows: the padded total (the routed count with one_bin), cut or with spares
  int64_t full = 0;
  if (valid) {
    const ref::MaskPlan all = ref::mask_plan(map, T, E, m, INT32_MAX, one_bin, 0);
    full = one_bin ? all.counts[0] : (all.counts.empty() ? 0 : all.counts.back());  // routed, or padded total
  }
  int64_t rows = chance(rng, 50) ? full : rng.below(full + 2 * m + 3);
  if (chance(rng, 2)) {
    rows = -1 - rng.below(3);
    valid = false;
  }
  const int64_t S = chance(rng, 50) ? std::max<int64_t>(rows, 0) : rng.below(full + 20);
  const int64_t n_counts = one_bin ? 4 : 4 * E;
  Tensor counts = poisoned(n_counts), dest = poisoned(A), sources = poisoned(S);
  if (chance(rng, 3)) {
    if (chance(rng, 50) && n_counts > 0) counts = poisoned(n_counts - 1);
    else dest = poisoned(A + 1);
    valid = false;
  }
  Tensor rim;
  if (chance(rng, 50)) {
    rim = poisoned_as(DType::kInt32, {T, 2 * E + 1});
    if (chance(rng, 3)) {
      rim = poisoned_as(DType::kInt32, {T, 2 * E});
      valid = false;
    }
  }
  SortedOutputs so = sorted_outputs(rng, A);
  valid = valid && so.valid;
  const bool with_probs = chance(rng, 35);
  const DType pdt = pick<DType>(rng, {DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  Tensor probs, moved, nonzero;
  if (with_probs) {
    probs = Tensor::empty(pdt, {T, E});
    auto* pb = static_cast<unsigned char*>(probs.view().data);
    const size_t w = padmoe::element_size(pdt);
    for (size_t i = 0; i < static_cast<size_t>(T * E); ++i) {  // any bits; a quarter +0 or -0
      const bool zero = chance(rng, 4);
      for (size_t b = 0; b < w; ++b) pb[i * w + b] = zero ? 0 : static_cast<unsigned char>(rng.below(256));
      if (zero && chance(rng, 2)) pb[i * w + w - 1] = 0x80;
    }
    moved = poisoned_as(pdt, {S});
    if (chance(rng, 2)) {
      nonzero = poisoned_as(DType::kFloat32, {A});
      if (chance(rng, 8)) {
        nonzero = poisoned_as(DType::kFloat32, {A + 1});
        valid = false;
      }
    }
    if (chance(rng, 4)) {
      moved = chance(rng, 50) ? poisoned_as(pdt, {S + 1})
                              : poisoned_as(pdt == DType::kFloat32 ? DType::kBFloat16 : DType::kFloat32, {S});
      valid = false;
    } else if (chance(rng, 2)) {
      moved = Tensor();  // probs without moved_probs
      valid = false;
    }
  }
  const bool int_map = chance(rng, 2);
  Tensor mt = Tensor::empty(int_map ? DType::kInt32 : DType::kUInt8, {T, E});
  if (int_map) {
    for (size_t i = 0; i < map.size(); ++i) mt.data_as<int32_t>()[i] = map[i];
    valid = false;
  } else if (!map.empty()) {
    std::memcpy(mt.view().data, map.data(), map.size());
  }
  padmoe::Options opt;
  opt.num_threads = static_cast<int>(rng.below(4));
  log = "mask_plan T=" + std::to_string(T) + " E=" + std::to_string(E) + " m=" + std::to_string(m) +
        " rows=" + std::to_string(rows) + " S=" + std::to_string(S) + " one_bin=" + std::to_string(one_bin) +
        " density=" + std::to_string(density) + " row_id_map=" + std::to_string(rim.view().data != nullptr) +
        " sorted=" + std::to_string(so.asked) + " probs=" + (with_probs ? padmoe::dtype_name(pdt) : "none") +
        " threads=" + std::to_string(opt.num_threads);
  const padmoe::TensorView none{};
  try {
    padmoe::mask_plan_out(mt, m, rows, one_bin, counts, dest, sources, rim.view().data ? rim.view() : none,
                          so.indices.view().data ? so.indices.view() : none,
                          so.bin_ids.view().data ? so.bin_ids.view() : none, probs.view().data ? probs.view() : none,
                          moved.view().data ? moved.view() : none, nonzero.view().data ? nonzero.view() : none, opt);
    if (!valid) fail("an invalid call returned");
    const ref::MaskPlan want = ref::mask_plan(map, T, E, m, rows, one_bin, S);
    expect_equal(read(counts), want.counts, "counts");
    expect_equal(read(dest), want.dest_rows, "dest_rows");
    expect_equal(read(sources), want.row_sources, "row_sources");
    if (rim.view().data) expect_equal(read(rim), want.row_id_map, "row_id_map");
    if (so.asked) {
      expect_equal(read(so.indices), want.indices, "indices");
      expect_equal(read(so.bin_ids), want.bin_ids, "bin_ids");
    }
    if (with_probs) {
      const std::vector<unsigned char> got = bytes_of(moved), src = bytes_of(probs);
      const size_t w = padmoe::element_size(pdt);
      for (int64_t r = 0; r < S; ++r) {
        const int64_t a = want.row_sources[static_cast<size_t>(r)];
        for (size_t b = 0; b < w; ++b) {
          const unsigned char expect = a >= 0 ? src[static_cast<size_t>(a) * w + b] : 0;
          if (got[static_cast<size_t>(r) * w + b] != expect) fail("moved_probs[" + std::to_string(r) + "]");
        }
      }
    }
    if (nonzero.view().data) {  // 1 where the pair has a row and its prob is not 0 as a number
      for (int64_t a = 0; a < A; ++a) {
        const float p = padmoe::numeric::load_as_float(probs.view().data, pdt, a);
        const bool live = want.dest_rows[static_cast<size_t>(a)] >= 0 && !(p == 0.0f);
        if (nonzero.data_as<float>()[a] != (live ? 1.0f : 0.0f)) fail("probs_nonzero[" + std::to_string(a) + "]");
      }
    }
  } catch (const padmoe::Error& e) {
    if (valid) fail(std::string("a valid call threw: ") + e.what());
    const Tensor* all[] = {&counts, &dest, &sources, &rim, &so.indices, &so.bin_ids, &moved, &nonzero};
    for (const Tensor* t : all) {
      if (!untouched(*t)) fail(std::string("an invalid call wrote an output before failing: ") + e.what());
    }
  }
  (valid ? st.valid : st.invalid) += 1;
}

// One index_plan_out call (TransformerEngine's index map without a number of experts): ids of any
// int32 value, a cut or spare rows, the sorted order or not, some arguments malformed.
void index_case(pt::Rng& rng, Stats& st, std::string& log) {
  const bool big = chance(rng, 3);  // past one block's sort on CUDA; the CPU's stable sort alike
  const int64_t T = big ? 600 + rng.below(2000) : rng.below(chance(rng, 20) ? 300 : 20);
  const int64_t K = rng.below(9);
  const int64_t A = T * K;
  const int kind = static_cast<int>(rng.below(4));
  std::vector<int32_t> ids(static_cast<size_t>(A));
  for (auto& x : ids) {
    switch (kind) {
      case 0: x = static_cast<int32_t>(rng.below(8)); break;
      case 1: x = chance(rng, 20) ? -1 : static_cast<int32_t>(rng.below(300)); break;
      case 2: x = static_cast<int32_t>(static_cast<uint32_t>(rng.below(int64_t{1} << 32))); break;
      default: x = pick<int32_t>(rng, {INT32_MAX, INT32_MIN, -2, 65536, 1 << 24, 0});
    }
  }
  bool valid = true;
  int64_t rows = chance(rng, 50) ? A : rng.below(A + 10);
  if (chance(rng, 2)) {
    rows = pick<int64_t>(rng, {-1, -5, int64_t{1} << 31});
    valid = false;
  }
  const int64_t S = chance(rng, 50) ? std::max<int64_t>(std::min<int64_t>(rows, A + 10), 0) : rng.below(A + 10);
  Tensor counts = poisoned(4), dest = poisoned(A), sources = poisoned(S);
  if (chance(rng, 3)) {
    if (chance(rng, 50)) counts = poisoned(3);
    else dest = poisoned(A + 1);
    valid = false;
  }
  SortedOutputs so = sorted_outputs(rng, A);
  valid = valid && so.valid;
  const bool wide = chance(rng, 2);  // int64 ids: refused
  Tensor top = index_tensor(std::vector<int64_t>(ids.begin(), ids.end()), wide ? DType::kInt64 : DType::kInt32, {T, K});
  if (wide) valid = false;
  log = "index_plan T=" + std::to_string(T) + " K=" + std::to_string(K) + " kind=" + std::to_string(kind) +
        " rows=" + std::to_string(rows) + " S=" + std::to_string(S) + " sorted=" + std::to_string(so.asked) +
        " ids=" + describe_ids(std::vector<int64_t>(ids.begin(), ids.end()));
  const padmoe::TensorView none{};
  try {
    padmoe::index_plan_out(top, rows, counts, dest, sources, so.indices.view().data ? so.indices.view() : none,
                           so.bin_ids.view().data ? so.bin_ids.view() : none);
    if (!valid) fail("an invalid call returned");
    const ref::IndexPlan want = ref::index_plan(ids, rows, S);
    expect_equal(read(counts), want.counts, "counts");
    expect_equal(read(dest), want.dest_rows, "dest_rows");
    expect_equal(read(sources), want.row_sources, "row_sources");
    if (so.asked) {
      expect_equal(read(so.indices), want.indices, "indices");
      expect_equal(read(so.bin_ids), want.bin_ids, "bin_ids");
    }
  } catch (const padmoe::Error& e) {
    if (valid) fail(std::string("a valid call threw: ") + e.what());
    const Tensor* all[] = {&counts, &dest, &sources, &so.indices, &so.bin_ids};
    for (const Tensor* t : all) {
      if (!untouched(*t)) fail(std::string("an invalid call wrote an output before failing: ") + e.what());
    }
  }
  (valid ? st.valid : st.invalid) += 1;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 20;
  uint64_t seed = 1;
  int64_t iterations = std::numeric_limits<int64_t>::max();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--seconds") seconds = std::atof(argv[i + 1]);
    else if (a == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--iterations") iterations = std::atoll(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--seconds S] [--seed N] [--iterations N]\n", argv[0]);
      return 2;
    }
  }
  const auto start = std::chrono::steady_clock::now();
  Stats st;
  int64_t it = 0;
  for (; it < iterations; ++it) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= seconds) break;
    pt::Rng rng(seed + static_cast<uint64_t>(it) * 7919);
    std::string log;
    try {
      const int64_t which = rng.below(100);
      if (which < 50) plan_case(rng, st, log);
      else if (which < 65) align_case(rng, st, log);
      else if (which < 85) mask_case(rng, st, log);
      else index_case(rng, st, log);
    } catch (const Failure& f) {
      std::fprintf(stderr, "fuzz_plan: FAILED at iteration %lld (seed %llu): %s\n  case: %s\n",
                   static_cast<long long>(it), static_cast<unsigned long long>(seed), f.what.c_str(), log.c_str());
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fuzz_plan: FAILED at iteration %lld (seed %llu): a non-padmoe exception: %s\n  case: %s\n",
                   static_cast<long long>(it), static_cast<unsigned long long>(seed), e.what(), log.c_str());
      return 1;
    }
  }
  std::printf("fuzz_plan: %lld cases, %lld valid checked against the reference, %lld invalid rejected untouched\n",
              static_cast<long long>(it), static_cast<long long>(st.valid), static_cast<long long>(st.invalid));
  return 0;
}
