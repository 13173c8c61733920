// test_cuda_quant.cpp — the quantized rows on the GPU: the `_scaled` ops and the fused quantizing
// dispatch (ops.hpp section 4). Helpers: cuda_fixture.hpp.
#include "cuda_fixture.hpp"

namespace pt {
namespace {

// Rows moved with their scales (ops.hpp section 4) on the GPU: every `_scaled` op, every scale layout,
// float8 e4m3 / e5m2 and bf16 rows, bitwise equal to the CPU backend (rows and scale rows, including the
// poison past P), under zero_padding / zero_tail / unchecked mode; shape errors leave the outputs unwritten.
enum class Fp8Layout { kPerRow1D, kPerRow2D, kBlock128, kMx };

int64_t fp8_cols(Fp8Layout l, int64_t H) {
  return l == Fp8Layout::kBlock128 ? (H + 127) / 128 : l == Fp8Layout::kMx ? (H + 31) / 32 : 1;
}
Tensor fp8_poison_scales(Fp8Layout l, int64_t rows, int64_t H) {
  if (l == Fp8Layout::kPerRow1D) return filled(DType::kFloat32, {rows}, kPoison);
  return filled(l == Fp8Layout::kMx ? DType::kUInt8 : DType::kFloat32, {rows, fp8_cols(l, H)}, kPoison);
}
Tensor fp8_random_scales(Fp8Layout l, int64_t rows, int64_t H, Rng& rng) {
  Tensor t = fp8_poison_scales(l, rows, H);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (l == Fp8Layout::kMx) t.data_as<uint8_t>()[i] = static_cast<uint8_t>(100 + rng.below(51));
    else t.data_as<float>()[i] = static_cast<float>(rng.uniform(0.01, 4.0));
  }
  return t;
}

TEST(Fp8ScalesGpu, EveryScaledOpMatchesCpuBitwise) {
  REQUIRE_GPU();
  const Fp8Layout layouts[] = {Fp8Layout::kPerRow1D, Fp8Layout::kPerRow2D, Fp8Layout::kBlock128, Fp8Layout::kMx};
  for (DType dt : {DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kBFloat16}) {
    for (Fp8Layout l : layouts) {
      for (int64_t H : {int64_t{200}, int64_t{7168}, int64_t{0}}) {
        SCOPED_TRACE(std::string(dname(dt)) + " layout " + std::to_string(static_cast<int>(l)) +
                     " H=" + std::to_string(H));
        const int64_t T = 333;
        const int K = 4, E = 9, m = 32;
        const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 71 + H);
        const ref::Plan p = ref::make_plan(te, T, K, E, m);
        const int64_t rows = p.capacity + 3;
        Rng rng(5 + H);
        const Tensor hx = rows_from_float(random_values(T * H, dt, rng, -300.0, 300.0), dt, T, H);
        const Tensor hs = fp8_random_scales(l, T, H, rng);
        const Tensor dx = to_gpu(hx), ds = to_gpu(hs);
        const Tensor hte = index_matrix(te, T, K, DType::kInt32);
        const padmoe::Plan cplan = padmoe::make_plan(hte, E, m);
        GpuPlan gp = gpu_plan_buffers(T, K, E, m);
        padmoe::make_plan_out(to_gpu(hte), E, m, gp.view);
        const IndexInputs hi = index_inputs(p, DType::kInt64);
        const Tensor di = to_gpu(hi.indices), db = to_gpu(hi.bin_ids), dbins = to_gpu(hi.bins),
                     dpb = to_gpu(hi.padded_bins);
        for (int variant = 0; variant < 4; ++variant) {
          padmoe::Options o;
          o.zero_padding = variant != 1;
          o.zero_tail = variant == 2;
          o.check_data = variant != 3;
          SCOPED_TRACE("variant " + std::to_string(variant));
          Tensor cy = poison_rows(dt, rows, H), cs = fp8_poison_scales(l, rows, H);
          padmoe::dispatch_scaled_out(hx, cplan.view(), hs, cy, cs, o);
          // the default, the block spread, a warp a token
          for (const std::optional<pol::SpreadKernel> spread :
               {std::optional<pol::SpreadKernel>(), std::optional<pol::SpreadKernel>(pol::SpreadKernel::kBlock),
                std::optional<pol::SpreadKernel>(pol::SpreadKernel::kWarp)}) {
            SCOPED_TRACE("spread " + std::string(!spread                               ? "default"
                                                 : *spread == pol::SpreadKernel::kWarp ? "warp"
                                                                                       : "block"));
            kernel_overrides().spread = spread;
            Tensor gy = gpu_poison_rows(dt, rows, H), gs = to_gpu(fp8_poison_scales(l, rows, H));
            padmoe::dispatch_scaled_out(dx, gp.view, ds, gy, gs, o);
            EXPECT_TRUE(all_same(to_cpu(gy), cy)) << "dispatch rows";
            EXPECT_TRUE(all_same(to_cpu(gs), cs)) << "dispatch scales";
            Tensor ggy = gpu_poison_rows(dt, rows, H), ggs = to_gpu(fp8_poison_scales(l, rows, H));
            padmoe::padded_gather_scaled_out(dx, di, db, dbins, dpb, K, ds, ggy, ggs, o);
            EXPECT_TRUE(all_same(to_cpu(ggy), cy)) << "padded_gather rows";
            EXPECT_TRUE(all_same(to_cpu(ggs), cs)) << "padded_gather scales";
          }
          kernel_overrides().spread.reset();

          // pad the expert-grouped rows, then unpad them (every other map entry dropped: unnamed rows)
          std::vector<float> hf;
          const std::vector<float> xf = rows_to_float(hx);
          Tensor grouped_s = fp8_poison_scales(l, T * K, H);
          const int64_t srow =
              static_cast<int64_t>(grouped_s.numel() / std::max<int64_t>(T * K, 1)) * esize(grouped_s.dtype());
          for (int64_t i = 0; i < T * K; ++i) {
            const int64_t t = p.indices[static_cast<size_t>(i)] / K;
            hf.insert(hf.end(), xf.begin() + t * H, xf.begin() + (t + 1) * H);
            std::memcpy(static_cast<char*>(grouped_s.data()) + i * srow, static_cast<const char*>(hs.data()) + t * srow,
                        static_cast<size_t>(srow));
          }
          const Tensor hh = rows_from_float(hf, dt, T * K, H);
          const Tensor tpe = index_tensor(p.tokens_per_expert, DType::kInt32);
          const int64_t prow = p.padded_rows + 5;
          Tensor cp = poison_rows(dt, prow, H), cps = fp8_poison_scales(l, prow, H), cm = poison_index(prow),
                 co = poison_index(E);
          padmoe::pad_to_alignment_scaled_out(hh, tpe, m, grouped_s, cp, cps, cm, co, o);
          Tensor gpd = gpu_poison_rows(dt, prow, H), gps = to_gpu(fp8_poison_scales(l, prow, H)),
                 gm = gpu_poison_index(prow), go = gpu_poison_index(E);
          padmoe::pad_to_alignment_scaled_out(to_gpu(hh), to_gpu(tpe), m, to_gpu(grouped_s), gpd, gps, gm, go, o);
          EXPECT_TRUE(all_same(to_cpu(gpd), cp)) << "pad rows";
          EXPECT_TRUE(all_same(to_cpu(gps), cps)) << "pad scales";
          EXPECT_TRUE(all_same(to_cpu(gm), cm)) << "pad map";
          std::vector<int64_t> map = index_to_vec(cm);
          for (size_t i = 0; i < map.size(); i += 2) map[i] = -1;
          const Tensor hmap = index_tensor(map, DType::kInt32);
          const Tensor src_rows = rows_from_float(random_values(prow * H, dt, rng), dt, prow, H);
          const Tensor src_scales = fp8_random_scales(l, prow, H, rng);
          Tensor cu = poison_rows(dt, T * K, H), cus = fp8_poison_scales(l, T * K, H);
          padmoe::unpad_from_alignment_scaled_out(src_rows, hmap, src_scales, cu, cus, o);
          Tensor gu = gpu_poison_rows(dt, T * K, H), gus = to_gpu(fp8_poison_scales(l, T * K, H));
          padmoe::unpad_from_alignment_scaled_out(to_gpu(src_rows), to_gpu(hmap), to_gpu(src_scales), gu, gus, o);
          EXPECT_TRUE(all_same(to_cpu(gu), cu)) << "unpad rows";
          EXPECT_TRUE(all_same(to_cpu(gus), cus)) << "unpad scales";
        }
        // allocating forms (P rows)
        const padmoe::ScaledRows c = padmoe::dispatch_scaled(hx, cplan.view(), hs);
        const padmoe::ScaledRows g = padmoe::dispatch_scaled(dx, gp.view, ds);
        EXPECT_TRUE(all_same(to_cpu(g.rows), c.rows));
        EXPECT_TRUE(all_same(to_cpu(g.scales), c.scales));
      }
    }
  }
}

