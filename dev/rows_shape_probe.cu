// rows_shape_probe.cu — the shape of the row kernels at decode sizes, standalone: a block a token
// (padmoe's spread and weighted reduce) against a token's row split over several small blocks
// (TransformerEngine's Triton permute and unpermute: a program a token and slice of the row), over
// slice counts, block sizes and units a thread, with both grid orders. Outputs are compared with the
// block-a-token kernels' (and those with the host's spread); times are the median of CUDA-graph
// replays of 20 launches, beside a copy of the same bytes.
//   nvcc -O3 -std=c++17 -arch=sm_90 dev/rows_shape_probe.cu -o rows_shape_probe
//   ./rows_shape_probe [T=256] [H=7168]        (K = 8, E = 256, bf16 rows)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

constexpr int kMaxK = 8;

// ---- spreads ----
// A: a block a token, 256 threads, up to 4 units a thread (padmoe's block spread, without the
// staging of live slots)
template <int NT, int UPT>
__global__ void __launch_bounds__(NT)
    spread_block(const int4* __restrict__ x, const int* __restrict__ dest, int4* __restrict__ y, int K, int units) {
  const int t = blockIdx.x;
  int4 r[UPT];
#pragma unroll
  for (int j = 0; j < UPT; ++j) {
    const int u = j * NT + threadIdx.x;
    if (u < units) r[j] = x[static_cast<int64_t>(t) * units + u];
  }
  __shared__ int sd[kMaxK];
  if (threadIdx.x < K) sd[threadIdx.x] = dest[t * K + threadIdx.x];
  __syncthreads();
  for (int k = 0; k < K; ++k) {
    const int d = sd[k];
    if (d < 0) continue;
#pragma unroll
    for (int j = 0; j < UPT; ++j) {
      const int u = j * NT + threadIdx.x;
      if (u < units) y[static_cast<int64_t>(d) * units + u] = r[j];
    }
  }
}

// B: a block a (token, slice) of `per` units, NT threads, UPT units a thread; kTokenFast: blocks
// of one slice for consecutive tokens are consecutive (TE's grid order), else a token's slices are.
// Each thread reads its destinations itself (K loads, no barrier).
template <int NT, int UPT, bool kTokenFast>
__global__ void __launch_bounds__(NT)
    spread_sliced(const int4* __restrict__ x, const int* __restrict__ dest, int4* __restrict__ y, int K, int units,
                  int tokens, int slices, int per) {
  const int b = blockIdx.x;
  const int t = kTokenFast ? b % tokens : b / slices;
  const int s = kTokenFast ? b / tokens : b % slices;
  const int u0 = s * per;
  int4 r[UPT];
#pragma unroll
  for (int j = 0; j < UPT; ++j) {
    const int u = u0 + j * NT + threadIdx.x;
    if (j * NT + threadIdx.x < per && u < units) r[j] = x[static_cast<int64_t>(t) * units + u];
  }
  int d[kMaxK];
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) d[k] = k < K ? __ldg(dest + t * K + k) : -1;
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) {
    if (d[k] < 0) continue;
#pragma unroll
    for (int j = 0; j < UPT; ++j) {
      const int u = u0 + j * NT + threadIdx.x;
      if (j * NT + threadIdx.x < per && u < units) y[static_cast<int64_t>(d[k]) * units + u] = r[j];
    }
  }
}

// ---- weighted reduces: out[t] = sum_k w[t,k] * y[dest[t,k]] (float32, k ascending, bf16 out) ----
__device__ __forceinline__ void fma8(float* acc, int4 v, float w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += w * f.x;
    acc[2 * i + 1] += w * f.y;
  }
}
__device__ __forceinline__ int4 pack8(const float* acc) {
  int4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return v;
}

// A: a block a token, NT threads, each thread its units one at a time with all K rows' loads in
// flight (padmoe's token reduce shape)
template <int NT>
__global__ void __launch_bounds__(NT)
    reduce_block(const int4* __restrict__ y, const int* __restrict__ dest, const float* __restrict__ w,
                 int4* __restrict__ out, int K, int units) {
  const int t = blockIdx.x;
  __shared__ int sd[kMaxK];
  __shared__ float sw[kMaxK];
  if (threadIdx.x < K) {
    sd[threadIdx.x] = dest[t * K + threadIdx.x];
    sw[threadIdx.x] = w[t * K + threadIdx.x];
  }
  __syncthreads();
  for (int u = threadIdx.x; u < units; u += NT) {
    int4 v[kMaxK];
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
      if (k < K && sd[k] >= 0) v[k] = y[static_cast<int64_t>(sd[k]) * units + u];
    }
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
      if (k < K && sd[k] >= 0) fma8(acc, v[k], sw[k]);
    }
    out[static_cast<int64_t>(t) * units + u] = pack8(acc);
  }
}

