// workload_data.cpp — the workload and its buffers (workload_data.hpp).
#include "workload_data.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace cli {

Workload parse_workload(const Args& args) {
  static const char* const kSizeFlags[] = {"tokens", "experts", "top-k", "hidden", "alignment"};
  bool sizes_given = false;
  for (const char* f : kSizeFlags) sizes_given = sizes_given || args.has(f);

  const std::string preset_name = args.get("preset", workload::default_preset_name());
  const workload::Preset* preset = workload::find_preset(preset_name);
  if (preset == nullptr) throw UsageError("unknown preset '" + preset_name + "' (see `padmoe presets`)");
  workload::Preset p = *preset;
  p.tokens = args.get_int("tokens", p.tokens);
  p.experts = args.get_int32("experts", p.experts);
  p.top_k = args.get_int32("top-k", p.top_k);
  p.hidden = args.get_int("hidden", p.hidden);
  p.alignment = args.get_int32("alignment", p.alignment);
  const bool implied_small = !args.has("preset") && !sizes_given;
  const bool small = args.has("small") || implied_small;
  if (small) p = workload::small(p);

  Workload w;
  w.label = sizes_given ? "custom (from " + preset_name + ")" : preset_name;
  if (small) w.label += implied_small ? " --small (default)" : " --small";
  w.T = p.tokens;
  w.E = p.experts;
  w.K = p.top_k;
  w.H = p.hidden;
  w.m = p.alignment;
  w.dtype = parse_dtype(args.get("dtype", "bf16"));
  w.seed = static_cast<uint64_t>(args.get_int("seed", 0));
  w.threads = static_cast<int>(args.get_int("threads", 0));
  const std::string dev = args.get("device", "cpu");
  if (dev == "cpu") w.device = Device::cpu();
  else if (dev == "cuda" || dev.rfind("cuda:", 0) == 0)
    w.device = Device::cuda(dev.size() > 5 ? std::atoi(dev.c_str() + 5) : 0);
  else throw UsageError("--device expects cpu or cuda, got '" + dev + "'");

  if (w.T < 0) throw UsageError("--tokens must be >= 0");
  if (w.E < 1) throw UsageError("--experts must be >= 1");
  if (w.K < 1 || w.K > w.E) throw UsageError("--top-k must be in [1, experts]");
  if (w.H < 0) throw UsageError("--hidden must be >= 0");
  if (w.m < 1) throw UsageError("--alignment must be >= 1");
  if (w.threads < 0) throw UsageError("--threads must be >= 0");
  // Sizes the library would reject, rejected before anything is allocated, in its words
  // (in 64 bits, no product that can overflow).
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (w.T > kMax / w.K) {
    throw Error(ErrorKind::kValue, "make_plan: top_experts: size overflow: " + std::to_string(w.T) + " x " +
                                       std::to_string(w.K) + " assignments do not fit the int32 index outputs");
  }
  const int64_t capacity = w.T * w.K + static_cast<int64_t>(w.E) * (w.m - 1);
  if (capacity > kMax) {
    throw Error(ErrorKind::kValue, "make_plan: capacity: size overflow: " + std::to_string(capacity) +
                                       " does not fit the int32 index outputs");
  }
  if (w.H > 0 && capacity > std::numeric_limits<int64_t>::max() / 8 / w.H) {
    throw Error(ErrorKind::kValue, "workload: hidden: size overflow: " + std::to_string(capacity) + " rows of " +
                                       std::to_string(w.H) + " elements");
  }
  return w;
}

