// padding.cpp — docs/spec.md §7: pad_to_alignment / unpad_from_alignment
// (input already expert-grouped) and the backward of unpad.
//
// Both run output-row-driven over a row map: pad builds
// permutation_map[p] (source row or -1), unpad its inverse over the N output
// rows. Every output row is written once; padding rows are zeroed in the same
// pass that moves the real ones.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "api/alloc.hpp"
#include "api/checks.hpp"
#include "api/scales.hpp"
#include "cpu/cpu_backend.hpp"
#include "cuda/cuda_backend.hpp"
#include "cpu/thread_pool.hpp"
#include "padmoe/index_math.hpp"
#include "padmoe/ops.hpp"

namespace padmoe {
namespace {

using detail::Checker;
using detail::ScalePair;

struct PadShape {
  std::vector<int64_t> counts;        // [E]
  std::vector<int64_t> padded_incl;   // [E] padded inclusive cumsum
  int64_t padded_rows = 0;            // P
};

void check_pad_shapes(const Checker& c, const TensorView& h, const TensorView& tokens_per_expert, int alignment) {
  c.row_tensor(h, "hidden_states", -1, -1, /*allow_fp8=*/true);
  c.index_vector(tokens_per_expert, "tokens_per_expert", -1);
  c.same_device(tokens_per_expert, "tokens_per_expert", h.device);
  c.alignment(alignment);
  detail::require_backend(c, h.device);
}

// The counts' data checks on host memory (on CUDA: a host copy).
PadShape pad_counts(const Checker& c, const TensorView& h, const detail::IndexReader& counts, int64_t experts,
                    int alignment) {
  PadShape s;
  s.counts.resize(static_cast<size_t>(experts));
  s.padded_incl.resize(static_cast<size_t>(experts));
  int64_t total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = counts[e];
    if (n < 0)
      c.value_error("tokens_per_expert", "entry " + std::to_string(e) + " is negative (" + std::to_string(n) + ")");
    if (n > h.shape[0]) {
      c.value_error("tokens_per_expert", "entry " + std::to_string(e) + " (" + std::to_string(n) + ") exceeds the " +
                                             std::to_string(h.shape[0]) + " rows of hidden_states");
    }
    total = detail::checked_add(c, "tokens_per_expert", total, n);  // entries <= rows, but rows may be ~2^63
    s.counts[e] = n;
    s.padded_rows = detail::checked_add(c, "tokens_per_expert", s.padded_rows,
                                        detail::checked_round_up(c, "tokens_per_expert", n, alignment));
    s.padded_incl[e] = s.padded_rows;
  }
  if (total > h.shape[0]) {
    c.value_error("tokens_per_expert", "sums to " + std::to_string(total) + " but hidden_states has " +
                                           std::to_string(h.shape[0]) + " rows");
  }
  detail::check_int32_extent(c, "tokens_per_expert", s.padded_rows);
  return s;
}

// Shapes, then the counts: read in place on the CPU; on CUDA copied to the
// host (one synchronization) when `read_device` (allocating form), else
// left to the device (checked mode) with P unknown here.
PadShape check_pad_inputs(const Checker& c, const TensorView& h, const TensorView& tokens_per_expert, int alignment,
                          const Options& options, bool read_device) {
  check_pad_shapes(c, h, tokens_per_expert, alignment);
  const int64_t experts = tokens_per_expert.shape[0];
  if (!h.device.is_cuda()) return pad_counts(c, h, detail::IndexReader(tokens_per_expert), experts, alignment);
  if (!read_device) {
    PadShape s;
    s.counts.resize(static_cast<size_t>(experts));
    s.padded_rows = -1;
    return s;
  }
  std::vector<int64_t> host(static_cast<size_t>(experts));
  const size_t w = element_size(tokens_per_expert.dtype);
  std::vector<char> raw(static_cast<size_t>(experts) * w);
  cuda::copy_bytes(raw.data(), Device::cpu(), tokens_per_expert.data, h.device, raw.size(), options.stream);
  TensorView copy = tokens_per_expert;
  copy.data = raw.data();
  return pad_counts(c, h, detail::IndexReader(copy), experts, alignment);
}

void run_pad(const Checker& c, const PadShape& s, const TensorView& h, const TensorView& tokens_per_expert,
             int alignment, const TensorView& padded, const TensorView& permutation_map,
             const TensorView& inclusive_offsets, const Options& options, const ScalePair* scales = nullptr) {
  const int64_t experts = static_cast<int64_t>(s.counts.size());
  if (h.device.is_cuda()) {
    const cuda::IndexRef counts = cuda::IndexRef::of(tokens_per_expert);
    if (options.check_data && s.padded_rows < 0) {  // counts not yet seen on the host
      cuda::Scratch scratch(options, cuda::validate_workspace_bytes(0), h.device.index);
      detail::raise_violation(c,
                              cuda::validate_counts(counts, static_cast<int>(experts), alignment, h.shape[0],
                                                    padded.shape[0], scratch.get(), options.stream),
                              detail::ViolationNames{"tokens_per_expert", 0, "padded"});
    }
    cuda::Scratch scratch(options, cuda::pad_workspace_bytes(static_cast<int>(experts)), h.device.index);
    int32_t* map = permutation_map.data_as<int32_t>();
    int32_t* offs = inclusive_offsets.data_as<int32_t>();
    cuda::pad_map(counts, static_cast<int>(experts), alignment, permutation_map.shape[0], h.shape[0], map, offs,
                  scratch.get(), options.stream);
    // Rows at or past P (the device's inclusive_offsets[E-1]) are left untouched, or, with
    // zero_tail, zeroed in the same pass: their map entries are -1.
    if (experts > 0 || options.zero_tail) {  // no experts and no zero_tail: P = 0, nothing to write
      const cuda::ScaleRowsArg sc =
          scales ? detail::cuda_scale_rows(scales->src, scales->dst, scales->spec) : cuda::ScaleRowsArg{};
      const int32_t* limit = options.zero_tail ? nullptr : offs + experts - 1;
      cuda::gather_rows(cuda::RowsArg::of(h), cuda::IndexRef{map, false}, cuda::ScaleArg{}, false,
                        cuda::RowsArg::of(padded), padded.shape[0], limit, options.stream,
                        /*skip_unmapped=*/!options.zero_padding, scales ? &sc : nullptr);
    }
    return;
  }
  int32_t* map = permutation_map.data_as<int32_t>();
  const int64_t map_len = permutation_map.shape[0];
  int32_t* offs = inclusive_offsets.data_as<int32_t>();
  for (int64_t e = 0; e < experts; ++e) offs[e] = static_cast<int32_t>(s.padded_incl[e]);

  // Row map: padded row p of expert e takes h[excl(e) + p - pexcl(e)] while
  // that is inside e's count, else it is padding (-1); entries past P are -1.
  std::vector<int64_t> excl(static_cast<size_t>(experts));
  for (int64_t e = 0, run = 0; e < experts; ++e) {
    excl[e] = run;
    run += s.counts[e];
  }
  const int workers = cpu::workers_for(options.num_threads, map_len, 64);
  cpu::parallel_run(workers, [&](int w) {
    const index::Range r = index::work_range(w, workers, map_len);
    int64_t e = index::find_segment(s.padded_incl.data(), experts, r.begin);
    for (int64_t p = r.begin; p < r.end; ++p) {
      while (e < experts && p >= s.padded_incl[e]) ++e;
      if (e >= experts) {
        map[p] = -1;
        continue;
      }
      const int64_t local = p - index::segment_start(s.padded_incl.data(), e);
      map[p] = local < s.counts[e] ? static_cast<int32_t>(excl[e] + local) : -1;
    }
  });
  const cpu::ScaleRows sc = scales ? detail::cpu_scale_rows(scales->src, scales->dst, scales->spec) : cpu::ScaleRows{};
  // Rows at or past P: untouched, or zeroed with zero_tail (their map entries are -1).
  const int64_t written = options.zero_tail ? std::min<int64_t>(padded.shape[0], map_len) : s.padded_rows;
  cpu::gather_rows(cpu::RowsRef::of(h), map, cpu::Scale{}, false, cpu::RowsRef::of(padded), written,
                   options.num_threads, /*skip_unmapped=*/!options.zero_padding, scales ? &sc : nullptr);
}

// permutation_map checked (entries in [-1, N), distinct) and inverted.
std::vector<int32_t> check_and_invert_map(const Checker& c, const TensorView& permutation_map, int64_t rows,
                                          int64_t original_size) {
  c.index_vector(permutation_map, "permutation_map", rows);
  const detail::IndexReader map(permutation_map);
  std::vector<int32_t> inverse = detail::host_vector<int32_t>(c, "original_size", original_size, -1);
  for (int64_t p = 0; p < rows; ++p) {
    const int64_t n = map[p];
    if (n < -1 || n >= original_size) {
      c.value_error("permutation_map", "entry " + std::to_string(p) + " is " + std::to_string(n) + ", outside [-1, " +
                                           std::to_string(original_size) + ")");
    }
    if (n < 0) continue;
    if (inverse[n] >= 0) {
      c.value_error("permutation_map", "entries " + std::to_string(inverse[n]) + " and " + std::to_string(p) +
                                           " both name row " + std::to_string(n));
    }
    inverse[n] = static_cast<int32_t>(p);
  }
  return inverse;
}

// unpad's inverse map: inverse[n] = p for map[p] == n, else -1. CPU: checked
// and built on the host; CUDA: validated on the device (checked mode) and
// built in scratch memory.
struct Inverse {
  std::vector<int32_t> host;
  std::shared_ptr<cuda::Scratch> device;
  const int32_t* data = nullptr;
};

Inverse inverse_map(const Checker& c, const TensorView& permutation_map, int64_t rows, int64_t original_size,
                    Device device, const Options& options, bool build_on_device = true) {
  Inverse inv;
  if (!device.is_cuda()) {
    inv.host = check_and_invert_map(c, permutation_map, rows, original_size);
    inv.data = inv.host.data();
    return inv;
  }
  c.index_vector(permutation_map, "permutation_map", rows);
  const cuda::IndexRef map = cuda::IndexRef::of(permutation_map);
  if (options.check_data) {
    cuda::Scratch scratch(options, cuda::validate_workspace_bytes(original_size), device.index);
    detail::raise_violation(c, cuda::validate_map(map, rows, original_size, scratch.get(), options.stream),
                            detail::ViolationNames{"permutation_map", original_size, "out"});
  }
  if (!build_on_device) return inv;  // validated only (unpad's backward on CUDA needs no inverse)
  inv.device = std::make_shared<cuda::Scratch>(options, static_cast<size_t>(original_size) * 4, device.index);
  int32_t* out = static_cast<int32_t*>(inv.device->get());
  cuda::invert_map(map, rows, original_size, out, options.stream);
  inv.data = out;
  return inv;
}

// out[r] = src[map[r]] (* scale) or zero, r < rows, on the tensors' backend.
// With scales, each row's scale row moves with it (zeroed rows: scale 1).
void run_gather(const TensorView& src, const int32_t* map, const std::optional<TensorView>& scale, bool scale_by_source,
                const TensorView& out, int64_t rows, const Options& options, const ScalePair* scales = nullptr) {
  if (src.device.is_cuda()) {
    const cuda::ScaleRowsArg sc =
        scales ? detail::cuda_scale_rows(scales->src, scales->dst, scales->spec) : cuda::ScaleRowsArg{};
    cuda::gather_rows(cuda::RowsArg::of(src), cuda::IndexRef{map, false},
                      scale ? cuda::ScaleArg{scale->data, scale->dtype} : cuda::ScaleArg{}, scale_by_source,
                      cuda::RowsArg::of(out), rows, nullptr, options.stream, false, scales ? &sc : nullptr);
    return;
  }
  const cpu::ScaleRows sc = scales ? detail::cpu_scale_rows(scales->src, scales->dst, scales->spec) : cpu::ScaleRows{};
  cpu::gather_rows(cpu::RowsRef::of(src), map, cpu::Scale::of(scale), scale_by_source, cpu::RowsRef::of(out), rows,
                   options.num_threads, false, scales ? &sc : nullptr);
}

void check_unpad_inputs(const Checker& c, const TensorView& padded, const TensorView& permutation_map,
                        const std::optional<TensorView>& probs, int64_t original_size) {
  c.row_tensor(padded, "padded_output", -1, -1, /*allow_fp8=*/!probs);
  c.same_device(permutation_map, "permutation_map", padded.device);
  detail::require_backend(c, padded.device);
  if (original_size < 0) c.value_error("original_size", "must be >= 0, got " + std::to_string(original_size));
  detail::check_int32_extent(c, "original_size", original_size);
  if (probs) {
    c.scale_vector(*probs, "probs", original_size, padded.dtype);
    c.same_device(*probs, "probs", padded.device);
  }
}

}  // namespace

