// check.cpp — `padmoe check`: every op of the op table on a workload, compared
// with the reference loops.
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "commands.hpp"
#include "ops_table.hpp"
#include "report.hpp"
#include "workload_data.hpp"

namespace cli {

int cmd_check(const Args& args) {
  apply_variants(args);
  const Workload w = parse_workload(args);
  Data d = build_data(w, /*reference=*/true);
  print_header("check", d);
  const std::vector<OpCase> ops = op_table();
  const bool large = static_cast<double>(d.R) * static_cast<double>(w.H) > (1 << 26);

  std::printf("%-38s %12s  %-30s %12s  %s\n", "op", "max abs err", "tolerance / exact", "rows checked", "result");
  int failures = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const OpCase& op = ops[i];
    if (!op_selected(args, op.name)) continue;
    if (large) progress("check", i, ops.size(), op.name);
    Outcome out;
    try {
      fill_outputs_with_sentinel(d);
      op.run(d);
      std::vector<Expect> expects = op.reference(d);
      for (Expect& e : expects) {
        e.got = on_host(d, e.got);  // --device cuda: the whole output, copied back
        compare(e, out);
      }
      out.rows = expects.empty() ? 0 : expects.front().rows;
    } catch (const Error& e) {
      out.ok = false;
      out.failure = std::string("raised padmoe::Error: ") + e.what();
    }
    const std::string tol =
        out.has_sums ? "<= " + num(out.max_tol) + " (err/tol " + fmt("%.3g", out.worst_ratio) + ")" : "exact";
    std::printf("%-38s %12s  %-30s %12" PRId64 "  %s\n", op.name.c_str(), num(out.max_err).c_str(), tol.c_str(),
                out.rows, out.ok ? "PASS" : "FAIL");
    if (!out.ok) {
      std::printf("    first failure: %s\n", out.failure.c_str());
      ++failures;
    }
    std::fflush(stdout);
  }
  const int p = significand_bits(w.dtype);
  std::printf(
      "\nmoves (gather, dispatch, grad_y, pad, unpad, grad_padded): bitwise equal to the reference float\n"
      "  rounded to %s; capacity rows past P must keep their previous contents.\n"
      "sums (scatter, combine, wgrad, grad_x, grad_weights, grad_probs), against a float64 reference:\n"
      "  |got - ref| <= 2*n*2^-24*S + 2^-p*|ref| + 2^-%d (half the smallest %s subnormal),\n"
      "  n = terms summed, S = sum of |terms|, p = 24/11/8 for f32/f16/bf16 (here %d).\n"
      "inputs in padded layout hold NaN in their padding rows (no op may read them); the gather\n"
      "backward grad_x is checked against the weighted scatter (d/dx of w*x).\n",
      dtype_name(w.dtype), -static_cast<int>(std::ilogb(half_min_subnormal(w.dtype))), dtype_name(w.dtype), p);
  if (d.gpu) {
    std::printf(
        "%s: workload built on the host, inputs staged with padmoe::copy, outputs (capacity-sized where padded)\n"
        "  pre-filled with the sentinel on the device, ops in checked mode (check_data=true) on one stream,\n"
        "  each compared output copied back whole.\n",
        device_name(w.device).c_str());
  }
  if (failures == 0) std::printf("%zu ops: all PASS\n", ops.size());
  else std::printf("%zu ops: %d FAIL\n", ops.size(), failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace cli