namespace {

uint64_t stream_seed(uint64_t seed, uint64_t stream) {
  uint64_t s = seed ^ (0x632be59bd9b4e019ull * (stream + 1));
  return workload::splitmix64(s);
}

int32_t* i32(const Tensor& t) { return t.data_as<int32_t>(); }

Tensor plan_tensor(const std::vector<int64_t>& v) {
  Tensor t = Tensor::empty(DType::kInt32, {static_cast<int64_t>(v.size())});
  for (size_t i = 0; i < v.size(); ++i) i32(t)[i] = static_cast<int32_t>(v[i]);
  return t;
}

std::vector<float> to_floats(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = numeric::load_as_float(t.data(), t.dtype(), i);
  return v;
}

Tensor random_rows(int64_t rows, int64_t H, DType dtype, uint64_t seed) {
  Tensor t = Tensor::empty(dtype, {rows, H});
  workload::fill_uniform(t.data(), dtype, rows * H, seed);
  return t;
}

void fill_nan_rows(const Tensor& t, const int32_t* row_sources, int64_t rows, int64_t H) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t r = 0; r < rows; ++r) {
    if (row_sources[r] >= 0) continue;
    for (int64_t c = 0; c < H; ++c) numeric::store_from_float(t.data(), t.dtype(), r * H + c, nan);
  }
}

// A copy of host tensor t on `dev` (padmoe::copy, synchronous host->device).
Tensor to_device(const Tensor& t, Device dev, const Options& opt) {
  if (!t.defined() || t.device() == dev) return t;
  Tensor out = Tensor::empty(t.dtype(), t.ndim(), t.view().shape, dev);
  padmoe::copy(t, out, opt);
  return out;
}

// The input tensors of Data (what the ops read).
std::vector<Tensor*> input_tensors(Data& d) {
  Plan& p = d.plan;
  return {&d.top_experts,
          &d.weights,
          &p.indices,
          &p.bin_ids,
          &p.tokens_per_expert,
          &p.bins,
          &p.padded_tokens_per_expert,
          &p.padded_bins,
          &p.dest_rows,
          &p.row_sources,
          &d.x,
          &d.grad_out,
          &d.y,
          &d.grad_y,
          &d.h,
          &d.grad_unpadded,
          &d.padded,
          &d.perm_map,
          &d.probs,
          &d.x8,
          &d.x8_scales,
          &d.split_sizes,
          &d.mask};
}


}  // namespace

// The output tensors of Data (what the ops write).
std::vector<Tensor*> output_tensors(Data& d) {
  Plan& p = d.plan_out;
  return {&p.indices,
          &p.bin_ids,
          &p.tokens_per_expert,
          &p.bins,
          &p.padded_tokens_per_expert,
          &p.padded_bins,
          &p.dest_rows,
          &p.row_sources,
          &d.out_rows_R,
          &d.out_rows_R2,
          &d.out_rows_T,
          &d.out_rows_N,
          &d.out_rows_P,
          &d.out_f32_A,
          &d.out_f32_N,
          &d.out_map_R,
          &d.out_offsets_E,
          &d.out_row_experts_R,
          &d.out_block_experts,
          &d.out_total_1,
          &d.out_sorted_V,
          &d.out_block_ids_V,
          &d.out_post_1,
          &d.out_batched_B,
          &d.out_batched_blocks,
          &d.out_batched_post_1,
          &d.out_mask_counts,
          &d.out_mask_dest,
          &d.out_mask_sources,
          &d.out_mask_indices,
          &d.out_mask_bin_ids,
          &d.out_mask_row_id_map,
          &d.out_index_counts,
          &d.out_index_dest,
          &d.out_index_sources,
          &d.out_index_indices,
          &d.out_index_bin_ids,
          &d.out_rows8_R,
          &d.out_scales_R,
          &d.out_e8m0_R,
          &d.plan_ep.indices,
          &d.plan_ep.bin_ids,
          &d.plan_ep.tokens_per_expert,
          &d.plan_ep.bins,
          &d.plan_ep.padded_tokens_per_expert,
          &d.plan_ep.padded_bins,
          &d.plan_ep.dest_rows,
          &d.plan_ep.row_sources,
          &d.out_dropped_1};
}

