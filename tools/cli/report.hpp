// report.hpp — expected results and their comparison (check), the header and
// progress lines both commands print, the output sentinel, and JSON helpers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common.hpp"
#include "workload_data.hpp"

namespace cli {

// ===========================================================================
// Expected results and their comparison
// ===========================================================================

enum class Cmp {
  kIndex,  // int32 output equal to the reference
  kMove,   // row output bitwise equal to the reference float rounded to the dtype
  kSum,    // within the tolerance rule of a float64 reference
};

struct Expect {
  std::string what;            // output name, for failure messages
  TensorView got;              // the library's output (1-D, or [rows, H])
  int64_t rows = 0, cols = 1;  // compared extent
  int64_t untouched_rows = 0;  // rows after `rows` that must keep the sentinel
  Cmp cmp = Cmp::kMove;
  std::vector<int64_t> index;                    // kIndex
  std::vector<float> move;                       // kMove
  std::vector<double> sum;                       // kSum
  int64_t terms = 0;                             // kSum: n
  std::function<std::vector<double>()> abs_sum;  // kSum: S per element (computed only by `check`)
};

Expect expect_index(std::string what, const TensorView& got, std::vector<int64_t> ref);
Expect expect_move(std::string what, const TensorView& got, int64_t rows, int64_t cols, std::vector<float> ref);
Expect expect_sum(std::string what, const TensorView& got, int64_t rows, int64_t cols, std::vector<double> ref,
                  int64_t terms, std::function<std::vector<double>()> abs_sum);

struct Outcome {
  double max_err = 0.0;
  double max_tol = 0.0;      // largest tolerance met (sums)
  double worst_ratio = 0.0;  // max err/tol over sums
  bool has_sums = false;
  int64_t rows = 0;
  bool ok = true;
  std::string failure;  // the first failure, in words
};

std::string num(double v);

// Compares e.got with e's reference, folding the result into out.
void compare(const Expect& e, Outcome& out);

std::vector<float> abs_of(const std::vector<float>& v);

int used_threads(const Workload& w);
void print_header(const char* command, const Data& d);
// Large workloads take a while: say what runs now (stderr, so stdout stays a table).
void progress(const char* command, size_t i, size_t n, const std::string& name);
void fill_sentinel(const Data& d, const Tensor& t);
void fill_outputs_with_sentinel(Data& d);

std::string json_escape(const std::string& s);
std::string json_num(double v);

}  // namespace cli
