// digest.cpp — every padmoe op on several workloads, on the CPU and CUDA backends, through the
// public API only (include/padmoe/*.hpp), so that the same source builds against two trees. One
// line per (device, workload, op, output): a 64-bit FNV-1a hash of the output's bytes. With
// --dump DIR, every float output of a dot product (grad_weights, wgrad, grad_probs) is also
// written to DIR/<device>.<workload>.<op>.<output>.bin for a max-abs-diff comparison.
//
//   digest [--device cpu|cuda|both] [--small] [--dump DIR] [--only WORKLOAD]
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "padmoe/numeric.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"

using namespace padmoe;

namespace {

struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

struct Workload {
  std::string name;
  int64_t T;
  int E, K;
  int64_t H;
  int m;
  DType dt;
  bool large;  // skipped with --small
};

size_t nbytes(const TensorView& v) { return static_cast<size_t>(v.numel()) * element_size(v.dtype); }

Tensor on(const Tensor& host, Device d) {
  if (d.is_cpu()) return host;
  Tensor t = Tensor::empty(host.dtype(), host.ndim(), host.view().shape, d);
  copy(host, t);
  return t;
}
Tensor to_host(const TensorView& v) {
  Tensor t = Tensor::empty(v.dtype, v.ndim, v.shape, Device::cpu());
  if (v.numel() > 0) copy(v, t);
  return t;
}
Tensor filled(DType dt, std::initializer_list<int64_t> shape, Device d, int byte) {
  Tensor h = Tensor::empty(dt, shape, Device::cpu());
  std::memset(h.data(), byte, nbytes(h));
  return on(h, d);
}

uint64_t fnv(const void* p, size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= b[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

struct Printer {
  std::string dev, wl, dump;
  void out(const std::string& op, const std::string& name, const TensorView& v) {
    if (v.data == nullptr && v.numel() != 0) {
      std::printf("%s %s %s %s undefined\n", dev.c_str(), wl.c_str(), op.c_str(), name.c_str());
      return;
    }
    const Tensor h = to_host(v);
    std::string shape;
    for (int i = 0; i < h.ndim(); ++i) shape += (i ? "x" : "") + std::to_string(h.size(i));
    std::printf("%s %s %s %s %s %s %016" PRIx64 "\n", dev.c_str(), wl.c_str(), op.c_str(), name.c_str(),
                dtype_name(h.dtype()), shape.c_str(), fnv(h.data(), nbytes(h)));
    const bool dots = name == "grad_weights" || name == "wgrad" || name == "grad_probs";
    if (dots && !dump.empty() && h.numel() > 0) {
      const std::string path = dump + "/" + dev + "." + wl + "." + op + "." + name + ".bin";
      std::vector<float> f(static_cast<size_t>(h.numel()));
      for (int64_t i = 0; i < h.numel(); ++i) f[i] = numeric::load_as_float(h.data(), h.dtype(), i);
      if (FILE* fp = std::fopen(path.c_str(), "wb")) {
        std::fwrite(f.data(), 4, f.size(), fp);
        std::fclose(fp);
      }
    }
  }
  void error(const std::string& op, const std::string& what) {
    std::string w = what;
    for (char& c : w)
      if (c == '\n') c = ' ';
    std::printf("%s %s %s ERROR %s\n", dev.c_str(), wl.c_str(), op.c_str(), w.c_str());
  }
};

Tensor random_rows(Rng& rng, DType dt, int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty(dt, {rows, cols});
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float v = static_cast<float>(rng.uniform() * 4.0 - 2.0);
    numeric::store_from_float(t.data(), dt, i, v);
  }
  return t;
}
Tensor random_fp8(Rng& rng, int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty(DType::kFloat8E4M3, {rows, cols});
  uint8_t* p = t.data_as<uint8_t>();
  for (int64_t i = 0; i < rows * cols; ++i) p[i] = numeric::float_to_fp8e4m3(static_cast<float>(rng.uniform() * 8 - 4));
  return t;
}
Tensor random_weights(Rng& rng, int64_t n) {
  Tensor t = Tensor::empty(DType::kFloat32, {n});
  for (int64_t i = 0; i < n; ++i) t.data_as<float>()[i] = static_cast<float>(rng.uniform());
  return t;
}
// top_k distinct experts a token, skewed toward the low ids.
Tensor routing(Rng& rng, int64_t T, int K, int E) {
  Tensor t = Tensor::empty(DType::kInt32, {T, K});
  int32_t* p = t.data_as<int32_t>();
  for (int64_t i = 0; i < T; ++i) {
    for (int k = 0; k < K; ++k) {
      int32_t e;
      bool again;
      do {
        const double u = rng.uniform();
        e = static_cast<int32_t>(u * u * E);
        if (e >= E) e = E - 1;
        again = false;
        for (int j = 0; j < k; ++j) again = again || p[i * K + j] == e;
      } while (again);
      p[i * K + k] = e;
    }
  }
  return t;
}

void run(const Workload& w, Device dev, Printer& pr) {
  Rng rng{static_cast<uint64_t>(w.T * 131 + w.E * 7 + w.K * 3 + w.H)};
  const int64_t T = w.T, H = w.H, A = T * w.K;
  const int E = w.E, K = w.K, m = w.m;
  const Tensor hte = routing(rng, T, K, E);
  const Tensor hx = random_rows(rng, w.dt, T, H);
  const Tensor hw = random_weights(rng, A);
  const Tensor te = on(hte, dev), x = on(hx, dev), wt = on(hw, dev);
  using W = std::optional<TensorView>;
  auto guard = [&](const std::string& op, const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      pr.error(op, e.what());
    }
  };
  auto plan_out = [&](const std::string& op, const Plan& p) {
    pr.out(op, "indices", p.indices);
    pr.out(op, "bin_ids", p.bin_ids);
    pr.out(op, "tokens_per_expert", p.tokens_per_expert);
    pr.out(op, "bins", p.bins);
    pr.out(op, "padded_tokens_per_expert", p.padded_tokens_per_expert);
    pr.out(op, "padded_bins", p.padded_bins);
    pr.out(op, "dest_rows", p.dest_rows);
    pr.out(op, "row_sources", p.row_sources);
  };

  Plan plan;
  guard("make_plan", [&] {
    plan = make_plan(te, E, m);
    plan_out("make_plan", plan);
  });
  if (!plan.indices.defined()) return;
  const PlanView pv = plan.view();
  const int64_t P = padded_rows(pv);
  const int64_t R = padded_rows_bound(T, K, E, m);

  // unchecked _out plan with layouts, into poisoned buffers
  guard("make_plan_out+layouts", [&] {
    Plan p = Plan::empty(T, K, E, m, dev);
    const Tensor re = filled(DType::kInt32, {R}, dev, 0x5a), be = filled(DType::kInt32, {(R + m - 1) / m}, dev, 0x5a),
                 tot = filled(DType::kInt32, {1}, dev, 0x5a);
    PlanLayouts l;
    l.row_experts = re;
    l.block_experts = be;
    l.padded_total = tot;
    Options o;
    o.check_data = false;
    make_plan_out(te, E, m, p.view(), l, o);
    plan_out("make_plan_out+layouts", p);
    pr.out("make_plan_out+layouts", "row_experts", re);
    pr.out("make_plan_out+layouts", "block_experts", be);
    pr.out("make_plan_out+layouts", "padded_total", tot);
  });
  // routed options: expert parallelism (range and map), invalid ids dropped, capacity by position / probs
  if (E >= 4) {
    guard("make_plan(ep)", [&] {
      PlanOptions po;
      po.global_experts = E;
      po.first_expert = E / 4;
      const Plan p = make_plan(te, E / 2, m, po);
      plan_out("make_plan(ep)", p);
    });
    guard("make_plan(map)", [&] {
      Tensor hm = Tensor::empty(DType::kInt32, {E});
      for (int e = 0; e < E; ++e) hm.data_as<int32_t>()[e] = e % 3 == 0 ? -1 : (e * 7) % (E / 2);
      const Tensor map = on(hm, dev);
      PlanOptions po;
      po.global_experts = E;
      po.expert_map = map;
      const Plan p = make_plan(te, E / 2, m, po);
      plan_out("make_plan(map)", p);
    });
  }
  for (int policy = 0; policy < 2; ++policy) {
    const std::string op = policy == 0 ? "make_plan(capacity)" : "make_plan(capacity,probs)";
    guard(op, [&] {
      PlanOptions po;
      po.expert_capacity = ((A / E) / m + 1) * m;
      po.drop_policy = policy == 0 ? DropPolicy::kPosition : DropPolicy::kProbs;
      if (policy == 1) po.probs = TensorView::contiguous(wt.data(), DType::kFloat32, {T, K}, dev);
      const Tensor dropped = filled(DType::kInt32, {1}, dev, 0);
      po.dropped = dropped;
      const Plan p = make_plan(te, E, m, po);
      plan_out(op, p);
      pr.out(op, "dropped", dropped);
    });
  }
  guard("moe_align_block_size", [&] {
    const AlignedBlocks b = moe_align_block_size(te, m, E);
    pr.out("moe_align_block_size", "sorted_token_ids", b.sorted_token_ids);
    pr.out("moe_align_block_size", "expert_ids", b.expert_ids);
    pr.out("moe_align_block_size", "num_tokens_post_padded", b.num_tokens_post_padded);
  });

  // dispatch / combine and their backwards, weights off and on
  const Tensor hgy = random_rows(rng, w.dt, P, H), gy = on(hgy, dev);
  const Tensor hgo = random_rows(rng, w.dt, T, H), go = on(hgo, dev);
  for (bool weighted : {false, true}) {
    const W wv = weighted ? W(wt.view()) : std::nullopt;
    const std::string s = weighted ? "(w)" : "";
    guard("dispatch" + s, [&] { pr.out("dispatch" + s, "y", dispatch(x, pv, wv)); });
    guard("combine" + s, [&] { pr.out("combine" + s, "out", combine(gy, pv, wv)); });
    guard("combine_backward" + s, [&] {
      const RowGrads g = combine_backward(go, gy, pv, wv);
      pr.out("combine_backward" + s, "grad_rows", g.grad_rows);
      if (weighted) pr.out("combine_backward" + s, "grad_weights", g.grad_weights);
    });
    guard("dispatch_backward" + s, [&] {
      const RowGrads g = dispatch_backward(gy, x, pv, wv);
      pr.out("dispatch_backward" + s, "grad_rows", g.grad_rows);
      if (weighted) pr.out("dispatch_backward" + s, "grad_weights", g.grad_weights);
    });
    guard("padded_gather" + s, [&] {
      pr.out("padded_gather" + s, "y", padded_gather(x, pv.indices, pv.bin_ids, pv.bins, pv.padded_bins, K, wv));
    });
    guard("padded_scatter" + s, [&] {
      pr.out("padded_scatter" + s, "out", padded_scatter(gy, pv.indices, pv.bin_ids, wv, pv.bins, pv.padded_bins, K));
    });
    guard("padded_gather_backward" + s, [&] {
      const RowGrads g = padded_gather_backward(gy, x, pv.indices, pv.bin_ids, pv.bins, pv.padded_bins, K, wv);
      pr.out("padded_gather_backward" + s, "grad_rows", g.grad_rows);
      if (weighted) pr.out("padded_gather_backward" + s, "grad_weights", g.grad_weights);
    });
    guard("padded_scatter_backward" + s, [&] {
      const RowGrads g = padded_scatter_backward(go, gy, pv.indices, pv.bin_ids, wv, pv.bins, pv.padded_bins, K);
      pr.out("padded_scatter_backward" + s, "grad_rows", g.grad_rows);
      if (weighted) pr.out("padded_scatter_backward" + s, "grad_weights", g.grad_weights);
    });
    guard("make_plan_and_dispatch" + s, [&] {
      const PlannedRows r = make_plan_and_dispatch(x, te, E, m, wv);
      pr.out("make_plan_and_dispatch" + s, "y", r.y);
      pr.out("make_plan_and_dispatch" + s, "dest_rows", r.plan.dest_rows);
    });
  }
  guard("padded_scatter_wgrad", [&] {
    pr.out("padded_scatter_wgrad", "wgrad",
           padded_scatter_wgrad(gy, go, pv.indices, pv.bin_ids, pv.bins, pv.padded_bins, K));
  });
  // the unchecked _out forms: capacity-sized outputs, padding left unwritten / rows past P zeroed
  for (int form = 0; form < 3; ++form) {
    const std::string op = form == 0   ? "dispatch_out(unchecked)"
                           : form == 1 ? "dispatch_out(no_zero_padding)"
                                       : "dispatch_out(zero_tail)";
    guard(op, [&] {
      Options o;
      o.check_data = false;
      o.zero_padding = form != 1;
      o.zero_tail = form == 2;
      const Tensor y = filled(w.dt, {R, H}, dev, 0x3c);
      dispatch_out(x, pv, W(wt.view()), y, o);
      pr.out(op, "y", y);
      const Tensor y2 = filled(w.dt, {R, H}, dev, 0x3c);
      padded_gather_out(x, pv.indices, pv.bin_ids, pv.bins, pv.padded_bins, K, std::nullopt, y2, o);
      pr.out(op, "padded_gather_y", y2);
    });
  }
  guard("combine_out(unchecked)", [&] {
    Options o;
    o.check_data = false;
    const Tensor ry = filled(w.dt, {R, H}, dev, 0);
    copy(TensorView::matrix(gy.data(), w.dt, P, H, H, dev), TensorView::matrix(ry.data(), w.dt, P, H, H, dev));
    const Tensor out = filled(w.dt, {T, H}, dev, 0x3c);
    combine_out(ry, pv, W(wt.view()), out, o);
    pr.out("combine_out(unchecked)", "out", out);
    const Tensor gw = filled(DType::kFloat32, {A}, dev, 0x3c), gyo = filled(w.dt, {R, H}, dev, 0x3c);
    combine_backward_out(go, ry, pv, W(wt.view()), gyo, gw, o);
    pr.out("combine_backward_out(unchecked)", "grad_rows", gyo);
    pr.out("combine_backward_out(unchecked)", "grad_weights", gw);
    const Tensor wg = filled(DType::kFloat32, {A}, dev, 0x3c);
    padded_scatter_wgrad_out(ry, go, pv.indices, pv.bin_ids, pv.bins, pv.padded_bins, K, wg, o);
    pr.out("padded_scatter_wgrad_out(unchecked)", "wgrad", wg);
  });

  // pad / unpad: the A dispatched rows grouped by expert
  const Tensor hh = random_rows(rng, w.dt, A, H), hs = on(hh, dev);
  PadResult pad;
  guard("pad_to_alignment", [&] {
    pad = pad_to_alignment(hs, pv.tokens_per_expert, m);
    pr.out("pad_to_alignment", "padded", pad.padded);
    pr.out("pad_to_alignment", "permutation_map", pad.permutation_map);
    pr.out("pad_to_alignment", "inclusive_offsets", pad.inclusive_offsets);
  });
  if (pad.padded.defined()) {
    const Tensor hprobs = random_weights(rng, A), probs = on(hprobs, dev);
    const Tensor hgp = random_rows(rng, w.dt, A, H), gp = on(hgp, dev);
    for (bool with_probs : {false, true}) {
      const W pw = with_probs ? W(probs.view()) : std::nullopt;
      const std::string s = with_probs ? "(probs)" : "";
      guard("unpad_from_alignment" + s, [&] {
        pr.out("unpad_from_alignment" + s, "out", unpad_from_alignment(pad.padded, pad.permutation_map, A, pw));
      });
      guard("unpad_from_alignment_backward" + s, [&] {
        const RowGrads g = unpad_from_alignment_backward(gp, pad.padded, pad.permutation_map, pw);
        pr.out("unpad_from_alignment_backward" + s, "grad_rows", g.grad_rows);
        if (with_probs) pr.out("unpad_from_alignment_backward" + s, "grad_probs", g.grad_weights);
      });
    }
  }

  // sort_chunks: R = 2 ranks, 2E chunks of the A rows, with and without sorted_index
  {
    const int ranks = 2;
    const int64_t C = int64_t{ranks} * E;
    Tensor hsz = Tensor::empty(DType::kInt64, {C});
    int64_t left = A;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t n = c + 1 == C ? left : std::min<int64_t>(left, rng.below(2 * A / C + 1));
      hsz.data_as<int64_t>()[c] = n;
      left -= n;
    }
    Tensor hperm = Tensor::empty(DType::kInt64, {C});
    for (int64_t c = 0; c < C; ++c) hperm.data_as<int64_t>()[c] = (c * 5 + 3) % C;  // a permutation when gcd(5, C) = 1
    bool perm_ok = C % 5 != 0;
    const Tensor sz = on(hsz, dev), perm = on(hperm, dev);
    for (int sorted = 0; sorted < (perm_ok ? 2 : 1); ++sorted) {
      const std::string op = sorted ? "sort_chunks(sorted_index)" : "sort_chunks";
      guard(op, [&] {
        const PadResult r = sort_chunks(hs, sz, ranks, m, sorted ? W(perm.view()) : std::nullopt);
        pr.out(op, "padded", r.padded);
        pr.out(op, "permutation_map", r.permutation_map);
        pr.out(op, "inclusive_offsets", r.inclusive_offsets);
        pr.out(op, "unsort", unsort_chunks(r.padded, r.permutation_map, A));
        Options o;
        o.check_data = false;
        const int64_t cap = sort_chunks_rows_bound(A, C, ranks, m);
        const Tensor p2 = filled(w.dt, {cap, H}, dev, 0x3c), m2 = filled(DType::kInt32, {cap}, dev, 0x3c),
                     off2 = filled(DType::kInt32, {C / ranks}, dev, 0x3c);
        sort_chunks_out(hs, sz, ranks, m, sorted ? W(perm.view()) : std::nullopt, p2, m2, off2, o);
        pr.out(op + "_out(unchecked)", "padded", p2);
        pr.out(op + "_out(unchecked)", "permutation_map", m2);
        pr.out(op + "_out(unchecked)", "inclusive_offsets", off2);
      });
    }
  }

