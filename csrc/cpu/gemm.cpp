// GEMM on the CPU through the platform BLAS (blas.h): 16-bit operands converted to f32, split-K
// slices as single-threaded BLAS calls on the pool, batched f32 products one entry per thread, and
// in the sample reduce order blocks of one sample's rows (gemm_blocks).
#include <algorithm>
#include <vector>

#include "blas.h"
#include "convert.h"
#include "core/thread_pool.h"
#include "cpu_backend.h"

namespace krnl::cpu {

// ---- gemm

namespace {

// A (rows, cols) matrix with row stride ld at element offset off of t, as f32: f32 tensors in
// place (ld unchanged), others converted into buf packed (ld becomes cols).
const float* as_f32(const Tensor& t, int64_t off, int64_t rows, int64_t cols, int64_t& ld, std::vector<float>& buf) {
  if (t.dtype() == DType::f32) return t.ptr<float>() + off;
  buf.resize(size_t(rows * cols));
  if (ld == cols) {
    load_all(t.dtype(), t.data(), off, rows * cols, buf.data());
  } else {
    for (int64_t r = 0; r < rows; ++r) load(t.dtype(), t.data(), off + r * ld, cols, buf.data() + r * cols);
  }
  ld = cols;
  return buf.data();
}

// C = sum_s alpha * op(A)[:, slice s] * op(B)[slice s, :] + beta * C, all f32, C (M, N) with
// row stride ldc.
// Slices run as single-threaded BLAS calls on the pool, at most one wave of pool-size slices
// at a time (bounded partial memory); partials are summed in slice order, so the result does
// not depend on the thread count.
void gemm_split_k(const GemmArgs& g, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc) {
  ThreadPool& pool = ThreadPool::global();
  const int64_t M = g.M, N = g.N, S = g.split_k, kp = g.K / S, MN = M * N;
  const int64_t W = blas_fan_out() ? std::min<int64_t>(S, pool.size()) : 1;
  std::vector<float> part(size_t(W * MN)), acc(S > W ? size_t(MN) : 0);
  BlasSingleThread one_thread(pool.size() > 1);
  for (int64_t s0 = 0; s0 < S; s0 += W) {
    const int64_t ns = std::min(W, S - s0);
    pool.parallel_for(ns, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        BlasSingleThreadHere here;
        const int64_t k0 = (s0 + i) * kp;
        const float* a = g.trans_a ? A + k0 * lda : A + k0;  // stored (K, M) or (M, K)
        const float* bm = g.trans_b ? B + k0 : B + k0 * ldb;  // stored (N, K) or (K, N)
        sgemm(g.trans_a, g.trans_b, M, N, kp, g.alpha, a, lda, bm, ldb, 0.f, part.data() + i * MN, N);
      }
    });
    const bool first = s0 == 0, last = s0 + ns == S;
    for_blocks(MN, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        float v = first ? part[size_t(j)] : acc[size_t(j)] + part[size_t(j)];
        for (int64_t i = 1; i < ns; ++i) v += part[size_t(i * MN + j)];
        if (!last) {
          acc[size_t(j)] = v;
        } else {
          float& c = C[(j / N) * ldc + j % N];
          c = g.beta == 0.f ? v : v + g.beta * c;  // beta == 0 never reads C (BLAS rule)
        }
      }
    });
  }
}

// One batch entry of a GEMM as f32 operands (row strides as stored).
struct Entry {
  const float* A;
  int64_t lda;
  const float* B;
  int64_t ldb;
  float* C;
  int64_t ldc;
};

// Columns of the sample order's output chunks: fixed, never the thread count's choice, so that a
// few samples' blocks still spread over the pool where N is wide. Each chunk repacks its block's
// rows: 256-column chunks made 128-row blocks ~10% slower than unchunked ones (measured).
constexpr int64_t kColChunk = 2048;

// The sample order's GEMM (Backend::gemm_row_block() = rows > 0): each entry's C in blocks of
// `rows` rows (one block of M where M is not a multiple of it) and kColChunk columns, each block
// one single-threaded BLAS call on the pool. OpenBLAS picks its kernels by a call's shape (the
// SkylakeX small-matrix kernels below about 1,200 outputs, edge tiles) and its threads split M
// and N, so in one call over all rows a row's bits depend on how many rows share the call. Here
// they depend on its block's rows alone, whatever M and the thread count: a rank holding half
// the samples computes their rows as one process holding all of them does.
void gemm_blocks(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, float beta,
                 const std::vector<Entry>& entries, int64_t rows) {
  const int64_t rb = M % rows == 0 ? rows : M, nc = (N + kColChunk - 1) / kColChunk, per = M / rb * nc;
  auto block = [&](int64_t i) {
    const Entry& e = entries[size_t(i / per)];
    const int64_t r0 = i % per / nc * rb, c0 = i % nc * kColChunk, n = std::min(kColChunk, N - c0);
    const float* a = ta ? e.A + r0 : e.A + r0 * e.lda;  // stored (K, M) or (M, K)
    const float* b = tb ? e.B + c0 * e.ldb : e.B + c0;  // stored (N, K) or (K, N)
    sgemm(ta, tb, rb, n, K, alpha, a, e.lda, b, e.ldb, beta, e.C + r0 * e.ldc + c0, e.ldc);
  };
  const int64_t total = int64_t(entries.size()) * per;
  if (!blas_fan_out()) {  // each Accelerate call threads itself (blas.h): one at a time
    for (int64_t i = 0; i < total; ++i) block(i);
    return;
  }
  BlasSingleThread one_thread;  // also with one pool thread: OpenBLAS's threads would split the block
  ThreadPool::global().parallel_for(total, 1, [&](int64_t b, int64_t e) {
    BlasSingleThreadHere here;
    for (int64_t i = b; i < e; ++i) block(i);
  });
}

