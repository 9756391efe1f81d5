// The skinny GEMM kernel (skinny_gemm.h says which GEMMs take it): C (M, N) = alpha op(A) op(B)
// + beta C, row-major, 16-bit operands, fp32 accumulation on the tensor cores (wmma 16x16x16).
//
// The big operand streams through shared memory in stages of 16 rows x 128 columns (4 KB, one
// 16-byte cp.async per thread, 4 stages in flight); the small one (the rank-r factor, or t / dt)
// is read by fragment straight from global memory, where it stays cached.
//   rows mode     a block owns 16 rows of A and the whole narrow N; a stage is 128 of K, and
//                 warp w takes its columns 16w..16w+15; the 8 warps' tiles are summed in order.
//   columns mode  a block owns 128 columns of the big operand (M's for dB = dy^T t, N's for
//                 dA = dt^T x); a stage is 16 of K, and warp w owns columns 16w..16w+15 outright.
// With K sliced over blocks each block writes its f32 partial (split, M, N) and the caller's
// reduce adds the slices in order. No atomics: the summation order depends on the shape alone.
//
// Self-contained (no krnl headers) so that tools/device/lora_gemm_probe.cu times the same code.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "skinny_gemm.h"

namespace krnl::cuda::skinny {

enum OutKind : int { kOutF32 = 0, kOutF16 = 1, kOutBF16 = 2 };

// Round to nearest even, NaN kept quiet: the same bits as common.cuh's stores.
__device__ __forceinline__ void store_out(int kind, void* C, int64_t o, float v) {
  if (kind == kOutF32) {
    static_cast<float*>(C)[o] = v;
  } else if (kind == kOutF16) {
    const uint32_t u = __float_as_uint(v);
    static_cast<uint16_t*>(C)[o] = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(((u >> 16) & 0x8000u) | 0x7e00u)
                                                                     : __half_as_ushort(__float2half_rn(v));
  } else {
    uint32_t u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      static_cast<uint16_t*>(C)[o] = uint16_t((u >> 16) | 0x40);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      static_cast<uint16_t*>(C)[o] = uint16_t(u >> 16);
    }
  }
}

__device__ __forceinline__ float load_out(int kind, const void* C, int64_t o) {
  if (kind == kOutF32) return static_cast<const float*>(C)[o];
  const uint16_t b = static_cast<const uint16_t*>(C)[o];
  return kind == kOutF16 ? __half2float(__ushort_as_half(b)) : __uint_as_float(uint32_t(b) << 16);
}

constexpr int kWarps = 8;
constexpr int kStages = 4;
constexpr int kPitch = 136;  // a stage row in shared memory (elements): 128 + 8, off the bank period
constexpr int kStageElems = 16 * kPitch;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ROWS: rows mode (then NARROW_N, !TA); else columns mode, whose big operand is A stored (K, M)
// when NARROW_N (TA, !TB) and B stored (K, N) otherwise (!TB). F: 16-wide fragments across the
// narrow side. TA / TB: A stored (K, M) / B stored (N, K).
template <bool ROWS, bool NARROW_N, bool TA, bool TB, int F, class T>
__global__ void __launch_bounds__(kWarps * 32)
    skinny_gemm_kernel(const T* __restrict__ A, const T* __restrict__ B, int64_t M, int64_t N, int64_t lda,
                       int64_t ldb, int64_t k_per_split, float alpha, float beta, void* C, int64_t ldc, int out_kind,
                       float* __restrict__ part) {
  using namespace nvcuda;
  using LayA = typename std::conditional<TA, wmma::col_major, wmma::row_major>::type;
  using LayB = typename std::conditional<TB, wmma::col_major, wmma::row_major>::type;
  constexpr int kPipeBytes = kStages * kStageElems * int(sizeof(T));
  constexpr int TW = 256 * F;  // elements of one warp's output tile
  constexpr int kRedBytes = kWarps * TW * 4;
  // the stages while streaming, then the warps' output tiles
  __shared__ __align__(128) unsigned char smem[kPipeBytes > kRedBytes ? kPipeBytes : kRedBytes];
  T* const stages = reinterpret_cast<T*>(smem);
  float* const red = reinterpret_cast<float*>(smem);

  const int warp = threadIdx.x >> 5;
  const int64_t kb = int64_t(blockIdx.y) * k_per_split;
  const T* const S = (ROWS || NARROW_N) ? A : B;  // the big operand, as stored
  const int64_t lds = (ROWS || NARROW_N) ? lda : ldb;
  const int64_t long0 = int64_t(blockIdx.x) * (ROWS ? 16 : kSkinnyColsW);
  constexpr int64_t step = ROWS ? kSkinnyRowsK : kSkinnyColsK;
  const int nst = int(k_per_split / step);
  const int crow = threadIdx.x >> 4, cchunk = threadIdx.x & 15;  // this thread's 16 bytes of a stage
  auto issue = [&](int s) {
    const int64_t k = kb + s * step;
    const int64_t r = ROWS ? long0 + crow : k + crow;
    const int64_t c = (ROWS ? k : long0) + cchunk * 8;
    cp_async16(stages + (s % kStages) * kStageElems + crow * kPitch + cchunk * 8, S + r * lds + c);
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[F];
#pragma unroll
  for (int j = 0; j < F; ++j) wmma::fill_fragment(acc[j], 0.f);

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nst) issue(s);
    cp_async_commit();
  }
  for (int s = 0; s < nst; ++s) {
    cp_async_wait<kStages - 2>();  // this thread's copies of stage s have landed
    __syncthreads();               // everyone's have, and everyone is done with stage s - 1's buffer
    if (s + kStages - 1 < nst) issue(s + kStages - 1);
    cp_async_commit();
    const T* const st = stages + (s % kStages) * kStageElems + 16 * warp;
    const int64_t k0 = kb + s * step;
    if constexpr (ROWS) {
      const int64_t k = k0 + 16 * warp;
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
      wmma::load_matrix_sync(a, st, kPitch);
#pragma unroll
      for (int j = 0; j < F; ++j) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayB> b;
        wmma::load_matrix_sync(b, TB ? B + 16 * j * ldb + k : B + k * ldb + 16 * j, unsigned(ldb));
        wmma::mma_sync(acc[j], a, b, acc[j]);
      }
    } else if constexpr (NARROW_N) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;  // A (K, M): (m, k) at k * pitch + m
      wmma::load_matrix_sync(a, st, kPitch);