  // quantized and scaled paths
  if (w.dt != DType::kFloat32 || H % 128 == 0 || H < 64) {
    const ScaleLayout layouts[] = {ScaleLayout::kPerRow, ScaleLayout::kBlock128, ScaleLayout::kMxE8M0};
    const char* names[] = {"per_row", "block128", "mxe8m0"};
    for (int l = 0; l < 3; ++l) {
      for (DType q : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
        if (l == 2 && q == DType::kFloat8E5M2) continue;
        const std::string op = std::string("dispatch_quantized(") + names[l] + "," + dtype_name(q) + ")";
        guard(op, [&] {
          const ScaledRows r = dispatch_quantized(x, pv, layouts[l], q);
          pr.out(op, "rows", r.rows);
          pr.out(op, "scales", r.scales);
        });
      }
      const std::string op = std::string("quantize(") + names[l] + ")";
      guard(op, [&] {
        const ScaledRows r = quantize(x, layouts[l]);
        pr.out(op, "rows", r.rows);
        pr.out(op, "scales", r.scales);
      });
    }
    // fp8 rows with 1x128 float32 scales moved by dispatch_scaled / padded_gather_scaled / pad / unpad
    const int64_t sc = scale_columns(ScaleLayout::kBlock128, H);
    const Tensor hq = random_fp8(rng, T, H), q = on(hq, dev);
    const Tensor hqs = random_weights(rng, T * sc);
    const Tensor qs = on(hqs, dev);
    const TensorView qsv = TensorView::contiguous(qs.data(), DType::kFloat32, {T, sc}, dev);
    guard("dispatch_scaled", [&] {
      const ScaledRows r = dispatch_scaled(q, pv, qsv);
      pr.out("dispatch_scaled", "rows", r.rows);
      pr.out("dispatch_scaled", "scales", r.scales);
    });
    guard("padded_gather_scaled", [&] {
      const ScaledRows r = padded_gather_scaled(q, pv.indices, pv.bin_ids, pv.bins, pv.padded_bins, K, qsv);
      pr.out("padded_gather_scaled", "rows", r.rows);
      pr.out("padded_gather_scaled", "scales", r.scales);
    });
    const Tensor hq2 = random_fp8(rng, A, H), q2 = on(hq2, dev);
    const Tensor hqs2 = random_weights(rng, A * sc);
    const Tensor qs2 = on(hqs2, dev);
    const TensorView qs2v = TensorView::contiguous(qs2.data(), DType::kFloat32, {A, sc}, dev);
    guard("pad_to_alignment_scaled", [&] {
      const PadScaledResult r = pad_to_alignment_scaled(q2, pv.tokens_per_expert, m, qs2v);
      pr.out("pad_to_alignment_scaled", "padded", r.padded);
      pr.out("pad_to_alignment_scaled", "padded_scales", r.padded_scales);
      pr.out("pad_to_alignment_scaled", "permutation_map", r.permutation_map);
      const ScaledRows u = unpad_from_alignment_scaled(r.padded, r.permutation_map, A, r.padded_scales);
      pr.out("unpad_from_alignment_scaled", "rows", u.rows);
      pr.out("unpad_from_alignment_scaled", "scales", u.scales);
    });
  }
  guard("copy", [&] {
    const Tensor y = filled(w.dt, {T, H}, dev, 0);
    copy(x, y);
    pr.out("copy", "y", y);
  });
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "both", dump, only;
  bool small = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device" && i + 1 < argc) device = argv[++i];
    else if (a == "--small") small = true;
    else if (a == "--dump" && i + 1 < argc) dump = argv[++i];
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else {
      std::fprintf(stderr, "usage: digest [--device cpu|cuda|both] [--small] [--dump DIR] [--only WORKLOAD]\n");
      return 2;
    }
  }
  // Sizes to reach every kernel choice on an H200 (132 SMs): one plan chunk and several, the small /
  // fused / split plan (E up to 1024), few tokens (T < 132, < 528) and many, the two-units window
  // (132 <= T < 330 with 8 KiB rows), the warp spread (T >= 2112, rows <= 8 KiB, K*units <= 2048),
  // top_k 1 / 2 / 8 / 16, odd and vectorizable H, float32 / float16 / bfloat16.
  const Workload workloads[] = {
      {"tiny_f32_K2_H7", 5, 8, 2, 7, 4, DType::kFloat32, false},
      {"odd_f16_K1_H100", 37, 8, 1, 100, 8, DType::kFloat16, false},
      {"small_bf16_K8_H256", 64, 64, 8, 256, 16, DType::kBFloat16, false},
      {"k16_f32_H1024", 100, 64, 16, 1024, 16, DType::kFloat32, false},
      {"e1024_bf16_K4_H64", 600, 1024, 4, 64, 8, DType::kBFloat16, false},
      {"two_units_bf16_T300", 300, 64, 8, 7168, 16, DType::kBFloat16, true},
      {"decode_bf16", 256, 256, 8, 7168, 16, DType::kBFloat16, true},
      {"decode_f16_T128", 128, 256, 8, 7168, 16, DType::kFloat16, true},
      {"mixtral_bf16_T4096", 4096, 8, 2, 4096, 128, DType::kBFloat16, true},
      {"k16_many_bf16", 2048, 64, 16, 2048, 32, DType::kBFloat16, true},
      {"qwen3_bf16_T16384", 16384, 128, 8, 2048, 128, DType::kBFloat16, true},
      {"odd_H_bf16_T3000", 3000, 64, 8, 1000, 16, DType::kBFloat16, true},
  };
  const bool cuda_present = [] {
    try {
      Tensor t = Tensor::empty(DType::kFloat32, {1}, Device::cuda(0));
      return t.defined();
    } catch (const std::exception&) {
      return false;
    }
  }();
  std::vector<Device> devices;
  if (device == "cpu" || device == "both") devices.push_back(Device::cpu());
  if ((device == "cuda" || device == "both") && cuda_present) devices.push_back(Device::cuda(0));
  if (device == "cuda" && !cuda_present) {
    std::fprintf(stderr, "digest: no CUDA device (or a build without CUDA)\n");
    return 2;
  }
  for (const Device& d : devices) {
    for (const Workload& w : workloads) {
      if (small && w.large) continue;
      if (!only.empty() && w.name != only) continue;
      Printer pr{d.is_cuda() ? "cuda" : "cpu", w.name, dump};
      run(w, d, pr);
      std::fflush(stdout);
    }
  }
  return 0;
}
