// quantized_matmul on CUDA (csrc/core/op_list.h has the layout). Two paths:
// - from kDequantMinRows rows of x on (training): W dequantized once into a transient (O, I)
//   matrix in x's dtype (released to the stream-ordered pool right after, so at most one lives at
//   a time), then one cuBLAS GEMM with f32 accumulation: tensor cores at the cost of rounding W to
//   a 16-bit x's dtype first, as MLX and bitsandbytes do;
// - fewer rows (generation): one thread per output element dequantizing the codes it reads, so a
//   token's forward never writes W out whole.
// Mode mxfp4 (op_list.h) runs the same kernels with MX set: W = s e2m1(q), 4-bit codes, no biases.
#include "common.cuh"
#include "core/ops.h"
#include "moe_tiles.cuh"

namespace krnl::cuda {
namespace {

constexpr int64_t kDequantMinRows = 16;

// Code j of a row: the row's codes are one little-endian bit stream of 32-bit words.
template <int BITS>
__device__ __forceinline__ uint32_t code(const uint32_t* row, int64_t j) {
  const int64_t bit = j * BITS, wi = bit >> 5;
  const int sh = int(bit & 31);
  uint32_t q = row[wi] >> sh;
  if (32 % BITS != 0 && sh + BITS > 32) q |= row[wi + 1] << (32 - sh);  // 3, 5, 6 bits straddle words
  return q & ((1u << BITS) - 1u);
}

template <int BITS>
__device__ __forceinline__ float dequant(const uint32_t* w, int64_t words, int64_t o, int64_t j, float s, float b) {
  return s * float(code<BITS>(w + o * words, j)) + b;
}

// A weight of its code q: s q + b, or s e2m1(q) (MX: mode mxfp4, b unused).
template <bool MX>
__device__ __forceinline__ float weight(uint32_t q, float s, float b) {
  if constexpr (MX)
    return s * moe::e2m1(q);
  else
    return s * float(q) + b;
}

// out (N, M) = x (N, K) op(W) + beta out; transpose: K = I, M = O (x W^T); else K = O, M = I (x W).
template <int BITS, bool MX, bool TRANSPOSE>
__global__ void quantized_matmul_kernel(DType xdt, const void* x, int64_t ldx, const uint32_t* w, DType sdt,
                                        const void* scales, const void* biases, void* out, int64_t ldo, int64_t N,
                                        int64_t M, int64_t K, int64_t words, int64_t gs, float beta) {
  const int64_t I = TRANSPOSE ? K : M, G = I / gs, total = N * M;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = e / M, m = e % M;
    float acc = 0.f;
    if (TRANSPOSE) {  // o = m: one row of W, group by group
      for (int64_t g = 0; g < G; ++g) {
        const float s = ld(sdt, scales, m * G + g), b = MX ? 0.f : ld(sdt, biases, m * G + g);
        for (int64_t j = g * gs; j < (g + 1) * gs; ++j)
          acc = fmaf(ld(xdt, x, n * ldx + j), weight<MX>(code<BITS>(w + m * words, j), s, b), acc);
      }
    } else {  // j = m: one column of W, down its rows
      const int64_t g = m / gs;
      for (int64_t o = 0; o < K; ++o)
        acc = fmaf(ld(xdt, x, n * ldx + o),
                   weight<MX>(code<BITS>(w + o * words, m), ld(sdt, scales, o * G + g),
                              MX ? 0.f : ld(sdt, biases, o * G + g)),
                   acc);
    }
    const int64_t oi = n * ldo + m;
    st(xdt, out, oi, beta != 0.f ? fmaf(beta, ld(xdt, out, oi), acc) : acc);  // beta 0 never reads out
  }
}

// wd (O, I) in odt = W for 3, 5 and 6 bits: a thread per run of codes that fills whole words
// (32 codes in 3 or 5 words, 16 in 3), so each code word is read once.
template <int BITS>
__global__ void dequantize_kernel(const uint32_t* w, int64_t words, DType sdt, const void* scales,
                                  const void* biases, int64_t O, int64_t I, int64_t gs, DType odt, void* wd) {
  constexpr int PER = BITS == 6 ? 16 : 32;
  const int64_t runs_per_row = I / PER, total = O * runs_per_row, G = I / gs;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t o = t / runs_per_row, j0 = (t % runs_per_row) * PER;
    const uint32_t* row = w + o * words;
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int64_t j = j0 + k, g = o * G + j / gs;
      st(odt, wd, o * I + j, ld(sdt, scales, g) * float(code<BITS>(row, j)) + ld(sdt, biases, g));
    }
  }
}

