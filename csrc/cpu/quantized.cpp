// quantized_matmul and quantized_embedding on the CPU: W dequantized a tile of rows at a time into
// f32, each tile one sgemm; embedding rows dequantized one by one.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "blas.h"
#include "convert.h"
#include "core/ops.h"
#include "cpu_backend.h"

namespace krnl::cpu {

// ---- quantized matmul: W dequantized a tile of rows at a time into f32, each tile one sgemm

namespace {

// MXFP4's E2M1 code values: bit 3 the sign, bits 0-2 the magnitude
constexpr float kE2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// Code j of a packed row: the row's codes are one bit stream, so a code may straddle two words
// (3, 5, 6 bits).
inline uint32_t code_at(const uint32_t* row, int64_t j, int64_t bits) {
  const int64_t bit = j * bits, wi = bit >> 5, sh = bit & 31;
  uint32_t q = row[wi] >> sh;
  if (sh + bits > 32) q |= row[wi + 1] << (32 - sh);
  return q & ((1u << bits) - 1u);
}

}  // namespace

void CpuBackend::quantized_matmul(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor* biases,
                                  const Tensor& out, bool transpose, int64_t group_size, int64_t bits, float beta,
                                  int64_t mode) {
  const int64_t N = x.size(0), O = w.size(0), words = w.size(1), I = words * 32 / bits, G = I / group_size;
  const int64_t M = transpose ? O : I, K = transpose ? I : O;
  const int64_t ldx = x.strides()[0], ldo = out.strides()[0];  // row strides: x and out may be column blocks
  if (N == 0 || M == 0) return;
  constexpr int64_t kTile = 256;  // rows of W per dequantized tile: (256, I) f32, a few MB at most
  const bool mx = mode == ops::kQuantMxfp4;  // W = s e2m1(q), no biases
  std::vector<float> xf(size_t(N * K)), of(size_t(N * M)), sf(size_t(O * G)), bf(mx ? 0 : size_t(O * G));
  for (int64_t n = 0; n < N; ++n) load_all(x.dtype(), x.data(), n * ldx, K, &xf[size_t(n * K)]);
  load_all(scales.dtype(), scales.data(), 0, O * G, sf.data());
  if (!mx) load_all(biases->dtype(), biases->data(), 0, O * G, bf.data());
  if (beta != 0.f) {
    for (int64_t n = 0; n < N; ++n) load_all(out.dtype(), out.data(), n * ldo, M, &of[size_t(n * M)]);
    for (float& v : of) v *= beta;
  }
  const uint32_t* codes = static_cast<const uint32_t*>(w.data());
  std::vector<float> tile(size_t(std::min(kTile, O) * I));
  for (int64_t o0 = 0; o0 < O; o0 += kTile) {
    const int64_t rows = std::min(kTile, O - o0);
    ThreadPool::global().parallel_for(rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const uint32_t* wr = codes + (o0 + r) * words;
        const float* s = &sf[size_t((o0 + r) * G)];
        float* t = &tile[size_t(r * I)];
        if (mx) {
          for (int64_t j = 0; j < I; ++j) t[j] = s[j / group_size] * kE2M1[code_at(wr, j, 4)];
        } else {
          const float* b = &bf[size_t((o0 + r) * G)];
          for (int64_t j = 0; j < I; ++j) t[j] = s[j / group_size] * float(code_at(wr, j, bits)) + b[j / group_size];
        }
      }
    });
    // M = N token rows: in the sample order's blocks of a sample's rows (gemm_row_block)
    if (transpose)  // out[:, o0:o0+rows] (+)= x (N, I) tile^T
      sgemm_rows(false, true, N, rows, I, 1.f, xf.data(), I, tile.data(), I, beta != 0.f ? 1.f : 0.f,
                 &of[size_t(o0)], O, gemm_row_block());
    else            // out (N, I) += x[:, o0:o0+rows] tile
      sgemm_rows(false, false, N, I, rows, 1.f, &xf[size_t(o0)], O, tile.data(), I,
                 o0 > 0 || beta != 0.f ? 1.f : 0.f, of.data(), I, gemm_row_block());
  }
  for (int64_t n = 0; n < N; ++n) store_all(out.dtype(), &of[size_t(n * M)], M, out.data(), n * ldo);
}

void CpuBackend::quantized_embedding(const Tensor& ids, const Tensor& w, const Tensor& scales, const Tensor& biases,
                                     const Tensor& out, int64_t group_size, int64_t bits) {
  const int64_t V = w.size(0), words = w.size(1), C = words * 32 / bits, G = C / group_size, n = ids.numel();
  ops::check_ids("quantized_embedding", "id", "position", ids.ptr<int32_t>(), n, V);
  const int32_t* id = ids.ptr<int32_t>();
  const uint32_t* codes = static_cast<const uint32_t*>(w.data());
  for_rows(n, C, [&](int64_t t0, int64_t t1) {
    std::vector<float> row(static_cast<size_t>(C)), s(static_cast<size_t>(G)), b(static_cast<size_t>(G));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t v = id[t];
      load_all(scales.dtype(), scales.data(), v * G, G, s.data());
      load_all(biases.dtype(), biases.data(), v * G, G, b.data());
      const uint32_t* wr = codes + v * words;
      for (int64_t j = 0; j < C; ++j)
        row[size_t(j)] = s[size_t(j / group_size)] * float(code_at(wr, j, bits)) + b[size_t(j / group_size)];
      store_all(out.dtype(), row.data(), C, out.data(), t * C);
    }
  });
}

}  // namespace krnl::cpu