// C = beta * C for K == 0 (an empty sum); beta == 0 writes zeros without reading C.
void scale_output(const Tensor& C, int64_t off, int64_t n, float beta) {
  const DType dt = C.dtype();
  for_blocks(n, [&](int64_t b, int64_t e) {
    float buf[kBlock];
    float* c = inout(dt, C.data(), off + b, beta == 0.f ? 0 : e - b, buf);
    for (int64_t i = 0; i < e - b; ++i) c[i] = beta == 0.f ? 0.f : beta * c[i];
    flush(dt, c, e - b, C.data(), off + b);
  });
}

}  // namespace

void sgemm_rows(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                const float* B, int64_t ldb, float beta, float* C, int64_t ldc, int64_t rows) {
  if (rows > 0)
    gemm_blocks(ta, tb, M, N, K, alpha, beta, {{A, lda, B, ldb, C, ldc}}, rows);
  else
    sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void CpuBackend::gemm(const GemmArgs& g) {
  const int64_t M = g.M, N = g.N, K = g.K;
  if (M == 0 || N == 0) return;
  const DType cdt = g.C.dtype();
  if (K == 0) {
    for (int64_t b = 0; b < g.batch; ++b)
      for (int64_t r = 0; r < M; ++r) scale_output(g.C, b * g.stride_c + r * g.ldc, N, g.beta);
    return;
  }
  // Stored shapes: A is (M, K) or (K, M), B is (K, N) or (N, K), each with its row stride.
  const int64_t a_rows = g.trans_a ? K : M, a_cols = g.trans_a ? M : K;
  const int64_t b_rows = g.trans_b ? N : K, b_cols = g.trans_b ? K : N;
  // The sample order: every entry's blocks on the pool at once (16-bit operands: below, per entry).
  const int64_t rows = gemm_row_block();
  const bool all_f32 = g.A.dtype() == DType::f32 && g.B.dtype() == DType::f32 && cdt == DType::f32;
  if (rows > 0 && g.split_k == 1 && all_f32) {
    std::vector<Entry> entries;
    for (int64_t b = 0; b < g.batch; ++b)
      entries.push_back({g.A.ptr<float>() + b * g.stride_a, g.lda, g.B.ptr<float>() + b * g.stride_b, g.ldb,
                         g.C.ptr<float>() + b * g.stride_c, g.ldc});
    gemm_blocks(g.trans_a, g.trans_b, M, N, K, g.alpha, g.beta, entries, rows);
    return;
  }
  // Batched all-f32 products (the attention heads): one single-threaded BLAS call per entry on
  // the pool. OpenBLAS's own threading of each small attention product pays a fork/join per
  // call; whole entries per thread do not (16 heads of 128-512 rows, 2 cores: ~100-114 vs
  // ~76-106 GFLOP/s, measured).
  ThreadPool& pool = ThreadPool::global();
  if (blas_fan_out() && g.batch >= pool.size() && pool.size() > 1 && g.split_k == 1 && all_f32) {
    const float* A0 = g.A.ptr<float>();
    const float* B0 = g.B.ptr<float>();
    float* C0 = g.C.ptr<float>();
    BlasSingleThread one_thread;
    pool.parallel_for(g.batch, 1, [&](int64_t b0, int64_t b1) {
      BlasSingleThreadHere here;
      for (int64_t b = b0; b < b1; ++b)
        sgemm(g.trans_a, g.trans_b, M, N, K, g.alpha, A0 + b * g.stride_a, g.lda, B0 + b * g.stride_b, g.ldb, g.beta,
              C0 + b * g.stride_c, g.ldc);
    });
    return;
  }
  std::vector<float> abuf, bbuf, cbuf;
  const float* Af = nullptr;
  const float* Bf = nullptr;
  int64_t lda = g.lda, ldb = g.ldb;
  for (int64_t b = 0; b < g.batch; ++b) {
    // A broadcast operand (stride 0) is converted once.
    if (b == 0 || g.stride_a != 0) lda = g.lda, Af = as_f32(g.A, b * g.stride_a, a_rows, a_cols, lda, abuf);
    if (b == 0 || g.stride_b != 0) ldb = g.ldb, Bf = as_f32(g.B, b * g.stride_b, b_rows, b_cols, ldb, bbuf);
    float* Cf;
    int64_t ldc = g.ldc;
    const int64_t c_off = b * g.stride_c;
    if (cdt == DType::f32) {
      Cf = g.C.ptr<float>() + c_off;
    } else {
      cbuf.resize(size_t(M * N));
      Cf = cbuf.data();
      ldc = N;
      if (g.beta != 0.f)
        for (int64_t r = 0; r < M; ++r) load(cdt, g.C.data(), c_off + r * g.ldc, N, Cf + r * N);
    }
    if (g.split_k > 1)
      gemm_split_k(g, Af, lda, Bf, ldb, Cf, ldc);
    else if (rows > 0)
      gemm_blocks(g.trans_a, g.trans_b, M, N, K, g.alpha, g.beta, {{Af, lda, Bf, ldb, Cf, ldc}}, rows);
    else
      sgemm(g.trans_a, g.trans_b, M, N, K, g.alpha, Af, lda, Bf, ldb, g.beta, Cf, ldc);
    if (cdt != DType::f32) {
      if (g.ldc == N)
        store_all(cdt, Cf, M * N, g.C.data(), c_off);
      else
        for (int64_t r = 0; r < M; ++r) store(cdt, Cf + r * N, N, g.C.data(), c_off + r * g.ldc);
    }
  }
}

}  // namespace krnl::cpu
