// test_cuda_chunks.cpp — sort_chunks (ops.hpp section 5) on the GPU: bitwise equal to the CPU backend
// (and the reference), checked-mode errors in the CPU's words with nothing
// written, and an unchecked _out captured in a CUDA graph.
// Helpers: cuda_fixture.hpp.
#include "cuda_fixture.hpp"

namespace pt {
namespace {

std::string sort_chunks_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const padmoe::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<int64_t> sort_chunks_sizes(int64_t C, int m, Rng& rng) {
  std::vector<int64_t> s(static_cast<size_t>(C));
  for (auto& n : s) n = rng.below(4) == 0 ? 0 : rng.below(3 * m + 7);
  return s;
}

TEST(SortChunksGpu, MatchesCpuBitwise) {
  REQUIRE_GPU();
  struct Cfg {
    int R, E, m;
    DType dt, sdt;
    bool sorted, two_d;
    int64_t H = 0;  // 0: 66 for float32, else 256
  };
  const std::vector<Cfg> cfgs = {
      {8, 4, 16, DType::kBFloat16, DType::kInt32, false, true},
      {8, 32, 128, DType::kBFloat16, DType::kInt64, false, false},
      {1, 6, 4, DType::kFloat32, DType::kInt64, false, false},
      {5, 1, 8, DType::kFloat16, DType::kInt32, false, true},
      {4, 8, 1, DType::kFloat32, DType::kInt32, true, false},
      {3, 5, 16, DType::kFloat8E4M3, DType::kInt64, true, true},
      {64, 16, 16, DType::kBFloat16, DType::kInt32, false, true},
      {2, 3, 4, DType::kFloat8E5M2, DType::kInt32, false, false},
      {16, 70, 8, DType::kFloat32, DType::kInt64, true, false},  // C = 1120 > the scan's 1024 threads
      {16, 160, 8, DType::kBFloat16, DType::kInt32, true, true},  // C = 2560: past the shared-memory layout
      // rows that are not 16-byte multiples: the one-launch form's 1- and 2-byte words
      {8, 32, 16, DType::kFloat8E4M3, DType::kInt32, false, true, 33},
      {4, 16, 8, DType::kBFloat16, DType::kInt64, true, false, 35},
      // rows of 256 words and more (the one launch's row-by-row form, forms 3 and 4): 300 16-byte
      // words, and 1101 4-byte words
      {8, 8, 16, DType::kBFloat16, DType::kInt32, false, true, 2400},
      {4, 6, 8, DType::kFloat32, DType::kInt64, true, false, 1101},
      // form 4's bounds: C = 256 chunks with 256-word rows, and 4-byte words with no sorted_index
      {8, 32, 16, DType::kBFloat16, DType::kInt64, false, false, 2048},
      {4, 6, 8, DType::kFloat32, DType::kInt32, false, true, 1101}};
  for (const Cfg& cf : cfgs) {
    SCOPED_TRACE("R=" + std::to_string(cf.R) + " E=" + std::to_string(cf.E) + " m=" + std::to_string(cf.m) + " " +
                 dname(cf.dt) + (cf.sorted ? " sorted" : ""));
    Rng rng(static_cast<uint64_t>(cf.R * 1000 + cf.E * 10 + cf.m));
    const int64_t C = static_cast<int64_t>(cf.R) * cf.E, H = cf.H > 0 ? cf.H : (cf.dt == DType::kFloat32 ? 66 : 256);
    const std::vector<int64_t> sizes = sort_chunks_sizes(C, cf.m, rng);
    const int64_t sum = std::accumulate(sizes.begin(), sizes.end(), int64_t{0}), N = sum + 3;
    std::vector<int64_t> perm(static_cast<size_t>(C));
    std::iota(perm.begin(), perm.end(), int64_t{0});
    for (int64_t i = C - 1; i > 0; --i)
      std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(rng.below(i + 1))]);
    const std::vector<float> hf = random_values(N * H, cf.dt, rng);
    const Tensor hh = rows_from_float(hf, cf.dt, N, H);
    const Tensor hs = cf.two_d ? index_matrix(sizes, cf.R, cf.E, cf.sdt) : index_tensor(sizes, cf.sdt);
    const Tensor hp = index_tensor(perm, DType::kInt64);
    const Tensor dh = to_gpu(hh), ds = to_gpu(hs), dp = to_gpu(hp);
    const std::optional<TensorView> hsi = cf.sorted ? std::optional<TensorView>(hp.view()) : std::nullopt;
    const std::optional<TensorView> dsi = cf.sorted ? std::optional<TensorView>(dp.view()) : std::nullopt;

