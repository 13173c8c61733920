// test_util.hpp — helpers shared by the padmoe test suite: a seeded RNG,
// tensors built from / read back into float vectors, poison-filled outputs,
// and comparisons against the reference (bitwise for moves, a stated float32
// tolerance for sums).
//
// Tolerance for a sum of n terms (products formed and accumulated in float32
// by the library, in double by the reference) with absolute sum S = sum |term|:
//     |lib - ref| <= 2 * n * 2^-24 * S          (float32 accumulation, rounding of each product)
//                  + 2^-p * |ref| * 1.01        (the single cast to the output dtype, p = 24 f32, 11 f16, 8 bf16)
//                  + smallest subnormal of the output dtype
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "padmoe/error.hpp"
#include "padmoe/numeric.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"
#include "reference/reference.hpp"
#include "rng.hpp"

namespace pt {

using padmoe::DType;
using padmoe::Tensor;
using padmoe::TensorView;
namespace ref = padmoe::ref;
namespace num = padmoe::numeric;

constexpr unsigned char kPoison = 0xFF;       // rows: NaN in every float format
constexpr unsigned char kIndexPoison = 0x5A;  // index buffers: 0x5A5A5A5A (never a valid value here)

// The seeded RNG: rng.hpp.


inline int mantissa_bits(DType d) {  // p: precision incl. the implicit bit
  switch (d) {
    case DType::kFloat32: return 24;
    case DType::kFloat16: return 11;
    case DType::kBFloat16: return 8;
    case DType::kFloat8E4M3: return 4;
    case DType::kFloat8E5M2: return 3;
    default: return 24;
  }
}
inline double min_subnormal(DType d) {
  switch (d) {
    case DType::kFloat32: return std::ldexp(1.0, -149);
    case DType::kFloat16: return std::ldexp(1.0, -24);
    case DType::kBFloat16: return std::ldexp(1.0, -133);
    case DType::kFloat8E4M3: return std::ldexp(1.0, -9);
    case DType::kFloat8E5M2: return std::ldexp(1.0, -16);
    default: return 0.0;
  }
}
inline size_t esize(DType d) {
  switch (d) {
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    default: return 1;
  }
}
inline const char* dname(DType d) {
  switch (d) {
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat8E4M3: return "e4m3";
    case DType::kFloat8E5M2: return "e5m2";
    case DType::kInt32: return "i32";
    case DType::kInt64: return "i64";
    case DType::kUInt8: return "u8";
  }
  return "?";
}

// ---------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------
inline Tensor filled(DType dtype, std::initializer_list<int64_t> shape, unsigned char byte) {
  Tensor t = Tensor::empty(dtype, shape);
  if (t.numel() > 0) std::memset(t.data(), byte, static_cast<size_t>(t.numel()) * esize(dtype));
  return t;
}
inline Tensor poison_rows(DType dtype, int64_t rows, int64_t cols) { return filled(dtype, {rows, cols}, kPoison); }
inline Tensor poison_index(int64_t n) { return filled(DType::kInt32, {n}, kIndexPoison); }

inline Tensor rows_from_float(const std::vector<float>& v, DType dtype, int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty(dtype, {rows, cols});
  for (int64_t i = 0; i < rows * cols; ++i) num::store_from_float(t.data(), dtype, i, v[static_cast<size_t>(i)]);
  return t;
}
inline Tensor vec_from_float(const std::vector<float>& v, DType dtype) {
  Tensor t = Tensor::empty(dtype, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) num::store_from_float(t.data(), dtype, static_cast<int64_t>(i), v[i]);
  return t;
}

// Element (r, c) address of a (possibly strided) 2-D row view, or element r of a 1-D view.
inline const unsigned char* elem_ptr(const TensorView& v, int64_t r, int64_t c) {
  const int64_t off = v.ndim == 1 ? r * v.strides[0] : r * v.strides[0] + c * v.strides[1];
  return static_cast<const unsigned char*>(v.data) + off * static_cast<int64_t>(esize(v.dtype));
}
inline float elem_float(const TensorView& v, int64_t r, int64_t c) {
  return num::load_as_float(elem_ptr(v, r, c), v.dtype, 0);
}

// All of a 2-D row view (or columns [c0, c1) of it) as floats, row-major.
inline std::vector<float> rows_to_float(const TensorView& v, int64_t c0 = 0, int64_t c1 = -1) {
  const int64_t rows = v.shape[0];
  const int64_t cols = v.ndim == 1 ? 1 : v.shape[1];
  if (c1 < 0) c1 = cols;
  const int64_t w = c1 - c0;
  std::vector<float> out(static_cast<size_t>(rows * w));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < w; ++c) out[static_cast<size_t>(r * w + c)] = elem_float(v, r, c0 + c);
  return out;
}
inline std::vector<float> vec_to_float(const TensorView& v) {
  std::vector<float> out(static_cast<size_t>(v.shape[0]));
  for (int64_t i = 0; i < v.shape[0]; ++i) out[static_cast<size_t>(i)] = elem_float(v, i, 0);
  return out;
}

