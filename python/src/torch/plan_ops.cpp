// plan_ops.cpp — the static path's operators on the packed plan: make_plan, make_plan_routed,
// dispatch, dispatch_backward, make_plan_and_dispatch, combine, combine_backward: their schemas,
// CPU / CUDA kernels and autograd.
//
// The row ops take the plan's sizes beside the plan (top_k, num_experts, alignment and
// expert_capacity: None, or the capacity C the plan was made with) and read it by
// packed_plan.hpp's layout.
#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <utility>

#include "common.hpp"
#include "kernels.hpp"
#include "packed_plan.hpp"

namespace padmoe_torch {
namespace {

// make_plan's sizes before any allocation (in 64 bits, no product that can overflow): E and m
// >= 1 and within int32, A and capacity = A + E*(m-1) (padded_rows_bound) within the int32 outputs.
void check_plan_sizes(const char* op, int64_t t, int64_t k, int64_t num_experts, int64_t alignment) {
  if (num_experts < 1) value_error(op, "num_experts", "must be >= 1, got " + std::to_string(num_experts));
  if (alignment < 1) value_error(op, "alignment", "must be >= 1, got " + std::to_string(alignment));
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (num_experts > kMax)
    value_error(op, "num_experts", "size overflow: " + std::to_string(num_experts) + " does not fit int32");
  if (alignment > kMax)
    value_error(op, "alignment", "size overflow: " + std::to_string(alignment) + " does not fit int32");
  if (k >= 1 && t > kMax / k) {
    value_error(op, "top_experts",
                "size overflow: " + std::to_string(t) + " x " + std::to_string(k) +
                    " assignments do not fit the int32 index outputs");
  }
  const int64_t a = std::max<int64_t>(t * k, 0);
  const int64_t cap = a + num_experts * (alignment - 1);  // padded_rows_bound, at most 2^31 * 2^31
  if (cap > kMax) {
    value_error(op, "capacity", "size overflow: " + std::to_string(cap) + " does not fit the int32 index outputs");
  }
}

// make_plan's CUDA scratch (workspace_bound bytes) from the caching allocator in one call (not
// through scratch_alloc); undefined on the CPU. use_workspace hands it to the op's Options.
Tensor plan_workspace(const Tensor& top, int64_t t, int64_t k, int64_t e, int64_t alignment) {
  if (!top.is_cuda()) return Tensor();
  size_t bytes = 0;
  native([&] {
    try {
      bytes = padmoe::workspace_bound(t, static_cast<int>(std::max<int64_t>(k, 1)), static_cast<int>(e),
                                      static_cast<int>(alignment));
    } catch (const padmoe::Error&) {
      bytes = 0;  // sizes the op rejects: it names them in its own words
    }
  });
  return bytes > 0 ? at::empty({static_cast<int64_t>(bytes)}, top.options().dtype(at::kByte)) : Tensor();
}
void use_workspace(padmoe::Options& o, const Tensor& workspace) {
  if (!workspace.defined()) return;
  o.workspace = workspace.data_ptr();
  o.workspace_bytes = static_cast<size_t>(workspace.numel());
}

}  // namespace

Tensor make_plan_kernel(const Tensor& top_experts_in, int64_t num_experts, int64_t alignment, int64_t check,
                        const OptTensor& weights) {
  const char* op = "make_plan";
  if (top_experts_in.dim() != 2)
    value_error(op, "top_experts", "expected [T, K], got shape " + shape_of(top_experts_in));
  const int64_t t = top_experts_in.size(0), k = top_experts_in.size(1);
  if (weights && weights->defined()) {  // checked here, not first at combine after the expert GEMMs
    const Tensor& w = *weights;
    if (!at::isFloatingType(w.scalar_type()) || w.scalar_type() == at::kFloat8_e4m3fn ||
        w.scalar_type() == at::kFloat8_e5m2) {
      type_error(op, "weights", "expected a float dtype, got " + dtype_name(w.scalar_type()));
    }
    if (w.numel() != t * k) {
      value_error(op, "weights",
                  "expected " + std::to_string(t * k) + " elements ([T, K] = [" + std::to_string(t) + ", " +
                      std::to_string(k) + "]), got shape " + shape_of(w));
    }
    if (w.device() != top_experts_in.device()) {
      type_error(op, "weights",
                 "expected a tensor on " + top_experts_in.device().str() + ", got one on " + w.device().str());
    }
  }
  Tensor top = index_arg(top_experts_in);
  check_plan_sizes(op, t, k, num_experts, alignment);
  const int64_t a = std::max<int64_t>(t * k, 0), e = num_experts;
  c10::OptionalDeviceGuard guard(top.device());
  Tensor out = at::empty({plan_layout(a, e, alignment, std::nullopt).total}, top.options().dtype(at::kInt));
  const Tensor workspace = plan_workspace(top, t, k, e, alignment);
  // The eight arrays as views of `out` (k = 0 columns: padmoe's make_plan reports top_k itself).
  const padmoe::PlanView pv = packed_plan(out, std::max<int64_t>(k, 1), e, alignment, std::nullopt, op).view(op);
  padmoe::Options o = options_for(top, check);
  use_workspace(o, workspace);
  native([&] {
    padmoe::make_plan_out(view(top, op, "top_experts"), static_cast<int>(num_experts), static_cast<int>(alignment), pv,
                          o);
  });
  return out;
}

// make_plan with PlanOptions (expert parallelism, invalid ids, an expert capacity): the packed plan
// and the [1] int32 dropped count. With a capacity C the packed plan holds E*C row_sources and the
// row ops take expert_capacity = C for it beside its alignment (packed_plan.hpp).
std::tuple<Tensor, Tensor> make_plan_routed_kernel(const Tensor& top_experts_in, int64_t num_experts, int64_t alignment,
                                                   const OptTensor& expert_map, int64_t first_expert,
                                                   int64_t global_experts, bool drop_invalid, OptInt expert_capacity,
                                                   bool by_probs, const OptTensor& probs, int64_t check) {
  const char* op = "make_plan";
  if (top_experts_in.dim() != 2)
    value_error(op, "top_experts", "expected [T, K], got shape " + shape_of(top_experts_in));
  const int64_t t = top_experts_in.size(0), k = top_experts_in.size(1);
  Tensor top = index_arg(top_experts_in);
  if (num_experts < 1) value_error(op, "num_experts", "must be >= 1, got " + std::to_string(num_experts));
  if (alignment < 1) value_error(op, "alignment", "must be >= 1, got " + std::to_string(alignment));
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (num_experts > kMax)
    value_error(op, "num_experts", "size overflow: " + std::to_string(num_experts) + " does not fit int32");
  if (alignment > kMax)
    value_error(op, "alignment", "size overflow: " + std::to_string(alignment) + " does not fit int32");
  for (const auto& [name, v] :
       {std::pair<const char*, int64_t>{"first_expert", first_expert}, {"global_experts", global_experts}}) {
    if (v < std::numeric_limits<int32_t>::min() || v > kMax)
      value_error(op, name, "does not fit int32: " + std::to_string(v));
  }
  if (k >= 1 && t > kMax / k) {
    value_error(op, "top_experts",
                "size overflow: " + std::to_string(t) + " x " + std::to_string(k) +
                    " assignments do not fit the int32 index outputs");
  }
  if (expert_capacity && *expert_capacity < 0) {
    value_error(op, "expert_capacity", "must be >= 0 (or None), got " + std::to_string(*expert_capacity));
  }
  const int64_t a = std::max<int64_t>(t * k, 0), e = num_experts;
  if (expert_capacity && *expert_capacity > kMax / e) {
    value_error(op, "expert_capacity",
                "size overflow: " + std::to_string(e) + " experts x capacity " + std::to_string(*expert_capacity) +
                    " rows do not fit the int32 index outputs");
  }
  const int64_t cap = expert_capacity ? e * *expert_capacity : a + e * (alignment - 1);
  if (cap > kMax)
    value_error(op, "capacity", "size overflow: " + std::to_string(cap) + " does not fit the int32 index outputs");
  c10::OptionalDeviceGuard guard(top.device());
  Tensor out = at::empty({plan_layout(a, e, alignment, expert_capacity).total}, top.options().dtype(at::kInt));
  Tensor dropped = at::empty({1}, top.options().dtype(at::kInt));
  const Tensor workspace = plan_workspace(top, t, k, e, alignment);
  const padmoe::PlanView pv = packed_plan(out, std::max<int64_t>(k, 1), e, alignment, expert_capacity, op).view(op);
  padmoe::PlanView pvm = pv;
  pvm.alignment = static_cast<int>(alignment);
  padmoe::Options o = options_for(top, check);
  use_workspace(o, workspace);
  Tensor map = expert_map && expert_map->defined() ? index_arg(*expert_map) : Tensor();
  OptTensor pr;  // ranked as float32 (float64 router weights are rounded once)
  if (probs && probs->defined()) {
    pr = probs->scalar_type() == at::kDouble ? probs->to(at::kFloat) : probs->contiguous();
  }
  padmoe::PlanOptions po;
  if (map.defined()) po.expert_map = view(map, op, "expert_map");
  po.first_expert = static_cast<int>(first_expert);
  po.global_experts = static_cast<int>(global_experts);
  po.drop_invalid = drop_invalid;
  po.expert_capacity = expert_capacity.value_or(-1);
  po.drop_policy = by_probs ? padmoe::DropPolicy::kProbs : padmoe::DropPolicy::kPosition;
  if (pr) po.probs = view(*pr, op, "probs");
  po.dropped = view(dropped, op, "dropped");
  native([&] {
    padmoe::make_plan_out(view(top, op, "top_experts"), static_cast<int>(num_experts), static_cast<int>(alignment), pvm,
                          padmoe::PlanLayouts{}, po, o);
  });
  return {out, dropped};
}

Tensor dispatch_kernel(const Tensor& x_in, const Tensor& plan, const OptTensor& weights, int64_t top_k,
                       int64_t num_experts, int64_t alignment, OptInt expert_capacity, int64_t check,
                       bool zero_padding) {
  const char* op = "dispatch";
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, expert_capacity, op);
  if (is_f64(x_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::dispatch_out(shadow(x_in), pp.view(op), opt_view(w, op, "weights"), shadow_rows(pp.cap, x_in),
                           options_for(x_in, check));
    });
    return spread64(x_in, pp.dest_rows(), top_k, weights, pp.cap);
  }
  Tensor x = rows_arg(x_in);
  OptTensor w = scale_arg(weights);
  Tensor y = at::empty({pp.cap, x.dim() == 2 ? x.size(1) : 0}, x.options());
  c10::OptionalDeviceGuard guard(x.device());
  const padmoe::PlanView pv = pp.view(op);
  padmoe::Options o = options_for(x, check, /*zero_tail=*/zero_padding);
  o.zero_padding = zero_padding;  // false: padding rows (and the rows past P) left unwritten
  native([&] { padmoe::dispatch_out(view(x, op, "x"), pv, opt_view(w, op, "weights"), view(y, op, "y"), o); });
  return y;
}

