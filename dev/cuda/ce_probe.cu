// Designs of cross_entropy's CUDA kernel, alone, on the train shapes' chunks of logits (bf16,
// dlogits written in place), each checked against the first. The first is the design csrc/cuda/
// loss.cu had (one load at a time, expf, up to 1024 threads a row), with its dtype fixed at
// compile time; the tree's kernel then also tested the dtype per element and moved (1024, 32000)
// at about 1.4 TB/s inside a step. Variants: fewer threads a row with each thread's loads issued
// together (loss.cu now: 8 loads, 256 threads, exp2); the row held in registers (read once);
// exp2 of (v - max) log2 e instead of expf. Each launch follows a fresh copy of the logits and a
// 256 MiB memset that moves them out of L2.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc -o /tmp/ce_probe dev/cuda/ce_probe.cu && /tmp/ce_probe
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/common.cuh"  // block_sum, block_max
#include "cuda_check.h"

using krnl::cuda::block_max;
using krnl::cuda::block_sum;

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ void unpack(uint4 u, float* v) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(w[k] << 16);
    v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack(const float* v) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
    w[k] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// 0: the earlier design (one block of up to 1024 threads a row; a running max and rescaled sum,
// then a second read that writes).
__global__ void ce_one_load(const uint4* logits, const int* targets, float* loss, uint4* dl, int64_t V, float s) {
  __shared__ float sh[32];
  const int64_t t = blockIdx.x, nv = V / 8, base = t * nv;
  const int y = targets[t];
  float v[8], mx = -3.402823466e38f, se = 0.f;
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    unpack(logits[base + c], v);
    float m = v[0];
#pragma unroll
    for (int e = 1; e < 8; ++e) m = fmaxf(m, v[e]);
    if (m > mx) {
      se *= expf(mx - m);
      mx = m;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) se += expf(v[e] - mx);
  }
  const float xt = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(logits)[t * V + y]);
  const float m = block_max(mx, sh);
  se = block_sum(se * expf(mx - m), sh);
  if (threadIdx.x == 0) loss[t] = m + logf(se) - xt;
  const float inv = 1.f / se;
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    unpack(logits[base + c], v);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float p = expf(v[e] - m) * inv;
      v[e] = s * (c * 8 + e == y ? p - 1.f : p);
    }
    dl[base + c] = pack(v);
  }
}

// exp(v - m), as expf or as exp2 of (v - m) log2 e (what loss.cu takes).
template <bool EXP2>
__device__ __forceinline__ float ex(float v, float m) {
  return EXP2 ? exp2f((v - m) * kLog2e) : expf(v - m);
}
// The sum of exp(v - m) over one vector's 8 logits.
template <bool EXP2>
__device__ __forceinline__ float sum_ex(uint4 u, float m) {
  float v[8], r = 0.f;
  unpack(u, v);
#pragma unroll
  for (int e = 0; e < 8; ++e) r += ex<EXP2>(v[e], m);
  return r;
}
__device__ __forceinline__ float max8(uint4 u, float m) {
  float v[8];
  unpack(u, v);
#pragma unroll
  for (int e = 0; e < 8; ++e) m = fmaxf(m, v[e]);
  return m;
}
// dlogits of one vector, vector index c: s (softmax - onehot(y)).
template <bool EXP2>
__device__ __forceinline__ uint4 grad8(uint4 u, int64_t c, int y, float m, float inv, float s) {
  float v[8];
  unpack(u, v);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float p = ex<EXP2>(v[e], m) * inv;
    v[e] = s * (c * 8 + e == y ? p - 1.f : p);
  }
  return pack(v);
}
constexpr uint4 kNegInf = {0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u};  // 8 bf16 -inf