void pad_to_alignment_out(const TensorView& hidden_states, const TensorView& tokens_per_expert, int alignment,
                          const TensorView& padded, const TensorView& permutation_map,
                          const TensorView& inclusive_offsets, const Options& options) {
  Checker c("pad_to_alignment");
  const PadShape s = check_pad_inputs(c, hidden_states, tokens_per_expert, alignment, options, false);
  c.row_output(padded, "padded", std::max<int64_t>(s.padded_rows, 0), /*at_least=*/true, hidden_states.shape[1],
               hidden_states.dtype);
  c.int32_output(permutation_map, "permutation_map", padded.shape[0]);
  c.int32_output(inclusive_offsets, "inclusive_offsets", static_cast<int64_t>(s.counts.size()));
  c.same_device(padded, "padded", hidden_states.device);
  c.same_device(permutation_map, "permutation_map", hidden_states.device);
  c.same_device(inclusive_offsets, "inclusive_offsets", hidden_states.device);
  detail::check_disjoint_all(
      c,
      {detail::named(padded, "padded"), detail::named(permutation_map, "permutation_map"),
       detail::named(inclusive_offsets, "inclusive_offsets")},
      {detail::named(hidden_states, "hidden_states"), detail::named(tokens_per_expert, "tokens_per_expert")});
  run_pad(c, s, hidden_states, tokens_per_expert, alignment, padded, permutation_map, inclusive_offsets, options);
}