// make_plan then dispatch in one call (padmoe::make_plan_and_dispatch_out: make_plan's launch then
// dispatch's): (y [capacity, H], the packed plan), make_plan's plan and dispatch's y bit for
// bit. Every check (make_plan's on top_experts, dispatch's on x and weights) runs before anything
// is written. CUDA scratch: one caching-allocator tensor of workspace_bound bytes, as make_plan's.
std::tuple<Tensor, Tensor> make_plan_and_dispatch_kernel(const Tensor& x_in, const Tensor& top_experts_in,
                                                         int64_t num_experts, int64_t alignment,
                                                         const OptTensor& weights, int64_t check, bool zero_padding) {
  const char* op = "make_plan_and_dispatch";
  if (top_experts_in.dim() != 2)
    value_error(op, "top_experts", "expected [T, K], got shape " + shape_of(top_experts_in));
  const int64_t t = top_experts_in.size(0), k = top_experts_in.size(1);
  check_plan_sizes(op, t, k, num_experts, alignment);
  const int64_t a = std::max<int64_t>(t * k, 0), e = num_experts;
  Tensor top = index_arg(top_experts_in);
  const bool f64 = is_f64(x_in);
  Tensor x = f64 ? x_in : rows_arg(x_in);
  OptTensor w = scale_arg(weights);
  c10::OptionalDeviceGuard guard(top.device());
  Tensor plan = at::empty({plan_layout(a, e, alignment, std::nullopt).total}, top.options().dtype(at::kInt));
  const Tensor workspace = plan_workspace(top, t, k, e, alignment);
  // k = 0 columns: padmoe reports top_k itself
  const PackedPlan pp = packed_plan(plan, std::max<int64_t>(k, 1), e, alignment, std::nullopt, op);
  const padmoe::PlanView pv = pp.view(op);
  // the views in the order padmoe checks them (top_experts, x, weights, y): the first bad one is reported
  const TensorView vt = view(top, op, "top_experts");
  const TensorView vx = f64 ? shadow(x) : view(x, op, "x");
  const std::optional<TensorView> vw = opt_view(w, op, "weights");
  Tensor y = f64 ? Tensor() : at::empty({pp.cap, x.dim() == 2 ? x.size(1) : 0}, x.options());
  const TensorView vy = f64 ? shadow_rows(pp.cap, x) : view(y, op, "y");
  padmoe::Options o = options_for(top, check, /*zero_tail=*/zero_padding || f64);
  o.zero_padding = zero_padding || f64;  // false: padding rows (and the rows past P) left unwritten
  use_workspace(o, workspace);
  native([&] {
    padmoe::make_plan_and_dispatch_out(vx, vt, static_cast<int>(num_experts), static_cast<int>(alignment), pv, vw, vy,
                                       o);
  });
  if (f64) y = spread64(x_in, pp.dest_rows(), pp.k, weights, pp.cap);
  return {y, plan};
}

