// bandwidth.cu — what the H200's memory does for each traffic mix the routing
// ops produce: copy (half read, half write), write-only (memset and a 16-byte
// store kernel), read-only, and a 1:8 read:write mix (a dispatch at top-8
// reads one row and writes eight), the same fan-out through Hopper's bulk
// copies (cp.async.bulk global -> shared -> global, one thread driving the
// TMA engine), the fan-in of a reduce and the reading fan-out of a spread
// with dots at 4 and 14 KiB rows, the decode-sized traffic (a few tens of
// MB: where launch and latency, not bandwidth, set the time), and the traffic of
// dispatch, combine, gather_backward(w) and combine_backward(w) at the presets'
// own sizes (a random dest map over P rows, padding rows zeroed: the row extents
// the ops touch, not the whole buffer). Used to tell a kernel's overhead
// from the memory system's own limit for a mix; results in bench/results/.
// Usage: padmoe_bandwidth [GiB per buffer, default 2]
#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>

#define CHECK(x)                                                    \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)

__global__ void write_kernel(uint4* dst, size_t n) {
  const uint4 z = make_uint4(0, 0, 0, 0);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) dst[i] = z;
}

// One thread busy for `ns` nanoseconds of the GPU's global timer: a stand-in for a kernel of a
// known duration (make_plan's at decode) in front of a traffic pattern.
__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

__global__ void read_kernel(const uint4* src, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = src[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads alive
}

// Each block reads one row of `units` 16-byte units and writes it to `copies`
// rows spread over dst (row r of block b goes to (b * copies + r) * stride_rows
// modulo the row count): the traffic of a dispatch.
__global__ void fan_out_kernel(const uint4* src, uint4* dst, int units, int copies, size_t rows_out) {
  const size_t b = blockIdx.x;
  uint4 reg[4];
  for (int j = 0; j < 4; ++j) {
    const int u = j * blockDim.x + threadIdx.x;
    if (u < units) reg[j] = src[b * units + u];
  }
  for (int c = 0; c < copies; ++c) {
    const size_t row = (b * copies + c) * 2654435761ull % rows_out;
    for (int j = 0; j < 4; ++j) {
      const int u = j * blockDim.x + threadIdx.x;
      if (u < units) dst[row * units + u] = reg[j];
    }
  }
}


// --- the fan-out through the bulk-copy (TMA) engine, sm_90 ---------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PADMOE_BW_BULK 1
#endif
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Block b: one thread loads row b (row_bytes) into shared memory with one bulk copy
// (completion on an mbarrier), then issues `copies` bulk stores of it to the same
// scattered rows as fan_out_kernel, and waits for them before the block ends.
__global__ void fan_out_bulk_kernel(const char* src, char* dst, unsigned row_bytes, int copies, size_t rows_out) {
#ifdef PADMOE_BW_BULK
  extern __shared__ __align__(128) char s_row[];
  __shared__ __align__(8) unsigned long long s_bar;
  if (threadIdx.x != 0) return;
  const size_t b = blockIdx.x;
  const unsigned bar = smem_u32(&s_bar), row = smem_u32(s_row);
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(row_bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(row),
               "l"(src + b * row_bytes), "r"(row_bytes), "r"(bar)
               : "memory");
  unsigned done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(bar)
                 : "memory");
  }
  for (int c = 0; c < copies; ++c) {
    const size_t r = (b * copies + c) * 2654435761ull % rows_out;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + r * row_bytes), "r"(row),
                 "r"(row_bytes)
                 : "memory");
  }
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

// The register fan-out with the row held by a 512-thread block (two 16-byte units a thread).
__global__ void fan_out_wide_kernel(const uint4* src, uint4* dst, int units, int copies, size_t rows_out) {
  const size_t b = blockIdx.x;
  uint4 reg[2];
  for (int j = 0; j < 2; ++j) {
    const int u = j * blockDim.x + threadIdx.x;
    if (u < units) reg[j] = src[b * units + u];
  }
  for (int c = 0; c < copies; ++c) {
    const size_t row = (b * copies + c) * 2654435761ull % rows_out;
    for (int j = 0; j < 2; ++j) {
      const int u = j * blockDim.x + threadIdx.x;
      if (u < units) dst[row * units + u] = reg[j];
    }
  }
}

// The fan-in of a reduce: each block reads `k` (<= 8) rows at scattered places, adds them as
// packed 32-bit words (the traffic is the point, not the adds), with `partner` reads one more row
// (the gather / dispatch backward's x[t], for its dot) and writes one row in order: combine,
// padded_scatter (k rows in, 1 out), padded_gather_backward(w) / dispatch_backward(w) (with the
// partner).
__global__ void fan_in_kernel(const uint4* src, uint4* dst, int units, int k, size_t rows_in, bool partner) {
  const size_t b = blockIdx.x;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {  // every load before the first add
      if (c < k) v[c] = src[((b * k + c) * 2654435761ull % rows_in) * units + u];
    }
    uint4 acc = partner ? src[((rows_in - 1 - b) % rows_in) * units + u] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (c < k) {
        acc.x += v[c].x;
        acc.y += v[c].y;
        acc.z += v[c].z;
        acc.w += v[c].w;
      }
    }
    dst[b * units + u] = acc;
  }
}

