// no_cuda.cpp — the CUDA backend's entry points in a build without CUDA
// (PADMOE_CUDA=OFF). The API layer never reaches them there (require_backend
// rejects CUDA tensors first); each throws in case it is ever called.
#include <string>

#include "cuda/cuda_backend.hpp"
#include "padmoe/error.hpp"

namespace padmoe {
namespace cuda {
namespace {
[[noreturn]] void unavailable(const char* what) {
  throw Error(ErrorKind::kUnsupported, std::string(what) + ": padmoe was built without CUDA (PADMOE_CUDA=OFF)");
}
}  // namespace

void* device_alloc(size_t, int) { unavailable("device_alloc"); }
void device_free(void*) {}
void copy_bytes(void*, Device, const void*, Device, size_t, void*) { unavailable("copy"); }
void memset_async(void*, int, size_t, void*) { unavailable("memset"); }
void synchronize(void*) { unavailable("synchronize"); }
int device_count() { return 0; }
Scratch::Scratch(const Options&, size_t, int) { unavailable("scratch memory"); }
Scratch::~Scratch() = default;

void make_plan(IndexRef, int64_t, int, int, int, const PlanView&, const PlanLayouts&, int32_t,
               const index::ExpertRemap&, int64_t, void*, void*) {
  unavailable("make_plan");
}
bool dest_search_fits(int64_t, int, int) { return false; }
bool chunk_rows_fit(int64_t, int, int, const RowsArg&, const RowsArg&) { return false; }
void sort_chunk_rows(const RowsArg&, IndexRef, IndexRef, int64_t, int, int, const RowsArg&, bool, bool, int32_t*,
                     int32_t*, void*) {
  unavailable("sort_chunks");
}
void apply_capacity(const PlanView&, int64_t, int, ScaleArg, int64_t, bool, int, const PlanView&, const PlanLayouts&,
                    int32_t, int64_t, int32_t*, void*) {
  unavailable("make_plan");
}
void build_dest_rows(IndexRef, IndexRef, IndexRef, IndexRef, int64_t, int, int32_t*, void*) {
  unavailable("build_dest_rows");
}
void spread_rows(const RowsArg&, int, const DestArg&, ScaleArg, const RowsArg&, const PaddingRef&, bool, bool,
                 const RowsArg*, FloatOutArg, void*, const ScaleRowsArg*) {
  unavailable("spread_rows");
}
void reduce_rows(const RowsArg&, int, const DestArg&, ScaleArg, const RowsArg&, const RowsArg*, FloatOutArg, void*) {
  unavailable("reduce_rows");
}
void row_dots(const RowsArg&, const RowsArg&, int, const DestArg&, int64_t, FloatOutArg, void*) {
  unavailable("row_dots");
}
void gather_rows(const RowsArg&, IndexRef, ScaleArg, bool, const RowsArg&, int64_t, const int32_t*, void*, bool,
                 const ScaleRowsArg*, bool) {
  unavailable("gather_rows");
}
void gather_rows_dots(const RowsArg&, IndexRef, ScaleArg, const RowsArg&, int64_t, const RowsArg&, FloatOutArg, int64_t,
                      void*) {
  unavailable("gather_rows_dots");
}
void pad_map(IndexRef, int, int, int64_t, int64_t, int32_t*, int32_t*, void*, void*) { unavailable("pad_map"); }
void invert_map(IndexRef, int64_t, int64_t, int32_t*, void*) { unavailable("invert_map"); }
size_t batched_align_workspace_bytes(int64_t) { return 0; }
void batched_align_blocks(IndexRef, int64_t, int, int, int64_t, int32_t*, int32_t*, int32_t*, void*, void*) {
  unavailable("batched_moe_align_block_size");
}
size_t mask_plan_workspace_bytes(int64_t, int64_t) { return 0; }
void mask_plan(const uint8_t*, int64_t, int, int, int64_t, bool, int32_t*, int32_t*, int32_t*, int64_t, int32_t*,
               int32_t*, int32_t*, const backend::MovedProbs&, void*, void*) {
  unavailable("mask_plan");
}
size_t index_plan_workspace_bytes(int64_t) { return 0; }
void index_plan(const int32_t*, int64_t, int64_t, int32_t*, int32_t*, int32_t*, int64_t, int32_t*, int32_t*, void*,
                size_t, void*) {
  unavailable("index_plan");
}
Violation validate_top_experts(IndexRef, int64_t, int, void*, void*) { unavailable("validate"); }
Violation validate_routing_ids(IndexRef, int64_t, int64_t, bool, IndexRef, int, void*, void*) {
  unavailable("validate");
}
Violation validate_sorted_routing(IndexRef, IndexRef, IndexRef, IndexRef, int64_t, int, int64_t, void*, void*) {
  unavailable("validate");
}
Violation validate_plan(const PlanView&, int64_t, void*, void*) { unavailable("validate"); }
Violation validate_counts(IndexRef, int, int, int64_t, int64_t, void*, void*) { unavailable("validate"); }
Violation validate_map(IndexRef, int64_t, int64_t, void*, void*) { unavailable("validate"); }
Violation validate_count_range(IndexRef, int64_t, int64_t, void*, void*) { unavailable("validate"); }
bool chunk_layout(IndexRef, IndexRef, int64_t, int, int, int64_t, void*, void*, int64_t, int32_t*, int32_t*) {
  unavailable("chunk_layout");
  return false;
}
Violation validate_chunks(IndexRef, IndexRef, int64_t, int64_t, int64_t, void*, void*) { unavailable("validate"); }
void chunk_map(const void*, int64_t, int, int64_t, int64_t, int32_t*, int32_t*, void*) { unavailable("chunk_map"); }

}  // namespace cuda
}  // namespace padmoe
