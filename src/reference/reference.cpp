// reference.cpp — the reference loops of reference.hpp, written straight from
// docs/spec.md §3-§7. Deliberately naive and single-threaded; it shares no
// code with the backends (no index-math header) so that a mistake in the
// shared index math cannot hide in both places.
#include "reference/reference.hpp"

#include <algorithm>
#include <map>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

namespace padmoe {
namespace ref {

namespace {

int64_t round_up_multiple(int64_t x, int64_t m) {
  // Smallest multiple of m >= x, written differently from index_math on purpose.
  const int64_t r = x % m;
  return r == 0 ? x : x + (m - r);
}

// A move with a weight: the product is formed in double and rounded once to float.
// A weighted row's element: the product rounded once, a zero product +0.0 (docs/spec.md).
float weighted(float v, float w) { return static_cast<float>(static_cast<double>(v) * static_cast<double>(w)) + 0.0f; }

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("padmoe::ref: " + what);
}

}  // namespace

Plan make_plan(const std::vector<int64_t>& top_experts, int64_t num_tokens, int top_k, int num_experts, int alignment) {
  require(top_k >= 1, "top_k must be >= 1");
  require(alignment >= 1, "alignment must be >= 1");
  require(num_experts >= 0, "num_experts must be >= 0");
  require(num_tokens >= 0, "num_tokens must be >= 0");
  const int64_t A = num_tokens * top_k;
  require(static_cast<int64_t>(top_experts.size()) == A, "top_experts must hold T*K entries");
  for (int64_t a = 0; a < A; ++a)
    require(top_experts[a] >= 0 && top_experts[a] < num_experts,
            "expert id out of range at position " + std::to_string(a));

  Plan p;
  p.num_tokens = num_tokens;
  p.top_k = top_k;
  p.num_experts = num_experts;
  p.alignment = alignment;
  const int64_t E = num_experts;

  // Stable sort of assignment ids by expert.
  p.indices.resize(A);
  std::iota(p.indices.begin(), p.indices.end(), int64_t{0});
  std::stable_sort(p.indices.begin(), p.indices.end(),
                   [&](int64_t l, int64_t r) { return top_experts[l] < top_experts[r]; });
  p.bin_ids.resize(A);
  for (int64_t i = 0; i < A; ++i) p.bin_ids[i] = top_experts[p.indices[i]];

  p.tokens_per_expert.assign(E, 0);
  for (int64_t a = 0; a < A; ++a) ++p.tokens_per_expert[top_experts[a]];
  p.bins.assign(E, 0);
  p.padded_tokens_per_expert.assign(E, 0);
  p.padded_bins.assign(E, 0);
  int64_t run = 0, prun = 0;
  for (int64_t e = 0; e < E; ++e) {
    run += p.tokens_per_expert[e];
    p.bins[e] = run;
    p.padded_tokens_per_expert[e] = round_up_multiple(p.tokens_per_expert[e], alignment);
    prun += p.padded_tokens_per_expert[e];
    p.padded_bins[e] = prun;
  }
  p.padded_rows = E == 0 ? 0 : p.padded_bins[E - 1];
  p.capacity = A + E * (static_cast<int64_t>(alignment) - 1);

  // Sorted position i of expert e -> padded_start(e) + i - real_start(e).
  p.dest_rows.assign(A, -1);
  p.row_sources.assign(static_cast<size_t>(p.capacity), -1);
  for (int64_t i = 0; i < A; ++i) {
    const int64_t e = p.bin_ids[i];
    const int64_t real_start = e == 0 ? 0 : p.bins[e - 1];
    const int64_t padded_start = e == 0 ? 0 : p.padded_bins[e - 1];
    const int64_t row = padded_start + (i - real_start);
    const int64_t a = p.indices[i];
    p.dest_rows[a] = row;
    p.row_sources[row] = a;
  }
  return p;
}

RoutedPlan make_plan(const std::vector<int64_t>& top_experts, int64_t num_tokens, int top_k, int num_experts,
                     int alignment, const RoutingOptions& o) {
  const int64_t A = num_tokens * top_k, E = num_experts;
  const int64_t G = o.global_experts == 0 ? E : o.global_experts;
  require(static_cast<int64_t>(top_experts.size()) == A, "top_experts must hold T*K entries");
  require(o.expert_map.empty() || static_cast<int64_t>(o.expert_map.size()) == G, "expert_map must hold G entries");
  require(!o.by_probs || static_cast<int64_t>(o.probs.size()) == A, "probs must hold A entries");
  require(o.expert_capacity < 0 || o.expert_capacity % alignment == 0, "alignment must divide the capacity");
  // Each local expert's assignments in ascending id order.
  std::vector<std::vector<int64_t>> lists(static_cast<size_t>(E));
  for (int64_t a = 0; a < A; ++a) {
    const int64_t id = top_experts[a];
    if (id < 0 || id >= G) {
      require(o.drop_invalid, "expert id out of range at position " + std::to_string(a));
      continue;
    }
    int64_t local = -1;
    if (!o.expert_map.empty()) local = o.expert_map[id];
    else if (id >= o.first_expert && id < o.first_expert + E) local = id - o.first_expert;
    if (local >= 0) lists[local].push_back(a);
  }
  RoutedPlan out;
  if (o.expert_capacity >= 0) {
    for (auto& list : lists) {
      const int64_t n = static_cast<int64_t>(list.size());
      if (n <= o.expert_capacity) continue;
      out.dropped += n - o.expert_capacity;
      if (o.by_probs) {
        std::vector<int64_t> best = list;
        std::stable_sort(best.begin(), best.end(),
                         [&](int64_t l, int64_t r) { return o.probs[l] > o.probs[r]; });  // ties keep id order
        best.resize(o.expert_capacity);
        std::sort(best.begin(), best.end());
        list = best;
      } else {
        list.resize(o.expert_capacity);
      }
    }
  }
  Plan& p = out.plan;
  p.num_tokens = num_tokens;
  p.top_k = top_k;
  p.num_experts = num_experts;
  p.alignment = alignment;
  p.indices.assign(A, -1);
  p.bin_ids.assign(A, -1);
  p.dest_rows.assign(A, -1);
  p.tokens_per_expert.assign(E, 0);
  p.bins.assign(E, 0);
  p.padded_tokens_per_expert.assign(E, 0);
  p.padded_bins.assign(E, 0);
  p.capacity = o.expert_capacity >= 0 ? E * o.expert_capacity : A + E * (static_cast<int64_t>(alignment) - 1);
  p.row_sources.assign(static_cast<size_t>(p.capacity), -1);
  int64_t pos = 0, row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(lists[e].size());
    for (int64_t j = 0; j < n; ++j) {
      const int64_t a = lists[e][j];
      p.indices[pos + j] = a;
      p.bin_ids[pos + j] = e;
      p.dest_rows[a] = row + j;
      p.row_sources[row + j] = a;
    }
    pos += n;
    row += o.expert_capacity >= 0 ? o.expert_capacity : round_up_multiple(n, alignment);
    p.tokens_per_expert[e] = n;
    p.bins[e] = pos;
    p.padded_tokens_per_expert[e] = row - (e == 0 ? 0 : p.padded_bins[e - 1]);
    p.padded_bins[e] = row;
  }
  p.padded_rows = row;
  return out;
}

