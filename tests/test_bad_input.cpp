// test_bad_input.cpp — docs/spec.md §12: every bad argument raises padmoe::Error
// whose message names the argument (and the offending position where there
// is one), and nothing was written: the outputs still hold their poison.
#include <functional>

#include "test_util.hpp"

namespace pt {
namespace {

constexpr int kValue = static_cast<int>(padmoe::ErrorKind::kValue);
constexpr int kType = static_cast<int>(padmoe::ErrorKind::kType);

// A valid MegaBlocks setup: T = 20, K = 2, E = 4, m = 8, H = 6, float32,
// a fixed routing with counts {12, 14, 7, 7}.
struct Valid {
  static constexpr int64_t T = 20, H = 6;
  static constexpr int K = 2, E = 4, m = 8;
  std::vector<int64_t> te;
  ref::Plan p;
  std::vector<int64_t> indices, bin_ids, bins, padded_bins;
  Tensor x, w, y, grad;
  Valid() {
    // expert of assignment a: 7 assignments of expert 3 -> test "expert 3 ... 7 assignments"
    const std::vector<int64_t> counts = {12, 14, 7, 7};  // sum 40 = T*K; expert 2 and 3 hold 7
    for (int e = 0; e < E; ++e) te.insert(te.end(), static_cast<size_t>(counts[static_cast<size_t>(e)]), e);
    Rng rng(1);
    for (size_t i = te.size(); i > 1; --i)
      std::swap(te[i - 1], te[static_cast<size_t>(rng.below(static_cast<int64_t>(i)))]);
    p = ref::make_plan(te, T, K, E, m);
    indices = p.indices;
    bin_ids = p.bin_ids;
    bins = p.bins;
    padded_bins = p.padded_bins;
    x = rows_from_float(random_values(T * H, DType::kFloat32, rng), DType::kFloat32, T, H);
    w = vec_from_float(random_values(T * K, DType::kFloat32, rng), DType::kFloat32);
    y = rows_from_float(random_values(p.padded_rows * H, DType::kFloat32, rng), DType::kFloat32, p.padded_rows, H);
    grad = rows_from_float(random_values(T * H, DType::kFloat32, rng), DType::kFloat32, T, H);
  }
  int64_t P() const { return p.padded_rows; }
};

// Runs gather, scatter and wgrad (_out forms) with index vectors possibly
// corrupted; asserts each throws with the needles and wrote nothing.
void expect_all_reject(const std::vector<int64_t>& indices, const std::vector<int64_t>& bin_ids,
                       const std::vector<int64_t>& bins, const std::vector<int64_t>& padded_bins, int top_k,
                       std::vector<std::string> needles, int kind = kValue) {
  const Valid v;
  for (DType idx : {DType::kInt32, DType::kInt64}) {
    SCOPED_TRACE(dname(idx));
    const Tensor ind = index_tensor(indices, idx), bid = index_tensor(bin_ids, idx), bn = index_tensor(bins, idx),
                 pb = index_tensor(padded_bins, idx);
    Tensor y = poison_rows(DType::kFloat32, v.p.capacity, Valid::H);
    EXPECT_TRUE(
        throws_error([&] { padmoe::padded_gather_out(v.x, ind, bid, bn, pb, top_k, v.w.view(), y); }, needles, kind))
        << "padded_gather_out";
    EXPECT_TRUE(all_bytes_are(y, kPoison)) << "padded_gather_out wrote before failing";
    EXPECT_TRUE(throws_error([&] { padmoe::padded_gather(v.x, ind, bid, bn, pb, top_k); }, needles, kind))
        << "padded_gather";
    Tensor out = poison_rows(DType::kFloat32, Valid::T, Valid::H);
    EXPECT_TRUE(
        throws_error([&] { padmoe::padded_scatter_out(v.y, ind, bid, v.w.view(), bn, pb, top_k, out); }, needles, kind))
        << "padded_scatter_out";
    EXPECT_TRUE(all_bytes_are(out, kPoison)) << "padded_scatter_out wrote before failing";
    Tensor wg = filled(DType::kFloat32, {Valid::T * Valid::K}, kPoison);
    EXPECT_TRUE(throws_error([&] { padmoe::padded_scatter_wgrad_out(v.y, v.grad, ind, bid, bn, pb, top_k, wg); },
                             needles, kind))
        << "padded_scatter_wgrad_out";
    EXPECT_TRUE(all_bytes_are(wg, kPoison)) << "padded_scatter_wgrad_out wrote before failing";
  }
}

TEST(BadInput, ValidSetupIsAccepted) {
  // The baseline every other case corrupts must itself pass (so a throw below is about the corruption).
  const Valid v;
  Tensor y = poison_rows(DType::kFloat32, v.P(), Valid::H);
  const IndexInputs ii = index_inputs(v.p, DType::kInt32);
  padmoe::padded_gather_out(v.x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, Valid::K, v.w.view(), y);
  const std::vector<float> wf = vec_to_float(v.w);
  EXPECT_TRUE(rows_bitwise(y, ref::padded_gather(rows_to_float(v.x), Valid::H, v.p, &wf), v.P()));
  EXPECT_EQ(v.p.tokens_per_expert, (std::vector<int64_t>{12, 14, 7, 7}));
}

TEST(BadInput, PaddedSegmentSmallerThanCount) {
  const Valid v;
  // padded_bins [16, 32, 40, 48]; shrink expert 3's segment to 5 rows (count 7).
  std::vector<int64_t> pb = v.padded_bins;
  ASSERT_EQ(pb, (std::vector<int64_t>{16, 32, 40, 48}));
  pb[3] = pb[2] + 5;
  expect_all_reject(v.indices, v.bin_ids, v.bins, pb, Valid::K, {"padded_bins", "expert 3"});
}

TEST(BadInput, PaddedBinsNotNondecreasing) {
  const Valid v;
  std::vector<int64_t> pb = v.padded_bins;
  pb[1] = 10;  // below padded_bins[0] = 16
  expect_all_reject(v.indices, v.bin_ids, v.bins, pb, Valid::K, {"padded_bins"});
}

TEST(BadInput, BinsNotNondecreasing) {
  const Valid v;
  std::vector<int64_t> b = v.bins;  // [12, 26, 33, 40]
  b[2] = 20;
  expect_all_reject(v.indices, v.bin_ids, b, v.padded_bins, Valid::K, {"bins"});
}

TEST(BadInput, BinsLastNotA) {
  const Valid v;
  std::vector<int64_t> b = v.bins;
  b[3] = 39;
  expect_all_reject(v.indices, v.bin_ids, b, v.padded_bins, Valid::K, {"bins"});
}

TEST(BadInput, BinIdsInconsistentWithBins) {
  const Valid v;
  std::vector<int64_t> bid = v.bin_ids;
  bid[12] = 0;  // position 12 belongs to expert 1
  expect_all_reject(v.indices, bid, v.bins, v.padded_bins, Valid::K, {"bin_ids", "12"});
}

TEST(BadInput, IndicesRepeated) {
  const Valid v;
  std::vector<int64_t> ind = v.indices;
  ind[17] = ind[3];  // a repeated assignment id would race
  expect_all_reject(ind, v.bin_ids, v.bins, v.padded_bins, Valid::K, {"indices", "17"});
}

TEST(BadInput, IndicesOutOfRange) {
  const Valid v;
  std::vector<int64_t> ind = v.indices;
  ind[25] = 40;  // == A
  expect_all_reject(ind, v.bin_ids, v.bins, v.padded_bins, Valid::K, {"indices", "25"});
  ind[25] = -1;
  expect_all_reject(ind, v.bin_ids, v.bins, v.padded_bins, Valid::K, {"indices", "25"});
}

TEST(BadInput, TopK) {
  const Valid v;
  expect_all_reject(v.indices, v.bin_ids, v.bins, v.padded_bins, 0, {"top_k"});
  expect_all_reject(v.indices, v.bin_ids, v.bins, v.padded_bins, -2, {"top_k"});
  // A = 40 is not a multiple of 3
  expect_all_reject(v.indices, v.bin_ids, v.bins, v.padded_bins, 3, {"top_k"});
}

TEST(BadInput, IndexLengthsDisagree) {
  const Valid v;
  std::vector<int64_t> bid = v.bin_ids;
  bid.pop_back();
  expect_all_reject(v.indices, bid, v.bins, v.padded_bins, Valid::K, {"bin_ids"});
  std::vector<int64_t> pb = v.padded_bins;
  pb.push_back(pb.back());
  expect_all_reject(v.indices, v.bin_ids, v.bins, pb, Valid::K, {"padded_bins"});
}

TEST(BadInput, RowTensorShapesDtypesStrides) {
  const Valid v;
  const IndexInputs ii = index_inputs(v.p, DType::kInt32);
  const int K = Valid::K;
  const int64_t T = Valid::T, H = Valid::H, P = v.P();
  Tensor y = poison_rows(DType::kFloat32, P, H);
  auto gather_into = [&](const TensorView& x, const TensorView& out) {
    return [&, x, out] {
      padmoe::padded_gather_out(x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, K, std::nullopt, out);
    };
  };
  // x rank 1
  {
    TensorView x1 = TensorView::contiguous(v.x.data(), DType::kFloat32, {T * H});
    EXPECT_TRUE(throws_error(gather_into(x1, y), {"x"}));
  }
  // x wrong row count (T must be A / K)
  {
    TensorView xs = TensorView::matrix(v.x.data(), DType::kFloat32, T - 1, H, H);
    EXPECT_TRUE(throws_error(gather_into(xs, y), {"x"}));
  }
  // x int32 dtype -> type error
  {
    TensorView xi = TensorView::matrix(v.x.data(), DType::kInt32, T, H, H);
    EXPECT_TRUE(throws_error(gather_into(xi, y), {"x"}, kType));
  }
  // x column stride 2
  {
    Tensor big = rows_from_float(std::vector<float>(static_cast<size_t>(T * H * 2), 1.0f), DType::kFloat32, T, 2 * H);
    TensorView xs = TensorView::matrix(big.data(), DType::kFloat32, T, H, 2 * H);
    xs.strides[1] = 2;
    EXPECT_TRUE(throws_error(gather_into(xs, y), {"x"}));
  }
  // x row stride < H (rows overlap)
  {
    TensorView xs = TensorView::matrix(v.x.data(), DType::kFloat32, T / 2, H, H / 2);
    xs.shape[0] = T;
    EXPECT_TRUE(throws_error(gather_into(xs, y), {"x"}));
  }
  // y: too few rows, wrong H, wrong dtype
  {
    Tensor ys = poison_rows(DType::kFloat32, P - 1, H);
    EXPECT_TRUE(throws_error(gather_into(v.x, ys), {"y"}));
    EXPECT_TRUE(all_bytes_are(ys, kPoison));
    Tensor yh = poison_rows(DType::kFloat32, P, H + 1);
    EXPECT_TRUE(throws_error(gather_into(v.x, yh), {"y"}));
    EXPECT_TRUE(all_bytes_are(yh, kPoison));
    Tensor yd = poison_rows(DType::kBFloat16, P, H);
    EXPECT_TRUE(throws_error(gather_into(v.x, yd), {"y"}, kType));
    EXPECT_TRUE(all_bytes_are(yd, kPoison));
  }
  EXPECT_TRUE(all_bytes_are(y, kPoison));
  // index dtype float -> type error
  {
    Tensor fi = vec_from_float(std::vector<float>(v.indices.begin(), v.indices.end()), DType::kFloat32);
    EXPECT_TRUE(throws_error(
        [&] { padmoe::padded_gather_out(v.x, fi, ii.bin_ids, ii.bins, ii.padded_bins, K, std::nullopt, y); },
        {"indices"}, kType));
  }
  // index tensor not contiguous (stride 2)
  {
    Tensor big = index_tensor(std::vector<int64_t>(v.indices.size() * 2, 0), DType::kInt32);
    for (size_t i = 0; i < v.indices.size(); ++i) big.data_as<int32_t>()[2 * i] = static_cast<int32_t>(v.indices[i]);
    TensorView s = TensorView::contiguous(big.data(), DType::kInt32, {static_cast<int64_t>(v.indices.size())});
    s.strides[0] = 2;
    EXPECT_TRUE(throws_error(
        [&] { padmoe::padded_gather_out(v.x, s, ii.bin_ids, ii.bins, ii.padded_bins, K, std::nullopt, y); },
        {"indices"}));
  }
  // weights: wrong length, wrong dtype
  {
    Tensor ws = vec_from_float(std::vector<float>(static_cast<size_t>(T * K - 1), 0.5f), DType::kFloat32);
    EXPECT_TRUE(throws_error(
        [&] { padmoe::padded_gather_out(v.x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, K, ws.view(), y); },
        {"weights"}));
    Tensor wi = index_tensor(std::vector<int64_t>(static_cast<size_t>(T * K), 1), DType::kInt32);
    EXPECT_TRUE(throws_error(
        [&] { padmoe::padded_gather_out(v.x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, K, wi.view(), y); },
        {"weights"}, kType));
  }
  EXPECT_TRUE(all_bytes_are(y, kPoison));

  // scatter: out wrong shape / dtype; y too few rows
  {
    Tensor o = poison_rows(DType::kFloat32, T + 1, H);
    EXPECT_TRUE(throws_error(
        [&] { padmoe::padded_scatter_out(v.y, ii.indices, ii.bin_ids, v.w.view(), ii.bins, ii.padded_bins, K, o); },
        {"out"}));
    EXPECT_TRUE(all_bytes_are(o, kPoison));
    Tensor o2 = poison_rows(DType::kFloat16, T, H);
    EXPECT_TRUE(throws_error(
        [&] { padmoe::padded_scatter_out(v.y, ii.indices, ii.bin_ids, v.w.view(), ii.bins, ii.padded_bins, K, o2); },
        {"out"}, kType));
    EXPECT_TRUE(all_bytes_are(o2, kPoison));
    Tensor o3 = poison_rows(DType::kFloat32, T, H);
    TensorView ys = TensorView::matrix(v.y.data(), DType::kFloat32, P - 1, H, H);
    EXPECT_TRUE(throws_error(
        [&] { padmoe::padded_scatter_out(ys, ii.indices, ii.bin_ids, v.w.view(), ii.bins, ii.padded_bins, K, o3); },
        {"y"}));
    EXPECT_TRUE(all_bytes_are(o3, kPoison));
  }
  // wgrad: grad wrong shape, wgrad wrong length / dtype
  {
    Tensor wg = filled(DType::kFloat32, {T * K}, kPoison);
    TensorView gs = TensorView::matrix(v.grad.data(), DType::kFloat32, T - 1, H, H);
    EXPECT_TRUE(throws_error(
        [&] { padmoe::padded_scatter_wgrad_out(v.y, gs, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, K, wg); },
        {"grad"}));
    EXPECT_TRUE(all_bytes_are(wg, kPoison));
    Tensor wg2 = filled(DType::kFloat32, {T * K - 1}, kPoison);
    EXPECT_TRUE(throws_error(
        [&] { padmoe::padded_scatter_wgrad_out(v.y, v.grad, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, K, wg2); },
        {"wgrad"}));
    EXPECT_TRUE(all_bytes_are(wg2, kPoison));
    Tensor wg3 = filled(DType::kInt32, {T * K}, kPoison);
    EXPECT_TRUE(throws_error(
        [&] { padmoe::padded_scatter_wgrad_out(v.y, v.grad, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, K, wg3); },
        {"wgrad"}, kType));
    EXPECT_TRUE(all_bytes_are(wg3, kPoison));
  }
}

TEST(BadInput, Float8GivenToWeightedOps) {
  const Valid v;
  const IndexInputs ii = index_inputs(v.p, DType::kInt32);
  const int K = Valid::K;
  const int64_t T = Valid::T, H = Valid::H, P = v.P();
  Tensor x8 = filled(DType::kFloat8E4M3, {T, H}, 0x38);  // 1.0
  Tensor y8 = poison_rows(DType::kFloat8E4M3, P, H);
  // weighted gather of float8
  auto r = throws_error(
      [&] { padmoe::padded_gather_out(x8, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, K, v.w.view(), y8); }, {});
  EXPECT_TRUE(r);
  EXPECT_TRUE(all_bytes_are(y8, kPoison));
  // scatter (a sum) of float8
  Tensor yy8 = filled(DType::kFloat8E5M2, {P, H}, 0x3c);
  Tensor o8 = poison_rows(DType::kFloat8E5M2, T, H);
  EXPECT_TRUE(throws_error(
      [&] { padmoe::padded_scatter_out(yy8, ii.indices, ii.bin_ids, std::nullopt, ii.bins, ii.padded_bins, K, o8); },
      {"y"}, kType));
  EXPECT_TRUE(all_bytes_are(o8, kPoison));
  // combine with float8
  const PlanHolder ph = plan_from_ref(v.p);
  EXPECT_TRUE(throws_error([&] { padmoe::combine(yy8, ph.view, std::nullopt); }, {"y"}, kType));
  // dispatch with weights
  Tensor d8 = poison_rows(DType::kFloat8E4M3, P, H);
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_out(x8, ph.view, v.w.view(), d8); }, {}));
  EXPECT_TRUE(all_bytes_are(d8, kPoison));
  // unpad with probs
  const std::vector<int64_t> counts = {3, 4};
  Tensor h8 = filled(DType::kFloat8E4M3, {7, 4}, 0x38);
  const padmoe::PadResult pr = padmoe::pad_to_alignment(h8, index_tensor(counts, DType::kInt32), 4);
  Tensor probs = vec_from_float(std::vector<float>(7, 0.5f), DType::kFloat32);
  Tensor u8 = poison_rows(DType::kFloat8E4M3, 7, 4);
  EXPECT_TRUE(
      throws_error([&] { padmoe::unpad_from_alignment_out(pr.padded, pr.permutation_map, probs.view(), u8); }, {}));
  EXPECT_TRUE(all_bytes_are(u8, kPoison));
  // ...while the move-only forms accept float8
  Tensor ok8 = poison_rows(DType::kFloat8E4M3, P, H);
  padmoe::padded_gather_out(x8, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, K, std::nullopt, ok8);
  EXPECT_TRUE(
      rows_bitwise(ok8, ref::padded_gather(std::vector<float>(static_cast<size_t>(T * H), 1.0f), H, v.p, nullptr), P));
}

