// test_cuda_launch.cpp — ops chained on one stream with no host synchronization between them:
// captured once in a CUDA graph and replayed on new inputs, with programmatic dependent launch off
// and on, and with the L2 prefetch before the wait. Helpers: cuda_fixture.hpp.
#include "cuda_fixture.hpp"

namespace pt {
namespace {

// Programmatic dependent launch: a chain of ops on one stream with no host synchronization
// between them (each reads what the one before wrote, and the pad / unpad ops are several
// launches), run with PDL off and on. Every kernel must wait for its predecessor before its
// first access, so both runs give the same bits, and the moves and sums equal the CPU's.
TEST(Pdl, ChainedOpsMatchWithAndWithoutPdl) {
  REQUIRE_GPU();
  const int64_t T = 4096, H = 512;
  const int E = 64, K = 8, m = 16;
  const int64_t A = T * K, cap = padmoe::padded_rows_bound(T, K, E, m);
  const DType dt = DType::kBFloat16;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 31);
  Rng rng(41);
  const Tensor hte = index_matrix(te, T, K, DType::kInt32);
  const Tensor hx = rows_from_float(random_values(T * H, dt, rng), dt, T, H);
  const Tensor hw = vec_from_float(random_values(A, DType::kFloat32, rng, 0, 1), DType::kFloat32);
  const Tensor dte = to_gpu(hte), dx = to_gpu(hx), dw = to_gpu(hw);

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t ws_bytes = padmoe::workspace_bound(T, K, E, m);
  void* ws = nullptr;
  CUDA_OK(cudaMalloc(&ws, ws_bytes));
  padmoe::Options o;
  o.stream = stream;
  o.check_data = false;
  o.workspace = ws;
  o.workspace_bytes = ws_bytes;

  auto chain = [&](int pdl) {
    kernel_overrides().pdl = pdl != 0;
    GpuPlan gp = gpu_plan_buffers(T, K, E, m);
    const Tensor y = gpu_poison_rows(dt, cap, H), out = gpu_poison_rows(dt, T, H);
    const Tensor gy = gpu_poison_rows(dt, cap, H), gx = gpu_poison_rows(dt, T, H);
    const Tensor gw = gpu_filled(DType::kFloat32, {A}, 0xff), gw2 = gpu_filled(DType::kFloat32, {A}, 0xff);
    const Tensor padded = gpu_poison_rows(dt, cap, H), map = gpu_poison_index(cap), offs = gpu_poison_index(E);
    const Tensor back = gpu_poison_rows(dt, A, H);
    CUDA_OK(cudaDeviceSynchronize());  // the poison memsets ran on the legacy stream
    padmoe::make_plan_out(dte, E, m, gp.view, o);
    padmoe::dispatch_out(dx, gp.view, dw.view(), y, o);
    padmoe::combine_out(y, gp.view, dw.view(), out, o);
    padmoe::combine_backward_out(out, y, gp.view, dw.view(), gy, gw, o);
    padmoe::dispatch_backward_out(gy, dx, gp.view, dw.view(), gx, gw2, o);
    padmoe::pad_to_alignment_out(gy, gp.tpe, m, padded, map, offs, o);  // gy's first A rows as grouped rows
    padmoe::unpad_from_alignment_out(padded, map, std::nullopt, back, o);
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<Tensor> r;
    for (const Tensor* t : std::initializer_list<const Tensor*>{&gp.dest_rows, &gp.row_sources, &y, &out, &gy, &gw, &gx,
                                                                &gw2, &padded, &map, &offs, &back})
      r.push_back(to_cpu(*t));
    return r;
  };
  const std::vector<Tensor> off = chain(0);
  const std::vector<Tensor> on = chain(1);
  kernel_overrides().pdl.reset();
  ASSERT_EQ(off.size(), on.size());
  for (size_t i = 0; i < off.size(); ++i) EXPECT_TRUE(all_same(off[i], on[i])) << "output " << i << " differs with PDL";