std::vector<float> padded_gather(const std::vector<float>& x, int64_t hidden, const Plan& plan,
                                 const std::vector<float>* weights) {
  const int64_t H = hidden, K = plan.top_k, A = plan.num_tokens * K;
  require(static_cast<int64_t>(x.size()) >= plan.num_tokens * H, "x too small");
  require(weights == nullptr || static_cast<int64_t>(weights->size()) >= A, "weights too small");
  std::vector<float> y(static_cast<size_t>(plan.padded_rows * H), 0.0f);
  for (int64_t r = 0; r < plan.padded_rows; ++r) {
    const int64_t a = plan.row_sources[r];
    if (a < 0) continue;  // padding row: zero
    const int64_t t = a / K;
    for (int64_t h = 0; h < H; ++h) {
      const float v = x[t * H + h];
      y[r * H + h] = weights ? weighted(v, (*weights)[a]) : v;
    }
  }
  return y;
}

std::vector<double> padded_scatter(const std::vector<float>& y, int64_t hidden, const Plan& plan,
                                   const std::vector<float>* weights) {
  const int64_t H = hidden, K = plan.top_k, T = plan.num_tokens;
  require(static_cast<int64_t>(y.size()) >= plan.padded_rows * H, "y too small");
  require(weights == nullptr || static_cast<int64_t>(weights->size()) >= T * K, "weights too small");
  std::vector<double> out(static_cast<size_t>(T * H), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t a = t * K + k;
      const int64_t row = plan.dest_rows[a];
      if (row < 0) continue;  // a dropped assignment contributes zero
      const double w = weights ? static_cast<double>((*weights)[a]) : 1.0;
      for (int64_t h = 0; h < H; ++h) out[t * H + h] += w * static_cast<double>(y[row * H + h]);
    }
  }
  return out;
}