// 1: the same two reads, each thread's U vectors loaded before any is used.
template <int U, bool EXP2>
__global__ void ce_batched(const uint4* logits, const int* targets, float* loss, uint4* dl, int64_t V, float s) {
  __shared__ float sh[32];
  const int64_t t = blockIdx.x, nv = V / 8, base = t * nv;
  const int y = targets[t];
  float mx = -3.402823466e38f, se = 0.f;
  for (int64_t c0 = threadIdx.x; c0 < nv; c0 += int64_t(blockDim.x) * U) {
    uint4 u[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int64_t c = c0 + int64_t(k) * blockDim.x;
      u[k] = c < nv ? logits[base + c] : kNegInf;
    }
    float m = mx;
#pragma unroll
    for (int k = 0; k < U; ++k) m = max8(u[k], m);
    se *= ex<EXP2>(mx, m);
    mx = m;
#pragma unroll
    for (int k = 0; k < U; ++k) se += sum_ex<EXP2>(u[k], m);
  }
  const float xt = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(logits)[t * V + y]);
  const float m = block_max(mx, sh);
  se = block_sum(se * ex<EXP2>(mx, m), sh);
  if (threadIdx.x == 0) loss[t] = m + logf(se) - xt;
  const float inv = 1.f / se;
  for (int64_t c0 = threadIdx.x; c0 < nv; c0 += int64_t(blockDim.x) * U) {
    uint4 u[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int64_t c = c0 + int64_t(k) * blockDim.x;
      if (c < nv) u[k] = logits[base + c];
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int64_t c = c0 + int64_t(k) * blockDim.x;
      if (c < nv) dl[base + c] = grad8<EXP2>(u[k], c, y, m, inv, s);
    }
  }
}

// 2: the row in registers as packed bf16 (NV vectors a thread): one read.
template <int NV, bool EXP2>
__global__ void ce_regs(const uint4* logits, const int* targets, float* loss, uint4* dl, int64_t V, float s) {
  __shared__ float sh[32];
  const int64_t t = blockIdx.x, nv = V / 8, base = t * nv;
  const int y = targets[t];
  uint4 u[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t c = int64_t(k) * blockDim.x + threadIdx.x;
    u[k] = c < nv ? logits[base + c] : kNegInf;
  }
  float mx = -3.402823466e38f;
#pragma unroll
  for (int k = 0; k < NV; ++k) mx = max8(u[k], mx);
  const float xt = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(logits)[t * V + y]);
  const float m = block_max(mx, sh);
  float se = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) se += sum_ex<EXP2>(u[k], m);
  se = block_sum(se, sh);
  if (threadIdx.x == 0) loss[t] = m + logf(se) - xt;
  const float inv = 1.f / se;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t c = int64_t(k) * blockDim.x + threadIdx.x;
    if (c < nv) dl[base + c] = grad8<EXP2>(u[k], c, y, m, inv, s);
  }
}

using Kernel = void (*)(const uint4*, const int*, float*, uint4*, int64_t, float);