PadResult pad_to_alignment(const TensorView& hidden_states, const TensorView& tokens_per_expert, int alignment,
                           const Options& options) {
  Checker c("pad_to_alignment");
  const PadShape s = check_pad_inputs(c, hidden_states, tokens_per_expert, alignment, options, true);
  const detail::NewTensor outputs[] = {detail::rows_like(hidden_states, s.padded_rows),
                                       {DType::kInt32, {s.padded_rows}},
                                       {DType::kInt32, {static_cast<int64_t>(s.counts.size())}}};
  return detail::allocate_outputs<PadResult>(hidden_states.device, outputs, [&](const PadResult& r) {
    run_pad(c, s, hidden_states, tokens_per_expert, alignment, r.padded, r.permutation_map, r.inclusive_offsets,
            options);
  });
}

int64_t pad_to_alignment_rows(const TensorView& hidden_states, const TensorView& tokens_per_expert, int alignment,
                              const Options& options) {
  Checker c("pad_to_alignment");
  return check_pad_inputs(c, hidden_states, tokens_per_expert, alignment, options, true).padded_rows;
}

void unpad_from_alignment_out(const TensorView& padded, const TensorView& permutation_map,
                              const std::optional<TensorView>& probs, const TensorView& out, const Options& options) {
  Checker c("unpad_from_alignment");
  c.row_tensor(out, "out", -1, -1, /*allow_fp8=*/true);
  const int64_t original_size = out.shape[0];
  check_unpad_inputs(c, padded, permutation_map, probs, original_size);
  c.row_output(out, "out", original_size, /*at_least=*/false, padded.shape[1], padded.dtype);
  c.same_device(out, "out", padded.device);
  detail::check_disjoint_all(c, {detail::named(out, "out")},
                             {detail::named(padded, "padded"), detail::named(permutation_map, "permutation_map"),
                              detail::named(probs, "probs")});
  const Inverse inverse = inverse_map(c, permutation_map, padded.shape[0], original_size, padded.device, options);
  run_gather(padded, inverse.data, probs, false, out, original_size, options);
}