    const ref::PadResult want = ref::sort_chunks(hf, H, sizes, cf.R, cf.m, cf.sorted ? &perm : nullptr);
    const int64_t P = want.padded_rows, cap = padmoe::sort_chunks_rows_bound(N, C, cf.R, cf.m);
    const padmoe::PadResult cpu = padmoe::sort_chunks(hh, hs, cf.R, cf.m, hsi);
    ASSERT_EQ(cpu.padded.size(0), P);
    EXPECT_TRUE(rows_bitwise(cpu.padded, want.padded, P));
    // five forms (unchecked calls only; checked ones validate on the device first, then take form
    // 0 or 1): 0 the layout, chunk_map, the gather; 1 the layout's fused map, the gather; 2 one
    // launch (chunk_rows_kernel, C <= 1024), the flattened loop; 3 the one launch moving a row at a
    // time (rows of 256 words and more; else form 2); 4 the layout in one block scan, one row a
    // block (chunk_rows_one_scan_kernel: no sorted_index, C <= 256, rows of 256 words and more;
    // else form 3). Form 4 is the default where it applies: the allocating call below takes it.
    for (int form : {0, 1, 2, 3, 4})
      for (bool checked : {true, false}) {
        for (bool zero_tail : {false, true}) {
          for (bool zero_padding : {true, false}) {
            SCOPED_TRACE("form " + std::to_string(form) + (zero_padding ? "" : " zero_padding off"));
            KernelOverrides ko;
            ko.chunk_map_fused = form != 0;
            ko.chunk_rows = form >= 2;
            ko.chunk_rows_form = form == 4   ? pol::ChunkRowsForm::kOneScan
                                 : form == 3 ? pol::ChunkRowsForm::kRowwise
                                             : pol::ChunkRowsForm::kFlat;
            kernel_overrides() = ko;
            padmoe::Options o;
            o.check_data = checked;
            o.zero_tail = zero_tail;
            o.zero_padding = zero_padding;
            Tensor gpad = gpu_poison_rows(cf.dt, cap, H), gmap = gpu_poison_index(cap), goff = gpu_poison_index(cf.E);
            padmoe::sort_chunks_out(dh, ds, cf.R, cf.m, dsi, gpad, gmap, goff, o);
            kernel_overrides() = KernelOverrides{};
            Tensor cpad = poison_rows(cf.dt, cap, H), cmap = poison_index(cap), coff = poison_index(cf.E);
            padmoe::sort_chunks_out(hh, hs, cf.R, cf.m, hsi, cpad, cmap, coff, o);
            const Tensor hpad = to_cpu(gpad);
            EXPECT_TRUE(all_same(hpad, cpad)) << "padded, checked=" << checked << " zero_tail=" << zero_tail;
            EXPECT_TRUE(all_same(to_cpu(gmap), cmap)) << "permutation_map";
            EXPECT_TRUE(all_same(to_cpu(goff), coff)) << "inclusive_offsets";
            if (zero_padding) EXPECT_TRUE(rows_bitwise(hpad, want.padded, P));
            EXPECT_TRUE(bytes_are(hpad, P, cap, zero_tail && zero_padding ? 0x00 : kPoison)) << "rows past P";
            EXPECT_EQ(index_to_vec(to_cpu(goff)), want.inclusive_offsets);
          }
        }
      }
    const padmoe::PadResult gpu = padmoe::sort_chunks(dh, ds, cf.R, cf.m, dsi);
    EXPECT_TRUE(all_same(to_cpu(gpu.padded), cpu.padded)) << "allocating form";
    EXPECT_TRUE(all_same(to_cpu(gpu.permutation_map), cpu.permutation_map));
    // The way back on the GPU (unsort_chunks = unpad_from_alignment), with probs for 16/32-bit rows.
    const Tensor cb = padmoe::unsort_chunks(cpu.padded, cpu.permutation_map, N);
    EXPECT_TRUE(all_same(to_cpu(padmoe::unsort_chunks(gpu.padded, gpu.permutation_map, N)), cb)) << "unsort";
    if (!padmoe::is_float8(cf.dt)) {
      const Tensor pr = vec_from_float(random_values(N, DType::kFloat32, rng, 0.0, 1.0), DType::kFloat32);
      const Tensor dpr = to_gpu(pr);
      EXPECT_TRUE(all_same(to_cpu(padmoe::unsort_chunks(gpu.padded, gpu.permutation_map, N, dpr.view())),
                           padmoe::unsort_chunks(cpu.padded, cpu.permutation_map, N, pr.view())))
          << "unsort with probs";
    }
  }
}

