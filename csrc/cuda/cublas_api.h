// The few cuBLAS entry points the backend calls, resolved with dlopen at run time so that the
// module imports (and "cuda" is simply absent) where no cuBLAS is installed. The signatures and
// enum values are cuBLAS's public C ABI (cublas_api.h of CUDA 12/13), declared here because the
// library and its headers need not exist where krnl is built.
#pragma once
#include <cuda_runtime.h>
#include <library_types.h>  // cudaDataType (CUDA_R_32F, ...), part of the runtime headers

namespace krnl::cuda {

using cublasHandle = void*;
using cublasStatus = int;  // CUBLAS_STATUS_SUCCESS = 0
enum : int { kOpN = 0, kOpT = 1 };                 // cublasOperation_t
enum : int { kCompute32F = 68 };                   // cublasComputeType_t CUBLAS_COMPUTE_32F (no TF32)
enum : int { kGemmDefault = -1 };                  // cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT

struct CublasApi {
  cublasStatus (*create)(cublasHandle*) = nullptr;
  cublasStatus (*destroy)(cublasHandle) = nullptr;
  cublasStatus (*set_stream)(cublasHandle, cudaStream_t) = nullptr;
  cublasStatus (*gemm_strided_batched)(cublasHandle, int transa, int transb, int m, int n, int k, const void* alpha,
                                       const void* A, cudaDataType Atype, int lda, long long strideA, const void* B,
                                       cudaDataType Btype, int ldb, long long strideB, const void* beta, void* C,
                                       cudaDataType Ctype, int ldc, long long strideC, int batch, int compute,
                                       int algo) = nullptr;
};

// The loaded API, or nullptr when no cuBLAS could be opened (why: cublas_error()).
const CublasApi* cublas();
const char* cublas_error();

}  // namespace krnl::cuda