// The same for 2, 4 and 8 bits (and mxfp4's 4, MX), where a word holds whole codes of one group: a
// thread per word, its PER outputs (ES bytes each) written with 8- or 16-byte stores.
template <int BITS, int ES, bool MX>
__global__ void dequantize_words_kernel(const uint32_t* w, int64_t total_words, int64_t words, DType sdt,
                                        const void* scales, const void* biases, int64_t I, int64_t gs, DType odt,
                                        void* wd) {
  constexpr int PER = 32 / BITS, NB = PER * ES;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int64_t G = I / gs;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total_words;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t o = t / words, j0 = (t % words) * PER, g = o * G + j0 / gs;
    const float s = ld(sdt, scales, g), b = MX ? 0.f : ld(sdt, biases, g);
    const uint32_t u = w[t];
    uint32_t packed[NB / 4] = {};
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const float v = weight<MX>((u >> (k * BITS)) & MASK, s, b);
      if (ES == 4)
        packed[k] = __float_as_uint(v);
      else
        packed[k / 2] |= uint32_t(odt == DType::f16 ? to_f16_bits(v) : to_bf16_bits(v)) << (16 * (k & 1));
    }
    char* dst = static_cast<char*>(wd) + (o * I + j0) * ES;  // I * ES is a multiple of 16: aligned
    if constexpr (NB % 16 == 0) {
#pragma unroll
      for (int i = 0; i < NB / 16; ++i)
        reinterpret_cast<uint4*>(dst)[i] = make_uint4(packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]);
    } else {
      *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
    }
  }
}

// out[t, c] = the dequantized table[ids[t], c]; an id outside [0, V) (checked on the host before)
// writes NaN and reads nothing.
template <int BITS>
__global__ void quantized_embedding_kernel(const int32_t* ids, const uint32_t* w, int64_t words, DType sdt,
                                           const void* scales, const void* biases, DType odt, void* out, int64_t n,
                                           int64_t C, int64_t V, int64_t gs) {
  const int64_t G = C / gs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n * C; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / C, c = i % C, id = ids[t];
    if (id >= 0 && id < V)
      st(odt, out, i, dequant<BITS>(w, words, id, c, ld(sdt, scales, id * G + c / gs), ld(sdt, biases, id * G + c / gs)));
    else
      st(odt, out, i, __uint_as_float(0x7fc00000u));
  }
}

template <int BITS>
void launch_embedding(cudaStream_t s, const int32_t* ids, const uint32_t* w, int64_t words, DType sdt,
                      const void* sc, const void* bi, DType odt, void* out, int64_t n, int64_t C, int64_t V,
                      int64_t gs) {
  quantized_embedding_kernel<BITS><<<grid_for(n * C), kThreads, 0, s>>>(ids, w, words, sdt, sc, bi, odt, out, n, C, V, gs);
}

template <int BITS, bool MX = false>
void launch(bool transpose, unsigned grid, cudaStream_t s, DType xdt, const void* x, int64_t ldx, const uint32_t* w,
            DType sdt, const void* sc, const void* bi, void* out, int64_t ldo, int64_t N, int64_t M, int64_t K,
            int64_t words, int64_t gs, float beta) {
  if (transpose)
    quantized_matmul_kernel<BITS, MX, true>
        <<<grid, kThreads, 0, s>>>(xdt, x, ldx, w, sdt, sc, bi, out, ldo, N, M, K, words, gs, beta);
  else
    quantized_matmul_kernel<BITS, MX, false>
        <<<grid, kThreads, 0, s>>>(xdt, x, ldx, w, sdt, sc, bi, out, ldo, N, M, K, words, gs, beta);
}