int main() {
  struct Shape {
    int64_t rows, V;
  };
  const Shape shapes[] = {{1024, 32000}, {2048, 32000}, {8192, 32000}, {256, 128256}};
  struct Variant {
    const char* name;
    Kernel k;
    int threads;  // 0: a power of two up to 1024 for V / 8 vectors, as the earlier design took
    int nv;       // registers variant: vectors a thread (the row must fit)
  };
  const Variant variants[] = {
      {"one load, expf, 1024 thr", ce_one_load, 0, 0},
      {"batched 4, 256 thr", ce_batched<4, false>, 256, 0},
      {"batched 4, 512 thr", ce_batched<4, false>, 512, 0},
      {"batched 4, 256 thr, exp2", ce_batched<4, true>, 256, 0},
      {"batched 8, 256 thr, exp2", ce_batched<8, true>, 256, 0},
      {"regs 8 x 512 thr", ce_regs<8, false>, 512, 8},
      {"regs 8 x 512 thr, exp2", ce_regs<8, true>, 512, 8},
      {"regs 16 x 256 thr, exp2", ce_regs<16, true>, 256, 16},
      {"regs 4 x 1024 thr, exp2", ce_regs<4, true>, 1024, 4},
  };
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const size_t flush_bytes = size_t(256) << 20;  // over the H200's 50 MB of L2
  void* flush;
  CK(cudaMalloc(&flush, flush_bytes));
  for (const Shape& sh : shapes) {
    const int64_t n = sh.rows * sh.V;
    std::vector<__nv_bfloat16> hx(n);
    std::vector<int> hy(sh.rows);
    uint64_t r = 88172645463325252ull;
    for (int64_t i = 0; i < n; ++i) {
      r ^= r << 13, r ^= r >> 7, r ^= r << 17;
      hx[i] = __float2bfloat16(float(int64_t(r % 20001) - 10000) / 2500.f);  // logits in [-4, 4]
    }
    for (int64_t i = 0; i < sh.rows; ++i) hy[i] = int((i * 7919) % sh.V);
    uint4 *x, *src, *dl;
    int* y;
    float* loss;
    CK(cudaMalloc(&src, n * 2));
    CK(cudaMalloc(&x, n * 2));
    CK(cudaMalloc(&dl, n * 2));
    CK(cudaMalloc(&y, sh.rows * 4));
    CK(cudaMalloc(&loss, sh.rows * 4));
    CK(cudaMemcpy(src, hx.data(), n * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(y, hy.data(), sh.rows * 4, cudaMemcpyHostToDevice));
    std::vector<float> ref_loss(sh.rows);
    std::vector<uint16_t> ref_dl(n), got_dl(n);
    std::vector<float> got_loss(sh.rows);
    const int nvec = int(sh.V / 8);
    std::vector<std::vector<float>> us(sizeof variants / sizeof *variants);
    for (int round = 0; round < 5; ++round)
      for (size_t vi = 0; vi < sizeof variants / sizeof *variants; ++vi) {
        const Variant& v = variants[vi];
        int threads = v.threads;
        if (!threads) {
          threads = 32;
          while (threads < 1024 && threads < nvec) threads *= 2;
        }
        if (v.nv && int64_t(v.nv) * threads < nvec) continue;  // the row does not fit
        // dlogits in place, as the model calls it: each launch reads a fresh copy of the logits
        CK(cudaMemcpy(x, src, n * 2, cudaMemcpyDeviceToDevice));
        v.k<<<unsigned(sh.rows), threads>>>(x, y, loss, x, sh.V, 1.f / 8192);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        if (round == 0) {
          CK(cudaMemcpy(got_dl.data(), x, n * 2, cudaMemcpyDeviceToHost));
          CK(cudaMemcpy(got_loss.data(), loss, sh.rows * 4, cudaMemcpyDeviceToHost));
          if (vi == 0) ref_dl = got_dl, ref_loss = got_loss;
          double dloss = 0;
          int64_t ulp = 0;
          for (int64_t i = 0; i < sh.rows; ++i) dloss = std::fmax(dloss, std::fabs(double(got_loss[i]) - ref_loss[i]));
          for (int64_t i = 0; i < n; ++i) ulp = std::max<int64_t>(ulp, std::llabs(int64_t(got_dl[i]) - ref_dl[i]));
          std::printf("(%lld, %lld) %-28s loss max |diff| %.2e, dlogits max %lld bf16 ulp\n", (long long)sh.rows,
                      (long long)sh.V, v.name, dloss, (long long)ulp);
        }
        float total = 0;
        for (int rep = 0; rep < 10; ++rep) {
          CK(cudaMemcpy(x, src, n * 2, cudaMemcpyDeviceToDevice));
          CK(cudaMemset(flush, rep, flush_bytes));
          CK(cudaEventRecord(a));
          v.k<<<unsigned(sh.rows), threads>>>(x, y, loss, x, sh.V, 1.f / 8192);
          CK(cudaEventRecord(b));
          CK(cudaEventSynchronize(b));
          float ms;
          CK(cudaEventElapsedTime(&ms, a, b));
          total += ms;
        }
        us[vi].push_back(100.f * total);  // us a launch
      }
    for (size_t vi = 0; vi < us.size(); ++vi) {
      if (us[vi].empty()) continue;
      std::vector<float> u = us[vi];
      std::sort(u.begin(), u.end());
      const float med = u[u.size() / 2];
      std::printf("(%lld, %lld) %-28s %8.1f us  %5.2f TB/s (read once + write)\n", (long long)sh.rows, (long long)sh.V,
                  variants[vi].name, med, 4.0 * n / med / 1e6);
    }
    cudaFree(x), cudaFree(src), cudaFree(dl), cudaFree(y), cudaFree(loss);
  }
  return 0;
}
