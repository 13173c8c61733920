// test_cuda_layouts.cpp — the block layouts on the GPU: make_plan's layouts and moe_align_block_size
// against the references, batched_moe_align_block_size against the CPU backend and the reference.
// Helpers: cuda_fixture.hpp.
#include "cuda_fixture.hpp"

namespace pt {
namespace {

// The layouts of make_plan (DeepGEMM's rows, vLLM's blocks, P) and moe_align_block_size: the GPU
// against the references, with few tokens (A < E: vLLM's smaller buffer) and many, both count kernels.
TEST(CpuVsGpuEdge, PlanLayoutsAndAlignedBlocks) {
  REQUIRE_GPU();
  struct Case {
    int64_t T;
    int K, E, m;
  };
  for (const Case c :
       {Case{3, 2, 64, 16}, Case{1000, 8, 256, 128}, Case{4096, 2, 8, 64}, Case{777, 4, 2048, 16}, Case{0, 2, 8, 16}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) + " E=" + std::to_string(c.E) +
                 " m=" + std::to_string(c.m));
    const std::vector<int64_t> te = make_routing(c.T, c.K, c.E, Dist::kSkewed, 31);
    const int64_t A = c.T * c.K;
    const int64_t R = padmoe::aligned_rows_bound(A, c.E, c.m);
    const ref::Plan p = ref::make_plan(te, c.T, c.K, c.E, c.m);
    const Tensor dte = to_gpu(index_matrix(te, c.T, c.K, DType::kInt64));
    Tensor ind = gpu_poison_index(A), bid = gpu_poison_index(A), tpe = gpu_poison_index(c.E),
           bins = gpu_poison_index(c.E), ptpe = gpu_poison_index(c.E), pb = gpu_poison_index(c.E),
           dest = gpu_poison_index(A), rs = gpu_poison_index(R);
    padmoe::PlanView out;
    out.indices = ind;
    out.bin_ids = bid;
    out.tokens_per_expert = tpe;
    out.bins = bins;
    out.padded_tokens_per_expert = ptpe;
    out.padded_bins = pb;
    out.dest_rows = dest;
    out.row_sources = rs;
    GpuLayouts l = gpu_layout_buffers(R, c.m);
    padmoe::make_plan_out(dte, c.E, c.m, out, l.view);
    EXPECT_EQ(index_to_vec(to_cpu(l.row_experts)), ref::row_experts(te, c.E, c.m, R));
    std::vector<int64_t> rows_src = p.row_sources;
    rows_src.resize(static_cast<size_t>(R), -1);
    EXPECT_EQ(index_to_vec(to_cpu(rs)), rows_src);
    EXPECT_EQ(index_to_vec(to_cpu(l.block_experts)), ref::block_experts(te, c.E, c.m, R));  // -1 past P
    EXPECT_EQ(index_to_vec(to_cpu(l.padded_total)), std::vector<int64_t>{p.padded_rows});
    // vLLM's ignore_invalid_experts map: every third expert elsewhere, the rest local in reverse order
    std::vector<int64_t> map(static_cast<size_t>(c.E), -1);
    int64_t next = 0;
    for (int e = c.E - 1; e >= 0; --e) {
      if (e % 3 != 1) map[static_cast<size_t>(e)] = next++;
    }
    const Tensor dmap = to_gpu(index_matrix(map, 1, c.E, DType::kInt32));
    const padmoe::TensorView map_view =
        padmoe::TensorView::contiguous(dmap.data(), DType::kInt32, {c.E}, dmap.device());
    for (bool pad : {false, true}) {
      for (bool mapped : {false, true}) {
        SCOPED_TRACE(std::string(pad ? "pad_sorted_ids" : "unpadded") + (mapped ? ", expert_map" : ""));
        const ref::AlignedBlocks w = ref::moe_align_block_size(te, c.m, c.E, pad, mapped ? &map : nullptr);
        const padmoe::AlignedBlocks g = mapped ? padmoe::moe_align_block_size(dte, c.m, c.E, map_view, pad)
                                               : padmoe::moe_align_block_size(dte, c.m, c.E, pad);
        EXPECT_EQ(index_to_vec(to_cpu(g.sorted_token_ids)), w.sorted_token_ids);
        EXPECT_EQ(index_to_vec(to_cpu(g.expert_ids)), w.expert_ids);  // 0 past P, as vLLM
        EXPECT_EQ(index_to_vec(to_cpu(g.num_tokens_post_padded)), std::vector<int64_t>{w.num_tokens_post_padded});
      }
    }
  }
}

// vLLM's batched layout (batched_moe_align_block_size): the GPU bitwise against the CPU backend and
// the reference, checked and unchecked, int32 and int64 counts, over the one-launch form (E <= 4096)
// and the two-launch one (E = 5000), E = 0, max_tokens 0, block_size 1 and larger than max_tokens.
// Checked mode names the first bad count as the CPU does and writes nothing; unchecked mode reads a
// bad count as clamped into [0, max_tokens].
TEST(CpuVsGpuEdge, BatchedAlignBlocks) {
  REQUIRE_GPU();
  struct Case {
    int E, max_tokens, block;
  };
  Rng rng(23);
  for (const Case c : {Case{0, 16, 8}, Case{1, 13, 16}, Case{8, 16, 8}, Case{7, 5, 64}, Case{64, 100, 1},
                       Case{32, 512, 64}, Case{256, 1024, 16}, Case{4096, 64, 16}, Case{5000, 24, 16}, Case{3, 0, 4}}) {
    SCOPED_TRACE("E=" + std::to_string(c.E) + " max_tokens=" + std::to_string(c.max_tokens) +
                 " block=" + std::to_string(c.block));
    std::vector<int64_t> counts(static_cast<size_t>(c.E));
    for (int64_t& n : counts) {
      const int64_t r = rng.below(4);  // 0, the maximum, or anything between
      n = r == 0 ? 0 : (r == 1 ? c.max_tokens : rng.below(c.max_tokens + 1));
    }
    const ref::AlignedBlocks want = ref::batched_moe_align_block_size(counts, c.max_tokens, c.block);
    const int64_t n = static_cast<int64_t>(want.sorted_token_ids.size());
    for (const DType idx : {DType::kInt32, DType::kInt64}) {
      const Tensor hc = index_tensor(counts, idx);
      const padmoe::AlignedBlocks cpu = padmoe::batched_moe_align_block_size(hc, c.max_tokens, c.block);
      const Tensor dc = to_gpu(hc);
      for (const bool checked : {true, false}) {
        SCOPED_TRACE(std::string(idx == DType::kInt64 ? "int64" : "int32") + (checked ? " checked" : " unchecked"));
        padmoe::Options o;
        o.check_data = checked;
        Tensor sorted = gpu_poison_index(n), blocks = gpu_poison_index(n / c.block), post = gpu_poison_index(1);
        padmoe::batched_moe_align_block_size_out(dc, c.max_tokens, c.block, sorted, blocks, post, o);
        EXPECT_TRUE(all_same(to_cpu(sorted), cpu.sorted_token_ids));
        EXPECT_TRUE(all_same(to_cpu(blocks), cpu.expert_ids));
        EXPECT_TRUE(all_same(to_cpu(post), cpu.num_tokens_post_padded));
        EXPECT_EQ(index_to_vec(to_cpu(sorted)), want.sorted_token_ids);
        EXPECT_EQ(index_to_vec(to_cpu(blocks)), want.expert_ids);
        EXPECT_EQ(index_to_vec(to_cpu(post)), std::vector<int64_t>{want.num_tokens_post_padded});
      }
      const padmoe::AlignedBlocks gpu = padmoe::batched_moe_align_block_size(dc, c.max_tokens, c.block);
      EXPECT_TRUE(all_same(to_cpu(gpu.sorted_token_ids), cpu.sorted_token_ids));
      EXPECT_TRUE(all_same(to_cpu(gpu.expert_ids), cpu.expert_ids));
    }
  }
  for (const int E : {3, 5000}) {  // both forms
    SCOPED_TRACE("bad counts, E=" + std::to_string(E));
    std::vector<int64_t> bad(static_cast<size_t>(E), 2);
    bad[1] = 17;
    bad[static_cast<size_t>(E) - 1] = -1;
    std::vector<int64_t> clamped = bad;
    clamped[1] = 16;
    clamped[static_cast<size_t>(E) - 1] = 0;
    const ref::AlignedBlocks want = ref::batched_moe_align_block_size(clamped, 16, 8);
    const int64_t n = static_cast<int64_t>(want.sorted_token_ids.size());
    for (const DType idx : {DType::kInt32, DType::kInt64}) {
      const Tensor dc = to_gpu(index_tensor(bad, idx));
      Tensor sorted = gpu_poison_index(n), blocks = gpu_poison_index(n / 8), post = gpu_poison_index(1);
      EXPECT_TRUE(throws_error([&] { padmoe::batched_moe_align_block_size_out(dc, 16, 8, sorted, blocks, post); },
                               {"batched_moe_align_block_size: expert_num_tokens: entry 1 is 17, outside [0, "
                                "max_tokens_per_batch = 16]"},
                               static_cast<int>(padmoe::ErrorKind::kValue)));
      EXPECT_TRUE(all_bytes_are(to_cpu(sorted), kIndexPoison));
      EXPECT_TRUE(all_bytes_are(to_cpu(blocks), kIndexPoison));
      EXPECT_TRUE(all_bytes_are(to_cpu(post), kIndexPoison));
      padmoe::Options o;
      o.check_data = false;
      padmoe::batched_moe_align_block_size_out(dc, 16, 8, sorted, blocks, post, o);
      EXPECT_EQ(index_to_vec(to_cpu(sorted)), want.sorted_token_ids);
      EXPECT_EQ(index_to_vec(to_cpu(blocks)), want.expert_ids);
      EXPECT_EQ(index_to_vec(to_cpu(post)), std::vector<int64_t>{want.num_tokens_post_padded});
    }
  }
}

}  // namespace
}  // namespace pt
