// Kernels for lora_gemm_probe.cu's "fused" mode: a LoRA backward's dB = dy^T t (out, 16) f32 and
// dt = dy B (rows, 16) from ONE pass over dy (rows, out) bf16, in variants that differ in how much
// of dy each SM keeps in flight. Commit 3e5a030's kernel (tiles of 128 x 128, three stages, dt's
// accumulators in shared memory, one block per SM) read dy at about 1 TB/s on the H200, where
// cuBLAS's two GEMMs read it twice at about 4 TB/s; these keep dt's accumulators in registers,
// so that narrower tiles and more stages or more blocks per SM fit in shared memory.
//
// Block (bx, by) covers rows [by NI 128, (by + 1) NI 128) and columns [bx Cc, (bx + 1) Cc), column
// tile by column tile, its NI row tiles within each. Warp w: dt's rows 16w.. of every row tile
// (NI fragments in registers for the block's life); dB's columns of group w % (BN / 16) over
// part w / (BN / 16) of a tile's rows (one fragment, stored per column tile into its own slot of
// the partials). A second kernel sums the partials in a fixed order.
#pragma once
#include <cuda_bf16.h>
#include <mma.h>

#include <cstdint>

namespace lora_b {

namespace wmma = nvcuda::wmma;
using T = __nv_bfloat16;
constexpr int R = 16, BM = 128, kThreads = 256;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int BN, int S, int NI>
struct Cfg {
  static constexpr int LDS = BN + 8;        // shared row stride of a dy tile (conflict-free, 16-byte rows)
  static constexpr int KS = 8 / (BN / 16);  // warps that split one dB column group's rows
  static constexpr int Rr = NI * BM;        // rows a block covers
  static constexpr size_t smem = size_t(S) * BM * LDS * 2 + size_t(Rr) * R * 2 + size_t(BN) * R * 2;
};

// dt_part (gridDim.x, rows_pad, R) and dB_part (gridDim.y * KS, out_pad, R), f32.
template <int BN, int S, int NI, int MINB = 1>  // MINB: resident blocks per SM the registers must allow
__global__ void __launch_bounds__(kThreads, MINB) fused(const T* __restrict__ dy, int64_t ld, const T* __restrict__ t,
                                                  const T* __restrict__ B, int64_t rows, int64_t out, int64_t Cc,
                                                  int64_t rows_pad, int64_t out_pad, float* __restrict__ dt_part,
                                                  float* __restrict__ dB_part) {
  using C = Cfg<BN, S, NI>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* dys = reinterpret_cast<T*>(smem);  // (S, BM, LDS)
  T* ts = dys + S * BM * C::LDS;        // (Rr, R)
  T* Bs = ts + C::Rr * R;               // (BN, R)
  const int tid = threadIdx.x, warp = tid / 32;
  const int64_t r0 = blockIdx.y * int64_t(C::Rr), c0 = blockIdx.x * Cc;
  const int64_t rlim = min(rows, r0 + C::Rr), clim = min(out, c0 + Cc);
  const int nI = int((rlim - r0 + BM - 1) / BM), nJ = int((clim - c0 + BN - 1) / BN), total = nI * nJ;
  for (int e = tid; e < C::Rr * R; e += kThreads) {
    const int64_t row = r0 + e / R;
    ts[e] = row < rlim ? t[row * R + e % R] : T(0.f);
  }
  auto issue = [&](int n) {
    if (n < total) {
      T* s = dys + (n % S) * BM * C::LDS;
      const int64_t tr = r0 + int64_t(n % nI) * BM, tc = c0 + int64_t(n / nI) * BN;
      for (int ch = tid; ch < BM * BN / 8; ch += kThreads) {
        const int lr = ch / (BN / 8), lc = (ch % (BN / 8)) * 8;
        const int64_t gr = tr + lr, gc = tc + lc;
        T* dst = s + lr * C::LDS + lc;
        if (gr < rlim && gc + 8 <= clim) cp_async16(dst, dy + gr * ld + gc);
        else
          for (int e = 0; e < 8; ++e) dst[e] = gr < rlim && gc + e < clim ? dy[gr * ld + gc + e] : T(0.f);
      }
    }
    cp_async_commit();
  };
  for (int n = 0; n < S - 1; ++n) issue(n);

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> dt[NI], dB;
#pragma unroll
  for (int i = 0; i < NI; ++i) wmma::fill_fragment(dt[i], 0.f);
  const int cg = warp % (BN / 16), part = warp / (BN / 16);
  constexpr int KROWS = BM / C::KS;
  int n = 0;
  for (int j = 0; j < nJ; ++j) {
    __syncthreads();  // every warp is done with the previous column tile's B
    const int64_t tc = c0 + int64_t(j) * BN;
    for (int e = tid; e < BN * R; e += kThreads) {
      const int64_t col = tc + e / R;
      Bs[e] = col < clim ? B[col * R + e % R] : T(0.f);
    }
    wmma::fill_fragment(dB, 0.f);
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      if (i < nI) {
        cp_async_wait<S - 2>();
        __syncthreads();  // tile n is in for every thread; tile n - 1's stage is free
        issue(n + S - 1);
        const T* s = dys + (n % S) * BM * C::LDS;
#pragma unroll
        for (int k = 0; k < BN / 16; ++k) {  // dt rows 16 warp.. += dy (16, BN) B_j (BN, R)
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
          wmma::load_matrix_sync(a, s + 16 * warp * C::LDS + 16 * k, C::LDS);
          wmma::load_matrix_sync(b, Bs + 16 * k * R, R);
          wmma::mma_sync(dt[i], a, b, dt[i]);
        }
#pragma unroll
        for (int k = 0; k < KROWS / 16; ++k) {  // dB columns 16 cg.. += dy^T (16, KROWS) t (KROWS, R)
          const int lr = part * KROWS + 16 * k;
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
          wmma::load_matrix_sync(a, s + lr * C::LDS + 16 * cg, C::LDS);
          wmma::load_matrix_sync(b, ts + (i * BM + lr) * R, R);
          wmma::mma_sync(dB, a, b, dB);
        }
        ++n;
      }
    }
    float* dst = dB_part + ((int64_t(blockIdx.y) * C::KS + part) * out_pad + tc + 16 * cg) * R;
    wmma::store_matrix_sync(dst, dB, R, wmma::mem_row_major);
  }
  cp_async_wait<0>();
#pragma unroll
  for (int i = 0; i < NI; ++i)
    wmma::store_matrix_sync(dt_part + (int64_t(blockIdx.x) * rows_pad + r0 + i * BM + 16 * warp) * R, dt[i], R,
                            wmma::mem_row_major);
}

// dt (rows, R) bf16 = sum of nc partials; gB (out, R) f32 = beta gB + sum of nr partials.
__global__ void reduce(const float* __restrict__ dt_part, int nc, int64_t rows_pad, const float* __restrict__ dB_part,
                       int nr, int64_t out_pad, int64_t rows, int64_t out, float beta, T* dt, float* gB) {
  const int64_t n_dt = rows * R, total = n_dt + out * R;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    float v = 0.f;
    if (e < n_dt) {
      for (int p = 0; p < nc; ++p) v += dt_part[p * rows_pad * R + e];
      dt[e] = T(v);
    } else {
      const int64_t g = e - n_dt;
      for (int p = 0; p < nr; ++p) v += dB_part[p * out_pad * R + g];
      gB[g] = beta == 0.f ? v : beta * gB[g] + v;
    }
  }
}

}  // namespace lora_b