TEST(Fp8ScalesGpu, ShapeErrorsWriteNothing) {
  REQUIRE_GPU();
  const int64_t T = 40, H = 200;
  const int K = 2, E = 4, m = 8;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kUniform, 81);
  const ref::Plan p = ref::make_plan(te, T, K, E, m);
  const padmoe::Plan gplan = padmoe::make_plan(to_gpu(index_matrix(te, T, K, DType::kInt32)), E, m);
  const Tensor dx = gpu_poison_rows(DType::kFloat8E4M3, T, H);
  Tensor gy = gpu_poison_rows(DType::kFloat8E4M3, p.capacity, H);
  Tensor gs = to_gpu(fp8_poison_scales(Fp8Layout::kMx, p.capacity, H));
  const Tensor bad_cols = to_gpu(fp8_poison_scales(Fp8Layout::kMx, T, 100));  // ceil(100/32) = 4 columns, H needs 7
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_scaled_out(dx, gplan.view(), bad_cols, gy, gs); },
                           {"dispatch", "x_scales", "ceil(H/32)"}));
  const Tensor host_scales = fp8_poison_scales(Fp8Layout::kMx, T, H);  // on the CPU
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_scaled_out(dx, gplan.view(), host_scales, gy, gs); },
                           {"dispatch", "x_scales", "cuda:0"}));
  EXPECT_TRUE(all_bytes_are(to_cpu(gy), kPoison));
  EXPECT_TRUE(bytes_are(to_cpu(gs), 0, p.capacity, kPoison));
}

