// layouts.cpp — vLLM's batched_moe_align_block_size: check, size, dispatch to
// the backend.
#include <memory>
#include <string>
#include <vector>

#include "api/alloc.hpp"
#include "api/checks.hpp"
#include "cpu/cpu_backend.hpp"
#include "cuda/cuda_backend.hpp"
#include "padmoe/index_math.hpp"
#include "padmoe/ops.hpp"

namespace padmoe {
namespace {

using detail::Checker;

constexpr const char* kOp = "batched_moe_align_block_size";

// The one message of a bad count, from the CPU's loop and from the device's validation alike.
[[noreturn]] void count_out_of_range(const Checker& c, int64_t e, int64_t n, int max_tokens) {
  c.value_error("expert_num_tokens", "entry " + std::to_string(e) + " is " + std::to_string(n) +
                                         ", outside [0, max_tokens_per_batch = " + std::to_string(max_tokens) + "]");
}

// The scalar arguments and the counts' shape; returns N = round_up(max_tokens, block_size) * E,
// checked to fit the int32 outputs.
int64_t check_batched_sizes(const Checker& c, const TensorView& expert_num_tokens, int max_tokens, int block_size) {
  if (max_tokens < 0) c.value_error("max_tokens_per_batch", "must be >= 0, got " + std::to_string(max_tokens));
  if (block_size < 1) c.value_error("block_size", "must be >= 1, got " + std::to_string(block_size));
  c.index_vector(expert_num_tokens, "expert_num_tokens", -1);
  detail::require_backend(c, expert_num_tokens.device);
  const int64_t run = index::round_up(max_tokens, block_size);  // < 2^32: both operands < 2^31
  const int64_t entries = detail::checked_mul(c, "sorted_ids", run, expert_num_tokens.shape[0]);
  detail::check_int32_extent(c, "sorted_ids", entries);
  return entries;
}

}  // namespace

namespace {

// Every count in [0, max_tokens_per_batch]: on the host for CPU tensors; on CUDA by the device's
// validation (one read back) when options.check_data.
void check_batched_counts(const Checker& c, const TensorView& expert_num_tokens, int max_tokens,
                          const Options& options) {
  const int64_t experts = expert_num_tokens.shape[0];
  if (expert_num_tokens.device.is_cuda()) {
    if (options.check_data && experts > 0) {
      cuda::Scratch scratch(options, cuda::validate_workspace_bytes(0), expert_num_tokens.device.index);
      const cuda::Violation v = cuda::validate_count_range(cuda::IndexRef::of(expert_num_tokens), experts, max_tokens,
                                                           scratch.get(), options.stream);
      if (v.code != cuda::kOk) count_out_of_range(c, v.pos, v.v1, max_tokens);
    }
    return;
  }
  const detail::IndexReader counts(expert_num_tokens);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = counts[e];
    if (n < 0 || n > max_tokens) count_out_of_range(c, e, n, max_tokens);
  }
}

// The layout into checked outputs, from checked counts.
void run_batched(const Checker& c, const TensorView& expert_num_tokens, int max_tokens_per_batch, int block_size,
                 int64_t entries, const TensorView& sorted_ids, const TensorView& block_ids,
                 const TensorView& num_tokens_post_pad, const Options& options) {
  const int64_t experts = expert_num_tokens.shape[0];
  const Device device = expert_num_tokens.device;
  int32_t* sorted = sorted_ids.data_as<int32_t>();
  int32_t* blocks = block_ids.data_as<int32_t>();
  int32_t* post = num_tokens_post_pad.data_as<int32_t>();
  if (device.is_cuda()) {
    const size_t bytes = entries > 0 ? cuda::batched_align_workspace_bytes(experts) : 0;
    std::unique_ptr<cuda::Scratch> scratch;
    if (bytes > 0) scratch.reset(new cuda::Scratch(options, bytes, device.index));
    cuda::batched_align_blocks(cuda::IndexRef::of(expert_num_tokens), experts, max_tokens_per_batch, block_size,
                               entries, sorted, blocks, post, scratch ? scratch->get() : nullptr, options.stream);
    return;
  }
  // CPU: the padded ends summed (only when there are entries to write: with max_tokens_per_batch =
  // 0 every count is 0 and E may be large).
  const detail::IndexReader counts(expert_num_tokens);
  std::vector<int32_t> ends = detail::host_vector<int32_t>(c, "expert_num_tokens", entries > 0 ? experts : 0);
  int64_t total = 0;
  for (int64_t e = 0; entries > 0 && e < experts; ++e) {
    total += index::round_up(counts[e], block_size);  // <= entries: every padded count is at most N / E
    ends[static_cast<size_t>(e)] = static_cast<int32_t>(total);
  }
  *post = static_cast<int32_t>(total);
  if (entries > 0) {
    cpu::batched_align_blocks(expert_num_tokens.data, expert_num_tokens.dtype == DType::kInt64, ends.data(), experts,
                              max_tokens_per_batch, block_size, entries, sorted, blocks, options.num_threads);
  }
}

}  // namespace

void batched_moe_align_block_size_out(const TensorView& expert_num_tokens, int max_tokens_per_batch, int block_size,
                                      const TensorView& sorted_ids, const TensorView& block_ids,
                                      const TensorView& num_tokens_post_pad, const Options& options) {
  const Checker c(kOp);
  const int64_t entries = check_batched_sizes(c, expert_num_tokens, max_tokens_per_batch, block_size);
  const Device device = expert_num_tokens.device;
  c.int32_output(sorted_ids, "sorted_ids", entries);
  c.int32_output(block_ids, "block_ids", entries / block_size);
  c.int32_output(num_tokens_post_pad, "num_tokens_post_pad", 1);
  c.same_device(sorted_ids, "sorted_ids", device);
  c.same_device(block_ids, "block_ids", device);
  c.same_device(num_tokens_post_pad, "num_tokens_post_pad", device);
  detail::check_disjoint_all(c,
                             {detail::named(sorted_ids, "sorted_ids"), detail::named(block_ids, "block_ids"),
                              detail::named(num_tokens_post_pad, "num_tokens_post_pad")},
                             {detail::named(expert_num_tokens, "expert_num_tokens")});
  check_batched_counts(c, expert_num_tokens, max_tokens_per_batch, options);
  run_batched(c, expert_num_tokens, max_tokens_per_batch, block_size, entries, sorted_ids, block_ids,
              num_tokens_post_pad, options);
}

AlignedBlocks batched_moe_align_block_size(const TensorView& expert_num_tokens, int max_tokens_per_batch,
                                           int block_size, const Options& options) {
  const Checker c(kOp);
  const int64_t entries = check_batched_sizes(c, expert_num_tokens, max_tokens_per_batch, block_size);
  check_batched_counts(c, expert_num_tokens, max_tokens_per_batch, options);  // before anything is allocated
  return detail::allocate_outputs<AlignedBlocks>(
      expert_num_tokens.device,
      {{DType::kInt32, {entries}}, {DType::kInt32, {entries / block_size}}, {DType::kInt32, {1}}},
      [&](const AlignedBlocks& r) {
        run_batched(c, expert_num_tokens, max_tokens_per_batch, block_size, entries, r.sorted_token_ids, r.expert_ids,
                    r.num_tokens_post_padded, options);
      });
}

}  // namespace padmoe
