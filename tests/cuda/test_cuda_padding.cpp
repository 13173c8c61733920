// test_cuda_padding.cpp — pad_to_alignment / unpad_from_alignment on the GPU against the CPU backend
// and the reference. Helpers: cuda_fixture.hpp.
#include "cuda_fixture.hpp"

namespace pt {
namespace {

// pad_to_alignment with no experts: P = 0, so every row of the padded output
// is "past P" and must stay untouched (the CPU leaves it alone).
TEST(CpuVsGpuEdge, PadWithNoExperts) {
  REQUIRE_GPU();
  const int64_t H = 8;
  const Tensor hh = rows_from_float(ones(5 * H), DType::kFloat32, 5, H);
  const Tensor hc = index_tensor({}, DType::kInt32);
  Tensor cpad = poison_rows(DType::kFloat32, 4, H), cmap = poison_index(4), coff = poison_index(0);
  padmoe::pad_to_alignment_out(hh, hc, 8, cpad, cmap, coff);
  Tensor gpad = gpu_poison_rows(DType::kFloat32, 4, H), gmap = gpu_poison_index(4), goff = gpu_poison_index(0);
  padmoe::pad_to_alignment_out(to_gpu(hh), to_gpu(hc), 8, gpad, gmap, goff);
  EXPECT_TRUE(all_bytes_are(cpad, kPoison)) << "CPU";
  EXPECT_TRUE(all_bytes_are(to_cpu(gpad), kPoison)) << "GPU wrote rows past P = 0";
  EXPECT_TRUE(all_same(to_cpu(gmap), cmap)) << "permutation_map: GPU vs CPU";
}

// Rows at or past P: untouched by default, zeroed under Options::zero_tail, with and without
// experts (no experts: P = 0, every row past it), as on the CPU.
TEST(CpuVsGpuEdge, PadZeroTailZeroesRowsPastP) {
  REQUIRE_GPU();
  const int64_t H = 8, R = 12;
  const Tensor hh = rows_from_float(ones(5 * H), DType::kFloat32, 5, H);
  for (const std::vector<int64_t>& counts : {std::vector<int64_t>{2, 3}, std::vector<int64_t>{}}) {
    const Tensor hc = index_tensor(counts, DType::kInt32);
    const int64_t P = counts.empty() ? 0 : 8, E = static_cast<int64_t>(counts.size());
    for (bool tail : {false, true}) {
      padmoe::Options o;
      o.zero_tail = tail;
      Tensor cpad = poison_rows(DType::kFloat32, R, H), cmap = poison_index(R), coff = poison_index(E);
      padmoe::pad_to_alignment_out(hh, hc, 4, cpad, cmap, coff, o);
      Tensor gpad = gpu_poison_rows(DType::kFloat32, R, H), gmap = gpu_poison_index(R), goff = gpu_poison_index(E);
      padmoe::pad_to_alignment_out(to_gpu(hh), to_gpu(hc), 4, gpad, gmap, goff, o);
      const Tensor back = to_cpu(gpad);
      EXPECT_TRUE(bytes_are(back, P, R, tail ? 0x00 : kPoison)) << "E " << E << " zero_tail " << tail;
      EXPECT_TRUE(all_same(back, cpad)) << "E " << E << " zero_tail " << tail << ": GPU vs CPU";
      EXPECT_TRUE(all_same(to_cpu(gmap), cmap)) << "permutation_map: GPU vs CPU";
    }
  }
}

// ---- pad and unpad against the CPU and the reference -----------------------------
// pad_to_alignment at many expert counts (up to 1024), capacity rows past P, 1- and 2-byte words,
// and unchecked bad counts; unpad_from_alignment over partial maps (rows no entry names), int64
// maps, probs of each dtype and many rows a block. (Written for one-launch forms of both, which
// were measured on the H200 and removed.)
TEST(PadUnpadGpu, PadMatchesCpuAndReference) {
  REQUIRE_GPU();
  struct Cfg {
    int E, m;
    DType dt, cdt;
    int64_t H, extra;  // extra: capacity rows past P (left untouched)
  };
  const std::vector<Cfg> cfgs = {{8, 16, DType::kBFloat16, DType::kInt32, 256, 5},
                                 {256, 16, DType::kBFloat16, DType::kInt64, 64, 0},
                                 {1, 4, DType::kFloat32, DType::kInt32, 66, 3},
                                 {33, 8, DType::kFloat16, DType::kInt64, 35, 17},  // 2-byte words
                                 {70, 1, DType::kFloat8E4M3, DType::kInt32, 33, 2},  // 1-byte words
                                 {1024, 4, DType::kBFloat16, DType::kInt32, 8, 9}};  // E = the kernel's 1024
  for (const Cfg& cf : cfgs) {
    SCOPED_TRACE("E=" + std::to_string(cf.E) + " m=" + std::to_string(cf.m) + " " + dname(cf.dt) +
                 " H=" + std::to_string(cf.H));
    Rng rng(static_cast<uint64_t>(cf.E * 31 + cf.m));
    std::vector<int64_t> counts(static_cast<size_t>(cf.E));
    for (auto& n : counts) n = rng.below(4) == 0 ? 0 : rng.below(3 * cf.m + 5);
    const int64_t sum = std::accumulate(counts.begin(), counts.end(), int64_t{0}), N = sum + 3, H = cf.H;
    const std::vector<float> hf = random_values(N * H, cf.dt, rng);
    const Tensor hh = rows_from_float(hf, cf.dt, N, H), hc = index_tensor(counts, cf.cdt);
    const Tensor dh = to_gpu(hh), dc = to_gpu(hc);
    const ref::PadResult want = ref::pad_to_alignment(hf, H, counts, cf.m);
    const int64_t P = want.padded_rows, cap = P + cf.extra;
    {
      for (bool checked : {true, false}) {
        for (bool zero_padding : {true, false}) {
          SCOPED_TRACE(std::string(checked ? "checked" : "unchecked") + (zero_padding ? "" : " zero_padding off"));
          padmoe::Options o;
          o.check_data = checked;
          o.zero_padding = zero_padding;
          Tensor gpad = gpu_poison_rows(cf.dt, cap, H), gmap = gpu_poison_index(cap), goff = gpu_poison_index(cf.E);
          padmoe::pad_to_alignment_out(dh, dc, cf.m, gpad, gmap, goff, o);
          Tensor cpad = poison_rows(cf.dt, cap, H), cmap = poison_index(cap), coff = poison_index(cf.E);
          padmoe::pad_to_alignment_out(hh, hc, cf.m, cpad, cmap, coff, o);
          const Tensor hpad = to_cpu(gpad);
          EXPECT_TRUE(all_same(hpad, cpad)) << "padded";
          EXPECT_TRUE(all_same(to_cpu(gmap), cmap)) << "permutation_map";
          EXPECT_TRUE(all_same(to_cpu(goff), coff)) << "inclusive_offsets";
          if (zero_padding) EXPECT_TRUE(rows_bitwise(hpad, want.padded, P));
          EXPECT_TRUE(bytes_are(hpad, P, cap, kPoison)) << "rows past P";
          const std::vector<int64_t> gm = index_to_vec(to_cpu(gmap));
          for (int64_t p = 0; p < cap; ++p) {
            ASSERT_EQ(gm[static_cast<size_t>(p)], p < P ? want.permutation_map[static_cast<size_t>(p)] : -1)
                << "map " << p;
          }
          EXPECT_EQ(index_to_vec(to_cpu(goff)), want.inclusive_offsets);
        }
      }
    }
    const padmoe::PadResult cpu = padmoe::pad_to_alignment(hh, hc, cf.m);
    const padmoe::PadResult gpu = padmoe::pad_to_alignment(dh, dc, cf.m);
    EXPECT_TRUE(all_same(to_cpu(gpu.padded), cpu.padded)) << "allocating form";
    EXPECT_TRUE(all_same(to_cpu(gpu.permutation_map), cpu.permutation_map));
  }
  // bad counts in unchecked mode (a negative entry, one past the rows, a sum past the rows): no
  // write outside the outputs (memcheck), the same bytes twice
  const int64_t N = 40, H = 64, E = 6, cap = 96;
  const Tensor dh = to_gpu(rows_from_float(std::vector<float>(N * H, 1.5f), DType::kBFloat16, N, H));
  const Tensor dc = to_gpu(index_tensor({5, -3, 60, 7, 30, 2}, DType::kInt64));
  padmoe::Options o;
  o.check_data = false;
  std::vector<Tensor> runs;
  for (int i = 0; i < 2; ++i) {
    Tensor gpad = gpu_poison_rows(DType::kBFloat16, cap, H), gmap = gpu_poison_index(cap), goff = gpu_poison_index(E);
    padmoe::pad_to_alignment_out(dh, dc, 8, gpad, gmap, goff, o);
    runs.push_back(to_cpu(gpad));
    runs.push_back(to_cpu(gmap));
  }
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(all_same(runs[0], runs[2]));
  EXPECT_TRUE(all_same(runs[1], runs[3]));
  for (int64_t v : index_to_vec(runs[1])) EXPECT_TRUE(v >= -1 && v < N) << v;
}

// A map naming k of the N rows from k distinct positions of P (the rest -1).
std::vector<int64_t> partial_map(int64_t P, int64_t N, int64_t k, Rng& rng) {
  std::vector<int64_t> pos(static_cast<size_t>(P)), rows(static_cast<size_t>(N)), map(static_cast<size_t>(P), -1);
  std::iota(pos.begin(), pos.end(), int64_t{0});
  std::iota(rows.begin(), rows.end(), int64_t{0});
  for (int64_t i = P - 1; i > 0; --i)
    std::swap(pos[static_cast<size_t>(i)], pos[static_cast<size_t>(rng.below(i + 1))]);
  for (int64_t i = N - 1; i > 0; --i)
    std::swap(rows[static_cast<size_t>(i)], rows[static_cast<size_t>(rng.below(i + 1))]);
  for (int64_t i = 0; i < k; ++i) map[static_cast<size_t>(pos[static_cast<size_t>(i)])] = rows[static_cast<size_t>(i)];
  return map;
}

TEST(PadUnpadGpu, UnpadMatchesCpuAndReference) {
  REQUIRE_GPU();
  struct Cfg {
    int64_t N, P, H;
    DType dt, mdt, pdt;  // pdt: probs' dtype (kInt32: no probs)
    int64_t named;       // rows the map names (N: all)
  };
  const std::vector<Cfg> cfgs = {
      {300, 500, 256, DType::kBFloat16, DType::kInt32, DType::kFloat32, 300},
      {2048, 4128, 128, DType::kBFloat16, DType::kInt32, DType::kInt32, 2048},  // decode's sizes, short rows
      {20000, 16000, 8, DType::kFloat32, DType::kInt64, DType::kFloat32, 15000},  // many rows a block
      {77, 130, 35, DType::kBFloat16, DType::kInt64, DType::kBFloat16, 60},  // 2-byte elements, not 16-byte rows
      {50, 64, 33, DType::kFloat8E4M3, DType::kInt32, DType::kInt32, 50},
      {1000, 1200, 66, DType::kFloat16, DType::kInt32, DType::kFloat16, 999},
      {5, 9, 16, DType::kFloat32, DType::kInt32, DType::kFloat32, 0}};  // names no row: all zero
  for (const Cfg& cf : cfgs) {
    SCOPED_TRACE("N=" + std::to_string(cf.N) + " P=" + std::to_string(cf.P) + " H=" + std::to_string(cf.H) + " " +
                 dname(cf.dt));
    Rng rng(static_cast<uint64_t>(cf.N * 7 + cf.P));
    const int64_t N = cf.N, P = cf.P, H = cf.H;
    const std::vector<int64_t> map = partial_map(P, N, cf.named, rng);
    const std::vector<float> pf = random_values(P * H, cf.dt, rng);
    const bool with_probs = cf.pdt != DType::kInt32;
    const std::vector<float> prf = random_values(N, with_probs ? cf.pdt : DType::kFloat32, rng, 0.0, 1.0);
    const Tensor hp = rows_from_float(pf, cf.dt, P, H), hm = index_tensor(map, cf.mdt);
    const Tensor hpr = vec_from_float(prf, with_probs ? cf.pdt : DType::kFloat32);
    const Tensor dp = to_gpu(hp), dm = to_gpu(hm), dpr = to_gpu(hpr);
    const std::optional<TensorView> cprobs = with_probs ? std::optional<TensorView>(hpr.view()) : std::nullopt;
    const std::optional<TensorView> gprobs = with_probs ? std::optional<TensorView>(dpr.view()) : std::nullopt;
    const std::vector<float> want = ref::unpad_from_alignment(pf, H, map, N, with_probs ? &prf : nullptr);
    const Tensor cu = padmoe::unpad_from_alignment(hp, hm, N, cprobs);
    ASSERT_TRUE(rows_bitwise(cu, want, N)) << "CPU";
    for (bool checked : {true, false}) {
      SCOPED_TRACE(checked ? "checked" : "unchecked");
      padmoe::Options o;
      o.check_data = checked;
      Tensor gu = gpu_poison_rows(cf.dt, N, H);
      padmoe::unpad_from_alignment_out(dp, dm, gprobs, gu, o);
      const Tensor ga = padmoe::unpad_from_alignment(dp, dm, N, gprobs, o);
      EXPECT_TRUE(all_same(to_cpu(gu), cu)) << "out form";
      EXPECT_TRUE(all_same(to_cpu(ga), cu)) << "allocating form";
    }
  }
  // bad entries in unchecked mode (below -1, past N, past int32) name no row: in bounds, the same
  // bytes as the plain-loop rule
  const int64_t N = 24, P = 40, H = 32;
  Rng rng(99);
  std::vector<int64_t> map = partial_map(P, N, 20, rng);
  map[11] = -9, map[12] = N + 4, map[13] = (int64_t{1} << 40), map[14] = -(int64_t{1} << 40);
  const std::vector<float> pf = random_values(P * H, DType::kBFloat16, rng);
  std::vector<float> want(static_cast<size_t>(N * H), 0.0f);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t n = map[static_cast<size_t>(p)];
    if (n < 0 || n >= N) continue;
    for (int64_t x = 0; x < H; ++x) want[static_cast<size_t>(n * H + x)] = pf[static_cast<size_t>(p * H + x)];
  }
  const Tensor dp = to_gpu(rows_from_float(pf, DType::kBFloat16, P, H)), dm = to_gpu(index_tensor(map, DType::kInt64));
  padmoe::Options o;
  o.check_data = false;
  Tensor gu = gpu_poison_rows(DType::kBFloat16, N, H);
  padmoe::unpad_from_alignment_out(dp, dm, std::nullopt, gu, o);
  EXPECT_TRUE(rows_bitwise(to_cpu(gu), want, N));
  CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace pt