std::vector<double> padded_scatter_wgrad(const std::vector<float>& y, const std::vector<float>& grad, int64_t hidden,
                                         const Plan& plan) {
  const int64_t H = hidden, K = plan.top_k, A = plan.num_tokens * K;
  require(static_cast<int64_t>(y.size()) >= plan.padded_rows * H, "y too small");
  require(static_cast<int64_t>(grad.size()) >= plan.num_tokens * H, "grad too small");
  std::vector<double> wgrad(static_cast<size_t>(A), 0.0);
  for (int64_t a = 0; a < A; ++a) {
    const int64_t row = plan.dest_rows[a];
    if (row < 0) continue;  // dropped: zero
    const int64_t t = a / K;
    double s = 0.0;
    for (int64_t h = 0; h < H; ++h) s += static_cast<double>(y[row * H + h]) * static_cast<double>(grad[t * H + h]);
    wgrad[a] = s;
  }
  return wgrad;
}

PadResult pad_to_alignment(const std::vector<float>& h, int64_t hidden, const std::vector<int64_t>& tokens_per_expert,
                           int alignment) {
  require(alignment >= 1, "alignment must be >= 1");
  const int64_t H = hidden;
  const int64_t E = static_cast<int64_t>(tokens_per_expert.size());
  PadResult r;
  r.inclusive_offsets.assign(E, 0);
  int64_t total = 0, ptotal = 0;
  for (int64_t e = 0; e < E; ++e) {
    require(tokens_per_expert[e] >= 0, "negative count");
    total += tokens_per_expert[e];
    ptotal += round_up_multiple(tokens_per_expert[e], alignment);
    r.inclusive_offsets[e] = ptotal;
  }
  require(static_cast<int64_t>(h.size()) >= total * H, "h holds fewer rows than sum(tokens_per_expert)");
  r.padded_rows = ptotal;
  r.padded.assign(static_cast<size_t>(ptotal * H), 0.0f);
  r.permutation_map.assign(static_cast<size_t>(ptotal), -1);
  int64_t excl = 0, pexcl = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = tokens_per_expert[e];
    for (int64_t j = 0; j < c; ++j) {
      const int64_t src = excl + j, dst = pexcl + j;
      r.permutation_map[dst] = src;
      for (int64_t x = 0; x < H; ++x) r.padded[dst * H + x] = h[src * H + x];
    }
    excl += c;
    pexcl += round_up_multiple(c, alignment);
  }
  return r;
}

std::vector<float> unpad_from_alignment(const std::vector<float>& padded, int64_t hidden,
                                        const std::vector<int64_t>& permutation_map, int64_t original_size,
                                        const std::vector<float>* probs) {
  const int64_t H = hidden;
  const int64_t P = static_cast<int64_t>(permutation_map.size());
  require(static_cast<int64_t>(padded.size()) >= P * H, "padded too small");
  require(probs == nullptr || static_cast<int64_t>(probs->size()) >= original_size, "probs too small");
  std::vector<float> out(static_cast<size_t>(original_size * H), 0.0f);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t n = permutation_map[p];
    if (n < 0) continue;
    require(n < original_size, "permutation_map entry out of range");
    for (int64_t x = 0; x < H; ++x) {
      const float v = padded[p * H + x];
      out[n * H + x] = probs ? weighted(v, (*probs)[n]) : v;
    }
  }
  return out;
}