TEST(BadInput, CudaTensorWithoutCuda) {
  const Valid v;
  const IndexInputs ii = index_inputs(v.p, DType::kInt32);
  TensorView xc = v.x.view();
  xc.device = padmoe::Device::cuda(0);
  Tensor y = poison_rows(DType::kFloat32, v.P(), Valid::H);
  try {
    padmoe::padded_gather_out(xc, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, Valid::K, std::nullopt, y);
    ADD_FAILURE() << "a cuda-tagged tensor (with the others on the cpu) was accepted";
  } catch (const padmoe::Error& e) {
    EXPECT_TRUE(e.kind() == padmoe::ErrorKind::kUnsupported || e.kind() == padmoe::ErrorKind::kType) << e.what();
  }
  EXPECT_TRUE(all_bytes_are(y, kPoison));
  // (An all-"cuda" call is not made here: in a CUDA build it would hand host
  // memory to the device backend. The mixed-device call above is an Error in
  // every build: kUnsupported without CUDA, kType for the device mismatch with it.)
  TensorView ic = ii.indices.view();
  ic.device = padmoe::Device::cuda(0);
  EXPECT_THROW(padmoe::padded_gather_out(v.x, ic, ii.bin_ids, ii.bins, ii.padded_bins, Valid::K, std::nullopt, y),
               padmoe::Error);
  EXPECT_TRUE(all_bytes_are(y, kPoison));
}

