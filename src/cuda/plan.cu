// plan.cu — make_plan on the GPU: a stable counting sort by expert, no host
// synchronization.
//
// Fused (the default for E <= 512 and more than one chunk): one launch of 512-thread blocks; block b
// owns a contiguous run of 2048-assignment chunks. It ranks its assignments by
// warp matching (four per thread a chunk), publishes its per-expert counts,
// and, when the grid has more than one block, waits at a grid barrier (a
// cooperative launch, so every block is resident); then every block reads
// the [blocks, E] counts (L2), scans the expert totals (one block scan of
// packed real / padded counts) and places its assignments from registers
// (one chunk a block) or from the ranks it left in the workspace (more). With
// one block there is no barrier and nothing goes through global memory between the phases.
//
// Small (one chunk: A <= 2048, E <= 512, the decode sizes): one launch of 32 blocks, each placing
// half of one warp's 128 assignments; counts by shared-memory integer atomics, ranks from ballots
// (plan_small.cuh).
//
// Split (E > 512, or no cooperative launch): two launches,
//   1. count: each block takes a chunk of kChunk assignment ids and writes
//             every assignment's rank among its expert inside the chunk and
//             the chunk's per-expert counts. Up to kMatchMaxExperts experts a
//             warp ranks 32 ids at a time with __match_any_sync against
//             per-warp counters in shared memory; above that the chunk is
//             sorted with cub::BlockRadixSort (stable).
//   2. place: every block reads the [chunks, E] counts (L2-resident), forms
//             the expert totals, the block-wide scans (bins, padded bins) and
//             its own chunk's offsets, then places its assignments: indices,
//             bin_ids, dest_rows, row_sources. Block 0 writes the count
//             vectors; the blocks share the -1 fill of row_sources (padding
//             rows and rows at or past P), each entry written once.
// Stability: chunks are in assignment order and ranks inside a chunk follow
// assignment order.
//
// This file is the dispatch: policy::plan_path / plan_match / plan_counts / plan_replicas choose,
// KernelOverrides (tests, `padmoe bench --variant`) may force a path, and the kernels live in
// plan_split.cuh, plan_fused.cuh, plan_small.cuh and plan_capacity.cuh.
#include <algorithm>
#include <atomic>
#include <mutex>

#include "cuda/plan_capacity.cuh"
#include "cuda/plan_fused.cuh"
#include "cuda/plan_small.cuh"
#include "cuda/plan_split.cuh"

namespace padmoe {
namespace cuda {
namespace {

// Per device: how many fused blocks fit at once (for the smem of E rounded up to a power of two),
// found once.
constexpr int kMaxDevices = 64;
constexpr int kSmemBuckets = 5;  // E <= 32, 64, ..., 512
struct FusedLimits {
  std::atomic<int> resident[kSmemBuckets];  // 0: not asked yet; -1: none fit
  std::once_flag attr_once;
};
FusedLimits g_fused[kMaxDevices];

int fused_bucket(int num_experts) {
  int b = 0;
  while (b + 1 < kSmemBuckets && (32 << b) < num_experts) ++b;
  return b;
}

// Blocks of the fused kernel resident at once on the current device (0: use the split path: no
// cooperative launch there, or the device past kMaxDevices).
int fused_resident_blocks(int num_experts) {
  if (!cooperative_launch_supported()) return 0;
  int dev = 0;
  PADMOE_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return 0;
  FusedLimits& f = g_fused[dev];
  std::call_once(f.attr_once, [] {
    for (auto kernel : {plan_fused_kernel<true>, plan_fused_kernel<false>}) {
      PADMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(fused_smem_bytes(kFusedMaxExperts))));
    }
  });
  const int bucket = fused_bucket(num_experts);
  int n = f.resident[bucket].load(std::memory_order_relaxed);
  if (n == 0) {
    int per_sm = 0;
    PADMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, plan_fused_kernel<true>, kFusedThreads,
                                                                    fused_smem_bytes(32 << bucket)));
    n = per_sm > 0 ? per_sm * sm_count() : -1;
    f.resident[bucket].store(n, std::memory_order_relaxed);
  }
  return n > 0 ? n : 0;
}

}  // namespace