PadResult sort_chunks(const std::vector<float>& received, int64_t hidden, const std::vector<int64_t>& split_sizes,
                      int num_ranks, int alignment, const std::vector<int64_t>* sorted_index) {
  require(num_ranks >= 1, "num_ranks must be >= 1");
  require(alignment >= 1, "alignment must be >= 1");
  const int64_t H = hidden, C = static_cast<int64_t>(split_sizes.size()), R = num_ranks;
  require(C % R == 0, "split_sizes must hold num_ranks * E entries");
  const int64_t E = C / R;
  // First row of every source chunk in the received buffer.
  std::vector<int64_t> first(static_cast<size_t>(C), 0);
  int64_t total = 0;
  for (int64_t c = 0; c < C; ++c) {
    require(split_sizes[c] >= 0, "negative split size");
    first[c] = total;
    total += split_sizes[c];
  }
  require(static_cast<int64_t>(received.size()) >= total * H, "received holds fewer rows than sum(split_sizes)");
  // The chunk at each output position.
  std::vector<int64_t> chunk_at(static_cast<size_t>(C));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < R; ++r) chunk_at[e * R + r] = r * E + e;
  if (sorted_index != nullptr) {
    require(static_cast<int64_t>(sorted_index->size()) == C, "sorted_index must hold C entries");
    std::vector<int> uses(static_cast<size_t>(C), 0);
    for (int64_t j = 0; j < C; ++j) {
      const int64_t s = (*sorted_index)[j];
      require(s >= 0 && s < C && uses[s]++ == 0, "sorted_index must be a permutation");
      chunk_at[j] = s;
    }
  }
  PadResult out;
  out.inclusive_offsets.assign(static_cast<size_t>(E), 0);
  std::vector<float> rows;
  int64_t p = 0;
  for (int64_t g = 0; g < E; ++g) {
    const int64_t start = p;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t c = chunk_at[g * R + r];
      for (int64_t i = 0; i < split_sizes[c]; ++i, ++p) {
        out.permutation_map.push_back(first[c] + i);
        for (int64_t x = 0; x < H; ++x) rows.push_back(received[(first[c] + i) * H + x]);
      }
    }
    const int64_t end = start + round_up_multiple(p - start, alignment);
    for (; p < end; ++p) {
      out.permutation_map.push_back(-1);
      for (int64_t x = 0; x < H; ++x) rows.push_back(0.0f);
    }
    out.inclusive_offsets[g] = p;
  }
  out.padded_rows = p;
  out.padded = std::move(rows);
  return out;
}

UnpadGrads unpad_from_alignment_backward(const std::vector<float>& grad_out, const std::vector<float>& padded,
                                         int64_t hidden, const std::vector<int64_t>& permutation_map,
                                         const std::vector<float>* probs) {
  const int64_t H = hidden;
  const int64_t P = static_cast<int64_t>(permutation_map.size());
  const int64_t N =
      H > 0 ? static_cast<int64_t>(grad_out.size()) / H : (probs ? static_cast<int64_t>(probs->size()) : 0);
  UnpadGrads g;
  g.grad_padded.assign(static_cast<size_t>(P * H), 0.0f);
  if (probs) g.grad_probs.assign(static_cast<size_t>(probs->size()), 0.0);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t n = permutation_map[p];
    if (n < 0) continue;
    require(H == 0 || n < N, "permutation_map entry out of range");
    double s = 0.0;
    for (int64_t x = 0; x < H; ++x) {
      const float go = grad_out[n * H + x];
      g.grad_padded[p * H + x] = probs ? weighted(go, (*probs)[n]) : go;
      s += static_cast<double>(go) * static_cast<double>(padded[p * H + x]);
    }
    if (probs) g.grad_probs[n] = s;
  }
  return g;
}

namespace {

// Per expert: the assignments routed to it in ascending id order.
std::vector<std::vector<int64_t>> by_expert(const std::vector<int64_t>& top_experts, int num_experts) {
  std::vector<std::vector<int64_t>> lists(static_cast<size_t>(num_experts));
  for (size_t a = 0; a < top_experts.size(); ++a)
    lists[static_cast<size_t>(top_experts[a])].push_back(static_cast<int64_t>(a));
  return lists;
}

int64_t up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

}  // namespace

std::vector<int64_t> row_experts(const std::vector<int64_t>& top_experts, int num_experts, int alignment,
                                 int64_t rows) {
  std::vector<int64_t> out(static_cast<size_t>(rows), -1);
  int64_t start = 0;
  const auto lists = by_expert(top_experts, num_experts);
  for (int e = 0; e < num_experts; ++e) {
    const int64_t n = static_cast<int64_t>(lists[static_cast<size_t>(e)].size());
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(start + i)] = e;
    start += up(n, alignment);
  }
  return out;
}