TEST(BadInput, MakePlan) {
  const int64_t T = 10;
  const int K = 2, E = 4;
  std::vector<int64_t> te = make_routing(T, K, E, Dist::kUniform, 3);
  // expert id out of range at flat position 13 = (6, 1)
  te[13] = 1000;
  for (DType idx : {DType::kInt32, DType::kInt64}) {
    const Tensor t = index_matrix(te, T, K, idx);
    auto r = throws_error([&] { padmoe::make_plan(t, E, 8); }, {"top_experts"}, kValue);
    EXPECT_TRUE(r);
    const std::string msg = r.message();
    EXPECT_TRUE(msg.find("13") != std::string::npos ||
                (msg.find("6") != std::string::npos && msg.find("1") != std::string::npos))
        << "message should name the offending position: " << msg;
  }
  te[13] = -1;
  EXPECT_TRUE(
      throws_error([&] { padmoe::make_plan(index_matrix(te, T, K, DType::kInt64), E, 8); }, {"top_experts"}, kValue));
  te[13] = 3;
  const Tensor good = index_matrix(te, T, K, DType::kInt32);
  // alignment < 1, E < 1
  EXPECT_TRUE(throws_error([&] { padmoe::make_plan(good, E, 0); }, {"alignment"}, kValue));
  EXPECT_TRUE(throws_error([&] { padmoe::make_plan(good, E, -8); }, {"alignment"}, kValue));
  // wrong rank, wrong dtype
  TensorView flat = good.view();
  flat.ndim = 1;
  flat.shape[0] = T * K;
  flat.shape[1] = 0;
  flat.strides[0] = 1;
  EXPECT_TRUE(throws_error([&] { padmoe::make_plan(flat, E, 8); }, {"top_experts"}));
  Tensor tf = Tensor::empty(DType::kFloat32, {T, K});
  EXPECT_TRUE(throws_error([&] { padmoe::make_plan(tf, E, 8); }, {"top_experts"}, kType));

  // make_plan_out: short buffers named, nothing written
  const int64_t A = T * K, cap = A + E * 7;
  auto buffers = [&](int64_t rs_len, int64_t ind_len, DType rs_dtype) {
    struct B {
      Tensor ind, bid, tpe, bins, ptpe, pb, dest, rs;
      padmoe::PlanView v;
    } b;
    b.ind = poison_index(ind_len);
    b.bid = poison_index(A);
    b.tpe = poison_index(E);
    b.bins = poison_index(E);
    b.ptpe = poison_index(E);
    b.pb = poison_index(E);
    b.dest = poison_index(A);
    b.rs = filled(rs_dtype, {rs_len}, kIndexPoison);
    b.v.indices = b.ind;
    b.v.bin_ids = b.bid;
    b.v.tokens_per_expert = b.tpe;
    b.v.bins = b.bins;
    b.v.padded_tokens_per_expert = b.ptpe;
    b.v.padded_bins = b.pb;
    b.v.dest_rows = b.dest;
    b.v.row_sources = b.rs;
    return b;
  };
  const int64_t P = ref::make_plan(te, T, K, E, 8).padded_rows;
  ASSERT_LT(P, cap);
  {
    // row_sources needs at least P entries (on the CPU P is known; padded_rows_bound is the
    // size that never fails); P - 1 entries are rejected.
    auto b = buffers(P - 1, A, DType::kInt32);
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(good, E, 8, b.v); }, {"row_sources"}));
    for (const Tensor* t : {&b.ind, &b.bid, &b.tpe, &b.bins, &b.ptpe, &b.pb, &b.dest, &b.rs})
      EXPECT_TRUE(all_bytes_are(*t, kIndexPoison));
  }
  {
    auto b = buffers(cap, A + 1, DType::kInt32);
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(good, E, 8, b.v); }, {"indices"}));
    EXPECT_TRUE(all_bytes_are(b.rs, kIndexPoison));
  }
  {
    auto b = buffers(cap, A, DType::kInt64);  // index outputs are int32
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(good, E, 8, b.v); }, {"row_sources"}, kType));
    EXPECT_TRUE(all_bytes_are(b.ind, kIndexPoison));
  }
  {
    auto b = buffers(cap, A, DType::kInt32);
    te[13] = 1000;
    const Tensor bad = index_matrix(te, T, K, DType::kInt32);
    EXPECT_TRUE(throws_error([&] { padmoe::make_plan_out(bad, E, 8, b.v); }, {"top_experts"}));
    for (const Tensor* t : {&b.ind, &b.bid, &b.tpe, &b.bins, &b.ptpe, &b.pb, &b.dest, &b.rs})
      EXPECT_TRUE(all_bytes_are(*t, kIndexPoison));
    te[13] = 3;
  }
}