Tensor unpad_from_alignment(const TensorView& padded, const TensorView& permutation_map, int64_t original_size,
                            const std::optional<TensorView>& probs, const Options& options) {
  Checker c("unpad_from_alignment");
  check_unpad_inputs(c, padded, permutation_map, probs, original_size);
  const Inverse inverse = inverse_map(c, permutation_map, padded.shape[0], original_size, padded.device, options);
  return detail::allocate_outputs<Tensor>(
      padded.device, {detail::rows_like(padded, original_size)},
      [&](const Tensor& out) { run_gather(padded, inverse.data, probs, false, out, original_size, options); });
}

// --- rows moved with their scales (ops.hpp section 4) ---------------------------

void pad_to_alignment_scaled_out(const TensorView& hidden_states, const TensorView& tokens_per_expert, int alignment,
                                 const TensorView& hidden_scales, const TensorView& padded,
                                 const TensorView& padded_scales, const TensorView& permutation_map,
                                 const TensorView& inclusive_offsets, const Options& options) {
  Checker c("pad_to_alignment");
  check_pad_shapes(c, hidden_states, tokens_per_expert, alignment);
  const detail::ScaleSpec spec = detail::check_scales(c, hidden_scales, "hidden_scales", hidden_states.shape[0],
                                                      hidden_states.shape[1], hidden_states.device);
  const PadShape s = check_pad_inputs(c, hidden_states, tokens_per_expert, alignment, options, false);
  c.row_output(padded, "padded", std::max<int64_t>(s.padded_rows, 0), /*at_least=*/true, hidden_states.shape[1],
               hidden_states.dtype);
  detail::check_scales_out(c, padded_scales, "padded_scales", padded.shape[0], spec, hidden_states.device);
  c.int32_output(permutation_map, "permutation_map", padded.shape[0]);
  c.int32_output(inclusive_offsets, "inclusive_offsets", static_cast<int64_t>(s.counts.size()));
  c.same_device(padded, "padded", hidden_states.device);
  c.same_device(permutation_map, "permutation_map", hidden_states.device);
  c.same_device(inclusive_offsets, "inclusive_offsets", hidden_states.device);
  detail::check_disjoint_all(
      c,
      {detail::named(padded, "padded"), detail::named(padded_scales, "padded_scales"),
       detail::named(permutation_map, "permutation_map"), detail::named(inclusive_offsets, "inclusive_offsets")},
      {detail::named(hidden_states, "hidden_states"), detail::named(tokens_per_expert, "tokens_per_expert"),
       detail::named(hidden_scales, "hidden_scales")});
  const ScalePair sp{hidden_scales, padded_scales, spec};
  run_pad(c, s, hidden_states, tokens_per_expert, alignment, padded, permutation_map, inclusive_offsets, options, &sp);
}