// The fused quantizing dispatch (ops.hpp section 4) on the GPU: dispatch_quantized and
// quantize, every scale layout x bf16 / f16 / f32 rows x e4m3 / e5m2, widths with partial blocks and
// unaligned rows, values with all-zero, tiny, huge, tied, saturating and NaN / inf blocks; bitwise equal
// to the CPU backend (codes, scales, padding rows, the poison past P) and to the reference quantizer,
// under zero_padding / zero_tail / unchecked mode, top_k past the kernel's staging group (70), and a bad
// output dtype / layout written nowhere.
std::vector<float> quant_values(int64_t T, int64_t H, DType dt, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < H; ++c) {
      const int64_t kind = (t * 5 + c / 32 + static_cast<int64_t>(seed)) % 8;
      float x = static_cast<float>(rng.uniform(-3.0, 3.0));
      if (kind == 1) x = 0.0f;                                                 // all-zero block
      if (kind == 2) x *= dt == DType::kFloat16 ? 1e-6f : 1e-38f;               // tiny
      if (kind == 3) x *= dt == DType::kFloat16 ? 20000.0f : 1e37f;             // huge
      if (kind == 4) x = (c % 32 == 0) ? 448.0f : 1.0625f + 0.125f * static_cast<float>(rng.below(8));  // e4m3 ties
      if (kind == 5 && c % 32 == 0) x = 1.96875f * 4096.0f;                    // saturating MX block
      if (kind == 6 && c % 32 == 7) x = NAN;
      if (kind == 7 && c % 32 == 9) x = INFINITY;
      v[static_cast<size_t>(t * H + c)] = num::round_to(dt, x);
    }
  }
  return v;
}

std::vector<uint8_t> quant_bytes(const TensorView& t) {
  const auto* p = static_cast<const uint8_t*>(t.data);
  return std::vector<uint8_t>(p, p + nbytes(t));
}

