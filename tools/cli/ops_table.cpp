// ops_table.cpp — the op table (ops_table.hpp).
#include "ops_table.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

namespace cli {

namespace {

// The decode step's routing: make_plan into the output plan, an unweighted dispatch on it (padding
// rows zeroed, or left unwritten as the inference dispatch), then the weighted combine of the
// dispatched rows, back to back.
void plan_dispatch_combine(Data& d, bool zero_padding) {
  make_plan_out(d.top_experts, d.w.E, d.w.m, d.plan_out.view(), d.opt);
  const PlanView plan = d.plan_out.view();
  Options o = d.opt;
  o.zero_padding = zero_padding;
  dispatch_out(d.x, plan, std::nullopt, d.out_rows_R, o);
  combine_out(d.out_rows_R, plan, std::optional<TensorView>(d.weights), d.out_rows_T, d.opt);
}

}  // namespace

std::vector<OpCase> op_table() {
  using W = std::optional<TensorView>;
  std::vector<OpCase> ops;

  // Byte formulas of docs/spec.md §16, op by op.
  const std::string kGatherRule = "(T*H + P*H)*s";
  auto gather_bytes = [](const Dims& d) { return (d.T * d.H + d.P * d.H) * d.s; };
  const std::string kScatterRule = "(A*H + T*H)*s";
  auto scatter_bytes = [](const Dims& d) { return (d.A * d.H + d.T * d.H) * d.s; };
  // grad_out read once, y's A real rows read, grad_y's P rows written.
  const std::string kScatterBwdRule = "(T*H + A*H + P*H)*s";
  auto scatter_bwd_bytes = [](const Dims& d) { return (d.T * d.H + d.A * d.H + d.P * d.H) * d.s; };
  // grad_y's A real rows read, x read once (for grad_weights), grad_x written.
  const std::string kGatherBwdRule = "(A*H + 2*T*H)*s";
  auto gather_bwd_bytes = [](const Dims& d) { return (d.A * d.H + 2 * d.T * d.H) * d.s; };

  // make_plan's minimum bytes (top_experts read, the plan written), in the composite ops too.
  auto plan_bytes = [](const Dims& d) { return d.A * 4 + (3 * d.A + 4 * d.E + d.R) * 4; };

  // The expected values shared by several ops.
  auto gather_ref = [](Data& d, const std::vector<float>& rows, bool weighted) {
    return ref::padded_gather(rows, d.w.H, d.ref_plan, weighted ? &d.routing.weights : nullptr);
  };
  auto scatter_expect = [](Data& d, const std::string& what, const TensorView& got, const std::vector<float>* rows,
                           bool weighted) {
    auto ref = ref::padded_scatter(*rows, d.w.H, d.ref_plan, weighted ? &d.routing.weights : nullptr);
    return expect_sum(what, got, d.w.T, d.w.H, std::move(ref), d.w.K, [&d, rows, weighted] {
      const std::vector<float> abs_w = abs_of(d.routing.weights);
      return ref::padded_scatter(abs_of(*rows), d.w.H, d.ref_plan, weighted ? &abs_w : nullptr);
    });
  };
  auto wgrad_expect = [](Data& d, const std::string& what, const TensorView& got, const std::vector<float>* rows,
                         const std::vector<float>* grad) {
    auto ref = ref::padded_scatter_wgrad(*rows, *grad, d.w.H, d.ref_plan);
    return expect_sum(what, got, d.A, 1, std::move(ref), d.w.H, [&d, rows, grad] {
      return ref::padded_scatter_wgrad(abs_of(*rows), abs_of(*grad), d.w.H, d.ref_plan);
    });
  };
  auto rows_P = [](Data& d, const std::string& what, const TensorView& got, std::vector<float> ref) {
    Expect e = expect_move(what, got, d.P, d.w.H, std::move(ref));
    e.untouched_rows = std::max<int64_t>(0, got.shape[0] - d.P);
    return e;
  };

  ops.push_back(
      {"make_plan", "A*4 + (3*A + 4*E + R)*4 (top_experts read, plan written; R = capacity)", plan_bytes,
       [](Data& d) { make_plan_out(d.top_experts, d.w.E, d.w.m, d.plan_out.view(), d.opt); },
       [](Data& d) {
         ref::Plan rp = ref::make_plan(std::vector<int64_t>(d.routing.top_experts.begin(), d.routing.top_experts.end()),
                                       d.w.T, d.w.K, d.w.E, d.w.m);
         const Plan& o = d.plan_out;
         return std::vector<Expect>{
             expect_index("indices", o.indices, rp.indices),
             expect_index("bin_ids", o.bin_ids, rp.bin_ids),
             expect_index("tokens_per_expert", o.tokens_per_expert, rp.tokens_per_expert),
             expect_index("bins", o.bins, rp.bins),
             expect_index("padded_tokens_per_expert", o.padded_tokens_per_expert, rp.padded_tokens_per_expert),
             expect_index("padded_bins", o.padded_bins, rp.padded_bins),
             expect_index("dest_rows", o.dest_rows, rp.dest_rows),
             expect_index("row_sources", o.row_sources, rp.row_sources)};
       }});

  // The layouts other kernels consume, from make_plan's own pass (DeepGEMM rows, vLLM blocks, P), and vLLM's
  // moe_align_block_size: the references are written from those projects' definitions.
  ops.push_back({"make_plan+layouts", "make_plan + (R + R/m + 1)*4 (row_experts, block_experts, P written)",
                 [=](const Dims& d) { return plan_bytes(d) + (d.R + d.R / d.m + 1) * 4; },
                 [](Data& d) {
                   PlanLayouts l;
                   l.row_experts = d.out_row_experts_R;
                   l.block_experts = d.out_block_experts;
                   l.padded_total = d.out_total_1;
                   make_plan_out(d.top_experts, d.w.E, d.w.m, d.plan_out.view(), l, d.opt);
                 },
                 [](Data& d) {
                   const std::vector<int64_t> te(d.routing.top_experts.begin(), d.routing.top_experts.end());
                   return std::vector<Expect>{
                       expect_index("row_sources", d.plan_out.row_sources, d.ref_plan.row_sources),
                       expect_index("row_experts", d.out_row_experts_R, ref::row_experts(te, d.w.E, d.w.m, d.R)),
                       expect_index("block_experts", d.out_block_experts, ref::block_experts(te, d.w.E, d.w.m, d.R)),
                       expect_index("padded_total", d.out_total_1, {d.ref_plan.padded_rows})};
                 }});
  ops.push_back(
      {"moe_align_block_size",
       "A*4 + (3*A + 4*E)*4 + (V + V/m + 1)*4 (ids read; plan scratch and vLLM's outputs written; V = A + "
       "min(A,E)*(m-1))",
       [](const Dims& d) {
         const double v = d.A + std::min(d.A, d.E) * (d.m - 1);
         return d.A * 4 + (3 * d.A + 4 * d.E) * 4 + (v + v / d.m + 1) * 4;
       },
       [](Data& d) {
         moe_align_block_size_out(d.top_experts, d.w.m, d.w.E, d.out_sorted_V, d.out_block_ids_V, d.out_post_1, d.opt);
       },
       [](Data& d) {
         const std::vector<int64_t> te(d.routing.top_experts.begin(), d.routing.top_experts.end());
         ref::AlignedBlocks r = ref::moe_align_block_size(te, d.w.m, d.w.E, false);
         return std::vector<Expect>{expect_index("sorted_token_ids", d.out_sorted_V, std::move(r.sorted_token_ids)),
                                    expect_index("expert_ids", d.out_block_ids_V, std::move(r.expert_ids)),
                                    expect_index("num_tokens_post_padded", d.out_post_1, {r.num_tokens_post_padded})};
       }});
  // vLLM's batched layout over the plan's counts, max_tokens_per_batch = the largest count.
  ops.push_back({"batched_moe_align_block_size",
                 "E*4 + (B + B/m + 1)*4 (counts read; vLLM's batched outputs written; B = round_up(max count, m)*E)",
                 [](const Dims& d) { return d.E * 4 + (d.B + d.B / d.m + 1) * 4; },
                 [](Data& d) {
                   batched_moe_align_block_size_out(d.tokens_per_expert, d.batched_max, d.w.m, d.out_batched_B,
                                                    d.out_batched_blocks, d.out_batched_post_1, d.opt);
                 },
                 [](Data& d) {
                   ref::AlignedBlocks r =
                       ref::batched_moe_align_block_size(d.tokens_per_expert_ref, d.batched_max, d.w.m);
                   return std::vector<Expect>{
                       expect_index("sorted_ids", d.out_batched_B, std::move(r.sorted_token_ids)),
                       expect_index("block_ids", d.out_batched_blocks, std::move(r.expert_ids)),
                       expect_index("num_tokens_post_pad", d.out_batched_post_1, {r.num_tokens_post_padded})};
                 }});

  // The routing as TransformerEngine's mask map [T, E]: the plan of the mask (K = E slots a token, no
  // cut) and TE's row_id_map.
  ops.push_back(
      {"mask_plan",
       "T*E + (4*E + 3*T*E + Rm + T*(2*E+1))*4 (the map read; counts, dest_rows, indices, bin_ids, row_sources "
       "and row_id_map written; Rm = T*E + E*(m-1))",
       [](const Dims& d) {
         const double te = d.T * d.E, rm = te + d.E * (d.m - 1);
         return te + (4 * d.E + 3 * te + rm + d.T * (2 * d.E + 1)) * 4;
       },
       [](Data& d) {
         const int64_t rows = d.out_mask_sources.numel();
         TensorView map = d.mask.view();  // no mask made past int32: its shape alone, for the op to reject
         if (map.shape[0] != d.w.T) map = TensorView::contiguous(nullptr, DType::kUInt8, {d.w.T, d.w.E}, d.w.device);
         mask_plan_out(map, d.w.m, rows, false, d.out_mask_counts, d.out_mask_dest, d.out_mask_sources,
                       d.out_mask_row_id_map, d.out_mask_indices, d.out_mask_bin_ids, d.opt);
       },
       [](Data& d) {
         const int64_t rows = d.out_mask_sources.numel();
         ref::MaskPlan r = ref::mask_plan(d.mask_ref, d.w.T, d.w.E, d.w.m, rows, false, rows);
         TensorView row_id_map = d.out_mask_row_id_map.view();  // compared flat: [T * (2E + 1)]
         const int64_t entries = row_id_map.numel();
         row_id_map.ndim = 1;
         row_id_map.shape[0] = entries;
         row_id_map.shape[1] = 0;
         row_id_map.strides[0] = 1;
         return std::vector<Expect>{expect_index("counts", d.out_mask_counts, std::move(r.counts)),
                                    expect_index("dest_rows", d.out_mask_dest, std::move(r.dest_rows)),
                                    expect_index("row_sources", d.out_mask_sources, std::move(r.row_sources)),
                                    expect_index("indices", d.out_mask_indices, std::move(r.indices)),
                                    expect_index("bin_ids", d.out_mask_bin_ids, std::move(r.bin_ids)),
                                    expect_index("row_id_map", row_id_map, std::move(r.row_id_map))};
       }});

  // The routing as TransformerEngine's index map without a number of experts: the plan of the ids
  // sorted as uint32 keys, every row kept (rows = A).
  ops.push_back(
      {"index_plan", "A*4 + (4 + 4*A)*4 (the ids read; counts, dest_rows, row_sources, indices, bin_ids written)",
       [](const Dims& d) { return d.A * 4 + (4 + 4 * d.A) * 4; },
       [](Data& d) {
         index_plan_out(d.top_experts, d.A, d.out_index_counts, d.out_index_dest, d.out_index_sources,
                        d.out_index_indices, d.out_index_bin_ids, d.opt);
       },
       [](Data& d) {
         ref::IndexPlan r = ref::index_plan(d.routing.top_experts, d.A, d.A);
         return std::vector<Expect>{expect_index("counts", d.out_index_counts, std::move(r.counts)),
                                    expect_index("dest_rows", d.out_index_dest, std::move(r.dest_rows)),
                                    expect_index("row_sources", d.out_index_sources, std::move(r.row_sources)),
                                    expect_index("indices", d.out_index_indices, std::move(r.indices)),
                                    expect_index("bin_ids", d.out_index_bin_ids, std::move(r.bin_ids))};
       }});

  // make_plan with PlanOptions (expert parallelism; a capacity with the probs drop policy), against
  // ref::make_plan(..., RoutingOptions).
  // A plan with PlanOptions against ref::make_plan(..., RoutingOptions) (row_sources to o's length).
  auto routed_expects = [](Data& d, const Plan& o, int experts, const ref::RoutingOptions& r,
                           bool with_dropped = false) {
    const ref::RoutedPlan rp =
        ref::make_plan(std::vector<int64_t>(d.routing.top_experts.begin(), d.routing.top_experts.end()), d.w.T, d.w.K,
                       experts, d.w.m, r);
    std::vector<int64_t> rows = rp.plan.row_sources;
    rows.resize(static_cast<size_t>(o.row_sources.numel()), -1);
    std::vector<Expect> e{expect_index("indices", o.indices, rp.plan.indices),
                          expect_index("bins", o.bins, rp.plan.bins),
                          expect_index("padded_bins", o.padded_bins, rp.plan.padded_bins),
                          expect_index("dest_rows", o.dest_rows, rp.plan.dest_rows),
                          expect_index("row_sources", o.row_sources, std::move(rows))};
    if (with_dropped) e.push_back(expect_index("dropped", d.out_dropped_1, {rp.dropped}));
    return e;
  };
  auto ep_options = [](const Data& d) {
    PlanOptions po;
    po.global_experts = d.w.E;
    po.first_expert = d.ep_ranks > 1 ? d.w.E / d.ep_ranks : 0;  // rank 1's experts (rank 0's with one rank)
    return po;
  };
  ops.push_back(
      {"make_plan(ep)", "A*4 + (3*A + 4*E/r + R)*4 (ids read, rank 1's plan of E/r local experts written; r = 8 ranks)",
       [](const Dims& d) { return d.A * 4 + (3 * d.A + 4 * d.E / 8 + d.R) * 4; },
       [ep_options](Data& d) {
         make_plan_out(d.top_experts, d.w.E / d.ep_ranks, d.w.m, d.plan_ep.view(), PlanLayouts{}, ep_options(d), d.opt);
       },
       [ep_options, routed_expects](Data& d) {
         ref::RoutingOptions r;
         r.global_experts = d.w.E;
         r.first_expert = ep_options(d).first_expert;
         return routed_expects(d, d.plan_ep, d.w.E / d.ep_ranks, r);
       }});
  ops.push_back(
      {"make_plan(capacity)",
       "A*4 + A*4 + (3*A + 4*E + E*C)*4 (ids and probs read, plan written; C = round_down(A/E, m), largest probs kept)",
       [](const Dims& d) { return 8 * d.A + (3 * d.A + 4 * d.E + d.E * std::floor(d.A / d.E / d.m) * d.m) * 4; },
       [](Data& d) {
         PlanOptions po;
         po.expert_capacity = d.expert_capacity;
         po.drop_policy = DropPolicy::kProbs;
         po.probs = d.weights;
         po.dropped = d.out_dropped_1;
         make_plan_out(d.top_experts, d.w.E, d.w.m, d.plan_out.view(), PlanLayouts{}, po, d.opt);
       },
       [routed_expects](Data& d) {
         ref::RoutingOptions r;
         r.expert_capacity = d.expert_capacity;
         r.by_probs = true;
         r.probs = d.routing.weights;
         return routed_expects(d, d.plan_out, d.w.E, r, /*with_dropped=*/true);
       }});

  for (bool weighted : {false, true}) {
    ops.push_back(
        {weighted ? "padded_gather(w)" : "padded_gather", kGatherRule, gather_bytes,
         [weighted](Data& d) {
           const Plan& p = d.plan;
           padded_gather_out(d.x, p.indices, p.bin_ids, p.bins, p.padded_bins, d.w.K, weighted ? W(d.weights) : W(),
                             d.out_rows_R, d.opt);
         },
         [=](Data& d) { return std::vector<Expect>{rows_P(d, "y", d.out_rows_R, gather_ref(d, d.x_f, weighted))}; }});
  }
  for (bool weighted : {false, true}) {
    ops.push_back(
        {weighted ? "padded_scatter(w)" : "padded_scatter", kScatterRule, scatter_bytes,
         [weighted](Data& d) {
           const Plan& p = d.plan;
           padded_scatter_out(d.y, p.indices, p.bin_ids, weighted ? W(d.weights) : W(), p.bins, p.padded_bins, d.w.K,
                              d.out_rows_T, d.opt);
         },
         [=](Data& d) { return std::vector<Expect>{scatter_expect(d, "out", d.out_rows_T, &d.y_f, weighted)}; }});
  }
  ops.push_back(
      {"padded_scatter_wgrad", kScatterRule, scatter_bytes,
       [](Data& d) {
         const Plan& p = d.plan;
         padded_scatter_wgrad_out(d.y, d.grad_out, p.indices, p.bin_ids, p.bins, p.padded_bins, d.w.K, d.out_f32_A,
                                  d.opt);
       },
       [=](Data& d) { return std::vector<Expect>{wgrad_expect(d, "wgrad", d.out_f32_A, &d.y_f, &d.grad_out_f)}; }});
  // Backward ops: without weights only the row gradient exists.
  // d/dx of y[row(a)] = w(a) x[a/K] is sum_k w(a) grad_y[row(a)]: the weighted scatter.
  auto gather_bwd_expect = [=](Data& d, bool weighted) {
    std::vector<Expect> e{scatter_expect(d, "grad_x", d.out_rows_T, &d.grad_y_f, weighted)};
    if (weighted) e.push_back(wgrad_expect(d, "grad_weights", d.out_f32_A, &d.grad_y_f, &d.x_f));
    return e;
  };
  // Without weights, an empty grad_weights view skips the weight gradient.
  auto grad_w_out = [](Data& d, bool weighted) { return weighted ? d.out_f32_A.view() : TensorView{}; };
  auto scatter_bwd_expect = [=](Data& d, const TensorView& grad_y, const TensorView& grad_weights, bool weighted) {
    std::vector<Expect> e{rows_P(d, "grad_y", grad_y, gather_ref(d, d.grad_out_f, weighted))};
    if (weighted) e.push_back(wgrad_expect(d, "grad_weights", grad_weights, &d.y_f, &d.grad_out_f));
    return e;
  };
  for (bool weighted : {false, true}) {
    ops.push_back({weighted ? "padded_gather_backward(w)" : "padded_gather_backward",
                   weighted ? kGatherBwdRule : kScatterRule, weighted ? gather_bwd_bytes : scatter_bytes,
                   [=](Data& d) {
                     const Plan& p = d.plan;
                     padded_gather_backward_out(d.grad_y, d.x, p.indices, p.bin_ids, p.bins, p.padded_bins, d.w.K,
                                                weighted ? W(d.weights) : W(), d.out_rows_T, grad_w_out(d, weighted),
                                                d.opt);
                   },
                   [=](Data& d) { return gather_bwd_expect(d, weighted); }});
  }
  for (bool weighted : {false, true}) {
    ops.push_back({weighted ? "padded_scatter_backward(w)" : "padded_scatter_backward",
                   weighted ? kScatterBwdRule : kGatherRule, weighted ? scatter_bwd_bytes : gather_bytes,
                   [=](Data& d) {
                     const Plan& p = d.plan;
                     padded_scatter_backward_out(d.grad_out, d.y, p.indices, p.bin_ids, weighted ? W(d.weights) : W(),
                                                 p.bins, p.padded_bins, d.w.K, d.out_rows_R2, grad_w_out(d, weighted),
                                                 d.opt);
                   },
                   [=](Data& d) { return scatter_bwd_expect(d, d.out_rows_R2, d.out_f32_A, weighted); }});
  }
  for (bool weighted : {false, true}) {
    ops.push_back(
        {weighted ? "dispatch(w)" : "dispatch", kGatherRule, gather_bytes,
         [weighted](Data& d) { dispatch_out(d.x, d.plan.view(), weighted ? W(d.weights) : W(), d.out_rows_R, d.opt); },
         [=](Data& d) { return std::vector<Expect>{rows_P(d, "y", d.out_rows_R, gather_ref(d, d.x_f, weighted))}; }});
  }
  // dispatch with Options::zero_padding = false: padding rows left unwritten; real rows checked
  // against the reference, padding rows compared to what the buffer held before the call.
  ops.push_back({"dispatch(no-pad)", "(T*H + A*H)*s (padding rows not written)",
                 [](const Dims& d) { return (d.T * d.H + d.A * d.H) * d.s; },
                 [](Data& d) {
                   Options o = d.opt;
                   o.zero_padding = false;
                   dispatch_out(d.x, d.plan.view(), W(), d.out_rows_R, o);
                 },
                 [=](Data& d) {
                   // Again into a buffer filled with 3.0 (exact in every row format): real rows as the reference,
                   // padding rows and rows past P still 3.0.
                   const int64_t H = d.w.H, R = d.out_rows_R.view().shape[0];
                   Tensor fill = Tensor::empty(d.w.dtype, {R, H});
                   for (int64_t i = 0; i < R * H; ++i) numeric::store_from_float(fill.data(), d.w.dtype, i, 3.0f);
                   padmoe::copy(fill, d.out_rows_R, d.opt);
                   Options o = d.opt;
                   o.zero_padding = false;
                   dispatch_out(d.x, d.plan.view(), W(), d.out_rows_R, o);
                   std::vector<float> ref = gather_ref(d, d.x_f, false);
                   ref.resize(static_cast<size_t>(R * H), 3.0f);
                   for (int64_t r = 0; r < d.P; ++r) {
                     if (d.ref_plan.row_sources[static_cast<size_t>(r)] >= 0) continue;
                     std::fill(ref.begin() + r * H, ref.begin() + (r + 1) * H, 3.0f);
                   }
                   return std::vector<Expect>{expect_move("y", d.out_rows_R, R, H, std::move(ref))};
                 }});
  // float8 e4m3 rows moved with their [T, ceil(H/128)] float32 scales in the same pass:
  // rows and scale rows both checked against the reference (padding rows: zero data, scale 1.0).
  ops.push_back(
      {"dispatch(fp8+scales)", "(T*H + P*H)*1 + (T + P)*ceil(H/128)*4 (e4m3 rows, float32 scales)",
       [](const Dims& d) { return (d.T * d.H + d.P * d.H) * 1.0 + (d.T + d.P) * std::ceil(d.H / 128.0) * 4.0; },
       [](Data& d) { dispatch_scaled_out(d.x8, d.plan.view(), d.x8_scales, d.out_rows8_R, d.out_scales_R, d.opt); },
       [=](Data& d) {
         const int64_t blocks = d.x8_scales.size(1);
         const std::vector<int64_t> sources = ref::spread_sources(d.ref_plan);
         std::vector<float> scales(static_cast<size_t>(d.P * blocks), 1.0f);
         for (int64_t r = 0; r < d.P; ++r) {
           const int64_t t = sources[static_cast<size_t>(r)];
           for (int64_t c = 0; c < blocks && t >= 0; ++c) scales[r * blocks + c] = d.x8_scales_f[t * blocks + c];
         }
         Expect s = expect_move("y_scales", d.out_scales_R, d.P, blocks, std::move(scales));
         s.untouched_rows = std::max<int64_t>(0, d.R - d.P);
         return std::vector<Expect>{rows_P(d, "y", d.out_rows8_R, gather_ref(d, d.x8_f, false)), std::move(s)};
       }});
  // The fused quantizing dispatch: x (the workload's dtype) quantized once per token to
  // e4m3 with DeepSeek-V3 1x128 float32 scales or MXFP8 E8M0 scales, written to its K rows; codes and
  // scales both checked bitwise against the reference quantizer (padding rows: zero codes, scale 1).
  for (bool mx : {false, true}) {
    ops.push_back(
        {mx ? "dispatch(quant-mxfp8)" : "dispatch(quant-128)",
         mx ? "T*H*s + P*H*1 + P*ceil(H/32)*1 (e4m3 codes, E8M0 scales written)"
            : "T*H*s + P*H*1 + P*ceil(H/128)*4 (e4m3 codes, float32 scales written)",
         [mx](const Dims& d) {
           return d.T * d.H * d.s + d.P * d.H * 1.0 + d.P * (mx ? std::ceil(d.H / 32.0) : std::ceil(d.H / 128.0) * 4.0);
         },
         [mx](Data& d) {
           dispatch_quantized_out(d.x, d.plan.view(), d.out_rows8_R, mx ? d.out_e8m0_R : d.out_scales_R, d.opt);
         },
         [=](Data& d) {
           const ref::QuantRows q = ref::dispatch_quantized(
               d.x_f, d.w.H, d.ref_plan, mx ? ref::QuantLayout::kMxE8M0 : ref::QuantLayout::kBlock128, false);
           std::vector<float> codes(q.rows.size()), scales(static_cast<size_t>(d.P * q.cols));
           for (size_t i = 0; i < codes.size(); ++i) codes[i] = ref::fp8_value(q.rows[i], false);
           for (size_t i = 0; i < scales.size(); ++i) {
             if (mx) scales[i] = static_cast<float>(q.scales[i]);
             else std::memcpy(&scales[i], q.scales.data() + 4 * i, 4);
           }
           Expect s = expect_move("y_scales", mx ? d.out_e8m0_R : d.out_scales_R, d.P, q.cols, std::move(scales));
           s.untouched_rows = std::max<int64_t>(0, d.R - d.P);
           return std::vector<Expect>{rows_P(d, "y", d.out_rows8_R, std::move(codes)), std::move(s)};
         }});
  }
  ops.push_back({"combine(w)", kScatterRule, scatter_bytes,
                 [](Data& d) { combine_out(d.y, d.plan.view(), W(d.weights), d.out_rows_T, d.opt); },
                 [=](Data& d) { return std::vector<Expect>{scatter_expect(d, "out", d.out_rows_T, &d.y_f, true)}; }});
  for (bool weighted : {false, true}) {
    ops.push_back({weighted ? "combine_backward(w)" : "combine_backward", weighted ? kScatterBwdRule : kGatherRule,
                   weighted ? scatter_bwd_bytes : gather_bytes,
                   [=](Data& d) {
                     combine_backward_out(d.grad_out, d.y, d.plan.view(), weighted ? W(d.weights) : W(), d.out_rows_R2,
                                          grad_w_out(d, weighted), d.opt);
                   },
                   [=](Data& d) { return scatter_bwd_expect(d, d.out_rows_R2, d.out_f32_A, weighted); }});
  }
  for (bool weighted : {false, true}) {
    ops.push_back({weighted ? "dispatch_backward(w)" : "dispatch_backward", weighted ? kGatherBwdRule : kScatterRule,
                   weighted ? gather_bwd_bytes : scatter_bytes,
                   [=](Data& d) {
                     dispatch_backward_out(d.grad_y, d.x, d.plan.view(), weighted ? W(d.weights) : W(), d.out_rows_T,
                                           grad_w_out(d, weighted), d.opt);
                   },
                   [=](Data& d) { return gather_bwd_expect(d, weighted); }});
  }

  ops.push_back(
      {"pad_to_alignment", "(N*H + P*H)*s (N = A expert-grouped rows)",
       [](const Dims& d) { return (d.N * d.H + d.P * d.H) * d.s; },
       [](Data& d) {
         pad_to_alignment_out(d.h, d.tokens_per_expert, d.w.m, d.out_rows_R, d.out_map_R, d.out_offsets_E, d.opt);
       },
       [=](Data& d) {
         ref::PadResult r = ref::pad_to_alignment(d.h_f, d.w.H, d.tokens_per_expert_ref, d.w.m);
         std::vector<int64_t> map = r.permutation_map;
         map.resize(static_cast<size_t>(d.R), -1);  // entries past P are set to -1
         return std::vector<Expect>{rows_P(d, "padded", d.out_rows_R, std::move(r.padded)),
                                    expect_index("permutation_map", d.out_map_R, std::move(map)),
                                    expect_index("inclusive_offsets", d.out_offsets_E, std::move(r.inclusive_offsets))};
       }});
  for (bool with_probs : {false, true}) {
    ops.push_back(
        {with_probs ? "unpad_from_alignment(probs)" : "unpad_from_alignment",
         "(N*H + N*H)*s (real rows read, N rows written)", [](const Dims& d) { return 2 * d.N * d.H * d.s; },
         [with_probs](Data& d) {
           unpad_from_alignment_out(d.padded, d.perm_map, with_probs ? W(d.probs) : W(), d.out_rows_N, d.opt);
         },
         [=](Data& d) {
           return std::vector<Expect>{expect_move(
               "out", d.out_rows_N, d.N, d.w.H,
               ref::unpad_from_alignment(d.padded_f, d.w.H, d.perm_map_ref, d.N, with_probs ? &d.probs_f : nullptr))};
         }});
  }
  ops.push_back({"unpad_from_alignment_backward(probs)", "(2*N*H + P*H)*s (grad_out, real padded rows, grad_padded)",
                 [](const Dims& d) { return (2 * d.N * d.H + d.P * d.H) * d.s; },
                 [](Data& d) {
                   unpad_from_alignment_backward_out(d.grad_unpadded, d.padded, d.perm_map, W(d.probs), d.out_rows_P,
                                                     d.out_f32_N, d.opt);
                 },
                 [=](Data& d) {
                   ref::UnpadGrads g = ref::unpad_from_alignment_backward(d.grad_unpadded_f, d.padded_f, d.w.H,
                                                                          d.perm_map_ref, &d.probs_f);
                   return std::vector<Expect>{
                       expect_move("grad_padded", d.out_rows_P, d.P, d.w.H, std::move(g.grad_padded)),
                       expect_sum("grad_probs", d.out_f32_N, d.N, 1, std::move(g.grad_probs), d.w.H, [&d] {
                         return ref::unpad_from_alignment_backward(abs_of(d.grad_unpadded_f), abs_of(d.padded_f), d.w.H,
                                                                   d.perm_map_ref, &d.probs_f)
                             .grad_probs;
                       })};
                 }});

  // The chunk sort after an expert-parallel all-to-all (ops.hpp section 5): h as the rank-major
  // receive buffer of ep_ranks ranks, into the expert-major padded layout of E/ep_ranks experts.
  auto local_offsets = [](Data& d) {
    TensorView v = d.out_offsets_E.view();
    v.shape[0] = d.w.E / d.ep_ranks;
    return v;
  };
  ops.push_back({"sort_chunks", "(N*H + Pc*H)*s (N = A rank-major rows of 8 ranks, Pc = its padded rows)",
                 [](const Dims& d) { return (d.N * d.H + d.Pc * d.H) * d.s; },
                 [=](Data& d) {
                   sort_chunks_out(d.h, d.split_sizes, d.ep_ranks, d.w.m, std::nullopt, d.out_rows_R, d.out_map_R,
                                   local_offsets(d), d.opt);
                 },
                 [=](Data& d) {
                   ref::PadResult r = ref::sort_chunks(d.h_f, d.w.H, d.split_sizes_ref, d.ep_ranks, d.w.m, nullptr);
                   std::vector<int64_t> map = r.permutation_map;
                   map.resize(static_cast<size_t>(d.R), -1);  // entries past P are set to -1
                   Expect rows = expect_move("padded", d.out_rows_R, r.padded_rows, d.w.H, std::move(r.padded));
                   rows.untouched_rows = std::max<int64_t>(0, d.out_rows_R.view().shape[0] - r.padded_rows);
                   return std::vector<Expect>{
                       std::move(rows), expect_index("permutation_map", d.out_map_R, std::move(map)),
                       expect_index("inclusive_offsets", local_offsets(d), std::move(r.inclusive_offsets))};
                 }});

  // dispatch then the weighted combine of the dispatched rows: the reference's gather is exact (an
  // unweighted move), its scatter the sum's reference.
  auto composite_expect = [=](Data& d) {
    d.composite_f = gather_ref(d, d.x_f, false);
    return std::vector<Expect>{scatter_expect(d, "out", d.out_rows_T, &d.composite_f, true)};
  };
  // The parts of plan+dispatch+combine below, to tell where the end-to-end time goes (each also
  // one graph on a GPU): make_plan then an unweighted dispatch on its output, and dispatch then
  // the weighted combine on the prepared plan.
  ops.push_back(
      {"plan+dispatch", "make_plan + (T*H + P*H)*s (the two rules summed)",
       [=](const Dims& d) { return plan_bytes(d) + gather_bytes(d); },
       [](Data& d) {
         make_plan_out(d.top_experts, d.w.E, d.w.m, d.plan_out.view(), d.opt);
         dispatch_out(d.x, d.plan_out.view(), W(), d.out_rows_R, d.opt);
       },
       [=](Data& d) { return std::vector<Expect>{rows_P(d, "y", d.out_rows_R, gather_ref(d, d.x_f, false))}; }});
  ops.push_back({"dispatch+combine", "(T*H + P*H)*s + (A*H + T*H)*s (the two rules summed)",
                 [=](const Dims& d) { return gather_bytes(d) + scatter_bytes(d); },
                 [](Data& d) {
                   const PlanView plan = d.plan.view();
                   dispatch_out(d.x, plan, W(), d.out_rows_R, d.opt);
                   combine_out(d.out_rows_R, plan, W(d.weights), d.out_rows_T, d.opt);
                 },
                 composite_expect});

  // The decode question: route and move a small batch end to end. make_plan
  // into the output plan, an unweighted dispatch on it, then the weighted
  // combine of the dispatched rows (standing in for the expert outputs), back
  // to back; on a GPU nothing synchronizes between them.
  ops.push_back({"plan+dispatch+combine", "make_plan + (T*H + P*H)*s + (A*H + T*H)*s (the three rules summed)",
                 [=](const Dims& d) { return plan_bytes(d) + gather_bytes(d) + scatter_bytes(d); },
                 [](Data& d) { plan_dispatch_combine(d, /*zero_padding=*/true); }, composite_expect});
  // The same with the inference dispatch (padding rows and rows past P left unwritten: combine
  // reads real rows only), as GroupedExperts and the transformers experts run with no gradient.
  ops.push_back({"plan+dispatch(no-pad)+combine", "make_plan + (T*H + A*H)*s + (A*H + T*H)*s (the three rules summed)",
                 [=](const Dims& d) { return plan_bytes(d) + (d.T * d.H + d.A * d.H) * d.s + scatter_bytes(d); },
                 [](Data& d) { plan_dispatch_combine(d, /*zero_padding=*/false); }, composite_expect});
  // The same two steps as one call (make_plan_and_dispatch).
  ops.push_back(
      {"make_plan_and_dispatch", "make_plan + (T*H + P*H)*s (as plan+dispatch)",
       [=](const Dims& d) { return plan_bytes(d) + gather_bytes(d); },
       [](Data& d) {
         make_plan_and_dispatch_out(d.x, d.top_experts, d.w.E, d.w.m, d.plan_out.view(), W(), d.out_rows_R, d.opt);
       },
       [=](Data& d) { return std::vector<Expect>{rows_P(d, "y", d.out_rows_R, gather_ref(d, d.x_f, false))}; }});
  return ops;
}

Dims dims_of(const Data& d) {
  return Dims{static_cast<double>(d.w.T), static_cast<double>(d.w.H),
              static_cast<double>(d.A),   static_cast<double>(d.P),
              static_cast<double>(d.R),   static_cast<double>(d.N),
              static_cast<double>(d.w.E), static_cast<double>(element_size(d.w.dtype)),
              static_cast<double>(d.w.m), static_cast<double>(d.Pc),
              static_cast<double>(d.B)};
}

// --ops: a comma-separated list of op names (all ops when absent).
bool op_selected(const Args& args, const std::string& name) {
  if (!args.has("ops")) return true;
  const std::string list = "," + args.get("ops", "") + ",";
  return list.find("," + name + ",") != std::string::npos;
}

}  // namespace cli
