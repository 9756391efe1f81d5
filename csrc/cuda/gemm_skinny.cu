// Skinny GEMMs: C (M, N) = op(A) op(B) with A row-major (M, K), N at most 64 (the LoRA rank,
// or q|k|v's three) and M, K long: t = x A^T and dt = dy B of docs/architecture.md's 'LoRA'.
// They are bandwidth-bound (A is read once, B is small), and cuBLAS ran the K = 4096 ones at
// 0.38 of that bound on the H200 (`krnl bench --workloads lora`), with few thread blocks for a
// (4096, 16) output. Here every 16 rows of A are one block of 8 warps, each warp a contiguous
// slice of K on tensor-core fragments (WMMA 16x16x16, fp32 accumulation), the slices summed in
// shared memory. A tail of fewer than 16 rows is covered by a last block that starts 16 rows
// before the end and stores only its new rows, so any M >= 16 needs no bounds checks in the loads.
#include <mma.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common.cuh"

namespace krnl::cuda {
namespace {

using namespace nvcuda;

constexpr int kSkinnyWarps = 8;   // K slices per block
constexpr int kSkinnyUnroll = 8;  // A tiles each warp loads before using them
constexpr int kSkinnyMaxN = 64;

// op(B) (K, N): stored (K, N) it is WMMA's row_major matrix_b, stored (N, K) its col_major.
template <typename T, typename LayoutB, int NT>
__global__ void __launch_bounds__(kSkinnyWarps * 32)
    gemm_skinny_kernel(const T* __restrict__ A, int64_t lda, const T* __restrict__ B, int64_t ldb, void* C,
                       DType cdt, int64_t ldc, int M, int K, float alpha, float beta) {
  constexpr bool b_row = std::is_same<LayoutB, wmma::row_major>::value;
  __shared__ float part[kSkinnyWarps][16][NT * 16];  // each warp's (16, N) partial sum
  const int warp = threadIdx.x >> 5;
  const int first = blockIdx.x * 16;
  const int r0 = min(first, M - 16);  // the last block overlaps its neighbour, never reads past M
  const T* Ab = A + int64_t(r0) * lda;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) wmma::fill_fragment(acc[n], 0.f);

  // Warp w takes a contiguous range of k-tiles, kSkinnyUnroll of them (256 bytes of each of its
  // 16 rows) in flight at a time.
  const int ktiles = K / 16, per = (ktiles + kSkinnyWarps - 1) / kSkinnyWarps;
  const int kbeg = warp * per, kend = min(ktiles, kbeg + per);
  for (int kt0 = kbeg; kt0 < kend; kt0 += kSkinnyUnroll) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[kSkinnyUnroll];
#pragma unroll
    for (int u = 0; u < kSkinnyUnroll; ++u)
      if (kt0 + u < kend) wmma::load_matrix_sync(a[u], Ab + int64_t(kt0 + u) * 16, unsigned(lda));
#pragma unroll
    for (int u = 0; u < kSkinnyUnroll; ++u) {
      if (kt0 + u < kend) {
        const int64_t k = int64_t(kt0 + u) * 16;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> b;
          const int64_t c = int64_t(n) * 16;
          wmma::load_matrix_sync(b, B + (b_row ? k * ldb + c : c * ldb + k), unsigned(ldb));
          wmma::mma_sync(acc[n], a[u], b, acc[n]);
        }
      }
    }
  }
#pragma unroll
  for (int n = 0; n < NT; ++n)
    wmma::store_matrix_sync(&part[warp][0][n * 16], acc[n], NT * 16, wmma::mem_row_major);
  __syncthreads();
  for (int i = threadIdx.x; i < 16 * NT * 16; i += blockDim.x) {
    const int r = i / (NT * 16), c = i % (NT * 16);
    if (r0 + r < first) continue;  // the overlapping block's rows belong to its neighbour
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kSkinnyWarps; ++w) v += part[w][r][c];
    v *= alpha;
    const int64_t o = int64_t(r0 + r) * ldc + c;
    st(cdt, C, o, beta == 0.f ? v : v + beta * ld(cdt, C, o));
  }
}

template <typename T, typename LB>
void launch_b(int nt, const T* A, const T* B, const GemmArgs& g, cudaStream_t s) {
  const unsigned blocks = unsigned((g.M + 15) / 16);
  const int M = int(g.M), K = int(g.K);
  void* C = g.C.data();
  const DType cdt = g.C.dtype();
  switch (nt) {
    case 1: gemm_skinny_kernel<T, LB, 1><<<blocks, kSkinnyWarps * 32, 0, s>>>(A, g.lda, B, g.ldb, C, cdt, g.ldc, M, K, g.alpha, g.beta); break;
    case 2: gemm_skinny_kernel<T, LB, 2><<<blocks, kSkinnyWarps * 32, 0, s>>>(A, g.lda, B, g.ldb, C, cdt, g.ldc, M, K, g.alpha, g.beta); break;
    case 3: gemm_skinny_kernel<T, LB, 3><<<blocks, kSkinnyWarps * 32, 0, s>>>(A, g.lda, B, g.ldb, C, cdt, g.ldc, M, K, g.alpha, g.beta); break;
    default: gemm_skinny_kernel<T, LB, 4><<<blocks, kSkinnyWarps * 32, 0, s>>>(A, g.lda, B, g.ldb, C, cdt, g.ldc, M, K, g.alpha, g.beta); break;
  }
}

template <typename T>
void launch(const GemmArgs& g, cudaStream_t s) {
  const T* a = static_cast<const T*>(g.A.data());
  const T* b = static_cast<const T*>(g.B.data());
  const int nt = int(g.N / 16);
  if (g.trans_b) launch_b<T, wmma::col_major>(nt, a, b, g, s);
  else launch_b<T, wmma::row_major>(nt, a, b, g, s);
}

bool aligned32(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 31u) == 0; }

}  // namespace

// KRNL_CUDA_SKINNY_GEMM=0 sends these products to cuBLAS, read at each call so that one process
// can record a CUDA graph of each path and time both.
bool skinny_enabled() {
  const char* v = std::getenv("KRNL_CUDA_SKINNY_GEMM");
  return !(v && std::strcmp(v, "0") == 0);
}

bool CudaBackend::gemm_skinny(const GemmArgs& g) {
  const DType dt = g.A.dtype();
  if (!skinny_enabled() || g.batch != 1 || g.split_k > 1 || (dt != DType::bf16 && dt != DType::f16)) return false;
  // A column-major A (dB = dy^T t) reads 32 bytes of each of 16 rows per tile: at 0.35-0.37 of
  // the bandwidth bound on the H200 against cuBLAS's 0.39-0.89, so it stays on cuBLAS (as do
  // dA = dt^T x and products with few rows, whose long side is not the rows of A).
  if (g.trans_a || g.N > kSkinnyMaxN || g.N % 16 || g.M < 16 || g.M > INT32_MAX || g.K % 16 || g.K > INT32_MAX)
    return false;
  // WMMA loads want 32-byte aligned tiles: 16-element steps of every leading dimension.
  if (g.lda % 16 || g.ldb % 16 || !aligned32(g.A.data()) || !aligned32(g.B.data())) return false;
  if (dt == DType::bf16)
    launch<__nv_bfloat16>(g, stream_);
  else
    launch<__half>(g, stream_);
  check_launch("gemm");
  return true;
}

}  // namespace krnl::cuda