  // the moves and sums against the CPU (bitwise); the dots (gw, gw2) are covered by DotKernels
  const padmoe::Plan cp = padmoe::make_plan(hte, E, m);
  const int64_t P = padmoe::padded_rows(cp);
  const Tensor cy = padmoe::dispatch(hx, cp.view(), hw.view());
  EXPECT_TRUE(rows_same(on[2], cy, 0, P)) << "dispatch vs CPU";
  const Tensor cout = padmoe::combine(cy, cp.view(), hw.view());
  EXPECT_TRUE(all_same(on[3], cout)) << "combine vs CPU";
  const padmoe::RowGrads cgb = padmoe::combine_backward(cout, cy, cp.view(), hw.view());
  EXPECT_TRUE(rows_same(on[4], cgb.grad_rows, 0, P)) << "combine_backward vs CPU";
  const padmoe::RowGrads cdb = padmoe::dispatch_backward(cgb.grad_rows, hx, cp.view(), hw.view());
  EXPECT_TRUE(all_same(on[6], cdb.grad_rows)) << "dispatch_backward vs CPU";
  CUDA_OK(cudaFree(ws));
  CUDA_OK(cudaStreamDestroy(stream));
}

// ---------------------------------------------------------------------------
// CUDA graph: plan + dispatch + combine captured once, replayed on new inputs.
// ---------------------------------------------------------------------------
// T=512: a one-chunk plan (an ordinary launch); T=16384, K=8, E=256: the plan's cooperative
// launch (a grid barrier) captured and replayed.
void capture_once_replay(const int64_t T, const int E, const int K) {
  SCOPED_TRACE("T=" + std::to_string(T) + " E=" + std::to_string(E) + " K=" + std::to_string(K));
  const int64_t H = 256;
  const int m = 16;
  const int64_t A = T * K, cap = padmoe::padded_rows_bound(T, K, E, m);
  const DType dt = DType::kBFloat16;

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t ws_bytes = padmoe::workspace_bound(T, K, E, m);
  void* ws = nullptr;
  CUDA_OK(cudaMalloc(&ws, ws_bytes));

  const Tensor d_te = gpu_filled(DType::kInt32, {T, K}, 0);
  const Tensor d_x = gpu_filled(dt, {T, H}, 0);
  const Tensor d_w = gpu_filled(DType::kFloat32, {A}, 0);
  GpuPlan gp = gpu_plan_buffers(T, K, E, m);
  const Tensor d_y = gpu_poison_rows(dt, cap, H);
  const Tensor d_out = gpu_poison_rows(dt, T, H);

  padmoe::Options o;
  o.stream = stream;
  o.check_data = false;
  o.workspace = ws;
  o.workspace_bytes = ws_bytes;

  CUDA_OK(cudaDeviceSynchronize());  // the poison memsets ran on the legacy stream
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  bool threw = false;
  std::string error;
  try {
    padmoe::make_plan_out(d_te, E, m, gp.view, o);
    padmoe::dispatch_out(d_x, gp.view, d_w.view(), d_y, o);
    padmoe::combine_out(d_y, gp.view, d_w.view(), d_out, o);
  } catch (const std::exception& e) {
    threw = true;
    error = e.what();
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t qerr = cudaStreamIsCapturing(stream, &status);
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  ASSERT_FALSE(threw) << "an op failed during capture (a host synchronization or allocation?): " << error;
  ASSERT_EQ(qerr, cudaSuccess) << cudaGetErrorString(qerr);
  ASSERT_EQ(status, cudaStreamCaptureStatusActive) << "capture was invalidated by an op";
  ASSERT_EQ(end, cudaSuccess) << "cudaStreamEndCapture: " << cudaGetErrorString(end);
  ASSERT_NE(graph, nullptr);
  size_t num_nodes = 0;
  CUDA_OK(cudaGraphGetNodes(graph, nullptr, &num_nodes));
  EXPECT_GE(num_nodes, 3u);  // the plan (one launch when E <= 512), dispatch, combine
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const padmoe::workload::Routing rt = padmoe::workload::random_router(T, E, K, 1234 + round);
    std::vector<int64_t> te(rt.top_experts.begin(), rt.top_experts.end());
    if (round == 2)  // a skewed round: different P, many empty experts
      te = make_routing(T, K, E, Dist::kSkewed, 99);
    const std::vector<int32_t> te32(te.begin(), te.end());
    Rng rng(500 + round);
    const std::vector<float> xf = random_values(T * H, dt, rng);
    const Tensor hx = rows_from_float(xf, dt, T, H);
    const std::vector<float>& wf = rt.weights;
    CUDA_OK(cudaMemcpyAsync(d_te.data(), te32.data(), te32.size() * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(d_x.data(), hx.data(), nbytes(hx), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(d_w.data(), wf.data(), wf.size() * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));

    const ref::Plan p = ref::make_plan(te, T, K, E, m);
    const int64_t P = p.padded_rows;
    const padmoe::Plan cplan = padmoe::make_plan(index_matrix(te, T, K, DType::kInt32), E, m);
    expect_plan_equal(gp.view, cplan, p, "graph make_plan_out");
    const Tensor hw = vec_from_float(wf, DType::kFloat32);
    const Tensor cy = padmoe::dispatch(hx, cplan.view(), hw.view());
    const std::vector<float> want_y = ref::padded_gather(xf, H, p, &wf);
    const Tensor gy = to_cpu(d_y);
    EXPECT_TRUE(rows_bitwise(gy, want_y, P)) << "graph dispatch vs reference";
    EXPECT_TRUE(rows_same(gy, cy, 0, P)) << "graph dispatch vs CPU";
    if (round == 0) EXPECT_TRUE(bytes_are(gy, P, cap, kPoison)) << "graph dispatch wrote past P";
    const std::vector<float> yf = rows_to_float(cy);
    const std::vector<double> want = ref::padded_scatter(yf, H, p, &wf);
    const std::vector<double> abs = ref_scatter_abs(yf, H, p, &wf);
    EXPECT_TRUE(sums_close(to_cpu(d_out), want, abs, K, T)) << "graph combine vs reference";
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaFree(ws));
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(CudaGraph, CaptureOnceReplayOnNewRouting) {
  REQUIRE_GPU();
  capture_once_replay(512, 16, 4);
  capture_once_replay(16384, 256, 8);
}

// ---------------------------------------------------------------------------
// L2 prefetch before the wait (common.cuh: l2_prefetch). A kernel may ask L2 for its rows before
// its pdl_wait, while the kernel ahead of it may still be writing them: here every prefetched row
// was written by the launch just before (dispatch and the quantizing dispatch of combine's
// output, sort_chunks of it, pad of the second dispatch's rows), PDL on, no host synchronization
// in the chain. The prefetch off, by the default rule and at every size: the same bits, and the
// CPU's.
// ---------------------------------------------------------------------------
TEST(L2Prefetch, OpsOnRowsJustWrittenMatchOffAndCpu) {
  REQUIRE_GPU();
  const int64_t T = 512, H = 1024;
  const int E = 32, K = 4, m = 16, R = 4;
  const int64_t A = T * K, cap = padmoe::padded_rows_bound(T, K, E, m), C = int64_t{R} * E;
  const DType dt = DType::kBFloat16;
  const padmoe::ScaleLayout ql = padmoe::ScaleLayout::kBlock128;
  const std::vector<int64_t> te = make_routing(T, K, E, Dist::kSkewed, 57);
  Rng rng(58);
  const Tensor hte = index_matrix(te, T, K, DType::kInt32);
  const Tensor hx = rows_from_float(random_values(T * H, dt, rng), dt, T, H);
  const Tensor hw = vec_from_float(random_values(A, DType::kFloat32, rng, 0, 1), DType::kFloat32);
  std::vector<int64_t> sizes(static_cast<size_t>(C));
  for (auto& n : sizes) n = rng.below(5);  // at most 4 * C = T rows
  const Tensor hs = index_tensor(sizes, DType::kInt32);
  const int64_t scap = padmoe::sort_chunks_rows_bound(T, C, R, m);
  const Tensor dte = to_gpu(hte), dx = to_gpu(hx), dw = to_gpu(hw), ds = to_gpu(hs);

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  padmoe::Options o;
  o.stream = stream;
  o.check_data = false;

  auto chain = [&](int mode) {
    if (mode == 1) kernel_overrides().l2_prefetch.reset();
    else kernel_overrides().l2_prefetch = mode == 2;
    GpuPlan gp = gpu_plan_buffers(T, K, E, m);
    const Tensor y = gpu_poison_rows(dt, cap, H), out = gpu_poison_rows(dt, T, H), y2 = gpu_poison_rows(dt, cap, H);
    const Tensor q = gpu_poison_rows(DType::kFloat8E4M3, cap, H), qs = to_gpu(quant_poison_scales(ql, cap, H));
    const Tensor sp = gpu_poison_rows(dt, scap, H), smap = gpu_poison_index(scap), soff = gpu_poison_index(E);
    const Tensor padded = gpu_poison_rows(dt, cap, H), map = gpu_poison_index(cap), offs = gpu_poison_index(E);
    CUDA_OK(cudaDeviceSynchronize());  // the poison memsets ran on the legacy stream
    padmoe::make_plan_out(dte, E, m, gp.view, o);
    padmoe::dispatch_out(dx, gp.view, dw.view(), y, o);
    padmoe::combine_out(y, gp.view, dw.view(), out, o);
    padmoe::dispatch_out(out, gp.view, std::nullopt, y2, o);  // out: written by the launch before
    padmoe::dispatch_quantized_out(out, gp.view, q, qs, o);
    padmoe::sort_chunks_out(out, ds, R, m, std::nullopt, sp, smap, soff, o);
    padmoe::pad_to_alignment_out(y2, gp.tpe, m, padded, map, offs, o);  // y2's first A rows as grouped rows
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<Tensor> r;
    for (const Tensor* t : std::initializer_list<const Tensor*>{&y, &out, &y2, &q, &qs, &sp, &smap, &padded, &map})
      r.push_back(to_cpu(*t));
    return r;
  };
  kernel_overrides().pdl = true;
  const std::vector<Tensor> off = chain(0), rule = chain(1), all = chain(2);
  kernel_overrides().l2_prefetch.reset();
  kernel_overrides().pdl.reset();
  for (size_t i = 0; i < off.size(); ++i) {
    EXPECT_TRUE(all_same(off[i], rule[i])) << "output " << i << " differs with the default prefetch";
    EXPECT_TRUE(all_same(off[i], all[i])) << "output " << i << " differs with the prefetch at every size";
  }
  // the CPU's results (bitwise; rows [0, P) of the padded outputs)
  const padmoe::Plan cp = padmoe::make_plan(hte, E, m);
  const int64_t P = padmoe::padded_rows(cp);
  const Tensor cy = padmoe::dispatch(hx, cp.view(), hw.view());
  const Tensor cout = padmoe::combine(cy, cp.view(), hw.view());
  EXPECT_TRUE(all_same(all[1], cout)) << "combine vs CPU";
  const Tensor cy2 = padmoe::dispatch(cout, cp.view());
  EXPECT_TRUE(rows_same(all[2], cy2, 0, P)) << "dispatch of combine's output vs CPU";
  const padmoe::ScaledRows cq = padmoe::dispatch_quantized(cout, cp.view(), ql, DType::kFloat8E4M3);
  EXPECT_TRUE(rows_same(all[3], cq.rows, 0, P)) << "quantizing dispatch vs CPU";
  const padmoe::PadResult cs = padmoe::sort_chunks(cout, hs, R, m);
  const int64_t SP = cs.padded.size(0);
  EXPECT_TRUE(rows_same(all[5], cs.padded, 0, SP)) << "sort_chunks vs CPU";
  Tensor cpad = poison_rows(dt, cap, H), cmap = poison_index(cap), coff = poison_index(E);
  padmoe::Options co;
  co.check_data = false;
  padmoe::pad_to_alignment_out(all[2], cp.tokens_per_expert, m, cpad, cmap, coff, co);
  EXPECT_TRUE(all_same(all[7], cpad)) << "pad_to_alignment vs CPU";
  EXPECT_TRUE(all_same(all[8], cmap)) << "pad's map vs CPU";
  CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace pt
