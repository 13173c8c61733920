// scaled_ops.cpp — rows moved with their scales (ops.hpp section 4): dispatch_scaled,
// padded_gather_scaled, pad_to_alignment_scaled, unpad_from_alignment_scaled, and the fused
// quantizing dispatch_quantized: their schemas, CPU / CUDA kernels and Autograd kernels.
//
// The _scaled ops: the move-only ops with a scale tensor moved alongside in the same pass (float32
// per row or per 128 columns, MXFP8 E8M0 as uint8 or float8_e8m0fnu). Not differentiable:
// quantized rows and their scales carry no gradient (an input that requires one is a clear error,
// not a silent detach). padmoe.torch calls the OpOverloads.
//
// dispatch_quantized: bfloat16 / float16 / float32 rows in, float8 rows (dtype) plus scales out
// (scale_layout "block128": float32 [R, ceil(H/128)]; "mxfp8": uint8 E8M0 [R, ceil(H/32)],
// view as torch.float8_e8m0fnu for the decoded 2^X; "row": float32 [R]), R = rows, or the plan's
// padded_rows_bound for rows = -1, like dispatch_scaled (padding rows and rows past P: zero codes,
// scale 1, unless zero_padding=False).
// Not differentiable: an x that requires a gradient under grad mode is an error.
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "common.hpp"
#include "kernels.hpp"
#include "packed_plan.hpp"