PadScaledResult pad_to_alignment_scaled(const TensorView& hidden_states, const TensorView& tokens_per_expert,
                                        int alignment, const TensorView& hidden_scales, const Options& options) {
  Checker c("pad_to_alignment");
  check_pad_shapes(c, hidden_states, tokens_per_expert, alignment);
  const detail::ScaleSpec spec = detail::check_scales(c, hidden_scales, "hidden_scales", hidden_states.shape[0],
                                                      hidden_states.shape[1], hidden_states.device);
  const PadShape s = check_pad_inputs(c, hidden_states, tokens_per_expert, alignment, options, true);
  const detail::NewTensor outputs[] = {detail::rows_like(hidden_states, s.padded_rows),
                                       detail::rows_like(hidden_scales, s.padded_rows),
                                       {DType::kInt32, {s.padded_rows}},
                                       {DType::kInt32, {static_cast<int64_t>(s.counts.size())}}};
  return detail::allocate_outputs<PadScaledResult>(hidden_states.device, outputs, [&](const PadScaledResult& r) {
    const ScalePair sp{hidden_scales, r.padded_scales, spec};
    run_pad(c, s, hidden_states, tokens_per_expert, alignment, r.padded, r.permutation_map, r.inclusive_offsets,
            options, &sp);
  });
}