TEST(BadInput, PlanViewOps) {
  const Valid v;
  PlanHolder ph = plan_from_ref(v.p);
  const int64_t P = v.P(), H = Valid::H;
  // x rows != plan.num_tokens
  TensorView xs = TensorView::matrix(v.x.data(), DType::kFloat32, Valid::T - 1, H, H);
  Tensor y = poison_rows(DType::kFloat32, P, H);
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_out(xs, ph.view, std::nullopt, y); }, {"x"}));
  // y too small
  Tensor ys = poison_rows(DType::kFloat32, P - 1, H);
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_out(v.x, ph.view, std::nullopt, ys); }, {"y"}));
  EXPECT_TRUE(all_bytes_are(ys, kPoison));
  // a corrupted plan: padded segment of expert 3 too small. The plan's fields are
  // redundant, so the first inconsistency found may be named through another
  // field (e.g. plan.dest_rows); the op name and "plan" must appear.
  ph.padded_bins.data_as<int32_t>()[3] = ph.padded_bins.data_as<int32_t>()[2] + 5;
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_out(v.x, ph.view, std::nullopt, y); }, {"dispatch", "plan"}, kValue));
  Tensor out = poison_rows(DType::kFloat32, Valid::T, H);
  EXPECT_TRUE(throws_error([&] { padmoe::combine_out(v.y, ph.view, v.w.view(), out); }, {"combine", "plan"}, kValue));
  // a plan whose dest_rows disagree with row_sources
  PlanHolder ph4 = plan_from_ref(v.p);
  std::swap(ph4.dest_rows.data_as<int32_t>()[0], ph4.dest_rows.data_as<int32_t>()[1]);
  EXPECT_TRUE(
      throws_error([&] { padmoe::dispatch_out(v.x, ph4.view, std::nullopt, y); }, {"dispatch", "plan"}, kValue));
  // a plan whose row_sources name the same assignment twice (the fused ops read
  // dest_rows / row_sources / padded_bins, which must be mutually inverse)
  PlanHolder ph5 = plan_from_ref(v.p);
  ph5.row_sources.data_as<int32_t>()[1] = ph5.row_sources.data_as<int32_t>()[0];
  EXPECT_TRUE(throws_error([&] { padmoe::combine_out(v.y, ph5.view, v.w.view(), out); }, {"combine", "plan"}, kValue));
  EXPECT_TRUE(all_bytes_are(out, kPoison));
  EXPECT_TRUE(all_bytes_are(y, kPoison));
  // plan with top_k = 0
  PlanHolder ph2 = plan_from_ref(v.p);
  ph2.view.top_k = 0;
  EXPECT_TRUE(throws_error([&] { padmoe::dispatch_out(v.x, ph2.view, std::nullopt, y); }, {"top_k"}));
  // combine_backward: grad_y too small, grad_weights wrong length
  PlanHolder ph3 = plan_from_ref(v.p);
  Tensor gy = poison_rows(DType::kFloat32, P - 1, H);
  Tensor gw = filled(DType::kFloat32, {Valid::T * Valid::K}, kPoison);
  EXPECT_TRUE(
      throws_error([&] { padmoe::combine_backward_out(v.grad, v.y, ph3.view, v.w.view(), gy, gw); }, {"grad_y"}));
  EXPECT_TRUE(all_bytes_are(gy, kPoison));
  EXPECT_TRUE(all_bytes_are(gw, kPoison));
  Tensor gy2 = poison_rows(DType::kFloat32, P, H);
  Tensor gw2 = filled(DType::kFloat32, {Valid::T * Valid::K + 1}, kPoison);
  EXPECT_TRUE(throws_error([&] { padmoe::combine_backward_out(v.grad, v.y, ph3.view, v.w.view(), gy2, gw2); },
                           {"grad_weights"}));
  EXPECT_TRUE(all_bytes_are(gy2, kPoison));
  EXPECT_TRUE(all_bytes_are(gw2, kPoison));
}