// B: a block a (token, slice) of `per` units, NT threads, one unit a thread and round
template <int NT, bool kTokenFast>
__global__ void __launch_bounds__(NT)
    reduce_sliced(const int4* __restrict__ y, const int* __restrict__ dest, const float* __restrict__ w,
                  int4* __restrict__ out, int K, int units, int tokens, int slices, int per) {
  const int b = blockIdx.x;
  const int t = kTokenFast ? b % tokens : b / slices;
  const int s = kTokenFast ? b / tokens : b % slices;
  int d[kMaxK];
  float wk[kMaxK];
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) {
    d[k] = k < K ? __ldg(dest + t * K + k) : -1;
    wk[k] = k < K ? __ldg(w + t * K + k) : 0.0f;
  }
  for (int i = threadIdx.x; i < per; i += NT) {
    const int u = s * per + i;
    if (u >= units) break;
    int4 v[kMaxK];
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
      if (d[k] >= 0) v[k] = y[static_cast<int64_t>(d[k]) * units + u];
    }
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
      if (d[k] >= 0) fma8(acc, v[k], wk[k]);
    }
    out[static_cast<int64_t>(t) * units + u] = pack8(acc);
  }
}

__global__ void copy_kernel(const int4* __restrict__ a, int4* __restrict__ b, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    b[i] = a[i];
  }
}