inline Tensor index_tensor(const std::vector<int64_t>& v, DType dtype) {
  Tensor t = Tensor::empty(dtype, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kInt32) t.data_as<int32_t>()[i] = static_cast<int32_t>(v[i]);
    else t.data_as<int64_t>()[i] = v[i];
  }
  return t;
}
inline Tensor index_matrix(const std::vector<int64_t>& v, int64_t rows, int64_t cols, DType dtype) {
  Tensor t = Tensor::empty(dtype, {rows, cols});
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kInt32) t.data_as<int32_t>()[i] = static_cast<int32_t>(v[i]);
    else t.data_as<int64_t>()[i] = v[i];
  }
  return t;
}
inline std::vector<int64_t> index_to_vec(const TensorView& v, int64_t n = -1) {
  if (n < 0) n = v.numel();
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    out[static_cast<size_t>(i)] = v.dtype == DType::kInt32 ? v.data_as<int32_t>()[i] : v.data_as<int64_t>()[i];
  return out;
}

inline std::vector<float> random_values(int64_t n, DType dtype, Rng& rng, double lo = -1.0, double hi = 1.0) {
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& f : v) f = num::round_to(dtype, static_cast<float>(rng.uniform(lo, hi)));
  return v;
}

// The four index inputs of the MegaBlocks ops, built from a reference plan.
struct IndexInputs {
  Tensor indices, bin_ids, bins, padded_bins;
};
inline IndexInputs index_inputs(const ref::Plan& p, DType dtype) {
  return {index_tensor(p.indices, dtype), index_tensor(p.bin_ids, dtype), index_tensor(p.bins, dtype),
          index_tensor(p.padded_bins, dtype)};
}

// An int32 PlanView built from a reference plan (independent of make_plan).
struct PlanHolder {
  Tensor indices, bin_ids, tpe, bins, ptpe, padded_bins, dest_rows, row_sources;
  padmoe::PlanView view;
};
inline PlanHolder plan_from_ref(const ref::Plan& p) {
  PlanHolder h;
  h.indices = index_tensor(p.indices, DType::kInt32);
  h.bin_ids = index_tensor(p.bin_ids, DType::kInt32);
  h.tpe = index_tensor(p.tokens_per_expert, DType::kInt32);
  h.bins = index_tensor(p.bins, DType::kInt32);
  h.ptpe = index_tensor(p.padded_tokens_per_expert, DType::kInt32);
  h.padded_bins = index_tensor(p.padded_bins, DType::kInt32);
  h.dest_rows = index_tensor(p.dest_rows, DType::kInt32);
  h.row_sources = index_tensor(p.row_sources, DType::kInt32);
  h.view.indices = h.indices;
  h.view.bin_ids = h.bin_ids;
  h.view.tokens_per_expert = h.tpe;
  h.view.bins = h.bins;
  h.view.padded_tokens_per_expert = h.ptpe;
  h.view.padded_bins = h.padded_bins;
  h.view.dest_rows = h.dest_rows;
  h.view.row_sources = h.row_sources;
  h.view.num_tokens = p.num_tokens;
  h.view.top_k = p.top_k;
  h.view.num_experts = p.num_experts;
  h.view.alignment = p.alignment;
  return h;
}