TEST(BadInput, Megatron) {
  const int64_t N = 12, H = 5;
  const std::vector<int64_t> counts = {3, 0, 7};  // sum 10 <= N
  Rng rng(2);
  const Tensor h = rows_from_float(random_values(N * H, DType::kFloat32, rng), DType::kFloat32, N, H);
  const Tensor c = index_tensor(counts, DType::kInt32);
  // alignment < 1
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment(h, c, 0); }, {"alignment"}, kValue));
  // negative count (position 1)
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment(h, index_tensor({3, -1, 7}, DType::kInt64), 4); },
                           {"tokens_per_expert"}, kValue));
  // sum(counts) > N
  EXPECT_TRUE(
      throws_error([&] { padmoe::pad_to_alignment(h, index_tensor({3, 0, 10}, DType::kInt32), 4); }, {}, kValue));
  // wrong dtypes
  EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment(h, vec_from_float({3, 0, 7}, DType::kFloat32), 4); },
                           {"tokens_per_expert"}, kType));
  // _out: padded too small, map length != padded rows, offsets wrong length; nothing written
  const int64_t P = 4 + 0 + 8;  // m = 4
  {
    Tensor pd = poison_rows(DType::kFloat32, P - 1, H);
    Tensor map = poison_index(P - 1);
    Tensor offs = poison_index(3);
    EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_out(h, c, 4, pd, map, offs); }, {"padded"}));
    EXPECT_TRUE(all_bytes_are(pd, kPoison));
    EXPECT_TRUE(all_bytes_are(map, kIndexPoison));
    EXPECT_TRUE(all_bytes_are(offs, kIndexPoison));
  }
  {
    Tensor pd = poison_rows(DType::kFloat32, P, H);
    Tensor map = poison_index(P - 1);
    Tensor offs = poison_index(3);
    EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_out(h, c, 4, pd, map, offs); }, {"permutation_map"}));
    EXPECT_TRUE(all_bytes_are(pd, kPoison));
    EXPECT_TRUE(all_bytes_are(offs, kIndexPoison));
  }
  {
    Tensor pd = poison_rows(DType::kFloat32, P, H);
    Tensor map = poison_index(P);
    Tensor offs = poison_index(2);
    EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_out(h, c, 4, pd, map, offs); }, {"inclusive_offsets"}));
    EXPECT_TRUE(all_bytes_are(pd, kPoison));
    EXPECT_TRUE(all_bytes_are(map, kIndexPoison));
  }
  {
    Tensor pd = poison_rows(DType::kFloat16, P, H);  // dtype differs from h
    Tensor map = poison_index(P);
    Tensor offs = poison_index(3);
    EXPECT_TRUE(throws_error([&] { padmoe::pad_to_alignment_out(h, c, 4, pd, map, offs); }, {"padded"}, kType));
    EXPECT_TRUE(all_bytes_are(pd, kPoison));
  }

  // unpad: map entry >= N (position 2), repeated entry, probs wrong length, out wrong rows
  const Tensor padded = rows_from_float(random_values(6 * H, DType::kFloat32, rng), DType::kFloat32, 6, H);
  {
    Tensor out = poison_rows(DType::kFloat32, 4, H);
    EXPECT_TRUE(throws_error(
        [&] {
          padmoe::unpad_from_alignment_out(padded, index_tensor({0, 1, 4, -1, -1, 2}, DType::kInt32), std::nullopt,
                                           out);
        },
        {"permutation_map", "2"}));
    EXPECT_TRUE(all_bytes_are(out, kPoison));
    EXPECT_TRUE(throws_error(
        [&] {
          padmoe::unpad_from_alignment_out(padded, index_tensor({0, 1, 3, -1, 1, 2}, DType::kInt32), std::nullopt, out);
        },
        {"permutation_map"}));
    EXPECT_TRUE(all_bytes_are(out, kPoison));
    EXPECT_TRUE(throws_error(
        [&] {
          padmoe::unpad_from_alignment_out(padded, index_tensor({0, 1, 3, -7, -1, 2}, DType::kInt32), std::nullopt,
                                           out);
        },
        {"permutation_map"}));
    EXPECT_TRUE(all_bytes_are(out, kPoison));
    Tensor probs = vec_from_float({0.5f, 0.5f, 0.5f}, DType::kFloat32);
    EXPECT_TRUE(throws_error(
        [&] {
          padmoe::unpad_from_alignment_out(padded, index_tensor({0, 1, 3, -1, -1, 2}, DType::kInt32), probs.view(),
                                           out);
        },
        {"probs"}));
    EXPECT_TRUE(all_bytes_are(out, kPoison));
    // map length != padded rows
    EXPECT_TRUE(throws_error(
        [&] {
          padmoe::unpad_from_alignment_out(padded, index_tensor({0, 1, 3, -1, 2}, DType::kInt32), std::nullopt, out);
        },
        {"permutation_map"}));
    EXPECT_TRUE(all_bytes_are(out, kPoison));
    // H mismatch between padded and out
    Tensor outh = poison_rows(DType::kFloat32, 4, H + 1);
    EXPECT_TRUE(throws_error(
        [&] {
          padmoe::unpad_from_alignment_out(padded, index_tensor({0, 1, 3, -1, -1, 2}, DType::kInt32), std::nullopt,
                                           outh);
        },
        {"out"}));
    EXPECT_TRUE(all_bytes_are(outh, kPoison));
  }
  EXPECT_TRUE(
      throws_error([&] { padmoe::unpad_from_alignment(padded, index_tensor({0, 1, 3, -1, -1, 2}, DType::kInt32), -1); },
                   {"original_size"}));
}

