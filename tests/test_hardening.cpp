// test_hardening.cpp — what a hostile or unlucky caller meets: a forked child,
// null and negative-length views, sizes whose product overflows, empty rows with null pointers,
// absurd thread counts, plan views with fields missing. Each case failed (hung, crashed, read out
// of bounds or threw a non-padmoe exception) before its fix.
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <limits>
#include <string>
#include <thread>

#include "test_util.hpp"

namespace pt {
namespace {

constexpr int kValue = static_cast<int>(padmoe::ErrorKind::kValue);

// A workload large enough that the CPU backend runs it on two workers.
struct Big {
  int64_t T = 8192, H = 256;
  int K = 2, E = 8, m = 16;
  std::vector<int64_t> te;
  Tensor x;
  padmoe::Plan plan;
  Big() {
    te = make_routing(T, K, E, Dist::kUniform, 7);
    Rng rng(3);
    x = rows_from_float(random_values(T * H, DType::kFloat32, rng), DType::kFloat32, T, H);
    plan = padmoe::make_plan(index_matrix(te, T, K, DType::kInt32), E, m);
  }
  Tensor dispatch(int threads) const {
    padmoe::Options o;
    o.num_threads = threads;
    Tensor y = poison_rows(DType::kFloat32, plan.padded_rows_bound(), H);
    padmoe::dispatch_out(x, plan.view(), std::nullopt, y, o);
    return y;
  }
};

int live_threads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

TEST(Hardening, ForkedChildRunsOpsOnItsOwnPool) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one hardware thread: the pool is never used";
  const Big b;
  const Tensor want = b.dispatch(2);  // the parent's pool now has a worker thread
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // the child: no gtest assertions, only an exit status
    const Tensor got = b.dispatch(2);
    const Tensor again = b.dispatch(0);
    _exit(same_bytes(got, want) && same_bytes(again, want) ? 0 : 1);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  pid_t done = 0;
  while ((done = waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    FAIL() << "the forked child hung in the worker pool";
  }
  ASSERT_TRUE(WIFEXITED(status)) << "the forked child died";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the forked child computed a different result";
  EXPECT_TRUE(same_bytes(b.dispatch(2), want)) << "the parent's pool after the fork";
}

TEST(Hardening, NumThreadsIsCappedAtTheHardwareThreads) {
  const Big b;
  const Tensor want = b.dispatch(1);
  const int before = live_threads();
  ASSERT_GT(before, 0);
  EXPECT_TRUE(same_bytes(b.dispatch(4000), want));
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_LE(live_threads(), std::max(before, hw + 1)) << "num_threads = 4000 started more threads than the machine has";
}

TEST(Hardening, NullTopExpertsIsRejected) {
  TensorView te = TensorView::contiguous(nullptr, DType::kInt32, {4, 2});
  EXPECT_TRUE(
      throws_error([&] { padmoe::make_plan(te, 4, 2); }, {"make_plan", "top_experts", "null data pointer"}, kValue));
  padmoe::Plan out = padmoe::Plan::empty(4, 2, 4, 2);
  EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(te, 4, 2, out.view()); }, {"top_experts", "null"}, kValue));
}

TEST(Hardening, NegativeLengthsAreRejected) {
  const ref::Plan p = ref::make_plan({0, 1, 1, 0}, 2, 2, 2, 2);
  IndexInputs ii = index_inputs(p, DType::kInt32);
  Tensor x = poison_rows(DType::kFloat32, 2, 4);
  Tensor y = poison_rows(DType::kFloat32, p.padded_rows, 4);
  TensorView bad_bins = ii.bins.view();
  bad_bins.shape[0] = -1;
  EXPECT_TRUE(throws_error(
      [&] { padmoe::padded_gather_out(x, ii.indices, ii.bin_ids, bad_bins, ii.padded_bins, 2, std::nullopt, y); },
      {"padded_gather", "bins", "negative length"}, kValue));
  EXPECT_TRUE(all_bytes_are(y, kPoison));
  TensorView bad_idx = ii.indices.view();
  bad_idx.shape[0] = -4;
  EXPECT_TRUE(throws_error([&] { padmoe::padded_gather(x, bad_idx, ii.bin_ids, ii.bins, ii.padded_bins, 2); },
                           {"padded_gather", "negative"}, kValue));
  // pad_to_alignment with counts of shape [-4]: a padmoe::Error, not std::length_error
  std::vector<int32_t> counts = {1, 1};
  TensorView tpe = TensorView::contiguous(counts.data(), DType::kInt32, {2});
  tpe.shape[0] = -4;
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment(x, tpe, 2); }, {"pad_to_alignment", "negative"}, kValue));
  // a plan with num_tokens = -1 (dispatch wrote 16 KiB past its output) or num_experts = -1
  padmoe::Plan lib = padmoe::make_plan(index_matrix({0, 1, 1, 0}, 2, 2, DType::kInt32), 2, 2);
  padmoe::PlanView pv = lib.view();
  pv.num_tokens = -1;
  Tensor small = poison_rows(DType::kFloat32, lib.padded_rows_bound(), 4);
  EXPECT_TRUE(
      throws_error([&] { padmoe::dispatch_out(x, pv, std::nullopt, small); }, {"dispatch", "plan.num_tokens"}, kValue));
  EXPECT_TRUE(all_bytes_are(small, kPoison));
  padmoe::PlanView pe = lib.view();
  pe.num_experts = -1;
  EXPECT_TRUE(throws_error([&] { padmoe::padded_rows(pe); }, {"padded_rows", "plan.num_experts"}, kValue));
}

