// sizes.cpp — scratch sizes of the CUDA backend: plain arithmetic, built in
// every configuration so workspace_bound() answers the same with or without CUDA.
#include "cuda/cuda_backend.hpp"

namespace padmoe {
namespace cuda {

size_t plan_workspace_bytes(int64_t assignments, int num_experts) {
  const int64_t chunks = (assignments + kPlanChunk - 1) / kPlanChunk;
  return static_cast<size_t>((chunks * num_experts + assignments) * 4 + 256);  // chunk counts + ranks
}

size_t pad_workspace_bytes(int num_experts) { return static_cast<size_t>(num_experts) * 2 * sizeof(int32_t) + 256; }

size_t validate_workspace_bytes(int64_t entries) { return static_cast<size_t>(64 + 4 * (entries > 0 ? entries : 0)); }

}  // namespace cuda
}  // namespace padmoe
