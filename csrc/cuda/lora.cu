// lora_b_backward in one pass over dy (op_list.h): a LoRA's dB = s dy^T t and dt = s dy B are two
// skinny GEMMs that each stream the whole (rows, out) dy for r columns of output, so as two cuBLAS
// calls they read it twice. Here each block stages 128 x 128 tiles of dy in shared memory once
// (cp.async, three stages) and feeds both products from them on the tensor cores (WMMA, f32
// accumulators):
//
//   block (cb, rb) covers dy's rows [rb Rr, (rb + 1) Rr) and columns [cb Cc, (cb + 1) Cc), column tile
//   by column tile, row tile by row tile within each. Warp w keeps dB's columns 16w.. of the
//   current column tile in registers across the row tiles, and adds dt's rows 16w.. of each row
//   tile into the block's dt accumulator in shared memory (Rr x r f32) across the column tiles.
//
// Each block writes its partial dB (Cc, r) and dt (Rr, r) to a workspace; a second kernel sums the
// partials in a fixed order (deterministic, no atomics), scales, rounds dt to dy's dtype and
// applies beta to gB.
#include <mma.h>

#include <algorithm>

#include "common.cuh"

namespace krnl::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTile = 128;          // dy tile: kTile rows x kTile columns
constexpr int kLds = kTile + 8;     // its shared row stride in elements (no bank conflicts, 32-byte rows)
constexpr int kStages = 3;          // tiles in flight
constexpr int kWarps = kTile / 16;  // warp w: dt rows 16w.., dB columns 16w.. of a tile

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Rr, dy's rows a block covers: dt's shared accumulator (Rr, R) f32 stays within 32 KiB.
template <int R>
__host__ __device__ constexpr int rows_per_block() {
  return R <= 16 ? 4 * kTile : R <= 32 ? 2 * kTile : kTile;
}

template <int R>
constexpr size_t smem_bytes() {
  return size_t(kStages) * kTile * kLds * 2 + size_t(rows_per_block<R>()) * R * 4 +
         size_t(rows_per_block<R>()) * R * 2 + size_t(kTile) * R * 2;
}

// T: __nv_bfloat16 or __half. dt_part (gridDim.x, rows_pad, R) f32 and dB_part (gridDim.y, out_pad,
// R) f32 receive this block's partial sums; Cc (a multiple of kTile) columns per block.
template <class T, int R>
__global__ void __launch_bounds__(kWarps * 32) lora_b_bwd_kernel(const T* __restrict__ dy, int64_t ld_dy,
                                                                  const T* __restrict__ t, int64_t ld_t,
                                                                  const T* __restrict__ B, int64_t rows, int64_t out,
                                                                  int64_t Cc, int64_t rows_pad, int64_t out_pad,
                                                                  float* __restrict__ dt_part,
                                                                  float* __restrict__ dB_part) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // 16-bit WMMA needs sm_80 (fuses_lora_b_backward says no below it)
