// test_limits.cpp — size overflow (docs/spec.md §12) and tensors on a device this build
// has no backend for. The views here point at tiny or no buffers: each check
// must fire on the shapes alone, before any data is read or written.
#include "test_util.hpp"

namespace pt {
namespace {

constexpr int kValue = static_cast<int>(padmoe::ErrorKind::kValue);
constexpr int kUnsupported = static_cast<int>(padmoe::ErrorKind::kUnsupported);

TEST(Limits, MakePlanRejectsAssignmentCountPastInt32) {
  int32_t one = 0;
  // [2^20, 2^12] ids: A = 2^32, past the int32 index outputs. Only the shape is read.
  TensorView te = TensorView::contiguous(&one, DType::kInt32, {int64_t{1} << 20, int64_t{1} << 12});
  EXPECT_TRUE(throws_error([&] { padmoe::make_plan(te, 8, 1); }, {"make_plan", "top_experts", "overflow"}, kValue));
}

TEST(Limits, MakePlanRejectsCapacityPastInt32) {
  int32_t one = 0;
  // A = 2^20 fits, but E*(m-1) = 2^16 * (2^15 - 1) pushes the capacity bound past 2^31.
  TensorView te = TensorView::contiguous(&one, DType::kInt32, {int64_t{1} << 20, 1});
  EXPECT_TRUE(
      throws_error([&] { padmoe::make_plan(te, 1 << 16, 1 << 15); }, {"make_plan", "capacity", "overflow"}, kValue));
}

TEST(Limits, PadRejectsPaddedRowsPastInt32) {
  // tokens_per_expert {2^30, 2^30} at alignment 2^30 + 1: P = 2^31 + 2, past int32.
  std::vector<int64_t> counts = {int64_t{1} << 30, int64_t{1} << 30};
  TensorView tpe = TensorView::contiguous(counts.data(), DType::kInt64, {2});
  float row = 0.0f;
  TensorView h = TensorView::matrix(&row, DType::kFloat32, int64_t{1} << 31, 1, 1);
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment(h, tpe, (1 << 30) + 1); },
                           {"pad_to_alignment", "tokens_per_expert", "overflow"}, kValue));
}

TEST(Limits, CudaTensorsWithoutCudaBackendAreRejected) {
#if defined(PADMOE_WITH_CUDA)
  GTEST_SKIP() << "this build has a CUDA backend";
#else
  std::vector<int32_t> ids = {0, 1, 1, 0};
  TensorView te = TensorView::contiguous(ids.data(), DType::kInt32, {2, 2}, padmoe::Device::cuda(0));
  EXPECT_TRUE(
      throws_error([&] { padmoe::make_plan(te, 2, 4); }, {"make_plan", "cuda:0", "without CUDA"}, kUnsupported));
  std::vector<float> x(8, 1.0f);
  std::vector<int32_t> counts = {2, 2};
  TensorView h = TensorView::contiguous(x.data(), DType::kFloat32, {4, 2}, padmoe::Device::cuda(0));
  TensorView tpe = TensorView::contiguous(counts.data(), DType::kInt32, {2}, padmoe::Device::cuda(0));
  EXPECT_TRUE(
      throws_error([&] { padmoe::pad_to_alignment(h, tpe, 4); }, {"pad_to_alignment", "without CUDA"}, kUnsupported));
  EXPECT_TRUE(throws_error([&] { padmoe::Tensor::empty(DType::kFloat32, {4}, padmoe::Device::cuda(0)); },
                           {"cuda:0", "without CUDA"}, kUnsupported));
#endif
}

}  // namespace
}  // namespace pt