TEST(QuantDispatchGpu, MatchesCpuAndReferenceBitwise) {
  REQUIRE_GPU();
  using padmoe::ScaleLayout;
  const ScaleLayout layouts[] = {ScaleLayout::kBlock128, ScaleLayout::kMxE8M0, ScaleLayout::kPerRow};
  for (ScaleLayout l : layouts) {
    for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
        for (int64_t H : {int64_t{1}, int64_t{31}, int64_t{200}, int64_t{2100}, int64_t{7168}, int64_t{0}}) {
          for (int K : {4, 70}) {
            if (K == 70 && H > 200) continue;
            SCOPED_TRACE(std::string(dname(dt)) + " -> " + dname(out) + " layout " +
                         std::to_string(static_cast<int>(l)) + " H=" + std::to_string(H) + " K=" + std::to_string(K));
            const int64_t T = H >= 2048 ? 97 : 333;
            const int E = 9, m = 32;
            const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 71 + H + K);
            const ref::Plan p = ref::make_plan(te, T, K, E, m);
            const int64_t rows = p.capacity + 3;
            const std::vector<float> xf = quant_values(T, H, dt, 9 + H);
            const Tensor hx = rows_from_float(xf, dt, T, H), dx = to_gpu(hx);
            const Tensor hte = index_matrix(te, T, K, DType::kInt32);
            const padmoe::Plan cplan = padmoe::make_plan(hte, E, m);
            GpuPlan gp = gpu_plan_buffers(T, K, E, m);
            padmoe::make_plan_out(to_gpu(hte), E, m, gp.view);
            const ref::QuantRows want = ref::dispatch_quantized(
                xf, H, p, static_cast<ref::QuantLayout>(static_cast<int>(l)), out == DType::kFloat8E5M2);
            // 0 the defaults, 1 zero_padding off, 2 zero_tail, 3 unchecked (T = 97 at H = 2100 and
            // 7168: the row's steps in blocks of their own, policy::quant_slices)
            for (int variant = 0; variant < 4; ++variant) {
              padmoe::Options o;
              o.zero_padding = variant != 1;
              o.zero_tail = variant == 2;
              o.check_data = variant != 3;
              SCOPED_TRACE("variant " + std::to_string(variant));
              Tensor cy = poison_rows(out, rows, H), cs = quant_poison_scales(l, rows, H);
              padmoe::dispatch_quantized_out(hx, cplan.view(), cy, cs, o);
              Tensor gy = gpu_poison_rows(out, rows, H), gs = to_gpu(quant_poison_scales(l, rows, H));
              padmoe::dispatch_quantized_out(dx, gp.view, gy, gs, o);
              EXPECT_TRUE(all_same(to_cpu(gy), cy)) << "codes";
              EXPECT_TRUE(all_same(to_cpu(gs), cs)) << "scales";
              if (variant == 0) {  // and the reference, rows [0, P)
                const std::vector<uint8_t> got = quant_bytes(to_cpu(gy)), gots = quant_bytes(to_cpu(gs));
                EXPECT_TRUE(std::equal(want.rows.begin(), want.rows.end(), got.begin())) << "codes vs reference";
                EXPECT_TRUE(std::equal(want.scales.begin(), want.scales.end(), gots.begin())) << "scales vs reference";
              }
            }
            // allocating forms, and quantize alone
            const padmoe::ScaledRows c = padmoe::dispatch_quantized(hx, cplan.view(), l, out);
            const padmoe::ScaledRows g = padmoe::dispatch_quantized(dx, gp.view, l, out);
            EXPECT_TRUE(all_same(to_cpu(g.rows), c.rows));
            EXPECT_TRUE(all_same(to_cpu(g.scales), c.scales));
            const padmoe::ScaledRows cq = padmoe::quantize(hx, l, out);
            const padmoe::ScaledRows gq = padmoe::quantize(dx, l, out);
            EXPECT_TRUE(all_same(to_cpu(gq.rows), cq.rows));
            EXPECT_TRUE(all_same(to_cpu(gq.scales), cq.scales));
          }
        }
      }
    }
  }
}

TEST(QuantDispatchGpu, HardwareConversionMatchesSoftwareOnEveryFloat) {
  REQUIRE_GPU();
  // cvt.rn.satfinite against quant::fp8_saturate (the CPU's conversion) on all 2^32 - 2^24 non-NaN
  // float32 patterns: infinities, float32 subnormals, fp8 subnormals, ties and saturation included.
  for (bool e5m2 : {false, true}) {
    uint32_t first = 0;
    int64_t compared = 0;
    const int64_t n = padmoe::cuda::fp8_convert_mismatches(e5m2, &first, &compared);
    EXPECT_EQ(n, 0) << (e5m2 ? "e5m2" : "e4m3fn") << ": first mismatch at float32 bits 0x" << std::hex << first;
    EXPECT_EQ(compared, (int64_t{1} << 32) - 2 * ((int64_t{1} << 23) - 1));  // every pattern but the NaNs
  }
}