// A spread that also reads: each block reads its row once, then for each of `copies` scattered
// rows reads that row of `other` and writes the same row of dst (combine_backward(w) /
// padded_scatter_backward(w): grad_out[t] in, y[dest] read for the dot, grad_y[dest] written).
__global__ void fan_out_read_kernel(const uint4* src, const uint4* other, uint4* dst, int units, int copies,
                                    size_t rows_out, unsigned* sink) {
  const size_t b = blockIdx.x;
  unsigned acc = 0;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const uint4 x = src[b * units + u];
    for (int c = 0; c < copies; ++c) {
      const size_t row = (b * copies + c) * 2654435761ull % rows_out;
      const uint4 y = other[row * units + u];
      acc ^= y.x ^ y.y ^ y.z ^ y.w;
      dst[row * units + u] = x;
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads alive
}

// --- the routing ops' traffic at a preset's own sizes ----------------------------------------
// T token rows, A = T * K assignments at random padded rows dest[A] of [0, P) (a random
// permutation's first A entries, as a plan of random routing places them), the P - A others
// listed in pad[] (padding rows): the same row extents as the op, so the DRAM pages and the TLB
// see what the op sees (the fixed-pattern kernels above spread over the whole 2 GiB buffer).

// Block T + z (z >= 0) of a spread zeroes padding rows pad[z * zero_rows, (z + 1) * zero_rows).
__device__ void zero_pad_rows(uint4* y, const int* pad, int units, int T, int pads, int zero_rows) {
  const int p0 = (static_cast<int>(blockIdx.x) - T) * zero_rows;
  for (int q = p0; q < p0 + zero_rows && q < pads; ++q) {
    for (int u = threadIdx.x; u < units; u += blockDim.x)
      y[static_cast<size_t>(pad[q]) * units + u] = make_uint4(0, 0, 0, 0);
  }
}

// dispatch: block t < T reads row t and writes it to its K destinations; blocks past T zero
// `zero_rows` padding rows each.
__global__ void route_spread_kernel(const uint4* x, uint4* y, const int* dest, const int* pad, int units, int K, int T,
                                    int pads, int zero_rows) {
  if (static_cast<int>(blockIdx.x) >= T) {
    zero_pad_rows(y, pad, units, T, pads, zero_rows);
    return;
  }
  const size_t t = blockIdx.x;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const uint4 v = x[t * units + u];
    for (int c = 0; c < K; ++c) y[static_cast<size_t>(dest[t * K + c]) * units + u] = v;
  }
}

// route_spread_kernel behind the chunk layout's dependency (sort_chunks' one-launch form, where
// no row can be written before the chunks are laid out): every block first reads the 256 split
// sizes and scans them (one cub::BlockScan of 256 threads, the least of the op's three scans), and
// its rows' destinations wait on the scan (shifted by total - expect_total, 0 at run time).
__global__ void __launch_bounds__(256)
    scanned_spread_kernel(const uint4* x, uint4* y, const int* dest, const int* pad, const int* sizes, int expect_total,
                          int units, int T, int pads, int zero_rows) {
  using Scan = cub::BlockScan<int, 256>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int s_shift;
  int excl = 0, total = 0;
  Scan(tmp).ExclusiveSum(sizes[threadIdx.x], excl, total);
  if (threadIdx.x == 0) s_shift = total - expect_total;
  __syncthreads();
  const int shift = s_shift;
  if (static_cast<int>(blockIdx.x) >= T) {
    zero_pad_rows(y, pad + shift, units, T, pads, zero_rows);
    return;
  }
  const size_t t = blockIdx.x;
  const size_t to = static_cast<size_t>(dest[t + shift]) * units;
  for (int u = threadIdx.x; u < units; u += blockDim.x) y[to + u] = x[t * units + u];
}

// combine (partner = nullptr) / gather or dispatch backward with dots (partner: x[t] read too):
// block t reads its K rows of y (every load before the first add) and writes out[t].
__global__ void route_reduce_kernel(const uint4* y, const uint4* partner, uint4* out, const int* dest, int units, int K,
                                    unsigned* sink) {
  const size_t t = blockIdx.x;
  unsigned dot = 0;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (c < K) v[c] = y[static_cast<size_t>(dest[t * K + c]) * units + u];
    }
    const uint4 g = partner != nullptr ? partner[t * units + u] : make_uint4(0, 0, 0, 0);
    uint4 acc = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (c < K) {
        acc.x += v[c].x;
        acc.y += v[c].y;
        acc.z += v[c].z;
        acc.w += v[c].w;
        dot ^= v[c].x & g.x;
      }
    }
    out[t * units + u] = acc;
  }
  if (dot == 0x9e3779b9u) sink[0] = dot;  // keeps the partner's loads alive
}

// The same traffic with padmoe's arithmetic: bf16 rows to float32, times a float weight, summed in
// ascending k without FMA, rounded back to bf16 (round to nearest even); a block a token, every
// source row's unit loaded before the first add.
__device__ __forceinline__ unsigned bf16_pair(float lo, float hi) {
  unsigned a = __float_as_uint(lo), b = __float_as_uint(hi);
  a += 0x7fffu + ((a >> 16) & 1u);
  b += 0x7fffu + ((b >> 16) & 1u);
  return (a >> 16) | (b & 0xffff0000u);
}
// kDots false, kOut true: that combine (g and dots unused). kDots: the gather / dispatch backward
// with dots in the same arithmetic (K float32 dots <y[dest], g[t]> with FMA, summed over the block
// by a shuffle tree and the warps in order), writing out[t] and the K dots; kOut false: the dots
// alone (padded_scatter_wgrad's traffic: A + T rows read, K floats a token written).
template <bool kDots, bool kOut>
__global__ void route_reduce_bf16_kernel(const uint4* y, const uint4* g, const float* w, uint4* out, float* dots,
                                         const int* dest, int units, int K) {
  __shared__ float s_part[8][8];
  const size_t t = blockIdx.x;
  int row[8];
  float wk[8], part[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    row[c] = c < K ? dest[t * K + c] : 0;
    wk[c] = c < K ? w[t * K + c] : 0.0f;
    part[c] = 0.0f;
  }
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (c < K) v[c] = y[static_cast<size_t>(row[c]) * units + u];
    }
    const uint4 gv = kDots ? g[t * units + u] : make_uint4(0, 0, 0, 0);
    const unsigned gx[4] = {gv.x, gv.y, gv.z, gv.w};
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (c >= K) continue;
      const unsigned x[4] = {v[c].x, v[c].y, v[c].z, v[c].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float lo = __uint_as_float(x[i] << 16), hi = __uint_as_float(x[i] & 0xffff0000u);
        if (kOut) {
          acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(wk[c], lo));
          acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(wk[c], hi));
        }
        if (kDots) {
          part[c] = fmaf(lo, __uint_as_float(gx[i] << 16), part[c]);
          part[c] = fmaf(hi, __uint_as_float(gx[i] & 0xffff0000u), part[c]);
        }
      }
    }
    if (kOut) {
      out[t * units + u] = make_uint4(bf16_pair(acc[0], acc[1]), bf16_pair(acc[2], acc[3]), bf16_pair(acc[4], acc[5]),
                                      bf16_pair(acc[6], acc[7]));
    }
  }
  if (!kDots) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) part[c] += __shfl_xor_sync(0xffffffffu, part[c], off);
    if (lane == 0 && warp < 8) s_part[warp][c] = part[c];
  }
  __syncthreads();
  if (threadIdx.x < static_cast<unsigned>(K)) {
    float sum = 0.0f;
    for (int q = 0; q < 8 && q < static_cast<int>(blockDim.x / 32); ++q) sum += s_part[q][threadIdx.x];
    dots[t * K + threadIdx.x] = sum;
  }
}