// ---------------------------------------------------------------------------
// Routings
// ---------------------------------------------------------------------------
enum class Dist {
  kUniform,   // independent uniform ids (repeats within a token allowed, as MegaBlocks' randint)
  kDistinct,  // K distinct experts per token (needs K <= E)
  kSkewed,    // most assignments to a few experts; many experts empty
  kOdd,       // only odd experts get tokens (every even expert is empty)
};
inline std::vector<int64_t> make_routing(int64_t T, int K, int E, Dist dist, uint64_t seed) {
  Rng rng(seed);
  std::vector<int64_t> te(static_cast<size_t>(T * K));
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      int64_t e = 0;
      switch (dist) {
        case Dist::kUniform: e = rng.below(E); break;
        case Dist::kDistinct: {
          for (;;) {
            e = rng.below(E);
            bool dup = false;
            for (int j = 0; j < k; ++j) dup = dup || te[static_cast<size_t>(t * K + j)] == e;
            if (!dup || K > E) break;
          }
          break;
        }
        case Dist::kSkewed: {
          const int64_t hot = std::max<int64_t>(1, E / 8);
          e = rng.below(10) < 8 ? rng.below(hot) * (E / hot) : rng.below(E);
          if (e >= E) e = E - 1;
          break;
        }
        case Dist::kOdd: e = E == 1 ? 0 : (2 * rng.below(E / 2) + 1); break;
      }
      te[static_cast<size_t>(t * K + k)] = e;
    }
  }
  return te;
}

// ---------------------------------------------------------------------------
// Comparisons
// ---------------------------------------------------------------------------
// The bytes `v` takes in dtype.
inline uint64_t encode(DType dtype, float v) {
  uint64_t tmp = 0;
  num::store_from_float(&tmp, dtype, 0, v);
  return tmp;
}

// Rows [0, rows) of lib, columns [c0, c0 + w), must equal expected (row-major
// rows x w) bitwise after rounding each expected float to lib's dtype.
inline ::testing::AssertionResult rows_bitwise(const TensorView& lib, const std::vector<float>& expected, int64_t rows,
                                               int64_t c0 = 0, int64_t w = -1, int64_t row0 = 0) {
  if (w < 0) w = lib.ndim == 1 ? 1 : lib.shape[1];
  const size_t s = esize(lib.dtype);
  int64_t bad = 0;
  std::ostringstream os;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < w; ++c) {
      const float e = expected[static_cast<size_t>(r * w + c)];
      const uint64_t want = encode(lib.dtype, e);
      uint64_t got = 0;
      std::memcpy(&got, elem_ptr(lib, row0 + r, c0 + c), s);
      if (got != want) {
        if (bad < 5)
          os << " [row " << row0 + r << " col " << c0 + c << ": got " << elem_float(lib, row0 + r, c0 + c) << " (0x"
             << std::hex << got << std::dec << ") want " << e << " (0x" << std::hex << want << std::dec << ")]";
        ++bad;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " mismatching elements (" << dname(lib.dtype) << "):" << os.str();
}

// Every byte of rows [r0, r1) of a 2-D view (or entries of a 1-D view) is `byte`.
inline ::testing::AssertionResult bytes_are(const TensorView& v, int64_t r0, int64_t r1, unsigned char byte) {
  const int64_t cols = v.ndim == 1 ? 1 : v.shape[1];
  const size_t s = esize(v.dtype);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const unsigned char* p = elem_ptr(v, r, c);
      for (size_t b = 0; b < s; ++b)
        if (p[b] != byte) {
          std::ostringstream os;
          os << "byte at row " << r << " col " << c << " is 0x" << std::hex << int(p[b]) << ", expected 0x"
             << int(byte);
          return ::testing::AssertionFailure() << os.str();
        }
    }
  return ::testing::AssertionSuccess();
}
inline ::testing::AssertionResult all_bytes_are(const TensorView& v, unsigned char byte) {
  return bytes_are(v, 0, v.shape[0], byte);
}

inline double sum_tolerance(int64_t n_terms, double abs_sum, double ref, DType out) {
  return 2.0 * static_cast<double>(std::max<int64_t>(n_terms, 1)) * std::ldexp(1.0, -24) * abs_sum +
         std::ldexp(1.0, -mantissa_bits(out)) * std::fabs(ref) * 1.01 + min_subnormal(out);
}

// lib rows [0, rows) x columns [c0, c0 + w) vs expected sums (double) with
// per-element absolute sums; n_terms per element.
inline ::testing::AssertionResult sums_close(const TensorView& lib, const std::vector<double>& expected,
                                             const std::vector<double>& abs_sums, int64_t n_terms, int64_t rows,
                                             int64_t c0 = 0, int64_t w = -1) {
  if (w < 0) w = lib.ndim == 1 ? 1 : lib.shape[1];
  int64_t bad = 0;
  std::ostringstream os;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < w; ++c) {
      const size_t i = static_cast<size_t>(r * w + c);
      const double got = elem_float(lib, r, c0 + c);
      const double tol = sum_tolerance(n_terms, abs_sums[i], expected[i], lib.dtype);
      if (!(std::fabs(got - expected[i]) <= tol)) {
        if (bad < 5)
          os << " [row " << r << " col " << c0 + c << ": got " << got << " want " << expected[i] << " tol " << tol
             << "]";
        ++bad;
      }
    }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " elements out of tolerance (" << dname(lib.dtype) << "):" << os.str();
}

