// Routes 4 tokens (top_k 2) over 3 experts at alignment 4 through an
// installed padmoe and checks the result against values worked out by hand.
#include <cstdio>
#include <vector>

#include "padmoe/padmoe.hpp"

int main() {
  std::vector<int32_t> top_experts = {0, 2, 2, 1, 0, 1, 2, 0};  // [4, 2]
  auto plan =
      padmoe::make_plan(padmoe::TensorView::contiguous(top_experts.data(), padmoe::DType::kInt32, {4, 2}), 3, 4);
  std::vector<float> x = {1, 2, 3, 4};  // [4, 1]: token t holds t + 1
  padmoe::Tensor y =
      padmoe::dispatch(padmoe::TensorView::contiguous(x.data(), padmoe::DType::kFloat32, {4, 1}), plan.view());
  // expert 0: assignments 0, 4, 7 -> tokens 0, 2, 3; expert 1: 3, 5 -> tokens 1, 2; expert 2: 1, 2, 6 -> tokens 0, 1, 3
  const std::vector<float> expect = {1, 3, 4, 0, 2, 3, 0, 0, 1, 2, 4, 0};
  if (y.size(0) != 12) {
    std::printf("padded rows %ld != 12\n", static_cast<long>(y.size(0)));
    return 1;
  }
  for (int r = 0; r < 12; ++r) {
    if (y.data_as<float>()[r] != expect[r]) {
      std::printf("row %d: %g != %g\n", r, y.data_as<float>()[r], expect[r]);
      return 1;
    }
  }
  padmoe::Tensor back = padmoe::combine(y, plan.view());
  for (int t = 0; t < 4; ++t) {
    if (back.data_as<float>()[t] != 2.0f * x[t]) {
      std::printf("token %d: %g\n", t, back.data_as<float>()[t]);
      return 1;
    }
  }
  std::printf("consumer OK\n");
  return 0;
}
