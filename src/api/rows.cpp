// rows.cpp — docs/spec.md §6: padded_gather / padded_scatter / wgrad,
// their backward rules, and the fused plan forms dispatch / combine /
// combine_backward / dispatch_backward.
//
// Every op first reduces its routing arguments to one inverse map
// (dest_rows[A], row_sources[P]): the plan already holds it; the
// MegaBlocks-style ops build it from (indices, bin_ids, bins, padded_bins)
// while checking them. The kernels then run token-driven: each token row is
// read once for its K assignments, each output row written once.
#include <algorithm>
#include <memory>
#include <string>

#include "api/alloc.hpp"
#include "api/checks.hpp"
#include "api/quant.hpp"
#include "api/scales.hpp"
#include "cpu/cpu_backend.hpp"
#include "cuda/cuda_backend.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tiling.hpp"

namespace padmoe {
namespace {

using detail::Checker;

// Routing reduced to the inverse map. CPU: pointers into a plan, or into
// `owned` (built while checking). CUDA: dest_rows from the plan or built on
// the device by prepare(); P is known on the device only (padded_rows = -1
// until an allocating form reads it), so row-count checks against P collect
// the smallest row count in rows_limit for the device-side validation.
struct Routed {
  int64_t tokens = 0;
  int64_t assignments = 0;
  int top_k = 1;
  int64_t padded_rows = 0;
  const int32_t* dest_rows = nullptr;
  const int32_t* row_sources = nullptr;
  detail::RoutingMap owned;
  // CUDA only
  bool on_cuda = false;
  int device_index = 0;
  int64_t rows_limit = -1;  // smallest rows of a padded tensor, -1: none
  const char* rows_limit_name = "y";
  cuda::PaddingRef padding;
  TensorView indices, bin_ids;  // sorted form (dest_rows built from these, or searched)
  const PlanView* plan = nullptr;
  std::shared_ptr<cuda::Scratch> scratch;
  cuda::DestArg search;  // the sorted form searched by the row kernels (search.indices set), else dest_rows
  cuda::DestArg dest() const { return search.indices.data != nullptr ? search : cuda::DestArg(dest_rows); }
  // the routing inputs as given (both backends), for the outputs' overlap checks
  const PlanView* given_plan = nullptr;
  TensorView given_indices, given_bin_ids, given_bins, given_padded_bins;
};

// MegaBlocks arguments. `device` is the row tensors' device.
Routed routed_from_sorted(const Checker& c, const TensorView& indices, const TensorView& bin_ids,
                          const TensorView& bins, const TensorView& padded_bins, int top_k, Device device,
                          const Options& options) {
  c.same_device(indices, "indices", device);
  detail::require_backend(c, device);
  Routed r;
  r.top_k = top_k;
  r.given_indices = indices;
  r.given_bin_ids = bin_ids;
  r.given_bins = bins;
  r.given_padded_bins = padded_bins;
  if (device.is_cuda()) {
    detail::check_sorted_shapes(c, indices, bin_ids, bins, padded_bins, top_k);
    r.on_cuda = true;
    r.device_index = device.index;
    r.assignments = indices.shape[0];
    r.tokens = r.assignments / top_k;
    r.padded_rows = -1;
    r.indices = indices;
    r.bin_ids = bin_ids;
    r.padding =
        cuda::PaddingRef{cuda::IndexRef::of(bins), cuda::IndexRef::of(padded_bins), static_cast<int>(bins.shape[0])};
    return r;
  }
  r.owned = detail::check_sorted_routing(c, indices, bin_ids, bins, padded_bins, top_k, options.num_threads);
  r.assignments = r.owned.assignments;
  r.tokens = r.assignments / top_k;
  r.padded_rows = r.owned.padded_rows;
  r.dest_rows = r.owned.dest_rows.data();
  r.row_sources = r.owned.row_sources.data();
  return r;
}

Routed routed_from_plan(const Checker& c, const PlanView& plan, Device device) {
  c.same_device(plan.dest_rows, "plan.dest_rows", device);
  detail::require_backend(c, device);
  Routed r;
  r.given_plan = &plan;
  r.tokens = plan.num_tokens;
  r.top_k = plan.top_k;
  r.assignments = detail::plan_assignments(c, plan);  // sizes checked before any product is used
  r.dest_rows = plan.dest_rows.data_as<const int32_t>();
  r.row_sources = plan.row_sources.data_as<const int32_t>();
  if (device.is_cuda()) {
    detail::check_plan_fields(c, plan, device);  // the same fields as the CPU backend checks
    r.on_cuda = true;
    r.device_index = device.index;
    r.padded_rows = -1;
    r.plan = &plan;
    r.padding = cuda::PaddingRef{cuda::IndexRef::of(plan.bins), cuda::IndexRef::of(plan.padded_bins), plan.num_experts};
    return r;
  }
  r.padded_rows = detail::check_plan(c, plan, device);
  return r;
}

// CUDA: checked mode validates the routing (and P against rows_limit) on the
// device; then dest_rows is built for the MegaBlocks-style arguments. Called
// after every host-side check, before anything is written. CPU: nothing left.
void prepare(const Checker& c, Routed& r, const Options& o) {
  if (!r.on_cuda) return;
  if (o.check_data) {
    cuda::Scratch scratch(o, cuda::validate_workspace_bytes(r.assignments), r.device_index);
    const cuda::Violation v =
        r.plan != nullptr ? cuda::validate_plan(*r.plan, r.rows_limit, scratch.get(), o.stream)
                          : cuda::validate_sorted_routing(cuda::IndexRef::of(r.indices), cuda::IndexRef::of(r.bin_ids),
                                                          r.padding.bins, r.padding.padded_bins, r.assignments,
                                                          r.padding.num_experts, r.rows_limit, scratch.get(), o.stream);
    detail::raise_violation(c, v, detail::ViolationNames{"bin_ids", r.assignments, r.rows_limit_name});
  }
  if (r.plan == nullptr && r.assignments > 0 && cuda::dest_search_fits(r.assignments, r.padding.num_experts, r.top_k)) {
    // small A: each row kernel's block finds its own rows in the sorted form (no dest_rows launch)
    r.search.indices = cuda::IndexRef::of(r.indices);
    r.search.bin_ids = cuda::IndexRef::of(r.bin_ids);
    r.search.bins = r.padding.bins;
    r.search.padded_bins = r.padding.padded_bins;
    r.search.num_experts = r.padding.num_experts;
    r.search.assignments = r.assignments;
    return;
  }
  if (r.plan == nullptr) {
    r.scratch = std::make_shared<cuda::Scratch>(o, static_cast<size_t>(r.assignments) * 4, r.device_index);
    int32_t* dest = static_cast<int32_t*>(r.scratch->get());
    cuda::build_dest_rows(cuda::IndexRef::of(r.indices), cuda::IndexRef::of(r.bin_ids), r.padding.bins,
                          r.padding.padded_bins, r.assignments, r.padding.num_experts, dest, o.stream);
    r.dest_rows = dest;
  }
}

// P on the host, for the allocating forms (CUDA: one synchronization).
void read_padded_rows(Routed& r, const Options& o) {
  if (!r.on_cuda) return;
  const int e = r.padding.num_experts;
  int64_t p = 0;
  if (e > 0) {
    const size_t w = r.padding.padded_bins.wide ? 8 : 4;
    const char* last = static_cast<const char*>(r.padding.padded_bins.data) + (e - 1) * w;
    int32_t p32 = 0;
    cuda::copy_bytes(w == 8 ? static_cast<void*>(&p) : static_cast<void*>(&p32), Device::cpu(), last,
                     Device::cuda(r.device_index), w, o.stream);
    if (w == 4) p = p32;
  }
  r.padded_rows = p;
}

void check_weights(const Checker& c, const std::optional<TensorView>& weights, const Routed& r,
                   const TensorView& rows) {
  if (!weights) return;
  c.scale_vector(*weights, "weights", r.assignments, rows.dtype);
  c.same_device(*weights, "weights", rows.device);
}

int scatter_block_x(const TensorView& rows) {
  static const TargetInfo cpu = target_info(TileTarget::kCpu);
  return tile_config(cpu, TileOp::kScatter, rows.shape[1], rows.dtype).block_x;
}

cpu::FloatOut float_out(const TensorView& t) { return cpu::FloatOut{t.data, t.dtype}; }

// --- the kernels on a Routed ------------------------------------------------

cuda::RowsArg rows_arg(const TensorView& t) { return cuda::RowsArg::of(t); }
cuda::ScaleArg scale_arg(const std::optional<TensorView>& w) {
  return w ? cuda::ScaleArg{w->data, w->dtype} : cuda::ScaleArg{};
}

using detail::ScalePair;

// y[dest[a]] = x[a/K] * w(a); padding rows zero. With scales, each row's
// scale row moves with it (padding rows: scale 1).
void run_spread(const Routed& r, const TensorView& x, const std::optional<TensorView>& w, const TensorView& y,
                const TensorView* dots_with, const TensorView* dots, const Options& o, bool zero_padding = true,
                const ScalePair* scales = nullptr) {
  if (r.on_cuda) {
    const cuda::RowsArg with = dots_with ? rows_arg(*dots_with) : cuda::RowsArg{};
    const cuda::ScaleRowsArg sc =
        scales ? detail::cuda_scale_rows(scales->src, scales->dst, scales->spec) : cuda::ScaleRowsArg{};
    cuda::spread_rows(rows_arg(x), r.top_k, r.dest(), scale_arg(w), rows_arg(y), r.padding, zero_padding, o.zero_tail,
                      dots_with ? &with : nullptr,
                      dots ? cuda::FloatOutArg{dots->data, dots->dtype} : cuda::FloatOutArg{}, o.stream,
                      scales ? &sc : nullptr);
    return;
  }
  const cpu::RowsRef with = dots_with ? cpu::RowsRef::of(*dots_with) : cpu::RowsRef{};
  const cpu::ScaleRows sc = scales ? detail::cpu_scale_rows(scales->src, scales->dst, scales->spec) : cpu::ScaleRows{};
  cpu::spread_rows(cpu::RowsRef::of(x), r.top_k, r.dest_rows, cpu::Scale::of(w), cpu::RowsRef::of(y), r.row_sources,
                   r.padded_rows, zero_padding, o.zero_tail, dots_with ? &with : nullptr,
                   dots ? float_out(*dots) : cpu::FloatOut{}, o.num_threads, scales ? &sc : nullptr);
}

void run_reduce(const Routed& r, const TensorView& y, const std::optional<TensorView>& w, const TensorView& out,
                const Options& o) {
  if (r.on_cuda) {
    cuda::reduce_rows(rows_arg(y), r.top_k, r.dest(), scale_arg(w), rows_arg(out), nullptr, cuda::FloatOutArg{},
                      o.stream);
    return;
  }
  cpu::reduce_rows(cpu::RowsRef::of(y), r.top_k, r.dest_rows, cpu::Scale::of(w), cpu::RowsRef::of(out),
                   scatter_block_x(y), o.num_threads);
}

void run_dots(const Routed& r, const TensorView& y, const TensorView& g, const TensorView& out, const Options& o) {
  if (r.on_cuda) {
    cuda::row_dots(rows_arg(y), rows_arg(g), r.top_k, r.dest(), r.assignments, cuda::FloatOutArg{out.data, out.dtype},
                   o.stream);
    return;
  }
  cpu::row_dots(cpu::RowsRef::of(y), cpu::RowsRef::of(g), r.top_k, r.dest_rows, r.assignments, float_out(out),
                o.num_threads);
}

// --- shared argument checks ---------------------------------------------------

// Token-order rows [T, H] (x, grad_out, grad).
void check_token_rows(const Checker& c, const TensorView& t, const char* name, const Routed& r, int64_t hidden,
                      bool allow_fp8) {
  c.row_tensor(t, name, r.tokens, hidden, allow_fp8);
}

// A padded tensor `name` of `rows` rows: at least P (CUDA: checked on the device).
bool padded_rows_known(Routed& r, int64_t rows, const char* name) {
  if (!r.on_cuda) return true;
  if (r.rows_limit < 0 || rows < r.rows_limit) {
    r.rows_limit = rows;
    r.rows_limit_name = name;
  }
  return false;
}

// Padded rows [>= P, H] (y, grad_y) as an input.
void check_padded_input(const Checker& c, const TensorView& t, const char* name, Routed& r, int64_t hidden,
                        DType dtype) {
  c.row_tensor(t, name, -1, hidden, /*allow_fp8=*/false);
  if (t.dtype != dtype) {
    c.fail(ErrorKind::kType, name, std::string("expected dtype ") + dtype_name(dtype) + ", got " + dtype_name(t.dtype));
  }
  if (padded_rows_known(r, t.shape[0], name) && t.shape[0] < r.padded_rows) {
    c.value_error(name, "has " + std::to_string(t.shape[0]) + " rows but the routing has " +
                            std::to_string(r.padded_rows) + " padded rows");
  }
}

// The row tensor's device must match the routing's, and be served.
Device rows_device(const Checker& c, const TensorView& rows) {
  detail::require_backend(c, rows.device);
  return rows.device;
}

// Outputs: padded rows [>= P, H], token rows [T, H], per-assignment floats [A].
void check_padded_out(const Checker& c, const TensorView& t, const char* name, Routed& r, const TensorView& like) {
  c.row_output(t, name, padded_rows_known(r, t.shape[0], name) ? r.padded_rows : 0, /*at_least=*/true, like.shape[1],
               like.dtype);
  c.same_device(t, name, like.device);
}
void check_token_out(const Checker& c, const TensorView& t, const char* name, const Routed& r, const TensorView& like) {
  c.row_output(t, name, r.tokens, /*at_least=*/false, like.shape[1], like.dtype);
  c.same_device(t, name, like.device);
}
// The outputs share no memory with each other, with the inputs or with the routing arrays.
void outputs_disjoint(const Checker& c, const Routed& r, std::initializer_list<detail::Named> outputs,
                      std::initializer_list<detail::Named> inputs) {
  detail::check_disjoint_all(c, outputs, inputs);
  detail::Named routing[12];  // no allocation: these checks run on every call
  int n = 0;
  if (r.given_plan != nullptr) {
    const PlanView& p = *r.given_plan;
    for (const TensorView* f : {&p.indices, &p.bin_ids, &p.tokens_per_expert, &p.bins, &p.padded_tokens_per_expert,
                                &p.padded_bins, &p.dest_rows, &p.row_sources}) {
      routing[n++] = detail::Named{f, "plan"};
    }
  }
  routing[n++] = detail::named(r.given_indices, "indices");
  routing[n++] = detail::named(r.given_bin_ids, "bin_ids");
  routing[n++] = detail::named(r.given_bins, "bins");
  routing[n++] = detail::named(r.given_padded_bins, "padded_bins");
  for (const detail::Named& o : outputs) {
    if (o.view == nullptr) continue;
    for (int i = 0; i < n; ++i) detail::check_disjoint(c, *o.view, o.name, *routing[i].view, routing[i].name);
  }
}
// An optional weight-gradient output; an empty TensorView{} (no data, no dims) skips it.
bool check_weight_grad_out(const Checker& c, const TensorView& t, const char* name, const Routed& r,
                           const TensorView& like) {
  if (t.data == nullptr && t.ndim == 0) return false;
  c.float_output(t, name, r.assignments, like.dtype);
  c.same_device(t, name, like.device);
  return true;
}

// --- the inputs of each op, checked; each returns the routing ----------------

Routed gather_inputs(const Checker& c, const TensorView& x, const TensorView& indices, const TensorView& bin_ids,
                     const TensorView& bins, const TensorView& padded_bins, int top_k,
                     const std::optional<TensorView>& weights, const Options& o) {
  c.row_tensor(x, "x", -1, -1, /*allow_fp8=*/!weights);
  Routed r = routed_from_sorted(c, indices, bin_ids, bins, padded_bins, top_k, rows_device(c, x), o);
  check_token_rows(c, x, "x", r, -1, !weights);
  check_weights(c, weights, r, x);
  return r;
}

Routed scatter_inputs(const Checker& c, const TensorView& y, const TensorView& indices, const TensorView& bin_ids,
                      const TensorView& bins, const TensorView& padded_bins, int top_k,
                      const std::optional<TensorView>& weights, const Options& o) {
  c.row_tensor(y, "y", -1, -1, false);
  Routed r = routed_from_sorted(c, indices, bin_ids, bins, padded_bins, top_k, rows_device(c, y), o);
  check_padded_input(c, y, "y", r, -1, y.dtype);
  check_weights(c, weights, r, y);
  return r;
}

// Token rows `tok` and padded rows `pad` of one routing (wgrad, the backward ops).
void pair_inputs(const Checker& c, Routed& r, const TensorView& tok, const char* tok_name, const TensorView& pad,
                 const char* pad_name, const std::optional<TensorView>& weights) {
  check_token_rows(c, tok, tok_name, r, -1, false);
  check_padded_input(c, pad, pad_name, r, tok.shape[1], tok.dtype);
  c.same_device(pad, pad_name, tok.device);
  check_weights(c, weights, r, tok);
}

Routed dispatch_inputs(const Checker& c, const TensorView& x, const PlanView& plan,
                       const std::optional<TensorView>& weights) {
  c.row_tensor(x, "x", -1, -1, /*allow_fp8=*/!weights);
  Routed r = routed_from_plan(c, plan, rows_device(c, x));
  check_token_rows(c, x, "x", r, -1, !weights);
  check_weights(c, weights, r, x);
  return r;
}

Routed combine_inputs(const Checker& c, const TensorView& y, const PlanView& plan,
                      const std::optional<TensorView>& weights) {
  c.row_tensor(y, "y", -1, -1, false);
  Routed r = routed_from_plan(c, plan, rows_device(c, y));
  check_padded_input(c, y, "y", r, -1, y.dtype);
  check_weights(c, weights, r, y);
  return r;
}

}  // namespace

// ---------------------------------------------------------------------------
// padded_gather / padded_scatter / padded_scatter_wgrad
// ---------------------------------------------------------------------------

void padded_gather_out(const TensorView& x, const TensorView& indices, const TensorView& bin_ids,
                       const TensorView& bins, const TensorView& padded_bins, int top_k,
                       const std::optional<TensorView>& weights, const TensorView& y, const Options& options) {
  Checker c("padded_gather");
  Routed r = gather_inputs(c, x, indices, bin_ids, bins, padded_bins, top_k, weights, options);
  check_padded_out(c, y, "y", r, x);
  outputs_disjoint(c, r, {detail::named(y, "y")}, {detail::named(x, "x"), detail::named(weights, "weights")});
  prepare(c, r, options);
  run_spread(r, x, weights, y, nullptr, nullptr, options, options.zero_padding);
}

Tensor padded_gather(const TensorView& x, const TensorView& indices, const TensorView& bin_ids, const TensorView& bins,
                     const TensorView& padded_bins, int top_k, const std::optional<TensorView>& weights,
                     const Options& options) {
  Checker c("padded_gather");
  Routed r = gather_inputs(c, x, indices, bin_ids, bins, padded_bins, top_k, weights, options);
  prepare(c, r, options);
  read_padded_rows(r, options);
  return detail::allocate_outputs<Tensor>(x.device, {detail::rows_like(x, r.padded_rows)}, [&](const Tensor& y) {
    run_spread(r, x, weights, y, nullptr, nullptr, options, options.zero_padding);
  });
}

void padded_scatter_out(const TensorView& y, const TensorView& indices, const TensorView& bin_ids,
                        const std::optional<TensorView>& weights, const TensorView& bins, const TensorView& padded_bins,
                        int top_k, const TensorView& out, const Options& options) {
  Checker c("padded_scatter");
  Routed r = scatter_inputs(c, y, indices, bin_ids, bins, padded_bins, top_k, weights, options);
  check_token_out(c, out, "out", r, y);
  outputs_disjoint(c, r, {detail::named(out, "out")}, {detail::named(y, "y"), detail::named(weights, "weights")});
  prepare(c, r, options);
  run_reduce(r, y, weights, out, options);
}

Tensor padded_scatter(const TensorView& y, const TensorView& indices, const TensorView& bin_ids,
                      const std::optional<TensorView>& weights, const TensorView& bins, const TensorView& padded_bins,
                      int top_k, const Options& options) {
  Checker c("padded_scatter");
  Routed r = scatter_inputs(c, y, indices, bin_ids, bins, padded_bins, top_k, weights, options);
  prepare(c, r, options);
  return detail::allocate_outputs<Tensor>(y.device, {detail::rows_like(y, r.tokens)},
                                          [&](const Tensor& out) { run_reduce(r, y, weights, out, options); });
}

void padded_scatter_wgrad_out(const TensorView& y, const TensorView& grad, const TensorView& indices,
                              const TensorView& bin_ids, const TensorView& bins, const TensorView& padded_bins,
                              int top_k, const TensorView& wgrad, const Options& options) {
  Checker c("padded_scatter_wgrad");
  Routed r = scatter_inputs(c, y, indices, bin_ids, bins, padded_bins, top_k, std::nullopt, options);
  pair_inputs(c, r, grad, "grad", y, "y", std::nullopt);
  c.float_output(wgrad, "wgrad", r.assignments, y.dtype);
  c.same_device(wgrad, "wgrad", y.device);
  outputs_disjoint(c, r, {detail::named(wgrad, "wgrad")}, {detail::named(y, "y"), detail::named(grad, "grad")});
  prepare(c, r, options);
  run_dots(r, y, grad, wgrad, options);
}

Tensor padded_scatter_wgrad(const TensorView& y, const TensorView& grad, const TensorView& indices,
                            const TensorView& bin_ids, const TensorView& bins, const TensorView& padded_bins, int top_k,
                            const Options& options) {
  Checker c("padded_scatter_wgrad");
  Routed r = scatter_inputs(c, y, indices, bin_ids, bins, padded_bins, top_k, std::nullopt, options);
  pair_inputs(c, r, grad, "grad", y, "y", std::nullopt);
  prepare(c, r, options);
  return detail::allocate_outputs<Tensor>(y.device, {{y.dtype, {r.assignments}}},
                                          [&](const Tensor& wgrad) { run_dots(r, y, grad, wgrad, options); });
}

// ---------------------------------------------------------------------------
// Backward rules of the MegaBlocks ops
// ---------------------------------------------------------------------------

namespace {

// grad_x = reduce(grad_y, weights); grad_weights = <grad_y[row], x[t]> (gather / dispatch backward).
void run_spread_backward(const Routed& r, const TensorView& grad_y, const TensorView& x,
                         const std::optional<TensorView>& weights, const TensorView& grad_x,
                         const TensorView* grad_weights, const Options& o) {
  if (r.on_cuda) {  // one pass over grad_y: the sum and the dot products together
    const cuda::RowsArg xr = rows_arg(x);
    cuda::reduce_rows(
        rows_arg(grad_y), r.top_k, r.dest(), scale_arg(weights), rows_arg(grad_x), grad_weights ? &xr : nullptr,
        grad_weights ? cuda::FloatOutArg{grad_weights->data, grad_weights->dtype} : cuda::FloatOutArg{}, o.stream);
    return;
  }
  // CPU: one pass over grad_y too (each token's dots while its K rows are in cache).
  const cpu::RowsRef xr = cpu::RowsRef::of(x);
  cpu::reduce_rows(cpu::RowsRef::of(grad_y), r.top_k, r.dest_rows, cpu::Scale::of(weights), cpu::RowsRef::of(grad_x),
                   scatter_block_x(grad_y), o.num_threads, grad_weights ? &xr : nullptr,
                   grad_weights ? float_out(*grad_weights) : cpu::FloatOut{});
}

}  // namespace

void padded_gather_backward_out(const TensorView& grad_y, const TensorView& x, const TensorView& indices,
                                const TensorView& bin_ids, const TensorView& bins, const TensorView& padded_bins,
                                int top_k, const std::optional<TensorView>& weights, const TensorView& grad_x,
                                const TensorView& grad_weights, const Options& options) {
  Checker c("padded_gather_backward");
  Routed r = gather_inputs(c, x, indices, bin_ids, bins, padded_bins, top_k, std::nullopt, options);
  pair_inputs(c, r, x, "x", grad_y, "grad_y", weights);
  check_token_out(c, grad_x, "grad_x", r, x);
  const bool want_gw = check_weight_grad_out(c, grad_weights, "grad_weights", r, x);
  outputs_disjoint(
      c, r, {detail::named(grad_x, "grad_x"), detail::named(grad_weights, "grad_weights")},
      {detail::named(grad_y, "grad_y"), detail::Named{want_gw ? &x : nullptr, "x"},  // read for grad_weights
       detail::named(weights, "weights")});
  prepare(c, r, options);
  run_spread_backward(r, grad_y, x, weights, grad_x, want_gw ? &grad_weights : nullptr, options);
}

RowGrads padded_gather_backward(const TensorView& grad_y, const TensorView& x, const TensorView& indices,
                                const TensorView& bin_ids, const TensorView& bins, const TensorView& padded_bins,
                                int top_k, const std::optional<TensorView>& weights, const Options& options) {
  Checker c("padded_gather_backward");
  Routed r = gather_inputs(c, x, indices, bin_ids, bins, padded_bins, top_k, std::nullopt, options);
  pair_inputs(c, r, x, "x", grad_y, "grad_y", weights);
  prepare(c, r, options);
  return detail::allocate_outputs<RowGrads>(
      x.device, {detail::rows_like(x, r.tokens), detail::grad_like(weights, r.assignments)}, [&](const RowGrads& g) {
        run_spread_backward(r, grad_y, x, weights, g.grad_rows, weights ? &g.grad_weights.view() : nullptr, options);
      });
}

void padded_scatter_backward_out(const TensorView& grad_out, const TensorView& y, const TensorView& indices,
                                 const TensorView& bin_ids, const std::optional<TensorView>& weights,
                                 const TensorView& bins, const TensorView& padded_bins, int top_k,
                                 const TensorView& grad_y, const TensorView& grad_weights, const Options& options) {
  Checker c("padded_scatter_backward");
  Routed r = scatter_inputs(c, y, indices, bin_ids, bins, padded_bins, top_k, std::nullopt, options);
  pair_inputs(c, r, grad_out, "grad_out", y, "y", weights);
  check_padded_out(c, grad_y, "grad_y", r, y);
  const bool want_gw = check_weight_grad_out(c, grad_weights, "grad_weights", r, y);
  outputs_disjoint(
      c, r, {detail::named(grad_y, "grad_y"), detail::named(grad_weights, "grad_weights")},
      {detail::named(grad_out, "grad_out"), detail::Named{want_gw ? &y : nullptr, "y"},  // read for grad_weights
       detail::named(weights, "weights")});
  prepare(c, r, options);
  run_spread(r, grad_out, weights, grad_y, want_gw ? &y : nullptr, want_gw ? &grad_weights : nullptr, options);
}

RowGrads padded_scatter_backward(const TensorView& grad_out, const TensorView& y, const TensorView& indices,
                                 const TensorView& bin_ids, const std::optional<TensorView>& weights,
                                 const TensorView& bins, const TensorView& padded_bins, int top_k,
                                 const Options& options) {
  Checker c("padded_scatter_backward");
  Routed r = scatter_inputs(c, y, indices, bin_ids, bins, padded_bins, top_k, std::nullopt, options);
  pair_inputs(c, r, grad_out, "grad_out", y, "y", weights);
  prepare(c, r, options);
  read_padded_rows(r, options);
  return detail::allocate_outputs<RowGrads>(
      y.device, {detail::rows_like(y, r.padded_rows), detail::grad_like(weights, r.assignments)},
      [&](const RowGrads& g) {
        run_spread(r, grad_out, weights, g.grad_rows, weights ? &y : nullptr,
                   weights ? &g.grad_weights.view() : nullptr, options);
      });
}

// ---------------------------------------------------------------------------
// Fused plan forms
// ---------------------------------------------------------------------------

void dispatch_out(const TensorView& x, const PlanView& plan, const std::optional<TensorView>& weights,
                  const TensorView& y, const Options& options) {
  Checker c("dispatch");
  Routed r = dispatch_inputs(c, x, plan, weights);
  check_padded_out(c, y, "y", r, x);
  outputs_disjoint(c, r, {detail::named(y, "y")}, {detail::named(x, "x"), detail::named(weights, "weights")});
  prepare(c, r, options);
  run_spread(r, x, weights, y, nullptr, nullptr, options, options.zero_padding);
}

Tensor dispatch(const TensorView& x, const PlanView& plan, const std::optional<TensorView>& weights,
                const Options& options) {
  Checker c("dispatch");
  Routed r = dispatch_inputs(c, x, plan, weights);
  prepare(c, r, options);
  read_padded_rows(r, options);
  return detail::allocate_outputs<Tensor>(x.device, {detail::rows_like(x, r.padded_rows)}, [&](const Tensor& y) {
    run_spread(r, x, weights, y, nullptr, nullptr, options, options.zero_padding);
  });
}

void combine_out(const TensorView& y, const PlanView& plan, const std::optional<TensorView>& weights,
                 const TensorView& out, const Options& options) {
  Checker c("combine");
  Routed r = combine_inputs(c, y, plan, weights);
  check_token_out(c, out, "out", r, y);
  outputs_disjoint(c, r, {detail::named(out, "out")}, {detail::named(y, "y"), detail::named(weights, "weights")});
  prepare(c, r, options);
  run_reduce(r, y, weights, out, options);
}

Tensor combine(const TensorView& y, const PlanView& plan, const std::optional<TensorView>& weights,
               const Options& options) {
  Checker c("combine");
  Routed r = combine_inputs(c, y, plan, weights);
  prepare(c, r, options);
  return detail::allocate_outputs<Tensor>(y.device, {detail::rows_like(y, r.tokens)},
                                          [&](const Tensor& out) { run_reduce(r, y, weights, out, options); });
}

void combine_backward_out(const TensorView& grad_out, const TensorView& y, const PlanView& plan,
                          const std::optional<TensorView>& weights, const TensorView& grad_y,
                          const TensorView& grad_weights, const Options& options) {
  Checker c("combine_backward");
  Routed r = combine_inputs(c, y, plan, std::nullopt);
  pair_inputs(c, r, grad_out, "grad_out", y, "y", weights);
  check_padded_out(c, grad_y, "grad_y", r, y);
  const bool want_gw = check_weight_grad_out(c, grad_weights, "grad_weights", r, y);
  outputs_disjoint(
      c, r, {detail::named(grad_y, "grad_y"), detail::named(grad_weights, "grad_weights")},
      {detail::named(grad_out, "grad_out"), detail::Named{want_gw ? &y : nullptr, "y"},  // read for grad_weights
       detail::named(weights, "weights")});
  prepare(c, r, options);
  run_spread(r, grad_out, weights, grad_y, want_gw ? &y : nullptr, want_gw ? &grad_weights : nullptr, options);
}

RowGrads combine_backward(const TensorView& grad_out, const TensorView& y, const PlanView& plan,
                          const std::optional<TensorView>& weights, const Options& options) {
  Checker c("combine_backward");
  Routed r = combine_inputs(c, y, plan, std::nullopt);
  pair_inputs(c, r, grad_out, "grad_out", y, "y", weights);
  prepare(c, r, options);
  read_padded_rows(r, options);
  return detail::allocate_outputs<RowGrads>(
      y.device, {detail::rows_like(y, r.padded_rows), detail::grad_like(weights, r.assignments)},
      [&](const RowGrads& g) {
        run_spread(r, grad_out, weights, g.grad_rows, weights ? &y : nullptr,
                   weights ? &g.grad_weights.view() : nullptr, options);
      });
}

void dispatch_backward_out(const TensorView& grad_y, const TensorView& x, const PlanView& plan,
                           const std::optional<TensorView>& weights, const TensorView& grad_x,
                           const TensorView& grad_weights, const Options& options) {
  Checker c("dispatch_backward");
  Routed r = dispatch_inputs(c, x, plan, std::nullopt);
  pair_inputs(c, r, x, "x", grad_y, "grad_y", weights);
  check_token_out(c, grad_x, "grad_x", r, x);
  const bool want_gw = check_weight_grad_out(c, grad_weights, "grad_weights", r, x);
  outputs_disjoint(
      c, r, {detail::named(grad_x, "grad_x"), detail::named(grad_weights, "grad_weights")},
      {detail::named(grad_y, "grad_y"), detail::Named{want_gw ? &x : nullptr, "x"},  // read for grad_weights
       detail::named(weights, "weights")});
  prepare(c, r, options);
  run_spread_backward(r, grad_y, x, weights, grad_x, want_gw ? &grad_weights : nullptr, options);
}

RowGrads dispatch_backward(const TensorView& grad_y, const TensorView& x, const PlanView& plan,
                           const std::optional<TensorView>& weights, const Options& options) {
  Checker c("dispatch_backward");
  Routed r = dispatch_inputs(c, x, plan, std::nullopt);
  pair_inputs(c, r, x, "x", grad_y, "grad_y", weights);
  prepare(c, r, options);
  return detail::allocate_outputs<RowGrads>(
      x.device, {detail::rows_like(x, r.tokens), detail::grad_like(weights, r.assignments)}, [&](const RowGrads& g) {
        run_spread_backward(r, grad_y, x, weights, g.grad_rows, weights ? &g.grad_weights.view() : nullptr, options);
      });
}

// ---------------------------------------------------------------------------
// Rows moved with their scales (ops.hpp section 4)
// ---------------------------------------------------------------------------

void padded_gather_scaled_out(const TensorView& x, const TensorView& indices, const TensorView& bin_ids,
                              const TensorView& bins, const TensorView& padded_bins, int top_k,
                              const TensorView& x_scales, const TensorView& y, const TensorView& y_scales,
                              const Options& options) {
  Checker c("padded_gather");
  Routed r = gather_inputs(c, x, indices, bin_ids, bins, padded_bins, top_k, std::nullopt, options);
  const detail::ScaleSpec spec = detail::check_scales(c, x_scales, "x_scales", r.tokens, x.shape[1], x.device);
  check_padded_out(c, y, "y", r, x);
  detail::check_scales_out(c, y_scales, "y_scales", y.shape[0], spec, x.device);
  outputs_disjoint(c, r, {detail::named(y, "y"), detail::named(y_scales, "y_scales")},
                   {detail::named(x, "x"), detail::named(x_scales, "x_scales")});
  prepare(c, r, options);
  const ScalePair sp{x_scales, y_scales, spec};
  run_spread(r, x, std::nullopt, y, nullptr, nullptr, options, options.zero_padding, &sp);
}

ScaledRows padded_gather_scaled(const TensorView& x, const TensorView& indices, const TensorView& bin_ids,
                                const TensorView& bins, const TensorView& padded_bins, int top_k,
                                const TensorView& x_scales, const Options& options) {
  Checker c("padded_gather");
  Routed r = gather_inputs(c, x, indices, bin_ids, bins, padded_bins, top_k, std::nullopt, options);
  const detail::ScaleSpec spec = detail::check_scales(c, x_scales, "x_scales", r.tokens, x.shape[1], x.device);
  prepare(c, r, options);
  read_padded_rows(r, options);
  return detail::allocate_outputs<ScaledRows>(
      x.device, {detail::rows_like(x, r.padded_rows), detail::rows_like(x_scales, r.padded_rows)},
      [&](const ScaledRows& out) {
        const ScalePair sp{x_scales, out.scales, spec};
        run_spread(r, x, std::nullopt, out.rows, nullptr, nullptr, options, options.zero_padding, &sp);
      });
}

void dispatch_scaled_out(const TensorView& x, const PlanView& plan, const TensorView& x_scales, const TensorView& y,
                         const TensorView& y_scales, const Options& options) {
  Checker c("dispatch");
  Routed r = dispatch_inputs(c, x, plan, std::nullopt);
  const detail::ScaleSpec spec = detail::check_scales(c, x_scales, "x_scales", r.tokens, x.shape[1], x.device);
  check_padded_out(c, y, "y", r, x);
  detail::check_scales_out(c, y_scales, "y_scales", y.shape[0], spec, x.device);
  outputs_disjoint(c, r, {detail::named(y, "y"), detail::named(y_scales, "y_scales")},
                   {detail::named(x, "x"), detail::named(x_scales, "x_scales")});
  prepare(c, r, options);
  const ScalePair sp{x_scales, y_scales, spec};
  run_spread(r, x, std::nullopt, y, nullptr, nullptr, options, options.zero_padding, &sp);
}

ScaledRows dispatch_scaled(const TensorView& x, const PlanView& plan, const TensorView& x_scales,
                           const Options& options) {
  Checker c("dispatch");
  Routed r = dispatch_inputs(c, x, plan, std::nullopt);
  const detail::ScaleSpec spec = detail::check_scales(c, x_scales, "x_scales", r.tokens, x.shape[1], x.device);
  prepare(c, r, options);
  read_padded_rows(r, options);
  return detail::allocate_outputs<ScaledRows>(
      x.device, {detail::rows_like(x, r.padded_rows), detail::rows_like(x_scales, r.padded_rows)},
      [&](const ScaledRows& out) {
        const ScalePair sp{x_scales, out.scales, spec};
        run_spread(r, x, std::nullopt, out.rows, nullptr, nullptr, options, options.zero_padding, &sp);
      });
}

// ---------------------------------------------------------------------------
// Fused quantizing dispatch (ops.hpp section 4)
// ---------------------------------------------------------------------------

namespace {

// x [T, H] float32/16/bf16 on the plan's device (the dtype named first: a
// float8 x is already quantized).
Routed quantized_inputs(const Checker& c, const TensorView& x, const PlanView& plan) {
  detail::check_quant_input(c, x, "x");
  return dispatch_inputs(c, x, plan, std::nullopt);
}

void run_quant_spread(const Routed& r, const TensorView& x, const TensorView& y, const TensorView& ys,
                      const detail::ScaleSpec& spec, bool e5m2, const Options& o) {
  if (r.on_cuda) {
    cuda::quantize_spread_rows(rows_arg(x), r.top_k, r.dest_rows, rows_arg(y),
                               detail::cuda_quant_scales(ys, spec, e5m2), r.padding, o.zero_padding, o.zero_tail,
                               o.stream);
    return;
  }
  cpu::quantize_spread_rows(cpu::RowsRef::of(x), r.top_k, r.dest_rows, cpu::RowsRef::of(y),
                            detail::cpu_quant_scales(ys, spec, e5m2), r.row_sources, r.padded_rows, o.zero_padding,
                            o.zero_tail, o.num_threads);
}

}  // namespace

void dispatch_quantized_out(const TensorView& x, const PlanView& plan, const TensorView& y, const TensorView& y_scales,
                            const Options& options) {
  Checker c("dispatch_quantized");
  Routed r = quantized_inputs(c, x, plan);
  const bool e5m2 = detail::check_fp8_dtype(c, y.dtype, "y");
  TensorView like = x;  // y: x's columns in the float8 dtype
  like.dtype = y.dtype;
  check_padded_out(c, y, "y", r, like);
  const detail::ScaleSpec spec = detail::check_scales(c, y_scales, "y_scales", y.shape[0], x.shape[1], x.device);
  outputs_disjoint(c, r, {detail::named(y, "y"), detail::named(y_scales, "y_scales")}, {detail::named(x, "x")});
  prepare(c, r, options);
  run_quant_spread(r, x, y, y_scales, spec, e5m2, options);
}

ScaledRows dispatch_quantized(const TensorView& x, const PlanView& plan, ScaleLayout layout, DType dtype,
                              const Options& options) {
  Checker c("dispatch_quantized");
  Routed r = quantized_inputs(c, x, plan);
  const bool e5m2 = detail::check_fp8_dtype(c, dtype, "dtype");
  prepare(c, r, options);
  read_padded_rows(r, options);
  return detail::allocate_outputs<ScaledRows>(
      x.device, {{dtype, {r.padded_rows, x.shape[1]}}, detail::quant_scales(layout, r.padded_rows, x.shape[1])},
      [&](const ScaledRows& out) {
        Options o = options;
        o.zero_tail = false;  // exactly P rows
        run_quant_spread(r, x, out.rows, out.scales, detail::quant_spec(layout, x.shape[1]), e5m2, o);
      });
}

}  // namespace padmoe