Tensor combine_kernel(const Tensor& y_in, const Tensor& plan, const OptTensor& weights, int64_t top_k,
                      int64_t num_experts, int64_t alignment, OptInt expert_capacity, int64_t check) {
  const char* op = "combine";
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, expert_capacity, op);
  if (is_f64(y_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::combine_out(shadow(y_in), pp.view(op), opt_view(w, op, "weights"), shadow_rows(pp.tokens, y_in),
                          options_for(y_in, check));
    });
    return reduce64(y_in, pp.dest_rows(), top_k, weights);
  }
  Tensor y = rows_arg(y_in);
  OptTensor w = scale_arg(weights);
  Tensor out = at::empty({pp.tokens, y.dim() == 2 ? y.size(1) : 0}, y.options());
  c10::OptionalDeviceGuard guard(y.device());
  const padmoe::PlanView pv = pp.view(op);
  const padmoe::Options o = options_for(y, check);
  native([&] { padmoe::combine_out(view(y, op, "y"), pv, opt_view(w, op, "weights"), view(out, op, "out"), o); });
  return out;
}

// y (combine's input) is needed only for the weight gradient; without it
// (None) grad_y has `rows` rows (-1: the plan's capacity) of grad_out's dtype.
std::tuple<Tensor, Tensor> combine_backward_kernel(const Tensor& grad_out_in, const OptTensor& y_in, const Tensor& plan,
                                                   const OptTensor& weights, int64_t top_k, int64_t num_experts,
                                                   int64_t alignment, OptInt expert_capacity, bool need_wgrad,
                                                   int64_t check, int64_t rows) {
  const char* op = "combine_backward";
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, expert_capacity, op);
  const bool have_y = y_in && y_in->defined();
  const bool want_w = need_wgrad && weights && weights->defined();
  if (want_w && !have_y) value_error(op, "y", "needed for the weight gradient");
  if (rows < 0) rows = have_y && y_in->dim() >= 1 ? y_in->size(0) : pp.cap;
  if (is_f64(grad_out_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::combine_backward_out(shadow(grad_out_in), have_y ? shadow(*y_in) : shadow_rows(rows, grad_out_in),
                                   pp.view(op), opt_view(w, op, "weights"), shadow_rows(rows, grad_out_in),
                                   TensorView{}, options_for(grad_out_in, check));
    });
    Tensor gy = spread64(grad_out_in, pp.dest_rows(), top_k, weights, rows);
    Tensor gw = want_w ? dots64(*y_in, pp.dest_rows(), top_k, grad_out_in).to(weights->scalar_type())
                       : no_grad_placeholder(grad_out_in, weights);
    return {gy, gw};
  }
  Tensor grad_out = rows_arg(grad_out_in);
  OptTensor w = scale_arg(weights);
  const int64_t cols = grad_out.dim() == 2 ? grad_out.size(1) : 0;
  Tensor gy = at::empty({rows, cols}, have_y ? y_in->options() : grad_out.options());
  Tensor y = have_y ? rows_arg(*y_in) : gy;  // without the weight gradient y gives only its shape and dtype
  Tensor gw = want_w ? wgrad_buffer(*weights, pp.a) : Tensor();
  c10::OptionalDeviceGuard guard(grad_out.device());
  const padmoe::PlanView pv = pp.view(op);
  const padmoe::Options o = options_for(grad_out, check, /*zero_tail=*/true);
  native([&] {
    padmoe::combine_backward_out(view(grad_out, op, "grad_out"), view(y, op, "y"), pv, opt_view(w, op, "weights"),
                                 view(gy, op, "grad_y"), want_w ? view(gw, op, "grad_weights") : TensorView{}, o);
  });
  return {gy, want_w ? as_weights_dtype(gw, weights) : no_grad_placeholder(grad_out, weights)};
}