template <typename F>
float time_graph(F launch, cudaStream_t s, int inner = 20, int reps = 15) {
  for (int i = 0; i < 3; ++i) launch();
  CK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < inner; ++i) launch();
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1000.0f / inner);
  }
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main(int argc, char** argv) {
  const int T = argc > 1 ? std::atoi(argv[1]) : 256;
  const int K = 8, E = 256, H = argc > 2 ? std::atoi(argv[2]) : 7168;
  const int units = H * 2 / 16;
  const int R = T * K;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, T=%d K=%d E=%d H=%d bf16 (%d units a row), R=%d\n", prop.name, T, K, E, H, units, R);
  // routing: K distinct experts a token; destinations sorted by expert, then token
  std::mt19937 rng(0);
  std::vector<int> ids(R);
  for (int t = 0; t < T; ++t) {
    std::vector<int> p(E);
    std::iota(p.begin(), p.end(), 0);
    std::shuffle(p.begin(), p.end(), rng);
    for (int k = 0; k < K; ++k) ids[t * K + k] = p[k];
  }
  std::vector<int> order(R);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ids[a] < ids[b]; });
  std::vector<int> dest(R);
  for (int r = 0; r < R; ++r) dest[order[r]] = r;
  std::vector<float> w(R);
  for (auto& v : w) v = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
  std::vector<uint16_t> hx(static_cast<size_t>(T) * H);
  for (auto& v : hx) {
    const float f = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>(bits >> 16);
  }
  int4 *x, *y, *y2, *out, *out2;
  int* d_dest;
  float* d_w;
  const size_t row = static_cast<size_t>(units) * 16;
  CK(cudaMalloc(&x, T * row));
  CK(cudaMalloc(&y, R * row));
  CK(cudaMalloc(&y2, R * row));
  CK(cudaMalloc(&out, T * row));
  CK(cudaMalloc(&out2, T * row));
  CK(cudaMalloc(&d_dest, R * 4));
  CK(cudaMalloc(&d_w, R * 4));
  CK(cudaMemcpy(x, hx.data(), T * row, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_dest, dest.data(), R * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_w, w.data(), R * 4, cudaMemcpyHostToDevice));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double spread_bytes = static_cast<double>(T) * row + static_cast<double>(R) * row;
  const double reduce_bytes = static_cast<double>(R) * row + static_cast<double>(T) * row;
  // copy floor: R rows copied
  const int64_t n16 = static_cast<int64_t>(R) * units;
  const float tc = time_graph([&] { copy_kernel<<<prop.multiProcessorCount * 8, 256, 0, s>>>(y, y2, n16); }, s);
  const double bw = 2.0 * R * row / (tc * 1e-6);
  std::printf("copy of R rows %.2f us, %.2f TB/s; spread floor %.2f us, reduce floor %.2f us\n", tc, bw / 1e12,
              spread_bytes / bw * 1e6, reduce_bytes / bw * 1e6);
  // spreads
  auto check_y = [&](const char* name) {
    std::vector<uint16_t> a(static_cast<size_t>(R) * H), b(static_cast<size_t>(R) * H);
    CK(cudaMemcpy(a.data(), y, R * row, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), y2, R * row, cudaMemcpyDeviceToHost));
    if (a != b) std::printf("  %s: MISMATCH against the block spread\n", name);
  };
  const float ta = time_graph([&] { spread_block<256, 4><<<T, 256, 0, s>>>(x, d_dest, y, K, units); }, s);
  {  // the block spread against the host
    std::vector<uint16_t> a(static_cast<size_t>(R) * H);
    CK(cudaMemcpy(a.data(), y, R * row, cudaMemcpyDeviceToHost));
    bool ok = true;
    for (int t = 0; t < T && ok; ++t)
      for (int k = 0; k < K && ok; ++k)
        ok = std::memcmp(&a[static_cast<size_t>(dest[t * K + k]) * H], &hx[static_cast<size_t>(t) * H], H * 2) == 0;
    std::printf("spread block a token (256 thr): %.2f us (%.2fx floor) %s\n", ta, ta / (spread_bytes / bw * 1e6),
                ok ? "" : "WRONG");
  }
  auto sliced = [&](auto nt_tag, auto upt_tag, auto fast_tag, int slices) {
    constexpr int NT = decltype(nt_tag)::value, UPT = decltype(upt_tag)::value;
    constexpr bool F = decltype(fast_tag)::value;
    const int per = (units + slices - 1) / slices;
    if (per > NT * UPT) return;
    CK(cudaMemset(y2, 0, R * row));
    const float tb = time_graph(
        [&] { spread_sliced<NT, UPT, F><<<T * slices, NT, 0, s>>>(x, d_dest, y2, K, units, T, slices, per); }, s);
    std::printf("spread sliced S=%2d NT=%3d UPT=%d %s: %.2f us (%.2fx floor)\n", slices, NT, UPT,
                F ? "token-fast" : "slice-fast", tb, tb / (spread_bytes / bw * 1e6));
    char name[64];
    std::snprintf(name, sizeof name, "S=%d NT=%d", slices, NT);
    check_y(name);
  };
  for (int S : {1, 2, 4, 7, 8, 14, 28}) {
    sliced(std::integral_constant<int, 128>{}, std::integral_constant<int, 1>{}, std::true_type{}, S);
    sliced(std::integral_constant<int, 128>{}, std::integral_constant<int, 2>{}, std::true_type{}, S);
    sliced(std::integral_constant<int, 128>{}, std::integral_constant<int, 4>{}, std::true_type{}, S);
    sliced(std::integral_constant<int, 256>{}, std::integral_constant<int, 1>{}, std::true_type{}, S);
    sliced(std::integral_constant<int, 256>{}, std::integral_constant<int, 2>{}, std::false_type{}, S);
    sliced(std::integral_constant<int, 256>{}, std::integral_constant<int, 4>{}, std::false_type{}, S);
  }
  // reduces
  const float ra = time_graph([&] { reduce_block<256><<<T, 256, 0, s>>>(y, d_dest, d_w, out, K, units); }, s);
  std::printf("reduce block a token (256 thr): %.2f us (%.2fx floor)\n", ra, ra / (reduce_bytes / bw * 1e6));
  auto rsliced = [&](auto nt_tag, auto fast_tag, int slices) {
    constexpr int NT = decltype(nt_tag)::value;
    constexpr bool F = decltype(fast_tag)::value;
    const int per = (units + slices - 1) / slices;
    CK(cudaMemset(out2, 0, T * row));
    const float tb = time_graph(
        [&] { reduce_sliced<NT, F><<<T * slices, NT, 0, s>>>(y, d_dest, d_w, out2, K, units, T, slices, per); }, s);
    std::vector<uint16_t> a(static_cast<size_t>(T) * H), b(static_cast<size_t>(T) * H);
    CK(cudaMemcpy(a.data(), out, T * row, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), out2, T * row, cudaMemcpyDeviceToHost));
    std::printf("reduce sliced S=%2d NT=%3d %s: %.2f us (%.2fx floor)%s\n", slices, NT, F ? "token-fast" : "slice-fast",
                tb, tb / (reduce_bytes / bw * 1e6), a == b ? "" : " MISMATCH");
  };
  for (int S : {1, 2, 4, 7, 8, 14, 28}) {
    rsliced(std::integral_constant<int, 128>{}, std::true_type{}, S);
    rsliced(std::integral_constant<int, 128>{}, std::false_type{}, S);
    rsliced(std::integral_constant<int, 256>{}, std::true_type{}, S);
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