TEST(SortChunksGpu, CheckedModeErrorsAsCpuNothingWritten) {
  REQUIRE_GPU();
  const int64_t N = 10, H = 8;
  Rng rng(1);
  const Tensor hh = rows_from_float(random_values(N * H, DType::kFloat32, rng), DType::kFloat32, N, H);
  const Tensor dh = to_gpu(hh);
  struct Case {
    std::vector<int64_t> sizes;
    std::vector<int64_t> perm;  // empty: none
    int64_t rows;               // output rows
  };
  const std::vector<Case> cases = {
      {{1, -1, 0, -2, 1, 1}, {}, 64},           // negative: first [0, 1]
      {{1, 2, 11, 3, 1, 1}, {}, 64},            // entry past the rows
      {{1, 2, 4, 3, 1, 1}, {}, 64},             // sum past the rows
      {{1, 2, 0, 3, 1, 1}, {0, 1, 9, 3, -1, 5}, 64},  // sorted_index out of range
      {{1, 2, 0, 3, 1, 1}, {0, 4, 2, 4, 1, 2}, 64},   // repeated chunks 2 and 4
      {{1, 2, 0, 3, 1, 1}, {}, 11},             // P = 12 > 11 rows
      {{-1, 20, 0, 3, 1, 1}, {0, 0, 0, 0, 0, 0}, 64},  // several: the lowest code first
  };
  for (const Case& k : cases) {
    for (DType sdt : {DType::kInt32, DType::kInt64}) {
      const Tensor hs = index_matrix(k.sizes, 2, 3, sdt), ds = to_gpu(hs);
      const Tensor hp = index_tensor(k.perm, DType::kInt32);
      const Tensor dp = k.perm.empty() ? Tensor() : to_gpu(hp);
      const std::optional<TensorView> hsi = k.perm.empty() ? std::nullopt : std::optional<TensorView>(hp.view());
      const std::optional<TensorView> dsi = k.perm.empty() ? std::nullopt : std::optional<TensorView>(dp.view());
      Tensor cpad = poison_rows(DType::kFloat32, k.rows, H), cmap = poison_index(k.rows), coff = poison_index(3);
      Tensor gpad = gpu_poison_rows(DType::kFloat32, k.rows, H), gmap = gpu_poison_index(k.rows),
             goff = gpu_poison_index(3);
      const std::string cpu_msg =
          sort_chunks_error([&] { padmoe::sort_chunks_out(hh, hs, 2, 4, hsi, cpad, cmap, coff); });
      const std::string gpu_msg =
          sort_chunks_error([&] { padmoe::sort_chunks_out(dh, ds, 2, 4, dsi, gpad, gmap, goff); });
      EXPECT_NE(cpu_msg, "(no error)");
      EXPECT_EQ(gpu_msg, cpu_msg);
      EXPECT_TRUE(all_bytes_are(to_cpu(gpad), kPoison)) << gpu_msg;
      EXPECT_TRUE(all_bytes_are(to_cpu(gmap), kIndexPoison)) << gpu_msg;
      EXPECT_TRUE(all_bytes_are(to_cpu(goff), kIndexPoison)) << gpu_msg;
      if (k.rows == 64) {  // the allocating form reads the sizes on the host: the same words
        EXPECT_EQ(sort_chunks_error([&] { padmoe::sort_chunks(dh, ds, 2, 4, dsi); }), cpu_msg);
      }
    }
  }
}

TEST(SortChunksGpu, UncheckedCapturedInCudaGraph) {
  REQUIRE_GPU();
  const int R = 8, E = 4, m = 16;
  const int64_t C = R * E, N = 2048, H = 512;
  const DType dt = DType::kBFloat16;
  const int64_t cap = padmoe::sort_chunks_rows_bound(N, C, R, m);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t ws_bytes = padmoe::sort_chunks_workspace_bytes(C);
  void* ws = nullptr;
  CUDA_OK(cudaMalloc(&ws, ws_bytes));
  const Tensor d_h = gpu_filled(dt, {N, H}, 0), d_s = gpu_filled(DType::kInt32, {R, E}, 0);
  const Tensor d_pad = gpu_poison_rows(dt, cap, H), d_map = gpu_poison_index(cap), d_off = gpu_poison_index(E);
  padmoe::Options o;
  o.stream = stream;
  o.check_data = false;
  o.workspace = ws;
  o.workspace_bytes = ws_bytes;
  CUDA_OK(cudaDeviceSynchronize());
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  std::string error;
  try {
    padmoe::sort_chunks_out(d_h, d_s, R, m, std::nullopt, d_pad, d_map, d_off, o);
  } catch (const std::exception& e) {
    error = e.what();
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  ASSERT_EQ(error, "") << "sort_chunks_out failed during capture (a host synchronization?)";
  ASSERT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    Rng rng(77 + round);
    std::vector<int64_t> sizes(static_cast<size_t>(C));
    for (auto& n : sizes) n = rng.below(N / C + 20);
    if (round == 2) std::fill(sizes.begin(), sizes.end(), 0);
    const int64_t sum = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    ASSERT_LE(sum, N);
    const std::vector<int32_t> s32(sizes.begin(), sizes.end());
    const std::vector<float> hf = random_values(N * H, dt, rng);
    const Tensor hh = rows_from_float(hf, dt, N, H);
    CUDA_OK(cudaMemcpyAsync(d_s.data(), s32.data(), s32.size() * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(d_h.data(), hh.data(), nbytes(hh), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const ref::PadResult want = ref::sort_chunks(hf, H, sizes, R, m, nullptr);
    const Tensor gpad = to_cpu(d_pad);
    EXPECT_TRUE(rows_bitwise(gpad, want.padded, want.padded_rows));
    std::vector<int64_t> map = want.permutation_map;
    map.resize(static_cast<size_t>(cap), -1);
    EXPECT_EQ(index_to_vec(to_cpu(d_map)), map);
    EXPECT_EQ(index_to_vec(to_cpu(d_off)), want.inclusive_offsets);
    if (round == 0) EXPECT_TRUE(bytes_are(gpad, want.padded_rows, cap, kPoison)) << "wrote past P";
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaFree(ws));
  CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace pt