// x (dispatch's input) is needed only for the weight gradient; without it
// (None) grad_x is [T, H] of grad_y's dtype.
std::tuple<Tensor, Tensor> dispatch_backward_kernel(const Tensor& grad_y_in, const OptTensor& x_in, const Tensor& plan,
                                                    const OptTensor& weights, int64_t top_k, int64_t num_experts,
                                                    int64_t alignment, OptInt expert_capacity, bool need_wgrad,
                                                    int64_t check) {
  const char* op = "dispatch_backward";
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, expert_capacity, op);
  const bool have_x = x_in && x_in->defined();
  const bool want_w = need_wgrad && weights && weights->defined();
  if (want_w && !have_x) value_error(op, "x", "needed for the weight gradient");
  if (is_f64(grad_y_in)) {
    OptTensor w = scale_arg(weights);
    native([&] {
      padmoe::dispatch_backward_out(shadow(grad_y_in), have_x ? shadow(*x_in) : shadow_rows(pp.tokens, grad_y_in),
                                    pp.view(op), opt_view(w, op, "weights"),
                                    have_x ? shadow(*x_in) : shadow_rows(pp.tokens, grad_y_in), TensorView{},
                                    options_for(grad_y_in, check));
    });
    Tensor gx = reduce64(grad_y_in, pp.dest_rows(), top_k, weights);
    Tensor gw = want_w ? dots64(grad_y_in, pp.dest_rows(), top_k, *x_in).to(weights->scalar_type())
                       : no_grad_placeholder(grad_y_in, weights);
    return {gx, gw};
  }
  Tensor grad_y = rows_arg(grad_y_in);
  OptTensor w = scale_arg(weights);
  Tensor gx = have_x ? at::empty(x_in->sizes(), x_in->options())
                     : at::empty({pp.tokens, grad_y.dim() == 2 ? grad_y.size(1) : 0}, grad_y.options());
  Tensor x = have_x ? rows_arg(*x_in) : gx;  // without the weight gradient x gives only its shape and dtype
  Tensor gw = want_w ? wgrad_buffer(*weights, pp.a) : Tensor();
  c10::OptionalDeviceGuard guard(grad_y.device());
  const padmoe::PlanView pv = pp.view(op);
  const padmoe::Options o = options_for(grad_y, check);
  native([&] {
    padmoe::dispatch_backward_out(view(grad_y, op, "grad_y"), view(x, op, "x"), pv, opt_view(w, op, "weights"),
                                  view(gx, op, "grad_x"), want_w ? view(gw, op, "grad_weights") : TensorView{}, o);
  });
  return {gx, want_w ? as_weights_dtype(gw, weights) : no_grad_placeholder(grad_y, weights)};
}

