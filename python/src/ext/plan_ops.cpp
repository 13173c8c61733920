// plan_ops.cpp — padmoe._C's plan bindings: the host-side bounds (padded_rows_bound, workspace_bound,
// plan_rows_bound), padded_rows, make_plan_out, and the row ops on a plan object (dispatch,
// make_plan_and_dispatch, combine and their backward).
#include "common.hpp"

namespace padmoe_ext {

void bind_plan(nb::module_& m) {
  m.def(
      "padded_rows_bound",
      [](int64_t num_tokens, int top_k, int num_experts, int alignment) {
        return padmoe::padded_rows_bound(num_tokens, top_k, num_experts, alignment);
      },
      nb::arg("num_tokens"), nb::arg("top_k"), nb::arg("num_experts"), nb::arg("alignment"),
      "Host-side bound on P: num_tokens*top_k + num_experts*(alignment-1).");
  m.def(
      "workspace_bound",
      [](int64_t num_tokens, int top_k, int num_experts, int alignment) {
        return static_cast<uint64_t>(padmoe::workspace_bound(num_tokens, top_k, num_experts, alignment));
      },
      nb::arg("num_tokens"), nb::arg("top_k"), nb::arg("num_experts"), nb::arg("alignment"),
      "Device scratch bytes that suffice for every op on this routing.");

  m.def(
      "padded_rows",
      [](nb::handle plan, uintptr_t stream) {
        PlanArg<In> p;
        read_plan(plan, "padded_rows", "plan", p);
        padmoe::Options o;
        o.stream = reinterpret_cast<void*>(stream);
        nb::gil_scoped_release release;
        return padmoe::padded_rows(p.view, o);
      },
      nb::arg("plan"), nb::kw_only(), nb::arg("stream") = 0,
      "P = plan.padded_bins[E-1], read on the host (on CUDA: synchronizes the stream).");

  m.def(
      "make_plan_out",
      [](const In& top_experts, int num_experts, int alignment, nb::handle out, const OptOut& row_experts,
         const OptOut& block_experts, const OptOut& padded_total, const OptIn& expert_map, int first_expert,
         int global_experts, bool drop_invalid, int64_t expert_capacity, const std::string& drop_policy,
         const OptIn& probs, const OptOut& dropped, PADMOE_OPTION_PARAMS) {
        const char* op = "make_plan";
        const TensorView te = to_view(top_experts, op, "top_experts");
        PlanArg<Out> p;
        read_plan(out, op, "out", p);
        padmoe::PlanLayouts l;  // the layouts other kernels consume, each optional (None: not written)
        l.row_experts = to_out_view(row_experts, op, "layouts.row_experts");
        l.block_experts = to_out_view(block_experts, op, "layouts.block_experts");
        l.padded_total = to_out_view(padded_total, op, "layouts.padded_total");
        padmoe::PlanOptions po;  // expert parallelism, invalid ids, capacity (ops.hpp)
        if (expert_map) po.expert_map = to_view(*expert_map, op, "expert_map");
        po.first_expert = first_expert;
        po.global_experts = global_experts;
        po.drop_invalid = drop_invalid;
        po.expert_capacity = expert_capacity;
        if (drop_policy == "probs") {
          po.drop_policy = padmoe::DropPolicy::kProbs;
        } else if (drop_policy != "position") {
          throw padmoe::Error(padmoe::ErrorKind::kValue, std::string(op) +
                                                             ": drop_policy: expected 'position' or "
                                                             "'probs', got '" +
                                                             drop_policy + "'");
        }
        if (probs) po.probs = to_view(*probs, op, "probs");
        po.dropped = to_out_view(dropped, op, "dropped");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::make_plan_out(te, num_experts, alignment, p.view, l, po, o);
      },
      nb::arg("top_experts"), nb::arg("num_experts"), nb::arg("alignment"), nb::arg("out"),
      nb::arg("row_experts").none() = nb::none(), nb::arg("block_experts").none() = nb::none(),
      nb::arg("padded_total").none() = nb::none(), nb::arg("expert_map").none() = nb::none(),
      nb::arg("first_expert") = 0, nb::arg("global_experts") = 0, nb::arg("drop_invalid") = false,
      nb::arg("expert_capacity") = -1, nb::arg("drop_policy") = "position", nb::arg("probs").none() = nb::none(),
      nb::arg("dropped").none() = nb::none(), PADMOE_OPTIONS);
  m.def(
      "plan_rows_bound",
      [](int64_t num_tokens, int top_k, int num_experts, int alignment, int64_t expert_capacity) {
        padmoe::PlanOptions po;
        po.expert_capacity = expert_capacity;
        return padmoe::plan_rows_bound(num_tokens, top_k, num_experts, alignment, po);
      },
      nb::arg("num_tokens"), nb::arg("top_k"), nb::arg("num_experts"), nb::arg("alignment"),
      nb::arg("expert_capacity") = -1,
      "Rows of row_sources a plan needs: num_experts * expert_capacity with a capacity, else padded_rows_bound.");


  // --- fused plan forms ------------------------------------------------------

  m.def(
      "dispatch_out",
      [](const In& x, nb::handle plan, const OptIn& weights, const Out& y, PADMOE_OPTION_PARAMS) {
        const char* op = "dispatch";
        const TensorView vx = to_view(x, op, "x"), vy = to_view(y, op, "y");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::dispatch_out(vx, p.view, vw, vy, o);
      },
      nb::arg("x"), nb::arg("plan"), nb::arg("weights").none(), nb::arg("y"), PADMOE_OPTIONS);

  // make_plan into `out` (a plan object, as make_plan_out's) and dispatch into y, in one call;
  // every check runs before anything is written.
  m.def(
      "make_plan_and_dispatch_out",
      [](const In& x, const In& top_experts, int num_experts, int alignment, nb::handle out, const OptIn& weights,
         const Out& y, PADMOE_OPTION_PARAMS) {
        const char* op = "make_plan_and_dispatch";
        const TensorView vx = to_view(x, op, "x"), te = to_view(top_experts, op, "top_experts"),
                         vy = to_view(y, op, "y");
        PlanArg<Out> p;
        read_plan(out, op, "out", p);
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::make_plan_and_dispatch_out(vx, te, num_experts, alignment, p.view, vw, vy, o);
      },
      nb::arg("x"), nb::arg("top_experts"), nb::arg("num_experts"), nb::arg("alignment"), nb::arg("out"),
      nb::arg("weights").none(), nb::arg("y"), PADMOE_OPTIONS);

  m.def(
      "combine_out",
      [](const In& y, nb::handle plan, const OptIn& weights, const Out& out, PADMOE_OPTION_PARAMS) {
        const char* op = "combine";
        const TensorView vy = to_view(y, op, "y"), vo = to_view(out, op, "out");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::combine_out(vy, p.view, vw, vo, o);
      },
      nb::arg("y"), nb::arg("plan"), nb::arg("weights").none(), nb::arg("out"), PADMOE_OPTIONS);

  m.def(
      "combine_backward_out",
      [](const In& grad_out, const In& y, nb::handle plan, const OptIn& weights, const Out& grad_y,
         const OptOut& grad_weights, PADMOE_OPTION_PARAMS) {
        const char* op = "combine_backward";
        const TensorView vgo = to_view(grad_out, op, "grad_out"), vy = to_view(y, op, "y"),
                         vgy = to_view(grad_y, op, "grad_y"), vgw = to_out_view(grad_weights, op, "grad_weights");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::combine_backward_out(vgo, vy, p.view, vw, vgy, vgw, o);
      },
      nb::arg("grad_out"), nb::arg("y"), nb::arg("plan"), nb::arg("weights").none(), nb::arg("grad_y"),
      nb::arg("grad_weights").none(), PADMOE_OPTIONS);

  m.def(
      "dispatch_backward_out",
      [](const In& grad_y, const In& x, nb::handle plan, const OptIn& weights, const Out& grad_x,
         const OptOut& grad_weights, PADMOE_OPTION_PARAMS) {
        const char* op = "dispatch_backward";
        const TensorView vgy = to_view(grad_y, op, "grad_y"), vx = to_view(x, op, "x"),
                         vgx = to_view(grad_x, op, "grad_x"), vgw = to_out_view(grad_weights, op, "grad_weights");
        PlanArg<In> p;
        read_plan(plan, op, "plan", p);
        const auto vw = opt_view(weights, op, "weights");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::dispatch_backward_out(vgy, vx, p.view, vw, vgx, vgw, o);
      },
      nb::arg("grad_y"), nb::arg("x"), nb::arg("plan"), nb::arg("weights").none(), nb::arg("grad_x"),
      nb::arg("grad_weights").none(), PADMOE_OPTIONS);
}

}  // namespace padmoe_ext