void make_plan(IndexRef top_experts, int64_t assignments, int top_k, int num_experts, int alignment,
               const PlanView& out, const PlanLayouts& layouts, int32_t padding_source, const index::ExpertRemap& remap,
               int64_t row_capacity, void* workspace, void* stream) {
  (void)top_k;
  const cudaStream_t s = as_stream(stream);
  const int chunks = static_cast<int>(index::ceil_div(assignments, kChunk));
  int32_t* chunk_counts = static_cast<int32_t*>(workspace);
  int32_t* local_rank = chunk_counts + static_cast<int64_t>(chunks) * num_experts;
  // The path: policy::plan_path, or the override's (the small kernel only where one chunk fits; a
  // fused grid capped at plan_fused_blocks blocks).
  const detail::KernelOverrides& o = overrides();
  const backend::PlanArrays arrays = backend::PlanArrays::of(out, layouts);
  const policy::PlanPath chosen = policy::plan_path(assignments, num_experts);
  policy::PlanPath path = o.plan_path.value_or(chosen);
  if (path == policy::PlanPath::kSmall && chosen != policy::PlanPath::kSmall) path = chosen;
  if (path == policy::PlanPath::kSmall && o.plan_fused_blocks > 0) path = policy::PlanPath::kFused;
  const bool fits_fused = num_experts >= 1 && num_experts <= kFusedMaxExperts;
  if (path == policy::PlanPath::kSmall && fits_fused) {
    launch_kernel("plan_small_kernel", plan_small_kernel, kSmallBlocks << kSmallShift, kFusedThreads,
                  small_smem_bytes(num_experts), s, top_experts, remap, static_cast<int>(assignments), num_experts,
                  alignment, kSmallShift, row_capacity, arrays, padding_source);
    return;
  }
  const int resident = path != policy::PlanPath::kSplit && fits_fused ? fused_resident_blocks(num_experts) : 0;
  if (resident > 0) {
    const int limit = o.plan_fused_blocks > 0 ? std::min(o.plan_fused_blocks, resident) : resident;
    const int per_block = chunks > limit ? static_cast<int>(index::ceil_div(chunks, limit)) : 1;
    const int distinct = chunks > 0 ? static_cast<int>(index::ceil_div(chunks, per_block)) : 1;
    const int replicas = chunks > 0 ? policy::plan_replicas(distinct, per_block, sm_count(), resident) : 1;
    const int grid = distinct * replicas;
    int shift = 0;
    while ((1 << shift) < replicas) ++shift;
    const size_t smem = fused_smem_bytes(num_experts);
    // block counts [grid, E] then the ranks [A]: inside plan_workspace_bytes (grid <= chunks)
    int32_t* block_counts = chunk_counts;
    backend::PlanArrays plan_out = arrays;
    IndexRef ids = top_experts;
    index::ExpertRemap rm = remap;
    int64_t a_count = assignments;
    int n_chunks = chunks, n_experts = num_experts, align = alignment;
    int32_t pad_src = padding_source;
    int64_t capacity = row_capacity;
    const policy::PlanCounts counts = o.plan_counts.value_or(policy::plan_counts(per_block, num_experts));
    int packed = counts == policy::PlanCounts::kPairs && policy::plan_pairs_fit(per_block) ? 1 : 0;
    const policy::PlanMatch match = o.plan_match.value_or(policy::plan_match(num_experts));
    auto* fused = match == policy::PlanMatch::kBallot ? plan_fused_kernel<true> : plan_fused_kernel<false>;
    if (distinct == 1) {  // no grid barrier: an ordinary launch
      launch_kernel("plan_fused_kernel", fused, grid, kFusedThreads, smem, s, ids, rm, a_count, n_chunks, per_block,
                    shift, n_experts, align, block_counts, local_rank, capacity, plan_out, pad_src, packed);
    } else {
      // cooperative, and with programmatic serialization where enabled (its blocks start while the
      // kernel before finishes, as every other launch does)
      const cudaError_t err =
          try_launch_kernel(fused, grid, kFusedThreads, smem, s, true, ids, rm, a_count, n_chunks, per_block, shift,
                            n_experts, align, block_counts, local_rank, capacity, plan_out, pad_src, packed);
      if (err == cudaErrorCooperativeLaunchTooLarge) {
        // fewer multiprocessors than the device reports (MPS limits, green contexts): the split
        // launches from now on, for this device
        cudaGetLastError();
        cooperative_launch_refused();
      } else {
        PADMOE_CUDA_CHECK(err);
        return;
      }
    }
    if (distinct == 1) return;
  }
  if (chunks > 0) {
    if (num_experts <= kMatchMaxExperts) {
      const size_t smem = static_cast<size_t>(kCountThreads / 32) * num_experts * sizeof(int);
      launch_kernel("plan_count_match_kernel", plan_count_match_kernel, chunks, kCountThreads, smem, s, top_experts,
                    remap, assignments, num_experts, chunk_counts, local_rank);
    } else {
      const size_t smem = static_cast<size_t>(num_experts) * sizeof(int);
      if (smem > 48 * 1024) {
        PADMOE_CUDA_CHECK(cudaFuncSetAttribute(plan_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem)));
      }
      launch_kernel("plan_count_kernel", plan_count_kernel, chunks, kCountThreads, smem, s, top_experts, remap,
                    assignments, num_experts, key_bits(num_experts), chunk_counts, local_rank);
    }
  }
  const size_t smem = static_cast<size_t>(3) * num_experts * sizeof(int);
  if (smem > 32 * 1024) {  // with the kernel's static shared memory the total may pass 48 KiB
    PADMOE_CUDA_CHECK(
        cudaFuncSetAttribute(plan_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  launch_kernel("plan_place_kernel", plan_place_kernel, chunks > 0 ? chunks : 1, kPlaceThreads, smem, s, top_experts,
                remap, assignments, chunks, num_experts, alignment, chunk_counts, local_rank, row_capacity, arrays,
                padding_source);
}

void apply_capacity(const PlanView& full, int64_t assignments, int num_experts, ScaleArg probs, int64_t capacity,
                    bool by_probs, int alignment, const PlanView& out, const PlanLayouts& layouts,
                    int32_t padding_source, int64_t row_capacity, int32_t* dropped, void* stream) {
  const int grid = num_experts > 0 ? num_experts : 1;
  launch_kernel("plan_capacity_kernel", plan_capacity_kernel, grid, kCapThreads, 0, as_stream(stream),
                full.indices.data_as<const int32_t>(), full.tokens_per_expert.data_as<const int32_t>(),
                full.dest_rows.data_as<const int32_t>(), assignments, num_experts, probs, capacity, by_probs, alignment,
                row_capacity, backend::PlanArrays::of(out, layouts), padding_source, dropped);
}

}  // namespace cuda
}  // namespace padmoe