namespace {

// Static path: dispatch / combine on a plan. Edges: (rows, weights).
struct PlanOpBackward : Node {
  bool is_combine = false;
  Tensor plan;  // the packed int32 plan of make_plan: never differentiable
  Saved rows;   // dispatch's x / combine's y, saved only for the weight gradient
  Saved weights;
  std::vector<int64_t> weight_shape;
  int64_t top_k = 1, num_experts = 1, alignment = 1, check = 0, row_count = 0;
  OptInt expert_capacity;
  bool need_w = false;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(2);
    Tensor r = rows.get(), w = weights.get();
    Tensor g_rows, g_w;
    if (is_combine) {
      static auto op = handle<decltype(combine_backward_kernel)>("padmoe::combine_backward");
      std::tie(g_rows, g_w) = op.call(grads[0], optional_of(r), plan, optional_of(w), top_k, num_experts, alignment,
                                      expert_capacity, need_w, check, row_count);
    } else {
      static auto op = handle<decltype(dispatch_backward_kernel)>("padmoe::dispatch_backward");
      std::tie(g_rows, g_w) = op.call(grads[0], optional_of(r), plan, optional_of(w), top_k, num_experts, alignment,
                                      expert_capacity, need_w, check);
    }
    return {g_rows, need_w ? shaped_as(g_w, weight_shape) : Tensor()};
  }
  void release_variables() override {
    rows.release();
    weights.release();
    plan = Tensor();
  }
  std::string name() const override { return is_combine ? "padmoe::CombineBackward" : "padmoe::DispatchBackward"; }
};