// combine backward with dots: block t reads row t, and for each destination reads that row of
// `other` (the dot) and writes row t there; padding rows zeroed as in the spread.
__global__ void route_spread_read_kernel(const uint4* x, const uint4* other, uint4* y, const int* dest, const int* pad,
                                         int units, int K, int T, int pads, int zero_rows, unsigned* sink) {
  if (static_cast<int>(blockIdx.x) >= T) {
    zero_pad_rows(y, pad, units, T, pads, zero_rows);
    return;
  }
  const size_t t = blockIdx.x;
  unsigned dot = 0;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const uint4 v = x[t * units + u];
    uint4 o[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (c < K) o[c] = other[static_cast<size_t>(dest[t * K + c]) * units + u];
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (c < K) {
        y[static_cast<size_t>(dest[t * K + c]) * units + u] = v;
        dot ^= o[c].x & v.x;
      }
    }
  }
  if (dot == 0x9e3779b9u) sink[0] = dot;
}

// dispatch(fp8+scales)'s traffic: block t < T moves its 1-byte row (units 16-byte units) and its
// scale row (scols float32 entries, 1x128 blocks) to its K destinations; blocks past T zero
// `zero_rows` padding rows each and set their scale entries to 1. `quant`: x holds bf16 rows (2 *
// units 16-byte units) and each code is the high byte of its bf16 value (the quantizing
// dispatch's bytes, read bf16 / write codes + scales, with none of its arithmetic: no amax, no
// division, no conversion), the scale written 1.
__global__ void route_spread_scaled_kernel(const uint4* x, const float* xs, uint4* y, float* ys, const int* dest,
                                           const int* pad, int units, int scols, int K, int T, int pads, int zero_rows,
                                           bool quant) {
  if (static_cast<int>(blockIdx.x) >= T) {
    zero_pad_rows(y, pad, units, T, pads, zero_rows);
    const int p0 = (static_cast<int>(blockIdx.x) - T) * zero_rows;
    for (int q = p0; q < p0 + zero_rows && q < pads; ++q) {
      for (int i = threadIdx.x; i < scols; i += blockDim.x) ys[static_cast<size_t>(pad[q]) * scols + i] = 1.0f;
    }
    return;
  }
  const size_t t = blockIdx.x;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    uint4 v;
    if (quant) {  // 16 bf16 values (two units of the bf16 row) -> 16 bytes: each value's high byte
      const uint4 a = x[t * 2 * units + 2 * u], b = x[t * 2 * units + 2 * u + 1];
      auto hi = [](unsigned w0, unsigned w1) {
        return (w0 >> 8 & 0xffu) | (w0 >> 24 & 0xffu) << 8 | (w1 >> 8 & 0xffu) << 16 | (w1 >> 24 & 0xffu) << 24;
      };
      v = make_uint4(hi(a.x, a.y), hi(a.z, a.w), hi(b.x, b.y), hi(b.z, b.w));
    } else {
      v = x[t * units + u];
    }
    for (int c = 0; c < K; ++c) y[static_cast<size_t>(dest[t * K + c]) * units + u] = v;
  }
  for (int i = threadIdx.x; i < scols; i += blockDim.x) {
    const float sv = quant ? 1.0f : xs[t * scols + i];
    for (int c = 0; c < K; ++c) ys[static_cast<size_t>(dest[t * K + c]) * scols + i] = sv;
  }
}