TEST(QuantDispatchGpu, UnalignedRowsMatchCpu) {
  REQUIRE_GPU();
  // x a column slice (row stride 203 elements: rows not 16-byte aligned), y with an odd row stride
  const int64_t T = 150, H = 130, xs = 203, ys_stride = 133;
  const int K = 3, E = 5, m = 16;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kUniform, 17);
  const ref::Plan p = ref::make_plan(te, T, K, E, m);
  const std::vector<float> wide = quant_values(T, xs, DType::kBFloat16, 3);
  const Tensor hw = rows_from_float(wide, DType::kBFloat16, T, xs), dw = to_gpu(hw);
  const TensorView hx = TensorView::matrix(hw.data(), DType::kBFloat16, T, H, xs);
  const TensorView dx = TensorView::matrix(dw.data(), DType::kBFloat16, T, H, xs, kGpu);
  const Tensor hte = index_matrix(te, T, K, DType::kInt32);
  const padmoe::Plan cplan = padmoe::make_plan(hte, E, m);
  const padmoe::Plan gplan = padmoe::make_plan(to_gpu(hte), E, m);
  for (padmoe::ScaleLayout l : {padmoe::ScaleLayout::kBlock128, padmoe::ScaleLayout::kMxE8M0}) {
    const int64_t rows = p.capacity;
    Tensor cyb = poison_rows(DType::kFloat8E4M3, rows, ys_stride),
           gyb = gpu_poison_rows(DType::kFloat8E4M3, rows, ys_stride);
    const TensorView cy = TensorView::matrix(cyb.data(), DType::kFloat8E4M3, rows, H, ys_stride);
    const TensorView gy = TensorView::matrix(gyb.data(), DType::kFloat8E4M3, rows, H, ys_stride, kGpu);
    Tensor cs = quant_poison_scales(l, rows, H), gs = to_gpu(quant_poison_scales(l, rows, H));
    padmoe::dispatch_quantized_out(hx, cplan.view(), cy, cs);
    padmoe::dispatch_quantized_out(dx, gplan.view(), gy, gs);
    EXPECT_TRUE(all_same(to_cpu(gyb), cyb));
    EXPECT_TRUE(all_same(to_cpu(gs), cs));
  }
}

TEST(QuantDispatchGpu, ShapeErrorsWriteNothing) {
  REQUIRE_GPU();
  const int64_t T = 40, H = 200;
  const int K = 2, E = 4, m = 8;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kUniform, 81);
  const ref::Plan p = ref::make_plan(te, T, K, E, m);
  const padmoe::Plan gplan = padmoe::make_plan(to_gpu(index_matrix(te, T, K, DType::kInt32)), E, m);
  const Tensor dx = gpu_poison_rows(DType::kBFloat16, T, H);
  Tensor gy = gpu_poison_rows(DType::kFloat8E4M3, p.capacity, H);
  Tensor gs = to_gpu(quant_poison_scales(padmoe::ScaleLayout::kMxE8M0, p.capacity, H));
  const Tensor bad_cols = to_gpu(quant_poison_scales(padmoe::ScaleLayout::kMxE8M0, p.capacity, 100));
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_quantized_out(dx, gplan.view(), gy, bad_cols); },
                           {"dispatch_quantized", "y_scales", "ceil(H/32)"}));
  Tensor gb = gpu_poison_rows(DType::kBFloat16, p.capacity, H);
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_quantized_out(dx, gplan.view(), gb, gs); },
                           {"dispatch_quantized", "y", "float8_e4m3 or float8_e5m2"}));
  const Tensor host_scales = quant_poison_scales(padmoe::ScaleLayout::kMxE8M0, p.capacity, H);
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_quantized_out(dx, gplan.view(), gy, host_scales); },
                           {"dispatch_quantized", "y_scales", "cuda:0"}));
  EXPECT_TRUE(all_bytes_are(to_cpu(gy), kPoison));
  EXPECT_TRUE(all_bytes_are(to_cpu(gs), kPoison));
  EXPECT_TRUE(all_bytes_are(to_cpu(gb), kPoison));
}

}  // namespace
}  // namespace pt