// Attaches the PlanOpBackward node of dispatch / combine on `plan` to their output `out`.
void record_plan_op(bool is_combine, const Tensor& out, const Tensor& rows, const Tensor& plan,
                    const OptTensor& weights, int64_t top_k, int64_t num_experts, int64_t alignment,
                    OptInt expert_capacity, int64_t check) {
  NodePtr node = new_node<PlanOpBackward>();
  auto* n = static_cast<PlanOpBackward*>(node.get());
  n->set_next_edges(torch::autograd::collect_next_edges(rows, weights));
  n->is_combine = is_combine;
  n->plan = plan;
  n->need_w = wants_grad(weights);
  if (n->need_w) {
    n->rows.save(rows);
    n->weight_shape = weights->sizes().vec();
  }
  if (weights) n->weights.save(*weights);
  n->top_k = top_k;
  n->num_experts = num_experts;
  n->alignment = alignment;
  n->expert_capacity = expert_capacity;
  n->check = backward_check(check);
  n->row_count = rows.dim() >= 1 ? rows.size(0) : 0;
  torch::autograd::set_history(out, node);
}

Tensor plan_op_autograd(bool is_combine, const Tensor& rows, const Tensor& plan, const OptTensor& weights,
                        int64_t top_k, int64_t num_experts, int64_t alignment, OptInt expert_capacity, int64_t check,
                        bool zero_padding = true) {
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    if (is_combine) {
      static auto op = handle<decltype(combine_kernel)>("padmoe::combine");
      out = op.call(rows, plan, weights, top_k, num_experts, alignment, expert_capacity, check);
    } else {
      static auto op = handle<decltype(dispatch_kernel)>("padmoe::dispatch");
      out = op.call(rows, plan, weights, top_k, num_experts, alignment, expert_capacity, check, zero_padding);
    }
  }
  if (recording(rows, weights)) {
    record_plan_op(is_combine, out, rows, plan, weights, top_k, num_experts, alignment, expert_capacity, check);
  }
  return out;
}

Tensor dispatch_autograd(const Tensor& x, const Tensor& plan, const OptTensor& weights, int64_t top_k,
                         int64_t num_experts, int64_t alignment, OptInt expert_capacity, int64_t check,
                         bool zero_padding) {
  return plan_op_autograd(false, x, plan, weights, top_k, num_experts, alignment, expert_capacity, check, zero_padding);
}
Tensor combine_autograd(const Tensor& y, const Tensor& plan, const OptTensor& weights, int64_t top_k,
                        int64_t num_experts, int64_t alignment, OptInt expert_capacity, int64_t check) {
  return plan_op_autograd(true, y, plan, weights, top_k, num_experts, alignment, expert_capacity, check);
}

// make_plan_and_dispatch: y differentiable wrt x and weights exactly as dispatch's (the same node:
// its backward is dispatch_backward on the returned plan); the plan output never is.
std::tuple<Tensor, Tensor> make_plan_and_dispatch_autograd(const Tensor& x, const Tensor& top_experts,
                                                           int64_t num_experts, int64_t alignment,
                                                           const OptTensor& weights, int64_t check, bool zero_padding) {
  std::tuple<Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = handle<decltype(make_plan_and_dispatch_kernel)>("padmoe::make_plan_and_dispatch");
    out = op.call(x, top_experts, num_experts, alignment, weights, check, zero_padding);
  }
  if (recording(x, weights)) {
    record_plan_op(false, std::get<0>(out), x, std::get<1>(out), weights, top_experts.size(1), num_experts, alignment,
                   std::nullopt, check);
  }
  return out;
}

