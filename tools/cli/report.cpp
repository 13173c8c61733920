// report.cpp — comparison, shared printing and JSON helpers (report.hpp).
#include "report.hpp"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

namespace cli {

Expect expect_index(std::string what, const TensorView& got, std::vector<int64_t> ref) {
  Expect e;
  e.what = std::move(what);
  e.got = got;
  e.rows = static_cast<int64_t>(ref.size());
  e.cmp = Cmp::kIndex;
  e.index = std::move(ref);
  return e;
}
Expect expect_move(std::string what, const TensorView& got, int64_t rows, int64_t cols, std::vector<float> ref) {
  Expect e;
  e.what = std::move(what);
  e.got = got;
  e.rows = rows;
  e.cols = cols;
  e.cmp = Cmp::kMove;
  e.move = std::move(ref);
  return e;
}
Expect expect_sum(std::string what, const TensorView& got, int64_t rows, int64_t cols, std::vector<double> ref,
                  int64_t terms, std::function<std::vector<double>()> abs_sum) {
  Expect e;
  e.what = std::move(what);
  e.got = got;
  e.rows = rows;
  e.cols = cols;
  e.cmp = Cmp::kSum;
  e.sum = std::move(ref);
  e.terms = terms;
  e.abs_sum = std::move(abs_sum);
  return e;
}

constexpr unsigned char kSentinel = 0x7f;

std::string num(double v) { return fmt("%.6g", v); }

void compare(const Expect& e, Outcome& out) {
  const TensorView& g = e.got;
  const size_t es = element_size(g.dtype);
  const int64_t row_stride = g.ndim >= 2 ? g.strides[0] : e.cols;
  auto fail = [&](const std::string& msg) {
    if (out.ok) out.failure = msg;
    out.ok = false;
  };
  const int64_t got_rows = g.ndim == 0 ? 0 : g.shape[0];
  if (got_rows < e.rows + e.untouched_rows || (g.ndim >= 2 && g.shape[1] != e.cols)) {
    fail(e.what + ": shape [" + std::to_string(got_rows) + (g.ndim >= 2 ? ", " + std::to_string(g.shape[1]) : "") +
         "], expected at least " + std::to_string(e.rows + e.untouched_rows) + " rows of " + std::to_string(e.cols));
    return;
  }
  std::vector<double> abs_sum;
  if (e.cmp == Cmp::kSum) {
    abs_sum = e.abs_sum();
    out.has_sums = true;
  }
  const double unit = std::ldexp(1.0, -24);
  const double rel = std::ldexp(1.0, -significand_bits(g.dtype));
  const double floor_abs = half_min_subnormal(g.dtype);
  for (int64_t r = 0; r < e.rows; ++r) {
    for (int64_t c = 0; c < e.cols; ++c) {
      const int64_t j = r * e.cols + c;
      const int64_t at = r * row_stride + c;
      auto where = [&] {
        return e.what + "[" + std::to_string(r) + (e.cols > 1 ? ", " + std::to_string(c) : "") + "]";
      };
      if (e.cmp == Cmp::kIndex) {
        const int64_t v = g.dtype == DType::kInt64 ? static_cast<const int64_t*>(g.data)[at]
                                                   : static_cast<const int32_t*>(g.data)[at];
        if (v != e.index[j]) {
          out.max_err = std::max(out.max_err, std::fabs(static_cast<double>(v - e.index[j])));
          fail(where() + " = " + std::to_string(v) + ", expected " + std::to_string(e.index[j]));
        }
      } else if (e.cmp == Cmp::kMove) {
        uint64_t want = 0;
        numeric::store_from_float(&want, g.dtype, 0, e.move[j]);
        const char* p = static_cast<const char*>(g.data) + at * es;
        if (std::memcmp(p, &want, es) != 0) {
          const double got = numeric::load_as_float(g.data, g.dtype, at);
          const double exp = numeric::load_as_float(&want, g.dtype, 0);
          const double err = std::isnan(got) || std::isnan(exp) ? INFINITY : std::fabs(got - exp);
          out.max_err = std::max(out.max_err, err == 0.0 ? std::numeric_limits<double>::denorm_min() : err);
          fail(where() + " = " + num(got) + ", expected " + num(exp) + " (not bitwise equal)");
        }
      } else {
        const double got = numeric::load_as_float(g.data, g.dtype, at);
        const double ref = e.sum[j];
        const double tol = 2.0 * static_cast<double>(e.terms) * unit * abs_sum[j] + rel * std::fabs(ref) + floor_abs;
        const double err = std::isnan(got) ? INFINITY : std::fabs(got - ref);
        out.max_err = std::max(out.max_err, err);
        out.max_tol = std::max(out.max_tol, tol);
        out.worst_ratio = std::max(out.worst_ratio, err / tol);
        if (!(err <= tol)) fail(where() + " = " + num(got) + ", expected " + num(ref) + " within " + num(tol));
      }
    }
  }
  // Rows past the compared extent (capacity rows past P) must be untouched.
  for (int64_t r = e.rows; r < e.rows + e.untouched_rows; ++r) {
    const unsigned char* p = static_cast<const unsigned char*>(g.data) + r * row_stride * es;
    for (int64_t b = 0; b < e.cols * static_cast<int64_t>(es); ++b) {
      if (p[b] != kSentinel) {
        fail(e.what + ": row " + std::to_string(r) + " (past P = " + std::to_string(e.rows) + ") was written");
        r = e.rows + e.untouched_rows;
        break;
      }
    }
  }
}

std::vector<float> abs_of(const std::vector<float>& v) {
  std::vector<float> a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = std::fabs(v[i]);
  return a;
}

// ===========================================================================
// Shared printing
// ===========================================================================

int used_threads(const Workload& w) { return w.threads > 0 ? w.threads : hardware_threads(); }

void print_header(const char* command, const Data& d) {
  const Workload& w = d.w;
  std::printf("padmoe %s: workload %s\n", command, w.label.c_str());
  std::printf("  T=%" PRId64 " E=%d K=%d H=%" PRId64 " m=%d  A=%" PRId64 " P=%" PRId64 " capacity=%" PRId64
              "  dtype %s  device %s  seed %" PRIu64 "\n",
              w.T, w.E, w.K, w.H, w.m, d.A, d.P, d.R, dtype_name(w.dtype), device_name(w.device).c_str(), w.seed);
  if (d.gpu)
    std::printf("  card %s (%s)  %s\n\n", d.gpu->card.c_str(), device_name(w.device).c_str(), utc_now().c_str());
  else
    std::printf("  threads %d (machine: %d hardware threads)  %s\n\n", used_threads(w), hardware_threads(),
                utc_now().c_str());
}

// Large workloads take a while: say what runs now (stderr, so stdout stays a table).
void progress(const char* command, size_t i, size_t n, const std::string& name) {
  std::fprintf(stderr, "[%zu/%zu] %s %s...\n", i + 1, n, command, name.c_str());
}

void fill_sentinel(const Data& d, const Tensor& t) {
  if (!t.defined()) return;
  if (t.device().is_cuda()) gpu_memset(*d.gpu, t, kSentinel);  // ordered on the ops' stream
  else std::memset(t.data(), kSentinel, static_cast<size_t>(t.numel()) * element_size(t.dtype()));
}

void fill_outputs_with_sentinel(Data& d) {
  for (const Tensor* t : output_tensors(d)) fill_sentinel(d, *t);
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) o += ' ';
    else o += c;
  }
  return o;
}

std::string json_num(double v) { return std::isfinite(v) ? fmt("%.6g", v) : "null"; }


}  // namespace cli