TEST(Hardening, PlanSizesThatOverflowAreRejected) {
  padmoe::Plan lib = padmoe::make_plan(index_matrix({0, 1, 1, 0}, 2, 2, DType::kInt32), 2, 2);
  padmoe::PlanView pv = lib.view();
  pv.num_tokens = int64_t{1} << 62;  // * top_k 4 wraps to 0 in 64 bits
  pv.top_k = 4;
  Tensor y = poison_rows(DType::kFloat32, 0, 0);
  Tensor out = poison_rows(DType::kFloat32, 0, 0);
  EXPECT_TRUE(throws_error([&] { padmoe::combine_out(y, pv, std::nullopt, out); }, {"combine", "overflow"}, kValue));
  // top_experts whose T*K overflows int64 (T = 2^62, K = 4): rejected on the shape alone
  int32_t one = 0;
  TensorView te = TensorView::contiguous(&one, DType::kInt32, {int64_t{1} << 62, 4});
  EXPECT_TRUE(throws_error([&] { padmoe::make_plan(te, 4, 1); }, {"make_plan", "top_experts", "overflow"}, kValue));
}

TEST(Hardening, EmptyRowsWithNullPointersAreValid) {
  const ref::Plan p = ref::make_plan({0, 1, 1, 0}, 2, 2, 2, 2);
  IndexInputs ii = index_inputs(p, DType::kInt32);
  TensorView x = TensorView::contiguous(nullptr, DType::kFloat32, {2, 0});
  TensorView y = TensorView::contiguous(nullptr, DType::kFloat32, {p.padded_rows, 0});
  padmoe::padded_gather_out(x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, 2, std::nullopt, y);
  padmoe::Plan lib = padmoe::make_plan(index_matrix({0, 1, 1, 0}, 2, 2, DType::kInt32), 2, 2);
  TensorView yc = TensorView::contiguous(nullptr, DType::kFloat32, {lib.padded_rows_bound(), 0});
  padmoe::Options o;
  o.zero_tail = true;
  padmoe::dispatch_out(x, lib.view(), std::nullopt, yc, o);
  TensorView out = TensorView::contiguous(nullptr, DType::kFloat32, {2, 0});
  padmoe::combine_out(yc, lib.view(), std::nullopt, out);
  SUCCEED();  // the sanitizer configuration of .ci/run catches memcpy(dst, nullptr, 0) here
}

TEST(Hardening, PlanFieldsAreCheckedOnTheCpuAsOnCuda) {
  padmoe::Plan lib = padmoe::make_plan(index_matrix({0, 1, 1, 0}, 2, 2, DType::kInt32), 2, 2);
  Tensor y = poison_rows(DType::kFloat32, lib.padded_rows_bound(), 4);
  Tensor out = poison_rows(DType::kFloat32, 2, 4);
  const char* names[] = {"plan.indices", "plan.bin_ids", "plan.tokens_per_expert", "plan.bins",
                         "plan.padded_tokens_per_expert"};
  for (int f = 0; f < 5; ++f) {
    padmoe::PlanView pv = lib.view();
    TensorView* fields[] = {&pv.indices, &pv.bin_ids, &pv.tokens_per_expert, &pv.bins, &pv.padded_tokens_per_expert};
    *fields[f] = TensorView{};  // an empty view where the array belongs
    EXPECT_TRUE(throws_error([&] { padmoe::combine_out(y, pv, std::nullopt, out); }, {"combine", names[f]}, kValue))
        << names[f];
  }
  EXPECT_TRUE(all_bytes_are(out, kPoison));
}

#if defined(__SANITIZE_ADDRESS__)
#define PADMOE_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PADMOE_TEST_ASAN 1
#endif
#endif

TEST(Hardening, OutOfHostMemoryInTheChecksIsAPadmoeError) {
#if defined(PADMOE_TEST_ASAN)
  GTEST_SKIP() << "an address-space limit and AddressSanitizer's shadow memory do not mix";
#else
  // make_plan with E = 2^29 needs 4 GiB of counts on the host before it allocates any output:
  // under a 1 GiB address-space limit (in a forked child) that is ErrorKind::kRuntime, not
  // std::bad_alloc escaping the library.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    rlimit lim{};
    lim.rlim_cur = lim.rlim_max = rlim_t{1} << 30;
    if (setrlimit(RLIMIT_AS, &lim) != 0) _exit(3);
    int32_t id = 0;
    TensorView te = TensorView::contiguous(&id, DType::kInt32, {1, 1});
    try {
      padmoe::make_plan(te, 1 << 29, 1);
    } catch (const padmoe::Error& e) {
      const std::string msg = e.what();
      _exit(e.kind() == padmoe::ErrorKind::kRuntime && msg.find("make_plan") != std::string::npos ? 0 : 1);
    } catch (...) {
      _exit(2);
    }
    _exit(4);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: wrong error kind, 2: a non-padmoe exception, 3: setrlimit, 4: no error";
#endif
}

}  // namespace
}  // namespace pt