std::vector<int64_t> block_experts(const std::vector<int64_t>& top_experts, int num_experts, int alignment,
                                   int64_t rows) {
  std::vector<int64_t> out(static_cast<size_t>((rows + alignment - 1) / alignment), -1);
  const auto lists = by_expert(top_experts, num_experts);
  int64_t start = 0;
  for (int e = 0; e < num_experts; ++e) {
    const int64_t end = start + up(static_cast<int64_t>(lists[static_cast<size_t>(e)].size()), alignment);
    for (int64_t b = start / alignment; b < end / alignment; ++b) out[static_cast<size_t>(b)] = e;
    start = end;
  }
  return out;
}

AlignedBlocks moe_align_block_size(const std::vector<int64_t>& top_experts, int block_size, int num_experts,
                                   bool pad_sorted_ids, const std::vector<int64_t>* expert_map) {
  const int64_t a = static_cast<int64_t>(top_experts.size());
  int64_t size = a + std::min<int64_t>(a, num_experts) * (block_size - 1);
  if (pad_sorted_ids) size = up(size, block_size);
  // vLLM's kernel: each assignment counted under its expert (its local id with a map; -1: none;
  // an id outside [0, E): none), experts in id order, each run padded to whole blocks; every other
  // entry the sentinel A, every block past the runs -1.
  std::vector<std::vector<int64_t>> lists(static_cast<size_t>(num_experts));
  for (int64_t i = 0; i < a; ++i) {
    int64_t e = top_experts[static_cast<size_t>(i)];
    if (e < 0 || e >= num_experts) continue;
    if (expert_map != nullptr) e = (*expert_map)[static_cast<size_t>(e)];
    if (e < 0) continue;
    require(e < num_experts, "expert_map entry out of range");
    lists[static_cast<size_t>(e)].push_back(i);
  }
  AlignedBlocks r;
  r.sorted_token_ids.assign(static_cast<size_t>(size), a);
  r.expert_ids.assign(static_cast<size_t>((size + block_size - 1) / block_size), -1);
  int64_t start = 0;
  for (int e = 0; e < num_experts; ++e) {
    const auto& l = lists[static_cast<size_t>(e)];
    for (size_t i = 0; i < l.size(); ++i) r.sorted_token_ids[static_cast<size_t>(start) + i] = l[i];
    const int64_t end = start + up(static_cast<int64_t>(l.size()), block_size);
    for (int64_t b = start / block_size; b < end / block_size; ++b) r.expert_ids[static_cast<size_t>(b)] = e;
    start = end;
  }
  r.num_tokens_post_padded = start;
  return r;
}

AlignedBlocks batched_moe_align_block_size(const std::vector<int64_t>& counts, int64_t max_tokens, int block_size) {
  const int64_t experts = static_cast<int64_t>(counts.size());
  const int64_t size = up(max_tokens, block_size) * experts;
  AlignedBlocks r;
  r.sorted_token_ids.assign(static_cast<size_t>(size), experts * max_tokens);
  r.expert_ids.assign(static_cast<size_t>(size / block_size), -1);
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = counts[static_cast<size_t>(e)];
    require(n >= 0 && n <= max_tokens, "count outside [0, max_tokens]");
    for (int64_t j = 0; j < n; ++j) r.sorted_token_ids[static_cast<size_t>(start + j)] = e * max_tokens + j;
    const int64_t end = start + up(n, block_size);
    for (int64_t b = start / block_size; b < end / block_size; ++b) r.expert_ids[static_cast<size_t>(b)] = e;
    start = end;
  }
  r.num_tokens_post_padded = start;
  return r;
}

