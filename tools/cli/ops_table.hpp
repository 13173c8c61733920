// ops_table.hpp — the op table that `check` and `bench` both walk: every op
// once, with its library call, the bytes it must move and its reference.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "common.hpp"
#include "report.hpp"
#include "workload_data.hpp"

namespace cli {

// ===========================================================================
// The op table
// ===========================================================================

struct Dims {
  double T, H, A, P, R, N, E, s, m;
  double Pc;  // sort_chunks' padded rows
  double B;   // batched_moe_align_block_size's entries
};

struct OpCase {
  std::string name;
  std::string bytes_rule;  // the footer's formula
  std::function<double(const Dims&)> min_bytes;
  std::function<void(Data&)> run;                       // the library call, into d's outputs
  std::function<std::vector<Expect>(Data&)> reference;  // the reference loops and the outputs to compare
};

std::vector<OpCase> op_table();

// The sizes of d's workload, as the byte formulas take them.
Dims dims_of(const Data& d);

// --ops: a comma-separated list of op names (all ops when absent).
bool op_selected(const Args& args, const std::string& name);

}  // namespace cli