TEST(BadInput, EmptyInputsAreValid) {
  // T = 0 through every MegaBlocks op, H = 0, all experts empty.
  const ref::Plan p = ref::make_plan({}, 0, 2, 4, 8);
  const IndexInputs ii = index_inputs(p, DType::kInt32);
  const Tensor x = Tensor::empty(DType::kFloat32, {0, 8});
  EXPECT_EQ(padmoe::padded_gather(x, ii.indices, ii.bin_ids, ii.bins, ii.padded_bins, 2).size(0), 0);
  EXPECT_EQ(padmoe::padded_scatter(Tensor::empty(DType::kFloat32, {0, 8}), ii.indices, ii.bin_ids, std::nullopt,
                                   ii.bins, ii.padded_bins, 2)
                .size(0),
            0);
  EXPECT_EQ(padmoe::padded_scatter_wgrad(Tensor::empty(DType::kFloat32, {0, 8}), x, ii.indices, ii.bin_ids, ii.bins,
                                         ii.padded_bins, 2)
                .numel(),
            0);
  const padmoe::Plan lp = padmoe::make_plan(Tensor::empty(DType::kInt64, {0, 2}), 4, 8);
  EXPECT_EQ(padmoe::dispatch(x, lp.view()).size(0), 0);
  EXPECT_EQ(padmoe::combine(Tensor::empty(DType::kFloat32, {0, 8}), lp.view()).size(0), 0);
}

}  // namespace
}  // namespace pt