MaskPlan mask_plan(const std::vector<uint8_t>& map, int64_t tokens, int64_t experts, int alignment, int64_t rows,
                   bool one_bin, int64_t sources_len) {
  require(static_cast<int64_t>(map.size()) == tokens * experts, "map must hold T * E entries");
  std::vector<std::pair<int64_t, int64_t>> pairs;  // (e, t) of every routed pair
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t e = 0; e < experts; ++e)
      if (map[static_cast<size_t>(t * experts + e)] != 0) pairs.emplace_back(e, t);
  std::sort(pairs.begin(), pairs.end());
  std::vector<int64_t> n(static_cast<size_t>(experts), 0), pstart(n), ustart(n), seen(n);
  for (const auto& p : pairs) ++n[static_cast<size_t>(p.first)];
  MaskPlan r;
  r.counts.assign(static_cast<size_t>(one_bin ? 4 : 4 * experts), 0);
  int64_t u = 0, pad = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const size_t i = static_cast<size_t>(e);
    const int64_t padded = up(n[i], alignment);
    ustart[i] = u;
    pstart[i] = pad;
    if (!one_bin) {
      r.counts[i] = n[i];
      r.counts[static_cast<size_t>(experts + e)] = u + n[i];
      r.counts[static_cast<size_t>(2 * experts + e)] = padded;
      r.counts[static_cast<size_t>(3 * experts + e)] = pad + padded;
    }
    u += n[i];
    pad += padded;
  }
  if (one_bin) r.counts = {std::min(u, rows), std::min(u, rows), rows, rows};
  r.dest_rows.assign(static_cast<size_t>(tokens * experts), -1);
  r.row_sources.assign(static_cast<size_t>(sources_len), -1);
  r.indices.assign(static_cast<size_t>(tokens * experts), -1);
  r.bin_ids.assign(static_cast<size_t>(tokens * experts), -1);
  size_t position = 0;  // the kept pairs, in (expert, token) order
  for (const auto& p : pairs) {
    const int64_t e = p.first, t = p.second;
    const int64_t d = pstart[static_cast<size_t>(e)] + seen[static_cast<size_t>(e)]++;
    if (d >= rows) continue;
    r.indices[position] = t * experts + e;
    r.bin_ids[position++] = e;
    r.dest_rows[static_cast<size_t>(t * experts + e)] = d;
    if (d < sources_len) r.row_sources[static_cast<size_t>(d)] = t * experts + e;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int64_t> kept_rows, kept_experts;
    for (int64_t e = experts - 1; e >= 0; --e) {
      const int64_t d = r.dest_rows[static_cast<size_t>(t * experts + e)];
      if (d < 0) continue;
      kept_rows.push_back(d - (pstart[static_cast<size_t>(e)] - ustart[static_cast<size_t>(e)]));
      kept_experts.push_back(e);
    }
    const int64_t k = static_cast<int64_t>(kept_rows.size());
    kept_rows.resize(static_cast<size_t>(experts), -1);
    kept_experts.resize(static_cast<size_t>(experts), -1);
    r.row_id_map.insert(r.row_id_map.end(), kept_rows.begin(), kept_rows.end());
    r.row_id_map.insert(r.row_id_map.end(), kept_experts.begin(), kept_experts.end());
    r.row_id_map.push_back(k);
  }
  return r;
}

IndexPlan index_plan(const std::vector<int32_t>& ids, int64_t rows, int64_t sources_len) {
  const int64_t a_count = static_cast<int64_t>(ids.size());
  const int64_t kept = std::min(a_count, rows);
  std::map<uint32_t, int64_t> start;  // each distinct key's count, then its first position
  for (int32_t id : ids) ++start[static_cast<uint32_t>(id)];
  int64_t run = 0;
  for (auto& kv : start) {
    const int64_t n = kv.second;
    kv.second = run;
    run += n;
  }
  IndexPlan r;
  r.counts = {kept, kept, rows, rows};
  r.dest_rows.assign(static_cast<size_t>(a_count), -1);
  r.row_sources.assign(static_cast<size_t>(sources_len), -1);
  r.indices.assign(static_cast<size_t>(a_count), -1);
  r.bin_ids.assign(static_cast<size_t>(a_count), -1);
  for (int64_t a = 0; a < a_count; ++a) {  // in assignment order: equal keys keep it
    const int64_t position = start[static_cast<uint32_t>(ids[static_cast<size_t>(a)])]++;
    if (position >= rows) continue;
    r.dest_rows[static_cast<size_t>(a)] = position;
    r.indices[static_cast<size_t>(position)] = a;
    r.bin_ids[static_cast<size_t>(position)] = 0;
    if (position < sources_len) r.row_sources[static_cast<size_t>(position)] = a;
  }
  return r;
}