namespace padmoe_torch {
namespace {

bool is_e8m0(const Tensor& t) { return std::strcmp(c10::toString(t.scalar_type()), "Float8_e8m0fnu") == 0; }

// A scale tensor as padmoe takes it: float8_e8m0fnu as its uint8 bytes (same memory).
TensorView scales_view(const Tensor& t, const char* op, const char* arg) {
  return view(is_e8m0(t) ? t.view(at::kByte) : t, op, arg);
}

// Scale inputs: any stride (one copy when not contiguous; padmoe wants them row-major).
Tensor scales_arg(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// Output scales shaped like `s` (its dims after the first) with `rows` rows.
Tensor scales_like(const Tensor& s, int64_t rows) {
  std::vector<int64_t> sizes = s.sizes().vec();
  if (sizes.empty()) sizes.push_back(rows);
  else sizes[0] = rows;
  return at::empty(sizes, s.options());
}

padmoe::ScaleLayout quant_layout(const std::string& s, const char* op) {
  if (s == "block128") return padmoe::ScaleLayout::kBlock128;
  if (s == "mxfp8") return padmoe::ScaleLayout::kMxE8M0;
  if (s == "row") return padmoe::ScaleLayout::kPerRow;
  value_error(op, "scale_layout", "expected 'block128', 'mxfp8' or 'row', got '" + s + "'");
}

Tensor quant_scales_out(padmoe::ScaleLayout l, int64_t rows, int64_t hidden, const Tensor& like) {
  const int64_t cols = padmoe::scale_columns(l, hidden);
  if (l == padmoe::ScaleLayout::kPerRow) return at::empty({rows}, like.options().dtype(at::kFloat));
  if (l == padmoe::ScaleLayout::kMxE8M0) return at::empty({rows, cols}, like.options().dtype(at::kByte));
  return at::empty({rows, cols}, like.options().dtype(at::kFloat));
}

}  // namespace

std::tuple<Tensor, Tensor> dispatch_scaled_kernel(const Tensor& x_in, const Tensor& plan, const Tensor& x_scales,
                                                  int64_t top_k, int64_t num_experts, int64_t alignment,
                                                  OptInt expert_capacity, int64_t check, bool zero_padding) {
  const char* op = "dispatch";
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, expert_capacity, op);
  Tensor x = rows_arg(x_in), xs = scales_arg(x_scales);
  Tensor y = at::empty({pp.cap, x.dim() == 2 ? x.size(1) : 0}, x.options());
  Tensor ys = scales_like(xs, pp.cap);
  c10::OptionalDeviceGuard guard(x.device());
  const padmoe::PlanView pv = pp.view(op);
  padmoe::Options o = options_for(x, check, /*zero_tail=*/zero_padding);
  o.zero_padding = zero_padding;  // false: padding rows (and the rows past P) left unwritten
  native([&] {
    padmoe::dispatch_scaled_out(view(x, op, "x"), pv, scales_view(xs, op, "x_scales"), view(y, op, "y"),
                                scales_view(ys, op, "y_scales"), o);
  });
  return {y, ys};
}

std::tuple<Tensor, Tensor> padded_gather_scaled_kernel(const Tensor& x_in, const Tensor& indices_in,
                                                       const Tensor& bin_ids_in, const Tensor& bins_in,
                                                       const Tensor& padded_bins_in, int64_t top_k,
                                                       const Tensor& x_scales, int64_t check, bool zero_padding) {
  const char* op = "padded_gather";
  Tensor indices = index_arg(indices_in), bin_ids = index_arg(bin_ids_in), bins = index_arg(bins_in),
         padded_bins = index_arg(padded_bins_in);
  const int64_t p = host_last(padded_bins, op, "padded_bins");
  check_rows_fit(op, "padded_bins", p);
  Tensor x = rows_arg(x_in), xs = scales_arg(x_scales);
  Tensor y = at::empty({p, x.dim() == 2 ? x.size(1) : 0}, x.options());
  Tensor ys = scales_like(xs, p);
  c10::OptionalDeviceGuard guard(x.device());
  padmoe::Options o = options_for(x, check);
  o.zero_padding = zero_padding;
  native([&] {
    padmoe::padded_gather_scaled_out(view(x, op, "x"), view(indices, op, "indices"), view(bin_ids, op, "bin_ids"),
                                     view(bins, op, "bins"), view(padded_bins, op, "padded_bins"),
                                     static_cast<int>(top_k), scales_view(xs, op, "x_scales"), view(y, op, "y"),
                                     scales_view(ys, op, "y_scales"), o);
  });
  return {y, ys};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> pad_scaled_kernel(const Tensor& h_in, const Tensor& tpe_in,
                                                             int64_t alignment, const Tensor& h_scales, int64_t check,
                                                             bool zero_padding) {
  const char* op = "pad_to_alignment";
  Tensor tpe = index_arg(tpe_in);
  Tensor h = rows_arg(h_in), hs = scales_arg(h_scales);
  const int64_t p = pad_rows(op, h, tpe, alignment, check);
  const int64_t e = tpe.dim() == 1 ? tpe.numel() : 0;
  Tensor padded = at::empty({p, h.dim() == 2 ? h.size(1) : 0}, h.options());
  Tensor ps = scales_like(hs, p);
  Tensor map = at::empty({p}, h.options().dtype(at::kInt));
  Tensor offs = at::empty({e}, h.options().dtype(at::kInt));
  c10::OptionalDeviceGuard guard(h.device());
  padmoe::Options o = options_for(h, check);
  o.zero_padding = zero_padding;
  native([&] {
    padmoe::pad_to_alignment_scaled_out(view(h, op, "hidden_states"), view(tpe, op, "tokens_per_expert"),
                                        static_cast<int>(alignment), scales_view(hs, op, "hidden_scales"),
                                        view(padded, op, "padded"), scales_view(ps, op, "padded_scales"),
                                        view(map, op, "permutation_map"), view(offs, op, "inclusive_offsets"), o);
  });
  return {padded, ps, map, offs};
}

std::tuple<Tensor, Tensor> unpad_scaled_kernel(const Tensor& padded_in, const Tensor& map_in, int64_t original_size,
                                               const Tensor& padded_scales, int64_t check) {
  const char* op = "unpad_from_alignment";
  if (original_size < 0) value_error(op, "original_size", "must be >= 0, got " + std::to_string(original_size));
  Tensor map = index_arg(map_in);
  Tensor padded = rows_arg(padded_in), ps = scales_arg(padded_scales);
  Tensor out = at::empty({original_size, padded.dim() == 2 ? padded.size(1) : 0}, padded.options());
  Tensor os = scales_like(ps, original_size);
  c10::OptionalDeviceGuard guard(padded.device());
  const padmoe::Options o = options_for(padded, check);
  native([&] {
    padmoe::unpad_from_alignment_scaled_out(view(padded, op, "padded"), view(map, op, "permutation_map"),
                                            scales_view(ps, op, "padded_scales"), view(out, op, "out"),
                                            scales_view(os, op, "out_scales"), o);
  });
  return {out, os};
}

std::tuple<Tensor, Tensor> dispatch_quantized_kernel(const Tensor& x_in, const Tensor& plan, int64_t top_k,
                                                     int64_t num_experts, int64_t alignment, OptInt expert_capacity,
                                                     c10::string_view scale_layout, at::ScalarType dtype, int64_t check,
                                                     bool zero_padding, int64_t rows) {
  const char* op = "dispatch_quantized";
  const padmoe::ScaleLayout l = quant_layout(std::string(scale_layout), op);
  if (dtype != at::kFloat8_e4m3fn && dtype != at::kFloat8_e5m2) {
    type_error(op, "dtype", "expected torch.float8_e4m3fn or torch.float8_e5m2, got torch." + dtype_name(dtype));
  }
  const PackedPlan pp = packed_plan(plan, top_k, num_experts, alignment, expert_capacity, op);
  Tensor x = rows_arg(x_in);
  const int64_t hidden = x.dim() == 2 ? x.size(1) : 0;
  if (rows < 0) rows = pp.cap;  // -1: the plan's padded_rows_bound (the wrapper checks a given rows)
  Tensor y = at::empty({rows, hidden}, x.options().dtype(dtype));
  Tensor ys = quant_scales_out(l, rows, hidden, x);
  c10::OptionalDeviceGuard guard(x.device());
  const padmoe::PlanView pv = pp.view(op);
  padmoe::Options o = options_for(x, check, /*zero_tail=*/zero_padding);
  o.zero_padding = zero_padding;
  native([&] { padmoe::dispatch_quantized_out(view(x, op, "x"), pv, view(y, op, "y"), view(ys, op, "y_scales"), o); });
  return {y, ys};
}

namespace {

// Autograd key: no graph node; an input that needs a gradient is an error.
void no_grad_for_scaled(const char* op, const Tensor& rows, const Tensor& scales) {
  if (at::GradMode::is_enabled() && (rows.requires_grad() || scales.requires_grad())) {
    throw c10::NotImplementedError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                   std::string(op) +
                                       ": rows moved with their scales are not differentiable "
                                       "(quantized rows carry no gradient); detach the inputs or "
                                       "use the op without scales");
  }
}

std::tuple<Tensor, Tensor> dispatch_scaled_autograd(const Tensor& x, const Tensor& plan, const Tensor& x_scales,
                                                    int64_t top_k, int64_t num_experts, int64_t alignment,
                                                    OptInt expert_capacity, int64_t check, bool zero_padding) {
  no_grad_for_scaled("dispatch", x, x_scales);
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(dispatch_scaled_kernel)>("padmoe::dispatch_scaled");
  return op.call(x, plan, x_scales, top_k, num_experts, alignment, expert_capacity, check, zero_padding);
}
std::tuple<Tensor, Tensor> padded_gather_scaled_autograd(const Tensor& x, const Tensor& indices, const Tensor& bin_ids,
                                                         const Tensor& bins, const Tensor& padded_bins, int64_t top_k,
                                                         const Tensor& x_scales, int64_t check, bool zero_padding) {
  no_grad_for_scaled("padded_gather", x, x_scales);
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(padded_gather_scaled_kernel)>("padmoe::padded_gather_scaled");
  return op.call(x, indices, bin_ids, bins, padded_bins, top_k, x_scales, check, zero_padding);
}
std::tuple<Tensor, Tensor, Tensor, Tensor> pad_scaled_autograd(const Tensor& h, const Tensor& tpe, int64_t alignment,
                                                               const Tensor& h_scales, int64_t check,
                                                               bool zero_padding) {
  no_grad_for_scaled("pad_to_alignment", h, h_scales);
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(pad_scaled_kernel)>("padmoe::pad_to_alignment_scaled");
  return op.call(h, tpe, alignment, h_scales, check, zero_padding);
}
std::tuple<Tensor, Tensor> unpad_scaled_autograd(const Tensor& padded, const Tensor& map, int64_t original_size,
                                                 const Tensor& padded_scales, int64_t check) {
  no_grad_for_scaled("unpad_from_alignment", padded, padded_scales);
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(unpad_scaled_kernel)>("padmoe::unpad_from_alignment_scaled");
  return op.call(padded, map, original_size, padded_scales, check);
}

// dispatch_quantized's Autograd key: as the _scaled ops', an x that needs a gradient is an error.
std::tuple<Tensor, Tensor> dispatch_quantized_autograd(const Tensor& x, const Tensor& plan, int64_t top_k,
                                                       int64_t num_experts, int64_t alignment, OptInt expert_capacity,
                                                       c10::string_view scale_layout, at::ScalarType dtype,
                                                       int64_t check, bool zero_padding, int64_t rows) {
  if (at::GradMode::is_enabled() && x.requires_grad()) {
    throw c10::NotImplementedError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                   "dispatch_quantized: not differentiable (float8 rows carry no gradient); "
                                   "detach x, or dispatch the 16-bit rows and quantize in the expert");
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = handle<decltype(dispatch_quantized_kernel)>("padmoe::dispatch_quantized");
  return op.call(x, plan, top_k, num_experts, alignment, expert_capacity, scale_layout, dtype, check, zero_padding,
                 rows);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(padmoe, m) {
  m.def(
      "dispatch_scaled(Tensor x, Tensor plan, Tensor x_scales, int top_k, int num_experts, int alignment, "
      "int? expert_capacity, int check=2, bool zero_padding=True) -> (Tensor, Tensor)");
  m.def(
      "padded_gather_scaled(Tensor x, Tensor indices, Tensor bin_ids, Tensor bins, Tensor padded_bins, int top_k, "
      "Tensor x_scales, int check=2, bool zero_padding=True) -> (Tensor, Tensor)");
  m.def(
      "pad_to_alignment_scaled(Tensor hidden_states, Tensor tokens_per_expert, int alignment, "
      "Tensor hidden_scales, int check=2, bool zero_padding=True) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "unpad_from_alignment_scaled(Tensor padded_output, Tensor permutation_map, int original_size, "
      "Tensor padded_scales, int check=2) -> (Tensor, Tensor)");
  m.def(
      "dispatch_quantized(Tensor x, Tensor plan, int top_k, int num_experts, int alignment, int? expert_capacity, "
      "str scale_layout, ScalarType dtype, int check=2, bool zero_padding=True, int rows=-1) -> (Tensor, Tensor)");
}

#define PADMOE_TORCH_SCALED_KERNELS(m)                         \
  m.impl("dispatch_scaled", dispatch_scaled_kernel);           \
  m.impl("padded_gather_scaled", padded_gather_scaled_kernel); \
  m.impl("pad_to_alignment_scaled", pad_scaled_kernel);        \
  m.impl("unpad_from_alignment_scaled", unpad_scaled_kernel);  \
  m.impl("dispatch_quantized", dispatch_quantized_kernel)

TORCH_LIBRARY_IMPL(padmoe, CPU, m) { PADMOE_TORCH_SCALED_KERNELS(m); }
#ifdef PADMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(padmoe, CUDA, m) { PADMOE_TORCH_SCALED_KERNELS(m); }
#endif
#undef PADMOE_TORCH_SCALED_KERNELS

TORCH_LIBRARY_IMPL(padmoe, Autograd, m) {
  m.impl("dispatch_scaled", dispatch_scaled_autograd);
  m.impl("padded_gather_scaled", padded_gather_scaled_autograd);
  m.impl("pad_to_alignment_scaled", pad_scaled_autograd);
  m.impl("unpad_from_alignment_scaled", unpad_scaled_autograd);
  m.impl("dispatch_quantized", dispatch_quantized_autograd);
}

}  // namespace padmoe_torch
