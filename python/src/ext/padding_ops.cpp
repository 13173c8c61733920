// padding_ops.cpp — padmoe._C's bindings of Megatron's drop-ins: pad_to_alignment (and its row
// count pad_to_alignment_rows), unpad_from_alignment and its backward.
#include "common.hpp"

namespace padmoe_ext {

void bind_padding(nb::module_& m) {
  // --- Megatron family -------------------------------------------------------

  m.def(
      "pad_to_alignment_out",
      [](const In& hidden_states, const In& tokens_per_expert, int alignment, const Out& padded,
         const Out& permutation_map, const Out& inclusive_offsets, PADMOE_OPTION_PARAMS) {
        const char* op = "pad_to_alignment";
        const TensorView vh = to_view(hidden_states, op, "hidden_states"),
                         vt = to_view(tokens_per_expert, op, "tokens_per_expert"), vp = to_view(padded, op, "padded"),
                         vm = to_view(permutation_map, op, "permutation_map"),
                         vo = to_view(inclusive_offsets, op, "inclusive_offsets");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::pad_to_alignment_out(vh, vt, alignment, vp, vm, vo, o);
      },
      nb::arg("hidden_states"), nb::arg("tokens_per_expert"), nb::arg("alignment"), nb::arg("padded"),
      nb::arg("permutation_map"), nb::arg("inclusive_offsets"), PADMOE_OPTIONS);

  m.def(
      "pad_to_alignment_rows",
      [](const In& hidden_states, const In& tokens_per_expert, int alignment, PADMOE_OPTION_PARAMS) {
        const char* op = "pad_to_alignment";
        const TensorView vh = to_view(hidden_states, op, "hidden_states"),
                         vt = to_view(tokens_per_expert, op, "tokens_per_expert");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        return padmoe::pad_to_alignment_rows(vh, vt, alignment, o);
      },
      nb::arg("hidden_states"), nb::arg("tokens_per_expert"), nb::arg("alignment"), PADMOE_OPTIONS,
      "P for these inputs, after pad_to_alignment's checks (CUDA: one synchronization).");

  m.def(
      "unpad_from_alignment_out",
      [](const In& padded, const In& permutation_map, const OptIn& probs, const Out& out, PADMOE_OPTION_PARAMS) {
        const char* op = "unpad_from_alignment";
        const TensorView vp = to_view(padded, op, "padded_output"),
                         vm = to_view(permutation_map, op, "permutation_map"), vo = to_view(out, op, "out");
        const auto vpr = opt_view(probs, op, "probs");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::unpad_from_alignment_out(vp, vm, vpr, vo, o);
      },
      nb::arg("padded"), nb::arg("permutation_map"), nb::arg("probs").none(), nb::arg("out"), PADMOE_OPTIONS);

  m.def(
      "unpad_from_alignment_backward_out",
      [](const In& grad_out, const In& padded, const In& permutation_map, const OptIn& probs, const Out& grad_padded,
         const OptOut& grad_probs, PADMOE_OPTION_PARAMS) {
        const char* op = "unpad_from_alignment_backward";
        const TensorView vgo = to_view(grad_out, op, "grad_out"), vp = to_view(padded, op, "padded_output"),
                         vm = to_view(permutation_map, op, "permutation_map"),
                         vgp = to_view(grad_padded, op, "grad_padded"),
                         vgpr = to_out_view(grad_probs, op, "grad_probs");
        const auto vpr = opt_view(probs, op, "probs");
        const padmoe::Options o = PADMOE_OPTS(op);
        nb::gil_scoped_release release;
        padmoe::unpad_from_alignment_backward_out(vgo, vp, vm, vpr, vgp, vgpr, o);
      },
      nb::arg("grad_out"), nb::arg("padded"), nb::arg("permutation_map"), nb::arg("probs").none(),
      nb::arg("grad_padded"), nb::arg("grad_probs").none(), PADMOE_OPTIONS);
}

}  // namespace padmoe_ext