#pragma unroll
      for (int j = 0; j < F; ++j) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
        wmma::load_matrix_sync(b, B + k0 * ldb + 16 * j, unsigned(ldb));
        wmma::mma_sync(acc[j], a, b, acc[j]);
      }
    } else {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;  // B (K, N): (k, n) at k * pitch + n
      wmma::load_matrix_sync(b, st, kPitch);
#pragma unroll
      for (int i = 0; i < F; ++i) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LayA> a;
        wmma::load_matrix_sync(a, TA ? A + k0 * lda + 16 * i : A + 16 * i * lda + k0, unsigned(lda));
        wmma::mma_sync(acc[i], a, b, acc[i]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages' memory becomes the output tiles

  // warp w's tile at red + w * TW, row-major: (16, 16F) when N is narrow, (16F, 16) otherwise
#pragma unroll
  for (int j = 0; j < F; ++j) {
    if constexpr (ROWS || NARROW_N)
      wmma::store_matrix_sync(red + warp * TW + 16 * j, acc[j], 16 * F, wmma::mem_row_major);
    else
      wmma::store_matrix_sync(red + warp * TW + 256 * j, acc[j], 16, wmma::mem_row_major);
  }
  __syncthreads();

  auto put = [&](int64_t m, int64_t n, float v) {
    if (part) {
      part[(int64_t(blockIdx.y) * M + m) * N + n] = v;
    } else {
      v *= alpha;
      const int64_t o = m * ldc + n;
      store_out(out_kind, C, o, beta == 0.f ? v : v + beta * load_out(out_kind, C, o));
    }
  };
  if constexpr (ROWS) {
    for (int e = threadIdx.x; e < TW; e += kWarps * 32) {  // the warps' K columns summed in order
      float v = red[e];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) v += red[w * TW + e];
      put(long0 + e / (16 * F), e % (16 * F), v);
    }
  } else {
    for (int e = threadIdx.x; e < kWarps * TW; e += kWarps * 32) {
      const int w = e / TW, l = e % TW;
      if constexpr (NARROW_N)
        put(long0 + 16 * w + l / (16 * F), l % (16 * F), red[e]);
      else
        put(l / 16, long0 + 16 * w + l % 16, red[e]);
    }
  }
}

template <bool ROWS, bool NARROW_N, bool TA, bool TB, class T>
cudaError_t launch_f(const SkinnyPlan& p, const T* A, const T* B, int64_t M, int64_t N, int64_t K, int64_t lda,
                     int64_t ldb, float alpha, float beta, void* C, int64_t ldc, int out_kind, float* part,
                     cudaStream_t s) {
  const dim3 grid(unsigned(p.tiles), unsigned(p.splits)), block(kWarps * 32);
  const int64_t kp = K / p.splits;
#define KRNL_SKINNY_CASE(f)                                                                                  \
  case f:                                                                                                    \
    skinny_gemm_kernel<ROWS, NARROW_N, TA, TB, f, T>                                                         \
        <<<grid, block, 0, s>>>(A, B, M, N, lda, ldb, kp, alpha, beta, C, ldc, out_kind, part);              \
    break;
  switch (p.frags) {
    KRNL_SKINNY_CASE(1)
    KRNL_SKINNY_CASE(2)
    KRNL_SKINNY_CASE(3)
    KRNL_SKINNY_CASE(4)
    default: return cudaErrorInvalidValue;
  }
#undef KRNL_SKINNY_CASE
  return cudaGetLastError();
}

// Queues the plan's kernel on s. part: (splits, M, N) f32 when p.splits > 1 (the caller then
// reduces it into C with alpha and beta), else nullptr and C is written here.
template <class T>
cudaError_t launch(const SkinnyPlan& p, bool ta, bool tb, const T* A, const T* B, int64_t M, int64_t N, int64_t K,
                   int64_t lda, int64_t ldb, float alpha, float beta, void* C, int64_t ldc, int out_kind, float* part,
                   cudaStream_t s) {
  if (p.mode == SkinnyMode::rows && p.narrow_n && !ta)
    return tb ? launch_f<true, true, false, true>(p, A, B, M, N, K, lda, ldb, alpha, beta, C, ldc, out_kind, part, s)
              : launch_f<true, true, false, false>(p, A, B, M, N, K, lda, ldb, alpha, beta, C, ldc, out_kind, part, s);
  if (p.mode == SkinnyMode::columns && p.narrow_n && ta && !tb)
    return launch_f<false, true, true, false>(p, A, B, M, N, K, lda, ldb, alpha, beta, C, ldc, out_kind, part, s);
  if (p.mode == SkinnyMode::columns && !p.narrow_n && !tb)
    return ta ? launch_f<false, false, true, false>(p, A, B, M, N, K, lda, ldb, alpha, beta, C, ldc, out_kind, part, s)
              : launch_f<false, false, false, false>(p, A, B, M, N, K, lda, ldb, alpha, beta, C, ldc, out_kind, part, s);
  return cudaErrorInvalidValue;
}

}  // namespace krnl::cuda::skinny