inline std::vector<float> abs_of(const std::vector<float>& v) {
  std::vector<float> a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = std::fabs(v[i]);
  return a;
}

inline bool same_bytes(const TensorView& a, const TensorView& b) {
  if (a.dtype != b.dtype || a.numel() != b.numel()) return false;
  const size_t n = static_cast<size_t>(a.numel()) * esize(a.dtype);
  return n == 0 || std::memcmp(a.data, b.data, n) == 0;
}

// Runs f, expects a padmoe::Error whose message contains every needle.
template <class F>
::testing::AssertionResult throws_error(F&& f, std::vector<std::string> needles, int kind = -1) {
  try {
    f();
  } catch (const padmoe::Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles)
      if (msg.find(n) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << n << "\"";
    if (kind >= 0 && static_cast<int>(e.kind()) != kind)
      return ::testing::AssertionFailure()
             << "message \"" << msg << "\" has kind " << static_cast<int>(e.kind()) << ", expected " << kind;
    return ::testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-padmoe exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// Padding rows (row_sources < 0) of a padded [rows, H] input set to the poison
// pattern (NaN in every float format): an op that reads them shows it.
inline void poison_padding_rows(Tensor& t, const ref::Plan& p, int64_t rows, int64_t H, DType dtype) {
  for (int64_t r = 0; r < rows; ++r)
    if (p.row_sources[static_cast<size_t>(r)] < 0)
      std::memset(static_cast<unsigned char*>(t.data()) + r * H * esize(dtype), kPoison, H * esize(dtype));
}

// top_experts with exactly counts[e] assignments of expert e (sum = T*K), shuffled.
inline std::vector<int64_t> routing_with_counts(const std::vector<int64_t>& counts, uint64_t seed) {
  std::vector<int64_t> te;
  for (size_t e = 0; e < counts.size(); ++e)
    te.insert(te.end(), static_cast<size_t>(counts[e]), static_cast<int64_t>(e));
  Rng rng(seed);
  for (size_t i = te.size(); i > 1; --i)
    std::swap(te[i - 1], te[static_cast<size_t>(rng.below(static_cast<int64_t>(i)))]);
  return te;
}

// The reference scatter over absolute values: the S of the sum tolerance.
inline std::vector<double> ref_scatter_abs(const std::vector<float>& y, int64_t H, const ref::Plan& p,
                                           const std::vector<float>* w) {
  std::vector<float> aw;
  if (w) aw = abs_of(*w);
  return ref::padded_scatter(abs_of(y), H, p, w ? &aw : nullptr);
}

// An index view equals `want` entry for entry; a plan view equals a reference plan, all eight arrays.
inline ::testing::AssertionResult same_vec(const TensorView& v, const std::vector<int64_t>& want, const char* what) {
  const std::vector<int64_t> got = index_to_vec(v);
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << what << ": " << got.size() << " entries, want " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << got[i] << ", want " << want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult plan_equals(const padmoe::PlanView& v, const ref::Plan& p) {
  const std::pair<const TensorView*, const std::vector<int64_t>*> fields[] = {
      {&v.indices, &p.indices},
      {&v.bin_ids, &p.bin_ids},
      {&v.tokens_per_expert, &p.tokens_per_expert},
      {&v.bins, &p.bins},
      {&v.padded_tokens_per_expert, &p.padded_tokens_per_expert},
      {&v.padded_bins, &p.padded_bins},
      {&v.dest_rows, &p.dest_rows},
      {&v.row_sources, &p.row_sources}};
  const char* names[] = {"indices",     "bin_ids",   "tokens_per_expert", "bins", "padded_tokens_per_expert",
                         "padded_bins", "dest_rows", "row_sources"};
  for (int i = 0; i < 8; ++i) {
    auto ok = same_vec(*fields[i].first, *fields[i].second, names[i]);
    if (!ok) return ok;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace pt