// make_plan's skeleton at T = 16384, K = 8, E = 256: the fused plan's memory phases with no
// ranking (what a one-launch plan cannot skip). Every block counts its chunk of ids into a
// shared histogram with integer atomics and writes its counts, waits at a grid barrier, reads
// the [G, E] counts (a column an expert, as padmoe's fused plan reads them: two threads an
// expert, each half the blocks, 16 loads in flight), scans the totals (cub), then places its
// ids by shared atomics (unordered: no stable rank) and writes one int each.
// `counts_only`: stop after the grid barrier (launch + id loads + histogram + barrier).
constexpr int kSkeletonThreads = 512;
__global__ void __launch_bounds__(kSkeletonThreads)
    plan_skeleton_kernel(const int* ids, int* counts, int* dest, int A, int E, int chunk, bool counts_only) {
  using Scan = cub::BlockScan<int, kSkeletonThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  extern __shared__ int sh[];
  int* hist = sh;      // [E]
  int* base = sh + E;  // [E]
  int* half = sh + 2 * E;  // [2][E]: the second thread's sums
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int begin = static_cast<int>(blockIdx.x) * chunk;
  const int end = begin + chunk < A ? begin + chunk : A;
  int mine[4];
  int n = 0;
  for (int i = begin + threadIdx.x; i < end && n < 4; i += blockDim.x) {
    mine[n] = ids[i];
    atomicAdd(&hist[mine[n]], 1);
    ++n;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[static_cast<size_t>(blockIdx.x) * E + e] = hist[e];
  cooperative_groups::this_grid().sync();
  if (counts_only) return;
  // expert x's total over all blocks and its count in the blocks before this one; E <= 256:
  // thread x reads blocks [0, G/2), thread x + 256 blocks [G/2, G)
  const int G = static_cast<int>(gridDim.x), cb = static_cast<int>(blockIdx.x);
  const int t = threadIdx.x, x = t & 255, second = t >> 8;
  const int lo = second ? G / 2 : 0, hi = second ? G : G / 2;
  int total = 0, before = 0;
  if (x < E) {
    constexpr int kBatch = 16;
    for (int b0 = lo; b0 < hi; b0 += kBatch) {
      int v[kBatch];
#pragma unroll
      for (int q = 0; q < kBatch; ++q) v[q] = b0 + q < hi ? __ldcg(counts + static_cast<size_t>(b0 + q) * E + x) : 0;
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        total += v[q];
        if (b0 + q < cb) before += v[q];
      }
    }
  }
  if (second && x < E) {
    half[x] = total;
    half[E + x] = before;
  }
  __syncthreads();
  const int e = t;
  if (e < E) {
    total += half[e];
    before += half[E + e];
  } else {
    total = before = 0;
  }
  int excl = 0;
  Scan(scan_storage).ExclusiveSum(total, excl);
  if (e < E) {
    base[e] = excl + before;  // exclusive prefix + this block's column prefix
    hist[e] = 0;
  }
  __syncthreads();
  int k = 0;
  for (int i = begin + threadIdx.x; i < end && k < n; i += blockDim.x, ++k) {
    dest[i] = base[mine[k]] + atomicAdd(&hist[mine[k]], 1);
  }
}

template <typename F>
float time_ms(F&& f, int iters) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  f();
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CHECK(cudaEventRecord(a));
    f();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Microseconds per launch of f from a CUDA graph holding `captures` launches of f, a sample being
