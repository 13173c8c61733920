// chunks_ops.cpp — padmoe._C's bindings of the expert-parallel chunk sort: sort_chunks_out,
// sort_chunks_rows (P after the checks) and sort_chunks_rows_bound (a host-side bound on P).
#include "common.hpp"

namespace padmoe_ext {

void bind_chunks(nb::module_& m) {
  // --- expert parallelism: chunk sort --------------------------------------------

  m.def(
      "sort_chunks_out",
      [](const In& received, const In& split_sizes, int num_ranks, int alignment, const OptIn& sorted_index,
         const Out& padded, const Out& permutation_map, const Out& inclusive_offsets, PADMOE_OPTION_PARAMS) {
        const char* op = "sort_chunks";
        const TensorView vr = to_view(received, op, "received"), vs = to_view(split_sizes, op, "split_sizes"),
                         vp = to_view(padded, op, "padded"), vm = to_view(permutation_map, op, "permutation_map"),
                         vo = to_view(inclusive_offsets, op, "inclusive_offsets");
        const auto vsi = opt_view(sorted_index, op, "sorted_index");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::sort_chunks_out(vr, vs, num_ranks, alignment, vsi, vp, vm, vo, o);
      },
      nb::arg("received"), nb::arg("split_sizes"), nb::arg("num_ranks"), nb::arg("alignment"),
      nb::arg("sorted_index").none(), nb::arg("padded"), nb::arg("permutation_map"), nb::arg("inclusive_offsets"),
      PADMOE_OPTIONS);
  m.def(
      "sort_chunks_rows",
      [](const In& received, const In& split_sizes, int num_ranks, int alignment, const OptIn& sorted_index,
         PADMOE_OPTION_PARAMS) {
        const char* op = "sort_chunks";
        const TensorView vr = to_view(received, op, "received"), vs = to_view(split_sizes, op, "split_sizes");
        const auto vsi = opt_view(sorted_index, op, "sorted_index");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        return padmoe::sort_chunks_rows(vr, vs, num_ranks, alignment, vsi, o);
      },
      nb::arg("received"), nb::arg("split_sizes"), nb::arg("num_ranks"), nb::arg("alignment"),
      nb::arg("sorted_index").none(), PADMOE_OPTIONS,
      "P for these inputs, after sort_chunks' checks (CUDA: one synchronization).");
  m.def(
      "sort_chunks_rows_bound",
      [](int64_t received_rows, int64_t num_chunks, int num_ranks, int alignment) {
        return padmoe::sort_chunks_rows_bound(received_rows, num_chunks, num_ranks, alignment);
      },
      nb::arg("received_rows"), nb::arg("num_chunks"), nb::arg("num_ranks"), nb::arg("alignment"),
      "Host-side bound on sort_chunks' P: received_rows + (num_chunks / num_ranks) * (alignment - 1).");
}

}  // namespace padmoe_ext
