// quantized_matmul on CUDA (csrc/core/op_list.h has the layout): W (O, I) stays packed in MLX's
// affine layout and each thread dequantizes the codes it reads, accumulating in float. A first,
// untuned kernel (one thread per output element, no shared-memory tiles): correct at any shape,
// bound by the reads of x and the codes; a tiled or tensor-core version comes with the
// quantized-base benchmark.
#include "common.cuh"

namespace krnl::cuda {
namespace {

template <int BITS>
__device__ __forceinline__ float dequant(const uint32_t* w, int64_t words, int64_t o, int64_t j, float s, float b) {
  constexpr int PER = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const uint32_t q = (w[o * words + j / PER] >> ((j % PER) * BITS)) & MASK;
  return s * float(q) + b;
}

// out (N, M) = x (N, K) op(W) + beta out; transpose: K = I, M = O (x W^T); else K = O, M = I (x W).
template <int BITS, bool TRANSPOSE>
__global__ void quantized_matmul_kernel(DType xdt, const void* x, const uint32_t* w, DType sdt, const void* scales,
                                        const void* biases, void* out, int64_t N, int64_t M, int64_t K, int64_t words,
                                        int64_t gs, float beta) {
  const int64_t I = TRANSPOSE ? K : M, G = I / gs, total = N * M;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = e / M, m = e % M;
    float acc = 0.f;
    if (TRANSPOSE) {  // o = m: one row of W, group by group
      for (int64_t g = 0; g < G; ++g) {
        const float s = ld(sdt, scales, m * G + g), b = ld(sdt, biases, m * G + g);
        for (int64_t j = g * gs; j < (g + 1) * gs; ++j)
          acc = fmaf(ld(xdt, x, n * K + j), dequant<BITS>(w, words, m, j, s, b), acc);
      }
    } else {  // j = m: one column of W, down its rows
      const int64_t g = m / gs;
      for (int64_t o = 0; o < K; ++o)
        acc = fmaf(ld(xdt, x, n * K + o),
                   dequant<BITS>(w, words, o, m, ld(sdt, scales, o * G + g), ld(sdt, biases, o * G + g)), acc);
    }
    st(xdt, out, e, beta != 0.f ? fmaf(beta, ld(xdt, out, e), acc) : acc);  // beta 0 never reads out
  }
}

template <int BITS>
void launch(bool transpose, unsigned grid, cudaStream_t s, DType xdt, const void* x, const uint32_t* w, DType sdt,
            const void* sc, const void* bi, void* out, int64_t N, int64_t M, int64_t K, int64_t words, int64_t gs,
            float beta) {
  if (transpose)
    quantized_matmul_kernel<BITS, true><<<grid, kThreads, 0, s>>>(xdt, x, w, sdt, sc, bi, out, N, M, K, words, gs, beta);
  else
    quantized_matmul_kernel<BITS, false><<<grid, kThreads, 0, s>>>(xdt, x, w, sdt, sc, bi, out, N, M, K, words, gs, beta);
}

}  // namespace

void CudaBackend::quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor& biases,
                                   const Tensor& out, bool transpose, int64_t group_size, int64_t bits, float beta) {
  OpTimer timer(this);
  const int64_t N = x.size(0), K = x.size(1), M = out.size(1);
  if (N == 0 || M == 0) return;
  const unsigned grid = grid_for(N * M);
  const auto* codes = static_cast<const uint32_t*>(w.data());
  auto go = bits == 2 ? launch<2> : bits == 4 ? launch<4> : launch<8>;  // the core allows 2, 4, 8
  go(transpose, grid, stream_, x.dtype(), x.data(), codes, scales.dtype(), scales.data(), biases.data(), out.data(), N,
     M, K, w.size(1), group_size, beta);
  check_launch("quantized_matmul");
}

}  // namespace krnl::cuda