std::tuple<Tensor, Tensor> make_plan_routed_autograd(const Tensor& top_experts, int64_t num_experts, int64_t alignment,
                                                     const OptTensor& expert_map, int64_t first_expert,
                                                     int64_t global_experts, bool drop_invalid, OptInt expert_capacity,
                                                     bool by_probs, const OptTensor& probs, int64_t check) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(make_plan_routed_kernel)>("padmoe::make_plan_routed");
  return op.call(top_experts, num_experts, alignment, expert_map, first_expert, global_experts, drop_invalid,
                 expert_capacity, by_probs, probs, check);
}

// Integer outputs only: never differentiable.
Tensor make_plan_autograd(const Tensor& top_experts, int64_t num_experts, int64_t alignment, int64_t check,
                          const OptTensor& weights) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(make_plan_kernel)>("padmoe::make_plan");
  return op.call(top_experts, num_experts, alignment, check, weights);
}

}  // namespace

// --- registration ---------------------------------------------------------------------

TORCH_LIBRARY_FRAGMENT(padmoe, m) {
  m.def("make_plan(Tensor top_experts, int num_experts, int alignment, int check=2, Tensor? weights=None) -> Tensor");
  m.def(
      "make_plan_routed(Tensor top_experts, int num_experts, int alignment, Tensor? expert_map, int first_expert, "
      "int global_experts, bool drop_invalid, int? expert_capacity, bool by_probs, Tensor? probs, int check=2) "
      "-> (Tensor, Tensor)");
  m.def(
      "dispatch(Tensor x, Tensor plan, Tensor? weights, int top_k, int num_experts, int alignment, "
      "int? expert_capacity, int check=2, bool zero_padding=True) -> Tensor");
  m.def(
      "dispatch_backward(Tensor grad_y, Tensor? x, Tensor plan, Tensor? weights, int top_k, int num_experts, "
      "int alignment, int? expert_capacity, bool need_wgrad, int check=2) -> (Tensor, Tensor)");
  m.def(
      "make_plan_and_dispatch(Tensor x, Tensor top_experts, int num_experts, int alignment, Tensor? weights=None, "
      "int check=2, bool zero_padding=True) -> (Tensor, Tensor)");
  m.def(
      "combine(Tensor y, Tensor plan, Tensor? weights, int top_k, int num_experts, int alignment, "
      "int? expert_capacity, int check=2) -> Tensor");
  m.def(
      "combine_backward(Tensor grad_out, Tensor? y, Tensor plan, Tensor? weights, int top_k, int num_experts, "
      "int alignment, int? expert_capacity, bool need_wgrad, int check=2, int rows=-1) -> (Tensor, Tensor)");
}

#define PADMOE_TORCH_PLAN_KERNELS(m)                               \
  m.impl("make_plan", make_plan_kernel);                           \
  m.impl("make_plan_routed", make_plan_routed_kernel);             \
  m.impl("dispatch", dispatch_kernel);                             \
  m.impl("dispatch_backward", dispatch_backward_kernel);           \
  m.impl("make_plan_and_dispatch", make_plan_and_dispatch_kernel); \
  m.impl("combine", combine_kernel);                               \
  m.impl("combine_backward", combine_backward_kernel)

TORCH_LIBRARY_IMPL(padmoe, CPU, m) { PADMOE_TORCH_PLAN_KERNELS(m); }
#ifdef PADMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(padmoe, CUDA, m) { PADMOE_TORCH_PLAN_KERNELS(m); }
#endif
#undef PADMOE_TORCH_PLAN_KERNELS

TORCH_LIBRARY_IMPL(padmoe, Autograd, m) {
  m.impl("make_plan", make_plan_autograd);
  m.impl("make_plan_routed", make_plan_routed_autograd);
  m.impl("dispatch", dispatch_autograd);
  m.impl("make_plan_and_dispatch", make_plan_and_dispatch_autograd);
  m.impl("combine", combine_autograd);
}

}  // namespace padmoe_torch