std::vector<uint8_t> move_scale_rows(const std::vector<uint8_t>& src, int64_t row_bytes,
                                     const std::vector<int64_t>& sources, const std::vector<uint8_t>& one) {
  require(static_cast<int64_t>(one.size()) == row_bytes, "one must hold one scale row");
  const int64_t rows = static_cast<int64_t>(sources.size());
  std::vector<uint8_t> out(static_cast<size_t>(rows * row_bytes));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t from = sources[static_cast<size_t>(r)];
    for (int64_t b = 0; b < row_bytes; ++b) {
      uint8_t v = one[static_cast<size_t>(b)];
      if (from >= 0) {
        require((from + 1) * row_bytes <= static_cast<int64_t>(src.size()), "scale source row out of range");
        v = src[static_cast<size_t>(from * row_bytes + b)];
      }
      out[static_cast<size_t>(r * row_bytes + b)] = v;
    }
  }
  return out;
}

std::vector<uint8_t> scale_one_row(bool e8m0, int64_t cols) {
  if (e8m0) return std::vector<uint8_t>(static_cast<size_t>(cols), uint8_t{127});  // 2^(127-127)
  std::vector<uint8_t> row;
  const float one = 1.0f;
  unsigned char bytes[sizeof(float)];
  std::memcpy(bytes, &one, sizeof(float));
  for (int64_t c = 0; c < cols; ++c) row.insert(row.end(), bytes, bytes + sizeof(float));
  return row;
}

std::vector<int64_t> spread_sources(const Plan& plan) {
  std::vector<int64_t> out(static_cast<size_t>(plan.padded_rows), -1);
  for (int64_t r = 0; r < plan.padded_rows; ++r) {
    const int64_t a = plan.row_sources[static_cast<size_t>(r)];
    if (a >= 0) out[static_cast<size_t>(r)] = a / plan.top_k;
  }
  return out;
}

std::vector<int64_t> unpad_sources(const std::vector<int64_t>& permutation_map, int64_t original_size) {
  std::vector<int64_t> out(static_cast<size_t>(original_size), -1);
  for (size_t p = 0; p < permutation_map.size(); ++p) {
    const int64_t n = permutation_map[p];
    if (n < 0) continue;
    require(n < original_size && out[static_cast<size_t>(n)] < 0, "permutation_map entry out of range or repeated");
    out[static_cast<size_t>(n)] = static_cast<int64_t>(p);
  }
  return out;
}

// --- quantizers (dispatch_quantized) -------------------------------------------

namespace {

int fp8_man_bits(bool e5m2) { return e5m2 ? 2 : 3; }
int fp8_bias(bool e5m2) { return e5m2 ? 15 : 7; }
uint8_t fp8_max_code(bool e5m2) { return e5m2 ? 0x7b : 0x7e; }

// Magnitude of the non-negative code c (no sign bit), in double, from the
// format's definition: subnormal man * 2^(1 - bias - man_bits), normal
// (1 + man / 2^man_bits) * 2^(exp - bias).
double code_magnitude(int c, bool e5m2) {
  const int mb = fp8_man_bits(e5m2), bias = fp8_bias(e5m2);
  const int exp = c >> mb, man = c & ((1 << mb) - 1);
  if (exp == 0) return std::ldexp(static_cast<double>(man), 1 - bias - mb);
  return std::ldexp(1.0 + static_cast<double>(man) / static_cast<double>(1 << mb), exp - bias);
}

}  // namespace

float fp8_value(uint8_t code, bool e5m2) {
  const int c = code & 0x7f;
  const bool neg = (code & 0x80) != 0;
  if (c > fp8_max_code(e5m2)) {
    if (e5m2 && c == 0x7c) return neg ? -INFINITY : INFINITY;
    return NAN;
  }
  const float v = static_cast<float>(code_magnitude(c, e5m2));
  return neg ? -v : v;
}