// Builds the workload, always on the host; with --device cuda every input is
// then staged to the GPU (padmoe::copy) and the outputs are allocated there.
// With `reference`, the plan the ops run on is the reference plan (so a
// make_plan bug cannot hide in the other checks) and the host float copies are
// made; otherwise the plan is the library's make_plan (run on the host).
Data build_data(const Workload& w, bool reference) {
  Data d;
  d.w = w;
  d.opt.num_threads = w.threads;
  if (w.device.is_cuda()) {
    d.gpu = open_gpu(w.device);  // throws (exit 2) in a build without CUDA or without a GPU
    d.opt.stream = d.gpu->stream;
  }
  const int64_t T = w.T, H = w.H;
  d.A = T * w.K;
  d.N = d.A;
  d.R = padded_rows_bound(T, w.K, w.E, w.m);

  d.routing = workload::random_router(T, w.E, w.K, stream_seed(w.seed, 0));
  d.top_experts = Tensor::empty(DType::kInt32, {T, w.K});
  std::copy(d.routing.top_experts.begin(), d.routing.top_experts.end(), i32(d.top_experts));
  d.weights = Tensor::empty(DType::kFloat32, {d.A});
  std::copy(d.routing.weights.begin(), d.routing.weights.end(), d.weights.data_as<float>());

  if (reference) {
    d.have_reference = true;
    std::vector<int64_t> te(d.routing.top_experts.begin(), d.routing.top_experts.end());
    d.ref_plan = ref::make_plan(te, T, w.K, w.E, w.m);
    const ref::Plan& rp = d.ref_plan;
    d.plan.indices = plan_tensor(rp.indices);
    d.plan.bin_ids = plan_tensor(rp.bin_ids);
    d.plan.tokens_per_expert = plan_tensor(rp.tokens_per_expert);
    d.plan.bins = plan_tensor(rp.bins);
    d.plan.padded_tokens_per_expert = plan_tensor(rp.padded_tokens_per_expert);
    d.plan.padded_bins = plan_tensor(rp.padded_bins);
    d.plan.dest_rows = plan_tensor(rp.dest_rows);
    d.plan.row_sources = plan_tensor(rp.row_sources);
    d.plan.num_tokens = T;
    d.plan.top_k = w.K;
    d.plan.num_experts = w.E;
    d.plan.alignment = w.m;
    d.P = rp.padded_rows;
  } else {
    d.plan = make_plan(d.top_experts, w.E, w.m, d.opt);
    d.P = padded_rows(d.plan, d.opt);
  }
  const int64_t A = d.A, P = d.P, R = d.R, N = d.N;
  const int32_t* indices = i32(d.plan.indices);
  const int32_t* dest_rows = i32(d.plan.dest_rows);
  const int32_t* row_sources = i32(d.plan.row_sources);

  d.x = random_rows(T, H, w.dtype, stream_seed(w.seed, 1));
  d.grad_out = random_rows(T, H, w.dtype, stream_seed(w.seed, 2));
  d.y = random_rows(P, H, w.dtype, stream_seed(w.seed, 3));
  d.grad_y = random_rows(P, H, w.dtype, stream_seed(w.seed, 4));
  fill_nan_rows(d.y, row_sources, P, H);
  fill_nan_rows(d.grad_y, row_sources, P, H);

  // Megatron inputs: h is what a dispatch without padding produces (x rows in
  // expert-sorted order); `padded` is h padded per the plan's segments.
  d.tokens_per_expert = d.plan.tokens_per_expert;
  d.ep_ranks = w.E % 8 == 0 ? 8 : 1;
  {
    const int64_t local = w.E / d.ep_ranks;
    d.split_sizes = Tensor::empty(DType::kInt32, {d.ep_ranks, local});
    std::copy(i32(d.tokens_per_expert), i32(d.tokens_per_expert) + w.E, i32(d.split_sizes));
    for (int64_t e = 0; e < local; ++e) {
      int64_t rows = 0;
      for (int64_t r = 0; r < d.ep_ranks; ++r) rows += i32(d.split_sizes)[r * local + e];
      d.Pc += (rows + w.m - 1) / w.m * w.m;
    }
  }
  const size_t es = element_size(w.dtype);
  d.h = Tensor::empty(w.dtype, {N, H});
  d.probs = Tensor::empty(DType::kFloat32, {N});
  d.padded = Tensor::empty(w.dtype, {P, H});
  d.perm_map = Tensor::empty(DType::kInt32, {P});
  std::fill(i32(d.perm_map), i32(d.perm_map) + P, -1);
  for (int64_t i = 0; i < A; ++i) {
    const int64_t a = indices[i];
    const int64_t row = dest_rows[a];
    std::memcpy(static_cast<char*>(d.h.data()) + i * H * es, static_cast<const char*>(d.x.data()) + (a / w.K) * H * es,
                H * es);
    std::memcpy(static_cast<char*>(d.padded.data()) + row * H * es, static_cast<const char*>(d.h.data()) + i * H * es,
                H * es);
    i32(d.perm_map)[row] = static_cast<int32_t>(i);
    d.probs.data_as<float>()[i] = d.weights.data_as<float>()[a];
  }
  fill_nan_rows(d.padded, row_sources, P, H);
  d.grad_unpadded = random_rows(N, H, w.dtype, stream_seed(w.seed, 5));
  // float8 e4m3 rows (x rounded) with DeepSeek-V3 blockwise scales [T, ceil(H/128)] in [0.5, 4).
  const int64_t blocks = (H + 127) / 128;
  d.x8 = Tensor::empty(DType::kFloat8E4M3, {T, H});
  for (int64_t i = 0; i < T * H; ++i)
    numeric::store_from_float(d.x8.data(), DType::kFloat8E4M3, i, numeric::load_as_float(d.x.data(), w.dtype, i));
  d.x8_scales = random_rows(T, blocks, DType::kFloat32, stream_seed(w.seed, 6));
  for (int64_t i = 0; i < T * blocks; ++i) {
    float& v = d.x8_scales.data_as<float>()[i];
    v = 0.5f + 1.75f * (v + 1.0f);
  }

  const Device dev = w.device;
  d.plan_out = Plan::empty(T, w.K, w.E, w.m, dev);
  d.out_rows_R = Tensor::empty(w.dtype, {R, H}, dev);
  d.out_rows_R2 = Tensor::empty(w.dtype, {R, H}, dev);
  d.out_rows_T = Tensor::empty(w.dtype, {T, H}, dev);
  d.out_rows_N = Tensor::empty(w.dtype, {N, H}, dev);
  d.out_rows_P = Tensor::empty(w.dtype, {P, H}, dev);
  d.out_f32_A = Tensor::empty(DType::kFloat32, {A}, dev);
  d.out_f32_N = Tensor::empty(DType::kFloat32, {N}, dev);
  d.out_map_R = Tensor::empty(DType::kInt32, {R}, dev);
  d.out_offsets_E = Tensor::empty(DType::kInt32, {w.E}, dev);
  d.out_row_experts_R = Tensor::empty(DType::kInt32, {R}, dev);
  d.out_block_experts = Tensor::empty(DType::kInt32, {(R + w.m - 1) / w.m}, dev);
  d.out_total_1 = Tensor::empty(DType::kInt32, {1}, dev);
  const int64_t V = aligned_rows_bound(A, w.E, w.m);
  d.out_sorted_V = Tensor::empty(DType::kInt32, {V}, dev);
  d.out_block_ids_V = Tensor::empty(DType::kInt32, {(V + w.m - 1) / w.m}, dev);
  d.out_post_1 = Tensor::empty(DType::kInt32, {1}, dev);
  d.batched_max = w.E > 0 ? *std::max_element(i32(d.tokens_per_expert), i32(d.tokens_per_expert) + w.E) : 0;
  d.B = (d.batched_max + w.m - 1) / w.m * w.m * static_cast<int64_t>(w.E);
  // past the int32 outputs the op's own size check reports it: no buffer of that size is made
  const int64_t b_len = d.B <= std::numeric_limits<int32_t>::max() ? d.B : 0;
  d.out_batched_B = Tensor::empty(DType::kInt32, {b_len}, dev);
  d.out_batched_blocks = Tensor::empty(DType::kInt32, {b_len / w.m}, dev);
  d.out_batched_post_1 = Tensor::empty(DType::kInt32, {1}, dev);
  {
    // past int32 the op's own size check reports it (ops_table.cpp): no buffer of that size is made
    const int64_t te = T * w.E, rm = te + static_cast<int64_t>(w.E) * (w.m - 1);
    const bool fits = rm <= std::numeric_limits<int32_t>::max();
    d.mask = Tensor::empty(DType::kUInt8, {fits ? T : 0, w.E});
    uint8_t* m = d.mask.data_as<uint8_t>();
    if (fits) {
      std::fill(m, m + te, uint8_t{0});
      for (int64_t a = 0; a < d.A; ++a) m[(a / w.K) * w.E + d.routing.top_experts[static_cast<size_t>(a)]] = 1;
      if (reference) d.mask_ref.assign(m, m + te);
    }
    d.out_mask_counts = Tensor::empty(DType::kInt32, {4 * static_cast<int64_t>(w.E)}, dev);
    d.out_mask_dest = Tensor::empty(DType::kInt32, {fits ? te : 0}, dev);
    d.out_mask_indices = Tensor::empty(DType::kInt32, {fits ? te : 0}, dev);
    d.out_mask_bin_ids = Tensor::empty(DType::kInt32, {fits ? te : 0}, dev);
    d.out_mask_sources = Tensor::empty(DType::kInt32, {fits ? rm : 0}, dev);
    d.out_mask_row_id_map = Tensor::empty(DType::kInt32, {fits ? T : 0, 2 * static_cast<int64_t>(w.E) + 1}, dev);
  }
  d.out_index_counts = Tensor::empty(DType::kInt32, {4}, dev);
  d.out_index_dest = Tensor::empty(DType::kInt32, {d.A}, dev);
  d.out_index_sources = Tensor::empty(DType::kInt32, {d.A}, dev);
  d.out_index_indices = Tensor::empty(DType::kInt32, {d.A}, dev);
  d.out_index_bin_ids = Tensor::empty(DType::kInt32, {d.A}, dev);
  d.out_rows8_R = Tensor::empty(DType::kFloat8E4M3, {R, H}, dev);
  d.out_scales_R = Tensor::empty(DType::kFloat32, {R, blocks}, dev);
  d.out_e8m0_R = Tensor::empty(DType::kUInt8, {R, (H + 31) / 32}, dev);
  d.plan_ep = Plan::empty(T, w.K, w.E / d.ep_ranks, w.m, dev);
  d.out_dropped_1 = Tensor::empty(DType::kInt32, {1}, dev);
  d.expert_capacity = A / w.E / w.m * w.m;

  if (reference) {
    d.x_f = to_floats(d.x);
    d.grad_out_f = to_floats(d.grad_out);
    d.y_f = to_floats(d.y);
    d.grad_y_f = to_floats(d.grad_y);
    d.h_f = to_floats(d.h);
    d.padded_f = to_floats(d.padded);
    d.grad_unpadded_f = to_floats(d.grad_unpadded);
    d.probs_f = to_floats(d.probs);
    d.x8_f = to_floats(d.x8);
    d.x8_scales_f = to_floats(d.x8_scales);
    d.perm_map_ref.assign(i32(d.perm_map), i32(d.perm_map) + P);
    d.tokens_per_expert_ref = d.ref_plan.tokens_per_expert;
    d.split_sizes_ref.assign(i32(d.split_sizes), i32(d.split_sizes) + w.E);
  }
  if (dev.is_cuda()) {  // stage every input (the host copies are dropped)
    for (Tensor* t : input_tensors(d)) *t = to_device(*t, dev, d.opt);
    d.tokens_per_expert = d.plan.tokens_per_expert;
  }
  return d;
}

// The output view v as host memory: v itself on the CPU; for a device output,
// a host mirror of the whole tensor, refreshed by padmoe::copy (synchronous),
// with v's shape and strides.
TensorView on_host(Data& d, const TensorView& v) {
  if (!v.device.is_cuda() || v.data == nullptr) return v;
  for (Tensor* t : output_tensors(d)) {
    if (t->data() != v.data) continue;
    Tensor& host = d.host_mirrors[t->data()];
    if (!host.defined()) host = Tensor::empty(t->dtype(), t->ndim(), t->view().shape);
    padmoe::copy(*t, host, d.opt);
    TensorView h = v;
    h.data = host.data();
    h.device = Device::cpu();
    return h;
  }
  throw Error(ErrorKind::kRuntime, "check: no output tensor holds the device view being compared");
}

}  // namespace cli
