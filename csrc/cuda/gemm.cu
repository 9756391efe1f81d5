// GEMM through cuBLAS (fp32 accumulation: CUBLAS_COMPUTE_32F, never TF32), plus the two small
// kernels around it: beta * C for K = 0, and the fp32 reduce of split-K partials.
//
// Row-major to cuBLAS's column-major: a row-major (M, N) C with row stride ldc is a column-major
// (N, M) matrix with leading dimension ldc, and C^T = op(B)^T * op(A)^T, so cuBLAS computes
// m = N, n = M with B as its first operand. A stored matrix keeps its own ld either way.
#include <library_types.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "cublas_api.h"

namespace krnl::cuda {
namespace {

cudaDataType cuda_type(DType d) {
  switch (d) {
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

// C[b][r][c] (element b*stride_c + r*ldc + c) = beta * C, or 0 when beta == 0 (C never read).
__global__ void scale_output_kernel(DType dt, void* C, int64_t batch, int64_t M, int64_t N, int64_t ldc,
                                    int64_t stride_c, float beta) {
  const int64_t total = batch * M * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / (M * N), r = (i / N) % M, c = i % N;
    const int64_t o = b * stride_c + r * ldc + c;
    st(dt, C, o, beta == 0.f ? 0.f : beta * ld(dt, C, o));
  }
}

// C[r*ldc + c] = alpha * sum_s part[s][r][c] (+ beta * C): slices summed in order (deterministic).
__global__ void split_k_reduce_kernel(const float* __restrict__ part, int64_t S, int64_t M, int64_t N, DType dt,
                                      void* C, int64_t ldc, float alpha, float beta) {
  const int64_t MN = M * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < MN; i += int64_t(gridDim.x) * blockDim.x) {
    float v = part[i];
    for (int64_t s = 1; s < S; ++s) v += part[s * MN + i];
    v *= alpha;
    const int64_t o = (i / N) * ldc + i % N;
    st(dt, C, o, beta == 0.f ? v : v + beta * ld(dt, C, o));
  }
}

// One cublasGemmStridedBatchedEx in the row-major-as-transposed form above: cuBLAS's first
// operand is B (ld ldb), its second A (ld lda); C is (N, M) column-major with leading dim ldc.
void blas_call(void* handle, const GemmArgs& g, int m, int n, int k, const void* Bp,
               long long sb, const void* Ap, long long sa, void* Cp, cudaDataType ct, int ldc, long long sc,
               int batch, float alpha, float beta) {
  const cudaDataType at = cuda_type(g.A.dtype());
  const int ta = g.trans_b ? kOpT : kOpN, tb = g.trans_a ? kOpT : kOpN;
  const int st = cublas()->gemm_strided_batched(handle, ta, tb, m, n, k, &alpha, Bp, at, int(g.ldb), sb, Ap, at,
                                                int(g.lda), sa, &beta, Cp, ct, ldc, sc, batch, kCompute32F, kGemmDefault);
  if (st != 0)
    throw std::runtime_error("[gemm] CUDA error: cublasGemmStridedBatchedEx returned status " + std::to_string(st) +
                             " (M=" + std::to_string(g.M) + " N=" + std::to_string(g.N) + " K=" + std::to_string(g.K) + ")");
}

}  // namespace

void CudaBackend::gemm_scale_output(const GemmArgs& g) {
  const int64_t total = g.batch * g.M * g.N;
  scale_output_kernel<<<grid_for(total), kThreads, 0, stream_>>>(g.C.dtype(), g.C.data(), g.batch, g.M, g.N, g.ldc,
                                                                 g.stride_c, g.beta);
  check_launch("gemm");
}

void CudaBackend::gemm_split(const GemmArgs& g) {
  // S K-slices as one strided-batched call into fp32 partials (S, M, N), then one reduce that
  // applies alpha, beta and the output dtype; per batch entry, reusing the partials (stream order).
  const int64_t S = g.split_k, kp = g.K / S, MN = g.M * g.N;
  Tensor part = scratch(S * MN);  // (S, M, N) f32
  const size_t ea = dtype_size(g.A.dtype()), ec = dtype_size(g.C.dtype());
  // Element step from one K slice to the next in each stored operand.
  const long long slice_a = g.trans_a ? kp * g.lda : kp;  // A stored (K, M) or (M, K)
  const long long slice_b = g.trans_b ? kp : kp * g.ldb;  // B stored (N, K) or (K, N)
  for (int64_t b = 0; b < g.batch; ++b) {
    const char* Ab = static_cast<const char*>(g.A.data()) + size_t(b * g.stride_a) * ea;
    const char* Bb = static_cast<const char*>(g.B.data()) + size_t(b * g.stride_b) * ea;
    blas_call(cublas_, g, int(g.N), int(g.M), int(kp), Bb, slice_b, Ab, slice_a, part.data(), CUDA_R_32F,
              int(g.N), MN, int(S), 1.f, 0.f);
    char* Cb = static_cast<char*>(g.C.data()) + size_t(b * g.stride_c) * ec;
    split_k_reduce_kernel<<<grid_for(MN), kThreads, 0, stream_>>>(part.ptr<float>(), S, g.M, g.N, g.C.dtype(), Cb,
                                                                  g.ldc, g.alpha, g.beta);
    check_launch("gemm");
  }
}

void CudaBackend::gemm(const GemmArgs& g) {
  OpTimer timer(this);
  gemm_untimed(g);
}

void CudaBackend::gemm_untimed(const GemmArgs& g) {
  if (g.M == 0 || g.N == 0) return;
  if (g.K == 0) return gemm_scale_output(g);
  for (int64_t d : {g.M, g.N, g.K, g.lda, g.ldb, g.ldc, g.batch})
    if (d > INT32_MAX)
      throw std::invalid_argument("[gemm] a dimension or row stride of " + std::to_string(d) +
                                  " exceeds the 32-bit sizes of cublasGemmStridedBatchedEx");
  if (g.split_k > 1) return gemm_split(g);
  // Batches are one strided call; a stride-0 operand is broadcast (cuBLAS allows it for A/B).
  blas_call(cublas_, g, int(g.N), int(g.M), int(g.K), g.B.data(), g.stride_b, g.A.data(), g.stride_a,
            g.C.data(), cuda_type(g.C.dtype()), int(g.ldc), g.stride_c, int(g.batch), g.alpha, g.beta);
}

}  // namespace krnl::cuda