void unpad_from_alignment_scaled_out(const TensorView& padded, const TensorView& permutation_map,
                                     const TensorView& padded_scales, const TensorView& out,
                                     const TensorView& out_scales, const Options& options) {
  Checker c("unpad_from_alignment");
  c.row_tensor(out, "out", -1, -1, /*allow_fp8=*/true);
  const int64_t original_size = out.shape[0];
  check_unpad_inputs(c, padded, permutation_map, std::nullopt, original_size);
  const detail::ScaleSpec spec =
      detail::check_scales(c, padded_scales, "padded_scales", padded.shape[0], padded.shape[1], padded.device);
  c.row_output(out, "out", original_size, /*at_least=*/false, padded.shape[1], padded.dtype);
  c.same_device(out, "out", padded.device);
  detail::check_scales_out(c, out_scales, "out_scales", original_size, spec, padded.device);
  detail::check_disjoint_all(c, {detail::named(out, "out"), detail::named(out_scales, "out_scales")},
                             {detail::named(padded, "padded"), detail::named(permutation_map, "permutation_map"),
                              detail::named(padded_scales, "padded_scales")});
  const Inverse inverse = inverse_map(c, permutation_map, padded.shape[0], original_size, padded.device, options);
  const ScalePair sp{padded_scales, out_scales, spec};
  run_gather(padded, inverse.data, std::nullopt, false, out, original_size, options, &sp);
}

ScaledRows unpad_from_alignment_scaled(const TensorView& padded, const TensorView& permutation_map,
                                       int64_t original_size, const TensorView& padded_scales, const Options& options) {
  Checker c("unpad_from_alignment");
  check_unpad_inputs(c, padded, permutation_map, std::nullopt, original_size);
  const detail::ScaleSpec spec =
      detail::check_scales(c, padded_scales, "padded_scales", padded.shape[0], padded.shape[1], padded.device);
  const Inverse inverse = inverse_map(c, permutation_map, padded.shape[0], original_size, padded.device, options);
  return detail::allocate_outputs<ScaledRows>(
      padded.device, {detail::rows_like(padded, original_size), detail::rows_like(padded_scales, original_size)},
      [&](const ScaledRows& r) {
        const ScalePair sp{padded_scales, r.scales, spec};
        run_gather(padded, inverse.data, std::nullopt, false, r.rows, original_size, options, &sp);
      });
}