// `replays` back-to-back graph launches between two events (median of iters samples, warm
// caches). graph_us: ten launches in one graph (one graph launch shared by ten kernels);
// graphs_us: one launch a graph, ten graphs back to back, as padmoe bench's graph column times
// an op (each replay pays a graph launch).
template <typename F>
float graph_time_us(F&& f, int captures, int replays, int iters) {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < captures; ++i) f(s);
  CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ge;
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  CHECK(cudaGraphUpload(ge, s));
  for (int i = 0; i < replays; ++i) CHECK(cudaGraphLaunch(ge, s));
  CHECK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CHECK(cudaEventRecord(a, s));
    for (int r = 0; r < replays; ++r) CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaStreamDestroy(s));
  return ms[ms.size() / 2] * 1e3f / static_cast<float>(captures * replays);
}
template <typename F>
float graph_us(F&& f, int reps, int iters) {
  return graph_time_us(f, reps, 1, iters);
}
template <typename F>
float graphs_us(F&& f, int replays, int iters) {
  return graph_time_us(f, 1, replays, iters);
}

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 2.0;
  const size_t bytes = static_cast<size_t>(gib * (1ull << 30)) / 16 * 16;
  const size_t n = bytes / 16;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  uint4 *a = nullptr, *b = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(a, 1, bytes));
  const int grid = prop.multiProcessorCount * 8;
  const int iters = 20;
  auto report = [&](const char* what, double moved, float ms) {
    std::printf("%-44s %8.1f us  %6.2f TB/s\n", what, ms * 1e3, moved / (ms * 1e-3) / 1e12);
  };
  auto greport = [&](const char* what, double moved, float us) {
    std::printf("%-44s %8.1f us  %6.2f TB/s\n", what, us, moved / (us * 1e-6) / 1e12);
  };
  std::printf("card: %s, %.2f GiB per buffer, median of %d\n", prop.name, gib, iters);
  report("copy (cudaMemcpyAsync D2D, read + write)", 2.0 * bytes,
         time_ms([&] { CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, iters));
  report("write only (cudaMemsetAsync)", double(bytes), time_ms([&] { CHECK(cudaMemsetAsync(b, 0, bytes)); }, iters));
  report("write only (16-byte store kernel)", double(bytes),
         time_ms([&] { write_kernel<<<grid, 256>>>(b, n); }, iters));
  report("read only (16-byte load kernel)", double(bytes),
         time_ms([&] { read_kernel<<<grid, 256>>>(a, n, sink); }, iters));
  for (int copies : {2, 8}) {
    const int units = 896;  // a 14 KiB row (H = 7168, bf16)
    const size_t rows_out = n / units;
    const size_t blocks = rows_out / copies;
    char label[80];
    std::snprintf(label, sizeof label, "fan-out 1 read : %d writes (14 KiB rows)", copies);
    report(
        label, double(blocks) * units * 16 * (1 + copies),
        time_ms([&] { fan_out_kernel<<<static_cast<unsigned>(blocks), 256>>>(a, b, units, copies, rows_out); }, iters));
  }
  {  // mixtral-8x7b's dispatch: top-2, 8 KiB rows (H = 4096, bf16)
    const int units = 512;
    const size_t rows_out = n / units;
    report("fan-out 1 : 2 (8 KiB rows)", double(rows_out / 2) * units * 16 * 3,
           time_ms([&] { fan_out_kernel<<<static_cast<unsigned>(rows_out / 2), 256>>>(a, b, units, 2, rows_out); },
                   iters));
  }
  // the qwen3-30b-a3b row (H = 2048, bf16: 4 KiB) beside deepseek-v3's (14 KiB), top-8: the
  // fan-out of a dispatch, the fan-in of a combine, the fan-in with a partner row of a gather /
  // dispatch backward with dots, and the reading fan-out of a combine backward with dots
  for (int units : {256, 896}) {
    const int kb = units * 16 / 1024;
    const size_t rows = n / units;
    char label[96];
    {
      const size_t blocks = rows / 8;
      std::snprintf(label, sizeof label, "fan-out 1 : 8 (%d KiB rows)", kb);
      report(label, double(blocks) * units * 16 * 9,
             time_ms([&] { fan_out_kernel<<<static_cast<unsigned>(blocks), 256>>>(a, b, units, 8, rows); }, iters));
    }
    for (bool partner : {false, true}) {
      const size_t blocks = rows / 8;  // b's first rows / 8 written, a's rows read at random
      std::snprintf(label, sizeof label, "fan-in 8 : 1%s (%d KiB rows)", partner ? " + partner row" : "", kb);
      report(label, double(blocks) * units * 16 * (8 + 1 + (partner ? 1 : 0)),
             time_ms([&] { fan_in_kernel<<<static_cast<unsigned>(blocks), 256>>>(a, b, units, 8, rows, partner); },
                     iters));
    }
    {
      // src and other share a (read only), b takes the writes: 1 + 8 reads, 8 writes a block
      const size_t blocks = rows / 16;
      std::snprintf(label, sizeof label, "fan-out 1 : 8 reading 8 (%d KiB rows)", kb);
      report(label, double(blocks) * units * 16 * 17,
             time_ms(
                 [&] {
                   fan_out_read_kernel<<<static_cast<unsigned>(blocks), 256>>>(a + rows / 2 * units, a, b, units, 8,
                                                                               rows / 2, sink);
                 },
                 iters));
    }
  }
  {
    const int units = 896;
    const unsigned row_bytes = units * 16;
    CHECK(cudaFuncSetAttribute(fan_out_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, row_bytes));
    for (int copies : {2, 8}) {
      const size_t rows_out = n / units;
      const size_t blocks = rows_out / copies;
      char label[80];
      std::snprintf(label, sizeof label, "fan-out 1 : %d, bulk copies (TMA)", copies);
      report(label, double(blocks) * units * 16 * (1 + copies),
             time_ms(
                 [&] {
                   fan_out_bulk_kernel<<<static_cast<unsigned>(blocks), 32, row_bytes>>>(
                       reinterpret_cast<const char*>(a), reinterpret_cast<char*>(b), row_bytes, copies, rows_out);
                 },
                 iters));
      std::snprintf(label, sizeof label, "fan-out 1 : %d, 512-thread blocks", copies);
      report(
          label, double(blocks) * units * 16 * (1 + copies),
          time_ms([&] { fan_out_wide_kernel<<<static_cast<unsigned>(blocks), 512>>>(a, b, units, copies, rows_out); },
                  iters));
    }
    // decode-sized traffic: T = 256 tokens of 14 KiB to 8 rows each (and the 4096-row
    // padded buffer a decode dispatch writes in all), one launch at a time
    std::printf("decode-sized (one launch timed by events, as padmoe bench times an op):\n");
    const size_t dec_rows = 4096, dec_bytes = dec_rows * row_bytes;
    report("  copy 4096 rows (cudaMemcpyAsync)", 2.0 * dec_bytes,
           time_ms([&] { CHECK(cudaMemcpyAsync(b, a, dec_bytes, cudaMemcpyDeviceToDevice)); }, iters));
    report("  write 4096 rows (cudaMemsetAsync)", double(dec_bytes),
           time_ms([&] { CHECK(cudaMemsetAsync(b, 0, dec_bytes)); }, iters));
    report("  write 4096 rows (16-byte store kernel)", double(dec_bytes),
           time_ms([&] { write_kernel<<<prop.multiProcessorCount * 4, 256>>>(b, dec_bytes / 16); }, iters));
    report("  fan-out 256 rows : 8 (register, 256 threads)", 9.0 * 256 * row_bytes,
           time_ms([&] { fan_out_kernel<<<256, 256>>>(a, b, units, 8, 2048); }, iters));
    report("  fan-out 256 rows : 8 (register, 512 threads)", 9.0 * 256 * row_bytes,
           time_ms([&] { fan_out_wide_kernel<<<256, 512>>>(a, b, units, 8, 2048); }, iters));
    report("  fan-out 256 rows : 8 (bulk copies)", 9.0 * 256 * row_bytes,
           time_ms(
               [&] {
                 fan_out_bulk_kernel<<<256, 32, row_bytes>>>(reinterpret_cast<const char*>(a),
                                                             reinterpret_cast<char*>(b), row_bytes, 8, 2048);
               },
               iters));
    report("  empty kernel", 0.0, time_ms([&] { write_kernel<<<1, 32>>>(b, 0); }, iters));
    std::printf("decode-sized, replayed from a CUDA graph (10 launches a replay, warm L2):\n");
    greport("  copy 4096 rows (cudaMemcpyAsync)", 2.0 * dec_bytes,
            graph_us([&](cudaStream_t st) { CHECK(cudaMemcpyAsync(b, a, dec_bytes, cudaMemcpyDeviceToDevice, st)); },
                     10, iters));
    greport("  write 4096 rows (cudaMemsetAsync)", double(dec_bytes),
            graph_us([&](cudaStream_t st) { CHECK(cudaMemsetAsync(b, 0, dec_bytes, st)); }, 10, iters));
    greport("  write 4096 rows (16-byte store kernel)", double(dec_bytes),
            graph_us(
                [&](cudaStream_t st) { write_kernel<<<prop.multiProcessorCount * 4, 256, 0, st>>>(b, dec_bytes / 16); },
                10, iters));
    greport("  write 2048 rows (16-byte store kernel)", double(dec_bytes) / 2,
            graph_us(
                [&](cudaStream_t st) { write_kernel<<<prop.multiProcessorCount * 4, 256, 0, st>>>(b, dec_bytes / 32); },
                10, iters));
    greport("  fan-out 256 rows : 8 (register, 256 threads)", 9.0 * 256 * row_bytes,
            graph_us([&](cudaStream_t st) { fan_out_kernel<<<256, 256, 0, st>>>(a, b, units, 8, 2048); }, 10, iters));
    greport("  empty kernel", 0.0, graph_us([&](cudaStream_t st) { write_kernel<<<1, 32, 0, st>>>(b, 0); }, 10, iters));
    std::printf("decode-sized, one launch a graph, 10 graphs replayed back to back (padmoe bench's graph column):\n");
    greport("  empty kernel", 0.0,
            graphs_us([&](cudaStream_t st) { write_kernel<<<1, 32, 0, st>>>(b, 0); }, 10, iters));
    greport("  two empty kernels", 0.0,
            graphs_us(
                [&](cudaStream_t st) {
                  write_kernel<<<1, 32, 0, st>>>(b, 0);
                  write_kernel<<<1, 32, 0, st>>>(b, 0);
                },
                10, iters));
    greport("  write 2048 rows (16-byte store kernel)", double(dec_bytes) / 2,
            graphs_us(
                [&](cudaStream_t st) { write_kernel<<<prop.multiProcessorCount * 4, 256, 0, st>>>(b, dec_bytes / 32); },
                10, iters));
  }
  {
    // the routing ops' traffic at each preset's sizes (T = 16384; P as padmoe bench reports it)
    // (and decode's, T = 256, where padmoe's zero blocks clear 4 rows each, timed from a graph too)
    struct Shape {
      const char* name;
      int K, units, T, P, zero_rows;
    };
    const Shape shapes[] = {{"mixtral-8x7b", 2, 512, 16384, 33152, 32},
                            {"qwen3-30b-a3b", 8, 256, 16384, 139008, 32},
                            {"deepseek-v3", 8, 896, 16384, 147200, 32},
                            {"decode", 8, 896, 256, 4128, 4}};
    uint4* c = nullptr;  // token rows (x, out, partner): T rows
    CHECK(cudaMalloc(&c, size_t(16384) * 896 * 16 * 2));
    CHECK(cudaMemset(c, 1, size_t(16384) * 896 * 16 * 2));
    std::printf("at the presets' sizes (random dest over P rows, padding rows zeroed; min bytes as padmoe bench):\n");
    for (const Shape& sh : shapes) {
      const size_t A = size_t(sh.T) * sh.K;
      if (size_t(sh.P) * sh.units > n) continue;  // buffers smaller than asked
      std::vector<int> perm(sh.P);
      for (int i = 0; i < sh.P; ++i) perm[i] = i;
      unsigned long long st = 0x9e3779b97f4a7c15ull;
      for (int i = sh.P - 1; i > 0; --i) {  // Fisher-Yates, a fixed seed
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        std::swap(perm[i], perm[static_cast<int>((st >> 33) % static_cast<unsigned long long>(i + 1))]);
      }
      int *dest = nullptr, *pad = nullptr;
      const int pads = sh.P - static_cast<int>(A);
      CHECK(cudaMalloc(&dest, A * sizeof(int)));
      CHECK(cudaMalloc(&pad, (pads > 0 ? pads : 1) * sizeof(int)));
      CHECK(cudaMemcpy(dest, perm.data(), A * sizeof(int), cudaMemcpyHostToDevice));
      if (pads > 0) CHECK(cudaMemcpy(pad, perm.data() + A, pads * sizeof(int), cudaMemcpyHostToDevice));
      float* weights = nullptr;  // the top-k weights of the bf16 combine
      const std::vector<float> host_w(A, 0.5f);
      CHECK(cudaMalloc(&weights, A * sizeof(float)));
      CHECK(cudaMemcpy(weights, host_w.data(), A * sizeof(float), cudaMemcpyHostToDevice));
      const double row = sh.units * 16.0;
      const int zero_rows = sh.zero_rows;
      const unsigned spread_blocks = static_cast<unsigned>(sh.T + (pads + zero_rows - 1) / zero_rows);
      const bool graph = sh.T < 1024;  // decode: also as padmoe bench's graph column times it
      char label[96];
      // one pattern: event-timed, and for decode replayed from a graph (10 launches a replay)
      auto both = [&](const char* what, double moved, auto&& launch) {
        std::snprintf(label, sizeof label, "  %s %s", sh.name, what);
        report(label, moved, time_ms([&] { launch(cudaStream_t{}); }, iters));
        if (!graph) return;
        std::snprintf(label, sizeof label, "  %s %s, graph", sh.name, what);
        greport(label, moved, graph_us(launch, 10, iters));
        std::snprintf(label, sizeof label, "  %s %s, a graph each", sh.name, what);
        greport(label, moved, graphs_us(launch, 10, iters));
      };
      both("dispatch (T + P rows)", (double(sh.T) + sh.P) * row, [&](cudaStream_t st) {
        route_spread_kernel<<<spread_blocks, 256, 0, st>>>(c, b, dest, pad, sh.units, sh.K, sh.T, pads, zero_rows);
      });
      // dispatch(fp8+scales)'s rows: the same spread over rows of H bytes (half the units; the
      // scale rows, 3% of the bytes at 128-column blocks, left out)
      both("dispatch, 1-byte rows (T + P rows)", (double(sh.T) + sh.P) * row / 2, [&](cudaStream_t st) {
        route_spread_kernel<<<spread_blocks, 256, 0, st>>>(c, b, dest, pad, sh.units / 2, sh.K, sh.T, pads, zero_rows);
      });
      {
        // dispatch(fp8+scales) with its scale rows (1x128 blocks of the H-byte rows: H / 128 float32
        // entries a row), and the quantizing dispatch's bytes (bf16 rows read, codes + scales written,
        // no arithmetic): bounds of those two ops at each preset
        const int scols = sh.units * 16 / 2 / 128;
        float *xs = nullptr, *ys = nullptr;
        CHECK(cudaMalloc(&xs, size_t(sh.T) * scols * sizeof(float)));
        CHECK(cudaMalloc(&ys, size_t(sh.P) * scols * sizeof(float)));
        CHECK(cudaMemset(xs, 0, size_t(sh.T) * scols * sizeof(float)));
        const double scale_row = scols * 4.0;
        both("dispatch(fp8+scales), 1-byte rows + scale rows (T + P rows)",
             (double(sh.T) + sh.P) * (row / 2 + scale_row), [&](cudaStream_t st) {
               route_spread_scaled_kernel<<<spread_blocks, 256, 0, st>>>(c, xs, b, ys, dest, pad, sh.units / 2, scols,
                                                                         sh.K, sh.T, pads, zero_rows, false);
             });
        both("quantizing dispatch's bytes, no arithmetic (T bf16 + P code rows)",
             double(sh.T) * row + double(sh.P) * (row / 2 + scale_row), [&](cudaStream_t st) {
               route_spread_scaled_kernel<<<spread_blocks, 256, 0, st>>>(c, nullptr, b, ys, dest, pad, sh.units / 2,
                                                                         scols, sh.K, sh.T, pads, zero_rows, true);
             });
        CHECK(cudaFree(xs));
        CHECK(cudaFree(ys));
      }
      both("combine (A + T rows)", (double(A) + sh.T) * row, [&](cudaStream_t st) {
        route_reduce_kernel<<<sh.T, 256, 0, st>>>(b, nullptr, c, dest, sh.units, sh.K, sink);
      });
      if (graph) {  // pad / unpad: a row a block by a map (K = 1 over the A sorted rows)
        const unsigned pad_blocks = static_cast<unsigned>(A + (pads + zero_rows - 1) / zero_rows);
        both("pad_to_alignment (A + P rows)", (double(A) + sh.P) * row, [&](cudaStream_t st) {
          route_spread_kernel<<<pad_blocks, 256, 0, st>>>(c, b, dest, pad, sh.units, 1, static_cast<int>(A), pads,
                                                          zero_rows);
        });
        both("unpad_from_alignment (2A rows)", 2.0 * A * row, [&](cudaStream_t st) {
          route_reduce_kernel<<<static_cast<unsigned>(A), 256, 0, st>>>(b, nullptr, c, dest, sh.units, 1, sink);
        });
        // sort_chunks' rows as padmoe bench's decode workload has them (A = 2048 received rows into
        // Pc = 2272 padded rows: R = 8 ranks, 32 local experts, alignment 16), a row a block by a
        // map with no layout ahead of it: the one-launch form's bound
        const int pc = static_cast<int>(A) + 224, cpads = pc - static_cast<int>(A);
        std::vector<int> cperm(pc);
        for (int i = 0; i < pc; ++i) cperm[i] = i;
        for (int i = pc - 1; i > 0; --i) {
          st = st * 6364136223846793005ull + 1442695040888963407ull;
          std::swap(cperm[i], cperm[static_cast<int>((st >> 33) % static_cast<unsigned long long>(i + 1))]);
        }
        int *cdest = nullptr, *cpad = nullptr;
        CHECK(cudaMalloc(&cdest, A * sizeof(int)));
        CHECK(cudaMalloc(&cpad, cpads * sizeof(int)));
        CHECK(cudaMemcpy(cdest, cperm.data(), A * sizeof(int), cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(cpad, cperm.data() + A, cpads * sizeof(int), cudaMemcpyHostToDevice));
        const unsigned chunk_blocks = static_cast<unsigned>(A + (cpads + zero_rows - 1) / zero_rows);
        both("sort_chunks (A + Pc rows, Pc = A + 224)", (double(A) + pc) * row, [&](cudaStream_t st) {
          route_spread_kernel<<<chunk_blocks, 256, 0, st>>>(c, b, cdest, cpad, sh.units, 1, static_cast<int>(A), cpads,
                                                            zero_rows);
        });
        // the same behind the layout's dependency (scanned_spread_kernel): 256 chunks of 8 rows
        int* csizes = nullptr;
        std::vector<int> eight(256, static_cast<int>(A) / 256);
        CHECK(cudaMalloc(&csizes, 256 * sizeof(int)));
        CHECK(cudaMemcpy(csizes, eight.data(), 256 * sizeof(int), cudaMemcpyHostToDevice));
        both("sort_chunks behind a scan of its 256 sizes in every block", (double(A) + pc) * row, [&](cudaStream_t st) {
          scanned_spread_kernel<<<chunk_blocks, 256, 0, st>>>(c, b, cdest, cpad, csizes,
                                                              256 * (static_cast<int>(A) / 256), sh.units,
                                                              static_cast<int>(A), cpads, zero_rows);
        });
        CHECK(cudaFree(csizes));
        CHECK(cudaFree(cdest));
        CHECK(cudaFree(cpad));
      }
      both("combine(w), bf16 arithmetic (A + T rows)", (double(A) + sh.T) * row, [&](cudaStream_t st) {
        route_reduce_bf16_kernel<false, true>
            <<<sh.T, 256, 0, st>>>(b, nullptr, weights, c, nullptr, dest, sh.units, sh.K);
      });
      if (graph) {
        // decode's dispatch + combine as one graph (the combine reads what the dispatch wrote; a
        // dispatch timed alone may leave dirty lines in L2 for the next kernel to write back), then
        // behind an empty kernel (a plan that costs only its launch): p + d + c's bound
        auto dispatch_combine = [&](cudaStream_t st) {
          route_spread_kernel<<<spread_blocks, 256, 0, st>>>(c, b, dest, pad, sh.units, sh.K, sh.T, pads, zero_rows);
          route_reduce_bf16_kernel<false, true>
              <<<sh.T, 256, 0, st>>>(b, nullptr, weights, c + size_t(sh.T) * sh.units, nullptr, dest, sh.units, sh.K);
        };
        const double dc_moved = (2.0 * sh.T + sh.P + A) * row;
        both("dispatch + combine(w) (T + P, A + T rows)", dc_moved, dispatch_combine);
        both("empty + dispatch + combine(w)", dc_moved, [&](cudaStream_t st) {
          write_kernel<<<1, 32, 0, st>>>(b, 0);
          dispatch_combine(st);
        });
        // behind a kernel of make_plan's own duration at decode (3.7 us of GPU time, CUPTI): plan +
        // dispatch + combine's bound for a plan that takes its measured time and a dispatch that
        // starts after it (measured on an H200: 31.6-31.7 us in a graph of 10, 4.4-4.5 the spin alone)
        both("spin 3.7 us alone", 0.0, [&](cudaStream_t st) { spin_kernel<<<1, 1, 0, st>>>(3700); });
        both("spin 3.7 us + dispatch + combine(w)", dc_moved, [&](cudaStream_t st) {
          spin_kernel<<<1, 1, 0, st>>>(3700);
          dispatch_combine(st);
        });
      }
      both("gather_backward(w) (A + 2T rows)", (double(A) + 2.0 * sh.T) * row, [&](cudaStream_t st) {
        route_reduce_kernel<<<sh.T, 256, 0, st>>>(b, c + size_t(sh.T) * sh.units, c, dest, sh.units, sh.K, sink);
      });
      float* dots = nullptr;  // the K dots a token of the patterns with dots
      CHECK(cudaMalloc(&dots, A * sizeof(float)));
      both("gather_backward(w), bf16 arithmetic + dots (A + 2T rows)", (double(A) + 2.0 * sh.T) * row,
           [&](cudaStream_t st) {
             route_reduce_bf16_kernel<true, true>
                 <<<sh.T, 256, 0, st>>>(b, c + size_t(sh.T) * sh.units, weights, c, dots, dest, sh.units, sh.K);
           });
      both("wgrad, bf16 dots (A + T rows)", (double(A) + sh.T) * row, [&](cudaStream_t st) {
        route_reduce_bf16_kernel<true, false>
            <<<sh.T, 256, 0, st>>>(b, c + size_t(sh.T) * sh.units, weights, nullptr, dots, dest, sh.units, sh.K);
      });
      CHECK(cudaFree(dots));
      both("combine_backward(w) (T + A + P rows)", (double(sh.T) + A + sh.P) * row, [&](cudaStream_t st) {
        route_spread_read_kernel<<<spread_blocks, 256, 0, st>>>(c, a, b, dest, pad, sh.units, sh.K, sh.T, pads,
                                                                zero_rows, sink);
      });
      CHECK(cudaFree(weights));
      CHECK(cudaFree(dest));
      CHECK(cudaFree(pad));
    }
    CHECK(cudaFree(c));
  }
  {
    // make_plan's floor for a one-launch design: the skeleton above at deepseek-v3's ids
    // (A = 131072, E = 256) on 128 blocks of 512 threads, as padmoe's fused plan launches
    const int A = 16384 * 8, E = 256, G = 128, threads = kSkeletonThreads, chunk = (A + G - 1) / G;
    std::vector<int> ids(A);
    unsigned long long st = 0x2545f4914f6cdd1dull;
    for (int& v : ids) {
      st = st * 6364136223846793005ull + 1442695040888963407ull;
      v = static_cast<int>((st >> 33) % E);
    }
    int *d_ids = nullptr, *d_counts = nullptr, *d_dest = nullptr;
    CHECK(cudaMalloc(&d_ids, A * sizeof(int)));
    CHECK(cudaMalloc(&d_counts, size_t(G) * E * sizeof(int)));
    CHECK(cudaMalloc(&d_dest, A * sizeof(int)));
    CHECK(cudaMemcpy(d_ids, ids.data(), A * sizeof(int), cudaMemcpyHostToDevice));
    int coop = 0, dev = 0, per_sm = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
    const size_t smem = 4 * E * sizeof(int);
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, plan_skeleton_kernel, threads, smem));
    if (coop != 0 && per_sm * prop.multiProcessorCount >= G) {
      std::printf("make_plan's skeleton, A = 131072, E = 256, 128 blocks of 512 (one launch, grid barrier):\n");
      for (const bool counts_only : {true, false}) {
        int a_ = A, e_ = E, c_ = chunk;
        bool co = counts_only;
        const int* pi = d_ids;
        int* pc = d_counts;
        int* pd = d_dest;
        void* args[] = {&pi, &pc, &pd, &a_, &e_, &c_, &co};
        auto launch = [&](cudaStream_t s) {
          CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(plan_skeleton_kernel), dim3(G), dim3(threads),
                                            args, smem, s));
        };
        const char* what = counts_only ? "  ids + histogram + grid barrier" : "  + column reads, scan, placement";
        char label[96];
        std::snprintf(label, sizeof label, "%s", what);
        report(label, 0.0, time_ms([&] { launch(cudaStream_t{}); }, iters));
        std::snprintf(label, sizeof label, "%s, graph", what);
        greport(label, 0.0, graph_us(launch, 10, iters));
        std::snprintf(label, sizeof label, "%s, a graph each", what);
        greport(label, 0.0, graphs_us(launch, 10, iters));
      }
      // the placement's result: every row below A taken once
      std::vector<int> got(A);
      CHECK(cudaMemcpy(got.data(), d_dest, A * sizeof(int), cudaMemcpyDeviceToHost));
      std::vector<char> seen(A, 0);
      int bad = 0;
      for (int v : got) {
        if (v < 0 || v >= A || seen[v]) ++bad;
        else seen[v] = 1;
      }
      if (bad != 0) std::printf("  skeleton placement WRONG: %d rows\n", bad);
    }
    CHECK(cudaFree(d_ids));
    CHECK(cudaFree(d_counts));
    CHECK(cudaFree(d_dest));
  }
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  return 0;
}