#else
  constexpr int Rr = rows_per_block<R>(), F = R / 16;
  extern __shared__ __align__(128) unsigned char smem[];
  T* dys = reinterpret_cast<T*>(smem);                                    // (kStages, kTile, kLds)
  float* dts = reinterpret_cast<float*>(dys + kStages * kTile * kLds);    // (Rr, R)
  T* ts = reinterpret_cast<T*>(dts + Rr * R);                             // (Rr, R)
  T* Bs = ts + Rr * R;                                                    // (kTile, R)

  const int tid = threadIdx.x, warp = tid / 32;
  const int64_t r0 = blockIdx.y * int64_t(Rr), c0 = blockIdx.x * Cc;
  const int64_t rlim = min(rows, r0 + Rr), clim = min(out, c0 + Cc);
  const int nI = int((rlim - r0 + kTile - 1) / kTile), nJ = int((clim - c0 + kTile - 1) / kTile), total = nI * nJ;

  // The block's rows of t (zero past the last row) and dt's accumulator.
  for (int i = tid; i < Rr * R; i += blockDim.x) {
    const int64_t row = r0 + i / R;
    ts[i] = row < rlim ? t[row * ld_t + i % R] : T(0.f);
    dts[i] = 0.f;
  }

  auto issue = [&](int n) {  // tile n (column tile n / nI, row tile n % nI) into its stage
    if (n < total) {
      T* s = dys + (n % kStages) * kTile * kLds;
      const int64_t tr = r0 + int64_t(n % nI) * kTile, tc = c0 + int64_t(n / nI) * kTile;
      for (int ch = tid; ch < kTile * kTile / 8; ch += blockDim.x) {
        const int lr = ch / (kTile / 8), lc = (ch % (kTile / 8)) * 8;
        const int64_t gr = tr + lr, gc = tc + lc;
        T* dst = s + lr * kLds + lc;
        if (gr < rlim && gc + 8 <= clim) {
          cp_async16(dst, dy + gr * ld_dy + gc);
        } else {  // the matrix's edge: what lies outside reads as zero
          for (int e = 0; e < 8; ++e) dst[e] = gr < rlim && gc + e < clim ? dy[gr * ld_dy + gc + e] : T(0.f);
        }
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  };
  for (int n = 0; n < kStages - 1; ++n) issue(n);

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> dB[F];
  for (int n = 0; n < total; ++n) {
    const int i = n % nI, j = n / nI;
    if (i == 0) {  // a new column tile: its rows of B; dB's accumulators start again
      __syncthreads();  // every warp is done with the previous B
      const int64_t tc = c0 + int64_t(j) * kTile;
      for (int e = tid; e < kTile * R; e += blockDim.x) {
        const int64_t col = tc + e / R;
        Bs[e] = col < clim ? B[col * R + e % R] : T(0.f);
      }
      for (int f = 0; f < F; ++f) wmma::fill_fragment(dB[f], 0.f);
    }
    cp_async_wait<kStages - 2>();
    __syncthreads();          // tile n landed for every thread; the stage of tile n - 1 is free
    issue(n + kStages - 1);   // into that stage
    const T* s = dys + (n % kStages) * kTile * kLds;

    // dt rows 16 warp.. of row tile i += dy (16, kTile) B_j (kTile, R)
    {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[F];
      float* dacc = dts + (i * kTile + 16 * warp) * R;
      for (int f = 0; f < F; ++f) wmma::load_matrix_sync(acc[f], dacc + 16 * f, R, wmma::mem_row_major);
      for (int k = 0; k < kTile / 16; ++k) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::load_matrix_sync(a, s + 16 * warp * kLds + 16 * k, kLds);
        for (int f = 0; f < F; ++f) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
          wmma::load_matrix_sync(b, Bs + 16 * k * R + 16 * f, R);
          wmma::mma_sync(acc[f], a, b, acc[f]);
        }
      }
      for (int f = 0; f < F; ++f) wmma::store_matrix_sync(dacc + 16 * f, acc[f], R, wmma::mem_row_major);
    }
    // dB columns 16 warp.. of column tile j += dy^T (16, kTile) t_i (kTile, R)
    for (int k = 0; k < kTile / 16; ++k) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;  // dy^T: dy's tile read by columns
      wmma::load_matrix_sync(a, s + 16 * k * kLds + 16 * warp, kLds);
      for (int f = 0; f < F; ++f) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
        wmma::load_matrix_sync(b, ts + (i * kTile + 16 * k) * R + 16 * f, R);
        wmma::mma_sync(dB[f], a, b, dB[f]);
      }
    }
    if (i == nI - 1) {  // column tile j done: this block's partial dB for its columns
      float* dst = dB_part + (blockIdx.y * out_pad + c0 + int64_t(j) * kTile + 16 * warp) * R;
      for (int f = 0; f < F; ++f) wmma::store_matrix_sync(dst + 16 * f, dB[f], R, wmma::mem_row_major);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  float* dst = dt_part + (blockIdx.x * rows_pad + r0) * R;
  for (int e = tid; e < Rr * R; e += blockDim.x) dst[e] = dts[e];
#endif
}

// dt = cvt(scale * sum of the nc partials) (row-strided), then gB = beta gB + scale * sum of the nr
// partials: fixed summation order.
template <class T>
__global__ void lora_b_reduce_kernel(const float* __restrict__ dt_part, int nc, int64_t rows_pad,
                                     const float* __restrict__ dB_part, int nr, int64_t out_pad, int64_t rows,
                                     int64_t out, int R, float scale, float beta, T* dt, int64_t ld_dt, float* gB) {
  const int64_t n_dt = rows * R, total = n_dt + out * R;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    if (e < n_dt) {
      float v = 0.f;
      for (int p = 0; p < nc; ++p) v += dt_part[p * rows_pad * R + e];
      dt[(e / R) * ld_dt + e % R] = T(scale * v);
    } else {
      const int64_t g = e - n_dt;
      float v = 0.f;
      for (int p = 0; p < nr; ++p) v += dB_part[p * out_pad * R + g];
      gB[g] = beta == 0.f ? scale * v : beta * gB[g] + scale * v;
    }
  }
}