namespace {

// Inputs of unpad's backward, checked; returns the inverse map (on the host; on CUDA the map is
// only validated, in checked mode: the backward kernel needs no inverse).
Inverse unpad_backward_inputs(const Checker& c, const TensorView& grad_out, const TensorView& padded,
                              const TensorView& permutation_map, const std::optional<TensorView>& probs,
                              const Options& options) {
  c.row_tensor(grad_out, "grad_out", -1, -1, false);
  check_unpad_inputs(c, padded, permutation_map, probs, grad_out.shape[0]);
  c.row_tensor(padded, "padded_output", -1, grad_out.shape[1], false);
  if (padded.dtype != grad_out.dtype) {
    c.fail(ErrorKind::kType, "padded_output",
           std::string("expected dtype ") + dtype_name(grad_out.dtype) + ", got " + dtype_name(padded.dtype));
  }
  c.same_device(grad_out, "grad_out", padded.device);
  return inverse_map(c, permutation_map, padded.shape[0], grad_out.shape[0], padded.device, options,
                     /*build_on_device=*/false);
}

// grad_padded[p] = grad_out[map[p]] * probs[map[p]] (zero for padding);
// grad_probs[n] = <padded[inverse[n]], grad_out[n]> when wanted. CUDA: one warp a padded row
// forms both from one read of grad_out[map[p]] (grad_probs zeroed first), no inverse map;
// the CPU uses the host inverse.
void run_unpad_backward(const TensorView& grad_out, const TensorView& padded, const TensorView& permutation_map,
                        const Inverse& inverse, const std::optional<TensorView>& probs, const TensorView& grad_padded,
                        const TensorView* grad_probs, const Options& options) {
  const int64_t rows = padded.shape[0];
  if (padded.device.is_cuda()) {
    const cuda::ScaleArg scale = probs ? cuda::ScaleArg{probs->data, probs->dtype} : cuda::ScaleArg{};
    if (grad_probs != nullptr) {
      cuda::gather_rows_dots(cuda::RowsArg::of(grad_out), cuda::IndexRef::of(permutation_map), scale,
                             cuda::RowsArg::of(grad_padded), rows, cuda::RowsArg::of(padded),
                             cuda::FloatOutArg{grad_probs->data, grad_probs->dtype}, grad_out.shape[0], options.stream);
      return;
    }
    cuda::gather_rows(cuda::RowsArg::of(grad_out), cuda::IndexRef::of(permutation_map), scale,
                      /*scale_by_source=*/true, cuda::RowsArg::of(grad_padded), rows, nullptr, options.stream);
    return;
  }
  const detail::IndexReader map_in(permutation_map);
  std::vector<int32_t> map(static_cast<size_t>(rows));  // int32 for the row kernel (the input may be int64)
  for (int64_t p = 0; p < rows; ++p) map[p] = static_cast<int32_t>(map_in[p]);
  // grad_probs[n] = <padded[p], grad_out[n]> (p = inverse[n]) from the same read of grad_out[n].
  const cpu::GatherDots dots{cpu::RowsRef::of(padded), inverse.data, grad_out.shape[0],
                             grad_probs ? cpu::FloatOut{grad_probs->data, grad_probs->dtype} : cpu::FloatOut{}};
  cpu::gather_rows(cpu::RowsRef::of(grad_out), map.data(), cpu::Scale::of(probs), /*scale_by_source=*/true,
                   cpu::RowsRef::of(grad_padded), rows, options.num_threads, false, nullptr,
                   grad_probs != nullptr ? &dots : nullptr);
}

}  // namespace

void unpad_from_alignment_backward_out(const TensorView& grad_out, const TensorView& padded,
                                       const TensorView& permutation_map, const std::optional<TensorView>& probs,
                                       const TensorView& grad_padded, const TensorView& grad_probs,
                                       const Options& options) {
  Checker c("unpad_from_alignment_backward");
  c.row_tensor(grad_out, "grad_out", -1, -1, false);
  c.row_tensor(padded, "padded_output", -1, grad_out.shape[1], false);
  c.row_output(grad_padded, "grad_padded", padded.shape[0], /*at_least=*/false, padded.shape[1], padded.dtype);
  c.same_device(grad_padded, "grad_padded", padded.device);
  const bool want_gp = !(grad_probs.data == nullptr && grad_probs.ndim == 0);
  if (want_gp) {
    c.float_output(grad_probs, "grad_probs", grad_out.shape[0], padded.dtype);
    c.same_device(grad_probs, "grad_probs", padded.device);
  }
  detail::check_disjoint_all(c, {detail::named(grad_padded, "grad_padded"), detail::named(grad_probs, "grad_probs")},
                             {detail::named(grad_out, "grad_out"), detail::named(padded, "padded_output"),
                              detail::named(permutation_map, "permutation_map"), detail::named(probs, "probs")});
  const Inverse inverse = unpad_backward_inputs(c, grad_out, padded, permutation_map, probs, options);
  run_unpad_backward(grad_out, padded, permutation_map, inverse, probs, grad_padded, want_gp ? &grad_probs : nullptr,
                     options);
}

RowGrads unpad_from_alignment_backward(const TensorView& grad_out, const TensorView& padded,
                                       const TensorView& permutation_map, const std::optional<TensorView>& probs,
                                       const Options& options) {
  Checker c("unpad_from_alignment_backward");
  const Inverse inverse = unpad_backward_inputs(c, grad_out, padded, permutation_map, probs, options);
  return detail::allocate_outputs<RowGrads>(
      padded.device, {detail::rows_like(padded, padded.shape[0]), detail::grad_like(probs, grad_out.shape[0])},
      [&](const RowGrads& g) {
        run_unpad_backward(grad_out, padded, permutation_map, inverse, probs, g.grad_rows,
                           probs ? &g.grad_weights.view() : nullptr, options);
      });
}

}  // namespace padmoe