template <int BITS, bool MX = false>
void launch_dequantize(cudaStream_t s, const uint32_t* w, int64_t words, DType sdt, const void* sc, const void* bi,
                       int64_t O, int64_t I, int64_t gs, DType odt, void* wd) {
  if constexpr (32 % BITS == 0) {
    const int64_t n = O * words;
    if (odt == DType::f32)
      dequantize_words_kernel<BITS, 4, MX><<<grid_for(n), kThreads, 0, s>>>(w, n, words, sdt, sc, bi, I, gs, odt, wd);
    else
      dequantize_words_kernel<BITS, 2, MX><<<grid_for(n), kThreads, 0, s>>>(w, n, words, sdt, sc, bi, I, gs, odt, wd);
  } else {
    constexpr int64_t PER = BITS == 6 ? 16 : 32;
    dequantize_kernel<BITS><<<grid_for(O * I / PER), kThreads, 0, s>>>(w, words, sdt, sc, bi, O, I, gs, odt, wd);
  }
}

template <class F2, class F3, class F4, class F5, class F6, class F8>
auto by_bits(int64_t bits, F2 f2, F3 f3, F4 f4, F5 f5, F6 f6, F8 f8) {
  switch (bits) {  // the core allows exactly these
    case 2: return f2;
    case 3: return f3;
    case 4: return f4;
    case 5: return f5;
    case 6: return f6;
    default: return f8;
  }
}

}  // namespace

void CudaBackend::quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases,
                                   const Tensor& out, bool transpose, int64_t group_size, int64_t bits, float beta,
                                   int64_t mode) {
  OpTimer timer(this);
  const int64_t N = x.size(0), K = x.size(1), M = out.size(1), O = w.size(0), words = w.size(1), I = words * 32 / bits;
  const int64_t ldx = x.strides()[0], ldo = out.strides()[0];
  if (N == 0 || M == 0) return;
  const auto* codes = static_cast<const uint32_t*>(w.data());
  const bool mx = mode == ops::kQuantMxfp4;
  const void* bi = mx ? nullptr : biases->data();
  if (N >= kDequantMinRows) {
    Tensor wd = empty({O, I}, x.dtype());  // (O, I) transient, back to the pool when this op returns
    auto deq = mx ? launch_dequantize<4, true>
                  : by_bits(bits, launch_dequantize<2>, launch_dequantize<3>, launch_dequantize<4>,
                            launch_dequantize<5>, launch_dequantize<6>, launch_dequantize<8>);
    deq(stream_, codes, words, scales.dtype(), scales.data(), bi, O, I, group_size, x.dtype(), wd.data());
    check_launch("quantized_matmul");
    GemmArgs g;
    g.A = x, g.B = wd, g.C = out, g.trans_b = transpose, g.beta = beta;
    g.M = N, g.N = M, g.K = K, g.lda = ldx, g.ldb = I, g.ldc = ldo;
    return gemm_untimed(g);
  }
  auto go = mx ? launch<4, true> : by_bits(bits, launch<2>, launch<3>, launch<4>, launch<5>, launch<6>, launch<8>);
  go(transpose, grid_for(N * M), stream_, x.dtype(), x.data(), ldx, codes, scales.dtype(), scales.data(), bi,
     out.data(), ldo, N, M, K, words, group_size, beta);
  check_launch("quantized_matmul");
}

void CudaBackend::quantized_embedding(const Tensor& ids, const Tensor& w, const Tensor& scales, const Tensor& biases,
                                      const Tensor& out, int64_t group_size, int64_t bits) {
  OpTimer timer(this);
  const int64_t V = w.size(0), C = out.size(-1), n = ids.numel();
  if (!capturing())
    ops::check_ids("quantized_embedding", "id", "position", read_i32(ids.data(), n, "quantized_embedding").data(), n, V);
  if (n == 0 || C == 0) return;
  auto go = by_bits(bits, launch_embedding<2>, launch_embedding<3>, launch_embedding<4>, launch_embedding<5>,
                    launch_embedding<6>, launch_embedding<8>);
  go(stream_, ids.ptr<int32_t>(), static_cast<const uint32_t*>(w.data()), w.size(1), scales.dtype(), scales.data(),
     biases.data(), out.dtype(), out.data(), n, C, V, group_size);
  check_launch("quantized_embedding");
}

}  // namespace krnl::cuda