template <class T, int R>
void launch(CudaBackend& be, const Tensor& dy, const Tensor& t, const Tensor& B, const Tensor& gB, const Tensor& dt,
            float scale, float beta) {
  constexpr int Rr = rows_per_block<R>();
  const int64_t rows = dy.size(0), out = dy.size(1);
  const int64_t ld_dy = dy.row_stride(), ld_t = t.row_stride(), ld_dt = dt.row_stride();
  // One wave: as many column blocks as leave every SM one block (the shared memory takes a whole SM).
  const int64_t nr = (rows + Rr - 1) / Rr, col_tiles = (out + kTile - 1) / kTile;
  const int64_t nc = std::max<int64_t>(1, std::min<int64_t>(col_tiles, be.sm_count() / nr));
  const int64_t Cc = (col_tiles + nc - 1) / nc * kTile, ncb = (out + Cc - 1) / Cc;
  const int64_t rows_pad = nr * Rr, out_pad = ncb * Cc;
  Tensor ws = be.scratch(ncb * rows_pad * R + nr * out_pad * R);
  float* dt_part = static_cast<float*>(ws.data());
  float* dB_part = dt_part + ncb * rows_pad * R;
  constexpr size_t shm = smem_bytes<R>();
  check(cudaFuncSetAttribute(lora_b_bwd_kernel<T, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shm)),
        "lora_b_backward");
  lora_b_bwd_kernel<T, R><<<dim3(unsigned(ncb), unsigned(nr)), kWarps * 32, shm, be.stream()>>>(
      static_cast<const T*>(dy.data()), ld_dy, static_cast<const T*>(t.data()), ld_t,
      static_cast<const T*>(B.data()), rows, out, Cc, rows_pad, out_pad, dt_part, dB_part);
  check_launch("lora_b_backward");
  lora_b_reduce_kernel<T><<<grid_for((rows + out) * R), kThreads, 0, be.stream()>>>(
      dt_part, int(ncb), rows_pad, dB_part, int(nr), out_pad, rows, out, R, scale, beta,
      static_cast<T*>(dt.data()), ld_dt, static_cast<float*>(gB.data()));
  check_launch("lora_b_backward");
}

template <class T>
void dispatch_rank(CudaBackend& be, const Tensor& dy, const Tensor& t, const Tensor& B, const Tensor& gB,
                   const Tensor& dt, float scale, float beta) {
  switch (B.size(1)) {
    case 16: return launch<T, 16>(be, dy, t, B, gB, dt, scale, beta);
    case 32: return launch<T, 32>(be, dy, t, B, gB, dt, scale, beta);
    case 48: return launch<T, 48>(be, dy, t, B, gB, dt, scale, beta);
    case 64: return launch<T, 64>(be, dy, t, B, gB, dt, scale, beta);
  }
}

}  // namespace

bool CudaBackend::fuses_lora_b_backward(const Tensor& dy, const Tensor& t, const Tensor& dt) const {
  const int64_t r = t.size(1);
  // cp.async moves 16 bytes: dy's rows must start on 16-byte boundaries
  const bool aligned = reinterpret_cast<uintptr_t>(dy.data()) % 16 == 0 && dy.row_stride() % 8 == 0;
  return (dy.dtype() == DType::bf16 || dy.dtype() == DType::f16) && r % 16 == 0 && r >= 16 && r <= 64 && aligned &&
         dy.numel() > 0 && compute_major_ >= 8;
}

void CudaBackend::lora_b_backward(const Tensor& dy, const Tensor& t, const Tensor& B, const Tensor& gB,
                                  const Tensor& dt, float scale, float beta) {
  OpTimer timer(this);
  if (dy.dtype() == DType::bf16) dispatch_rank<__nv_bfloat16>(*this, dy, t, B, gB, dt, scale, beta);
  else dispatch_rank<__half>(*this, dy, t, B, gB, dt, scale, beta);
}

}  // namespace krnl::cuda