uint8_t fp8_saturate(float v, bool e5m2) {
  if (std::isnan(v)) return 0x7f;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(v));
  const int top = fp8_max_code(e5m2);
  if (a >= code_magnitude(top, e5m2)) return static_cast<uint8_t>(sign | top);  // saturate (infinities too)
  // The codes bracketing a: lo <= a < hi; the midpoint of two fp8 values is exact in double.
  int lo = 0;
  while (code_magnitude(lo + 1, e5m2) <= a) ++lo;
  const int hi = lo + 1;
  const double mid = 0.5 * (code_magnitude(lo, e5m2) + code_magnitude(hi, e5m2));
  int c;
  if (a < mid) c = lo;
  else if (a > mid) c = hi;
  else c = (lo % 2 == 0) ? lo : hi;  // a tie: the even code (even mantissa)
  return static_cast<uint8_t>(sign | c);
}

QuantRows quantize_rows(const std::vector<float>& x, int64_t rows, int64_t hidden, QuantLayout layout, bool e5m2) {
  require(static_cast<int64_t>(x.size()) == rows * hidden, "x must hold rows * hidden values");
  const int64_t block = layout == QuantLayout::kMxE8M0 ? 32 : layout == QuantLayout::kBlock128 ? 128 : hidden;
  QuantRows q;
  q.cols = layout == QuantLayout::kPerRow ? 1 : (hidden + block - 1) / block;
  const bool mx = layout == QuantLayout::kMxE8M0;
  q.row_bytes = q.cols * (mx ? 1 : 4);
  q.rows.assign(static_cast<size_t>(rows * hidden), 0);
  q.scales.assign(static_cast<size_t>(rows * q.row_bytes), 0);
  const float fp8_max = e5m2 ? 57344.0f : 448.0f;
  const int emax_elem = e5m2 ? 15 : 8;  // OCP MX v1.0: exponent of the element format's largest normal
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < q.cols; ++b) {
      const int64_t c0 = b * block, c1 = std::min(hidden, c0 + block);
      const float* v = x.data() + r * hidden;
      float amax = 0.0f;
      bool finite = true;
      for (int64_t c = c0; c < c1; ++c) {
        if (!std::isfinite(v[c])) finite = false;
        else amax = std::max(amax, std::fabs(v[c]));
      }
      float divisor = 1.0f;
      unsigned char* srow = q.scales.data() + r * q.row_bytes;
      if (mx) {
        uint8_t byte = 0xff;  // E8M0 NaN for a block with a NaN or infinity
        if (finite) {
          int x_exp = 0;  // amax == 0: X = 0 (scale byte 127)
          if (amax > 0.0f) {
            int e = 0;
            std::frexp(amax, &e);  // amax = f * 2^e, f in [0.5, 1): floor(log2(amax)) = e - 1
            x_exp = std::min(127, std::max(-127, (e - 1) - emax_elem));
          }
          byte = static_cast<uint8_t>(x_exp + 127);
          divisor = std::ldexp(1.0f, x_exp);
        }
        srow[b] = byte;
      } else {
        float scale;
        if (finite) {
          scale = amax / fp8_max;          // float32 division (an empty per-row block: amax 0)
          if (scale == 0.0f) scale = 1.0f;  // amax == 0 (or an underflowing float32 amax)
        } else {
          const uint32_t nan_bits = 0x7fc00000u;  // the canonical quiet NaN
          std::memcpy(&scale, &nan_bits, 4);
        }
        std::memcpy(srow + b * 4, &scale, 4);
        divisor = scale;
      }
      for (int64_t c = c0; c < c1; ++c) {
        q.rows[static_cast<size_t>(r * hidden + c)] = finite ? fp8_saturate(v[c] / divisor, e5m2) : uint8_t{0x7f};
      }
    }
  }
  return q;
}

QuantRows dispatch_quantized(const std::vector<float>& x, int64_t hidden, const Plan& plan, QuantLayout layout,
                             bool e5m2) {
  const QuantRows tok = quantize_rows(x, plan.num_tokens, hidden, layout, e5m2);
  const std::vector<int64_t> sources = spread_sources(plan);
  QuantRows out;
  out.cols = tok.cols;
  out.row_bytes = tok.row_bytes;
  out.rows = move_scale_rows(tok.rows, hidden, sources, std::vector<uint8_t>(static_cast<size_t>(hidden), 0));
  out.scales =
      move_scale_rows(tok.scales, tok.row_bytes, sources, scale_one_row(layout == QuantLayout::kMxE8M0, tok.cols));
  return out;
}

}  // namespace ref
}  // namespace padmoe
